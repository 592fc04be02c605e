"""The serving options on the NumPy path: state pools (``state_indices``) and in-kernel gating
(``A_log``, ``dt_bias``, ``use_beta_sigmoid``), against compositions of simpler calls and an
independent loop for the gate math."""

import math

import numpy
import pytest

from cupy_comba import comba_decode_step, comba_forward, gated_delta_decode_step, gated_delta_forward, reference
from cupy_comba.inputs import decode_inputs, forward_inputs

F32 = numpy.dtype(numpy.float32)


def gating_inputs(rng, lead, H, xp=numpy):
    """Raw gate inputs ``a`` and logits ``b`` of shape ``lead + (H,)``, with A_log and dt_bias [H]; one
    ``a`` above the softplus threshold."""
    a = (3.0 * rng.standard_normal(lead + (H,))).astype(F32)
    a.reshape(-1)[0] = 25.0
    b = rng.standard_normal(lead + (H,)).astype(F32)
    A_log = rng.uniform(-2.0, 1.0, H).astype(F32)
    dt_bias = rng.uniform(-1.0, 1.0, H).astype(F32)
    return tuple(xp.asarray(x) for x in (a, b, A_log, dt_bias))


def naive_gates(a, b, A_log, dt_bias):
    """float64 ``(beta, g)`` element by element with the math module."""
    g = numpy.empty(a.shape)
    beta = numpy.empty(b.shape)
    for i in numpy.ndindex(a.shape):
        x = float(a[i]) + float(dt_bias[i[-1]])
        softplus = x if x > 20.0 else math.log1p(math.exp(x))
        g[i] = -math.exp(float(A_log[i[-1]])) * softplus
        beta[i] = 1.0 / (1.0 + math.exp(-float(b[i])))
    return beta, g


def test_reference_gates_match_a_naive_loop(rng):
    a, b, A_log, dt_bias = gating_inputs(rng, (3, 5), 4)
    beta, g = reference.gates(b, a, A_log, dt_bias, use_beta_sigmoid=True)
    beta_n, g_n = naive_gates(a, b, A_log, dt_bias)
    numpy.testing.assert_allclose(g, g_n, rtol=1e-14, atol=0)
    numpy.testing.assert_allclose(beta, beta_n, rtol=1e-14, atol=0)
    assert reference.gates(b, a)[0] is not b  # no options: the inputs as float64
    numpy.testing.assert_array_equal(reference.gates(b, a)[1], a.astype(numpy.float64))


@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("step", [True, False], ids=["decode", "forward"])
def test_in_kernel_gating_equals_the_gates_computed_outside(rng, comba, step):
    B, T, H, K, V = 3, 4, 4, 64, 32
    if step:
        S, q, k, v, p, _, _ = decode_inputs(B, H, K, V, Hk=2, warm_steps=1, seed=3)
        lead = (B,)
    else:
        q, k, v, p, _, _, S = forward_inputs(B, T, H, K, V, Hk=2, warm_steps=1, seed=3)
        lead = (B, T)
    a, b, A_log, dt_bias = gating_inputs(rng, lead, H)
    beta, g = (x.astype(F32) for x in naive_gates(a, b, A_log, dt_bias))  # as an engine hands them over
    gated = dict(A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid=True)
    if step:
        call = (lambda **kw: comba_decode_step(S, q, k, v, p, **kw)) if comba else \
            (lambda **kw: gated_delta_decode_step(S, q, k, v, **kw))
        S1, o1 = call(beta=b, g=a, **gated)
        S2, o2 = call(beta=beta, g=g)
    else:
        call = (lambda **kw: comba_forward(q, k, v, p, initial_state=S, **kw)) if comba else \
            (lambda **kw: gated_delta_forward(q, k, v, initial_state=S, **kw))
        o1, S1 = call(beta=b, g=a, **gated)
        o2, S2 = call(beta=beta, g=g)
    # the reference both ways: the outside gates differ by their float32 rounding
    assert reference.relative_error(S1, S2) < 1e-6 and reference.relative_error(o1.astype(F32), o2.astype(F32)) < 1e-2


