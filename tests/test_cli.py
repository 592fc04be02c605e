"""The cupy-comba CLI through click's CliRunner; on a machine without a GPU it runs the NumPy backend."""

import json

import pytest
from click.testing import CliRunner

from cupy_comba import gpu_available
from cupy_comba.bench import OPS
from cupy_comba.cli import main

TINY = ["--shapes", "4,2,64,64", "--iters", "2", "--warmup", "1"]


@pytest.fixture
def runner():
    return CliRunner()


def test_help_lists_commands(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("bench", "check", "info", "roofline"):
        assert cmd in result.output


def test_info(runner):
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "cupy_comba 0.1.0" in result.output
    assert "comba::delta_rule_kv<128, 64, 8, true, false>" in result.output or "CuPy: not installed" in result.output


def test_bench_json_schema(runner, tmp_path):
    path = tmp_path / "bench.json"
    result = runner.invoke(main, ["bench", "comba_decode_step", *TINY, "--json", str(path)])
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert report["schema"] == "cupy-comba-bench/1"
    assert report["environment"]["backend"] == ("cuda" if gpu_available() else "numpy")
    assert {"date", "numpy", "cupy", "python"} <= set(report["environment"])
    assert report["roofline"]["copy_gbps"] > 0
    (row,) = report["results"]
    assert row["shape"] == {"B": 4, "H": 2, "K": 64, "V": 64}
    assert row["ok"] and row["errors"]["state"] < 1e-6 and row["errors"]["o"] < 8e-3
    for key in ("us_median", "us_min", "us_max", "gbps", "fraction_of_copy", "bytes"):
        assert row[key] > 0
    assert row["us_min"] <= row["us_median"] <= row["us_max"]
    assert "comba_decode_step" in result.output and "x copy" in result.output
    if not gpu_available():
        assert "NumPy backend" in result.output


def test_bench_default_is_every_op(runner):
    result = runner.invoke(main, ["bench", *TINY, "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert "float32" in result.output


@pytest.mark.parametrize("args,message", [
    (["bench", "no_such_op"], "unknown op 'no_such_op'"),
    (["bench", "--shapes", "1,2,3"], "neither a preset"),
    (["bench", "--shapes", "a,b,c,d"], "neither a preset"),
    (["bench", "--shapes", "2,2,0,64"], "positive integers"),
    (["bench", "--dtype", "int8"], "unknown dtype"),
    (["bench", "--shapes", "2,2,96,64"], "K=96 is not supported"),
    (["bench", "--iters", "0"], "0"),
], ids=["op", "shape-len", "shape-text", "shape-zero", "dtype", "head-size", "iters"])
def test_bad_arguments_are_clean_errors(runner, args, message):
    result = runner.invoke(main, args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output
    assert not isinstance(result.exception, (AssertionError, KeyError, AttributeError))


def test_check(runner):
    result = runner.invoke(main, ["check"])
    assert result.exit_code == 0, result.output
    assert "checks passed" in result.output


def test_roofline(runner, tmp_path):
    path = tmp_path / "roof.json"
    result = runner.invoke(main, ["roofline", "--size", "64", "--iters", "2", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text())["roofline"]["copy_gbps"] > 0


def test_plot_without_matplotlib_says_so(runner, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = runner.invoke(main, ["bench", *TINY, "--plot", str(tmp_path / "x.png")])
    assert result.exit_code != 0
    assert "needs matplotlib" in result.output


def test_bad_device(runner):
    result = runner.invoke(main, ["info", "--device", "99"])
    assert result.exit_code != 0
    assert "device" in result.output.lower()


@pytest.mark.gpu
def test_bench_quick_on_the_gpu_gives_sane_numbers(runner, tmp_path):
    path = tmp_path / "quick.json"
    result = runner.invoke(main, ["bench", "--shapes", "quick", "--iters", "5", "--json", str(path)])
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert report["environment"]["backend"] == "cuda" and report["environment"]["gpu"]
    assert len(report["results"]) == 3 * len(OPS)
    for row in report["results"]:
        assert row["ok"]
        assert 0.0 < row["fraction_of_copy"] <= 1.05
        assert row["errors"]["state"] < 1e-6 and row["errors"]["o"] < 4e-3
        assert row["host_us"] > 0 and row["us_eager"] > 0
