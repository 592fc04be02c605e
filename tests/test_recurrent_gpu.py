"""The delta-rule family's CUDA kernel against the float64 reference and the seed port (``pytest -m gpu``)."""

import numpy
import pytest

from cupy_comba import (
    bfloat16, comba_decode_step, comba_forward, families, gated_delta_decode_step, gated_delta_forward, reference,
    tiling,
)
from cupy_comba.inputs import forward_inputs

from gpu_variants import exact as _exact, runnable
from kernel_paths import CHUNKED_CHOICE, CHUNKED_HEADS, FEW_HEADS, FEW_HEADS_CHOICE, MANY_HEADS, MANY_HEADS_CHOICE
from seed_port import mt_gated_delta_chunk

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

F16, F32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
O_TOL = {numpy.dtype(bfloat16): 4e-3, F16: 1e-3, F32: 2e-6}




def _poisoned(shape, dtype):
    return cupy.full(shape, cupy.nan, dtype)


def _run(comba, q, k, v, p, beta, g, S, **opts):
    B, T, H, V = v.shape
    out = _poisoned((B, T, H, V), opts.pop("o_dtype", v.dtype))
    state_out = _poisoned(S.shape, F32)
    if comba:
        o, S_new = comba_forward(q, k, v, p, beta, g, initial_state=S, out=out, state_out=state_out, **opts)
    else:
        o, S_new = gated_delta_forward(q, k, v, beta, g, initial_state=S, out=out, state_out=state_out, **opts)
    assert o is out and S_new is state_out
    return o, S_new


def _op(step, q, k, v, p, beta, g, state, **opts):
    """The public op these arguments call (Comba when p is given), e.g. with ``variant=`` forced."""
    if step:
        if p is None:
            return gated_delta_decode_step(state, q, k, v, beta, g, **opts)
        return comba_decode_step(state, q, k, v, p, beta, g, **opts)
    if p is None:
        return gated_delta_forward(q, k, v, beta, g, initial_state=state, **opts)
    return comba_forward(q, k, v, p, beta, g, initial_state=state, **opts)


def _ref(comba, q, k, v, p, beta, g, S, scale=None, **opts):
    return reference.comba_loop(S, q, k, v, p if comba else k, beta, g, scale, **opts)


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate", ["log", "linear"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("T", [1, 5])
def test_forward_matches_reference(K, layout, comba, gate, l2norm, T):
    args = forward_inputs(3, T, 4, K, 64, Hk=2, state_layout=layout, gate=gate, seed=K + T, dtype=bfloat16,
                          normalize_keys=not l2norm, xp=cupy)
    opts = dict(state_layout=layout, gate=gate, use_qk_l2norm=l2norm)
    o, S = _run(comba, *args, **opts)
    S_ref, o_ref = _ref(comba, *args, **opts)
    assert reference.relative_error(S, S_ref) <= 1e-6
    assert reference.relative_error(o, o_ref) <= O_TOL[numpy.dtype(bfloat16)]


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", [(64, 128), (128, 128), (128, 96), (64, 256), (128, 32)])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate,l2norm", [("log", False), ("linear", True)], ids=["log", "linear-l2norm"])
def test_every_decode_tiling(layout, K, V, comba, gate, l2norm):
    """Each decode kernel tiling, both layouts, both ops, the options, GVA, a grid of many CTAs."""
    B, H, Hk = 37, 4, 2
    q, k, v, p, beta, g, S = forward_inputs(B, 1, H, K, V, Hk=Hk, state_layout=layout, gate=gate, seed=K + V,
                                            dtype=bfloat16, normalize_keys=not l2norm, xp=cupy)
    q, k, v, p, beta, g = (a[:, 0] for a in (q, k, v, p, beta, g))
    p = p if comba else None
    opts = dict(state_layout=layout, gate=gate, use_qk_l2norm=l2norm)
    S_ref, o_ref = reference.comba_step(S, q, k, v, k if p is None else p, beta, g, **opts)
    before = S.copy()
    for variant in families.variants(layout, K, V):
        out, state_out = _poisoned((B, H, V), bfloat16), _poisoned(S.shape, F32)
        _op(True, q, k, v, p, beta, g, S, out=out, state_out=state_out, state_layout=layout, gate=gate,
            use_qk_l2norm=l2norm, variant=variant)
        assert reference.relative_error(state_out, S_ref) <= 1e-6, variant
        assert reference.relative_error(out, o_ref) <= O_TOL[numpy.dtype(bfloat16)], variant
    assert bool(cupy.array_equal(S, before))
    S_new, o = comba_decode_step(S, q, k, v, k if p is None else p, beta, g, state_out=S, **opts)  # in place
    assert S_new is S and reference.relative_error(S, S_ref) <= 1e-6


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", [(64, 128), (128, 128), (128, 96), (64, 256)])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("T,initial", [(4, True), (6, True), (13, True), (37, True), (3, False), (1, False)],
                         ids=["T4", "T6", "T13", "T37", "T3-zero-state", "T1-zero-state"])
