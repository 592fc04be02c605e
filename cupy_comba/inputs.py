"""Realistic random inputs for tests and benchmarks (the spec's recipe).

q ~ N(0, 1); k, p = normalize(N(0, 1)) along K; v ~ N(0, 1);
beta = sigmoid(U(0, 1)); g = logsigmoid(N(0, 1)) / 4.  The state starts at
zero and is warmed by ``warm_steps`` float64 reference steps on fresh tokens,
so it looks like a state in the middle of a decode rather than zeros or noise.
"""

from . import reference
from ._dtypes import bfloat16, float32


def _rng(xp, seed):
    return xp.random.default_rng(seed)


def _normal(xp, rng, shape):
    return rng.standard_normal(shape, dtype=xp.float64)


def _unit(xp, x):
    return x / xp.sqrt((x * x).sum(axis=-1, keepdims=True))


def decode_token(xp, rng, B, H, K, V, Hk=None):
    """One token of float64 activations ``(q, k, v, p, beta, g)``."""
    Hk = H if Hk is None else Hk
    q = _normal(xp, rng, (B, Hk, K))
    k = _unit(xp, _normal(xp, rng, (B, Hk, K)))
    p = _unit(xp, _normal(xp, rng, (B, Hk, K)))
    v = _normal(xp, rng, (B, H, V))
    beta = 1.0 / (1.0 + xp.exp(-rng.random((B, H), dtype=xp.float64)))
    g = -xp.log1p(xp.exp(-_normal(xp, rng, (B, H)))) / 4.0
    return q, k, v, p, beta, g


def decode_inputs(B, H, K, V, *, Hk=None, dtype=bfloat16, g_dtype=float32, xp=None, seed=0, warm_steps=16):
    """``(state, q, k, v, p, beta, g)`` for one decode step, state warmed by reference steps.

    Parameters
    ----------
    B, H, K, V : int
        Batch, value heads, key and value head sizes.
    Hk : int, optional
        Key heads (q, k, p); ``H`` when None.
    dtype : dtype
        Activation dtype of q, k, v, p, beta.
    g_dtype : dtype
        dtype of the log-decay g.
    xp : module, optional
        ``numpy`` (default) or ``cupy``: where the arrays are built.
    seed : int
    warm_steps : int
        Reference steps applied to the zero state before the returned token.

    Examples
    --------
    >>> from cupy_comba.inputs import decode_inputs
    >>> state, q, k, v, p, beta, g = decode_inputs(2, 4, 64, 32, warm_steps=2)
    >>> state.dtype, q.dtype.name, state.shape, g.shape
    (dtype('float32'), 'bfloat16', (2, 4, 64, 32), (2, 4))
    """
    if xp is None:
        import numpy as xp
    rng = _rng(xp, seed)
    S = xp.zeros((B, H, K, V), dtype=xp.float64)
    for _ in range(warm_steps):
        S, _o = reference.comba_step(S, *decode_token(xp, rng, B, H, K, V, Hk))
    q, k, v, p, beta, g = decode_token(xp, rng, B, H, K, V, Hk)
    acts = [a.astype(dtype) for a in (q, k, v, p, beta)]
    return (S.astype(float32), *acts[:3], acts[3], acts[4], g.astype(g_dtype))
