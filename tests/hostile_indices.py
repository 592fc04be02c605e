"""Pooled decode steps and forward passes with hostile state_indices and cu_seqlens on every variant, small
shapes: run under compute-sanitizer by test_sanitizer_gpu.py (any access outside an array fails it)."""

import cupy
import numpy

from cupy_comba import comba_decode_step, comba_forward, families, gated_delta_forward
from cupy_comba.inputs import forward_inputs
from gpu_variants import runnable
from sanitized import exact_workspaces

HOSTILE = numpy.array([2 ** 62, -2 ** 63, 3, 1, -1, 1, 2 ** 31 - 1, 2], numpy.int64)  # N = 3
#: Sequence bounds of a ragged batch of 8 over 9 packed tokens: negative, decreasing, past the end.
HOSTILE_CU = numpy.array([-2 ** 40, 3, 1, 9, 2 ** 62, 4, 4, -1, 2 ** 31 - 1], numpy.int64)


def main():
    launches = 0
    for layout in ("kv", "vk"):
        for K, V in ((64, 64), (128, 128), (256, 64)):
            q, k, v, p, beta, g, _ = forward_inputs(8, 9, 2, K, V, xp=cupy, state_layout=layout, warm_steps=0)
            long = forward_inputs(8, 130, 2, K, V, xp=cupy, state_layout=layout, warm_steps=0)
            shape = (3, 2, K, V) if layout == "kv" else (3, 2, V, K)
            A_log, dt_bias = cupy.zeros(2, cupy.float32), cupy.ones(2, cupy.float32)
            for dtype in (cupy.int64, cupy.int32):
                idx = cupy.asarray(HOSTILE.clip(numpy.iinfo(dtype).min, numpy.iinfo(dtype).max).astype(dtype))
                for variant in runnable(layout, K, V, multi=True):
                    pool = cupy.zeros(shape, cupy.float32)
                    comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=idx, state_layout=layout,
                                  variant=variant, A_log=A_log, dt_bias=dt_bias)
                    gated_delta_forward(q, k, v, beta, g, initial_state=pool, state_indices=idx, state_layout=layout,
                                        variant=variant, output_final_state=False)
                    if variant.endswith("sg"):  # 130 tokens: three segments of a chunk
                        comba_forward(*long[:6], initial_state=pool, state_indices=idx, state_layout=layout,
                                      variant=variant)
                        launches += 1
                    cu = cupy.asarray(HOSTILE_CU.clip(numpy.iinfo(dtype).min, numpy.iinfo(dtype).max).astype(dtype))
                    packed = [a.reshape((1, 8 * 9) + a.shape[2:])[:, :9] for a in (q, k, v, p, beta, g)]
                    comba_forward(*packed, initial_state=pool, state_indices=idx, cu_seqlens=cu, state_layout=layout,
                                  variant=variant)
                    gated_delta_forward(*packed[:3], *packed[4:], cu_seqlens=cu, state_layout=layout, variant=variant)
                    launches += 4
                slots2 = cupy.asarray(numpy.resize(HOSTILE, 8 * 9).reshape(8, 9).clip(numpy.iinfo(dtype).min,
                                                                                        numpy.iinfo(dtype).max).astype(dtype))
                accepted = cupy.asarray(numpy.array([0, 1, 9, 10, -3, 2 ** 31 - 1, 5, 3]).astype(dtype))
                for variant in families.variants(layout, K, V, multi=True, token_loop=True):
                    pool = cupy.zeros(shape, cupy.float32)
                    comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=slots2,
                                  num_accepted_tokens=accepted, state_layout=layout, variant=variant)
                    comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=idx, state_layout=layout,
                                  intermediate_states=cupy.zeros((8, 9) + shape[1:], cupy.float32), variant=variant)
                    launches += 2
                for variant in families.variants(layout, K, V):
                    pool = cupy.zeros(shape, cupy.float32)
                    comba_decode_step(pool, *(a[:, 0] for a in (q, k, v, p, beta, g)), state_indices=idx,
                                      state_layout=layout, variant=variant, use_beta_sigmoid=True)
                    launches += 1
            cupy.cuda.Device().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()  # the sanitizer's shadow memory needs the room
    print(f"{launches} launches with hostile indices")


if __name__ == "__main__":
    exact_workspaces()
    main()
