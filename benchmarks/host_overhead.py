"""Host microseconds of one decode-step call, and where they go (the GPU is never waited on).

    PYTHONPATH=. python benchmarks/host_overhead.py [B,H,K,V]

Default shape 8,16,128,128 (B*H = 128), bf16, preallocated outputs.  Each row is one piece of
work repeated back to back (median of 5 bursts of 4000): the public calls, the launch floors
(the plan's prepacked driver launch, CuPy's RawKernel call of the same kernel and arguments, and
the CUDA driver launching an empty one-argument kernel), then the pieces of the call path, and
last the replay of one step captured in a CUDA graph (bursts of 200, below the GPU queue depth).
"""

import ctypes
import statistics
import sys

import cupy

from cupy_comba import bfloat16, comba_decode_step, gated_delta_decode_step
from cupy_comba._checks import check_overlaps
from cupy_comba.bench import host_overhead, parse_shapes
from cupy_comba.inputs import decode_inputs
from cupy_comba.recurrent import _plan

EMPTY = r"""
struct Big { long long x[42]; };
extern "C" __global__ void empty(const Big b) {}
"""


def per_call_us(fn, calls=4000, bursts=5):
    """Median over bursts of the library's host timer (it syncs the current stream around a burst)."""
    return statistics.median(host_overhead(fn, calls=calls) for _ in range(bursts))


def main():
    (shape,) = parse_shapes(sys.argv[1:] or ["8,16,128,128"])
    B, H, K, V = shape
    state, q, k, v, p, beta, g = args = decode_inputs(B, H, K, V, xp=cupy, seed=0, warm_steps=1)
    out, state_out = cupy.empty((B, H, V), bfloat16), cupy.empty_like(state)
    arrays = (q, k, v, p, beta, g, state, out, state_out)
    dev = state.data.device_id
    key = sum(((a.shape, a.strides, a.dtype) for a in arrays), ()) + (None, None, True, "kv", "log", False, True,
                                                                      dev, None)
    plan = _plan(*key)
    pointers = [a.data.ptr for a in arrays]
    kernel_ptrs = (state.data.ptr, state_out.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, p.data.ptr,
                   beta.data.ptr, g.data.ptr, out.data.ptr)
    stream = cupy.cuda.get_current_stream().ptr
    launch = plan.launch
    raw_args = (state, state_out, q, k, v, p, beta, g, out, launch.params, launch.scale)
    empty = cupy.RawModule(code=EMPTY).get_function("empty")
    blob = launch.params.tobytes()
    param_buf = ctypes.create_string_buffer(blob, len(blob))
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(param_buf))
    rows = {
        "comba_decode_step(..., out=, state_out=)": lambda: comba_decode_step(*args, out=out, state_out=state_out),
        "gated_delta_decode_step(..., out=, state_out=)":
            lambda: gated_delta_decode_step(state, q, k, v, beta, g, out=out, state_out=state_out),
        "comba_decode_step (allocating outputs)": lambda: comba_decode_step(*args),
        "launch floor: the plan's prepacked driver launch": lambda: launch(kernel_ptrs, stream),
        "launch floor: CuPy RawKernel call, same kernel and args":
            lambda: launch.kernel(launch.grid, launch.block, raw_args),
        "launch floor: driver launch of an empty 1-arg kernel":
            lambda: cupy.cuda.driver.launchKernel(empty.kernel.ptr, 1, 1, 1, 32, 1, 1, 0, stream,
                                                  ctypes.addressof(argv), 0),
        "piece: shape, strides, dtype of 9 arrays": lambda: [(a.shape, a.strides, a.dtype) for a in arrays],
        "piece: data pointer and device of 9 arrays": lambda: [(a.data.ptr, a.data.device_id) for a in arrays],
        "piece: _plan cache hit": lambda: _plan(*key),
        "piece: check_overlaps": lambda: check_overlaps(pointers, plan.spans),
        "piece: current stream handle": lambda: cupy.cuda.get_current_stream().ptr,
    }
    print(f"host time per call, {shape}, bf16:")
    for name, fn in rows.items():
        print(f"  {name:58s} {per_call_us(fn):6.2f} us", flush=True)
    # One step captured in a CUDA graph: bursts short enough that the GPU queue never fills.
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        side.begin_capture()
        comba_decode_step(*args, out=out, state_out=state_out)
        graph = side.end_capture()
    with side:  # the current stream, so the timer waits on the replays between bursts
        us = per_call_us(lambda: graph.launch(side), calls=200, bursts=25)
    print(f"  {'comba_decode_step captured in a CUDA graph, graph.launch()':58s} {us:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