def test_every_forward_tiling(layout, K, V, comba, T, initial):
    """Each tiling's T-token build (the one forward passes run), from a state or from zeros; V = 256 at
    K = 64 runs the 128-column slabs two to a head."""
    B, H, Hk = 9, 4, 2
    q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, Hk=Hk, state_layout=layout, seed=K + V + T,
                                            dtype=bfloat16, xp=cupy)
    p = p if comba else None
    S_ref, o_ref = reference.comba_loop(S if initial else cupy.zeros(S.shape), q, k, v, k if p is None else p,
                                        beta, g, state_layout=layout)
    shape, S = S.shape, (S if initial else None)
    for variant in runnable(layout, K, V, multi=True, exact=True):
        out, state_out = _poisoned((B, T, H, V), bfloat16), _poisoned(shape, F32)
        _op(False, q, k, v, p, beta, g, S, out=out, state_out=state_out, state_layout=layout, variant=variant,
            **_exact(variant))
        assert reference.relative_error(state_out, S_ref) <= 1e-6, variant
        assert reference.relative_error(out, o_ref) <= O_TOL[numpy.dtype(bfloat16)], variant
        out2 = _poisoned((B, T, H, V), bfloat16)  # and with no final state to write
        _op(False, q, k, v, p, beta, g, S, output_final_state=False, out=out2, state_layout=layout, variant=variant,
            **_exact(variant))
        assert bool(cupy.array_equal(out2, out)), variant


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [bfloat16, F16, F32], ids=lambda d: numpy.dtype(d).name)
def test_every_forward_tiling_strided_activations(layout, dtype):
    """Every T-token build with q, k, p, v and o as odd-offset, stride-2 views (no vector loads or paired
    stores possible); o in the activations' dtype."""
    B, T, H, Hk, K, V = 5, 11, 4, 2, 128, 64
    q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, Hk=Hk, state_layout=layout, seed=T, dtype=dtype,
                                            xp=cupy)

    def strided(a):
        wide = _poisoned(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        wide[..., 1::2] = a
        return wide[..., 1::2]

    views = [strided(a) for a in (q, k, v, p)]
    assert all(view.strides[-1] == 2 * view.itemsize for view in views)
    S_ref, o_ref = reference.comba_loop(S, q, k, v, p, beta, g, state_layout=layout)
    for variant in runnable(layout, K, V, multi=True, exact=True):
        out, state_out = strided(_poisoned((B, T, H, V), dtype)), _poisoned(S.shape, F32)
        _op(False, *views[:3], views[3], beta, g, S, out=out, state_out=state_out, state_layout=layout,
            variant=variant, **_exact(variant))
        assert reference.relative_error(state_out, S_ref) <= 1e-6, variant
        assert reference.relative_error(out, o_ref) <= O_TOL[numpy.dtype(dtype)], variant


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [bfloat16, F16, F32], ids=lambda d: numpy.dtype(d).name)
def test_every_decode_tiling_strided_activations(layout, dtype):
    """Every decode build with q, k, p, v and o as odd-offset, stride-2 views: the build that reads dtypes and strides
    at run time (a build for one dtype assumes unit strides along K and V), against the one for contiguous rows."""
    B, H, Hk, K, V = 5, 4, 2, 128, 64
    q, k, v, p, beta, g, S = forward_inputs(B, 1, H, K, V, Hk=Hk, state_layout=layout, seed=7, dtype=dtype, xp=cupy)
    q, k, v, p, beta, g = (a[:, 0] for a in (q, k, v, p, beta, g))

    def strided(a):
        wide = _poisoned(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        wide[..., 1::2] = a
        return wide[..., 1::2]

    views = [strided(a) for a in (q, k, v, p)]
    S_ref, o_ref = reference.comba_step(S, q, k, v, p, beta, g, state_layout=layout)
    for variant in families.variants(layout, K, V):
        for args, out in ((views, strided(_poisoned((B, H, V), dtype))), ((q, k, v, p), _poisoned((B, H, V), dtype))):
            state_out = _poisoned(S.shape, F32)
            _op(True, *args[:3], args[3], beta, g, S, out=out, state_out=state_out, state_layout=layout,
                variant=variant)
            assert reference.relative_error(state_out, S_ref) <= 1e-6, variant
            assert reference.relative_error(out, o_ref) <= O_TOL[numpy.dtype(dtype)], variant


@pytest.mark.parametrize("shape", [(1, 1, 1, 64, 32), (2, 3, 5, 128, 96), (3, 2, 3, 64, 256), (257, 2, 3, 128, 32),
                                   (2, 7, 8, 128, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [bfloat16, F16, F32], ids=lambda d: numpy.dtype(d).name)
def test_odd_shapes_and_dtypes(shape, layout, dtype):
    B, T, H, K, V = shape
    args = forward_inputs(B, T, H, K, V, state_layout=layout, seed=sum(shape), dtype=dtype, xp=cupy)
    o, S = _run(True, *args, state_layout=layout)
    S_ref, o_ref = _ref(True, *args, state_layout=layout)
    assert reference.relative_error(S, S_ref) <= 1e-6
    assert reference.relative_error(o, o_ref) <= O_TOL[numpy.dtype(dtype)]


@pytest.mark.parametrize("T", [1, 3, 6])
@pytest.mark.parametrize("Hk,H", [(2, 2), (2, 8), (1, 3)])
def test_seed_parity(T, Hk, H):
    """vk layout, linear gate, scale 1: the metaltile seed's step (T = 1) and chunk (T > 1) kernels
    (T = 3 runs the chunked vk kernel, T = 6 the tensor-core one)."""
    q, k, v, _, beta, g, S = forward_inputs(2, T, H, 128, 64, Hk=Hk, state_layout="vk", gate="linear", seed=T,
                                            dtype=F32, xp=numpy)
    y, S_seed = mt_gated_delta_chunk(q, k, v, g, beta, S)
    dev = [cupy.asarray(a) for a in (q, k, v, beta, g, S)]
    if T == 1:
        S_new, o = gated_delta_decode_step(dev[5], *(a[:, 0] for a in dev[:5]), 1.0, state_layout="vk",
                                           gate="linear")
        o = o[:, None]
    else:
        o, S_new = gated_delta_forward(*dev[:5], 1.0, initial_state=dev[5], state_layout="vk", gate="linear")
    assert reference.relative_error(S_new, S_seed) <= 1e-6
    assert reference.relative_error(o, y) <= 1e-6


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("T", [4, 6, 19])  # 4: the chunked kernels; 19 over B*H = 16: the tensor-core kernel, 8, 8, 3
def test_forward_equals_repeated_steps(layout, T):
    q, k, v, p, beta, g, S = forward_inputs(4, T, 4, 128, 64, state_layout=layout, dtype=F32, xp=cupy)
    o, S_fwd = comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout=layout)
    state = S
    for t in range(T):
        # "kv" runs the tuned decode kernels, "vk" the family's kernel: both must agree with forward
        state, o_t = comba_decode_step(state, q[:, t], k[:, t], v[:, t], p[:, t], beta[:, t], g[:, t],
                                       state_layout=layout)
        assert reference.relative_error(o[:, t], o_t) <= 1e-6
    assert reference.relative_error(S_fwd, state) <= 1e-6


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", [(128, 128), (64, 96)])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate,l2norm", [("log", False), ("linear", True)], ids=["log", "linear-l2norm"])
@pytest.mark.parametrize("T,initial", [(8, True), (21, True), (11, False)], ids=["T8", "T21", "T11-zero-state"])
def test_tensor_core_path(layout, K, V, comba, gate, l2norm, T, initial):
    """Few heads and T >= 8: the ops choose the tensor-core kernel, but for the prefill kernels' lengths
    (kernel_paths.FEW_HEADS_CHOICE), where it is forced; fp32 o, every chunk shape.  The other chunk length of
    the same slabs (8 or 16 tokens a pass) is forced too."""
    B, H, Hk = 3, 4, 2
    assert B * H == FEW_HEADS
    chosen = FEW_HEADS_CHOICE[layout, K, V, T]
    assert tiling.choose(layout, K, V, comba, multi=True, T=T, heads=B * H) == chosen
    forced = f"{layout}32tc16" if chosen.endswith("c64") else None  # the prefill kernel's length
    _check_forward_fp32(B, H, Hk, K, V, T, layout, comba, gate, l2norm, initial, seed=K + T, variant=forced)
    chosen = forced or chosen
    other = chosen.removesuffix("16") if chosen.endswith("16") else chosen + "16"
    _check_forward_fp32(B, H, Hk, K, V, T, layout, comba, gate, l2norm, initial, seed=K + T, variant=other)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K", [128, 64])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate,l2norm", [("log", False), ("linear", True)], ids=["log", "linear-l2norm"])
