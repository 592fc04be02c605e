"""The kernel families: every specialisation that is compiled, by variant name, with its launch geometry.

This is the one place where the Python side describes the CUDA kernels.  A *variant* names one
tiling of one family; :mod:`cupy_comba.tiling` picks one per shape, and the ops take
``variant=`` to force one (benchmarks and tests).  Each family's source file opens with its math,
layouts and launch geometry.

========================  =============================  ============================================
variant                   kernel (``comba::``)           a CTA holds
========================  =============================  ============================================
``kv{COLS}x{RG}``         ``delta_rule_kv``              COLS value columns of a "kv" state, RG row
                          (``token_loop.cu``)            groups; one token at a time
``kv{COLS}w``             ``delta_rule_kv_warp``         COLS value columns of a "kv" state in one warp;
                          (``token_loop.cu``)            the decode step only
``vk{R}x{NW}``            ``delta_rule_vk``              R x NW x max(1, 128 / K) rows of V of a "vk"
                          (``token_loop.cu``)            state, NW warps; one token at a time (``vk4x2``:
                                                         the decode step only; ``vk8x8``: T-token passes
                                                         only)
``kv{COLS}x{RG}c4``       ``delta_rule_kv_chunked``      as ``kv{COLS}x{RG}``, 4 tokens a pass over the
                          (``chunked.cu``)               state (T-token passes only)
``vk{ROWS}c4``            ``delta_rule_vk_chunked``      ROWS rows of V, 4 tokens a pass (K = 128,
                          (``chunked.cu``)               T-token passes only)
``{layout}{SLAB}tc``      ``delta_rule_mma``             SLAB value columns, 8 tokens a pass on the
                          (``delta_rule_mma.cu``)        tensor cores (T-token passes only)
``{layout}{SLAB}tc16``    ``delta_rule_mma``             the same, 16 tokens (two chunks of 8) a pass;
                                                         at K = 64 also SLAB = 128
``{layout}{SLAB}c64``     ``prefill_prep``, then         SLAB value columns, chunk after chunk of 64
                          ``prefill_scan``               tokens on the tensor cores, from coefficients
                          (``prefill.cu``)               ``prefill_prep`` forms for every chunk at once
``{layout}{SLAB}c64wg``   ``prefill_prep``, then         the same on Hopper's warpgroup MMA (bf16
                          ``prefill_scan_wg``            q, k, p and products; compute capability 9.0)
                          (``prefill_wgmma.cu``)
``{layout}64c64wt``       ``prefill_prep`` (ACC 6),      64 value columns as the rows of S^T, the state
                          then ``prefill_scan_wt``       and the chunk's corrections kept in registers
                          (``prefill_transposed.cu``)    from chunk to chunk (bf16, compute cap. 9.0)
``{layout}64c64sg``       ``prefill_prep`` (ACC 6),      the same over one segment of a row's chunks,
                          then ``prefill_scan_wt``       from the state that the segments before it
                          twice: chain, segments         leave (a dense batch over a few heads)
``{layout}128c64wt``,     the same two                   128 value columns on two warpgroups, which
``{layout}128c64sg``                                     share each chunk's staged keys and record
========================  =============================  ============================================

The token-loop kernels have two builds: the decode step (one token from a given state to a
written state, no token loop) and the T-token build (``multi``).  The decode step is also built for
one activation dtype (``act``: q, k, p, v and o all bf16, fp16 or fp32), which a call whose
activations agree runs.  Every build has a twin with the serving options (``serving``: a state pool,
in-kernel gating), compiled when a call uses them.

>>> from cupy_comba import families
>>> families.variants("kv", 128, 128)
('kv64x8', 'kv64x4', 'kv32x8', 'kv32x16', 'kv16x32', 'kv16w', 'kv8w')
>>> k = families.kernel("kv", "kv64x8", K=128, separate_p=True, multi=False, act=2)
>>> k.expression, k.block, k.grid(B=32, H=16, V=128)
('comba::delta_rule_kv<128, 64, 8, true, false, 2, false>', 128, (1024, 1, 1))
"""

import itertools
from typing import NamedTuple