def _pool(rng, N, H, K, V):
    return rng.standard_normal((N, H, K, V)).astype(F32) / 4


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
def test_decode_through_a_pool_is_gather_step_scatter(rng, layout, comba):
    N, H, K, V = 9, 4, 64, 32
    _, q, k, v, p, beta, g = decode_inputs(6, H, K, V, Hk=2, warm_steps=0, seed=5)
    pool = _pool(rng, N, H, K, V) if layout == "kv" else _pool(rng, N, H, V, K)
    idx = numpy.array([7, 0, -1, 3, 9, 5], numpy.int64)  # -1 and 9 (>= N) are padding rows
    live = numpy.array([0, 1, 3, 5])
    before = pool.copy()
    opts = dict(state_layout=layout)
    if comba:
        dense_S, dense_o = comba_decode_step(pool[idx[live]], q[live], k[live], v[live], p[live], beta[live],
                                             g[live], **opts)
        S, o = comba_decode_step(pool, q, k, v, p, beta, g, state_indices=idx, **opts)
    else:
        dense_S, dense_o = gated_delta_decode_step(pool[idx[live]], q[live], k[live], v[live], beta[live], g[live],
                                                   **opts)
        S, o = gated_delta_decode_step(pool, q, k, v, beta, g, state_indices=idx.astype(numpy.int32), **opts)
    assert S is pool
    numpy.testing.assert_array_equal(pool[idx[live]], dense_S)
    numpy.testing.assert_array_equal(o[live], dense_o)
    assert not o[[2, 4]].astype(F32).any()
    untouched = numpy.setdiff1d(numpy.arange(N), idx[live])
    numpy.testing.assert_array_equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("write_final", [True, False])
def test_forward_through_a_pool_reads_and_writes_its_slots(rng, write_final):
    N, B, T, H, K, V = 6, 3, 5, 2, 64, 32
    q, k, v, p, beta, g, _ = forward_inputs(B, T, H, K, V, warm_steps=0, seed=8)
    pool = _pool(rng, N, H, K, V)
    before = pool.copy()
    idx = numpy.array([4, -7, 1], numpy.int32)
    o, S = comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=idx, output_final_state=write_final)
    o_dense, S_dense = comba_forward(q[[0, 2]], k[[0, 2]], v[[0, 2]], p[[0, 2]], beta[[0, 2]], g[[0, 2]],
                                     initial_state=before[[4, 1]])
    numpy.testing.assert_array_equal(o[[0, 2]], o_dense)
    assert not o[1].astype(F32).any()
    if write_final:
        assert S is pool
        numpy.testing.assert_array_equal(pool[[4, 1]], S_dense)
        numpy.testing.assert_array_equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
    else:
        assert S is None
        numpy.testing.assert_array_equal(pool, before)


def test_reference_pool_matches_gather_scatter(rng):
    N, H, K, V = 5, 2, 8, 4
    pool = rng.standard_normal((N, H, K, V))
    q, k, v, p = (rng.standard_normal((3, H, n)) for n in (K, K, V, K))
    beta, g = rng.random((3, H)), -rng.random((3, H))
    idx = numpy.array([2, -1, 4])
    S, o = reference.comba_step(pool, q, k, v, p, beta, g, state_indices=idx)
    S2, o2 = reference.comba_step(pool[[2, 4]], q[[0, 2]], k[[0, 2]], v[[0, 2]], p[[0, 2]], beta[[0, 2]], g[[0, 2]])
    numpy.testing.assert_array_equal(S[[2, 4]], S2)
    numpy.testing.assert_array_equal(S[[0, 1, 3]], pool[[0, 1, 3]])
    numpy.testing.assert_array_equal(o[[0, 2]], o2)
    assert not o[1].any()


# -- bad input ---------------------------------------------------------------------------------------

def _decode_args():
    return list(decode_inputs(3, 4, 64, 32, warm_steps=1, seed=2))


@pytest.mark.parametrize("idx,error,match", [
    (numpy.zeros(3, numpy.float32), TypeError, "state_indices must be int32 or int64, got float32"),
    (numpy.zeros(2, numpy.int32), ValueError, r"state_indices must have shape \(B,\).* = \(3,\), got \(2,\)"),
    (numpy.zeros((3, 1), numpy.int32), ValueError, "state_indices must have shape"),
    ([0, 1, 2], TypeError, "state_indices must be a cupy.ndarray or numpy.ndarray, got list"),
])
def test_bad_state_indices(idx, error, match):
    with pytest.raises(error, match=match):
        comba_decode_step(*_decode_args(), state_indices=idx)


def test_a_pool_is_updated_in_place_only():
    args = _decode_args()
    with pytest.raises(ValueError, match="state_out must be the pool itself"):
        comba_decode_step(*args, state_indices=numpy.arange(3), state_out=args[0].copy())


