"""Realistic random inputs for tests and benchmarks.

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


def _tokens(xp, rng, lead, H, K, V, Hk, normalize_keys=True):
    """float64 ``(q, k, v, p, beta, g)`` with leading axes ``lead``: ``(B,)`` or ``(B, T)``."""
    Hk = H if Hk is None else Hk
    q = _normal(xp, rng, lead + (Hk, K))
    k = _normal(xp, rng, lead + (Hk, K))
    p = _normal(xp, rng, lead + (Hk, K))
    if normalize_keys:
        k, p = reference.l2_normalize(k, 0.0), reference.l2_normalize(p, 0.0)
    v = _normal(xp, rng, lead + (H, V))
    beta = 1.0 / (1.0 + xp.exp(-rng.random(lead + (H,), dtype=xp.float64)))
    g = -xp.log1p(xp.exp(-_normal(xp, rng, lead + (H,)))) / 4.0
    return q, k, v, p, beta, g


def decode_token(xp, rng, B, H, K, V, Hk=None):
    """One token of float64 activations ``(q, k, v, p, beta, g)``."""
    return _tokens(xp, rng, (B,), H, K, V, Hk)


def _warm_state(xp, rng, B, H, K, V, Hk, warm_steps):
    S = xp.zeros((B, H, K, V), dtype=xp.float64)
    for _ in range(warm_steps):
        S, _o = reference.comba_step(S, *decode_token(xp, rng, B, H, K, V, Hk))
    return S


def _laid_out(xp, S, g, state_layout, gate, g_dtype):
    """The warmed state as a C-contiguous float32 array in ``state_layout``, and ``g`` as ``gate`` says."""
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout must be 'kv' or 'vk', got {state_layout!r}")
    if gate not in ("log", "linear"):
        raise ValueError(f"gate must be 'log' or 'linear', got {gate!r}")
    if state_layout == "vk":
        S = xp.swapaxes(S, -1, -2)
    if gate == "linear":
        g = xp.exp(g)
    return xp.ascontiguousarray(S.astype(float32)), g.astype(g_dtype)


def decode_inputs(B, H, K, V, *, Hk=None, dtype=bfloat16, g_dtype=float32, xp=None, seed=0, warm_steps=16,
                  state_layout="kv", gate="log", normalize_keys=True):
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
        dtype of the gate g.
    xp : module, optional
        ``numpy`` (default) or ``cupy``: where the arrays are built.
    seed : int
    warm_steps : int
        Reference steps applied to the zero state before the returned token.
    state_layout : {"kv", "vk"}
        The state as ``(B, H, K, V)`` or ``(B, H, V, K)``.
    gate : {"log", "linear"}
        g as the log-decay, or as the decay ``exp(g)``.
    normalize_keys : bool
        False leaves k and p unnormalised (for ``use_qk_l2norm`` runs).

    Examples
    --------
    >>> from cupy_comba.inputs import decode_inputs
    >>> state, q, k, v, p, beta, g = decode_inputs(2, 4, 64, 32, warm_steps=2)
    >>> state.dtype, q.dtype.name, state.shape, g.shape
    (dtype('float32'), 'bfloat16', (2, 4, 64, 32), (2, 4))
    >>> decode_inputs(2, 4, 64, 32, warm_steps=2, state_layout="vk")[0].shape
    (2, 4, 32, 64)
    """
    if xp is None:
        import numpy as xp
    rng = _rng(xp, seed)
    S = _warm_state(xp, rng, B, H, K, V, Hk, warm_steps)
    q, k, v, p, beta, g = _tokens(xp, rng, (B,), H, K, V, Hk, normalize_keys)
    S, g = _laid_out(xp, S, g, state_layout, gate, g_dtype)
    return (S, *(a.astype(dtype) for a in (q, k, v, p, beta)), g)


def forward_inputs(B, T, H, K, V, *, Hk=None, dtype=bfloat16, g_dtype=float32, xp=None, seed=0, warm_steps=16,
                   state_layout="kv", gate="log", normalize_keys=True):
    """``(q, k, v, p, beta, g, initial_state)`` for ``T`` tokens, ``[B, T, H, *]`` activations.

    The parameters are those of :func:`decode_inputs`.

    Examples
    --------
    >>> from cupy_comba.inputs import forward_inputs
    >>> q, k, v, p, beta, g, S = forward_inputs(2, 5, 4, 64, 32, state_layout="vk", warm_steps=1)
    >>> q.shape, v.shape, g.shape, S.shape
    ((2, 5, 4, 64), (2, 5, 4, 32), (2, 5, 4), (2, 4, 32, 64))
    """
    if xp is None:
        import numpy as xp
    rng = _rng(xp, seed)
    S = _warm_state(xp, rng, B, H, K, V, Hk, warm_steps)
    q, k, v, p, beta, g = _tokens(xp, rng, (B, T), H, K, V, Hk, normalize_keys)
    S, g = _laid_out(xp, S, g, state_layout, gate, g_dtype)
    return (*(a.astype(dtype) for a in (q, k, v, p, beta)), g, S)
