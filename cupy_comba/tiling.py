"""Which kernel tiling runs a shape (kernels_cu/delta_rule.cu, kernels_cu/delta_rule_mma.cu; data:
benchmarks/sweep_decode.py and benchmarks/sweep_forward_tilings.py).

Variant names: ``kv{COLS}x{RG}`` -- ``delta_rule_kv``, a CTA per COLS-column slab of a
head with RG row groups; ``vk{R}x{NW}`` -- ``delta_rule_vk``, NW warps whose lanes hold
R state rows each.  The same kernels run one decode step and T-token forward passes.
Three families exist only for T-token passes: ``kv{COLS}x{RG}c4`` (``delta_rule_kv_chunked``,
4 tokens a pass over the state), ``vk{ROWS}c4`` (``delta_rule_vk_chunked``, K = 128 only: the
same chunks over a "vk" state, a CTA per ROWS rows of V), ``{layout}{SLAB}tc`` (``delta_rule_mma``,
a CTA per SLAB value columns, 8-token chunks on tensor cores) and ``{layout}{SLAB}tc16`` (the same
kernel taking 16 tokens, two chunks of 8, a pass over the state; at K = 64 also with SLAB = 128).
"""

from ._build import (
    KV_CHUNKED_TILINGS, KV_TILINGS, MMA_BUILDS, MMA_WIDE_K, MMA_WIDE_SLAB, VK_CHUNKED_K, VK_CHUNKED_ROWS, VK_TILINGS,
    get_kernel, _flag,
)

KV_VARIANTS = tuple(f"kv{c}x{r}" for c, r in KV_TILINGS)
KV_CHUNKED_VARIANTS = tuple(f"kv{c}x{r}c4" for c, r in KV_CHUNKED_TILINGS)
VK_VARIANTS = {K: tuple(f"vk{r}x{w}" for r, w in VK_TILINGS[K]) for K in VK_TILINGS}
VK_CHUNKED_VARIANTS = tuple(f"vk{r}c4" for r in VK_CHUNKED_ROWS)


def token_passes_only(variant):
    """Whether ``variant`` exists only as a T-token build (no decode build): the chunked kernels,
    ``...c4``, and the tensor-core kernels, ``...tc`` and ``...tc16``."""
    return variant.endswith(("c4", "tc", "tc16"))


def variants(layout, K, V, multi=False):
    """The variants that can run a ``layout`` state with head sizes K, V (``multi``: T-token passes,
    which also have the chunked kernels, ``kv{COLS}x{RG}c4`` and at K = 128 ``vk{ROWS}c4``, and the
    tensor-core kernels, ``{layout}{SLAB}tc`` and ``{layout}{SLAB}tc16``, and at K = 64 ``{layout}128tc16``)."""
    mma = tuple(f"{layout}{slab}tc{'' if chunk == 8 else chunk}" for k, slab, chunk in MMA_BUILDS
                if k == K and V % slab == 0) if multi else ()
    if layout == "kv":
        chunked = zip(KV_CHUNKED_VARIANTS, KV_CHUNKED_TILINGS) if multi else ()
        return tuple(n for n, (c, _) in (*zip(KV_VARIANTS, KV_TILINGS), *chunked) if V % c == 0) + mma
    chunked = zip(VK_CHUNKED_VARIANTS, VK_CHUNKED_ROWS) if multi and K == VK_CHUNKED_K else ()
    chunked = tuple(n for n, rows in chunked if V % rows == 0)
    return tuple(n for n, (r, w) in zip(VK_VARIANTS[K], VK_TILINGS[K]) if V % _vk_rows(K, r, w) == 0) + chunked + mma


