"""The rules of cupy_comba.tiling.choose, and the variant names of cupy_comba.families."""

import itertools
import json
import re

import numpy
import pytest

from cupy_comba import families, tiling

from kernel_paths import CHUNKED_CHOICE, CHUNKED_HEADS, FEW_HEADS, FEW_HEADS_CHOICE, MANY_HEADS, MANY_HEADS_CHOICE
from repo import ROOT, renderer

RESULTS = ROOT / "benchmarks" / "results"


@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
def test_the_gpu_path_tests_run_the_rules_choices(comba):
    """test_recurrent_gpu.py's path tests assert these choices on the GPU before they run them (kernel_paths.py)."""
    for (layout, K, V, T), variant in FEW_HEADS_CHOICE.items():
        assert tiling.choose(layout, K, V, comba, multi=True, T=T, heads=FEW_HEADS) == variant, (layout, K, V, T)
    for heads, table in ((MANY_HEADS, MANY_HEADS_CHOICE), (CHUNKED_HEADS, CHUNKED_CHOICE)):
        for (layout, K, T), variant in table.items():
            assert tiling.choose(layout, K, 128, comba, multi=True, T=T, heads=heads) == variant, (layout, K, T, heads)


def test_every_rule_cites_a_results_file_that_exists():
    for rule in tiling.RULES:
        cited = re.findall(r"[\w-]*\.json", rule.evidence)
        assert cited, rule.name
        for name in cited:
            name = name if name.startswith("h200-") else "h200-forward" + name  # "-smallT.json" after a full name
            assert (RESULTS / name).is_file(), (rule.name, name)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K", [64, 128])
def test_sixteen_token_passes_where_fewer_passes_cost_less(layout, K):
    heads = 8192
    sixteen = {T for T in range(5, 80) if tiling.choose(layout, K, 128, False, True, T, heads).endswith("tc16")}
    expected = set(range(9, 17)) | set(range(25, 33)) | set(range(41, 80))
    if layout == "vk" and K == families.VK_CHUNKED_K:  # the chunked vk kernel up to T = 7
        expected -= set(range(2, 8))
    assert sixteen == expected


@pytest.mark.parametrize("heads", [129, 8192, None])
def test_vk_chunked_kernel_to_seven_tokens_over_many_heads(heads):
    """vk at K = 128 over many heads: the chunked kernel for T = 2 to 7, 8-token tensor-core passes at T = 8."""
    for T in range(2, 8):
        assert tiling.choose("vk", 128, 128, False, True, T, heads) == "vk64c4", T
    assert tiling.choose("vk", 128, 128, False, True, 8, heads) == "vk64tc"
    assert tiling.choose("vk", 128, 128, True, True, 8, heads) == "vk64tc"
    assert tiling.choose("vk", 128, 128, False, True, 9, heads) == "vk64tc16"


@pytest.mark.parametrize("heads,K,slab", [(16, 128, 32), (32, 128, 32), (64, 128, 64), (16, 64, 64)])
def test_slab_width_over_few_heads(heads, K, slab):
    T = next(t for most, t in tiling.PREFILL_MIN_T[K] if heads <= most) - 1  # the longest tensor-core pass
    assert tiling.choose("kv", K, 128, False, True, T, heads) == f"kv{slab}tc16"
    assert tiling.choose("kv", K, 96, False, True, T, heads) == "kv32tc16"  # V not a multiple of 64


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_wide_slab_at_k64_over_many_heads(layout):
    """16-token passes at K = 64 take 128-column slabs over more than 128 heads when V allows; 8-token
    passes, K = 128, few heads and V = 192 keep the 64-column ones."""
    for T in (9, 16, 32, 64, 512):
        for heads in (129, 256, 8192, None):
            assert tiling.choose(layout, 64, 128, False, True, T, heads) == f"{layout}128tc16", (T, heads)
            assert tiling.choose(layout, 64, 256, True, True, T, heads) == f"{layout}128tc16", (T, heads)
            assert tiling.choose(layout, 64, 192, False, True, T, heads) == f"{layout}64tc16", (T, heads)
            assert tiling.choose("kv", 128, 128, False, True, T, heads) == "kv64tc16", (T, heads)
        # over 65-128 heads the prefill kernels take K = 64 passes from T = 161
        assert tiling.choose(layout, 64, 128, False, True, T, 128) == f"{layout}{'32c64' if T >= 161 else '64tc16'}"
    assert tiling.choose(layout, 64, 128, False, True, 24, 8192) == f"{layout}64tc"


