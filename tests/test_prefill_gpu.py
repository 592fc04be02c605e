"""The 64-token prefill kernels (``{layout}{slab}c64``, and where the GPU has compute capability 9.0 the scans on
wgmma: ``{layout}{slab}c64wg``, ``{layout}64c64wt`` and ``{layout}64c64sg``) against the float64 reference
(``pytest -m gpu``).

Every case runs a forced variant on fresh random inputs into NaN-poisoned outputs.  ``precision="fp32"``
(3xTF32) is held to the fp32 kernels' accuracy, ``"tf32"`` and ``"bf16"`` (bf16 products where q, k, p are bf16,
else TF32 ones) to the accuracy docs/design.md states for them.
"""

import itertools

import numpy
import pytest

from cupy_comba import _plan, bfloat16, comba_forward, families, gated_delta_forward, reference, tiling
from cupy_comba.inputs import forward_inputs

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

F16, F32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
#: Relative error bounds (state, o) by precision and activation dtype; bf16 and fp16 o are rounded outputs.
TOL = {("fp32", "bfloat16"): (1e-6, 4e-3), ("fp32", "float16"): (1e-6, 1e-3), ("fp32", "float32"): (1e-6, 5e-6),
       ("tf32", "bfloat16"): (1.5e-3, 5e-3), ("tf32", "float16"): (1.5e-3, 2e-3), ("tf32", "float32"): (1.5e-3, 2e-3),
       ("bf16", "bfloat16"): (4e-3, 5e-3), ("bf16", "float16"): (1.5e-3, 2e-3), ("bf16", "float32"): (1.5e-3, 2e-3)}


def _wgmma():
    """Whether this GPU runs the wgmma scan (``{layout}{slab}c64wg``: compute capability 9.0); False with none."""
    try:
        return families.runs_wgmma(cupy.cuda.Device().compute_capability)
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


needs_wgmma = pytest.mark.skipif(not _wgmma(), reason="the wgmma scan needs compute capability 9.0")


def _programmatic():
    """Whether a plan's kernels launch as programmatic dependents here (compute capability 9.0 and a driver that
    has them)."""
    from cupy_comba import _launcher
    return _launcher.dependent_launches() and int(cupy.cuda.Device().compute_capability) >= 90


def _forward(comba, q, k, v, p, beta, g, S, **opts):
    out = cupy.full(v.shape, cupy.nan, opts.pop("o_dtype", v.dtype))
    state_out = None if S is None or not opts.get("output_final_state", True) else cupy.full(S.shape, cupy.nan,
                                                                                              F32)
    if comba:
        return comba_forward(q, k, v, p, beta, g, initial_state=S, out=out, state_out=state_out, **opts)
    return gated_delta_forward(q, k, v, beta, g, initial_state=S, out=out, state_out=state_out, **opts)


def _check(comba, args, precision, **opts):
    q, k, v, p, beta, g, S0 = args
    o, S = _forward(comba, *args, precision=precision, **opts)
    ref_opts = {n: x for n, x in opts.items() if n not in ("variant", "output_final_state")}
    S_ref, o_ref = reference.comba_loop(S0, q, k, v, p if comba else k, beta, g, **ref_opts)
    tol_s, tol_o = TOL[precision or "bf16", numpy.dtype(q.dtype).name]  # None: "bf16"
    assert reference.relative_error(o, o_ref) <= tol_o
    if opts.get("output_final_state", True):
        assert reference.relative_error(S, S_ref) <= tol_s
    else:
        assert S is None
    return o, S


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (128, 96), (256, 64)])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate,l2norm", [("log", False), ("linear", True)], ids=["log", "linear-l2norm"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_matches_reference(K, V, layout, comba, gate, l2norm, T, precision):
    if K == 256 and T not in (65, 200):
        pytest.skip("K = 256: two lengths")
    args = forward_inputs(2, T, 4, K, V, Hk=2, state_layout=layout, gate=gate, seed=K + T + V, dtype=bfloat16,
                          normalize_keys=not l2norm, xp=cupy)
    for slab in families.PREFILL_SLABS:
        if V % slab == 0:
            _check(comba, args, precision, state_layout=layout, gate=gate, use_qk_l2norm=l2norm,
                   variant=f"{layout}{slab}c64")