@pytest.mark.parametrize("T,initial", [(5, True), (8, True), (9, True), (16, True), (13, False)],
                         ids=["T5", "T8", "T9", "T16", "T13-zero-state"])
def test_tensor_core_path_many_heads(layout, K, comba, gate, l2norm, T, initial):
    """More than 128 heads and T >= 5: the ops choose the tensor-core kernel (16 tokens a pass from T = 9,
    at K = 64 in 128-column slabs), except the vk layout's chunked kernel at K = 128 up to T = 7; the
    tensor-core variants the op did not choose are forced (fp32 activations: the 16-token variants run
    8-token chunks, the 128-column one in 64-column slabs)."""
    B, H, Hk, V = 33, 4, 2, 128
    assert B * H == MANY_HEADS
    expected = MANY_HEADS_CHOICE[layout, K, T]
    assert tiling.choose(layout, K, V, comba, multi=True, T=T, heads=B * H) == expected
    _check_forward_fp32(B, H, Hk, K, V, T, layout, comba, gate, l2norm, initial, seed=K + T + 1)
    for variant in (f"{layout}64tc", f"{layout}64tc16") + ((f"{layout}128tc16",) if K == 64 else ()):
        if variant != expected:
            _check_forward_fp32(B, H, Hk, K, V, T, layout, comba, gate, l2norm, initial, seed=K + T + 1,
                                variant=variant)