def test_mma_variant_names():
    assert families.variants("kv", 128, 128, multi=True)[-12:] == ("kv64tc", "kv64tc16", "kv32tc", "kv32tc16",
                                                                       "kv32c64", "kv16c64", "kv32c64wg", "kv16c64wg",
                                                                       "kv64c64wt", "kv64c64sg", "kv128c64wt",
                                                                       "kv128c64sg")
    assert not {"kv64c64wt", "kv64c64sg"} & set(families.variants("kv", 128, 96, multi=True))  # 64-column slabs
    assert not {"kv128c64wt", "kv128c64sg"} & set(families.variants("kv", 128, 192, multi=True))  # 128-column ones
    assert not any(v.endswith("tc16") for v in families.variants("vk", 128, 128))  # T-token passes only
    assert families.tiling("vk", 128, "vk32tc16").passes_only
    assert families.variants("kv", 64, 128, multi=True)[-9] == "kv128tc16"  # K = 64 only, V a multiple of 128
    assert "vk128tc16" in families.variants("vk", 64, 256, multi=True)
    assert not any("128tc" in v for layout, K, V in (("kv", 128, 128), ("vk", 128, 256), ("kv", 64, 192))
                   for v in families.variants(layout, K, V, multi=True))


@pytest.mark.parametrize("V,loop,tc", [(128, "vk16x2", "vk64tc"), (96, "vk8x2", "vk32tc")])
def test_vk_k64_tensor_core_from_three_tokens_over_few_heads(V, loop, tc):
    """vk at K = 64: the tensor-core kernel from T = 3 over at most 128 heads, from T = 4 over more (V a
    multiple of 64; otherwise the token loop there)."""
    for heads in (16, 128):
        assert [tiling.choose("vk", 64, V, False, True, T, heads) for T in (2, 3, 4)] == [loop, tc, tc], heads
    many = tc if V % 64 == 0 else loop
    for heads in (129, 8192, None):
        assert [tiling.choose("vk", 64, V, False, True, T, heads) for T in (2, 3, 4)] == [loop, loop, many], heads


@pytest.mark.parametrize("heads,variant", [(1, "kv16w"), (16, "kv16w"), (128, "kv16w"), (256, "kv16w"),
                                           (257, "kv64x8"), (None, "kv64x8")])
def test_kv_decode_over_few_heads_in_one_warp(heads, variant):
    """h200-decode-tiny.json: one warp a CTA on 16-column slabs where the step is a chain of latencies, both ops."""
    for comba in (False, True):
        assert tiling.choose("kv", 128, 128, comba, heads=heads) == variant
        assert tiling.choose("kv", 128, 96, comba, heads=heads) == ("kv16w" if variant == "kv16w" else "kv32x8")
    assert tiling.choose("kv", 128, 128, False, multi=True, T=1, heads=heads) == "kv64x4"  # T-token build
    assert tiling.choose("kv", 64, 128, False, heads=heads) == "kv64x4"  # measured at K = 128 only


@pytest.mark.parametrize("heads,variant", [(1, "vk4x2"), (128, "vk4x2"), (512, "vk4x2"), (513, "vk16x2"),
                                           (None, "vk16x2")])
