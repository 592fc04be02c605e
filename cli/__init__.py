"""``cupy-comba``: measure how close the kernels run to this GPU's memory roofline.

A thin click layer over :mod:`cupy_comba.bench`; every figure it prints can be
produced from Python with the same functions.
"""

import json
import os
import sys

import click

from cupy_comba import bench as bench_lib
from cupy_comba._backend import gpu_available
from cupy_comba._dtypes import parse_dtype

from .report import NO_GPU_NOTE, info_lines, plot_fractions, results_table, roofline_lines, selftest_table


def _use_device(device):
    if device is None:
        return
    if not gpu_available():
        raise click.UsageError("--device needs a CUDA device; none is visible")
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= device < count:
        raise click.BadParameter(f"device {device} does not exist (this machine has {count})", param_hint="--device")
    cupy.cuda.Device(device).use()


def _note_fallback():
    if not gpu_available():
        click.echo(NO_GPU_NOTE, err=True)


def _check_writable(path, option):
    """A file the run will write at its end: checked before any work (exit 2)."""
    if path is None:
        return
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise click.BadParameter(f"{path} is a directory", param_hint=option)
    if not os.path.isdir(folder):
        raise click.BadParameter(f"folder {folder} does not exist", param_hint=option)
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise click.BadParameter(f"{path} is not writable", param_hint=option)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cupy_comba", message="cupy-comba %(version)s")
def main():
    """Fused Comba / Gated DeltaNet kernels: roofline, benchmarks and self-test."""


@main.command()
@click.option("--device", type=int, default=None, help="CUDA device ordinal.")
def info(device):
    """GPU, driver, library versions, kernel cache and compiled specialisations."""
    _use_device(device)
    for line in info_lines():
        click.echo(line)


@main.command()
@click.option("--size", "size_mib", type=click.IntRange(min=64), default=None,
              help="Copy buffer in MiB (default: 8x L2, at least 1 GiB).")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--device", type=int, default=None, help="CUDA device ordinal.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the figures, with the GPU, driver and versions, to this file.")
def roofline(size_mib, iters, device, json_path):
    """Measure device-to-device copy bandwidth (bytes read + written) against the DRAM peak."""
    _use_device(device)
    _check_writable(json_path, "--json")
    _note_fallback()
    nbytes = None if size_mib is None else size_mib << 20
    roof = (bench_lib.measure_copy(nbytes, iters=iters) if gpu_available()
            else bench_lib.measure_copy_cpu(nbytes or 256 << 20, iters=min(iters, 5)))
    for line in roofline_lines(roof):
        click.echo(line)
    if json_path:
        _write_json(json_path, {"environment": bench_lib.environment(), "roofline": roof.as_dict()})


@main.command(name="bench")
@click.argument("ops", nargs=-1)
@click.option("--shapes", "shape_specs", multiple=True,
              help="Preset (" + ", ".join(bench_lib.SHAPES) + "), B,H,K,V (decode steps) or B,T,H,K,V (forward "
                   "passes); repeatable. Default: regime on a GPU, tiny on the NumPy fallback.")
@click.option("--dtype", default="bf16", show_default=True, help="Activation dtype: bf16, fp16 or fp32.")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("--device", type=int, default=None, help="CUDA device ordinal.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every figure, with the GPU, driver and versions, to this file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw fraction of copy per shape to this PNG (needs matplotlib).")
def bench_cmd(ops, shape_specs, dtype, iters, warmup, device, json_path, plot_path):
    """Check each op against the float64 reference, then time it against the copy roofline.

    OPS defaults to every registered op (decode steps and forward passes); each runs the shapes
    of its kind.
    """
    _use_device(device)
    unknown = [o for o in ops if o not in bench_lib.OPS]
    if unknown:
        raise click.BadParameter(f"unknown op {unknown[0]!r}; known: {', '.join(bench_lib.OPS)}", param_hint="OPS")
    try:
        act_dtype = parse_dtype(dtype)
    except TypeError as err:
        raise click.BadParameter(str(err), param_hint="--dtype") from None
    specs = shape_specs or (("regime",) if gpu_available() else ("tiny",))
    op_names = list(ops) or list(bench_lib.OPS)
    try:
        plan = bench_lib.shapes_for_ops(op_names, specs, every_op_needs_shapes=bool(ops))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--shapes") from None
    _check_writable(json_path, "--json")
    _check_writable(plot_path, "--plot")
    if plot_path:
        _require_matplotlib()
    _note_fallback()
    if not gpu_available():
        seconds = bench_lib.estimate_cpu_seconds(plan, iters=iters)
        click.echo(f"NumPy backend: these shapes take about {seconds:.0f} s on this CPU", err=True)
    total = sum(len(shapes) for shapes in plan.values())
    with click.progressbar(length=total, label="benchmarking", file=sys.stderr,
                           item_show_func=lambda s: s) as bar:
        def progress(label):
            bar.update(1, label)

        try:
            report = bench_lib.bench(plan, dtype=act_dtype, iters=iters, warmup=warmup, progress=progress)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise click.ClickException(str(err)) from None
    click.echo(results_table(report))
    if json_path:
        _write_json(json_path, report)
        click.echo(f"wrote {json_path}")
    if plot_path:
        plot_fractions(report, plot_path)
        click.echo(f"wrote {plot_path}")
    failed = [r for r in report["results"] if not r["ok"]]
    if failed:
        raise click.ClickException(f"{len(failed)} case(s) failed the reference check; they were not timed")


@main.command()
@click.option("--device", type=int, default=None, help="CUDA device ordinal.")
def check(device):
    """Self-test every op and specialisation on this GPU against the float64 reference."""
    _use_device(device)
    _note_fallback()
    results = bench_lib.selftest()
    click.echo(selftest_table(results))
    bad = [r for r in results if not r["ok"]]
    if bad:
        raise click.ClickException(f"{len(bad)} of {len(results)} checks failed")
    click.echo(f"all {len(results)} checks passed")


@main.command()
@click.option("--device", type=int, default=None, help="CUDA device ordinal.")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Compiles at once (default: the CPU count, at most 8).")
def precompile(device, jobs):
    """Compile every kernel specialisation for this GPU into CuPy's kernel cache (for container images)."""
    if not gpu_available():
        raise click.UsageError("precompile needs a CUDA device; none is visible")
    _use_device(device)
    import cupy

    from cupy_comba import _build, families

    device_id = cupy.cuda.Device().id
    items = [(source, e) for source, exprs in families.specialisations().items() for e in exprs]
    with click.progressbar(length=len(items), label=f"compiling for GPU {device_id}", file=sys.stderr,
                           item_show_func=lambda s: s) as bar:
        _build.precompile(items, device_id, jobs=jobs, progress=lambda source, e: bar.update(1, e))
    click.echo(f"{len(items)} specialisations compiled into {_build.cache_dir()}")


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.UsageError("--plot needs matplotlib: pip install 'cupy_comba[plot]'") from None
