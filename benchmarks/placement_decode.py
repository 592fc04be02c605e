"""Does where state_out sits relative to state change the bandwidth? (decode kernel vs a plain copy)

    PYTHONPATH=. python benchmarks/placement_decode.py [B,H,K,V]

For one shape, state and state_out are carved out of one allocation at several
distances; each placement times the chosen decode variants and the float4 copy
kernel between the same two buffers.
"""

import sys

import cupy
import numpy

from cupy_comba import bfloat16
from cupy_comba._build import get_kernel
from cupy_comba.bench import measure_copy, parse_shapes, time_graph
from cupy_comba.comba import _decode_step
from cupy_comba.inputs import decode_inputs


def main():
    (shape,) = parse_shapes(sys.argv[1:] or ["896,16,128,128"])
    B, H, K, V = shape
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s", flush=True)
    state0, q, k, v, p, beta, g = decode_inputs(B, H, K, V, xp=cupy, seed=1, warm_steps=2)
    nbytes = state0.nbytes
    out = cupy.empty((B, H, V), bfloat16)
    copy = get_kernel("copy", "comba::copy_float4", 0)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    moved = B * H * (8 * K * V + 6 * K + 4 * V + 6)
    gap_list = [("in-place", None), ("+0", 0), ("+64KiB", 64 << 10), ("+1MiB", 1 << 20),
                ("+7MiB+192KiB", (7 << 20) + (192 << 10)),
                ("to 1GiB", (1 << 30) - nbytes if nbytes < (1 << 30) else 0), ("to 2GiB", (2 << 30) - nbytes)]
    for name, gap in gap_list:
        buf = None
        if gap is None:
            state, state_out = state0.copy(), None
        else:
            buf = cupy.empty((2 * nbytes + gap) // 4, numpy.float32)
            state = buf[:nbytes // 4].reshape(shape)
            state[...] = state0
            state_out = buf[(nbytes + gap) // 4:(2 * nbytes + gap) // 4].reshape(shape)
        dst = state if state_out is None else state_out
        line = f"{name:14s}"
        for variant in ("warp32", "warp16", "pipe8"):
            t = time_graph(lambda: _decode_step(state, q, k, v, p, beta, g, None, out, dst, None, variant), iters=10)
            line += f"  {variant} {moved / t.median_us / 1e3 / roof.copy_gbps:.3f}"
        if state_out is not None:
            n4 = numpy.int64(nbytes // 16)
            t = time_graph(lambda: copy((sms * 4,), (512,), (state, state_out, n4)), iters=10)
            line += f"  copy {2 * nbytes / t.median_us / 1e3 / roof.copy_gbps:.3f}"
        print(line, flush=True)
        buf = state = state_out = dst = None
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