@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate,l2norm", [("log", False), ("linear", True)], ids=["log", "linear-l2norm"])
@pytest.mark.parametrize("layout,K,T,initial", [("kv", 128, 2, True), ("kv", 128, 3, False), ("kv", 128, 4, True),
                                                ("kv", 64, 2, True), ("kv", 64, 4, False), ("vk", 128, 2, True),
                                                ("vk", 128, 3, False), ("vk", 128, 4, True), ("vk", 128, 7, True)],
                         ids=["kv-K128-T2", "kv-K128-T3-zero-state", "kv-K128-T4", "kv-K64-T2", "kv-K64-T4-zero-state",
                              "vk-T2", "vk-T3-zero-state", "vk-T4", "vk-T7"])
def test_chunked_kernel_path(layout, K, comba, gate, l2norm, T, initial):
    """Over many heads the ops choose the chunked kernels for T = 2 to 4 (two partial 4-token chunks
    and a full one), and in the vk layout for T = 7 too (a full chunk and a partial one).  GVA, fp32 o."""
    B, H, Hk, V = 35, 4, 2, 128
    assert B * H == CHUNKED_HEADS
    chunked = CHUNKED_CHOICE[layout, K, T]
    assert tiling.choose(layout, K, V, comba, multi=True, T=T, heads=B * H) == chunked
    _check_forward_fp32(B, H, Hk, K, V, T, layout, comba, gate, l2norm, initial, seed=K + T + 2)