def test_a_forward_pool_needs_the_pool():
    q, k, v, p, beta, g, _ = forward_inputs(2, 3, 2, 64, 32, warm_steps=0)
    with pytest.raises(ValueError, match="pass the pool as initial_state"):
        comba_forward(q, k, v, p, beta, g, state_indices=numpy.arange(2))


def test_gating_options():
    args = _decode_args()
    A = numpy.zeros(4, F32)
    with pytest.raises(ValueError, match="A_log was given without dt_bias"):
        comba_decode_step(*args, A_log=A)
    with pytest.raises(ValueError, match="gate='log', got gate='linear'"):
        comba_decode_step(*args, A_log=A, dt_bias=A, gate="linear")
    with pytest.raises(ValueError, match=r"dt_bias must have shape \(H,\)"):
        comba_decode_step(*args, A_log=A, dt_bias=numpy.zeros(3, F32))
    with pytest.raises(TypeError, match="A_log must be float32, got float64"):
        comba_decode_step(*args, A_log=A.astype(numpy.float64), dt_bias=A)
    with pytest.raises(ValueError, match="A_log must be contiguous"):
        comba_decode_step(*args, A_log=numpy.zeros(8, F32)[::2], dt_bias=A)
    with pytest.raises(TypeError, match="use_beta_sigmoid must be a bool"):
        comba_decode_step(*args, use_beta_sigmoid=1)


# -- ragged batches ----------------------------------------------------------------------------------

def ragged_case(lengths, H=4, K=64, V=32, seed=6, layout="kv"):
    """Packed activations ``[1, total_T, ...]`` of sequences of ``lengths`` and their states ``[N, ...]``."""
    q, k, v, p, beta, g, _ = forward_inputs(1, sum(lengths), H, K, V, Hk=2, warm_steps=0, seed=seed)
    rng = numpy.random.default_rng(seed)
    shape = (len(lengths), H, K, V) if layout == "kv" else (len(lengths), H, V, K)
    S0 = (rng.standard_normal(shape) / 4).astype(F32)
    cu = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
    return (q, k, v, p, beta, g), S0, cu


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
def test_a_ragged_batch_is_its_sequences_one_by_one(layout, comba):
    lengths = [3, 0, 5, 1]
    acts, S0, cu = ragged_case(lengths, layout=layout)
    q, k, v, p, beta, g = acts
    opts = dict(state_layout=layout)
    fwd = (lambda *a, **kw: comba_forward(*a, **kw)) if comba else \
        (lambda q, k, v, p, beta, g, **kw: gated_delta_forward(q, k, v, beta, g, **kw))
    o, S = fwd(q, k, v, p, beta, g, initial_state=S0, cu_seqlens=cu, **opts)
    assert o.shape == v.shape[:3] + (32,) and S.shape == S0.shape
    for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        o_n, S_n = fwd(*(a[:, lo:hi] for a in acts), initial_state=S0[n:n + 1], **opts)
        numpy.testing.assert_array_equal(o[:, lo:hi], o_n)
        numpy.testing.assert_array_equal(S[n:n + 1], S_n)
    o0, S_none = fwd(q, k, v, p, beta, g, cu_seqlens=cu.astype(numpy.int64), output_final_state=False, **opts)
    o1, _ = fwd(*(a[:, :3] for a in acts), **opts)  # no initial state: zeros
    assert S_none is None
    numpy.testing.assert_array_equal(o0[:, :3], o1)


def test_rows_of_no_sequence_keep_what_out_held():
    """A packed buffer longer than its tokens (a batch padded to a captured size): o's rows before the first
    bound, in a gap and past the last are left as ``out`` held them; the others are the sequences' own."""
    acts, S0, _ = ragged_case([4, 4, 4, 4])
    cu = numpy.array([2, 6, 6, 9, 12])  # tokens 0-1 and 12-15 in no sequence
    out = numpy.full(acts[2].shape[:3] + (32,), 7.0, acts[2].dtype)
    o, S = comba_forward(*acts, initial_state=S0, cu_seqlens=cu, out=out)
    assert o is out
    rows = reference.covered_rows(cu, 16)
    assert rows.tolist() == [False] * 2 + [True] * 10 + [False] * 4
    assert (o[:, ~rows] == 7.0).all()
    o_all, S_all = comba_forward(*acts, initial_state=S0, cu_seqlens=cu)
    numpy.testing.assert_array_equal(o[:, rows], o_all[:, rows])
    numpy.testing.assert_array_equal(S, S_all)


