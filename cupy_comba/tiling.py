"""Which variant (:mod:`cupy_comba.families`) runs a shape: a table of rules, first match wins.

Every rule cites the measurement that justifies it: a results file under ``benchmarks/results/``
(one H200, Gated DeltaNet from a state, bf16, CUDA-graph replay, H = 16 and V = 128 unless the
file says otherwise; ``benchmarks/sweep_forward_tilings.py`` and ``benchmarks/sweep_decode.py``
reproduce them) and the figures in it that decide.  ``heads`` is B * H; "few heads" is at most
:data:`FEW_HEADS`, where the GPU waits on each token's latency rather than on memory.

>>> from cupy_comba import tiling
>>> tiling.choose("kv", 128, 128, separate_p=True)                  # a decode step
'kv64x8'
>>> tiling.choose("vk", 128, 128, False, multi=True, T=16, heads=8192)
'vk64tc16'
>>> print(tiling.explain("kv", 64, 128, False, multi=True, T=512, heads=8192).name)
tensor cores, 128-column slabs at K = 64
"""

from typing import Callable, NamedTuple

from .families import MAX_SHARED, prefill_fits

#: At most this many heads (B * H) count as few.
FEW_HEADS = 128
#: At most this many heads the tensor-core kernel takes 32-column slabs at K = 128.
NARROW_HEADS = 32
#: At most this many heads a kv decode step at K = 128 runs in one warp a CTA (``kv16w``).
ONE_WARP_HEADS = 256
#: At most this many heads a vk decode step at K = 128 runs on 8-row slabs (``vk4x2``).
NARROW_VK_HEADS = 512
#: The H200's multiprocessors, against which the rules that count CTAs were measured.
H200_SMS = 132