def test_vk_decode_over_few_heads_on_eight_row_slabs(heads, variant):
    """h200-decode-tiny.json: 16 CTAs a head of V = 128 where the step is a chain of latencies."""
    for comba in (False, True):
        assert tiling.choose("vk", 128, 128, comba, heads=heads) == variant
    assert tiling.choose("vk", 128, 128, False, multi=True, T=1, heads=heads) == "vk16x2"  # T-token build
    assert tiling.choose("vk", 64, 128, False, heads=heads) == "vk16x2"  # measured at K = 128 only


@pytest.mark.parametrize("heads,variant", [(16, "vk16x2"), (128, "vk16x2"), (129, "vk8x8"), (None, "vk8x8")])
def test_vk_verify_over_many_heads_on_eight_warps(heads, variant):
    """h200-verify-tilings.json: speculative verify (every token's state stored) on 64-row slabs of eight warps
    over more than 128 heads at K = 128; the plain T-token pass keeps vk16x2, and so do other K and V."""
    for comba in (False, True):
        assert tiling.choose("vk", 128, 128, comba, multi=True, T=1, heads=heads, verify=True) == variant
        assert tiling.choose("vk", 128, 128, comba, multi=True, T=1, heads=heads) == "vk16x2"
    for layout, K, V in (("vk", 128, 96), ("vk", 64, 128), ("vk", 256, 128), ("kv", 128, 128)):
        assert tiling.choose(layout, K, V, False, multi=True, T=1, heads=heads, verify=True) == \
            tiling.choose(layout, K, V, False, multi=True, T=1, heads=heads), (layout, K, V)
    assert "vk8x8" not in families.variants("vk", 128, 128) and "vk8x8" in families.variants("vk", 128, 128, True)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False])
def test_prefill_over_few_heads_and_long_prompts(layout, comba):
    """h200-prefill-tiling.json, h200-prefill-lengths.json: 64-token chunks over at most 32 heads from T = 33
    (16-column slabs over at most 16; at K = 64 over at most 16 heads from T = 17), from T = 49 over at most 64,
    from T = 97 (K = 128) or 113 (K = 64) over at most 128 (the sweeps' most); at K = 256 from T = 16 over any
    number; the tensor-core kernel or the token loop otherwise."""
    def choose(T, heads, K=128, **kw):
        return tiling.choose(layout, K, 128, comba, True, T, heads, **kw)

    assert choose(32, 16) == choose(32, 32) == choose(32, 1) == f"{layout}32tc16"
    assert choose(33, 1) == choose(48, 1) == choose(33, 16) == f"{layout}16c64"
    assert choose(48, 33) == choose(48, 64) == choose(96, 65) == choose(255, None) == f"{layout}64tc16"
    assert choose(49, 1) == choose(8192, 16) == choose(17, 16, K=64) == choose(17, 1, K=64) == f"{layout}16c64"
    assert choose(33, 17) == choose(33, 32, K=64) == choose(49, 33) == choose(49, 64, K=64) == f"{layout}32c64"
    assert choose(97, 65) == choose(65536, 128) == choose(113, 128, K=64) == f"{layout}32c64"
    assert choose(112, 65, K=64) == choose(16, 1, K=64) == choose(32, 32, K=64) == f"{layout}64tc16"
    assert choose(177, 129) == choose(65536, 8192) == choose(65536, None) == f"{layout}64tc16"  # beyond the sweeps
    assert choose(65536, 129, K=64) == choose(65536, None, K=64) == f"{layout}128tc16"
    assert choose(16, 16, K=256) == f"{layout}16c64" and not choose(15, 16, K=256).endswith("c64")
    assert choose(16, 17, K=256) == choose(16, 65, K=256) == choose(16, None, K=256) == f"{layout}32c64"
    assert not choose(15, 128, K=256).endswith("c64")
    # K = 256 with wide keys: only Gated DeltaNet's 16-column slab fits in shared memory
    assert choose(4096, 16, K=256, wide_keys=True) == (choose(15, 16, K=256) if comba else f"{layout}16c64")
    assert not choose(4096, 17, K=256, wide_keys=True).endswith("c64")
    assert not tiling.choose(layout, 128, 128, comba, False, 1, 16).endswith("c64")  # a decode step
    assert tiling.choose(layout, 128, 96, comba, True, 4096, 16) == f"{layout}16c64"  # V a multiple of 16
    assert choose(4096, 16, wide_keys=True) == f"{layout}16c64"


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_prefill_only_where_its_shared_memory_fits(layout):
    """A GPU that allows less shared memory a CTA than the H200 gets the prefill builds that fit it and the
    rules after the prefill one for the rest: an A100 (163 KB) keeps Gated DeltaNet's 16-column scan at
    K = 128 (164880 bytes) and loses Comba's (201744); a 99 KB GPU (sm_86 / sm_89) runs none."""
    a100, ada = 166912, 101376

    def choose(comba, K=128, T=8192, heads=16, **kw):
        return tiling.choose(layout, K, 128, comba, True, T, heads, **kw)

    assert choose(False, max_shared=a100) == choose(False) == f"{layout}16c64"
    assert choose(True) == f"{layout}16c64" and choose(True, max_shared=a100) == f"{layout}32tc16"
    for comba, K in itertools.product((True, False), families.SUPPORTED_K):
        assert not choose(comba, K, max_shared=ada).endswith("c64")
        assert choose(comba, K, max_shared=ada) == choose(comba, K, T=15 if K == 256 else 16 if K == 64 else 32)
    assert choose(True, 256, heads=64, max_shared=a100) == choose(True, 256, T=15, heads=64)