def _vk_rows(K, r, w):
    return r * w * (128 // K)


def _mma_geometry(variant):
    """``(SLAB, tokens a pass)`` of a tensor-core variant, ``{layout}{SLAB}tc[16]``."""
    slab, chunk = variant[2:].split("tc")
    return int(slab), int(chunk or 8)


def mma_stage_bytes(K, slab, separate_p, chunk):
    """Bytes of ``MmaStage<K, SLAB, SEPARATE_P, SUBS>`` (kernels_cu/delta_rule_mma.cu), the tensor-core
    kernel's dynamic shared memory, from the struct's layout (test_build checks it against NVRTC's
    ``sizeof``)."""
    subs, planes, ks = chunk // 8, 3 if separate_p else 2, K // 64
    nt = 32 * slab // 16 * ks
    passes, ev = chunk * K // nt // 4, chunk * slab // nt
    fragments = subs * (K // 8) * (planes + 1) * 32 * 8          # x and kw, two values each
    ring = 2 * planes * passes * nt * 8 + 2 * (nt * ev // 2) * 4  # MmaRing: qkp, v
    part = slab // 16 * ks * 2 * subs * 32 * 16
    gram = ks * (4 if subs == 1 else 9) * 32 * 16
    coefficients = -(-(3 * 64 + 3 * 8 + 1) * 4 // 16) * 16  # ChunkCoefficients, 16-byte aligned
    rest = chunk * (slab + 4) * 4 + 2 * chunk * 4 + subs * coefficients  # v (padded rows), e and beta, coefficients
    total = fragments + -(-ring // 16) * 16 + part + gram + rest
    return -(-total // 16) * 16


# The T-token rules below come from the sweeps of 2026-11-30 (third session; benchmarks.md, "Tilings"):
# Gated DeltaNet from a state, bf16, graph replay, H = 16, V = 128, one H200.

#: T-token passes of this many tokens run the chunked kernels (4 tokens a pass over the state): "kv"
#: with 64-column slabs at K = 64 over any number of heads and at K = 128 over more than
#: MMA_MAX_HEADS heads, "vk" with 64-row slabs at K = 128 over at most MMA_MAX_HEADS heads.  kv at K
#: = 64 (bench-h200-forward-lowT.json, -smallT.json): T = 2 / 3 / 4 in 169.1 / 187.6 / 203.9 us at
#: B*H = 8192 against 173.2 / 204.4 / 236.4 us for the token loop, 6.8 / 7.2 / 7.6 against 7.4 / 8.8
#: / 10.4 us at 256, and T = 2 / 4 in 4.0 / 4.7 against 4.5 / 7.2 us over 16 heads; at K = 128, T =
#: 2 in 268.8 against 294.3 us over 8192 heads.  vk over 128 heads (-vkchunked.json): T = 2 / 3 / 4
#: in 7.1 / 7.1 / 7.2 against 7.3 / 8.7 / 10.0 us for the token loop (over 16 heads T = 3 / 4 in 5.1 /
#: 5.2 against 5.6 / 6.7 us, T = 2 in 5.0 against 4.4).
CHUNKED_T = range(2, 5)

#: The same for kv at K = 128 over at most MMA_MAX_HEADS heads, where the token loop leads at T = 2
#: (4.6 against 5.3 us over 16 heads, 6.8 against 7.3 over 128; -threshold.json, -smallT.json), and
#: for the 32-column (32-row) slabs.
CHUNKED_FEW_HEADS_T = range(3, 5)

#: "vk" T-token passes at K = 128 over more than MMA_MAX_HEADS heads run the chunked kernel for
#: this many tokens, ahead of the tensor-core kernel (bench-h200-forward-vkchunked.json, B*H = 8192:
#: T = 2 / 4 in 272.2 / 276.9 us; from T = 9 the 16-token passes lead, T = 9 / 12 in 556.9 / 564.7
#: against 565.6 / 591.2 us; over 256 heads the two are within 2 % at T = 9-12).  Since the ninth
#: session's bank-conflict fix the 8-token tensor-core passes take T = 8 (bench-h200-forward-vk5to8.json,
#: B*H = 8192: 406.5 against 419.3 us), tie at T = 6-7 (408.4 / 408.6 against 405.5 / 409.3 us) and
#: trail at T = 5 (406.2 against 391.0 us).
VK_CHUNKED_MANY_HEADS_T = range(2, 8)

#: T-token passes of at least MMA_MIN_T tokens run the tensor-core kernel, in either layout, over at
#: most MMA_MAX_HEADS heads (B*H) and, when V is a multiple of 64, over more.  With few heads the GPU
#: waits on each token's latency, and the tensor-core kernel takes 8 tokens a step: at T = 5 it led
#: every case over 16-128 heads, 4.5-8.9 against 7.9-11.4 us for the token loop
#: (bench-h200-forward-fewheadsT5.json), and every longer one measured (-small.json, -smallT.json,
#: -threshold.json).  Over more heads (-manyheads.json, -manyheads-256.json) it is within 6.4 % of the
#: best kernel from T = 5 where the chunked vk kernel does not run (kv, K = 128, T = 9, 256 heads: 21.6
#: against 20.3 us for the token loop).  Only its 64-column slabs there: at 8192 heads the 32-column
#: ones ran 1.15-1.22x slower at K = 128 (-tilings.json).
MMA_MIN_T = 5
MMA_MAX_HEADS = 128

#: The vk layout at K = 64 (no chunked vk kernel) runs the tensor-core kernel from this many tokens:
#: T = 4 in 225.6 against 246.7 us for the token loop at B*H = 8192, 6.3 against 8.6 us over 128
#: heads, 11.0 against 10.9 us over 256; at T = 3 the token loop leads over many heads, 214.1 against
#: 225.6 us at 8192 and 9.2 against 11.3 us at 256 (-lowT.json, -smallT.json).  Over at most
#: MMA_MAX_HEADS heads it runs from T = 3 (VK64_MMA_MIN_T_FEW; ninth session, -fewT2to5.json: 4.6
#: against 6.2 us for the token loop over 16 heads, 6.3 against 7.2 us over 128); at T = 2 the two
#: are within 0.3 us over 16 heads and the token loop leads over 128 (5.7 against 6.4 us).
VK64_MMA_MIN_T = 4
VK64_MMA_MIN_T_FEW = 3

#: Over at most MMA_NARROW_MAX_HEADS heads the tensor-core kernel takes 32-column slabs at K = 128, twice
#: the CTAs on a GPU those heads leave mostly idle (bench-h200-forward-small.json, K = 128, T = 512: 136.1
#: against 178.4 us over 16 heads and 136.3 against 174.4 us over 32 (kv), 136.2 / 136.7 against 181.3 /
#: 175.9 us (vk); over 64 heads the two are within 5 % either way, over 128 the 64-column slabs lead,
#: 230.6 against 377.7 us).  At K = 64 a 32-column CTA is two warps, and the 64-column slabs lead with
#: 16-token chunks (16 heads, T = 512: 91.6 against 119.1 us, -mma16-few.json; with 8-token chunks the
#: two are within 3 %).
MMA_NARROW_MAX_HEADS = 32

#: The tensor-core kernel takes 16 tokens a pass (``...tc16``: two chunks of 8 share one read of the
#: state) when MMA16_COST passes of 16 cost less than MMA8_COST passes of 8: about the ratio of one
#: pass of each over 8192 heads at K = V = 128 (bench-h200-forward-mma16.json, kv: 366 against 215 us
#: a pass from T = 16 to 64).  So at T = 9-16 (kv 588.4-594.7 against 610.9-616.6 us), not at 17-24
#: (T = 24: 949.7 against 835.0 us), at 25-32, even at 33-40 (T = 40: 1311.8 against 1268.1 us), and
#: from 41 on (T = 64: 1691.5 against 1912.9 us); likewise in vk, at K = 64 and over 256 heads.
#: Over 16-128 heads (-mma16-few.json) it leads or ties from T = 16 (16 heads, T = 512: 120.7 against
#: 136.8 us at K = 128, 91.6 against 121.7 us at K = 64); near misses at T = 9 (16 heads, K = 64: 7.2
#: against 6.5 us).  With an fp32 among q, k, p the ``...tc16`` variants run 8-token chunks (launch).
MMA16_COST, MMA8_COST = 5, 3

# At K = 64 with V a multiple of 128, the 16-token passes take the wide slab (``{layout}128tc16``, one
# 256-thread CTA a V = 128 head, which stages and solves each chunk once where two 64-column CTAs each
# did) over more than MMA_MAX_HEADS heads (bench-h200-forward-widek64.json, ninth session, kv: 246.8
# against 270.9 us at T = 16 and 4762.9 against 5469.2 us at T = 512 over 8192 heads; 9.5 against 13.1
# and 162.0 against 243.5 us over 256; vk alike).  Over 128 heads the two tie (T = 512: 112.9 against
# 112.4 us kv, 113.1 against 110.9 us vk; 122.9 against 118.7 us kv in the seventh session's run); over
# 16 heads, half the CTAs cost 20-23 % (T = 512: 116.0 against 95.8 us kv).


def choose(layout, K, V, separate_p, multi=False, T=1, heads=None):
    """The variant for a shape, from the H200 sweeps (docs/benchmarks.md, "Tilings").

    Decode steps (and T-token passes no rule below takes): kv with 64-column slabs whenever V allows
    (256 contiguous bytes per row per warp-load), else 32-column slabs; 8 row groups for the decode
    step at K = 128 (16 float4 of state per thread, 128 threads), else 4 (the token loop: 64 threads
    holding 32 float4 each).  vk with two warps of 16 rows per lane (8 at K = 64 when V is not a
    multiple of 64).  The same tilings led at B*H = 128 and 1024 within a few percent, so the batch
    size does not enter.

    T-token passes (``multi``; ``heads`` = B*H, None means many), first rule that applies:

    * vk at K = 128: the chunked kernel, 64-row slabs, for :data:`CHUNKED_T` tokens (2 to 4) over
      at most :data:`MMA_MAX_HEADS` heads and :data:`VK_CHUNKED_MANY_HEADS_T` (2 to 7) over more;
      32-row slabs for :data:`CHUNKED_FEW_HEADS_T` (3, 4) when V is not a multiple of 64.
    * Either layout: the tensor-core kernel from :data:`MMA_MIN_T` tokens (vk at K = 64 from
      :data:`VK64_MMA_MIN_T`, from :data:`VK64_MMA_MIN_T_FEW` over at most :data:`MMA_MAX_HEADS`
      heads) over at most :data:`MMA_MAX_HEADS` heads, and over more when V is a multiple of 64;
      32-column slabs at K = 128 over at most :data:`MMA_NARROW_MAX_HEADS` heads,
      and whenever V is not a multiple of 64; 16 tokens a pass (``...tc16``) where fewer passes of
      16 cost less (:data:`MMA16_COST`): T = 9-16, 25-32 and from 41 on; those at K = 64 over more
      than :data:`MMA_MAX_HEADS` heads with 128-column slabs when V allows (:data:`MMA_WIDE_SLAB`).
    * kv: the chunked kernel, 64-column slabs, for :data:`CHUNKED_T` tokens, at K = 128 over at
      most :data:`MMA_MAX_HEADS` heads :data:`CHUNKED_FEW_HEADS_T`; 32-column slabs at K = 128 for
      :data:`CHUNKED_FEW_HEADS_T` when V is not a multiple of 64.
    """
    wide = V % 64 == 0
    few = heads is not None and heads <= MMA_MAX_HEADS
    if multi and layout == "vk" and K == VK_CHUNKED_K:
        if T in ((CHUNKED_T if few else VK_CHUNKED_MANY_HEADS_T) if wide else CHUNKED_FEW_HEADS_T):
            return "vk64c4" if wide else "vk32c4"
    mma_min_t = MMA_MIN_T
    if layout == "vk" and K == 64:
        mma_min_t = VK64_MMA_MIN_T_FEW if few else VK64_MMA_MIN_T
    if multi and T >= mma_min_t and (few or wide):
        narrow = not wide or (few and heads <= MMA_NARROW_MAX_HEADS and K == 128)
        sixteen = -(-T // 16) * MMA16_COST < -(-T // 8) * MMA8_COST
        if sixteen and not few and K == MMA_WIDE_K and V % MMA_WIDE_SLAB == 0:
            return f"{layout}{MMA_WIDE_SLAB}tc16"
        return f"{layout}{32 if narrow else 64}tc{16 if sixteen else ''}"
    if layout == "kv":
        if multi and wide and T in (CHUNKED_FEW_HEADS_T if K == 128 and few else CHUNKED_T):
            return "kv64x8c4"
        if multi and not wide and K == 128 and T in CHUNKED_FEW_HEADS_T:
            return "kv32x8c4"
        if not wide:
            return "kv32x8"
        return "kv64x8" if K == 128 and not multi else "kv64x4"
    return "vk16x2" if V % _vk_rows(K, 16, 2) == 0 else "vk8x2"


def launch(layout, variant, heads, K, V, separate_p, multi, device, f32_keys=False):
    """``(kernel, grid, block, shared_bytes)`` of one variant (``shared_bytes``: its dynamic shared
    memory); ``multi`` selects the kernel built for T != 1 (the chunked variants have only that
    build, whatever ``multi`` says).  ``f32_keys``: an fp32 among q, k, p, which the 16-token
    tensor-core variants run with 8-token chunks (their build holds the 16-bit path only: both
    paths in one kernel spill).

    ``device`` must be current (the launch plan makes it so: its ``Launch`` needs it too).
    """
    multi = multi or token_passes_only(variant)
    if variant not in variants(layout, K, V, multi):
        raise ValueError(f"variant {variant!r} cannot run a {layout!r} state with K={K}, V={V}"
                         f"{' over T tokens' if multi else ' for one step'}; "
                         f"expected one of {variants(layout, K, V, multi)}")
    if variant.endswith(("tc", "tc16")):
        slab, chunk = _mma_geometry(variant)
        if f32_keys:  # 8-token chunks; a slab with no 8-token build (the wide one) runs as 64-column ones
            slab, chunk = slab if (K, slab, 8) in MMA_BUILDS else 64, 8
        name = f"comba::delta_rule_mma<{K}, {slab}, {_flag(separate_p)}, {_flag(layout == 'vk')}, {chunk // 8}>"
        kernel, smem = get_kernel("delta_rule_mma", name, device), mma_stage_bytes(K, slab, separate_p, chunk)
        if kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        return kernel, (heads * (V // slab),), (2 * slab * K // 64,), smem
    if layout == "vk" and variant.endswith("c4"):
        rows = int(variant[2:-2])
        name = f"comba::delta_rule_vk_chunked<{K}, {rows}, {_flag(separate_p)}>"
        return get_kernel("delta_rule_vk_chunked", name, device), (heads * (V // rows),), (2 * rows,), 0
    a, b = (int(x) for x in variant[2:].removesuffix("c4").split("x"))
    if layout == "kv":
        name = f"comba::delta_rule_kv<{K}, {a}, {b}, {_flag(separate_p)}, {_flag(multi)}>"
        module = "delta_rule_kv"
        if variant.endswith("c4"):
            name, module = f"comba::delta_rule_kv_chunked<{K}, {a}, {b}, {_flag(separate_p)}>", "delta_rule_kv_chunked"
        grid, block = heads * (V // a), a // 4 * b
    else:
        name = f"comba::delta_rule_vk<{K}, {a}, {b}, {_flag(separate_p)}, {_flag(multi)}>"
        module = "delta_rule_vk"
        grid, block = heads * (V // _vk_rows(K, a, b)), 32 * b
    return get_kernel(module, name, device), (grid,), (block,), 0
