"""Which kernel tiling runs a shape (kernels_cu/delta_rule.cu, kernels_cu/delta_rule_mma.cu; data:
benchmarks/sweep_decode.py and benchmarks/sweep_forward_tilings.py).

Variant names: ``kv{COLS}x{RG}`` -- ``delta_rule_kv``, a CTA per COLS-column slab of a
head with RG row groups; ``vk{R}x{NW}`` -- ``delta_rule_vk``, NW warps whose lanes hold
R state rows each.  The same kernels run one decode step and T-token forward passes.
Three families exist only for T-token passes: ``kv{COLS}x{RG}c4`` (``delta_rule_kv_chunked``,
4 tokens a pass over the state), ``kv{COLS}cc`` (``delta_rule_kv_columns``, K = 64 only: the
same 4-token chunks with a thread per state column) and ``{layout}{SLAB}tc``
(``delta_rule_mma``, a CTA per SLAB value columns, 8-token chunks on tensor cores).
"""

from ._build import (
    KV_CHUNKED_TILINGS, KV_COLUMN_K, KV_COLUMN_SLABS, KV_TILINGS, MMA_SLABS, VK_TILINGS, get_kernel, _flag,
)

KV_VARIANTS = tuple(f"kv{c}x{r}" for c, r in KV_TILINGS)
KV_CHUNKED_VARIANTS = tuple(f"kv{c}x{r}c4" for c, r in KV_CHUNKED_TILINGS)
VK_VARIANTS = {K: tuple(f"vk{r}x{w}" for r, w in VK_TILINGS[K]) for K in VK_TILINGS}
KV_COLUMN_VARIANTS = tuple(f"kv{c}cc" for c in KV_COLUMN_SLABS)
MMA_VARIANTS = {layout: tuple(f"{layout}{slab}tc" for slab in MMA_SLABS) for layout in ("kv", "vk")}


def token_passes_only(variant):
    """Whether ``variant`` exists only as a T-token build (no decode build): the chunked kernels,
    ``...c4``, ``...cc`` and ``...tc``."""
    return variant.endswith(("c4", "tc", "cc"))


def variants(layout, K, V, multi=False):
    """The variants that can run a ``layout`` state with head sizes K, V (``multi``: T-token passes,
    which also have the chunked kv kernels, ``kv{COLS}x{RG}c4`` and at K = 64 ``kv{COLS}cc``, and
    the tensor-core kernels, ``{layout}{SLAB}tc``)."""
    mma = tuple(n for n, slab in zip(MMA_VARIANTS[layout], MMA_SLABS) if V % slab == 0) if multi else ()
    if layout == "kv":
        chunked = zip(KV_CHUNKED_VARIANTS, KV_CHUNKED_TILINGS) if multi else ()
        columns = zip(KV_COLUMN_VARIANTS, KV_COLUMN_SLABS) if multi and K == KV_COLUMN_K else ()
        columns = tuple(n for n, c in columns if V % c == 0)
        return tuple(n for n, (c, _) in (*zip(KV_VARIANTS, KV_TILINGS), *chunked) if V % c == 0) + mma + columns
    return tuple(n for n, (r, w) in zip(VK_VARIANTS[K], VK_TILINGS[K]) if V % _vk_rows(K, r, w) == 0) + mma