def _check_forward_fp32(B, H, Hk, K, V, T, layout, comba, gate, l2norm, initial, seed, variant=None):
    """The op's forward pass (fp32 activations and o, NaN-poisoned outputs) against the reference;
    ``variant`` forces a tiling instead."""
    q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, Hk=Hk, state_layout=layout, gate=gate, seed=seed,
                                            dtype=F32, normalize_keys=not l2norm, xp=cupy)
    opts = dict(state_layout=layout, gate=gate, use_qk_l2norm=l2norm)
    S0 = S if initial else None
    out, state_out = _poisoned((B, T, H, V), F32), _poisoned(S.shape, F32)
    if variant is not None:
        _op(False, q, k, v, p if comba else None, beta, g, S0, out=out, state_out=state_out, state_layout=layout,
            gate=gate, use_qk_l2norm=l2norm, variant=variant)
        o, S_new = out, state_out
    elif comba:
        o, S_new = comba_forward(q, k, v, p, beta, g, initial_state=S0, out=out, state_out=state_out, **opts)
    else:
        o, S_new = gated_delta_forward(q, k, v, beta, g, initial_state=S0, out=out, state_out=state_out, **opts)
    S_ref, o_ref = _ref(comba, q, k, v, p, beta, g, S if initial else cupy.zeros(S.shape), **opts)
    assert reference.relative_error(S_new, S_ref) <= 1e-6
    assert reference.relative_error(o, o_ref) <= O_TOL[F32]


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("dtype", [bfloat16, F16], ids=lambda d: numpy.dtype(d).name)
def test_tensor_core_kernel_16bit_inputs(layout, K, comba, dtype):
    """bf16 (the fast path, whose loads go two chunks ahead through shared memory) and fp16 inputs with
    use_qk_l2norm: 1 to 4 chunks, every slab width and chunk length, GVA, fp32 o against the reference."""
    B, H, Hk, V = 3, 4, 2, 128
    for T in (1, 9, 29):
        q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, Hk=Hk, state_layout=layout, seed=K + T, dtype=dtype,
                                                normalize_keys=False, xp=cupy)
        p = p if comba else None
        S_ref, o_ref = reference.comba_loop(S, q, k, v, k if p is None else p, beta, g, state_layout=layout,
                                            use_qk_l2norm=True)
        wide = (f"{layout}128tc16",) if K == 64 else ()
        for variant in (*(f"{layout}{slab}tc{chunk}" for slab in (64, 32) for chunk in ("", "16")), *wide):
            out, state_out = _poisoned((B, T, H, V), F32), _poisoned(S.shape, F32)
            _op(False, q, k, v, p, beta, g, S, out=out, state_out=state_out, state_layout=layout, use_qk_l2norm=True,
                variant=variant)
            assert reference.relative_error(state_out, S_ref) <= 1e-6, (T, variant)
            assert reference.relative_error(out, o_ref) <= O_TOL[F32], (T, variant)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [bfloat16, F32], ids=lambda d: numpy.dtype(d).name)
