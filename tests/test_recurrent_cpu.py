"""The delta-rule family on the CPU: reference options, seed parity, consistency and argument checks."""

import numpy
import pytest

from cupy_comba import (
    bfloat16, comba_decode_step, comba_forward, gated_delta_decode_step, gated_delta_forward, reference,
)
from cupy_comba.inputs import forward_inputs

from seed_port import mt_gated_delta_chunk, mt_gated_delta_step

F32 = numpy.float32


def test_vk_reference_is_the_transposed_kv_reference():
    q, k, v, p, beta, g, S = forward_inputs(2, 1, 3, 8, 5, dtype=numpy.float64, xp=numpy)
    S_kv, o_kv = reference.comba_step(S, q[:, 0], k[:, 0], v[:, 0], p[:, 0], beta[:, 0], g[:, 0])
    S_vk, o_vk = reference.comba_step(S.swapaxes(-1, -2), q[:, 0], k[:, 0], v[:, 0], p[:, 0], beta[:, 0], g[:, 0],
                                      state_layout="vk")
    numpy.testing.assert_allclose(S_vk.swapaxes(-1, -2), S_kv, rtol=1e-13)
    numpy.testing.assert_allclose(o_vk, o_kv, rtol=1e-13)


def test_linear_gate_is_the_exponentiated_log_gate():
    q, k, v, p, beta, g, S = forward_inputs(2, 1, 2, 8, 4, dtype=numpy.float64, xp=numpy)
    a = reference.comba_step(S, q[:, 0], k[:, 0], v[:, 0], p[:, 0], beta[:, 0], g[:, 0])
    b = reference.comba_step(S, q[:, 0], k[:, 0], v[:, 0], p[:, 0], beta[:, 0], numpy.exp(g[:, 0].astype(float)),
                             gate="linear")
    numpy.testing.assert_allclose(a[0], b[0], rtol=1e-13)


def test_l2norm_option_normalises_q_k_p():
    q, k, v, p, beta, g, S = forward_inputs(2, 1, 2, 8, 4, dtype=numpy.float64, normalize_keys=False, xp=numpy)
    a = reference.comba_step(S, q[:, 0], k[:, 0], v[:, 0], p[:, 0], beta[:, 0], g[:, 0], use_qk_l2norm=True)
    n = reference.l2_normalize
    b = reference.comba_step(S, n(q[:, 0]), n(k[:, 0]), v[:, 0], n(p[:, 0]), beta[:, 0], g[:, 0])
    numpy.testing.assert_allclose(a[0], b[0], rtol=1e-13)
    numpy.testing.assert_allclose(a[1], b[1], rtol=1e-13)


def test_l2norm_adds_a_millionth_to_the_sum_of_squares():
    """x / sqrt(sum x^2 + 1e-6), flash-linear-attention's epsilon: a key of norm 1e-3 comes out at 1 / sqrt(2)."""
    x = numpy.zeros((1, 1, 8))
    x[..., 3] = 1e-3
    numpy.testing.assert_allclose(reference.l2_normalize(x)[..., 3], 2 ** -0.5, rtol=1e-12)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("Hk,H", [(2, 2), (1, 4), (2, 6)])
def test_reference_matches_the_seed_port(T, Hk, H):
    """Our float64 math with the seed's conventions (vk, linear gate, no scale) is the seed's arithmetic."""
    q, k, v, _, beta, g, S = forward_inputs(2, T, H, 32, 64, Hk=Hk, state_layout="vk", gate="linear", seed=T,
                                            dtype=F32, xp=numpy)
    y, S_seed = mt_gated_delta_chunk(q, k, v, g, beta, S)
    S_ref, o_ref = reference.gated_delta_loop(S, q, k, v, beta, g, 1.0, state_layout="vk", gate="linear")
    assert reference.relative_error(S_seed, S_ref) < 1e-6
    assert reference.relative_error(y, o_ref) < 1e-6


