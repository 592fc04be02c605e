"""Benchmark and self-test drivers behind ``cupy-comba bench`` and ``cupy-comba check``.

Every timed case is first checked against the float64 reference at full size
(on the GPU when there is one); a case that fails its check is reported and
makes the run fail, and is never timed.
"""

import datetime
import os
import platform
import time

import numpy

from .. import families, reference
from .._backend import cupy, gpu_available
from .._dtypes import bfloat16, dtype_name
from .registry import OPS
from .roofline import measure_copy, measure_copy_cpu
from .timing import host_overhead, time_cpu, time_eager, time_graph

#: Decode-step presets (B, H, K, V): large decode batches, plus two small ones (B*H = 128 and 1024).
SHAPES = {
    "measure": [(896, 16, 128, 128), (448, 32, 128, 128), (1792, 8, 128, 128), (1280, 16, 64, 128),
                (640, 24, 128, 128)],
    "small-batch": [(8, 16, 128, 128), (64, 16, 128, 128)],
    "quick": [(256, 16, 128, 128), (128, 32, 128, 128), (512, 16, 64, 128)],
    "tiny": [(8, 4, 128, 128), (16, 2, 64, 128), (4, 8, 128, 64), (32, 4, 64, 64)],
}
SHAPES["regime"] = SHAPES["measure"] + SHAPES["small-batch"]

#: Forward-pass presets (B, T, H, K, V) under the same names: speculative verify (T = 4, 16) over
#: a large batch, chunks of a prompt, and long prompts over few heads.
FORWARD_SHAPES = {
    "measure": [(512, 4, 16, 128, 128), (512, 16, 16, 128, 128), (512, 64, 16, 64, 128)],
    "small-batch": [(1, 4096, 16, 128, 128), (8, 16, 16, 128, 128)],
    "quick": [(64, 16, 16, 128, 128), (2, 256, 16, 128, 128)],
    "tiny": [(2, 3, 4, 128, 128), (1, 9, 8, 64, 128), (3, 5, 2, 128, 64), (2, 20, 4, 64, 64)],
}
FORWARD_SHAPES["regime"] = FORWARD_SHAPES["measure"] + FORWARD_SHAPES["small-batch"]

#: Largest size of one dimension (the kernels index a grid of 2^31 - 1 CTAs).
MAX_DIM = 2**31 - 1


def _presets(dims):
    return SHAPES if len(dims) == 4 else FORWARD_SHAPES


def parse_shapes(specs, dims=("B", "H", "K", "V")):
    """Shapes for an op with fields ``dims`` from preset names (``regime``, ``quick``, ...) and
    ``B,H,K,V`` (or ``B,T,H,K,V``) strings; strings of another length are left to other ops."""
    shapes = []
    for spec in specs:
        if spec in SHAPES:
            shapes.extend(_presets(dims)[spec])
            continue
        shape = _parse(spec)
        if len(shape) == len(dims):
            shapes.append(shape)
    return shapes


def _parse(spec):
    parts = spec.replace("x", ",").split(",")
    try:
        shape = tuple(int(x) for x in parts)
    except ValueError:
        shape = ()
    if len(shape) not in (4, 5) or min(shape) < 1:
        raise ValueError(f"shape {spec!r} is neither a preset ({', '.join(SHAPES)}) nor 4 positive integers B,H,K,V "
                         "(decode steps) or 5, B,T,H,K,V (forward passes)")
    if max(shape) > MAX_DIM:
        raise ValueError(f"shape {spec!r} has a dimension above {MAX_DIM}")
    return shape


