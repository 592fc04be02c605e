"""What the order of pool slots costs a plain copy (CUDA-graph replay), apart from any kernel of the library.

    PYTHONPATH=. python benchmarks/pool_order.py

``benchmarks/serving.py``'s pooled copy (each CTA copies 4096 floats of one row's slot onto themselves, every
load before any store) over B slots of ``[H, 128, 128]`` floats: a random permutation of a pool of B, 2B and 4B
slots, the same slots sorted, and slots 0 .. B - 1 in order; and its fan-out copy (one slot read, T slots
written, the verify pass's state traffic) into random slots and into slots laid out as a contiguous
``[B, T]`` block (what ``intermediate_states`` is).  Fractions are of the device copy measured first.
"""

import importlib.util
import os

import cupy
import numpy

from cupy_comba.bench import measure_copy, time_graph

_spec = importlib.util.spec_from_file_location("serving", os.path.join(os.path.dirname(__file__), "serving.py"))
serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)

HEAD = 128 * 128


def pooled(copy_gbps):
    for B, H in ((896, 16), (1792, 8), (448, 32)):
        for factor in (1, 2, 4):
            pool = cupy.random.default_rng(0).standard_normal((factor * B, H, 128, 128), dtype=cupy.float32)
            perm = numpy.random.default_rng(1).permutation(factor * B)[:B]
            orders = {"random": perm, "in order": numpy.arange(B)}
            if factor > 1:
                orders = {"random": perm, "sorted": numpy.sort(perm), "in order": numpy.arange(B)}
            nbytes = 2 * B * H * HEAD * 4
            for name, order in orders.items():
                t = time_graph(serving._pool_copy(pool, cupy.asarray(order.astype(numpy.int32))))
                print(f"B={B} H={H} pool={factor}B {name:9s} {t.median_us:8.1f} us "
                      f"{nbytes / t.median_us / 1e3 / copy_gbps:.3f} of copy", flush=True)
            del pool
            cupy.get_default_memory_pool().free_all_blocks()


def fan_out(copy_gbps):
    for B, T, H in ((512, 4, 16), (128, 16, 16)):
        pool = cupy.random.default_rng(0).standard_normal((B * (T + 1), H, 128, 128), dtype=cupy.float32)
        perm = numpy.random.default_rng(1).permutation(B * (T + 1))
        first = cupy.asarray(perm[:B].astype(numpy.int32))
        block = cupy.asarray((B + numpy.arange(B * T)).reshape(B, T).astype(numpy.int32))  # a [B, T] block
        cases = {"random slots": (first, cupy.asarray(perm[B:].reshape(B, T).astype(numpy.int32))),
                 "contiguous outs": (first, block),
                 "sorted first, contiguous outs": (cupy.asarray(numpy.sort(perm[:B]).astype(numpy.int32)), block)}
        nbytes = (1 + T) * B * H * HEAD * 4
        for name, (src, outs) in cases.items():
            t = time_graph(serving._fan_copy(pool, src, outs))
            print(f"fan B={B} T={T} {name} {t.median_us:8.1f} us {nbytes / t.median_us / 1e3 / copy_gbps:.3f}",
                  flush=True)
        del pool
        cupy.get_default_memory_pool().free_all_blocks()


def main():
    copy_gbps = measure_copy().copy_gbps
    print(f"copy {copy_gbps:.0f} GB/s")
    pooled(copy_gbps)
    fan_out(copy_gbps)


if __name__ == "__main__":
    main()
