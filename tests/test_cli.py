"""The cupy-comba CLI through click's CliRunner; on a machine without a GPU it runs the NumPy backend."""

import json

import numpy
import pytest
from click.testing import CliRunner

from cupy_comba import bfloat16, gpu_available
from cupy_comba.bench import OPS, registry
from cupy_comba.cli import main

TINY = ["--shapes", "4,2,64,64", "--shapes", "2,3,2,64,64", "--iters", "2", "--warmup", "1"]
DECODE_TINY = ["--shapes", "4,2,64,64", "--iters", "2", "--warmup", "1"]


@pytest.fixture
def runner():
    return CliRunner()


def test_help_lists_commands(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("bench", "check", "info", "precompile", "roofline"):
        assert cmd in result.output


def test_info(runner):
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "cupy_comba 0.1.0"
    assert max(map(len, lines)) < 120  # one fact a line
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "CuPy       not installed (NumPy backend only)" in lines
        return
    counts = {line.split()[0]: int(line.split()[1]) for line in lines if line.startswith("  ")}
    assert counts == {"token_loop.cu": 464, "chunked.cu": 24, "delta_rule_mma.cu": 72, "prefill.cu": 246,
                      "prefill_wgmma.cu": 36, "prefill_transposed.cu": 78, "copy.cu": 1}


def test_info_lists_the_loaded_kernels_one_a_line(runner, monkeypatch):
    """A process that ran many shapes holds hundreds of specialisations: each gets its own line."""
    from cupy_comba import _build
    loaded = [("prefill.cu", f"comba::prefill_scan<128, 16, false, false, {i}, false>", 0) for i in range(300)]
    monkeypatch.setattr(_build, "loaded", lambda: loaded)
    lines = runner.invoke(main, ["info"]).output.splitlines()
    assert max(map(len, lines)) < 120
    at = lines.index("loaded in this process (300):")
    assert lines[at + 1:at + 301] == [f"- {e}" for _, e, _ in loaded]


def test_bench_json_schema(runner, tmp_path):
    path = tmp_path / "bench.json"
    result = runner.invoke(main, ["bench", "comba_decode_step", *DECODE_TINY, "--json", str(path)])
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


def test_bench_default_is_every_op(runner, tmp_path):
    path = tmp_path / "all.json"
    result = runner.invoke(main, ["bench", *TINY, "--dtype", "fp32", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())["results"]
    assert sorted(r["op"] for r in rows) == sorted(OPS)  # each op once: its one shape of the two
    for r in rows:
        assert r["ok"] and r["dtype"] == "float32" and r["errors"]["state"] < 1e-6, r
        assert len(r["shape"]) == (5 if "forward" in r["op"] else 4)
        assert f"{r['op']} " in result.output


def test_bench_forward_pass(runner, tmp_path):
    path = tmp_path / "fwd.json"
    result = runner.invoke(main, ["bench", "gated_delta_forward[vk]", "--shapes", "2,5,2,128,64", "--iters", "1",
                                  "--json", str(path)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(path.read_text())["results"]
    assert row["shape"] == {"B": 2, "T": 5, "H": 2, "K": 128, "V": 64} and row["ok"]
    assert row["bytes"] == 2 * 2 * (2 * 128 * 64 * 4 + 5 * (2 * 128 * 2 + 2 * 64 * 2 + 2 + 4))


def test_the_check_gates_half_products_where_the_prefill_kernels_run():
    """16-bit forward passes on the prefill kernels are held to their half-precision state error;
    every other case, and fp32 activations, to fp32's."""
    gdn = OPS["gated_delta_forward"]
    long_bf16 = gdn.prepare((1, 256, 2, 64, 64), bfloat16, numpy, variant="kv16c64")
    short_bf16 = gdn.prepare((1, 16, 2, 64, 64), bfloat16, numpy, variant="kv64x8")
    long_fp32 = gdn.prepare((1, 256, 2, 64, 64), numpy.float32, numpy, variant="kv16c64")
    assert long_bf16.tolerances["state"] == registry.HALF_PRODUCTS_STATE_TOLERANCE
    assert short_bf16.tolerances["state"] == long_fp32.tolerances["state"] == registry.STATE_TOLERANCE


@pytest.mark.parametrize("args,message", [
    (["bench", "no_such_op"], "unknown op 'no_such_op'"),
    (["bench", "--shapes", "1,2,3"], "neither a preset"),
    (["bench", "--shapes", "a,b,c,d"], "neither a preset"),
    (["bench", "--shapes", "2,2,0,64"], "positive integers"),
    (["bench", "--dtype", "int8"], "unknown dtype"),
    (["bench", "--shapes", "2,2,96,64"], "K=96 is not supported"),
    (["bench", "--shapes", "4,4,96,128", "--shapes", "4,4,128,128"], "K=96 is not supported"),
    (["bench", "--shapes", "4,4,128,100"], "V=100 must be a multiple of 32"),
    (["bench", "--shapes", "100000,100000,128,128"], "GiB"),
    (["bench", "--shapes", "99999999999999999999,1,64,64"], "has a dimension above"),
    (["bench", "comba_forward", "comba_decode_step", "--shapes", "4,4,128,128"], "comba_forward takes B,T,H,K,V"),
    (["bench", "comba_decode_step", "--shapes", "2,3,4,128,128"], "none of the selected ops takes 5"),
    (["bench", *DECODE_TINY, "--json", "/no/such/folder/x.json"], "does not exist"),
    (["bench", *DECODE_TINY, "--plot", "/"], "is a directory"),
    (["roofline", "--json", "/no/such/folder/x.json"], "does not exist"),
    (["bench", "--iters", "0"], "0"),
], ids=["op", "shape-len", "shape-text", "shape-zero", "dtype", "head-size", "head-size-second", "V",
        "memory", "huge-int", "forward-needs-T", "no-op-takes-it", "json-folder", "plot-folder", "roofline-json", "iters"])
def test_bad_arguments_are_clean_errors(runner, args, message):
    result = runner.invoke(main, args)
    assert result.exit_code == 2, result.output  # a usage error, before any work
    assert message in result.output
    assert "benchmarking" not in result.output and "copy" not in result.output.lower().replace("copy.cu", "")
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
    result = runner.invoke(main, ["bench", *DECODE_TINY, "--plot", str(tmp_path / "x.png")])
    assert result.exit_code != 0
    assert "needs matplotlib" in result.output


def test_numpy_backend_says_how_long_it_takes(runner):
    if gpu_available():
        pytest.skip("the estimate is printed on the NumPy backend only")
    result = runner.invoke(main, ["bench", *DECODE_TINY])
    assert result.exit_code == 0, result.output
    assert "NumPy backend: these shapes take about" in result.output
    header = next(line for line in result.output.splitlines() if line.lstrip().startswith("op "))
    assert header.split() == ["op", "shape", "dtype", "us", "x", "copy", "rel.", "error", "check"]  # no kernel figures


def test_precompile_needs_a_gpu(runner):
    if gpu_available():
        pytest.skip("this machine has a GPU")
    result = runner.invoke(main, ["precompile"])
    assert result.exit_code == 2 and "needs a CUDA device" in result.output


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
    assert len(report["results"]) == 3 * len(OPS) // 2 + 2 * len(OPS) // 2  # 3 decode, 2 forward shapes
    for row in report["results"]:
        assert row["ok"]
        assert 0.0 < row["fraction_of_copy"] <= 1.05
        s = row["shape"]
        half = "T" in s and registry.half_products(OPS[row["op"]].layout, "comba" in row["op"],
                                                   tuple(s[d] for d in registry.FORWARD_DIMS), bfloat16)
        assert row["errors"]["state"] < (registry.HALF_PRODUCTS_STATE_TOLERANCE if half else 1e-6)
        assert row["errors"]["o"] < 4e-3
        assert row["host_us"] > 0 and row["us_eager"] > 0
