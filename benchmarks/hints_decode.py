"""Which cache hints let the state stream fastest?  Decode variants and the copy kernel,
each compiled with every COMBA_LOAD_HINT / COMBA_STORE_HINT / COMBA_BULK_HINT combination.

    PYTHONPATH=. python benchmarks/hints_decode.py [B,H,K,V]
"""

import sys

import cupy
import numpy

from cupy_comba import bfloat16
from cupy_comba._build import get_kernel
from cupy_comba.bench import measure_copy, parse_shapes, time_graph
from cupy_comba.comba import _launch_config, _plan, _signature
from cupy_comba.inputs import decode_inputs


def main():
    (shape,) = parse_shapes(sys.argv[1:] or ["896,16,128,128"])
    B, H, K, V = shape
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s", flush=True)
    args = decode_inputs(B, H, K, V, xp=cupy, seed=1, warm_steps=2)
    state_out = cupy.empty(shape, numpy.float32)
    out = cupy.empty((B, H, V), bfloat16)
    plan = _plan(*(_signature(a) for a in args), None, _signature(out), None, True, 0, "warp16")
    moved = B * H * (8 * K * V + 6 * K + 4 * V + 6)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    n4 = numpy.int64(args[0].nbytes // 16)
    for load, store, bulk in ((1, 1, 1), (0, 0, 0), (0, 1, 0), (1, 0, 1), (2, 0, 0), (2, 1, 1)):
        defines = (f"COMBA_LOAD_HINT={load}", f"COMBA_STORE_HINT={store}", f"COMBA_BULK_HINT={bulk}")
        line = f"load={load} store={store} bulk={bulk}"
        for variant in ("warp16", "warp32", "pipe16"):
            _, grid, block, smem, extra = _launch_config(variant, B * H, K, V, 0)
            kernel = _variant_kernel(variant, K, defines, smem)
            call_args = (args[0], state_out, *args[1:], out, plan.params, numpy.float32(plan.scale)) + extra
            t = time_graph(lambda: kernel(grid, block, call_args, shared_mem=smem), iters=10)
            line += f"  {variant} {moved / t.median_us / 1e3 / roof.copy_gbps:.3f}"
        copy = get_kernel("copy", "comba::copy_float4", 0, defines)
        t = time_graph(lambda: copy((sms * 4,), (512,), (args[0], state_out, n4)), iters=10)
        line += f"  copy {2 * args[0].nbytes / t.median_us / 1e3 / roof.copy_gbps:.3f}"
        print(line, flush=True)


def _variant_kernel(variant, K, defines, smem):
    if variant.startswith("warp"):
        return get_kernel("comba_decode", f"comba::comba_decode_step<{K}, {int(variant[4:])}>", 0, defines)
    kernel = get_kernel("comba_decode", f"comba::comba_decode_step_pipelined<{K}, {int(variant[4:])}>", 0, defines)
    kernel.max_dynamic_shared_size_bytes = smem
    return kernel


if __name__ == "__main__":
    main()