#: Head sizes K: every family is built for the first two; K = 256 has the token loops and the prefill kernels.
SUPPORTED_K = (64, 128, 256)
#: Head sizes the chunked and the tensor-core families are built for.
FAMILY_K = (64, 128)
#: Slabs (value columns a CTA) of the 64-token prefill kernels, built at every K.
PREFILL_SLABS = (32, 16)
#: The prefill kernels' numerics, by ``precision``: TF32 products ("tf32"), split operands ("fp32",
#: 3xTF32), each with bf16 q, k, p or wider ones, or every product on bf16 operands ("bf16", bf16 keys; else
#: "tf32") (the template argument ACC of kernels_cu/prefill.cuh).
PRECISIONS = ("tf32", "fp32", "bf16")
#: Tokens a chunk, and 32-bit words of a chunk's record in the prefill workspace (Record<ACC>::SIZE in
#: kernels_cu/prefill.cuh): A's and Mq's fragments as TF32 tiles of 16 x 8, or as bf16 tiles of 16 x 16 ("bf16").
PREFILL_CHUNK, PREFILL_RECORD, PREFILL_RECORD_BF16 = 64, 2 * 20 * 32 * 4 + 256, 2 * 10 * 32 * 4 + 256


#: The compute capability whose arch-specific target (sm_90a) holds the wgmma scan (``{layout}{SLAB}c64wg``).
WGMMA_CAPABILITY = "90"


#: The families built for that target only: the wgmma scans.
WGMMA_FAMILIES = ("prefill_scan_wg", "prefill_scan_wt")

#: prefill_scan_wt's PART (``WtPart``, kernels_cu/prefill_transposed.cu): the whole scan, the segmented scan's
#: chain, its segments.
WT_WHOLE, WT_CHAIN, WT_SEGMENTS = 0, 1, 2

#: Warpgroups a CTA of the transposed scan (``{layout}{64 WGS}c64wt`` / ``sg``): one on a slab of 64 value columns,
#: or two on 128 sharing each chunk's staged keys and record.
WT_WARPGROUPS = (1, 2)


def runs_wgmma(compute_capability):
    """Whether a GPU of ``compute_capability`` (CuPy's spelling, ``"90"``) runs the wgmma scan."""
    return compute_capability == WGMMA_CAPABILITY


def prefill_record(acc):
    """32-bit words of a chunk's record for the prefill kernels' ACC (Record<ACC>::SIZE): bf16 tiles at ACC 4 and 5."""
    return PREFILL_RECORD_BF16 if acc in (4, 5) else PREFILL_RECORD


def _flag(x):
    return "true" if x else "false"


class Tiling(NamedTuple):
    """One variant of one family at one K."""

    variant: str        #: e.g. ``"kv64x8"``
    layout: str         #: ``"kv"`` or ``"vk"``
    K: int
    family: str         #: the ``__global__`` template, in namespace ``comba``
    source: str         #: its file in ``kernels_cu/``
    args: tuple         #: template arguments between K and the flags (prefill_scan_wt: PART and WGS, after them)
    slab: int           #: value columns (or rows of V) a CTA holds: V must be a multiple
    threads: int        #: threads a CTA
    tokens: int         #: tokens a pass over the state: 1 (token loop), 4 (chunked), 8 or 16, 64 (prefill)
    passes_only: bool   #: built for T-token passes only (no decode build)
    decode_only: bool = False  #: built for the decode step only (no T-token build)