@pytest.mark.parametrize("name, points", [("h200-prefill-tiling.json", 200), ("h200-prefill-lengths.json", 200),
                                          ("h200-prefill-between.json", 75)])
def test_the_forward_choice_is_within_5_percent_of_the_best_timed(name, points):
    """At every point of the committed sweeps (T = 16-65536, K = 64-256, 1-128 heads, and 16-32 heads at T =
    1536-4096) the variant chosen is among those timed and within 5% of the fastest of them (with the wgmma scan
    where the sweep ran on a GPU that has it)."""
    with open(RESULTS / name) as f:
        report = json.load(f)
    rows = report["rows"]
    for r in rows:  # a row that did not time the transposed scans (or their pairs): the choice without them
        timed, pairs = (f"{r['layout']}{slab}c64wt" in r["us"] for slab in (64, 128))
        chosen = tiling.choose(r["layout"], r["K"], r["V"], r["op"] == "comba", True, r["T"], r["B"] * r["H"],
                               wgmma=report.get("wgmma", False), transposed=timed, paired=pairs)
        assert r["us"][chosen] <= 1.05 * min(r["us"].values()), r
        if report.get("wgmma", False):  # the choice of a GPU without it, among the kernels such a GPU has
            chosen = tiling.choose(r["layout"], r["K"], r["V"], r["op"] == "comba", True, r["T"], r["B"] * r["H"])
            us = {v: t for v, t in r["us"].items() if not v.endswith(("wg", "wt", "sg"))}
            assert us[chosen] <= 1.05 * min(us.values()), r
    assert len(rows) >= points  # the files are not stubs


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False])
def test_prefill_thresholds_on_wgmma(layout, comba):
    """h200-prefill-lengths.json, h200-prefill-tiling.json: where the scan runs on wgmma the prefill kernels take
    64-128 heads from T = 33, where the transposed scan takes them (at K = 64 64 heads from T = 49), 33-63 heads
    from T = 49; at K = 64 over at most 32 heads the wgmma scan from T = 1024 only, and the segmented scan from
    T = 1024 over 16 heads, on two warpgroups a CTA over 32 from T = 1024 and over 16 from T = 4096; the other
    thresholds stay."""
    def choose(T, heads, K=128, **kw):
        return tiling.choose(layout, K, 128, comba, True, T, heads, wgmma=True, **kw)

    assert choose(32, 128, K=64) == choose(48, 33, K=64) == choose(32, 64) == choose(32, 128) == f"{layout}64tc16"
    assert choose(48, 64, K=64) == choose(48, 63) == f"{layout}64tc16"
    assert choose(33, 128, K=64) == f"{layout}128c64wt" and choose(33, 64) == f"{layout}64c64wt"
    assert choose(49, 33, K=64) == choose(1023, 63, K=64) == choose(97, 128, K=64, transposed=False) == \
        f"{layout}32c64wg"
    assert choose(49, 64, K=64) == f"{layout}64c64wt" and choose(49, 128, K=64) == f"{layout}128c64wt"
    assert choose(16, 16, K=64) == f"{layout}64tc16" and choose(17, 16, K=64) == choose(1023, 16, K=64) == \
        f"{layout}16c64"
    assert choose(33, 32, K=64) == choose(1023, 32, K=64) == f"{layout}32c64"
    assert choose(1024, 32, K=64, paired=False) == choose(4095, 32, K=64, paired=False) == f"{layout}32c64wg"
    assert choose(1024, 32, K=64) == f"{layout}128c64sg"
    assert choose(1024, 16, K=64) == choose(4095, 16, K=64) == choose(65536, 1, K=64) == f"{layout}64c64sg"
    assert choose(4096, 16, K=64) == choose(4096, 32, K=64) == f"{layout}128c64sg"
    assert choose(96, 65, transposed=False) == choose(48, 63) == f"{layout}64tc16"
    assert choose(49, 64) == choose(33, 128, paired=False) == f"{layout}64c64wt"
    assert choose(49, 67) == choose(33, 128) == f"{layout}128c64wt"  # more 64-column CTAs than SMs: pairs
    assert choose(8192, 128) == f"{layout}128c64sg" and choose(4096, 16) == f"{layout}64c64sg"
    # the segments on pairs over 16 heads from T = 8192 and over 17-32 from T = 2560; over one head and over 64 on
    # one warpgroup a CTA
    assert choose(8192, 16) == choose(65536, 32) == choose(2560, 17) == choose(2560, 32) == f"{layout}128c64sg"
    assert choose(8191, 16) == choose(2559, 20) == f"{layout}64c64sg" and choose(2559, 32) == f"{layout}32c64wg"
    assert choose(8192, 1) == choose(8192, 64) == choose(8192, 16, paired=False) == f"{layout}64c64sg"
    assert choose(97, 65, transposed=False) == choose(96, 63) == choose(33, 32) == f"{layout}32c64wg"
    assert choose(32, 32) == f"{layout}32tc16" and choose(97, 129) == f"{layout}64tc16"  # beyond the sweeps


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_prefill_thresholds_without_wgmma(layout):
    """h200-prefill-lengths.json: prefill_scan takes 65-128 heads at K = 128 from T = 97, at K = 64 from T = 113."""
    def choose(T, K=128):
        return tiling.choose(layout, K, 128, True, True, T, 128)

    assert choose(96) == choose(112, K=64) == f"{layout}64tc16"
    assert choose(97) == choose(113, K=64) == f"{layout}32c64"


