"""The float64 reference against an independent naive loop, and against the spec's calibration."""

import numpy
import pytest

from cupy_comba import reference
from cupy_comba.inputs import decode_inputs, decode_token

from naive import comba_step_naive


def _f64_inputs(rng, B, H, K, V, Hk):
    state = rng.standard_normal((B, H, K, V))
    return (state, *decode_token(numpy, rng, B, H, K, V, Hk))


@pytest.mark.parametrize("B,H,Hk,K,V", [(2, 3, 3, 8, 5), (1, 4, 2, 6, 4), (3, 4, 1, 4, 7)], ids=str)
@pytest.mark.parametrize("scale", [None, 0.7])
def test_reference_matches_naive_loop(rng, B, H, Hk, K, V, scale):
    args = _f64_inputs(rng, B, H, K, V, Hk)
    S, o = reference.comba_step(*args, scale=scale)
    S_naive, o_naive = comba_step_naive(*args, scale=scale)
    numpy.testing.assert_allclose(S, numpy.array(S_naive), rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(o, numpy.array(o_naive), rtol=1e-12, atol=1e-12)


def test_loop_is_repeated_step(rng):
    B, T, H, K, V = 2, 5, 2, 8, 4
    state = rng.standard_normal((B, H, K, V))
    toks = [decode_token(numpy, rng, B, H, K, V) for _ in range(T)]
    stacked = [numpy.stack([t[i] for t in toks], axis=1) for i in range(6)]
    S_loop, o_loop = reference.comba_loop(state, *stacked)
    S = state
    for t, tok in enumerate(toks):
        S, o = reference.comba_step(S, *tok)
        numpy.testing.assert_array_equal(o, o_loop[:, t])
    numpy.testing.assert_array_equal(S, S_loop)


def _variant(state, q, k, v, p, beta, g, *, decay=True, read_key="p", correction=True):
    """The step with one of the spec's calibrated bugs planted."""
    K = state.shape[2]
    S = numpy.exp(g)[..., None, None] * state if decay else state.copy()
    r = {"p": p, "k": k}[read_key]
    read = numpy.einsum("bhk,bhkv->bhv", r, S) if correction else 0.0
    u = beta[..., None] * (v - read)
    S_new = S + k[..., :, None] * u[..., None, :]
    return S_new, numpy.einsum("bhk,bhkv->bhv", q * K ** -0.5, S_new)


def test_einsum_variant_without_bugs_is_the_reference():
    args = [a.astype(numpy.float64) for a in decode_inputs(16, 4, 64, 64, seed=3)]
    S, o = reference.comba_step(*args)
    S2, o2 = _variant(*args)
    assert reference.relative_error(S2, S) < 1e-14
    assert reference.relative_error(o2, o) < 1e-14


@pytest.mark.parametrize("bug,least", [
    (dict(decay=False), 1e-1),          # spec: forget gate dropped ~2.0e-1
    (dict(read_key="k"), 3e-2),         # spec: correction read with k ~6.4e-2
    (dict(correction=False), 2e-2),     # spec: correction dropped ~4.5e-2
], ids=["no-decay", "read-with-k", "no-correction"])
def test_calibrated_bugs_are_far_outside_tolerance(bug, least):
    args = [a.astype(numpy.float64) for a in decode_inputs(32, 4, 128, 64, seed=5)]
    S, _ = reference.comba_step(*args)
    S_bug, _ = _variant(*args, **bug)
    assert reference.relative_error(S_bug, S) > least


def test_relative_error_propagates_nan():
    x = numpy.ones(4)
    y = x.copy()
    y[2] = numpy.nan
    assert numpy.isnan(reference.relative_error(y, x))
