"""Text tables, info lines and the optional plot printed by the CLI."""

import platform

import numpy

from cupy_comba import __version__, families
from cupy_comba._backend import cupy, gpu_available
from cupy_comba import _build

NO_GPU_NOTE = ("note: no CUDA device found -- running the NumPy backend (float64 reference on the CPU); "
               "timings are CPU timings, not kernel timings")


def _table(headers, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = "  ".join("{:>%d}" % w for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def _num(x, spec):
    return "-" if x is None else format(x, spec)


def results_table(report):
    roof = report["roofline"]
    env = report["environment"]
    gpu = env["backend"] == "cuda"
    where = env.get("gpu", "CPU (NumPy backend)")
    if gpu:
        head = (f"{where}: copy {roof['copy_gbps']:.0f} GB/s (memcpy {roof['memcpy_gbps']:.0f}, kernel "
                f"{roof['kernel_gbps']:.0f}" + (f", DRAM peak {roof['peak_gbps']:.0f}" if roof.get("peak_gbps") else "")
                + ")")
    else:
        head = f"{where}: host memory copy {roof['copy_gbps']:.1f} GB/s; times are the float64 reference's"
    rows = []
    for r in report["results"]:
        shape = ",".join(str(v) for v in r["shape"].values())
        dims = ",".join(r["shape"])
        errs = " ".join(f"{k}={v:.1e}" for k, v in r["errors"].items())
        row = [r["op"], f"{dims}={shape}", r["dtype"], _num(r.get("us_median"), ".1f")]
        if gpu:
            row += [_num(r.get("us_min"), ".1f"), _num(r.get("us_max"), ".1f"), _num(r.get("us_eager"), ".1f"),
                    _num(r.get("host_us"), ".1f"), _num(r.get("gbps"), ".0f")]
        row += [_num(r.get("fraction_of_copy"), ".3f"), errs, "ok" if r["ok"] else "FAIL"]
        rows.append(row)
    headers = ["op", "shape", "dtype", "us"]
    if gpu:
        headers += ["min", "max", "eager us", "host us", "GB/s"]
    headers += ["x copy", "rel. error", "check"]
    return head + "\n" + _table(headers, rows)


def selftest_table(results):
    rows = [[r["op"], "default" if r["variant"] is None else r["variant"], ",".join(map(str, r["shape"])),
             r["dtype"], " ".join(f"{k}={v:.1e}" for k, v in r["errors"].items()), "ok" if r["ok"] else "FAIL"]
            for r in results]
    return _table(["op", "variant", "shape", "dtype", "rel. error", "check"], rows)


def roofline_lines(roof):
    if roof.backend == "numpy":
        yield f"host memory copy (NumPy): {roof.copy_gbps:.1f} GB/s over {roof.buffer_bytes >> 20} MiB"
        return
    yield f"buffer: {roof.buffer_bytes / 2**30:.2f} GiB (bytes read + written counted)"
    yield f"cudaMemcpyAsync D2D : {roof.memcpy_gbps:8.0f} GB/s"
    yield f"float4 copy kernel  : {roof.kernel_gbps:8.0f} GB/s"
    if roof.peak_gbps:
        share = roof.copy_gbps / roof.peak_gbps
        yield f"DRAM peak (clock x bus width): {roof.peak_gbps:.0f} GB/s; the copy reaches {share:.1%} of it"


def info_lines():
    """What ``cupy-comba info`` prints: versions, the GPUs, and the kernel specialisations."""
    import ml_dtypes

    yield f"cupy_comba {__version__}"
    yield f"Python     {platform.python_version()}, NumPy {numpy.__version__}, ml_dtypes {ml_dtypes.__version__}"
    if cupy is None:
        yield "CuPy       not installed (NumPy backend only)"
        return
    yield f"CuPy       {cupy.__version__}"
    try:
        from cupy_backends.cuda.libs import nvrtc
        yield "NVRTC      {}.{}".format(*nvrtc.getVersion())
    except Exception as err:  # NVRTC missing: kernels cannot be built
        yield f"NVRTC      not available ({err})"
    yield f"cache      {_build.cache_dir()}"
    arch = None
    if gpu_available():
        rt = cupy.cuda.runtime
        yield f"CUDA       driver {rt.driverGetVersion()}, runtime {rt.runtimeGetVersion()}"
        for i in range(rt.getDeviceCount()):
            props = rt.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            yield (f"GPU {i}      {name}, sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs, "
                   f"{props['totalGlobalMem'] / 2**30:.0f} GiB, L2 {props['l2CacheSize'] >> 20} MiB")
        arch = "sm_" + cupy.cuda.Device().compute_capability
    else:
        yield "GPU        none visible (NumPy backend)"
    yield ""
    specs = families.specialisations()
    where = f"compiled: for {arch} in this cache" if arch else "no GPU, so none is compiled for one"
    yield f"kernel specialisations ({where}; `cupy-comba precompile` builds them all):"
    width = max(map(len, specs))
    for source, expressions in specs.items():
        built = sum(_build.is_built(source, e, arch) for e in expressions) if arch else None
        count = f"{len(expressions):3d}" + ("" if built is None else f", {built:3d} compiled")
        yield f"  {source:<{width}} {count}"
    loaded = _build.loaded()
    if loaded:  # one a line: a process that ran many shapes holds hundreds
        yield f"loaded in this process ({len(loaded)}):"
        for _, e, _ in loaded:
            yield f"- {e}"


def plot_fractions(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r.get("fraction_of_copy") is not None]
    labels = [f"{r['op']}\n" + ",".join(str(v) for v in r["shape"].values()) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    ax.bar(range(len(rows)), [r["fraction_of_copy"] for r in rows], color="#3b7dd8")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("fraction of device copy")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"{report['environment'].get('gpu', 'CPU')}: copy {report['roofline']['copy_gbps']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