class Case(NamedTuple):
    """A shape as the rules see it."""

    layout: str
    K: int
    V: int
    separate_p: bool
    multi: bool
    T: int
    heads: int | None   #: B * H; None means many
    wide_keys: bool = False  #: not all of q, k, p bf16 (the prefill kernels stage those as fp32)
    max_shared: int = MAX_SHARED  #: bytes of shared memory the GPU allows a CTA (the H200's 227 KB)
    verify: bool = False  #: speculative verify: the state after every token stored (the token loop only)
    wgmma: bool = False  #: bf16 products of bf16 q, k, p on a GPU of compute capability 9.0 (``prefill_scan_wg``)
    transposed: bool = True  #: with ``wgmma``, the transposed scan may be chosen (False: the rules before it)
    segmented: bool = True  #: with ``transposed``, the segmented scan may be chosen (False: the rules before it)
    paired: bool = True  #: with ``transposed``, its two-warpgroup CTAs may be chosen (False: the rules before them)

    @property
    def few(self):
        return self.heads is not None and self.heads <= FEW_HEADS

    @property
    def wide(self):
        """V a multiple of 64 (the 64-column and 64-row slabs divide it)."""
        return self.V % 64 == 0

    @property
    def slabs(self):
        """Slabs of 64 value columns over every head: the CTAs of the transposed scan on one warpgroup a CTA."""
        return self.heads * (self.V // 64)

    @property
    def sixteen(self):
        """16 tokens a tensor-core pass cost less than 8: a pass of 16 costs about 5/3 of a pass of 8
        over many heads (h200-forward-mma16.json, kv, K = V = 128, 8192 heads: 366 against 215 us a
        pass from T = 16 to 64), so T = 9-16, 25-32 and from 41 on take 16 (at 33-40 both cost 15 units
        and passes of 8 keep it)."""
        return -(-self.T // 16) * 5 < -(-self.T // 8) * 3

    @property
    def mma_min_t(self):
        """Fewest tokens the tensor-core kernel takes (vk at K = 64 has no chunked kernel)."""
        if self.layout == "vk" and self.K == 64:
            return 3 if self.few else 4
        return 5


class Rule(NamedTuple):
    name: str
    applies: Callable[[Case], bool]
    variant: Callable[[Case], str]
    evidence: str


def _mma(c):
    narrow = not c.wide or (c.few and c.heads <= NARROW_HEADS and c.K == 128)
    return f"{c.layout}{32 if narrow else 64}tc{16 if c.sixteen else ''}"


#: The shortest pass the prefill kernels take at each K, over at most so many heads: (heads, T) in order
#: (h200-prefill-lengths.json).  Their cost rises in steps of 64 tokens and the 16-token kernel's in steps of 16,
#: so the thresholds fall on that kernel's step boundaries: T = 17, 33, 49, 97 and 113 open a step of it that costs
#: more than the prefill chunks.  Over 1-32 heads one chunk costs less than the 16-token kernel's three steps (K =
#: 128, T = 48: one head 9.1 against 12.1 us for kv32tc16, 16 heads 9.9 against 12.4, 32 heads 11.6 against 12.7;
#: K = 64: 16 heads 8.7 against 11.6 for kv64tc16, 32 heads 9.8 against 11.6; K = 128, T = 32: 16 heads 9.9 against
#: 9.3, which keep it), at K = 64 over 1-16 heads no more than its two (T = 32: one head 8.0 against 8.4, 16 heads
#: 8.7 against 8.7; 32 heads 9.8 against 8.6, which keep it); over 33-64 heads one chunk costs less than four
#: steps (64 heads, T = 49: K = 128 16.4 against 17.2 us for kv64tc16, K = 64 13.9 against 14.7; T = 48 16.4
#: against 14.0 and 13.9 against 11.9); at K = 64 over 65-128 heads prefill_scan's two chunks cost less than the
#: 16-token kernel's eight steps (128 heads, T = 113: 27.8 against 30.6).  Beyond 128
#: heads, the most the sweeps measured, the token kernels keep every length (and no workspace
#: of 11-21.5 KB a chunk and head is made); at K = 256 the token loops the prefill kernels replace walk 256 keys a
#: token, and lose from T = 16 over any number of heads.
PREFILL_MIN_T = {
    64: ((16, 17), (32, 33), (64, 49), (128, 113)),
    128: ((32, 33), (64, 49), (128, 97)),
    256: ((None, 16),),
}
#: The same where the scan runs on wgmma (:func:`_warpgroup`): over 65-128 heads at K = 128 from T = 97, where
#: its two chunks cost less than the 16-token kernel's seven steps, and at K = 64 over 33-128 heads from T = 49,
#: where one chunk costs less than four steps (h200-prefill-lengths.json, 64 heads: 12.1 against 14.7 us on the
#: transposed scan).  Over the heads that take the transposed scan it begins at TRANSPOSED_MIN_T where that is
#: shorter.
PREFILL_MIN_T_WGMMA = {64: ((16, 17), (32, 33), (128, 49)), 128: ((32, 33), (64, 49), (128, 97))}


def _prefill_min_t(c):
    """The shortest pass the prefill kernels take at this head size and head count, or None."""
    for most, T in (PREFILL_MIN_T_WGMMA if _warpgroup(c) else PREFILL_MIN_T).get(c.K, ()):
        if most is None or (c.heads is not None and c.heads <= most):
            return min(T, _transposed_min_t(c)) if _transposed_heads(c) else T
    return None


def _prefill(c):
    if not c.multi or c.V % 32:
        return False
    shortest = _prefill_min_t(c)
    return shortest is not None and c.T >= shortest and prefill_fits(c.K, _prefill_slab(c), c.separate_p,
                                                                     c.wide_keys, c.max_shared)


def _prefill_slab(c):
    return 16 if c.heads is not None and c.heads <= 16 else 32


#: From this many tokens Comba's 16-column slabs (1-16 heads) take the wgmma scan (h200-prefill-wgmma.json: T = 1024
#: one head 29.1 against 30.8 us, 16 heads 36.1 against 35.2; T = 8192 175.6 against 193.1 and 226.9 against
#: 237.4; T = 256 13.7 against 13.6 and 16.4 against 16.0), and at K = 64 every slab over at most NARROW_HEADS
#: heads, where prefill_scan's chunks cost less before (h200-prefill-lengths.json, K = 64: 16 heads, T = 64 8.7
#: against 9.6 us for kv16c64wg, Comba over 32 heads 10.3 against 11.6; T = 8192 185.9 against 174.1).
WGMMA_MIN_T = 1024


def _warpgroup(c):
    """The prefill scan on wgmma: 32-column slabs, Gated DeltaNet's 16-column ones, and Comba's from WGMMA_MIN_T
    tokens; at K = 64 over at most NARROW_HEADS heads from WGMMA_MIN_T tokens only."""
    if not (c.wgmma and c.K in (64, 128)):
        return False
    if c.K == 64 and c.heads is not None and c.heads <= NARROW_HEADS and c.T < WGMMA_MIN_T:
        return False
    return _prefill_slab(c) == 32 or not c.separate_p or c.T >= WGMMA_MIN_T


#: The heads from which the prefill pass takes the transposed wgmma scan (``{layout}64c64wt``), by K, from
#: TRANSPOSED_MIN_T tokens with V a multiple of 64 (h200-prefill-transposed.json): two CTAs a head of V = 128, each
#: bound by the tensor cores' rate on its chunk's products, which over fewer heads leave most SMs idle.
TRANSPOSED_MIN_HEADS = {128: 64, 64: 64}
#: ... by K, (at most so many heads, from so many tokens), where over those heads the prefill kernels then begin:
#: one chunk costs less than the 16-token kernel's three steps at K = 128 over 64-128 heads and at K = 64 over
#: 65-128 (on two warpgroups a CTA), and over 64 at K = 64 less than four (h200-prefill-lengths.json, K = 128: 64
#: heads T = 48 13.5 against 14.0 us for kv64tc16 (Comba 14.1 against 14.7), T = 32 13.3 against 10.7; 128 heads T
#: = 48 16.4 against 19.9, T = 32 16.3 against 14.9; K = 64: 128 heads T = 48 13.4 against 14.1, 64 heads T = 48
#: 12.0 against 11.9).
TRANSPOSED_MIN_T = {128: ((FEW_HEADS, 33),), 64: ((64, 49), (FEW_HEADS, 33))}


def _transposed_heads(c):
    """Over these heads the transposed scan is the prefill pass's from TRANSPOSED_MIN_T on (up to FEW_HEADS)."""
    most = TRANSPOSED_MIN_HEADS.get(c.K)
    return c.transposed and c.wgmma and c.wide and most is not None and c.heads is not None and \
        most <= c.heads <= FEW_HEADS


def _transposed_min_t(c):
    return next(T for most, T in TRANSPOSED_MIN_T[c.K] if c.heads <= most)


def _transposed(c):
    return _transposed_heads(c) and c.T >= _transposed_min_t(c)


#: The segmented scan (``{layout}64c64sg``): a batch (a ragged one as N rows of its mean length) too few to fill the
#: GPU with one CTA a (row, head, 64 value columns), cut into segments whose CTAs fill it once -- from so many tokens
#: over at most so many such CTAs (h200-prefill-segments.json), and over up to 256 from T = 8192, where one segment a
#: row runs level with the whole transposed scan or ahead of it (h200-prefill-lengths.json, K = 128, 128 heads,
#: two warpgroups a CTA: T = 65536 4624.6 against 4755.2 us, one a CTA 5585.4 against 5818.9; T = 8192 593.5
#: against 593.6).  At K = 64 from T = 1024 over up to 32 such CTAs (h200-prefill-tiling.json, Gated DeltaNet, 16
#: heads: 27.0 against 27.9 us for kv16c64wg, Comba 28.2 against 29.1 for kv16c64) and from T = 4096 over up to
#: 64, in the pairs below (32 heads: 103.6 against 126.8 for kv32c64wg; 16 heads 62.8 against 70.1 for one
#: warpgroup a CTA), which take up to 64 from T = 1024 (PAIRED_SEGMENTS_MIN_T).  At K = 128 over up to 40 from T =
#: 1536, where over 17-20 heads the 32-column wgmma scan's 68-80 CTAs leave a third of the SMs idle or more
#: (h200-prefill-between.json, T = 1536: 16 heads 42.6 against 43.4 us for kv16c64wg, 20 heads 50.1 against 51.8 for
#: kv32c64wg; 20 heads, T = 2048: 61.1 against 67.4).
SEGMENTED_MIN_T = {128: ((16, 1024), (40, 1536), (256, 8192)),
                   64: ((32, 1024), (64, 4096), (256, 8192))}
#: At most so many segments (the last one composes the maps of all before it, one after another), each of at
#: least MIN_SEGMENT_CHUNKS chunks of 64 tokens.
MAX_SEGMENTS = 16
MIN_SEGMENT_CHUNKS = 4


def _segmented(c):
    if not (c.segmented and c.transposed and c.wgmma and c.wide and c.K in (64, 128)
            and c.heads is not None):
        return False
    return any(c.slabs <= most and c.T >= T for most, T in SEGMENTED_MIN_T[c.K]) or _paired_segments(c)


def segments(heads, V, T, sms, slab=64):
    """``(segments, chunks a segment)`` of the segmented scan over ``heads`` = B * H heads of V columns and T
    tokens on a GPU of ``sms`` multiprocessors, a CTA a ``slab`` of value columns: as many segments as one CTA a
    multiprocessor takes, at most MAX_SEGMENTS and none shorter than MIN_SEGMENT_CHUNKS chunks where the row is
    longer than that.

    >>> segments(16, 128, 8192, 132)      # 32 CTAs a segment: four segments of 32 chunks
    (4, 32)
    >>> segments(1, 128, 2048, 132)       # 32 chunks over one head: eight segments of four
    (8, 4)
    >>> segments(16, 128, 8192, 132, 128) # two warpgroups a CTA, on 128 columns: eight segments of 16
    (8, 16)
    """
    chunks = max(1, -(-T // 64))
    n = max(1, min(MAX_SEGMENTS, chunks // MIN_SEGMENT_CHUNKS, sms // max(1, heads * (V // slab))))
    per = -(-chunks // n)
    return -(-chunks // per), per


def ragged_segment_chunks(per, N, H, V, T, sms, slab=64):
    """Chunks a segment of a ragged batch of N sequences packed into T tokens over H heads: at least ``per`` (what
    :func:`segments` gives for N rows of the mean length), and enough that the segments' CTAs run at once on an
    idle GPU of ``sms`` multiprocessors, one CTA each, whatever the lengths -- or, where not even one segment a
    sequence allows that, one segment a sequence.

    Every segment's CTA reads the sequence's initial state as it starts and the last one writes the final state as it
    ends, in place where a pool is updated (kernels_cu/prefill_transposed.cu, "Segments"): all of a sequence's CTAs
    must have started before its last segment ends.  N rows of the mean length fill the GPU once, but sequences of
    other lengths have more segments between them -- up to N + floor((ceil(T / 64) - 1) / per), a chunk and
    multiples of ``per`` each --, and a CTA of a second wave may start after a short last segment has ended.

    >>> ragged_segment_chunks(16, 1, 16, 128, 8192, 132, 128)  # one sequence: as segments() cuts it
    16
    >>> ragged_segment_chunks(16, 2, 16, 128, 8192, 132, 128)  # two: at most 2 + 127 // 19 = 8 segments of 16 CTAs
    19
    >>> ragged_segment_chunks(32, 40, 4, 128, 81920, 132, 64)  # 40 sequences: one segment each
    1280
    """
    fit = sms // max(1, H * (V // slab))  # segments whose CTAs run at once
    return max(per, max(0, -(-T // 64) - 1) // max(1, fit - N + 1) + 1)


#: The transposed scan (whole or in segments) runs two warpgroups a CTA on a 128-column slab (``{layout}128c64wt``,
#: ``sg``), sharing each chunk's staged keys and record, where one warpgroup a 64-column slab would make more CTAs
#: than the H200's 132 SMs (B * H * V / 64 of them, from this many): one CTA an SM either way, and two chains on
#: each in place of a second wave (h200-prefill-lengths.json, 128 heads; docs/design.md; at K = 64, where a chunk
#: costs less, mostly by 1-4 %: T = 1024 75.6 against 77.3 us, Comba 81.3 against 83.2; 0.93-1.01 of their
#: time over T = 49-65536).  Over fewer
#: CTAs the pairs leave SMs idle, and each chain runs 1.28 times slower beside another (B = 1, T = 8192, H = 16:
#: 301.4 against 235.5 us for the scan alone).
PAIRED_MIN_SLABS = H200_SMS + 1
#: The segmented scan takes the pairs over fewer heads too: over 32-64 slabs of 64 columns (B * H = 16-32 at
#: V = 128) -- at K = 128 over 32 from T = 8192 and over 33-64 from T = 2560 (h200-prefill-between.json: 32 heads,
#: T = 2560 95.4 against 93.9 us for kv32c64wg, T = 3072 105.1 against 111.2, T = 4096 133.5 against 143.8; 24
#: heads, T = 3072 90.0 against 104.2; h200-prefill-lengths.json, 16 heads, T = 4096 89.3 against 90.4 for one
#: warpgroup a CTA, Comba 108.3 against 97.7) -- and at K = 64 over 32 from T = 4096 and over 33-64 from T = 1024
#: (where the segments begin for them: h200-prefill-tiling.json, 32 heads, T = 1024 35.5 against 34.4 us for
#: kv32c64wg, Comba 36.8 against 38.0, in vk 37.3 against 38.0; h200-prefill-lengths.json 35.8 against 34.4, Comba
#: 37.2 against 38.2; without the pairs they begin at T = 4096, SEGMENTED_MIN_T).  tiling.segments then cuts
#: twice as many segments, and at K = 128 the chain runs two warpgroups a CTA on 128 of the V + K columns of a
#: segment's map, each chunk's Kc and A staged once for both (h200-prefill-lengths.json: H = 16, T = 65536
#: 882.2 against 1063.8 us, H = 32 1656.5 against 1894.3).  Over one head both cut the most segments, and the
#: pairs' chains run slower (T = 8192: 76.8 against 52.9); over 64 heads they lose to one segment of one warpgroup
#: a CTA (T = 8192: 407.3 against 362.6).
PAIRED_SEGMENT_SLABS = (32, 64)
PAIRED_SEGMENTS_MIN_T = {128: ((32, 8192), (64, 2560)), 64: ((32, 4096), (64, 1024))}


def _paired_segments(c):
    """The segmented scan on two warpgroups a CTA over PAIRED_SEGMENT_SLABS, from PAIRED_SEGMENTS_MIN_T."""
    return c.paired and c.V % 128 == 0 and PAIRED_SEGMENT_SLABS[0] <= c.slabs <= PAIRED_SEGMENT_SLABS[1] and \
        c.T >= next(T for most, T in PAIRED_SEGMENTS_MIN_T[c.K] if c.slabs <= most)


def _paired(c):
    if not (c.paired and c.V % 128 == 0):
        return False
    return c.slabs >= PAIRED_MIN_SLABS or (_segmented(c) and _paired_segments(c))


def _prefill_variant(c):
    """The prefill rule's variant for a Case it applies to."""
    if _segmented(c) or _transposed(c):
        return f"{c.layout}{128 if _paired(c) else 64}c64{'sg' if _segmented(c) else 'wt'}"
    return f"{c.layout}{_prefill_slab(c)}c64{'wg' if _warpgroup(c) else ''}"


def _decode_over_few(c, layout, most, slab):
    """A decode step on a ``layout`` state at K = 128 over at most ``most`` heads, V a multiple of ``slab``."""
    return c.layout == layout and c.K == 128 and not c.multi and c.heads is not None and c.heads <= most and \
        c.V % slab == 0


def _tensor_cores(c):
    return c.multi and c.T >= c.mma_min_t and (c.few or c.wide)


RULES = (
    Rule("prefill: 64-token chunks on the tensor cores",
         _prefill,
         _prefill_variant,
         "h200-prefill-tiling.json (kv and vk, K = 64 / 128 / 256, 1-128 heads, T = 256-4096) and "
         "h200-prefill-lengths.json (kv, T = 16-65536 and either side of each threshold), Gated DeltaNet at "
         "K = 128 unless said, prefill_scan (mma.sync) first.  The prefill kernels cost a step every 64 tokens, the "
         "16-token kernel every 16, so the thresholds fall on the latter's step boundaries: over 1-32 heads from "
         "T = 33, 16-column slabs over 1-16 heads and 32-column ones over more (T = 48: one head 9.1 against 12.1 us "
         "for kv32tc16, 16 heads 9.9 against 12.4, 32 heads 11.6 against 12.7; K = 64, 16 heads 8.7 against 11.6 "
         "for kv64tc16; T = 32: 16 heads 9.9 against 9.3; T = 65536, 16 heads: 1712.1 against 12858.5), at K = 64 "
         "over 1-16 heads from T = 17 (T = 32: one head 8.0 against 8.4, 16 heads 8.7 against 8.7); over 33-64 "
         "heads from T = 49 (64 heads: 16.4 against 17.2 for kv64tc16, T = 48 16.4 against 14.0); over 65-128 heads "
         "from T = 97 (128 heads: T = 97 35.0 against 40.3, T = 96 33.9 against 35.0; T = 65536 9726.3 against "
         "20714.3), at K = 64 from T = 113 (T = 113 27.8 against 30.6, T = 112 27.3 against 27.6); at K = 256 "
         "over every head count from T = 16 (1 head: 15.8 against 18.8 us for kv32x16, 128 heads: 37.5 against "
         "53.9), 6.6-33x the token loops from T = 256.  Where q, k, "
         "p are bf16 with bf16 products on compute capability 9.0, the same slabs' scan on wgmma "
         "(h200-prefill-wgmma.json, K = 64 / 128, kv and vk, 1-128 heads, T = 256-8192): 32-column slabs "
         "(K = 128, 128 heads, T = 8192: 1070.0 against 1243.9 us; K = 64: 707.8 against 1020.4), Gated DeltaNet's "
         "16-column slabs (16 heads, T = 8192: 206.2 against 224.5), Comba's 16-column ones from T = 1024 (16 "
         "heads, T = 8192 226.9 against 237.4; shorter passes keep prefill_scan: WGMMA_MIN_T); at K = 64 over 1-32 "
         "heads from T = 1024 only (h200-prefill-lengths.json, 16 heads, T = 64: 8.7 against 9.6 us for kv16c64wg; "
         "T = 8192 185.9 against 174.1); and over 65-128 heads from T = 97 at K = 128 (h200-prefill-lengths.json, "
         "128 heads, T = 112: 31.0 against 40.4 us for kv64tc16, Comba 35.6 against 42.0; T = 96: 29.4 against "
         "35.0, Comba 32.8 against 36.7).  The transposed wgmma scan over 64-128 heads at K = 128 from T = 33, where "
         "the prefill kernels then begin (h200-prefill-lengths.json: 64 heads, T = 48 13.5 against 14.0 us for "
         "kv64tc16, T = 32 13.3 against 10.7; 128 heads, in two-warpgroup CTAs, T = 48 16.4 against 19.9, T = 32 "
         "16.3 against 14.9; T = 192 18.1 against 22.1 for kv32c64wg; h200-prefill-transposed.json, 32-128 heads, "
         "T = 256-4096, against the choice without it: 64 heads, T = 256 21.0 against 25.6 us for kv32c64wg, T = "
         "4096 195.5 against 279.0 (Comba 22.2 against 28.6, 214.0 against 316.8; vk 20.4 against 25.8, 196.9 "
         "against 279.6), 128 heads in two-warpgroup CTAs T = 4096 306.1 against 549.3; over 32 heads it loses (T = "
         "4096: 166.2 against 143.5)), and at K = 64 over 64 heads from T = 49 and over 65-128 from T = 33 "
         "(h200-prefill-lengths.json: 64 heads T = 49 12.1 against 14.7 us for kv64tc16; 128 heads in "
         "two-warpgroup CTAs, T = 48 13.4 against 14.1; 64 heads T = 1024 50.1 against 53.7 for kv32c64wg).  The "
         "transposed scans run two warpgroups a CTA where one a 64-column slab would make more than 132 CTAs "
         "(PAIRED_MIN_SLABS; h200-prefill-lengths.json, 128 heads: T = 1024 89.2 against 111.0 us, T = 65536 in "
         "segments 4624.6 against 5585.4; K = 64, T = 1024 75.6 against 77.3), and the segmented scan over 16 "
         "heads from T = 8192 and over 17-32 from T = 2560, at K = 64 over 16 from T = 4096 and 32 from T = 1024 "
         "(PAIRED_SEGMENT_SLABS: 16 heads, T = 65536 882.2 against 1063.8; h200-prefill-between.json, 32 heads, "
         "T = 4096 133.5 against 143.8 for kv32c64wg; K = 64, h200-prefill-tiling.json, T = 4096 62.8 against "
         "70.1, 32 heads T = 1024 35.5 against 36.1, Comba 36.8 against 39.5)."),
    Rule("K = 256: the kv token loop",
         lambda c: c.K == 256 and c.layout == "kv",
         lambda c: "kv64x16" if c.wide and (c.heads is None or c.heads > 1024) else "kv32x16",
         "h200-decode-k256.json: at K = 256 decode steps and passes of fewer than 16 tokens take the token "
         "loops (from 16 the prefill kernels: PREFILL_MIN_T).  Over 7168 heads 64-column slabs "
         "with 16 row groups (16 float4 of state a thread) run the decode step at 0.972 (Comba) / 0.979 of the "
         "copy against 0.968 / 0.965 for 32-column ones; over 1024 / 128 heads 32-column ones lead (71.0 / 8.9 "
         "against 73.6 / 9.0 us, Comba)."),
    Rule("K = 256: the vk token loop",
         lambda c: c.K == 256,
         lambda c: "vk8x4",
         "h200-decode-k256.json: four warps of 8 rows a lane (two float4 of each) run the decode step at 0.976 "
         "(Comba) / 0.977 of the copy over 7168 heads, level with two warps (0.976 / 0.975), and ahead over 1024 "
         "and 128 heads (69.5 / 9.0 against 70.0 / 9.0 us, Comba; 8.8 against 9.1 us, Gated DeltaNet)."),
    Rule("vk chunked, K = 128",
         lambda c: c.multi and c.layout == "vk" and c.K == 128 and c.T in (
             (range(2, 5) if c.few else range(2, 8)) if c.wide else range(3, 5)),
         lambda c: "vk64c4" if c.wide else "vk32c4",
         "h200-forward-vkchunked.json: 8192 heads, T = 2 / 4 in 272.2 / 276.9 us, ahead of the token loop and "
         "the tensor cores; 128 heads, T = 2 / 3 / 4 in 7.1 / 7.1 / 7.2 against 7.3 / 8.7 / 10.0 us for the token "
         "loop.  h200-forward-vk5to8.json, 8192 heads: T = 5 in 391.0 against 406.2 us for 8-token tensor-core "
         "passes, T = 6-7 tied (405.5 / 409.3 against 408.4 / 408.6 us), T = 8 to the tensor cores (406.5 against "
         "419.3 us)."),
    Rule("tensor cores, 128-column slabs at K = 64",
         lambda c: _tensor_cores(c) and c.sixteen and not c.few and c.K == 64 and c.V % 128 == 0,
         lambda c: f"{c.layout}128tc16",
         "h200-forward-widek64.json, kv, 8192 heads: T = 16 in 246.8 against 270.9 us for 64-column slabs, "
         "T = 512 in 4762.9 against 5469.2 us; 256 heads: 9.5 against 13.1 us and 162.0 against 243.5 us.  Over "
         "128 heads the two tie (T = 512: 112.9 against 112.4 us), over 16 half the CTAs cost 20 %."),
    Rule("tensor cores",
         _tensor_cores,
         _mma,
         "h200-forward-fewheadsT5.json: T = 5 over 16-128 heads in 4.5-8.9 against 7.9-11.4 us for the token "
         "loop.  h200-forward-manyheads.json, -manyheads-256.json: within 6.4 % of the best kernel from T = 5 "
         "over more heads when V is a multiple of 64.  h200-forward-small.json, K = 128, T = 512: 32-column slabs "
         "over 16 / 32 heads in 136.1 / 136.3 against 178.4 / 174.4 us, 64-column ones ahead over 128 heads "
         "(230.6 against 377.7 us).  h200-forward-fewT2to5.json: vk at K = 64 over 16 / 128 heads from T = 3 "
         "(4.6 / 6.3 against 6.2 / 7.2 us for the token loop).  h200-forward-lowT.json: vk at K = 64 over 8192 "
         "heads from T = 4 (225.6 against 246.7 us), the token loop ahead at T = 3."),
    Rule("kv chunked",
         lambda c: c.multi and c.layout == "kv" and c.wide and c.T in (
             range(3, 5) if c.K == 128 and c.few else range(2, 5)),
         lambda c: "kv64x8c4",
         "h200-forward-lowT.json, K = 64, 8192 heads: T = 2 / 3 / 4 in 169.1 / 187.6 / 203.9 against 173.2 / "
         "204.4 / 236.4 us for the token loop; K = 128: T = 2 in 268.8 against 294.3 us.  h200-forward-smallT.json "
         "and -threshold.json: over at most 128 heads at K = 128 the token loop leads at T = 2 (4.6 against "
         "5.3 us over 16 heads)."),
    Rule("kv chunked, 32 columns",
         lambda c: c.multi and c.layout == "kv" and not c.wide and c.K == 128 and c.T in range(3, 5),
         lambda c: "kv32x8c4",
         "the 64-column rule above, for V not a multiple of 64 (h200-forward-smallT.json)."),
    Rule("kv decode step over a few heads",
         lambda c: _decode_over_few(c, "kv", ONE_WARP_HEADS, 16),
         lambda c: "kv16w",
         "h200-decode-tiny.json (K = V = 128, bf16, 1-512 heads): one warp a CTA on 16-column slabs, activations of "
         "one dtype fixed at compile time, Gated DeltaNet over 1-256 heads in 2.16-7.12 us against 2.60-8.17 for the "
         "best of the other kv tilings (1 head: 2.16 against 2.60 for kv32x16; 128: 4.83 against 5.47), Comba in "
         "2.32-7.55 against 2.52-8.14 (64 heads: 3.75 against 3.67 for kv32x8); over 512 heads 22.8 against 20.9 "
         "us for kv32x8 and 21.2 for kv64x8, which the rule after this keeps."),
    Rule("kv token loop",
         lambda c: c.layout == "kv",
         lambda c: "kv32x8" if not c.wide else "kv64x8" if c.K == 128 and not c.multi else "kv64x4",
         "h200-tilings.json: 64-column slabs (256 contiguous bytes a row a warp-load) with 8 row groups for "
         "the decode step at K = 128 (16 float4 of state a thread), 4 otherwise; the same tilings led at B*H = "
         "128 and 1024 within a few percent, so the batch does not enter."),
    Rule("vk speculative verify, K = 128",
         lambda c: c.verify and c.layout == "vk" and c.K == 128 and c.V % 64 == 0 and not c.few,
         lambda c: "vk8x8",
         "h200-verify-tilings.json (Comba, intermediate_states from a pool): eight warps of 8 rows a lane over more "
         "than 128 heads, B = 32 / 512, T = 4, H = 16: 58.6 / 748.0 against 60.2 / 817.2 us for vk16x2 (0.870 of "
         "the copy at 8192 heads against 0.796), B = 128, T = 16: 657.9 against 722.2; over 16 and 128 heads vk16x2 "
         "leads (8.0 against 9.0 us, 14.4 against 15.1, T = 16: 52.0 against 55.7)."),
    Rule("vk decode step over few heads",
         lambda c: _decode_over_few(c, "vk", NARROW_VK_HEADS, 8),
         lambda c: "vk4x2",
         "h200-decode-tiny.json: 8-row slabs (two warps of 4 rows a lane, 16 CTAs a head of V = 128) over 1-512 heads, "
         "Gated DeltaNet in 2.32-19.42 us against 2.78-21.01 for vk16x2 / vk16x4 (64 heads: 3.90 against 3.91; 512: "
         "19.42 against 21.01), Comba in 2.36-19.71 against 2.79-21.08 (64 heads: 3.93 against 3.92)."),
    Rule("vk token loop",
         lambda c: True,
         lambda c: "vk16x2" if c.V % (16 * 2 * (128 // c.K)) == 0 else "vk8x2",
         "h200-tilings.json: two warps of 16 rows a lane (8 at K = 64 when V is not a multiple of 64)."),
)


def explain(layout, K, V, separate_p, multi=False, T=1, heads=None, wide_keys=False, max_shared=MAX_SHARED,
            verify=False, wgmma=False):
    """The :class:`Rule` that decides a shape."""
    return _decide(Case(layout, K, V, bool(separate_p), bool(multi), T, heads, bool(wide_keys), max_shared,
                        bool(verify), bool(wgmma)))[0]


def _decide(case):
    """The first rule that applies to ``case``, and the variant it names."""
    for rule in RULES:
        if rule.applies(case):
            return rule, rule.variant(case)
    raise AssertionError("the last rule applies to every case")


def choose(layout, K, V, separate_p, multi=False, T=1, heads=None, wide_keys=False, max_shared=MAX_SHARED,
           verify=False, wgmma=False, transposed=True, segmented=True, paired=True):
    """The variant for a shape: ``multi`` for T-token passes (T of them), ``heads`` = B * H; ``wide_keys``
    not all of q, k, p bf16; ``max_shared`` the bytes of shared memory the GPU allows a CTA (a prefill
    build that needs more leaves the shape to the rules after it: on an A100, 163 KB, Comba's and the
    fp32 keys' scans at K = 128; on sm_86 / sm_89 GPUs, 99 KB, every prefill build); ``verify``: the state after
    every token stored (speculative verify), which only the token loop does (T is then 1); ``wgmma``: bf16 q, k,
    p with bf16 products on a GPU of compute capability 9.0, where the prefill scan also runs on wgmma;
    ``transposed=False`` leaves out the transposed wgmma scans (the sweeps that predate them); ``segmented=False``
    the segmented scan and ``paired=False`` the transposed scan's two-warpgroup CTAs (the sweeps that predate
    them).  A ragged batch is chosen for as B = N rows of its mean length."""
    return _decide(Case(layout, K, V, bool(separate_p), bool(multi), T, heads, bool(wide_keys), max_shared,
                        bool(verify), bool(wgmma), bool(transposed), bool(segmented), bool(paired)))[1]