def test_a_ragged_batch_through_a_pool_with_gating(rng):
    lengths = [2, 4, 0]
    acts, _, cu = ragged_case(lengths)
    q, k, v, p, _, _ = acts
    a, b, A_log, dt_bias = gating_inputs(rng, (1, sum(lengths)), 4)
    pool = _pool(rng, 5, 4, 64, 32)
    before = pool.copy()
    idx = numpy.array([3, -1, 0], numpy.int64)  # sequence 1 is padding
    gates = dict(A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid=True)
    o, S = comba_forward(q, k, v, p, b, a, initial_state=pool, state_indices=idx, cu_seqlens=cu, **gates)
    assert S is pool
    o_0, S_0 = comba_forward(q[:, :2], k[:, :2], v[:, :2], p[:, :2], b[:, :2], a[:, :2], initial_state=before[3:4],
                             **gates)
    numpy.testing.assert_array_equal(o[:, :2], o_0)
    numpy.testing.assert_array_equal(pool[3:4], S_0)
    assert not o[:, 2:].astype(F32).any()  # the padding sequence's tokens
    numpy.testing.assert_array_equal(pool[[0, 1, 2, 4]], before[[0, 1, 2, 4]])  # sequence 2 is empty: slot 0 as it was


def test_hostile_cu_seqlens_are_clamped():
    acts, S0, _ = ragged_case([2, 2, 2])
    cu = numpy.array([-5, 4, 2, 99], numpy.int64)  # clamped: [0, 4), [4, 4), [2, 6)
    _, S = comba_forward(*acts, initial_state=S0, cu_seqlens=cu)
    _, S_a = comba_forward(*(x[:, 0:4] for x in acts), initial_state=S0[0:1])
    numpy.testing.assert_array_equal(S[0:1], S_a)
    numpy.testing.assert_array_equal(S[1], S0[1])


@pytest.mark.parametrize("cu,error,match", [
    (numpy.array([0, 3], numpy.float32), TypeError, "cu_seqlens must be int32 or int64, got float32"),
    (numpy.array([0], numpy.int32), ValueError, r"cu_seqlens must have shape \(N \+ 1,\) with N >= 1"),
])
def test_bad_cu_seqlens(cu, error, match):
    acts, S0, _ = ragged_case([3])
    with pytest.raises(error, match=match):
        comba_forward(*acts, cu_seqlens=cu)


def test_a_ragged_batch_is_packed_in_one_row():
    q, k, v, p, beta, g, _ = forward_inputs(2, 3, 4, 64, 32, Hk=2, warm_steps=0)
    with pytest.raises(ValueError, match=r"packed along T: q must have shape \(1, total_T, ...\)"):
        comba_forward(q, k, v, p, beta, g, cu_seqlens=numpy.array([0, 3, 6], numpy.int32))


# -- speculative verify ------------------------------------------------------------------------------

def _steps(S, acts, layout="kv"):
    """The state after each token and o, by decode steps (the composition verify must equal; the steps
    round the state to float32 after each token, the forward pass does not)."""
    q, k, v, p, beta, g = acts
    states, outs = [], []
    for t in range(q.shape[1]):
        S, o = comba_decode_step(S, q[:, t], k[:, t], v[:, t], p[:, t], beta[:, t], g[:, t], state_layout=layout)
        states.append(S)
        outs.append(o)
    return numpy.stack(states, axis=1), numpy.stack(outs, axis=1)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("write_final", [True, False])
def test_intermediate_states_are_the_states_of_decode_steps(rng, layout, write_final):
    B, T, H, K, V = 3, 4, 4, 64, 32
    q, k, v, p, beta, g, S0 = forward_inputs(B, T, H, K, V, Hk=2, warm_steps=1, seed=4, state_layout=layout)
    before = S0.copy()
    inter = numpy.full((B, T) + S0.shape[1:], numpy.nan, F32)
    o, S = comba_forward(q, k, v, p, beta, g, initial_state=S0, intermediate_states=inter, state_layout=layout,
                         output_final_state=write_final)
    states, outs = _steps(before, (q, k, v, p, beta, g), layout)
    assert reference.relative_error(inter, states) < 1e-6
    assert reference.relative_error(o, outs) < 5e-3
    numpy.testing.assert_array_equal(S0, before)  # initial_state is never written (no state_out=)
    if write_final:
        numpy.testing.assert_array_equal(S, inter[:, -1])
    else:
        assert S is None


