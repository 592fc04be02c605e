"""Every build of the 64-token prefill kernels over several chunks (two full ones and one of 22 tokens), dense and
with the serving options (a ragged batch from a pool; the segmented scan, in segments of one chunk, also over a
dense batch from a pool with a padding row and from no state), in "bf16" and "fp32", and the wgmma scans' builds on
compute capability 9.0, those also over a row long enough for their third stage, and the transposed scan's
two-warpgroup CTAs over 128 value columns, Gated DeltaNet's prep in its lean layout: run under compute-sanitizer's
racecheck and memcheck by test_sanitizer_gpu.py, each call with a workspace allocated at its exact size."""

import cupy
import numpy

from cupy_comba import _plan, comba_forward, families, gated_delta_forward, tiling
from cupy_comba.inputs import forward_inputs
from sanitized import exact_workspaces

T = 150


def _scans(layout, precision, K):
    """The prefill scans' ``layout`` variants this GPU builds for ``precision`` at head size ``K``."""
    hopper = families.runs_wgmma(cupy.cuda.Device().compute_capability)
    wgmma = precision == "bf16" and K in families.FAMILY_K and hopper
    return [f"{layout}{slab}{scan}" for slab in families.PREFILL_SLABS for scan in (("c64", "c64wg") if wgmma
                                                                                   else ("c64",))] + \
        ([f"{layout}{64 * wgs}c64{part}" for wgs in families.WT_WARPGROUPS for part in ("wt", "sg")] if wgmma else [])


def _ring():
    """The wgmma scans over a row long enough for their third stage (families.WG_RING_CHUNKS chunks and a partial
    one), dense and packed with a short sequence before it; the launches made."""
    T = 64 * families.WG_RING_CHUNKS + 22
    launches = 0
    for layout in ("kv", "vk"):
        q, k, v, p, beta, g, S = forward_inputs(1, T, 1, 128, 64, xp=cupy, state_layout=layout, seed=T)
        cu = cupy.asarray(numpy.array([0, 70, T], numpy.int32))
        pool = cupy.concatenate([S, S])
        for slab in families.PREFILL_SLABS:
            variant = f"{layout}{slab}c64wg"
            comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout=layout, variant=variant)
            comba_forward(q, k, v, p, beta, g, initial_state=pool, cu_seqlens=cu, state_layout=layout,
                          variant=variant)
            gated_delta_forward(q, k, v, beta, g, initial_state=pool, cu_seqlens=cu, state_layout=layout,
                                variant=variant)
            launches += 3
    return launches


def main():
    tiling.MIN_SEGMENT_CHUNKS = 1  # segments of one chunk: the chain and the compositions run at T = 150
    _plan.LEAN_PREP_WAVE = 0  # Gated DeltaNet's prep in its lean layout, in the room it takes on a long prompt
    launches = 0
    for precision in ("bf16", "fp32"):
        for K, V in ((64, 64), (128, 64), (128, 128), (256, 32)):
            for layout in ("kv", "vk"):
                q, k, v, p, beta, g, S = forward_inputs(2, T, 2, K, V, xp=cupy, state_layout=layout, warm_steps=2,
                                                        seed=K)
                packed = [a.reshape((1, 2 * T) + a.shape[2:]) for a in (q, k, v, p, beta, g)]
                cu = cupy.asarray(numpy.array([0, 70, 2 * T], numpy.int32))
                slots = cupy.asarray(numpy.array([2, 0], numpy.int32))
                padded = cupy.asarray(numpy.array([2, -1], numpy.int32))  # the segments' pool: a padding row
                for variant in _scans(layout, precision, K):
                    t = families.tiling(layout, K, variant)
                    for comba in (False, True):
                        if V % t.slab or (V == 128 and t.slab != 128) or (t.family == "prefill_scan" and
                                                                          not families.prefill_fits(K, t.slab, comba,
                                                                                                    False)):
                            continue
                        pool = cupy.concatenate([S, S[:1]])
                        segmented = variant.endswith("sg")
                        if comba:
                            comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout=layout, variant=variant,
                                          precision=precision)
                            if segmented:  # from a pool with a padding row, and from no state
                                comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=padded,
                                              state_layout=layout, variant=variant, precision=precision)
                                comba_forward(q, k, v, p, beta, g, state_layout=layout, variant=variant,
                                              precision=precision)
                            comba_forward(*packed, initial_state=pool, state_indices=slots, cu_seqlens=cu,
                                          state_layout=layout, variant=variant, precision=precision)
                        else:
                            gated_delta_forward(q, k, v, beta, g, initial_state=S, state_layout=layout,
                                                variant=variant, precision=precision)
                            if segmented:
                                gated_delta_forward(q, k, v, beta, g, initial_state=pool, state_indices=padded,
                                                    state_layout=layout, variant=variant, precision=precision)
                                gated_delta_forward(q, k, v, beta, g, state_layout=layout, variant=variant,
                                                    precision=precision)
                            gated_delta_forward(*packed[:3], *packed[4:], initial_state=pool, state_indices=slots,
                                                cu_seqlens=cu, state_layout=layout, variant=variant,
                                                precision=precision)
                        launches += 4 if segmented else 2
    if families.runs_wgmma(cupy.cuda.Device().compute_capability):
        launches += _ring()
    cupy.cuda.Device().synchronize()
    print(f"{launches} prefill launches over several chunks")


if __name__ == "__main__":
    exact_workspaces()
    main()