@needs_wgmma
@pytest.mark.parametrize("K,V", [(64, 64), (64, 128), (128, 128), (128, 96)])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate,l2norm", [("log", False), ("linear", True)], ids=["log", "linear-l2norm"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200, 1000])
def test_the_wgmma_scan_matches_reference(K, V, layout, comba, gate, l2norm, T, monkeypatch):
    """``prefill_scan_wg`` (bf16 products on wgmma) on both slabs and ``prefill_scan_wt`` (the transposed scan,
    one warpgroup a 64-column slab or two a 128-column one), whole and in segments (8 or 4 CTAs a segment here,
    segments of one chunk allowed: as many segments as chunks up to 8 or 16, of 1-2 chunks), to the bf16 products'
    bounds."""
    monkeypatch.setattr(tiling, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(_plan, "PLANS", {})  # a plan holds its segments
    args = forward_inputs(2, T, 4, K, V, Hk=2, state_layout=layout, gate=gate, seed=K + T + V, dtype=bfloat16,
                          normalize_keys=not l2norm, xp=cupy, warm_steps=8 if T == 1000 else 0)
    for variant in [f"{layout}{slab}c64wg" for slab in families.PREFILL_SLABS] + \
            [f"{layout}{64 * wgs}c64{part}" for wgs in families.WT_WARPGROUPS for part in ("wt", "sg")]:
        if V % families.tiling(layout, K, variant).slab == 0:
            _check(comba, args, "bf16", state_layout=layout, gate=gate, use_qk_l2norm=l2norm, variant=variant)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("precision", [None, "fp32"], ids=["default", "fp32"])
def test_a_thousand_tokens(layout, comba, precision):
    """T = 1000 (15 full chunks and one of 40 tokens) from a warmed state, on both slabs: the error stays
    at its bound over a long prompt, the default being the bf16 read."""
    args = forward_inputs(1, 1000, 2, 128, 128, state_layout=layout, seed=1000, warm_steps=8, dtype=bfloat16,
                          xp=cupy)
    for slab in families.PREFILL_SLABS:
        _check(comba, args, precision, state_layout=layout, variant=f"{layout}{slab}c64")


@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_wide_keys(dtype, layout, comba, precision):
    """fp16 and fp32 keys are staged as fp32 (their own builds)."""
    args = forward_inputs(2, 130, 4, 128, 64, Hk=2, state_layout=layout, seed=7, dtype=dtype, xp=cupy)
    _check(comba, args, precision, state_layout=layout, variant=f"{layout}32c64")


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [bfloat16, F32], ids=["bf16", "fp32"])
def test_strided_activations(layout, dtype):
    """q, k, v, p slices of one packed projection (no 16-byte copies) and an o with a gap between heads."""
    B, T, H, K, V = 2, 100, 4, 128, 64
    rng = numpy.random.default_rng(5)
    packed = cupy.asarray(rng.standard_normal((B, T, H, 3 * K + V + 3)).astype(dtype))
    q, k, p, v = packed[..., :K], packed[..., K + 1:2 * K + 1], packed[..., 2 * K + 2:3 * K + 2], packed[..., -V:]
    k = k / cupy.linalg.norm(k.astype(F32), axis=-1, keepdims=True).astype(dtype)
    p = p / cupy.linalg.norm(p.astype(F32), axis=-1, keepdims=True).astype(dtype)
    beta = cupy.asarray(rng.random((B, T, H)).astype(dtype))
    g = cupy.asarray(-rng.random((B, T, H)).astype(F32) / 4)
    S0 = cupy.asarray(rng.standard_normal((B, H, K, V) if layout == "kv" else (B, H, V, K)).astype(F32) / 8)
    S_ref, o_ref = reference.comba_loop(S0, q, k, v, p, beta, g, state_layout=layout)
    runs = [(f"{layout}32c64", "fp32")] + ([(f"{layout}32c64wg", "bf16"), (f"{layout}64c64wt", "bf16"),
                                            (f"{layout}64c64sg", "bf16")] if dtype == bfloat16 and _wgmma() else [])
    for variant, precision in runs:
        o_buf = cupy.full((B, T, H, V + 8), cupy.nan, dtype)
        o, S = comba_forward(q, k, v, p, beta, g, initial_state=S0, out=o_buf[..., :V], state_layout=layout,
                             variant=variant, precision=precision)
        tol_s, tol_o = TOL[precision, numpy.dtype(dtype).name]
        assert reference.relative_error(S, S_ref) <= tol_s
        assert reference.relative_error(o, o_ref) <= tol_o
        assert bool(cupy.isnan(o_buf[..., V:]).all())  # the gap untouched


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("precision,scan", [("fp32", "32c64"), ("tf32", "32c64"), ("bf16", "32c64wg"),
                                             ("bf16", "64c64wt"), ("bf16", "128c64wt"), ("bf16", "64c64sg"),
                                             ("bf16", "128c64sg")])
def test_ragged_pool_gating(layout, comba, precision, scan):
    """Packed sequences of many lengths (empty ones too) from a pool with padding rows, in-kernel gating (the
    segmented scan as tiling.segments cuts them by their mean length: a segment a chunk)."""
    if scan.endswith(("wg", "wt", "sg")) and not _wgmma():
        pytest.skip("the wgmma scan needs compute capability 9.0")
    lens = [0, 70, 1, 0, 200, 64, 128, 5]
    N, H, Hk, K, V = len(lens), 4, 2, 128, 128 if scan.startswith("128") else 64
    cu = numpy.concatenate([[0], numpy.cumsum(lens)]).astype(numpy.int32)
    q, k, v, p, beta, g, _ = forward_inputs(1, int(cu[-1]), H, K, V, Hk=Hk, state_layout=layout, seed=3, xp=cupy)
    rng = numpy.random.default_rng(0)
    shape = (N + 3, H, K, V) if layout == "kv" else (N + 3, H, V, K)
    pool = cupy.asarray(rng.standard_normal(shape).astype(F32) / 8)
    before = cupy.asnumpy(pool)
    idx = numpy.array([3, 0, 5, -1, 9, 1, 2, 7], numpy.int64)
    A_log = cupy.asarray(rng.standard_normal(H).astype(F32) / 2)
    dt_bias = cupy.asarray(rng.standard_normal(H).astype(F32) / 2)
    out = cupy.full(v.shape, cupy.nan, v.dtype)
    kw = dict(state_layout=layout, state_indices=cupy.asarray(idx), cu_seqlens=cupy.asarray(cu), A_log=A_log,
              dt_bias=dt_bias, use_beta_sigmoid=True, variant=f"{layout}{scan}", precision=precision)
    if comba:
        o, S = comba_forward(q, k, v, p, beta, g, initial_state=pool, out=out, **kw)
    else:
        o, S = gated_delta_forward(q, k, v, beta, g, initial_state=pool, out=out, **kw)
    assert S is pool and o is out
    h = cupy.asnumpy
    S_ref, o_ref = reference.comba_loop(before, h(q), h(k), h(v), h(p if comba else k), h(beta), h(g),
                                        state_layout=layout, state_indices=idx, cu_seqlens=cu, A_log=h(A_log),
                                        dt_bias=h(dt_bias), use_beta_sigmoid=True)
    tol_s, tol_o = TOL[precision, "bfloat16"]
    live = reference.live_slots(idx, N + 3)
    assert reference.relative_error(h(S)[live], S_ref[live]) <= tol_s
    assert reference.relative_error(o, o_ref) <= tol_o
    untouched = numpy.setdiff1d(numpy.arange(N + 3), live)
    assert numpy.array_equal(h(S)[untouched], before[untouched])  # bit for bit
    assert not bool(cupy.isnan(o).any())  # every token written, the padding row's with zeros


