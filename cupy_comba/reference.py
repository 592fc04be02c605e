"""The float64 reference: the executable specification of every op.

Written once, in array-API style, so the same code runs on NumPy arrays (the
CPU path and the tests) and on CuPy arrays (the benchmark's full-size
correctness check on the GPU).  Clarity over speed: every input is upcast to
float64 and the math is written exactly as the spec states it.

Shapes follow the library: ``state [B, H, K, V]``, ``q, k, p [B, Hk, K]``,
``v [B, H, V]``, ``beta, g [B, H]`` with ``H % Hk == 0`` (head ``h`` reads the
keys of head ``h // (H // Hk)``).
"""

from ._backend import array_namespace


def _f64(xp, x):
    return xp.asarray(x).astype(xp.float64)


def _expand_heads(xp, x, heads):
    """Repeat key heads ``[B, Hk, K]`` to ``[B, H, K]`` (grouped value attention)."""
    group = heads // x.shape[1]
    return x if group == 1 else xp.repeat(x, group, axis=1)


def comba_step(state, q, k, v, p, beta, g, scale=None):
    """One Comba step in float64: decay, correction read with ``p``, write with ``k``.

    Parameters
    ----------
    state : array, shape (B, H, K, V)
    q, k, p : arrays, shape (B, Hk, K)
    v : array, shape (B, H, V)
    beta, g : arrays, shape (B, H); ``g`` is the log-decay.
    scale : float, optional
        Query scale, ``K ** -0.5`` when None.

    Returns
    -------
    state_new : float64 array, shape (B, H, K, V)
    o : float64 array, shape (B, H, V)

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import reference
    >>> S = np.zeros((1, 1, 2, 3)); k = np.array([[[1.0, 0.0]]])
    >>> S1, o = reference.comba_step(S, k, k, np.ones((1, 1, 3)), k, np.ones((1, 1)), np.zeros((1, 1)), scale=1.0)
    >>> S1[0, 0].tolist(), o[0, 0].tolist()
    ([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], [1.0, 1.0, 1.0])
    """
    xp = array_namespace(state, q, k, v, p, beta, g)
    S = _f64(xp, state)
    H, K = S.shape[1], S.shape[2]
    if scale is None:
        scale = K ** -0.5
    q = _expand_heads(xp, _f64(xp, q), H)
    k = _expand_heads(xp, _f64(xp, k), H)
    p = _expand_heads(xp, _f64(xp, p), H)
    v, beta, g = _f64(xp, v), _f64(xp, beta), _f64(xp, g)

    S = xp.exp(g)[..., None, None] * S                       # decay first
    u = beta[..., None] * (v - (p[..., None, :] @ S)[..., 0, :])  # read with p
    S_new = S + k[..., :, None] * u[..., None, :]            # write with k
    o = ((scale * q)[..., None, :] @ S_new)[..., 0, :]       # read the new state
    return S_new, o


def comba_loop(state, q, k, v, p, beta, g, scale=None):
    """``T`` Comba steps: ``q, k, p [B, T, Hk, K]``, ``v [B, T, H, V]``, ``beta, g [B, T, H]``.

    Returns the final state ``[B, H, K, V]`` and ``o [B, T, H, V]``, float64.
    """
    xp = array_namespace(state, q, k, v, p, beta, g)
    S, outs = _f64(xp, state), []
    for t in range(q.shape[1]):
        S, o = comba_step(S, q[:, t], k[:, t], v[:, t], p[:, t], beta[:, t], g[:, t], scale)
        outs.append(o)
    return S, xp.stack(outs, axis=1)


def relative_error(x, ref):
    """Relative Frobenius error ``||x - ref|| / ||ref||`` in float64 (NaN stays NaN)."""
    xp = array_namespace(x, ref)
    x, ref = _f64(xp, x), _f64(xp, ref)
    return float(xp.linalg.norm((x - ref).ravel()) / xp.linalg.norm(ref.ravel()))
