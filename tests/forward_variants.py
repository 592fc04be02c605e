"""Every variant of the token-loop, chunked and 16-token tensor-core families -- the kernels that stage tokens
through shared memory -- over passes that end mid-step (T = 21), Comba and Gated DeltaNet, bf16 (and fp32 keys
in the tensor-core kernels, their 8-token path), with the decode steps and the verify build that keeps every
token's state: run under compute-sanitizer's racecheck by test_sanitizer_gpu.py (the prefill kernels have
prefill_chunks.py)."""

import cupy
import numpy

from cupy_comba import bfloat16, comba_decode_step, comba_forward, families, gated_delta_forward
from cupy_comba.inputs import forward_inputs

T = 21


def main():
    launches = 0
    for layout in ("kv", "vk"):
        for K, V in ((64, 64), (128, 128), (256, 64)):
            for dtype in (bfloat16, numpy.float32):
                q, k, v, p, beta, g, S = forward_inputs(2, T, 2, K, V, dtype=dtype, xp=cupy, state_layout=layout,
                                                        warm_steps=2, seed=K)
                for variant in families.variants(layout, K, V, multi=True):
                    family = families.tiling(layout, K, variant).family
                    # fp32 keys take another path only in the 16-token kernels (8-token passes)
                    if family.startswith("prefill_scan") or (dtype is numpy.float32 and family != "delta_rule_mma"):
                        continue
                    comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout=layout, variant=variant)
                    gated_delta_forward(q, k, v, beta, g, initial_state=S, state_layout=layout, variant=variant)
                    launches += 2
                if dtype is numpy.float32:
                    continue
                for variant in families.variants(layout, K, V, multi=True, token_loop=True):
                    comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout=layout, variant=variant,
                                  intermediate_states=cupy.empty((2, T) + S.shape[1:], cupy.float32))
                    launches += 1
                for variant in families.variants(layout, K, V):
                    comba_decode_step(S.copy(), *(a[:, 0] for a in (q, k, v, p, beta, g)), state_layout=layout,
                                      variant=variant)
                    launches += 1
            cupy.cuda.Device().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
    print(f"{launches} launches over the shared-memory families")


if __name__ == "__main__":
    main()
