"""Comba decode step: one token of the decoupled-key gated delta rule for a whole batch."""

from .recurrent import _run


def comba_decode_step(state, q, k, v, p, beta, g, scale=None, *, out=None, state_out=None, o_dtype=None,
                      state_layout="kv", gate="log", use_qk_l2norm=False):
    """One Comba recurrent step for every sequence of a decode batch.

    Per ``(b, h)``, with ``S = state[b, h]`` and ``e = exp(g[b, h])``::

        S     = e * S
        u     = beta * (v - S^T p)      # correction read with p, after the decay
        S_new = S + k u^T               # rank-1 write with k
        o     = S_new^T (scale * q)

    CuPy inputs run one fused CUDA kernel on their device and the current
    stream (the fp32 state is read once and written once); NumPy inputs run
    the float64 reference on the CPU and return the same dtypes.  The other
    ops of the family share the argument order and options
    (:mod:`cupy_comba.recurrent`).

    Parameters
    ----------
    state : ndarray, shape (B, H, K, V), float32, C-contiguous
        Recurrent state from the previous token. Never written unless it is
        also passed as ``state_out``.
    q, k, p : ndarray, shape (B, Hk, K)
        Query, write key and read key. ``H % Hk == 0``; value head ``h``
        uses key head ``h // (H // Hk)`` (grouped value attention).
    v : ndarray, shape (B, H, V)
    beta : ndarray, shape (B, H)
        Delta-rule step size.
    g : ndarray, shape (B, H)
        Log-decay (``exp(g)`` is the forget gate).
    scale : float, optional
        Query scale; ``K ** -0.5`` when None.
    out : ndarray, shape (B, H, V), optional
        Buffer for ``o`` (any strides, bfloat16 / float16 / float32).
    state_out : ndarray, shape (B, H, K, V), float32, C-contiguous, optional
        Buffer for the new state. ``state_out=state`` updates in place.
    o_dtype : dtype, optional
        dtype of a newly allocated ``o``; default ``v.dtype``.
    state_layout : {"kv", "vk"}
        ``"vk"``: the state is ``(B, H, V, K)``, K contiguous.
    gate : {"log", "linear"}
        ``"linear"``: the state is scaled by ``g`` itself.
    use_qk_l2norm : bool
        L2-normalise q, k and p along K first (eps 1e-6).

    Activations (q, k, v, p, beta, g) may each be bfloat16, float16 or
    float32 and may be strided views; K is 64 or 128, V a multiple of 32.

    Returns
    -------
    state_new : ndarray, shape (B, H, K, V), float32
        ``state_out`` when given, else a new array.
    o : ndarray, shape (B, H, V)
        ``out`` when given, else a new array of ``o_dtype``.

    Raises
    ------
    TypeError
        An argument is not an array, NumPy and CuPy arrays are mixed, or a
        dtype is not supported.
    ValueError
        Shapes disagree, arrays are on different devices, an output overlaps
        an input, ``state`` is not C-contiguous, or ``scale`` is not finite.
    NotImplementedError
        K is not 64 or 128, or V is not a multiple of 32.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import comba_decode_step, bfloat16
    >>> B, H, K, V = 2, 4, 64, 64
    >>> rng = np.random.default_rng(0)
    >>> act = lambda *s: rng.standard_normal(s).astype(bfloat16)
    >>> unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(bfloat16)
    >>> state = np.zeros((B, H, K, V), np.float32)
    >>> q, v = act(B, H, K), act(B, H, V)
    >>> k, p = unit(rng.standard_normal((B, H, K))), unit(rng.standard_normal((B, H, K)))
    >>> beta = np.full((B, H), 0.5, bfloat16); g = np.full((B, H), -0.1, np.float32)
    >>> state_new, o = comba_decode_step(state, q, k, v, p, beta, g)
    >>> state_new.shape, state_new.dtype, o.shape, o.dtype == bfloat16
    ((2, 4, 64, 64), dtype('float32'), (2, 4, 64), True)
    """
    return _run(q, k, v, p, beta, g, scale, state, True, out, state_out, o_dtype, state_layout, gate,
                use_qk_l2norm, step=True)
