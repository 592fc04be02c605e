"""cupy_comba.interop.jax: flash-linear-attention's calls on jax arrays, against the float64 reference (the NumPy
path of the public ops).  Skips without JAX."""

import doctest

import numpy
import pytest

from cupy_comba import comba_forward, gated_delta_forward, reference

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.gpu

import jax.numpy as jnp  # noqa: E402

from cupy_comba.interop import jax as cj  # noqa: E402


def _inputs(B, T, H, HV, K, V, seed, N=None):
    rng = numpy.random.default_rng(seed)
    unit = lambda *s: (lambda x: x / numpy.linalg.norm(x, axis=-1, keepdims=True))(rng.standard_normal(s))  # noqa
    host = [unit(B, T, H, K), unit(B, T, H, K), rng.standard_normal((B, T, HV, V)), unit(B, T, H, K),
            -rng.random((B, T, HV)) / 4, rng.random((B, T, HV)), rng.standard_normal((B if N is None else N, HV, K, V))]
    host = [x.astype(numpy.float32) for x in host]
    gpu = jax.devices("gpu")[0]
    return host, [jax.device_put(jnp.asarray(x), gpu) for x in host]


@pytest.mark.parametrize("T", [1, 6, 33])
def test_the_calls_equal_the_reference(T):
    (hq, hk, hv, hp, hg, hb, hS), (q, k, v, p, g, beta, S) = _inputs(2, T, 2, 4, 64, 64, seed=T)
    o_ref, S_ref = gated_delta_forward(hq, hk, hv, hb, hg, initial_state=hS, use_qk_l2norm=True)
    for call in (cj.chunk_gated_delta_rule, cj.fused_recurrent_gated_delta_rule):  # beta by name: gk comes first
        o, S1 = call(q, k, v, g, beta=beta, initial_state=S, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert isinstance(o, jax.Array) and isinstance(S1, jax.Array)
        assert reference.relative_error(numpy.asarray(o), o_ref) <= 2e-6
        assert reference.relative_error(numpy.asarray(S1), S_ref) <= 1e-6
    o_ref, S_ref = comba_forward(hq, hk, hv, hp, hb, hg, initial_state=hS)
    o, S1 = cj.fused_recurrent_comba(q, k, p, v, g, beta, initial_state=S, output_final_state=True)
    assert reference.relative_error(numpy.asarray(o), o_ref) <= 2e-6
    assert reference.relative_error(numpy.asarray(S1), S_ref) <= 1e-6
    o, _ = cj.chunk_comba(q, k, v, p, g, beta, initial_state=S)
    assert reference.relative_error(numpy.asarray(o), o_ref) <= 2e-6


def test_a_pool_comes_back_as_a_new_array():
    """With ssm_state_indices the updated pool is a new array: the one passed in is unchanged (jax arrays are
    immutable), the slots not named are copied as they were, and JAX's work after the call sees finished values."""
    (hq, hk, hv, hp, hg, hb, hS), (q, k, v, p, g, beta, pool) = _inputs(3, 2, 2, 2, 64, 64, seed=3, N=5)
    slots = numpy.array([4, -1, 1], numpy.int32)
    host_pool = hS.copy()
    o_ref, _ = gated_delta_forward(hq, hk, hv, hb, hg, initial_state=host_pool, state_indices=slots)
    o, new_pool = cj.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, ssm_state_indices=jnp.asarray(slots))
    assert numpy.array_equal(numpy.asarray(pool), hS)
    assert reference.relative_error(numpy.asarray(new_pool), host_pool) <= 1e-6
    assert reference.relative_error(numpy.asarray(o), o_ref) <= 2e-6
    assert float(jnp.abs(new_pool[jnp.array([0, 2, 3])] - pool[jnp.array([0, 2, 3])]).max()) == 0.0


def test_refusals():
    _, (q, k, v, p, g, beta, S) = _inputs(1, 2, 2, 2, 64, 64, seed=7)
    with pytest.raises(TypeError, match="jax.Array"):
        cj.chunk_gated_delta_rule(numpy.asarray(q), k, v, g, beta)
    with pytest.raises(NotImplementedError, match="gk, gv"):
        cj.fused_recurrent_gated_delta_rule(q, k, v, gk=q)
    with pytest.raises(TypeError, match="unexpected keyword"):
        cj.chunk_comba(q, k, v, p, g, beta, head_first=True)


def test_docstring_examples():
    result = doctest.testmod(cj, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
