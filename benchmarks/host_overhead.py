"""Host microseconds of one comba_decode_step call, and where they go.

    PYTHONPATH=. python benchmarks/host_overhead.py [B,H,K,V]

Times N calls without waiting for the GPU (small shape, preallocated outputs),
the bare kernel launch with the same arguments, and prints a cProfile of the
call path.
"""

import cProfile
import pstats
import sys

import cupy
import numpy

from cupy_comba import bfloat16, comba_decode_step
from cupy_comba._checks import signature
from cupy_comba.bench import host_overhead, parse_shapes
from cupy_comba.comba import _plan
from cupy_comba.inputs import decode_inputs


def per_call_us(fn):
    return host_overhead(fn, calls=2000)


def main():
    (shape,) = parse_shapes(sys.argv[1:] or ["8,16,128,128"])
    B, H, K, V = shape
    args = decode_inputs(B, H, K, V, xp=cupy, seed=0, warm_steps=1)
    state_out = cupy.empty(shape, numpy.float32)
    out = cupy.empty((B, H, V), bfloat16)
    call = lambda: comba_decode_step(*args, out=out, state_out=state_out)  # noqa: E731
    plan = _plan(*(signature(a) for a in args), None, signature(out), None, 0, None)
    launch_args = (args[0], state_out, *args[1:], out) + plan.args_tail
    launch = lambda: plan.kernel(plan.grid, plan.block, launch_args, shared_mem=plan.shared_mem)  # noqa: E731
    alloc = lambda: comba_decode_step(*args)  # noqa: E731
    print(f"{shape}: call with out=/state_out= {per_call_us(call):.1f} us, "
          f"allocating call {per_call_us(alloc):.1f} us, "
          f"bare launch {per_call_us(launch):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        call()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