def test_tensor_core_kernel_keeps_nan(layout, dtype):
    """A NaN state entry (the bits CUDA's own NaN has, 0x7fffffff, which the TF32 split's rounding add
    would carry into the sign) reaches exactly the outputs the float64 reference makes NaN."""
    B, T, H, K, V = 2, 16, 4, 128, 128
    q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, state_layout=layout, seed=3, dtype=dtype, xp=cupy)
    S.view(numpy.uint32)[1, 2, 5, 9] = 0x7FFFFFFF
    S_ref, o_ref = reference.comba_loop(S, q, k, v, p, beta, g, state_layout=layout)
    for variant in (f"{layout}64tc", f"{layout}64tc16"):
        out, state_out = _poisoned((B, T, H, V), F32), _poisoned(S.shape, F32)
        _op(False, q, k, v, p, beta, g, S, out=out, state_out=state_out, state_layout=layout, variant=variant)
        for x, ref in ((out, o_ref), (state_out, S_ref)):
            nan = cupy.isnan(ref)
            assert 0 < int(nan.sum()) < nan.size // 8, variant
            assert bool(cupy.array_equal(cupy.isnan(x), nan)), variant
            assert reference.relative_error(cupy.where(nan, 0, x), cupy.where(nan, 0, ref)) <= 2e-6, variant


def test_comba_with_p_equal_k_is_gated_delta_and_layouts_agree():
    q, k, v, p, beta, g, S = forward_inputs(3, 4, 4, 128, 64, dtype=F32, xp=cupy)
    o1, S1 = comba_forward(q, k, v, k, beta, g, initial_state=S)
    o2, S2 = gated_delta_forward(q, k, v, beta, g, initial_state=S)
    assert reference.relative_error(o1, o2) <= 1e-6 and reference.relative_error(S1, S2) <= 1e-6
    o3, S3 = gated_delta_forward(q, k, v, beta, g, initial_state=cupy.ascontiguousarray(S.swapaxes(-1, -2)),
                                 state_layout="vk")
    assert reference.relative_error(S3.swapaxes(-1, -2), S2) <= 1e-6
    assert reference.relative_error(o3, o2) <= 1e-6


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_in_place_inputs_unchanged_zero_state_no_final(layout):
    args = forward_inputs(4, 3, 4, 64, 64, state_layout=layout, seed=3, dtype=F32, xp=cupy)
    q, k, v, p, beta, g, S = args
    before = [a.copy() for a in args]
    o, S_new = comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout=layout)
    for a, b in zip(args, before):
        assert bool(cupy.array_equal(a, b))
    o2, S_same = comba_forward(q, k, v, p, beta, g, initial_state=S, state_out=S, state_layout=layout)
    assert S_same is S and bool(cupy.array_equal(S, S_new)) and bool(cupy.array_equal(o2, o))
    o_zero, S_zero = comba_forward(q, k, v, p, beta, g, state_layout=layout)
    S_ref, o_ref = reference.comba_loop(cupy.zeros(S.shape), q, k, v, p, beta, g, state_layout=layout)
    assert reference.relative_error(S_zero, S_ref) <= 1e-6
    o_only, none = comba_forward(q, k, v, p, beta, g, state_layout=layout, output_final_state=False)
    assert none is None and bool(cupy.array_equal(o_only, o_zero))


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_strided_packed_projection(layout):
    B, T, H, K, V = 3, 4, 4, 128, 64
    q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, state_layout=layout, dtype=bfloat16, xp=cupy)
    packed = _poisoned((B, T, H, 3 * K + V + 8), bfloat16)
    packed[..., :K], packed[..., K:2 * K], packed[..., 2 * K:3 * K], packed[..., 3 * K:3 * K + V] = q, k, p, v
    views = (packed[..., :K], packed[..., K:2 * K], packed[..., 3 * K:3 * K + V], packed[..., 2 * K:3 * K])
    o, S_new = comba_forward(*views, beta, g, initial_state=S, state_layout=layout)
    S_ref, o_ref = reference.comba_loop(S, q, k, v, p, beta, g, state_layout=layout)
    assert reference.relative_error(S_new, S_ref) <= 1e-6
    assert reference.relative_error(o, o_ref) <= O_TOL[numpy.dtype(bfloat16)]


