"""Benchmark and self-test drivers behind ``cupy-comba bench`` and ``cupy-comba check``.

Every timed case is first checked against the float64 reference at full size
(on the GPU when there is one); a case that fails its check is reported and
makes the run fail, and is never timed.
"""

import datetime
import platform

import numpy

from .._backend import cupy, gpu_available
from .._dtypes import bfloat16, dtype_name
from .registry import OPS
from .roofline import measure_copy, measure_copy_cpu
from .timing import host_overhead, time_cpu, time_eager, time_graph

#: The spec's measure shapes, plus two small decode batches (B*H = 128 and 1024).
SHAPES = {
    "measure": [(896, 16, 128, 128), (448, 32, 128, 128), (1792, 8, 128, 128), (1280, 16, 64, 128),
                (640, 24, 128, 128)],
    "small-batch": [(8, 16, 128, 128), (64, 16, 128, 128)],
    "quick": [(256, 16, 128, 128), (128, 32, 128, 128), (512, 16, 64, 128)],
    "tiny": [(8, 4, 128, 128), (16, 2, 64, 128), (4, 8, 128, 64), (32, 4, 64, 64)],
}
SHAPES["regime"] = SHAPES["measure"] + SHAPES["small-batch"]


def parse_shapes(specs, dims=("B", "H", "K", "V")):
    """Shapes from preset names (``regime``, ``quick``, ...) and ``B,H,K,V`` strings."""
    shapes = []
    for spec in specs:
        if spec in SHAPES:
            shapes.extend(SHAPES[spec])
            continue
        parts = spec.replace("x", ",").split(",")
        try:
            shape = tuple(int(x) for x in parts)
        except ValueError:
            shape = ()
        if len(shape) != len(dims) or min(shape) < 1:
            raise ValueError(f"shape {spec!r} is neither a preset ({', '.join(SHAPES)}) nor "
                             f"{len(dims)} positive integers {','.join(dims)}")
        shapes.append(shape)
    return shapes


def environment():
    """What the numbers were measured on."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "cupy": getattr(cupy, "__version__", None),
        "backend": "cuda" if gpu_available() else "numpy",
    }
    if env["backend"] == "cuda":
        rt = cupy.cuda.runtime
        dev = cupy.cuda.Device()
        props = rt.getDeviceProperties(dev.id)
        env.update({
            "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "device": dev.id,
            "compute_capability": dev.compute_capability,
            "sm_count": dev.attributes["MultiProcessorCount"],
            "driver": rt.driverGetVersion(),
            "runtime": rt.runtimeGetVersion(),
        })
    return env


def _passed(errors, tolerances):
    return all(errors[name] <= tol for name, tol in tolerances.items())


def bench(op_names, shapes, *, dtype=bfloat16, iters=20, warmup=3, copy_bytes=None, progress=None):
    """Check then time ``op_names`` x ``shapes``; returns the JSON-ready report.

    ``progress(item_label)`` is called before each case when given.
    """
    use_gpu = gpu_available()
    xp = cupy if use_gpu else numpy
    roof = measure_copy(copy_bytes) if use_gpu else measure_copy_cpu()
    rows = []
    for name in op_names:
        op = OPS[name]
        for shape in shapes:
            if progress:
                progress(f"{name} {shape}")
            case = op.prepare(shape, dtype, xp)
            errors = case.check()
            row = {"op": name, "shape": dict(zip(op.dims, shape)), "dtype": dtype_name(dtype),
                   "errors": errors, "ok": _passed(errors, case.tolerances), "bytes": case.bytes_moved}
            if row["ok"]:
                if use_gpu:
                    t = time_graph(case.run, iters=iters, warmup=warmup)
                    row.update(us_eager=time_eager(case.run), host_us=host_overhead(case.run))
                else:
                    t = time_cpu(case.run, iters=max(1, min(iters, 3)), warmup=min(warmup, 1))
                    row.update(us_eager=t.median_us, host_us=None)
                gbps = case.bytes_moved / t.median_us / 1e3
                row.update(us_median=t.median_us, us_min=t.min_us, us_max=t.max_us,
                           calls_per_sample=t.calls_per_sample, samples=t.samples,
                           gbps=gbps, fraction_of_copy=gbps / roof.copy_gbps)
            rows.append(row)
            del case
            if use_gpu:
                cupy.get_default_memory_pool().free_all_blocks()
    return {"schema": "cupy-comba-bench/1", "environment": environment(), "roofline": roof.as_dict(),
            "iters": iters, "warmup": warmup, "results": rows}


def selftest(*, shapes=None, dtypes=None, progress=None):
    """Every registered op x every specialisation x dtype at small shapes vs the reference.

    Returns a list of ``{op, variant, shape, dtype, errors, ok}``.
    """
    use_gpu = gpu_available()
    xp = cupy if use_gpu else numpy
    shapes = shapes or SHAPES["tiny"]
    dtypes = dtypes or [bfloat16, numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)]
    results = []
    for name, op in OPS.items():
        for seed, shape in enumerate(shapes):
            for variant in (op.variants(shape) if use_gpu else (None,)):
                for dt in dtypes:
                    if progress:
                        progress(f"{name}[{variant}] {shape} {dtype_name(dt)}")
                    case = op.prepare(shape, dt, xp, seed=seed, variant=variant)
                    errors = case.check()
                    results.append({"op": name, "variant": variant, "shape": list(shape),
                                    "dtype": dtype_name(dt), "errors": errors,
                                    "ok": _passed(errors, case.tolerances)})
    return results