def test_seed_step_is_one_chunk_token():
    q, k, v, _, beta, g, S = forward_inputs(2, 1, 4, 32, 32, state_layout="vk", gate="linear", dtype=F32, xp=numpy)
    y1, S1 = mt_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
    y2, S2 = mt_gated_delta_chunk(q, k, v, g, beta, S)
    numpy.testing.assert_array_equal(S1, S2)
    numpy.testing.assert_array_equal(y1, y2[:, 0])


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_numpy_ops_match_the_seed_with_its_options(layout):
    q, k, v, _, beta, g, S = forward_inputs(2, 3, 4, 64, 32, Hk=2, state_layout="vk", gate="linear", dtype=F32,
                                            xp=numpy)
    y, S_seed = mt_gated_delta_chunk(q, k, v, g, beta, S)
    init = S if layout == "vk" else numpy.ascontiguousarray(S.swapaxes(-1, -2))
    o, S_new = gated_delta_forward(q, k, v, beta, g, 1.0, initial_state=init, state_layout=layout, gate="linear")
    S_new = S_new if layout == "vk" else S_new.swapaxes(-1, -2)
    assert reference.relative_error(S_new, S_seed) < 1e-6
    assert reference.relative_error(o, y) < 1e-6


def test_forward_is_repeated_steps_and_comba_with_p_equal_k_is_gated_delta():
    q, k, v, p, beta, g, S = forward_inputs(2, 4, 2, 64, 32, dtype=F32, xp=numpy)
    o, S_fwd = comba_forward(q, k, v, p, beta, g, initial_state=S)
    state = S
    for t in range(4):
        state, o_t = comba_decode_step(state, q[:, t], k[:, t], v[:, t], p[:, t], beta[:, t], g[:, t],
                                       o_dtype=F32)
        assert reference.relative_error(o[:, t], o_t) < 1e-6
    assert reference.relative_error(S_fwd, state) < 1e-6
    a = comba_forward(q, k, v, k, beta, g, initial_state=S)
    b = gated_delta_forward(q, k, v, beta, g, initial_state=S)
    numpy.testing.assert_array_equal(a[0], b[0])
    numpy.testing.assert_array_equal(a[1], b[1])


def test_forward_defaults_zero_state_and_optional_final_state():
    q, k, v, p, beta, g, S = forward_inputs(1, 2, 2, 64, 32, dtype=F32, xp=numpy)
    o1, S1 = comba_forward(q, k, v, p, beta, g)
    o2, S2 = comba_forward(q, k, v, p, beta, g, initial_state=numpy.zeros_like(S))
    numpy.testing.assert_array_equal(o1, o2)
    numpy.testing.assert_array_equal(S1, S2)
    o3, none = comba_forward(q, k, v, p, beta, g, output_final_state=False)
    assert none is None
    numpy.testing.assert_array_equal(o3, o1)


def test_forward_with_no_tokens():
    q, k, v, p, beta, g, S = forward_inputs(2, 0, 2, 64, 32, dtype=F32, xp=numpy)
    o, S_new = comba_forward(q, k, v, p, beta, g, initial_state=S)
    assert o.shape == (2, 0, 2, 32)
    numpy.testing.assert_array_equal(S_new, S)


def test_decode_step_options_route_through_the_family():
    q, k, v, p, beta, g, S = forward_inputs(2, 1, 2, 64, 32, state_layout="vk", gate="linear", dtype=bfloat16, xp=numpy)
    S_a, o_a = comba_decode_step(S, q[:, 0], k[:, 0], v[:, 0], p[:, 0], beta[:, 0], g[:, 0],
                                 state_layout="vk", gate="linear", use_qk_l2norm=True)
    o_b, S_b = comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout="vk", gate="linear",
                             use_qk_l2norm=True)
    numpy.testing.assert_array_equal(S_a, S_b)
    numpy.testing.assert_array_equal(o_a, o_b[:, 0])


# ---------------------------------------------------------------------------------------------- errors

def _fwd():
    return forward_inputs(2, 3, 4, 64, 32, dtype=F32, xp=numpy)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(state_layout="kvv"), ValueError, "state_layout must be 'kv' or 'vk'"),
    (dict(gate="exp"), ValueError, "gate must be 'log' or 'linear'"),
    (dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm must be a bool"),
    (dict(output_final_state=False, state_out=numpy.zeros((2, 4, 64, 32), F32)), ValueError, "nothing would be"),
    (dict(initial_state=numpy.zeros((2, 4, 32, 64), F32)), ValueError, r"initial_state must have shape \(B, H, K, V\)"),
    (dict(initial_state=numpy.zeros((2, 4, 64, 32), F32), state_layout="vk"), ValueError, r"\(B, H, V, K\)"),
    (dict(initial_state=numpy.zeros((2, 4, 64, 32))), TypeError, "initial_state must be float32"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(out=numpy.zeros((2, 3, 4, 16), F32)), ValueError, r"out must have shape \(B, T, H, V\)"),
], ids=["layout", "gate", "l2norm-type", "state_out-unused", "state-shape", "vk-shape", "state-dtype", "scale",
        "out-shape"])
