"""Host microseconds of one decode-step call, and where they go.

    PYTHONPATH=. python benchmarks/host_overhead.py [B,H,K,V]

Times N calls without waiting for the GPU (small shape, preallocated outputs) for both
decode ops and CuPy's bare RawKernel launch of the same kernel with the same arguments (the
floor of any CuPy-launched op), and prints a cProfile of the call path.
"""

import cProfile
import pstats
import sys

import cupy
import numpy

from cupy_comba import bfloat16, comba_decode_step, gated_delta_decode_step, tiling
from cupy_comba._checks import signature
from cupy_comba.bench import host_overhead, parse_shapes
from cupy_comba.inputs import decode_inputs
from cupy_comba.recurrent import _plan


def per_call_us(fn):
    return host_overhead(fn, calls=2000)


def main():
    (shape,) = parse_shapes(sys.argv[1:] or ["8,16,128,128"])
    B, H, K, V = shape
    args = decode_inputs(B, H, K, V, xp=cupy, seed=0, warm_steps=1)
    state, q, k, v, p, beta, g = args
    state_out = cupy.empty(shape, numpy.float32)
    out = cupy.empty((B, H, V), bfloat16)
    call = lambda: comba_decode_step(*args, out=out, state_out=state_out)  # noqa: E731
    gdn = lambda: gated_delta_decode_step(state, q, k, v, beta, g, out=out, state_out=state_out)  # noqa: E731
    alloc = lambda: comba_decode_step(*args)  # noqa: E731
    dev = cupy.cuda.Device().id
    plan = _plan(*(signature(a) for a in (q, k, v, p, beta, g, state)), signature(out), None, None, True, "kv",
                 "log", False, True, dev, None)
    kernel, grid, block = tiling.launch("kv", tiling.choose("kv", K, V, True), B * H, K, V, True, False, dev)
    raw_args = (state, state_out, q, k, v, p, beta, g, out, plan.params, plan.scale_arg)
    raw = lambda: kernel(grid, block, raw_args)  # noqa: E731
    print(f"{shape}: comba_decode_step with out=/state_out= {per_call_us(call):.1f} us, "
          f"gated_delta_decode_step {per_call_us(gdn):.1f} us, allocating call {per_call_us(alloc):.1f} us, "
          f"bare CuPy RawKernel launch {per_call_us(raw):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        call()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
