"""Random inputs for the delta-rule family tests: [B, T, H, *] activations and a state in either layout."""

import numpy

from cupy_comba import reference


def forward_inputs(xp, B, T, H, K, V, *, Hk=None, dtype=numpy.float32, layout="kv", gate="log", seed=0,
                   unit_keys=True):
    """(q, k, v, p, beta, g, state): state warmed to realistic magnitudes, gates in range."""
    rng = xp.random.default_rng(seed)
    Hk = H if Hk is None else Hk

    def normal(*shape):
        return rng.standard_normal(shape, dtype=xp.float64)

    q, k, p = normal(B, T, Hk, K), normal(B, T, Hk, K), normal(B, T, Hk, K)
    if unit_keys:
        k, p = reference.l2_normalize(k), reference.l2_normalize(p)
    v = normal(B, T, H, V)
    beta = 1.0 / (1.0 + xp.exp(-rng.random((B, T, H), dtype=xp.float64)))
    g = -xp.log1p(xp.exp(-normal(B, T, H))) / 4.0
    if gate == "linear":
        g = xp.exp(g)
    state = normal(B, H, K, V) * 0.1
    if layout == "vk":
        state = xp.ascontiguousarray(xp.swapaxes(state, -1, -2))
    acts = [a.astype(dtype) for a in (q, k, v, p, beta)]
    return (*acts, g.astype(numpy.float32), state.astype(numpy.float32))