def test_the_wgmma_scan_choice_is_within_5_percent_of_the_best_timed():
    """h200-prefill-wgmma.json: where the tiling takes the wgmma scan (bf16 q, k, p and products on compute
    capability 9.0), its choice among both slabs of both scans is within 5% of the fastest at every point."""
    with open(RESULTS / "h200-prefill-wgmma.json") as f:
        rows = json.load(f)["rows"]
    for r in rows:  # the rules without the transposed scans (h200-prefill-transposed.json), which a row may time too
        chosen = tiling.choose(r["layout"], r["K"], r["V"], r["op"] == "comba", True, r["T"], r["B"] * r["H"],
                               wgmma=True, transposed=False)
        scans = {v: t for v, t in r["us"].items() if v.endswith(("c64", "c64wg"))}
        assert len(scans) == 4 and scans[chosen] <= 1.05 * min(scans.values()), r
    assert len(rows) == 92


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_the_wgmma_scan_where_it_wins(layout):
    """32-column slabs and Gated DeltaNet's 16-column ones on wgmma; Comba's 16-column ones from T = 1024; never at
    K = 256, nor without wgmma."""
    def choose(comba, K=128, heads=16, wgmma=True, T=4096):  # the rules before the transposed scans
        return tiling.choose(layout, K, 128, comba, True, T, heads, wgmma=wgmma, transposed=False)
    assert choose(False) == choose(True) == choose(True, T=1024) == f"{layout}16c64wg"
    assert choose(True, heads=1) == choose(True, heads=1, T=1024) == f"{layout}16c64wg"
    assert choose(True, heads=1, T=1023) == choose(True, T=1023) == f"{layout}16c64"
    assert choose(True, heads=32) == choose(False, K=64, heads=64) == f"{layout}32c64wg"
    assert choose(False, K=256) == f"{layout}16c64" and choose(False, wgmma=False) == f"{layout}16c64"


