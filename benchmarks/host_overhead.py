"""Host microseconds of one decode-step call, and where they go (the GPU is never waited on).

    PYTHONPATH=. python benchmarks/host_overhead.py [B,H,K,V ...]

Default shapes 1,1,64,32 (B*H = 1: the GPU work of a call, ~2 us, stays far below its host time,
so the GPU never holds the host back) and 8,16,128,128 (B*H = 128), bf16, preallocated outputs.
Each row is one piece of work repeated back to back (median of 5 bursts of 4000): the public
calls (with the same arrays every call, and with fresh activations: 8 sets of q, k, v, p, beta,
g taken in turn, so the pointers change every call), the launch floors (the plan's Launcher as the
op uses it -- a one-node graph replayed, with the same pointers and with new ones every call --,
its kernel through cuLaunchKernel, CuPy's RawKernel call of the same kernel and arguments, the
CUDA driver launching an empty kernel with a 336-byte and with an 8-byte argument), the pieces of
the call path, the call with the launch replaced by a no-op, and last the replay of one step
captured in a CUDA graph (bursts of 200, below the GPU queue depth).
"""

import ctypes
import statistics
import sys

import cupy
import numpy

from cupy_comba import bfloat16, comba_decode_step, gated_delta_decode_step
from cupy_comba._launcher import N_POINTERS
from cupy_comba._plan import PLANS, _check_pointers, _kernel_pointers
from cupy_comba._validate import ARRAYS
from cupy_comba.bench import host_overhead, parse_shapes
from cupy_comba.inputs import decode_inputs

EMPTY = r"""
struct Big { long long x[42]; };
extern "C" __global__ void empty(const Big b) {}
extern "C" __global__ void empty_ptr(const void* p) {}
"""


def per_call_us(fn, calls=4000, bursts=5):
    """Median over bursts of the library's host timer (it syncs the current stream around a burst)."""
    return statistics.median(host_overhead(fn, calls=calls) for _ in range(bursts))


def main():
    for shape in parse_shapes(sys.argv[1:] or ["1,1,64,32", "8,16,128,128"]):
        report(shape)


def report(shape):
    B, H, K, V = shape
    state, q, k, v, p, beta, g = args = decode_inputs(B, H, K, V, xp=cupy, seed=0, warm_steps=1)
    out, state_out = cupy.empty((B, H, V), bfloat16), cupy.empty_like(state)
    arrays = (q, k, v, p, beta, g, state, out, state_out) + (None,) * (len(ARRAYS) - 9)  # no serving options
    PLANS.clear()
    comba_decode_step(*args, out=out, state_out=state_out)  # the one plan, under the key the op built
    ((key, plan),) = PLANS.items()
    fresh = [decode_inputs(B, H, K, V, xp=cupy, seed=i + 1)[1:] for i in range(8)]
    turn = iter(range(1 << 62))
    pointers = tuple(None if a is None else a.data.ptr for a in arrays)
    kernel_ptrs = _kernel_pointers(pointers)
    stream = cupy.cuda.get_current_stream().ptr
    device = plan.device
    launch = plan.launcher
    swapped = (kernel_ptrs[1], kernel_ptrs[0]) + kernel_ptrs[2:]  # state and state_out trade places
    alternate = iter(range(1 << 62))
    null = numpy.uint64(0)  # the serving pointers, absent
    raw_args = (state, state_out, q, k, v, p, beta, g, out) + (null,) * (N_POINTERS - 9) + (launch.params, launch.scale)
    empty = cupy.RawModule(code=EMPTY).get_function("empty")
    blob = launch.params.tobytes()
    param_buf = ctypes.create_string_buffer(blob, len(blob))
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(param_buf))
    empty_ptr = cupy.RawModule(code=EMPTY).get_function("empty_ptr")
    ptr_arg = ctypes.c_uint64(state.data.ptr)
    argv_ptr = (ctypes.c_void_p * 1)(ctypes.addressof(ptr_arg))
    rows = {
        "comba_decode_step(..., out=, state_out=)": lambda: comba_decode_step(*args, out=out, state_out=state_out),
        "gated_delta_decode_step(..., out=, state_out=)":
            lambda: gated_delta_decode_step(state, q, k, v, beta, g, out=out, state_out=state_out),
        "comba_decode_step, fresh activations every call (8 sets in turn)":
            lambda: comba_decode_step(state, *fresh[next(turn) & 7], out=out, state_out=state_out),
        "comba_decode_step (allocating outputs)": lambda: comba_decode_step(*args),
        "launch: the plan's Launcher, same pointers (graph replay)": lambda: launch(kernel_ptrs, device),
        "launch: the plan's Launcher, new pointers (node update + replay)":
            lambda: launch(swapped if next(alternate) & 1 else kernel_ptrs, device),
        "launch floor: the plan's kernel through cuLaunchKernel": lambda: launch._launch_kernels(stream),
        "launch floor: CuPy RawKernel call, same kernel and args":
            lambda: launch.kernel(launch.grid, (launch.block,), raw_args, shared_mem=launch.shared_bytes),
        "launch floor: driver launch of an empty 1-arg kernel":
            lambda: cupy.cuda.driver.launchKernel(empty.kernel.ptr, 1, 1, 1, 32, 1, 1, 0, stream,
                                                  ctypes.addressof(argv), 0),
        "launch floor: driver launch of an empty kernel, one 8-byte argument":
            lambda: cupy.cuda.driver.launchKernel(empty_ptr.kernel.ptr, 1, 1, 1, 32, 1, 1, 0, stream,
                                                  ctypes.addressof(argv_ptr), 0),
        "piece: shape, strides, dtype of 9 arrays": lambda: [(a.shape, a.strides, a.dtype) for a in arrays[:9]],
        "piece: data pointer and device of 9 arrays": lambda: [(a.data.ptr, a.data.device_id) for a in arrays[:9]],
        "piece: plan cache hit": lambda: PLANS.get(key),
        "piece: pointer checks (device, overlaps, alignment)":
            lambda: _check_pointers(arrays, pointers, device, plan.pairs),
        "piece: current stream handle": lambda: cupy.cuda.get_current_stream().ptr,
        "piece: is the stream capturing (cudaStreamIsCapturing)": lambda: cupy.cuda.runtime.streamIsCapturing(stream),
        "piece: current device (cudaGetDevice)": lambda: cupy.cuda.runtime.getDevice(),
        "piece: .data of 9 arrays": lambda: [a.data for a in arrays[:9]],
        f"piece: the plan's {N_POINTERS} pointer slots written": lambda: launch._slots.__setitem__(slice(None), kernel_ptrs),
    }
    print(f"host time per call, {shape}, bf16:")
    for name, fn in rows.items():
        print(f"  {name:66s} {per_call_us(fn):6.2f} us", flush=True)
    # The whole Python path with the driver launch taken out: what the library adds to the launch.
    plan.launcher = lambda pointers, device: None
    us = per_call_us(lambda: comba_decode_step(*args, out=out, state_out=state_out))
    plan.launcher = launch
    print(f"  {'comba_decode_step, the launch replaced by a no-op':66s} {us:6.2f} us", flush=True)
    # One step captured in a CUDA graph: bursts short enough that the GPU queue never fills.
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        side.begin_capture()
        comba_decode_step(*args, out=out, state_out=state_out)
        graph = side.end_capture()
    with side:  # the current stream, so the timer waits on the replays between bursts
        us = per_call_us(lambda: graph.launch(side), calls=200, bursts=25)
    print(f"  {'comba_decode_step captured in a CUDA graph, graph.launch()':66s} {us:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