def test_intermediate_states_through_a_pool_skip_padding_rows(rng):
    B, T, H, K, V = 4, 3, 2, 64, 32
    q, k, v, p, beta, g, _ = forward_inputs(B, T, H, K, V, warm_steps=0, seed=5)
    pool = _pool(rng, 4, H, K, V)
    before = pool.copy()
    inter = numpy.full((B, T, H, K, V), 7.0, F32)
    o, S = comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=numpy.array([2, -1, 0, 4]),
                         intermediate_states=inter, output_final_state=False)
    assert S is None
    numpy.testing.assert_array_equal(pool, before)  # output_final_state=False: the pool as it was
    states, _ = _steps(before[[2, 0]], tuple(a[[0, 2]] for a in (q, k, v, p, beta, g)))
    assert reference.relative_error(inter[[0, 2]], states) < 1e-6
    for padding in (1, 3):  # a negative slot, and one past the pool
        assert (inter[padding] == 7.0).all() and not o[padding].astype(F32).any()


def test_intermediate_states_of_a_live_row_are_written_whatever_their_values():
    """A live row's states are written even where they are NaN (NaN inputs), as the kernels write them: nothing of
    the last call's is left in the buffer to pass for this one's."""
    B, T, H, K, V = 2, 3, 2, 64, 32
    q, k, v, p, beta, g, S0 = forward_inputs(B, T, H, K, V, warm_steps=1, seed=7)
    v[1, 1, 0, 0] = numpy.nan
    inter = numpy.full((B, T, H, K, V), 7.0, F32)
    comba_forward(q, k, v, p, beta, g, initial_state=S0, intermediate_states=inter, output_final_state=False)
    assert numpy.isfinite(inter[0]).all() and numpy.isfinite(inter[1, 0]).all()
    assert numpy.isnan(inter[1, 1:]).any() and not (inter[1] == 7.0).any()


def test_vllm_slots_per_token_with_accepted_counts(rng):
    B, T, H, K, V, N = 4, 3, 2, 64, 32, 12
    acts = forward_inputs(B, T, H, K, V, warm_steps=0, seed=6)[:6]
    pool = _pool(rng, N, H, K, V)
    before = pool.copy()
    idx = numpy.array([[0, 1, 2], [3, 4, 5], [6, 7, -1], [9, 10, 11]], numpy.int64)
    accepted = numpy.array([1, 3, 2, 0], numpy.int32)  # row 3: 0 accepted tokens, a padding row
    o, S = comba_forward(*acts, initial_state=pool, state_indices=idx, num_accepted_tokens=accepted)
    assert S is pool
    for b, first in ((0, 0), (1, 5), (2, 7)):
        states, outs = _steps(before[first:first + 1], tuple(a[b:b + 1] for a in acts))
        assert reference.relative_error(o[b], outs[0]) < 5e-3
        for t in range(T):
            if idx[b, t] >= 0:
                assert reference.relative_error(pool[idx[b, t]], states[0, t]) < 1e-6
    assert not o[3].astype(F32).any()
    numpy.testing.assert_array_equal(pool[[8, 9, 10, 11]], before[[8, 9, 10, 11]])  # untouched and padding slots


def test_verify_options_are_checked():
    q, k, v, p, beta, g, S0 = forward_inputs(2, 3, 2, 64, 32, warm_steps=0)
    pool = numpy.zeros((4, 2, 64, 32), F32)
    idx2 = numpy.zeros((2, 3), numpy.int32)
    with pytest.raises(ValueError, match="output_final_state must be True"):
        comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=idx2, output_final_state=False)
    with pytest.raises(ValueError, match="num_accepted_tokens .* takes 2-D state_indices"):
        comba_forward(q, k, v, p, beta, g, initial_state=S0, num_accepted_tokens=numpy.ones(2, numpy.int32))
    with pytest.raises(ValueError, match=r"intermediate_states must have shape"):
        comba_forward(q, k, v, p, beta, g, initial_state=S0, intermediate_states=numpy.zeros((2, 2, 2, 64, 32), F32))
    with pytest.raises(ValueError, match=r"state_indices must have shape \(B, T\)"):
        comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=numpy.zeros((2, 4), numpy.int32))
    with pytest.raises(ValueError, match="keeping every token's state; expected one of"):
        comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=idx2, variant="kv64tc16")
    with pytest.raises(ValueError, match="two conventions for the same states: pass one"):
        comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=idx2,
                      intermediate_states=numpy.zeros((2, 3, 2, 64, 32), F32))
    with pytest.raises(ValueError, match="not with cu_seqlens"):
        comba_forward(q[:1], k[:1], v[:1], p[:1], beta[:1], g[:1], cu_seqlens=numpy.array([0, 3]),
                      intermediate_states=numpy.zeros((1, 3, 2, 64, 32), F32))