def test_decode_steps_with_options():
    q, k, v, p, beta, g, S = forward_inputs(5, 1, 6, 128, 128, Hk=3, state_layout="vk", gate="linear",
                                            dtype=bfloat16, normalize_keys=False, xp=cupy)
    step = [a[:, 0] for a in (q, k, v, p, beta, g)]
    S1, o1 = comba_decode_step(S, *step, state_layout="vk", gate="linear", use_qk_l2norm=True)
    S_ref, o_ref = reference.comba_step(S, *step, state_layout="vk", gate="linear", use_qk_l2norm=True)
    assert reference.relative_error(S1, S_ref) <= 1e-6
    assert reference.relative_error(o1, o_ref) <= O_TOL[numpy.dtype(bfloat16)]
    S2, o2 = gated_delta_decode_step(S, step[0], step[1], step[2], step[4], step[5], state_layout="vk",
                                     gate="linear", use_qk_l2norm=True)
    S_ref, o_ref = reference.gated_delta_step(S, step[0], step[1], step[2], step[4], step[5], state_layout="vk",
                                              gate="linear", use_qk_l2norm=True)
    assert reference.relative_error(S2, S_ref) <= 1e-6
    assert reference.relative_error(o2, o_ref) <= O_TOL[numpy.dtype(bfloat16)]