def _vk_rows(K, r, w):
    return r * w * (128 // K)


#: "kv" T-token passes of this many tokens run the chunked kernel at K = 128 (benchmarks.md,
#: "Tilings"; at K = 64 the column kernel takes them over many heads, the token loop over few; from
#: T = 5 the tensor-core kernel or the token loop, bench-h200-forward-manyheads.json).
CHUNKED_T = range(3, 5)

#: The same over more than MMA_MAX_HEADS heads with 64-column slabs, where 2-token passes run chunked
#: too (bench-h200-forward-lowT.json: 292.4 against 299.5 us for the token loop at B*H = 8192, 12.9
#: against 14.1 us at 256; bench-h200-forward-threshold.json: over 16 heads the token loop leads,
#: 4.7 against 5.4 us, and bench-h200-forward-smallT.json, 7.7 against 8.7 us over 128).
CHUNKED_MANY_HEADS_T = range(2, 5)

#: T-token passes of at least MMA_MIN_T tokens over at most MMA_MAX_HEADS heads (B*H) run the
#: tensor-core kernel, in either layout: with few heads the GPU waits on each token's latency,
#: and the tensor-core kernel takes 8 tokens a step (benchmarks.md, "Tilings": it led every case
#: of T = 6-512 at B*H = 16-128).
MMA_MIN_T = 6
MMA_MAX_HEADS = 128

#: Over more heads the tensor-core kernel runs T-token passes of at least MMA_MANY_HEADS_MIN_T
#: tokens (bench-h200-forward-manyheads*.json, B*H = 256 and 8192, both layouts, K = 64 and 128:
#: from T = 5 it is within 2.3 % of the best kernel in every case and the best in all but kv at K =
#: 128, T = 9, 8192 heads and vk at K = 128, T = 5, 256 heads; at T = 3 and 4 the chunked, column or
#: token-loop kernels lead at 8192 heads).  Only its 64-column slabs: at 8192 heads the 32-column ones
#: ran 1.15-1.22x slower at K = 128 and within 6 % either way at K = 64 (bench-h200-forward-tilings.json).
MMA_MANY_HEADS_MIN_T = 5

#: "kv" T-token passes at K = 64 of at least COLUMN_MIN_T tokens (and fewer than the tensor-core
#: kernel takes, where V allows it) over more than MMA_MAX_HEADS heads run the column kernel
#: (``kv{COLS}cc``; bench-h200-forward-lowT.json: at T = 3 and 4, 198-199 us against 205-238 us for
#: the token loop and 248-249 us for the tensor-core kernel at B*H = 8192; at T = 2 the token loop is
#: 8 % faster).
COLUMN_MIN_T = 3


def choose(layout, K, V, separate_p, multi=False, T=1, heads=None):
    """The variant for a shape, from the H200 sweeps (docs/benchmarks.md, "Tilings").

    kv: 64-column slabs whenever V allows (256 contiguous bytes per row per warp-load), else
    32-column slabs.  The decode step takes 8 row groups at K = 128 (16 float4 of state per
    thread, 128 threads) and 4 at K = 64.  T-token passes (``multi``) of 3 or 4 tokens
    (:data:`CHUNKED_T`) at K = 128 run the chunked kernel (4 tokens per pass over the state), and
    over more than :data:`MMA_MAX_HEADS` heads with 64-column slabs those of
    :data:`CHUNKED_MANY_HEADS_T` (2 to 4); the others the token loop with 4 row groups (64 threads
    holding 32 float4 each).
    vk: two warps of 16 rows per lane (8 at K = 64 when V is not a multiple of 64).  The same
    tilings led at B*H = 128 and 1024 within a few percent, so the batch size does not enter.
    Either layout: T-token passes of at least :data:`MMA_MIN_T` tokens over at most
    :data:`MMA_MAX_HEADS` heads (``heads`` = B*H; None means many) run the tensor-core kernel, and
    over more heads those of T >= :data:`MMA_MANY_HEADS_MIN_T` when V is a multiple of 64.
    kv at K = 64: the other passes of at least :data:`COLUMN_MIN_T` tokens over more heads run the
    column kernel, 128-column slabs when V allows.
    """
    wide = V % 64 == 0
    few = heads is not None and heads <= MMA_MAX_HEADS
    if multi and (T >= MMA_MIN_T if few else wide and T >= MMA_MANY_HEADS_MIN_T):
        return f"{layout}{64 if wide else 32}tc"
    if layout == "kv":
        if multi and wide and K == KV_COLUMN_K and T >= COLUMN_MIN_T and (heads is None or heads > MMA_MAX_HEADS):
            return "kv128cc" if V % 128 == 0 else "kv64cc"
        if multi and K == 128 and T in (CHUNKED_MANY_HEADS_T if wide and not few else CHUNKED_T):
            return "kv64x8c4" if wide else "kv32x8c4"
        if not wide:
            return "kv32x8"
        return "kv64x8" if K == 128 and not multi else "kv64x4"
    return "vk16x2" if V % _vk_rows(K, 16, 2) == 0 else "vk8x2"


def launch(layout, variant, heads, K, V, separate_p, multi, device):
    """``(kernel, grid, block)`` of one variant; ``multi`` selects the kernel built for T != 1
    (the chunked variants have only that build, whatever ``multi`` says).

    ``device`` must be current (the launch plan makes it so: its ``Launch`` needs it too).
    """
    multi = multi or token_passes_only(variant)
    if variant not in variants(layout, K, V, multi):
        raise ValueError(f"variant {variant!r} cannot run a {layout!r} state with K={K}, V={V}"
                         f"{' over T tokens' if multi else ' for one step'}; "
                         f"expected one of {variants(layout, K, V, multi)}")
    if variant.endswith("tc"):
        slab = int(variant[2:-2])
        name = f"comba::delta_rule_mma<{K}, {slab}, {_flag(separate_p)}, {_flag(layout == 'vk')}>"
        return get_kernel("delta_rule_mma", name, device), (heads * (V // slab),), (2 * slab * K // 64,)
    if variant.endswith("cc"):
        cols = int(variant[2:-2])
        name = f"comba::delta_rule_kv_columns<{K}, {cols}, {_flag(separate_p)}>"
        return get_kernel("delta_rule_kv_columns", name, device), (heads * (V // cols),), (cols,)
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
    return get_kernel(module, name, device), (grid,), (block,)