def shapes_for_ops(op_names, specs, *, every_op_needs_shapes=True):
    """``{op: [shape, ...]}`` for the selected ops, every shape checked (ValueError) before any work.

    A ``B,H,K,V`` string goes to the decode steps, a ``B,T,H,K,V`` one to the forward passes;
    with ``every_op_needs_shapes=False`` an op that gets none is left out.
    """
    for spec in specs:
        if spec not in SHAPES:
            shape = _parse(spec)
            if not any(len(OPS[n].dims) == len(shape) for n in op_names):
                raise ValueError(f"shape {spec!r} has {len(shape)} fields, but none of the selected ops takes "
                                 f"{len(shape)} ({', '.join(op_names)})")
    plan = {}
    for name in op_names:
        op = OPS[name]
        shapes = parse_shapes(specs, op.dims)
        if not shapes:
            if not every_op_needs_shapes:
                continue
            raise ValueError(f"{name} takes {','.join(op.dims)} shapes, and none was given")
        for shape in shapes:
            _check_shape(op, shape)
        plan[name] = shapes
    return plan


def _check_shape(op, shape):
    heads, T, K, V = op.heads_and_sizes(shape)
    label = ",".join(map(str, shape))
    if K not in families.SUPPORTED_K:
        raise ValueError(f"{op.name} at {label}: K={K} is not supported (supported: {families.SUPPORTED_K})")
    if V % 32:
        raise ValueError(f"{op.name} at {label}: V={V} must be a multiple of 32")
    need = case_bytes(op, shape)
    have = available_bytes()
    if need > have:
        raise ValueError(f"{op.name} at {label} needs about {need / 2**30:.1f} GiB, more than the "
                         f"{have / 2**30:.1f} GiB {'the GPU has free' if gpu_available() else 'of host memory'}")


def case_bytes(op, shape):
    """About the memory one case holds: its state, a state out and the float64 reference's copies."""
    heads, T, K, V = op.heads_and_sizes(shape)
    state = heads * K * V
    acts = heads * T * (3 * K + 2 * V + 2)
    return state * (4 + 4 + 8 * 3) + acts * 8 * 2


def available_bytes():
    """Free GPU memory, or host memory on the NumPy backend."""
    if gpu_available():
        return cupy.cuda.Device().mem_info[0]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def estimate_cpu_seconds(plan, *, iters=20):
    """About how long :func:`bench` takes on the NumPy backend: the float64 reference's cost per
    state element and token, measured now on a small case, times the cases' element-tokens (the
    input warm-up's 16 steps, the check and the timed calls)."""
    from ..inputs import decode_inputs

    state, q, k, v, p, beta, g = decode_inputs(8, 4, 64, 64, warm_steps=0)
    start = time.perf_counter()
    for _ in range(3):
        reference.comba_step(state, q, k, v, p, beta, g)
    per_element = (time.perf_counter() - start) / 3 / state.size
    calls = 1 + 1 + max(1, min(iters, 3))
    total = 0.0
    for name, shapes in plan.items():
        for shape in shapes:
            heads, T, K, V = OPS[name].heads_and_sizes(shape)
            total += heads * K * V * (16 + calls * T) * per_element
    return total


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


def bench(plan, *, dtype=bfloat16, iters=20, warmup=3, copy_bytes=None, progress=None):
    """Check then time every ``{op name: [shape, ...]}`` of ``plan`` (:func:`shapes_for_ops`);
    returns the JSON-ready report.

    ``progress(item_label)`` is called before each case when given.
    """
    use_gpu = gpu_available()
    xp = cupy if use_gpu else numpy
    roof = measure_copy(copy_bytes) if use_gpu else measure_copy_cpu()
    rows = []
    for name, shapes in plan.items():
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
    """Every registered op x every variant x dtype at small shapes vs the reference.

    ``shapes``: ``{op name: [shape, ...]}``, by default each op's ``tiny`` preset.  Returns a list
    of ``{op, variant, shape, dtype, errors, ok}``.
    """
    use_gpu = gpu_available()
    xp = cupy if use_gpu else numpy
    dtypes = dtypes or [bfloat16, numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)]
    results = []
    for name, op in OPS.items():
        for seed, shape in enumerate((shapes or {}).get(name) or _presets(op.dims)["tiny"]):
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