def test_long_sequence_stays_accurate():
    """512 tokens: fp32-accurate with precision="fp32", at bf16 rounding by default for bf16 inputs (the
    prefill kernels' bf16 products)."""
    q, k, v, p, beta, g, S = forward_inputs(2, 512, 2, 128, 128, dtype=bfloat16, seed=9, xp=cupy)
    S_ref, o_ref = reference.comba_loop(S, q, k, v, p, beta, g)
    for precision, tol in (("fp32", 1e-5), (None, 4e-3)):
        o, S_new = comba_forward(q, k, v, p, beta, g, initial_state=S, precision=precision)
        assert reference.relative_error(S_new, S_ref) <= tol, precision
        assert reference.relative_error(o, o_ref) <= O_TOL[numpy.dtype(bfloat16)], precision


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("V", [128, 96, 512])
def test_head_size_256_on_every_token_loop_variant(layout, comba, V):
    """K = 256 (flash-linear-attention's own default), both layouts: decode steps and 5-token passes, GVA, l2norm,
    NaN-poisoned outputs, every variant; then the serving options against the NumPy path: a pool with a padding
    row and gating (decode step and forward), a ragged batch with an empty sequence, a verify pass."""
    B, T, H, K = 5, 5, 4, 256
    q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, Hk=2, seed=V, dtype=bfloat16, normalize_keys=False, xp=cupy)
    p = p if comba else None
    opts = dict(use_qk_l2norm=True, state_layout=layout)
    stored = (lambda x: x.swapaxes(-1, -2)) if layout == "vk" else (lambda x: x)  # a kv state as `layout` holds it
    S_in = cupy.ascontiguousarray(stored(S))
    S_ref, o_ref = reference.comba_loop(S, q, k, v, k if p is None else p, beta, g, use_qk_l2norm=True)
    step = [x[:, 0] if x is not None else None for x in (q, k, v, p, beta, g)]
    S1_ref, o1_ref = reference.comba_step(S, *step[:3], step[1] if p is None else step[3], *step[4:],
                                          use_qk_l2norm=True)
    variants = runnable(layout, K, V, multi=True, exact=True)
    assert len(variants) >= 2
    for variant in variants:
        o, S_new = _op(False, q, k, v, p, beta, g, S_in, out=_poisoned(o_ref.shape, bfloat16),
                       state_out=_poisoned(S_in.shape, F32), variant=variant, **opts, **_exact(variant))
        assert reference.relative_error(stored(S_new), S_ref) <= 1e-6, variant
        assert reference.relative_error(o, o_ref) <= O_TOL[numpy.dtype(bfloat16)], variant
        S1, o1 = _op(True, *step, S_in, out=_poisoned(o1_ref.shape, bfloat16), state_out=_poisoned(S_in.shape, F32),
                     variant=variant, **opts)
        assert reference.relative_error(stored(S1), S1_ref) <= 1e-6, variant
        assert reference.relative_error(o1, o1_ref) <= O_TOL[numpy.dtype(bfloat16)], variant

    def both(step, acts, state, **serving):
        """The op on the NumPy path and on the GPU (a fresh device copy of every array); the GPU's outputs."""
        dev = [None if x is None else cupy.asarray(x) for x in (*acts, state)]
        dev_serving = {n: cupy.asarray(x) if isinstance(x, numpy.ndarray) else x for n, x in serving.items()}
        host = _op(step, *[None if x is None else cupy.asnumpy(x) for x in acts], state.copy(), **opts, **serving)
        gpu = _op(step, *dev, **opts, **dev_serving)
        for h, d in zip(host, gpu):
            assert (h is None) == (d is None)
            if d is not None:
                assert reference.relative_error(d, h) <= (1e-6 if d.dtype == F32 else O_TOL[numpy.dtype(bfloat16)])
        return gpu, dev[-1], dev_serving

    rng = numpy.random.default_rng(V)
    pool = stored(rng.standard_normal((B + 2, H, K, V)).astype(F32) / 4).copy()
    idx = numpy.array([6, -1, 0, 3, 2], numpy.int32)
    gates = dict(A_log=rng.standard_normal(H).astype(F32) / 2, dt_bias=rng.standard_normal(H).astype(F32),
                 use_beta_sigmoid=True)
    (S_d, o_d), d_pool, _ = both(True, step, pool, state_indices=idx, **gates)
    assert S_d is d_pool and not cupy.asnumpy(o_d[1]).any()
    (o_d, S_d), d_pool, _ = both(False, (q, k, v, p, beta, g), pool, state_indices=idx, output_final_state=True,
                                 **gates)
    assert S_d is d_pool and cupy.array_equal(S_d[[1, 4, 5]], cupy.asarray(pool[[1, 4, 5]]))
    # ragged: sequences of 0, 7, 1, 12 and 5 tokens in one packed batch, each from and back into its slot
    lens = numpy.array([0, 7, 1, 12, 5])
    packed = forward_inputs(1, int(lens.sum()), H, K, V, Hk=2, seed=V + 1, dtype=bfloat16, normalize_keys=False,
                            xp=cupy)[:6]
    packed = packed if comba else (*packed[:3], None, *packed[4:])
    cu = numpy.concatenate([[0], numpy.cumsum(lens)]).astype(numpy.int64)
    (o_d, S_d), d_pool, _ = both(False, packed, pool, state_indices=idx, cu_seqlens=cu, output_final_state=True)
    assert S_d is d_pool
    # verify: the state after every token, the pool left as it was
    inter = numpy.full((B, T) + pool.shape[1:], numpy.nan, F32)
    _, d_pool, dev = both(False, (q, k, v, p, beta, g), pool, state_indices=idx, intermediate_states=inter,
                          output_final_state=False)
    assert cupy.array_equal(d_pool, cupy.asarray(pool))
    live = [0, 2, 3, 4]  # row 1 is padding: its part of the buffer is left as it was
    assert reference.relative_error(dev["intermediate_states"][live], inter[live]) <= 1e-6
    assert cupy.isnan(dev["intermediate_states"][1]).all()