def test_the_transposed_choice_is_within_5_percent_of_the_best_timed():
    """h200-prefill-transposed.json (32-128 heads, T = 256-4096, K = 128 and 64, kv and vk) and
    h200-prefill-parts.json (whole passes on the shapes of flash-linear-attention's table and 64 heads): the
    transposed scan against the variant the rules choose without it and the rules' choice; the choice is among
    them and within 5% of the fastest at every point."""
    with open(RESULTS / "h200-prefill-transposed.json") as f:
        rows = json.load(f)["rows"]
    for r in rows:  # a row that did not time the segmented scan: the choice without it
        segmented = any(v.endswith("sg") for v in r["us"])
        chosen = tiling.choose(r["layout"], r["K"], r["V"], r["op"] == "comba", True, r["T"], r["B"] * r["H"],
                               wgmma=True, segmented=segmented)
        assert r["us"][chosen] <= 1.05 * min(r["us"].values()), r
    assert len(rows) == 36
    with open(RESULTS / "h200-prefill-parts.json") as f:
        rows = json.load(f)["rows"]
    for r in rows:  # it predates the segmented scan and the paired CTAs
        chosen = tiling.choose("kv", 128, 128, r["op"] == "comba", True, r["T"], r["B"] * r["H"], wgmma=True,
                               segmented=False, paired=False)
        whole = {v: t for v, t in r.items() if v.startswith("kv") and ":" not in v}
        assert whole[chosen] <= 1.05 * min(whole.values()), r
    assert len(rows) == 14


def test_the_segmented_choice_is_within_5_percent_of_the_best_timed():
    """h200-prefill-segments.json (1-64 heads, T = 1024-16384, kv and vk, K = 128 and 64): the rules' choice (on two
    warpgroups a CTA where they take them) is timed at every point, and within 5% of the fastest of it, the
    segmented scan on one warpgroup a CTA (cut as tiling.segments cuts it), the whole transposed scan and the
    rules' choice without them."""
    with open(RESULTS / "h200-prefill-segments.json") as f:
        rows = json.load(f)["rows"]
    for r in rows:
        heads = r["B"] * r["H"]
        chosen = tiling.choose(r["layout"], r["K"], r["V"], r["op"] == "comba", True, r["T"], heads, wgmma=True)
        assert r["auto_segments"] == tiling.segments(heads, r["V"], r["T"], 132)[0]
        assert r["us"][chosen] <= 1.05 * min(r["us"].values()), r
    assert len(rows) == 74


