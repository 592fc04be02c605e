"""Where the host microseconds of one decode-step call go, piece by piece (no GPU waits).

    PYTHONPATH=. python benchmarks/host_breakdown.py

B*H = 128, K = V = 128, bf16, preallocated outputs: each piece of the call path timed alone over
20000 repetitions, plus CuPy launches of a one-argument and an eleven-argument empty kernel.
"""

import time

import cupy
import numpy

from cupy_comba import bfloat16, comba_decode_step
from cupy_comba._checks import check_outputs, common_device, namespace_of, signature
from cupy_comba.inputs import decode_inputs
from cupy_comba.recurrent import _plan

N = 20000

EMPTY = r"""
struct Big { long long x[42]; };
extern "C" __global__ void one(const Big b) {}
extern "C" __global__ void eleven(const float* a, float* b, const void* c, const void* d, const void* e,
                                  const void* f, const void* g, const void* h, void* i, const Big p, float s) {}
"""


def us(fn, n=N):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    cupy.cuda.get_current_stream().synchronize()
    return dt


def main():
    B, H, K, V = 8, 16, 128, 128
    state, q, k, v, p, beta, g = args = decode_inputs(B, H, K, V, xp=cupy, seed=0, warm_steps=1)
    out, state_out = cupy.empty((B, H, V), bfloat16), cupy.empty_like(state)
    arrays = (q, k, v, p, beta, g, state)
    dev = state.data.device_id
    sigs = tuple(signature(a) for a in arrays)
    plan = _plan(*sigs, signature(out), None, None, True, "kv", "log", False, True, dev, None)
    named = dict(zip(("q", "k", "v", "p", "beta", "g", "state"), arrays))
    mod = cupy.RawModule(code=EMPTY)
    one, eleven = mod.get_function("one"), mod.get_function("eleven")
    raw = (state, state_out, q, k, v, p, beta, g, out, plan.params, plan.scale_arg)
    ints = tuple(a.data.ptr for a in raw[:9]) + raw[9:]
    rows = {
        "comba_decode_step (whole call)": lambda: comba_decode_step(*args, out=out, state_out=state_out),
        "plan.kernel launch, 11 args (arrays)": lambda: plan.kernel(plan.grid, plan.block, raw),
        "plan.kernel launch, 11 args (int pointers)": lambda: plan.kernel(plan.grid, plan.block, ints),
        "empty kernel, 1 struct arg": lambda: one((1,), (32,), (plan.params,)),
        "empty kernel, 11 args (arrays)": lambda: eleven((1,), (32,), raw),
        "empty kernel, 11 args (int pointers)": lambda: eleven((1,), (32,), ints),
        "signature() x 9": lambda: [signature(a) for a in arrays + (out, state_out)],
        "_plan cache hit": lambda: _plan(*sigs, signature(out), None, None, True, "kv", "log", False, True, dev,
                                         None),
        "check_outputs": lambda: check_outputs(named, plan.spans, out, plan.out_span, state_out, plan.state_shape,
                                               ""),
        "common_device": lambda: common_device(dict(named, out=out, state_out=state_out)),
        "namespace_of": lambda: namespace_of(named),
        "getDevice": lambda: cupy.cuda.runtime.getDevice(),
        "a.data.ptr x 9": lambda: [a.data.ptr for a in raw[:9]],
        "numpy.float32(scale)": lambda: numpy.float32(0.5),
    }
    for name, fn in rows.items():
        print(f"{name:45s} {us(fn):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