def test_forward_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        comba_forward(*_fwd()[:6], **kwargs)


@pytest.mark.parametrize("i,shape,match", [
    (0, (2, 3, 4), "q must be 4-D"),
    (1, (2, 2, 4, 64), r"k has \(B, T\) = \(2, 2\) but q, p, v, beta, g have \(2, 3\)"),
    (2, (2, 3, 4, 48), "V=48"),
    (4, (2, 3, 5), r"beta has value heads H = 5 but v, g have 4"),
    (5, (2, 3), r"g must be 3-D \(B, T, H\), got shape \(2, 3\)"),
])
def test_forward_shape_errors(i, shape, match):
    args = list(_fwd()[:6])
    args[i] = numpy.zeros(shape, F32) + 0.5
    if i == 2:
        with pytest.raises(NotImplementedError, match=match):
            comba_forward(*args)
        return
    with pytest.raises(ValueError, match=match):
        comba_forward(*args)


def test_step_errors():
    q, k, v, _, beta, g, S = forward_inputs(2, 1, 4, 64, 32, dtype=F32, xp=numpy)
    with pytest.raises(TypeError, match="state must be"):
        gated_delta_decode_step(None, q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0])
    with pytest.raises(ValueError, match=r"state must have shape \(B, H, V, K\)"):
        gated_delta_decode_step(S, q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], state_layout="vk")
    buf = numpy.zeros(S.size + 64, F32)
    v_alias = buf[:v[:, 0].size].reshape(v[:, 0].shape)
    v_alias[...] = v[:, 0]
    with pytest.raises(ValueError, match="state_out overlaps v"):
        gated_delta_decode_step(S, q[:, 0], k[:, 0], v_alias, beta[:, 0], g[:, 0],
                                state_out=buf[:S.size].reshape(S.shape))



def _span(shape, strides, itemsize):
    lo = hi = 0
    for n, st in zip(shape, strides):
        if n == 0:
            return 0, 0
        lo, hi = (lo + (n - 1) * st, hi) if st < 0 else (lo, hi + (n - 1) * st)
    return lo, hi + itemsize


def test_cupy_contiguity_flag_stands_for_the_strides():
    """The op's call signature keeps True instead of the strides of a C-contiguous CuPy array
    (reading the flag is cheaper) and launches with strides computed from the shape: that is only
    right if CuPy's flag means exactly what our stride check means.  Arrays over unowned device
    addresses are never touched, so this runs without a GPU."""
    cupy = pytest.importorskip("cupy")
    from cupy_comba._validate import ArraySig, _is_c_contiguous
    from cupy_comba._launcher import _c_strides

    memory = cupy.cuda.UnownedMemory(0x7F0000000000, 1 << 20, None, device_id=0)
    base = cupy.ndarray((4, 6, 8, 16), numpy.float32, memptr=cupy.cuda.MemoryPointer(memory, 0))
    views = [base, base[:, 2], base[1:2], base[:, :, :1], base[..., ::2], base.transpose(0, 2, 1, 3),
             base[:, 1:2, :, :].reshape(4, 1, 128), base[:0], base[:, :, 3]]
    for a in views:
        sig = ArraySig(a)
        assert a._c_contiguous == _is_c_contiguous(sig), (a.shape, a.strides)
        if a._c_contiguous:  # the strides the launch uses address the same elements
            computed = tuple(s * a.itemsize for s in _c_strides(a.shape, 1, False))
            assert _span(a.shape, computed, a.itemsize) == sig.span(), (a.shape, a.strides)


def test_a_transient_capture_lets_go_only_the_workspaces_it_pinned():
    """The timing helpers' block (``_launcher.transient_captures``): a workspace first captured inside it is let go
    on leaving it, even when the block raises; one a caller's capture pinned before it stays pinned."""
    from cupy_comba import _launcher

    saved = dict(_launcher._CAPTURED)
    callers, timed = object(), object()
    try:
        _launcher._CAPTURED[id(callers)] = callers
        with pytest.raises(RuntimeError):
            with _launcher.transient_captures():
                _launcher._CAPTURED[id(timed)] = timed
                _launcher._CAPTURED[id(callers)] = callers  # captured again inside: still the caller's
                raise RuntimeError
        assert _launcher._CAPTURED == {**saved, id(callers): callers}
    finally:
        _launcher._CAPTURED.clear()
        _launcher._CAPTURED.update(saved)
