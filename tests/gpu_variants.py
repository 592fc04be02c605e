"""The variants the GPU tests run on every kernel path: ``families.variants`` less the builds this GPU lacks, and
the precision that makes each fp32-accurate."""

import cupy

from cupy_comba import families


def runnable(layout, K, V, multi=False, token_loop=False, exact=False):
    """``families.variants(layout, K, V, multi, token_loop)`` that this GPU runs (the wgmma scan on compute
    capability 9.0 only); ``exact``: only those with an fp32-accurate build (the wgmma scans have bf16 products
    only: test_prefill_gpu.py holds them to their bounds)."""
    hopper = families.runs_wgmma(cupy.cuda.Device().compute_capability)
    return tuple(v for v in families.variants(layout, K, V, multi, token_loop)
                 if families.tiling(layout, K, v).family not in families.WGMMA_FAMILIES or (hopper and not exact))


def exact(variant):
    """fp32 products on the 64-token prefill scan (whose default for 16-bit inputs is bf16); every other kernel
    is fp32-accurate whatever ``precision`` says."""
    return {"precision": "fp32"} if variant is not None and variant.endswith("c64") else {}