# Where the gates decay slowly (a 1/e memory of ~500 tokens) the bf16 operands' rounding of the state carries over
# many chunks: Comba's whole scans land at 5-6e-3 of the reference at T = 4096, over the fast-gate bounds of TOL.
# The segmented scan is held to these bounds and to within SEGMENT_COST of the whole transposed scan's own error on
# the same inputs (its maps M are bf16: kernels_cu/prefill_transposed.cu, "Segments").
SLOW = (8e-3, 8e-3)
SEGMENT_COST = 1.35


def _as_close_as_the_whole_scan(errors, whole):
    """``errors`` and ``whole``: (state, o) errors of the segmented and the whole transposed scan."""
    for err, err_whole, bound in zip(errors, whole, SLOW):
        assert err <= bound and err <= SEGMENT_COST * err_whole, (errors, whole)


@needs_wgmma
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("segments", [2, 3, 7])
@pytest.mark.parametrize("slab", [64, 128])
def test_segments_from_a_pool(layout, comba, K, segments, slab, monkeypatch):
    """The segmented scan cut into 2, 3 and 7 segments (the last one short) over 13 chunks of slowly decaying
    gates, on one warpgroup a 64-column slab and on two a 128-column one (whose chain runs two warpgroups a CTA at
    K = 128 where p is k): rows from a pool with a padding row and in-kernel gating, and rows from no initial state; with and
    without the final state.  Each is as close to the reference as the whole transposed scan; the padding row's o
    is zeros and the slots no row names are untouched, bit for bit."""
    monkeypatch.setattr(tiling, "segments", lambda heads, V, T, sms, slab=64: (segments,
                                                                                -(-((T + 63) // 64) // segments)))
    monkeypatch.setattr(_plan, "PLANS", {})
    B, T, H, V = 3, 13 * 64 - 20, 2, 128
    q, k, v, p, beta, g, _ = forward_inputs(B, T, H, K, V, state_layout=layout, seed=segments, xp=cupy)
    g /= 100  # every segment's start depends on the ones before it
    rng = numpy.random.default_rng(segments)
    shape = (B + 2, H, K, V) if layout == "kv" else (B + 2, H, V, K)
    before = rng.standard_normal(shape).astype(F32) / 8
    idx = numpy.array([3, -1, 0], numpy.int32)
    A_log = cupy.asarray(rng.standard_normal(H).astype(F32) / 2 - 5)  # in-kernel gates of slow decay too
    dt_bias = cupy.asarray(rng.standard_normal(H).astype(F32) / 2)
    h = cupy.asnumpy
    live = reference.live_slots(idx, B + 2)

    def forward(scan="sg", **kw):
        out = cupy.full(v.shape, cupy.nan, v.dtype)
        kw.update(out=out, state_layout=layout, variant=f"{layout}{slab}c64{scan}")
        if comba:
            return comba_forward(q, k, v, p, beta, g, **kw)
        return gated_delta_forward(q, k, v, beta, g, **kw)

    def errors(o, S, S_ref, o_ref, rows=slice(None)):
        return reference.relative_error(h(S)[rows], S_ref[rows]), reference.relative_error(o, o_ref)

    S_ref, o_ref = reference.comba_loop(before, h(q), h(k), h(v), h(p if comba else k), h(beta), h(g),
                                        state_layout=layout, state_indices=idx, A_log=h(A_log), dt_bias=h(dt_bias))
    S0_ref, o0_ref = reference.comba_loop(numpy.zeros((B,) + shape[1:]), h(q), h(k), h(v), h(p if comba else k),
                                          h(beta), h(g), state_layout=layout)
    pooled = dict(state_indices=cupy.asarray(idx), A_log=A_log, dt_bias=dt_bias)
    whole = errors(*forward("wt", initial_state=cupy.asarray(before), **pooled), S_ref, o_ref, live)
    whole0 = errors(*forward("wt"), S0_ref, o0_ref)
    for final in (True, False):
        pool = cupy.asarray(before)
        o, S = forward(initial_state=pool, output_final_state=final, **pooled)
        assert bool((o[1] == 0).all())  # the padding row
        if final:
            assert S is pool
            _as_close_as_the_whole_scan(errors(o, S, S_ref, o_ref, live), whole)
            untouched = numpy.setdiff1d(numpy.arange(B + 2), live)
            assert numpy.array_equal(h(S)[untouched], before[untouched])
        else:
            assert S is None and numpy.array_equal(h(pool), before)
            _as_close_as_the_whole_scan((0.0, reference.relative_error(o, o_ref)), whole)
        o, S = forward(output_final_state=final)  # from zeros: the first map's E alone
        if final:
            _as_close_as_the_whole_scan(errors(o, S, S0_ref, o0_ref), whole0)
        else:
            assert S is None
            _as_close_as_the_whole_scan((0.0, reference.relative_error(o, o0_ref)), whole0)
    plans = [pl for pl in _plan.PLANS.values() if pl.variant.endswith("sg")]
    # prep, chain, segments; where the launches are dependents, the prep's tail part after the chain
    split = _programmatic() and K == 128 and slab == 128
    assert len(plans) == 4 and all(len(pl.launcher._steps) == (4 if split else 3) for pl in plans)
    chain_threads = 256 if slab == 128 and K == 128 and not comba else 128
    assert all(pl.launcher._steps[1][2] == chain_threads for pl in plans)


@needs_wgmma
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
def test_segments_over_a_long_prompt(comba):
    """One row of 4096 tokens over 4 heads of slowly decaying gates on the segmented scan as tiling.segments cuts
    it (16 segments), from a warmed state: as close to the reference as the whole transposed scan.  It is the
    default choice there."""
    q, k, v, p, beta, g, S = forward_inputs(1, 4096, 4, 128, 128, seed=4096, warm_steps=4, dtype=bfloat16, xp=cupy)
    args = (q, k, v, p, beta, g / 100, S)
    S_ref, o_ref = reference.comba_loop(*(cupy.asnumpy(a) for a in (S, q, k, v, p if comba else k, beta, g / 100)))
    runs = {scan: _forward(comba, *args, variant=f"kv64c64{scan}") for scan in ("wt", "sg")}
    err = {scan: (reference.relative_error(S, S_ref), reference.relative_error(o, o_ref))
           for scan, (o, S) in runs.items()}
    _as_close_as_the_whole_scan(err["sg"], err["wt"])
    o, S = _forward(comba, *args)
    assert bool((o == runs["sg"][0]).all()) and bool((S == runs["sg"][1]).all())


@needs_wgmma
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("slab", [64, 128])
def test_segments_of_a_ragged_batch_are_its_sequences_segments(layout, comba, K, slab, monkeypatch):
    """A ragged batch on the segmented scan, cut into segments of two chunks: sequences of 0-700 tokens (a chunk
    and a token, a partial last chunk, empty ones) from a pool with a padding row and in-kernel gating, slowly
    decaying gates.  Each sequence's o and final state are bit for bit those of the same sequence run alone, as a
    dense row cut into segments of two chunks; the empty sequence keeps its slot's state, the padding row's o is
    zeros, the slots no sequence names are untouched, and the batch is as close to the reference as the whole
    transposed scan."""
    monkeypatch.setattr(tiling, "segments", lambda heads, V, T, sms, slab=64: (-(-((T + 63) // 64) // 2), 2))
    monkeypatch.setattr(_plan, "PLANS", {})
    lens = [300, 0, 1, 64, 65, 700, 129, 200]
    idx = numpy.array([5, 2, 0, 8, -1, 3, 7, 1], numpy.int32)
    N, H, V = len(lens), 2, 128
    cu = numpy.concatenate([[0], numpy.cumsum(lens)]).astype(numpy.int32)
    q, k, v, p, beta, g, _ = forward_inputs(1, int(cu[-1]), H, K, V, state_layout=layout, seed=K + slab, xp=cupy)
    g /= 100
    rng = numpy.random.default_rng(K)
    shape = (N + 2, H, K, V) if layout == "kv" else (N + 2, H, V, K)
    before = rng.standard_normal(shape).astype(F32) / 8
    A_log = cupy.asarray(rng.standard_normal(H).astype(F32) / 2 - 5)
    dt_bias = cupy.asarray(rng.standard_normal(H).astype(F32) / 2)
    gates = dict(A_log=A_log, dt_bias=dt_bias)

    def forward(arrays, pool, slots, scan="sg", **kw):
        q, k, v, p, beta, g = arrays
        out = cupy.full(v.shape, cupy.nan, v.dtype)
        kw.update(out=out, state_layout=layout, variant=f"{layout}{slab}c64{scan}", initial_state=pool,
                  state_indices=cupy.asarray(slots), **gates)
        if comba:
            return comba_forward(q, k, v, p, beta, g, **kw)
        return gated_delta_forward(q, k, v, beta, g, **kw)

    acts = (q, k, v, p, beta, g)
    pool = cupy.asarray(before)
    o, S = forward(acts, pool, idx, cu_seqlens=cupy.asarray(cu))
    assert S is pool and o is not None
    for n in range(N):
        a, z = int(cu[n]), int(cu[n + 1])
        if idx[n] < 0:
            assert bool((o[:, a:z] == 0).all())
            continue
        if a == z:
            assert numpy.array_equal(cupy.asnumpy(S[idx[n]]), before[idx[n]])
            continue
        alone = cupy.asarray(before)
        o_n, S_n = forward([x[:, a:z] for x in acts], alone, idx[n:n + 1])
        assert bool((o[:, a:z] == o_n).all()) and bool((S[idx[n]] == S_n[idx[n]]).all()), n
    h = cupy.asnumpy
    S_ref, o_ref = reference.comba_loop(before, h(q), h(k), h(v), h(p if comba else k), h(beta), h(g),
                                        state_layout=layout, state_indices=idx, cu_seqlens=cu, A_log=h(A_log),
                                        dt_bias=h(dt_bias))
    live = reference.live_slots(idx, N + 2)
    untouched = numpy.setdiff1d(numpy.arange(N + 2), live)
    assert numpy.array_equal(h(S)[untouched], before[untouched])
    err = reference.relative_error(h(S)[live], S_ref[live]), reference.relative_error(o, o_ref)
    o_w, S_w = forward(acts, cupy.asarray(before), idx, scan="wt", cu_seqlens=cupy.asarray(cu))
    whole = reference.relative_error(h(S_w)[live], S_ref[live]), reference.relative_error(o_w, o_ref)
    _as_close_as_the_whole_scan(err, whole)
    plan = next(pl for pl in _plan.PLANS.values() if pl.variant.endswith("sg") and pl.o_shape == o.shape)
    assert len(plan.launcher._steps) == 3  # prep, chain, segments


@needs_wgmma
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
def test_a_long_row_takes_the_wgmma_scans_third_stage(layout, comba):
    """A row of families.WG_RING_CHUNKS chunks or more runs the wgmma scan through a ring of three stages, a shorter
    one through two: dense (the last chunk partial) and packed, a short and a long sequence in one launch, on both
    slabs, from a warmed state, to the bf16 products' bounds."""
    T = 64 * families.WG_RING_CHUNKS + 37
    args = forward_inputs(1, T, 2, 128, 128, state_layout=layout, seed=T, warm_steps=8, dtype=bfloat16, xp=cupy)
    q, k, v, p, beta, g, S0 = args
    cu = numpy.array([0, 100, T], numpy.int32)
    pool = cupy.concatenate([S0, S0[:, ::-1]])
    h = cupy.asnumpy
    S_ref, o_ref = reference.comba_loop(h(pool), h(q), h(k), h(v), h(p if comba else k), h(beta), h(g),
                                        state_layout=layout, cu_seqlens=cu)
    tol_s, tol_o = TOL["bf16", "bfloat16"]
    for slab in families.PREFILL_SLABS:
        variant = f"{layout}{slab}c64wg"
        _check(comba, args, "bf16", state_layout=layout, variant=variant)
        o, S = _forward(comba, *args[:6], pool, state_layout=layout, cu_seqlens=cupy.asarray(cu), variant=variant)
        assert reference.relative_error(o, o_ref) <= tol_o
        assert reference.relative_error(S, S_ref) <= tol_s


@needs_wgmma
def test_the_third_stage_has_room_only_where_it_costs_no_occupancy():
    """The wgmma scan's launch holds room for a third stage only where a row may take it (families.WG_RING_CHUNKS
    chunks) and its CTAs take an SM each anyway: more room would leave two CTAs of an SM one."""

    def shared(B, T, H, slab):
        args = forward_inputs(B, T, H, 128, 128, seed=T, dtype=bfloat16, xp=cupy)
        _plan.PLANS.clear()
        _forward(False, *args, variant=f"kv{slab}c64wg")
        plan, = _plan.PLANS.values()
        return plan.launcher.shared_bytes, plan.kernel

    long = 64 * families.WG_RING_CHUNKS
    got, kernel = shared(1, long, 2, 16)
    assert got == kernel.ring_shared_bytes == families.prefill_wg_bytes(128, 16, False, ring=True) > \
        kernel.shared_bytes
    assert shared(1, long - 1, 2, 16)[0] == kernel.shared_bytes  # no row takes it
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    got, kernel = shared(1, long, sms // 4 + 1, 32)  # more CTAs than SMs
    assert got == kernel.shared_bytes


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_a_packed_sequence_sees_none_of_its_neighbours_tokens(layout, comba, precision):
    """A chunk that runs past its sequence's end stages the next sequence's rows (bulk copies box 64 tokens
    at a time): those rows must count for nothing, even where they hold NaN and infinities."""
    lens = [70, 50, 90]
    H, K, V = 4, 128, 64
    cu = numpy.concatenate([[0], numpy.cumsum(lens)]).astype(numpy.int32)
    q, k, v, p, beta, g, S0 = forward_inputs(len(lens), int(cu[-1]), H, K, V, state_layout=layout, seed=5, xp=cupy)
    q, k, v, p, beta, g = (a[:1] for a in (q, k, v, p, beta, g))  # one packed row
    bad = slice(int(cu[1]), int(cu[2]))
    for a, value in ((q, cupy.nan), (k, cupy.inf), (p, -cupy.inf), (v, cupy.nan)):
        a[0, bad] = value
    h = cupy.asnumpy
    with numpy.errstate(all="ignore"):  # the middle sequence's own outputs are NaN
        S_ref, o_ref = reference.comba_loop(h(S0), h(q), h(k), h(v), h(p if comba else k), h(beta), h(g),
                                            state_layout=layout, cu_seqlens=cu)
    tol_s, tol_o = TOL[precision, "bfloat16"]
    scans = ("c64", "c64wg") if precision == "bf16" and _wgmma() else ("c64",)
    variants = [f"{layout}{slab}{scan}" for slab, scan in itertools.product(families.PREFILL_SLABS, scans)] + \
        ([f"{layout}64c64wt"] if precision == "bf16" and _wgmma() else [])
    for variant in variants:
        o, S = _forward(comba, q, k, v, p, beta, g, S0, state_layout=layout, cu_seqlens=cupy.asarray(cu),
                        variant=variant, precision=precision)
        for n in (0, 2):
            rows = slice(int(cu[n]), int(cu[n + 1]))
            assert reference.relative_error(o[:, rows], o_ref[:, rows]) <= tol_o
            assert reference.relative_error(S[n], S_ref[n]) <= tol_s


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_zero_state_and_no_final_state(layout):
    q, k, v, p, beta, g, _ = forward_inputs(3, 150, 4, 64, 64, state_layout=layout, seed=11, xp=cupy)
    S_ref, o_ref = reference.comba_loop(numpy.zeros((3, 4, 64, 64)), q, k, v, p, beta, g, state_layout=layout)
    for final in (True, False):
        o, S = _forward(True, q, k, v, p, beta, g, None, state_layout=layout, variant=f"{layout}16c64",
                        precision="fp32", output_final_state=final)
        assert reference.relative_error(o, o_ref) <= TOL["fp32", "bfloat16"][1]
        if final:
            assert reference.relative_error(S, S_ref) <= 1e-6
        else:
            assert S is None


def test_equals_the_token_loop_at_fp32():
    """precision="fp32" agrees with the token loop (both fp32-accurate) far below bf16 rounding."""
    q, k, v, p, beta, g, S0 = forward_inputs(2, 300, 4, 128, 128, seed=2, dtype=F32, xp=cupy)
    o1, S1 = comba_forward(q, k, v, p, beta, g, initial_state=S0, variant="kv32c64", precision="fp32")
    o2, S2 = comba_forward(q, k, v, p, beta, g, initial_state=S0, variant="kv64x4")
    assert reference.relative_error(S1, S2) <= 1e-6
    assert reference.relative_error(o1, o2) <= 1e-6


def test_repeated_calls_with_new_buffers():
    """The two-kernel launch replayed as a graph, its nodes given new pointers on every call."""
    args = forward_inputs(2, 129, 4, 128, 64, seed=4, xp=cupy)
    results = []
    for _ in range(4):
        o, S = gated_delta_forward(*args[:3], *args[4:6], initial_state=args[6], variant="kv32c64")
        results.append((o, S))
    cupy.cuda.Device().synchronize()
    for o, S in results[1:]:
        assert bool((o == results[0][0]).all()) and bool((S == results[0][1]).all())
    S_ref, o_ref = reference.comba_loop(args[6], *args[:3], args[1], *args[4:6])
    assert reference.relative_error(results[-1][0], o_ref) <= TOL["bf16", "bfloat16"][1]


@pytest.mark.parametrize("variant,precision", [("kv16c64", "bf16"), ("vk32c64", "tf32"), ("kv16c64wg", None),
                                               ("vk64c64wt", None), ("kv128c64sg", None)])
def test_gated_deltanets_lean_prep(variant, precision, monkeypatch):
    """Gated DeltaNet's prep in its lean layout (k staged once, no room for p: five CTAs an SM), which a prep of
    more than _plan.LEAN_PREP_WAVE CTAs an SM takes, gives bit for bit what the full layout gives, near the
    reference; Comba's prep keeps the full layout."""
    if variant[2:] != "16c64" and variant[2:] != "32c64" and not _wgmma():
        pytest.skip("the wgmma scans need compute capability 9.0")
    layout = variant[:2]
    B, T, H, K, V = 2, 700, 3, 128, 128
    q, k, v, p, beta, g, S0 = forward_inputs(B, T, H, K, V, state_layout=layout, seed=17, xp=cupy)
    runs = []
    for wave in (10 ** 9, 0):  # the full layout, then the lean one for every prep
        monkeypatch.setattr(_plan, "LEAN_PREP_WAVE", wave)
        monkeypatch.setattr(_plan, "PLANS", {})
        for comba in (False, True):
            runs.append(_check(comba, (q, k, v, p, beta, g, S0), precision, state_layout=layout, variant=variant))
            (plan,) = _plan.PLANS.values()
            _plan.PLANS.clear()
            full = families.prefill_prep_bytes(K, False)
            assert plan.launcher._steps[0][3] == (full if comba or wave else families.prefill_prep_bytes(K, False,
                                                                                                         False))
    for (o, S), (o_lean, S_lean) in zip(runs[:2], runs[2:]):
        assert bool((o == o_lean).all()) and bool((S == S_lean).all())


@pytest.mark.parametrize("variant, comba", [("kv16c64", True), ("kv16c64wg", True), ("vk64c64wt", True),
                                            ("kv64c64sg", True), ("kv128c64wt", True), ("vk128c64sg", True),
                                            ("kv128c64sg", False)])
def test_programmatic_dependent_launches(variant, comba, monkeypatch):
    """Each kernel of a plan after the first launched as a programmatic dependent of the one before where
    families.Kernel.dependent says so (compute capability 9.0, CUDA >= 12.3; the segmented scan in two-warpgroup
    CTAs, Comba's chain on one warpgroup a CTA and Gated DeltaNet's on two): the first call's plain launches, then
    the op's graph, replayed with new buffers, then a caller's capture with a padding row, each bit for bit what the
    same kernels give launched one after the other, and near the reference."""
    from cupy_comba import _launcher
    if variant[2:] != "16c64" and not _wgmma():
        pytest.skip("the wgmma scans need compute capability 9.0")
    layout = variant[:2]
    monkeypatch.setattr(_plan, "PLANS", {})
    B, T, H, K, V = 3, 1500, 2, 128, 128
    q, k, v, p, beta, g, _ = forward_inputs(B, T, H, K, V, state_layout=layout, seed=15, xp=cupy)
    shape = (B + 1, H, K, V) if layout == "kv" else (B + 1, H, V, K)
    pool = cupy.asarray(numpy.random.default_rng(15).standard_normal(shape).astype(F32) / 8)
    idx = cupy.asarray(numpy.array([2, -1, 0], numpy.int32))

    def forward(**kw):
        if comba:
            return comba_forward(q, k, v, p, beta, g, state_layout=layout, variant=variant, **kw)
        return gated_delta_forward(q, k, v, beta, g, state_layout=layout, variant=variant, **kw)

    def calls():
        runs = []
        for i in range(3):  # a plain launch, the graph's capture, a replay with new pointers
            out, state_out = cupy.full(v.shape, cupy.nan, v.dtype), cupy.full((B,) + shape[1:], cupy.nan, F32)
            runs.append(forward(initial_state=pool[:B], out=out, state_out=state_out))
        stream = cupy.cuda.Stream(non_blocking=True)
        pooled = pool.copy()
        out = cupy.full(v.shape, cupy.nan, v.dtype)
        # the copy and the poison done: a non-blocking stream does not wait for the null stream's work
        cupy.cuda.Device().synchronize()
        with stream:
            stream.begin_capture()
            forward(initial_state=pooled, state_indices=idx, out=out)
            graph = stream.end_capture()
            graph.launch(stream)
        stream.synchronize()
        return runs + [(out, pooled)], [pl.launcher for pl in _plan.PLANS.values()]

    runs, launchers = calls()
    for launcher in launchers:
        dependent = _programmatic() and (not variant.endswith("sg") or variant.endswith("128c64sg"))
        assert [c is not None for c in launcher._configs] == [i > 0 and dependent for i in range(len(launcher._steps))]
        # the segmented scan's prep split around the chain (kernels_cu/prefill_prep.cuh, PrepSplit): its tail part a
        # grid of (H, chunks) after the chain
        if dependent and variant.endswith("sg"):
            lead, chain, tail, segments = launcher._steps
            assert lead[0] == tail[0] and tail[1][0] == H and tail[1][1] > 1
    monkeypatch.setattr(_launcher, "_LAUNCH_EX", None)
    monkeypatch.setattr(_plan, "PLANS", {})
    plain, launchers = calls()
    assert all(c is None for launcher in launchers for c in launcher._configs)
    assert all(len(launcher._steps) <= 3 for launcher in launchers)  # the prep whole, in turn
    for (o, S), (o_plain, S_plain) in zip(runs, plain):
        assert bool((o == o_plain).all()) and bool((S == S_plain).all())
    S_ref, o_ref = reference.comba_loop(cupy.asnumpy(pool[:B]), *map(cupy.asnumpy, (q, k, v, p if comba else k, beta,
                                                                   g)), state_layout=layout)
    for o, S in runs[:3]:
        assert reference.relative_error(o, o_ref) <= TOL["bf16", "bfloat16"][1]
        assert reference.relative_error(S, S_ref) <= TOL["bf16", "bfloat16"][0]
    assert bool((runs[3][0][1] == 0).all())  # the padding row


def test_variants_that_do_not_fit_are_refused():
    args = forward_inputs(1, 70, 2, 256, 64, seed=1, dtype=F32, xp=cupy)
    with pytest.raises(ValueError, match="shared memory"):
        comba_forward(*args[:6], initial_state=args[6], variant="kv32c64")
    o, S = gated_delta_forward(*args[:3], *args[4:6], initial_state=args[6], variant="kv16c64", precision="fp32")
    S_ref, _ = reference.comba_loop(args[6], *args[:3], args[1], *args[4:6])
    assert reference.relative_error(S, S_ref) <= 1e-6


@pytest.fixture
def a100_limit():
    """The current GPU told it allows an A100's 163 KB of shared memory a CTA; plans made under it are dropped."""
    device = cupy.cuda.Device().id
    saved = _plan.shared_limit(device)
    _plan.PLANS.clear()
    _plan._SHARED_LIMITS[device] = 166912
    yield 166912
    _plan._SHARED_LIMITS[device] = saved
    _plan.PLANS.clear()


def test_a_gpu_with_less_shared_memory(a100_limit):
    """Where the GPU allows less than the H200's 227 KB a CTA, a long prompt runs on a kernel that fits (Comba's
    16-column scan at K = 128 needs 201744 bytes in TF32, 181264 in bf16: the tensor-core kernel takes it; Gated
    DeltaNet's, 164880, still runs, on wgmma where the GPU has it), and a forced variant that does not fit is refused before any work."""
    args = forward_inputs(1, 256, 16, 128, 128, seed=3, dtype=bfloat16, xp=cupy)
    assert families.prefill_scan_bytes(128, 16, True, False) > a100_limit >= families.prefill_scan_bytes(
        128, 16, False, False)
    for comba in (True, False):
        _check(comba, args, None)
    with pytest.raises(ValueError, match="181264 bytes of shared memory a CTA; GPU .* allows 166912"):  # bf16
        comba_forward(*args[:6], initial_state=args[6], variant="kv16c64")
    assert [plan.variant for plan in _plan.PLANS.values()] == ["kv32tc16", "kv16c64wg" if _wgmma() else "kv16c64"]


def test_precision_is_checked():
    args = forward_inputs(1, 4, 2, 64, 64, seed=1, xp=cupy)
    with pytest.raises(ValueError, match="precision"):
        comba_forward(*args[:6], initial_state=args[6], precision="fp16")


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("scan", ["32c64", "64c64sg"])
def test_a_cuda_graph_of_a_ragged_prefill(layout, scan):
    """Device-resident cu_seqlens in a captured graph, replayed with new lengths (no host sync): the prefill scan,
    and the segmented scan, whose sequences' segments the new lengths move in its grid."""
    if scan.endswith("sg") and not _wgmma():
        pytest.skip("the segmented scan needs compute capability 9.0")
    H, K, V, total = 2, 64, 64, 300
    q, k, v, p, beta, g, _ = forward_inputs(1, total, H, K, V, seed=9, state_layout=layout, xp=cupy)
    cu = cupy.asarray(numpy.array([0, 100, 300], numpy.int32))
    S0 = cupy.asarray(numpy.random.default_rng(9).standard_normal((2, H, K, V)).astype(F32) / 8)
    o = cupy.empty_like(v)
    S = cupy.empty_like(S0)
    cupy.cuda.Device().synchronize()  # the inputs written: a non-blocking stream does not wait for the null stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # the plan, and the stream's workspace at this size, before the capture
        comba_forward(q, k, v, p, beta, g, initial_state=S0, cu_seqlens=cu, out=o, state_out=S, state_layout=layout,
                      variant=f"{layout}{scan}")
        stream.begin_capture()
        comba_forward(q, k, v, p, beta, g, initial_state=S0, cu_seqlens=cu, out=o, state_out=S, state_layout=layout,
                      variant=f"{layout}{scan}")
        graph = stream.end_capture()
        for lens in ([0, 300], [299, 1], [64, 236]):
            cu[...] = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lens)]).astype(numpy.int32))
            graph.launch(stream)
            stream.synchronize()
            S_ref, o_ref = reference.comba_loop(cupy.asnumpy(S0), *map(cupy.asnumpy, (q, k, v, p, beta, g)),
                                                state_layout=layout, cu_seqlens=cupy.asnumpy(cu))
            assert reference.relative_error(o, o_ref) <= TOL["bf16", "bfloat16"][1]
            assert reference.relative_error(S, S_ref) <= TOL["bf16", "bfloat16"][0]


@pytest.mark.parametrize("scan", ["32c64", "64c64sg"])
def test_packed_lengths_that_change_share_the_streams_workspace(scan):
    """A serving engine's prompts: packed batches of changing lengths on one stream, largest first, then smaller
    ones, then the largest again.  Each is right, and the stream holds one workspace, the largest plan's."""
    if scan.endswith("sg") and not _wgmma():
        pytest.skip("the segmented scan needs compute capability 9.0")
    from cupy_comba import _launcher

    H, K, V = 2, 64, 64
    stream = cupy.cuda.Stream(non_blocking=True)
    device = cupy.cuda.Device().id
    _launcher._WORKSPACES.pop((device, stream.ptr, None), None)  # a stream an earlier test left at this address
    _plan.PLANS.clear()
    cupy.cuda.Device().synchronize()
    with stream:
        needs = []
        for i, lens in enumerate(([300, 500], [64], [129, 1, 70], [0, 250], [300, 500])):
            total = sum(lens)
            q, k, v, p, beta, g, _ = forward_inputs(1, total, H, K, V, seed=40 + i, xp=cupy)
            cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lens)]).astype(numpy.int32))
            S0 = cupy.asarray(numpy.random.default_rng(i).standard_normal((len(lens), H, K, V)).astype(F32) / 8)
            o, S = _forward(True, q, k, v, p, beta, g, S0, cu_seqlens=cu, variant=f"kv{scan}")
            (plan,) = [x for x in _plan.PLANS.values() if x.signature.T == total]
            needs.append(plan.launcher.workspace)
            S_ref, o_ref = reference.comba_loop(cupy.asnumpy(S0), *map(cupy.asnumpy, (q, k, v, p, beta, g)),
                                                cu_seqlens=cupy.asnumpy(cu))
            assert reference.relative_error(o, o_ref) <= TOL["bf16", "bfloat16"][1]
            assert reference.relative_error(S, S_ref) <= TOL["bf16", "bfloat16"][0]
        held = _launcher.workspace(device, stream.ptr).buffer
        assert held.nbytes == -(-max(needs) // _launcher.WORKSPACE_STEP) * _launcher.WORKSPACE_STEP
        assert len(set(needs)) >= 2  # the plans needed different sizes


@pytest.mark.parametrize("scan", ["32c64", "64c64sg"])
def test_threads_on_one_stream_do_not_interleave_their_prompts(scan):
    """Two threads run prompts of different lengths on the same (the null) stream, many times: each one's prep and
    scan launch together, so every result equals the call's alone."""
    if scan.endswith("sg") and not _wgmma():
        pytest.skip("the segmented scan needs compute capability 9.0")
    import threading

    H, K, V = 4, 64, 64
    calls = [forward_inputs(1, T, H, K, V, seed=T, xp=cupy) for T in (700, 190)]
    alone = [gated_delta_forward(q, k, v, beta, g, initial_state=S0, variant=f"kv{scan}")
             for q, k, v, p, beta, g, S0 in calls]
    cupy.cuda.Device().synchronize()
    failures = []

    def run(i):
        q, k, v, p, beta, g, S0 = calls[i]
        try:
            with cupy.cuda.Stream.null:
                for _ in range(30):
                    o, S = gated_delta_forward(q, k, v, beta, g, initial_state=S0, variant=f"kv{scan}")
                    cupy.cuda.Stream.null.synchronize()
                    if not (bool((o == alone[i][0]).all()) and bool((S == alone[i][1]).all())):
                        failures.append(i)
        except BaseException as e:  # noqa: BLE001 - a thread's error fails the test, not only its thread
            failures.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