class Kernel(NamedTuple):
    """One specialisation: what NVRTC compiles and how it is launched."""

    source: str
    expression: str     #: the name expression compiled: ``comba::delta_rule_kv<128, 64, 8, true, false, 2, false>``
    slab: int
    block: int
    shared_bytes: int   #: dynamic shared memory a CTA
    prep: str = ""      #: a kernel launched first with the same arguments (the prefill family's)
    prep_shared_bytes: int = 0  #: its dynamic shared memory a CTA
    prep_block: int = 0         #: its threads a CTA (its grid: a CTA a chunk slot and value head)
    record_words: int = 0       #: 32-bit words of its workspace a chunk slot and value head
    key_pad: int = 16           #: elements past the key axis in a staged key row (its bulk copies' box width)
    grid3: bool = False         #: a grid of (b, h, slab) rather than of B * H * slabs CTAs in x (the tilings for a
                                #: decode step over a few heads; Params::grid3)
    swizzled_keys: bool = False  #: q, k, p and v rows in 128-byte swizzled boxes of 64 elements (prefill_scan_wt's
                                 #: maps)
    chain: str = ""             #: the segmented scan's first launch after the prep: each segment's map
    chain_shared_bytes: int = 0  #: its dynamic shared memory a CTA
    chain_block: int = 128      #: its threads a CTA (128 a warpgroup)
    ring_shared_bytes: int = 0  #: ``shared_bytes`` with room for a third stage (prefill_scan_wg), 0: none
    dependent: bool = True      #: launched as a programmatic dependent of the kernel before it on compute
                                #: capability 9.0 (the prefill family's scans after the prep, the segmented scan's
                                #: chain and segments; not where that measured slower: _plan.ALL_DEPENDENT)
    prep_lean_bytes: int = 0    #: the prep's dynamic shared memory where p is k (Gated DeltaNet stages no rows of
                                #: p: five CTAs an SM where Comba's take four), 0 for Comba; _plan.LEAN_PREP_WAVE
                                #: says where

    def grid(self, B, H, V):
        """The launch's grid ``(x, y, z)`` for B x H heads of V value columns: one CTA a slab of a head."""
        slabs = V // self.slab
        return (B, H, slabs) if self.grid3 else (B * H * slabs, 1, 1)

    def segment_grids(self, B, T, H, K, V, segments, per, ragged):
        """The segmented scan's two grids and the number of segment maps its workspace holds, over B rows of T
        tokens (B sequences packed into T where ``ragged``) cut into ``segments`` of ``per`` chunks
        (kernels_cu/prefill_transposed.cu, "Segments"): the chain's grid (a CTA a map, head and 64 of the V + K columns
        of the map a warpgroup of its ``chain_block`` threads) and the segments' (a CTA a segment, head and slab).
        A dense row has a map a segment but the last; a ragged batch numbers its sequences' segments in packed
        order, below ``(T // 64 + B) // per + B``, the segments' grid runs a CTA a number (those of no segment exit)
        and the chain's a CTA a number but the highest (a last segment where it names one).

        >>> k = kernel("kv", "kv64c64sg", K=128, separate_p=True, multi=True, precision="bf16")
        >>> k.segment_grids(2, 4096, 16, 128, 128, 4, 16, False)  # 2 x 3 maps
        ((384, 1, 1), (256, 1, 1), 6)
        >>> k.segment_grids(2, 8192, 16, 128, 128, 4, 16, True)   # numbers 0 .. 9
        ((576, 1, 1), (320, 1, 1), 9)
        """
        chain_cols = 64 * (self.chain_block // 128)
        numbers = prefill_slots(B, T, True) // per + B if ragged else 0
        maps = numbers - 1 if ragged else B * (segments - 1)
        rows = numbers if ragged else B * segments
        return (maps * H * ((V + K) // chain_cols), 1, 1), self.grid(rows, H, V), maps

    def segment_words(self, K, V):
        """32-bit words of the workspace a segment map and value head past the records: E (K x V fp32) and M
        (K x K bf16)."""
        return K * V + K * K // 2


def prefill_slots(B, T, ragged):
    """Chunk slots of a prefill workspace (kernels_cu/prefill.cuh, "Workspace"): ``B * ceil(T / 64)``
    for a dense batch, ``floor(T / 64) + B`` for B sequences packed into T tokens."""
    return T // PREFILL_CHUNK + B if ragged else B * -(-T // PREFILL_CHUNK)


# -- the tilings ------------------------------------------------------------------------------

#: ``delta_rule_kv`` (COLS, RG): thread (lc, rg) holds the float4 of columns 4 lc .. 4 lc + 3 in rows rg, rg + RG, ...
KV_TILINGS = ((64, 8), (64, 4), (32, 8), (32, 16), (16, 32))
#: The same at K = 256: twice the row groups, so that a thread holds at most 16 float4 of state.
KV256_TILINGS = ((64, 16), (32, 16), (16, 32))
#: ``delta_rule_kv_chunked`` (COLS, RG): those whose state, column sums and staging fit the registers.
KV_CHUNKED_TILINGS = ((64, 8), (32, 8))
#: ``delta_rule_kv_warp`` value columns a CTA (one warp), by K: built for the decode step only, over a few heads.
KV_WARP_COLS = {64: (16, 8), 128: (16, 8)}
#: ``delta_rule_vk`` (R, NW) by K: NW warps, R state rows a lane (at K = 256 two float4 of a row each, so
#: that a lane holds 16 float4 of state at every K).
VK_TILINGS = {64: ((8, 2), (16, 2)), 128: ((16, 2), (16, 4)), 256: ((8, 2), (8, 4))}
#: ``delta_rule_vk`` tilings built for the decode step only, by K: 8 rows of V a CTA over few heads (the T-token
#: passes take other kernels there, and ptxas spills 4 bytes in this one's T-token build).
VK_DECODE_TILINGS = {128: ((4, 2),)}
#: ``delta_rule_vk`` tilings built for T-token passes only, by K: eight warps of 8 rows a lane, for speculative
#: verify, which stores the state after every token.
VK_PASS_TILINGS = {128: ((8, 8),)}
#: ``delta_rule_vk_chunked`` slabs (rows of V) and the one K it is built for (8 lanes of 16 keys a row).
VK_CHUNKED_ROWS, VK_CHUNKED_K = (64, 32), 128
#: ``delta_rule_mma`` builds: (K, SLAB, tokens a pass).  The 128-column slab exists at K = 64 with
#: 16-token passes only: the same 8-warp CTA as a 64-column slab at K = 128 (8-token chunks do not
#: divide among its threads).
MMA_BUILDS = tuple((K, slab, tokens) for K in FAMILY_K for slab in (64, 32) for tokens in (8, 16)) + ((64, 128, 16),)


def _mma_name(layout, slab, tokens):
    return f"{layout}{slab}tc{'' if tokens == 8 else tokens}"


def _all_tilings():
    out = []
    for K in SUPPORTED_K:
        out += [Tiling(f"kv{c}x{r}", "kv", K, "delta_rule_kv", "token_loop.cu", (c, r), c, c // 4 * r, 1, False)
                for c, r in (KV256_TILINGS if K == 256 else KV_TILINGS)]
        out += [Tiling(f"kv{c}w", "kv", K, "delta_rule_kv_warp", "token_loop.cu", (c,), c, 32, 1, False, True)
                for c in KV_WARP_COLS.get(K, ())]
        out += [Tiling(f"vk{r}x{w}", "vk", K, "delta_rule_vk", "token_loop.cu", (r, w), r * w * max(1, 128 // K),
                       32 * w, 1, passes, decode)
                for tilings, passes, decode in ((VK_TILINGS, False, False), (VK_DECODE_TILINGS, False, True),
                                                (VK_PASS_TILINGS, True, False))
                for r, w in tilings.get(K, ())]
        if K not in FAMILY_K:
            continue
        out += [Tiling(f"kv{c}x{r}c4", "kv", K, "delta_rule_kv_chunked", "chunked.cu", (c, r), c, c // 4 * r, 4, True)
                for c, r in KV_CHUNKED_TILINGS]
        if K == VK_CHUNKED_K:
            out += [Tiling(f"vk{rows}c4", "vk", K, "delta_rule_vk_chunked", "chunked.cu", (rows,), rows, 2 * rows, 4,
                           True) for rows in VK_CHUNKED_ROWS]
        for k, slab, tokens in MMA_BUILDS:
            if k == K:
                out += [Tiling(_mma_name(layout, slab, tokens), layout, K, "delta_rule_mma", "delta_rule_mma.cu",
                               (slab,), slab, 2 * slab * K // 64, tokens, True) for layout in ("kv", "vk")]
    for K in SUPPORTED_K:
        out += [Tiling(f"{layout}{slab}c64", layout, K, "prefill_scan", "prefill.cu", (slab,), slab, 256,
                       PREFILL_CHUNK, True) for layout in ("kv", "vk") for slab in PREFILL_SLABS]
    for K in FAMILY_K:
        out += [Tiling(f"{layout}{slab}c64wg", layout, K, "prefill_scan_wg", "prefill_wgmma.cu", (slab,), slab, 128,
                       PREFILL_CHUNK, True) for layout in ("kv", "vk") for slab in PREFILL_SLABS]
        out += [Tiling(f"{layout}{64 * wgs}c64{name}", layout, K, "prefill_scan_wt", "prefill_transposed.cu",
                       (part, wgs), 64 * wgs, 128 * wgs, PREFILL_CHUNK, True)
                for wgs in WT_WARPGROUPS for layout in ("kv", "vk")
                for name, part in (("wt", WT_WHOLE), ("sg", WT_SEGMENTS))]
    return tuple(out)


#: Every tiling, in the order :func:`variants` lists them.
TILINGS = _all_tilings()
_BY_NAME = {(t.layout, t.K, t.variant): t for t in TILINGS}


def variants(layout, K, V, multi=False, token_loop=False):
    """The variants that can run a ``layout`` state with head sizes K, V; ``multi``: T-token passes,
    which also have the chunked and tensor-core families; ``token_loop``: only the token-loop
    family, the one that forms the state after every token (speculative verify keeps them all)."""
    return tuple(t.variant for t in TILINGS
                 if t.layout == layout and t.K == K and V % t.slab == 0
                 and not (t.decode_only if multi else t.passes_only)
                 and (not token_loop or t.tokens == 1))


def tiling(layout, K, variant):
    """The :class:`Tiling` of a variant name (ValueError naming the known ones)."""
    t = _BY_NAME.get((layout, K, variant))
    if t is None:
        known = sorted({t.variant for t in TILINGS if t.layout == layout and t.K == K})
        raise ValueError(f"variant must name a {layout!r} tiling at K={K}, one of {known}; got {variant!r}")
    return t


def _dependent(K, warpgroups, segmented=False):
    """Whether a prefill scan of ``warpgroups`` warpgroups a CTA launches as its prep's programmatic dependent
    (compute capability 9.0; the segmented scan's chain as the prep's and its segments as the chain's): not at
    K = 64 on one warpgroup a CTA, and in segments only on two at K = 128.  At K = 64 on one warpgroup the wgmma
    scan took 1.14-1.30 times as long so over 1-32 heads from T = 512, and the transposed scan's 64-column CTAs
    1.09-1.18 over 64 heads from T = 320; the transposed scan's pairs 0.97-1.00 of their time.  In segments at
    K = 128 one warpgroup a CTA took up to 1.19 times as long so, two 0.97-1.00 (h200-prefill-launches.json;
    docs/design.md, "Host path")."""
    if segmented:
        return K == 128 and warpgroups > 1
    return K != 64 or warpgroups > 1


def kernel(layout, variant, *, K, separate_p, multi, f32_keys=False, serving=False, precision="fp32",
           bf16_keys=None, act=None):
    """The specialisation that runs ``variant``.

    ``separate_p``: Comba (a read key p apart from k); ``multi``: the T-token build (the chunked
    and tensor-core families have only that one); ``f32_keys``: an fp32 among q, k, p, which the
    16-token tensor-core variants run in 8-token passes (their build holds the 16-bit path only:
    both paths in one kernel spill), the 128-column slab as 64-column ones; ``serving``: the build
    with the serving options (a state pool, in-kernel gating; kernels_cu/params.cuh), every
    family's last template flag, so that calls without them run code that holds none of them;
    ``precision``: the prefill family's products, "tf32", "bf16" or "fp32", or None (16-bit activations:
    "bf16"); the other families are fp32-accurate whatever it says; ``bf16_keys``: q, k, p all bf16,
    which the prefill family stages as they are (others as fp32; default ``not f32_keys``); ``act``: the dtype
    code (``_dtypes.ACTIVATION_CODES``) that q, k, p, v and o share, or None where they differ: the decode step
    of the token loops is built for it (template argument ACT, kernels_cu/params.cuh), every other build reads
    the dtypes at run time.
    """
    t = tiling(layout, K, variant)
    wide = f32_keys if bf16_keys is None else not bf16_keys  # the prefill family's keys staged as fp32
    if t.family in WGMMA_FAMILIES and (wide or precision not in (None, "bf16")):
        raise ValueError(f"variant {variant!r} runs bf16 q, k, p with precision 'bf16' only; got "
                         f"{'wider keys' if wide else f'precision {precision!r}'}")
    if t.family == "prefill_scan_wg":
        return Kernel(t.source, f"comba::prefill_scan_wg<{K}, {t.slab}, {_flag(separate_p)}, {_flag(layout == 'vk')}, "
                                f"{_flag(serving)}>", t.slab, t.threads, prefill_wg_bytes(K, t.slab, separate_p),
                      f"comba::prefill_prep<{K}, 5, {_flag(serving)}>", prefill_prep_bytes(K, False), 128,
                      PREFILL_RECORD_BF16, 8, ring_shared_bytes=prefill_wg_bytes(K, t.slab, separate_p, ring=True),
                      dependent=_dependent(K, 1), prep_lean_bytes=_prep_lean_bytes(K, False, separate_p))
    if t.family == "prefill_scan_wt":  # args: (PART, WGS); PART WT_WHOLE or WT_SEGMENTS (after WT_CHAIN)
        part, wgs = t.args
        segmented = part == WT_SEGMENTS
        # the chain on 128 of the V + K columns of [E | M] a CTA where the segments run pairs, K = 128 (V + K is then
        # a multiple of 128 too) and p is k: each chunk's Kc and A staged once for both warpgroups, two CTAs an SM
        # (Comba's P as well leaves room for one); one build for both layouts (it touches no state)
        chain_wgs = wgs if K == 128 and not separate_p else 1
        sep = _flag(separate_p)
        flags = f"{sep}, {_flag(layout == 'vk')}, {_flag(serving)}"
        return Kernel(t.source, f"comba::prefill_scan_wt<{K}, {flags}, {part}, {wgs}>",
                      t.slab, t.threads, prefill_wt_bytes(K, separate_p, wgs=wgs),
                      f"comba::prefill_prep<{K}, 6, {_flag(serving)}>", prefill_prep_bytes(K, False), 128,
                      record_words=WT_RECORD, swizzled_keys=True,
                      chain=f"comba::prefill_scan_wt<{K}, {sep}, false, {_flag(serving)}, {WT_CHAIN}, {chain_wgs}>"
                      if segmented else "",
                      chain_shared_bytes=prefill_wt_bytes(K, separate_p, chain=True, wgs=chain_wgs) if segmented else 0,
                      chain_block=128 * chain_wgs, dependent=_dependent(K, wgs, segmented),
                      prep_lean_bytes=_prep_lean_bytes(K, False, separate_p))
    if t.family == "prefill_scan":
        if precision is None:  # 16-bit activations: bf16 products, the fastest (docs/design.md)
            precision = "bf16"
        acc = (3 if wide else 4 if precision == "bf16" else 0) if precision != "fp32" else 2 if wide else 1
        record = prefill_record(acc)
        return Kernel(t.source, f"comba::prefill_scan<{K}, {t.slab}, {_flag(separate_p)}, {_flag(layout == 'vk')}, "
                                f"{acc}, {_flag(serving)}>", t.slab, t.threads,
                      prefill_scan_bytes(K, t.slab, separate_p, wide, record),
                      f"comba::prefill_prep<{K}, {acc}, {_flag(serving)}>", prefill_prep_bytes(K, wide), 128,
                      record, prep_lean_bytes=_prep_lean_bytes(K, wide, separate_p))
    if t.family == "delta_rule_mma":
        slab, tokens = t.slab, t.tokens
        if f32_keys and tokens == 16:
            slab, tokens = slab if (K, slab, 8) in MMA_BUILDS else 64, 8
        expression = (f"comba::delta_rule_mma<{K}, {slab}, {_flag(separate_p)}, {_flag(layout == 'vk')}, "
                      f"{tokens // 8}, {_flag(serving)}>")
        return Kernel(t.source, expression, slab, 2 * slab * K // 64, mma_stage_bytes(K, slab, separate_p, tokens))
    decode = t.tokens == 1 and not (multi or t.passes_only)
    flags = _flag(separate_p)
    if t.tokens == 1:
        if t.family != "delta_rule_kv_warp":  # the one family with no T-token build has no MULTI flag
            flags += f", {_flag(not decode)}"
        flags += f", {act if decode and act is not None else -1}"
    flags += f", {_flag(serving)}"
    args = ", ".join(str(a) for a in (K, *t.args))
    return Kernel(t.source, f"comba::{t.family}<{args}, {flags}>", t.slab, t.threads, 0,
                  grid3=t.family == "delta_rule_kv_warp" or (t.decode_only and decode))


#: The activation dtype codes the decode builds are specialised for, and None (each dtype read at run time).
ACT_CODES = (None, 0, 1, 2)


def _builds(t):
    """``(multi, act)`` of each build of a tiling: the T-token one, and the decode step for each of ACT_CODES."""
    multis = (True,) if t.passes_only else (False,) if t.decode_only else (False, True)
    return [(m, act) for m in multis for act in ((None,) if m or t.tokens > 1 else ACT_CODES)]


def specialisations():
    """``{source file: (name expression, ...)}``: everything that is built, each once."""
    out = {}
    for serving in (False, True):
        for t in TILINGS:
            for separate_p in (True, False):
                for multi, act in _builds(t):
                    prefill = t.family == "prefill_scan"  # its builds differ by numerics too
                    numerics = itertools.product(PRECISIONS, (False, True)) if prefill else \
                        (("bf16", False),) if t.family in WGMMA_FAMILIES else \
                        (("fp32", False), ("fp32", True))
                    for precision, f32_keys in numerics:
                        if prefill and not prefill_fits(t.K, t.slab, separate_p, f32_keys):
                            continue
                        k = kernel(t.layout, t.variant, K=t.K, separate_p=separate_p, multi=multi, serving=serving,
                                   precision=precision, f32_keys=f32_keys, act=act)
                        exprs = out.setdefault(k.source, [])
                        for e in (k.prep, k.chain, k.expression):
                            if e and e not in exprs:
                                exprs.append(e)
    out["copy.cu"] = ["comba::copy_float4"]
    return {source: tuple(e) for source, e in out.items()}


#: Shared memory a CTA may hold on the H200 (227 KB), the most any GPU allows; the prefill scan's stages are
#: counted against it when it is built.  A100s allow 163 KB, sm_86 / sm_89 GPUs 99 KB (``max_shared`` below).
MAX_SHARED = 232448


def _prefill_layout(K, slab, separate_p, wide_keys, record):
    """``(bytes of one stage, bytes of the rest)`` of ``ScanLayout`` (kernels_cu/prefill.cu) for a record of
    ``record`` words."""
    rows = 40 if slab == 16 else slab + 8
    fixed = 4 * (K // 4) * (4 * slab + 8) + 3 * 4 * PREFILL_CHUNK * rows + 16  # + two mbarriers
    stage = (3 if separate_p else 2) * PREFILL_CHUNK * (K + 16) * (4 if wide_keys else 2) + \
        PREFILL_CHUNK * 4 * slab + 4 * record
    return stage, fixed


def prefill_prep_bytes(K, wide_keys, separate_p=True):
    """Bytes of ``PrepLayout<K, K32>`` (kernels_cu/prefill_prep.cuh): a chunk's q, k, p rows; over q's and k's, once
    read, L (then X = (I + L)^-1) and Mq, rows of 68 floats, and the solve's scratch (2 KB); p's rows last
    (``BYTES``), or no p rows where p is k (Gated DeltaNet: ``SHARED_P_BYTES``)."""
    key = PREFILL_CHUNK * (K + 16) * (4 if wide_keys else 2)
    return max(2 * key, 4 * 2 * PREFILL_CHUNK * (PREFILL_CHUNK + 4) + 2048) + (key if separate_p else 0)


def _prep_lean_bytes(K, wide_keys, separate_p):
    """``Kernel.prep_lean_bytes``: the prep's bytes without p's rows where p is k, 0 where p has rows of its own."""
    return 0 if separate_p else prefill_prep_bytes(K, wide_keys, False)


def prefill_fits(K, slab, separate_p, wide_keys, max_shared=MAX_SHARED):
    """Whether the prefill kernels of a slab are built (one stage of a chunk's inputs fits beside the rest in
    MAX_SHARED) and run on a GPU that allows ``max_shared`` bytes a CTA, in every precision (each stage holds
    room for its precision's record); ``wide_keys``: not all of q, k, p bf16, staged as fp32 (at K = 256 that
    fits only Gated DeltaNet on 16-column slabs)."""
    records = (PREFILL_RECORD,) if wide_keys else (PREFILL_RECORD, PREFILL_RECORD_BF16)
    return max(prefill_prep_bytes(K, wide_keys),
               *(prefill_scan_bytes(K, slab, separate_p, wide_keys, r) for r in records)) <= max_shared


def prefill_scan_bytes(K, slab, separate_p, wide_keys, record=PREFILL_RECORD):
    """Bytes of ``ScanLayout<K, SLAB, SEPARATE_P, K32, RECORD>`` (kernels_cu/prefill.cu): the state slab as the
    read's operand, Y, U and w U of a chunk, and one or two stages of a chunk's inputs."""
    stage, fixed = _prefill_layout(K, slab, separate_p, wide_keys, record)
    return fixed + (2 if fixed + 2 * stage <= MAX_SHARED else 1) * stage


#: A row of this many chunks or more takes the wgmma scan's third stage where its launch gives room for one
#: (``kWgRingChunks``, kernels_cu/prefill_wgmma.cu; ``Kernel.ring_shared_bytes``).
WG_RING_CHUNKS = 24


def prefill_wg_bytes(K, slab, separate_p, ring=False):
    """Bytes of ``WgLayout<K, SLAB, SEPARATE_P, RECORD>`` (kernels_cu/prefill_wgmma.cu): the state, Y, U and
    w U as bf16 tiles, the stages' mbarriers (128 bytes), then two stages of a chunk's key rows (K + 8 bf16 a row),
    v slab and record (``BYTES``); ``ring``: with a third stage (``RING_BYTES``), 0 where that does not fit in
    MAX_SHARED."""
    tiles = -(-(2 * slab * K + 3 * 2 * slab * PREFILL_CHUNK) // 128) * 128
    stage = (3 if separate_p else 2) * PREFILL_CHUNK * (K + 8) * 2 + PREFILL_CHUNK * slab * 4 + 4 * PREFILL_RECORD_BF16
    stage = -(-stage // 128) * 128
    n = tiles + 128 + (3 if ring else 2) * stage
    return 0 if n > MAX_SHARED else n


#: 32-bit words of ``WtRecord`` (kernels_cu/prefill.cuh), prefill_scan_wt's record: A (64 x 64 bf16), G fp, scale
#: G fq, w (64 each) and G_63 (256 words), then Mq (64 x 64 bf16).
WT_RECORD = 2048 + 256 + 2048


def prefill_wt_bytes(K, separate_p, chain=False, wgs=1):
    """Bytes of ``WtLayout<K, CHAIN, SEPARATE_P, WGS>`` (kernels_cu/prefill_transposed.cu): room to align to 1 KB, two
    stages of a chunk's Q, Kc and (``separate_p``) P rows (64 rows of K bf16 each), record and v slab (a box of
    64 x 64 bf16 each of ``wgs`` warpgroups), their warps' o transposes and two mbarriers; ``chain``: the segments'
    chain, whose stages hold no Q and the record without Mq."""
    keys = (1 if chain else 2) + (1 if separate_p else 0)
    stage = keys * PREFILL_CHUNK * K * 2 + 4 * (WT_RECORD - (2048 if chain else 0)) + wgs * PREFILL_CHUNK * 64 * 2
    return 1024 + 2 * stage + (0 if chain else 4 * wgs * 2048) + 16


def mma_stage_bytes(K, slab, separate_p, tokens):
    """Bytes of ``MmaStage<K, SLAB, SEPARATE_P, SUBS>`` (kernels_cu/mma_stage.cuh), the tensor-core
    kernel's dynamic shared memory, from the struct's layout (tests/test_build.py holds it to NVRTC's
    ``sizeof`` for every build)."""
    subs, planes, ks = tokens // 8, 3 if separate_p else 2, K // 64
    nt = 32 * slab // 16 * ks
    passes, ev = tokens * K // nt // 4, tokens * slab // nt
    fragments = subs * (K // 8) * (planes + 1) * 32 * 8          # x and kw, two values each
    ring = 2 * planes * passes * nt * 8 + 2 * (nt * ev // 2) * 4  # MmaRing: qkp, v
    part = slab // 16 * ks * 2 * subs * 32 * 16
    gram = ks * (4 if subs == 1 else 9) * 32 * 16
    coefficients = -(-(3 * 64 + 3 * 8 + 1) * 4 // 16) * 16  # ChunkCoefficients, 16-byte aligned
    rest = tokens * (slab + 4) * 4 + 2 * tokens * 4 + subs * coefficients  # v (padded rows), e and beta, coefficients
    total = fragments + -(-ring // 16) * 16 + part + gram + rest
    return -(-total // 16) * 16