def _ragged_segments(lengths, per):
    """The segments of a ragged batch cut into segments of ``per`` chunks, as the segmented scan's CTAs find them
    (kernels_cu/prefill_transposed.cu: max(1, ceil(chunks / per)) a sequence, an empty one too)."""
    chunks = [-(-n // 64) for n in lengths]
    return sum(max(1, -(-c // per)) for c in chunks)


def _partitions(T, N, rng, per):
    """Ways to pack N sequences into T tokens: even, random, and the most segments (all but one sequence a chunk
    and a whole number of segments past it), with empty sequences and gaps."""
    yield [T // N] * N
    for _ in range(40):
        cuts = sorted(rng.integers(0, T + 1, N - 1).tolist())
        yield [b - a for a, b in zip([0] + cuts, cuts + [T])]
    for _ in range(N):
        lengths = [64 * per * int(rng.integers(0, 3)) + 1 for _ in range(N - 1)] + [0]
        if sum(lengths) <= T:
            lengths[-1] = T - sum(lengths)
            yield lengths
    yield [1] * (N - 1) + [T - (N - 1)]


@pytest.mark.parametrize("N", [1, 2, 3, 5, 8, 40])
@pytest.mark.parametrize("H", [1, 4, 16, 32])
def test_a_ragged_batchs_segments_run_at_once(N, H):
    """The segmented scan reads a sequence's initial state in every segment's CTA and writes its final state from
    the last, in place for a pool: every CTA must start before the last ends.  Cut as the plan cuts a ragged batch
    (tiling.segments by the mean length, then tiling.ragged_segment_chunks), the segments' CTAs of any lengths fit
    on the GPU at once (one CTA an SM), or each sequence is one segment; one sequence is cut as a dense row is."""
    rng = numpy.random.default_rng(N * 100 + H)
    for T, V, slab, sms in itertools.product([64 * N, 1000 * N + 37, 4096 * N, 70000], [64, 128], [64, 128],
                                             [132, 78]):
        if slab > V:
            continue
        slabs = V // slab
        per0 = tiling.segments(N * H, V, max(1, T // N), sms, slab)[1]
        per = tiling.ragged_segment_chunks(per0, N, H, V, T, sms, slab)
        assert per >= per0
        if N == 1:
            assert per == per0, (T, V, slab, sms)
        for lengths in _partitions(T, N, rng, per):
            assert sum(lengths) <= T and min(lengths) >= 0
            ctas = _ragged_segments(lengths, per) * H * slabs
            assert ctas <= sms or _ragged_segments(lengths, per) == N, (T, V, slab, sms, lengths, per)
    # where it costs: two sequences of 4096 tokens over 16 heads, two warpgroups a CTA
    assert tiling.segments(32, 128, 4096, 132, 128)[1] == 16
    assert tiling.ragged_segment_chunks(16, 2, 16, 128, 8192, 132, 128) == 19
    assert _ragged_segments([4160, 4032], 16) * 16 == 144 > 132  # 16 chunks a segment: a second wave
    assert _ragged_segments([4160, 4032], 19) * 16 <= 132


def test_the_segments_table_is_the_rules_rendering():
    """docs/benchmarks.md's table of the segmented scan is what benchmarks/render_benchmarks.py makes of
    h200-prefill-segments.json under the current rules, so a change of the rules shows there or fails here."""
    render = renderer()
    with open(RESULTS / "h200-prefill-segments.json") as f:
        report = json.load(f)
    assert render.block_of(report) == "segments"
    table = render.tables(report)["segments"]
    assert table.count("\n") > 50 and table in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False])
def test_the_segmented_scan_where_it_wins(layout, comba):
    """Where the segmented scan may be chosen: a dense batch of at most 16 CTAs a segment (B * H * V / 64) from
    T = 1024, 40 from 1536 (64 from 2560 on two warpgroups a CTA), 256 from 8192 (128 heads, the most the prefill
    kernels take); with wgmma and V a multiple of 64; never without the transposed scans, nor with
    ``segmented=False``."""
    def choose(T, heads, **kw):
        return tiling.choose(layout, 128, 128, comba, True, T, heads, **{"wgmma": True, **kw})
    sg = f"{layout}64c64sg"
    assert choose(1024, 8) == choose(1536, 16) == choose(1536, 20) == choose(8192, 128, paired=False) == \
        choose(65536, 1) == sg
    assert choose(8192, 128) == f"{layout}128c64sg"  # two warpgroups a CTA: 128 heads make 256 CTAs of 64 columns
    assert choose(1023, 8) != sg and choose(1535, 16) != sg and not choose(8191, 128).endswith("sg") and \
        choose(1536, 21) != sg and not choose(2559, 21).endswith("sg")
    assert choose(65536, 129) != sg and tiling.choose(layout, 128, 256, comba, True, 8192, 128, wgmma=True) != sg
    assert choose(4096, 16, transposed=False) != sg
    assert choose(8192, 16, wgmma=False) != sg and tiling.choose(layout, 128, 96, comba, True, 8192, 16,
                                                                wgmma=True) != sg
    assert choose(8192, 16, segmented=False) == choose(8192, 16, transposed=False)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False])
def test_the_transposed_scan_where_it_wins(layout, comba):
    """Over 64-128 heads from T = 33 (at K = 64 over 64 heads from T = 49), with wgmma and V a multiple of 64, in
    segments from T = 8192; nowhere else."""
    def choose(T=4096, heads=64, K=128, V=128, **kw):
        return tiling.choose(layout, K, V, comba, True, T, heads, **{"wgmma": True, **kw})
    assert choose() == choose(heads=128, paired=False) == choose(T=49) == choose(K=64, T=49) == \
        choose(K=64, T=512) == choose(heads=66) == f"{layout}64c64wt"
    assert choose(heads=67) == choose(heads=128) == choose(K=64, heads=128) == choose(K=64, heads=128, T=49) == \
        f"{layout}128c64wt"  # pairs where 64-column CTAs pass the SMs
    assert choose(K=64, T=513) == choose(K=64) == choose(T=33, heads=65) == f"{layout}64c64wt"
    assert choose(T=32, heads=64) == choose(K=64, T=48) == f"{layout}64tc16" and choose(T=33) == f"{layout}64c64wt"
    assert choose(K=64, T=8192) == choose(T=8192) == f"{layout}64c64sg"
    assert choose(heads=63) == choose(K=64, heads=63) == choose(V=96) == f"{layout}32c64wg"
    assert choose(wgmma=False) == f"{layout}32c64" and choose(transposed=False) == f"{layout}32c64wg"
    assert not choose(heads=129).endswith("c64wt")  # beyond the prefill sweeps the token kernels keep every length


def _first_prefill_t(layout, K, heads, comba, most=256):
    """The shortest pass the rules give the 64-token prefill kernels on the H200 (bf16 products on wgmma), or None."""
    for T in range(1, most + 1):
        if "c64" in tiling.choose(layout, K, 128, comba, True, T, heads, wgmma=True):
            return T
    return None


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False])
def test_the_design_page_threshold_table_is_the_rules(layout, comba):
    """design.md's table of the first T the prefill kernels take, by heads and K, is what tiling.choose does at
    every head count of each row (its first number where a cell names several scans)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("| heads | K = 64 | K = 128 |"):]
    rows = re.findall(r"^\| (\d+)(?:-(\d+))? \| (\d+)[^|]*\| (\d+)[^|]*\|$", table.split("\n\n")[0], re.MULTILINE)
    assert len(rows) == 5, rows
    for lo, hi, t64, t128 in rows:
        for heads in range(int(lo), int(hi or lo) + 1):
            for K, T in ((64, t64), (128, t128)):
                assert _first_prefill_t(layout, K, heads, comba) == int(T), (heads, K)
    more = table.split("\n\n")[0].splitlines()[-1]
    assert more.startswith("| more (the most the sweeps measured is 128) |")
    for K in (64, 128):
        assert "c64" not in tiling.choose(layout, K, 128, comba, True, 65536, 129, wgmma=True)
