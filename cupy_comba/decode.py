"""Decode steps: one token of the gated delta rule for every sequence of a batch, in one launch.

``comba_decode_step(state, q, k, v, p, beta, g)`` and ``gated_delta_decode_step(state, q, k, v,
beta, g)`` (the Comba step with the read key ``p = k``).  The fp32 state is read once and written
once; on NumPy arrays the float64 reference runs instead.  The options are those of every op of
the library (docs/api.md): ``state_layout``, ``gate``, ``use_qk_l2norm``, ``out``, ``state_out``,
``o_dtype`` and ``variant``, and the serving options (docs/serving.md): ``state_indices``,
``A_log``, ``dt_bias`` and ``use_beta_sigmoid``.
"""

from ._plan import run, serving


def comba_decode_step(state, q, k, v, p, beta, g, scale=None, *, state_indices=None, A_log=None, dt_bias=None,
                      use_beta_sigmoid=False, out=None, state_out=None, o_dtype=None, state_layout="kv", gate="log",
                      use_qk_l2norm=False, variant=None):
    """One Comba recurrent step for every sequence of a decode batch.

    Per ``(b, h)``, with ``S = state[b, h]`` and ``e = exp(g[b, h])``::

        S     = e * S
        u     = beta * (v - S^T p)      # correction read with p, after the decay
        S_new = S + k u^T               # rank-1 write with k
        o     = S_new^T (scale * q)

    CuPy inputs run one fused CUDA kernel on their device and CuPy's current stream; NumPy
    inputs run the float64 reference on the CPU and return the same dtypes.

    Parameters
    ----------
    state : ndarray, shape (B, H, K, V), float32, C-contiguous
        Recurrent state from the previous token (``(B, H, V, K)`` for ``state_layout="vk"``).
        Never written unless it is also passed as ``state_out``.
    q, k, p : ndarray, shape (B, Hk, K)
        Query, write key and read key.  ``H % Hk == 0``; value head ``h`` uses key head
        ``h // (H // Hk)`` (grouped value attention).
    v : ndarray, shape (B, H, V)
    beta : ndarray, shape (B, H)
        Delta-rule step size.
    g : ndarray, shape (B, H)
        Log-decay (``exp(g)`` is the forget gate); the gate itself with ``gate="linear"``.
    scale : float, optional
        Query scale; ``K ** -0.5`` when None.
    state_indices : ndarray, shape (B,), int32 or int64, optional
        ``state`` is a pool ``(N, H, K, V)`` (``(N, H, V, K)`` for "vk") updated in place: row b
        reads and writes slot ``state_indices[b]``.  A negative index or one >= N makes row b a
        padding row: its ``o`` is zeros and no slot is read or written (checked in the kernel,
        without a device synchronisation).  Two rows naming one slot leave it undefined.
    A_log, dt_bias : ndarray, shape (H,), float32, optional
        In-kernel gating (Qwen3-Next): ``g`` holds the raw gate input ``a`` and the step uses the
        log-decay ``-exp(A_log) * softplus(a + dt_bias)`` (softplus linear above 20).  Both or
        neither; ``gate="log"``.
    use_beta_sigmoid : bool
        ``beta`` holds a logit: the step size is ``sigmoid(beta)``.
    out : ndarray, shape (B, H, V), optional
        Buffer for ``o`` (any strides, bfloat16 / float16 / float32).
    state_out : ndarray, float32, C-contiguous, optional
        Buffer for the new state, the shape of ``state``.  ``state_out=state`` updates in place.
    o_dtype : dtype or str, optional
        dtype of a newly allocated ``o`` (``"bf16"``, ``"float16"``, ``numpy.float32``, ...);
        default ``v.dtype``.
    state_layout : {"kv", "vk"}
        ``"vk"``: the state is ``(B, H, V, K)``, K contiguous (as vLLM and SGLang keep it).
    gate : {"log", "linear"}
        ``"linear"``: the state is scaled by ``g`` itself.
    use_qk_l2norm : bool
        L2-normalise q, k and p along K first (eps 1e-6).
    variant : str, optional
        Force a kernel tiling (:mod:`cupy_comba.families`; benchmarks and tests).  Checked on
        NumPy arrays too, where the reference runs whatever it names.

    Activations (q, k, v, p, beta, g) may each be bfloat16, float16 or float32 and may be
    strided views; K is 64, 128 or 256, V a multiple of 32.

    Returns
    -------
    state_new : ndarray, float32, the layout of ``state``
        ``state_out`` when given (with ``state_indices``: the pool itself), else a new array.
    o : ndarray, shape (B, H, V)
        ``out`` when given, else a new array of ``o_dtype``.

    Raises
    ------
    TypeError
        An argument is not an array (p is None: use :func:`gated_delta_decode_step`), NumPy and
        CuPy arrays are mixed, an option has the wrong type, or a dtype is not supported.
    ValueError
        Shapes disagree, arrays are on different devices, an output overlaps an input or is
        read-only, a state is not C-contiguous, or ``scale`` is not finite in float32.
    NotImplementedError
        K is not 64, 128 or 256, or V is not a multiple of 32.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import comba_decode_step
    >>> from cupy_comba.inputs import decode_inputs
    >>> state, q, k, v, p, beta, g = decode_inputs(2, 4, 64, 64, warm_steps=2)   # NumPy arrays
    >>> state_new, o = comba_decode_step(state, q, k, v, p, beta, g)
    >>> state_new.shape, state_new.dtype, o.shape, o.dtype.name
    ((2, 4, 64, 64), dtype('float32'), (2, 4, 64), 'bfloat16')
    >>> _ = comba_decode_step(state, q, k, v, p, beta, g, state_out=state)       # in place
    """
    if p is None:
        raise TypeError("p must be a cupy.ndarray or numpy.ndarray, got NoneType (for p = k use "
                        "gated_delta_decode_step)")
    return run(True, state, q, k, v, p, beta, g, scale, True, out, state_out, o_dtype, state_layout, gate,
               use_qk_l2norm, variant, serving(state_indices, A_log, dt_bias, use_beta_sigmoid))


def gated_delta_decode_step(state, q, k, v, beta, g, scale=None, *, state_indices=None, A_log=None, dt_bias=None,
                            use_beta_sigmoid=False, out=None, state_out=None, o_dtype=None, state_layout="kv",
                            gate="log", use_qk_l2norm=False, variant=None):
    """One Gated DeltaNet step (:func:`comba_decode_step` with ``p = k``) for a decode batch.

    Parameters
    ----------
    state : ndarray, float32, C-contiguous
        ``(B, H, K, V)`` for ``state_layout="kv"``, ``(B, H, V, K)`` for ``"vk"``.
    q, k : ndarray, shape (B, Hk, K)
    v : ndarray, shape (B, H, V)
    beta, g : ndarray, shape (B, H)
    scale : float, optional
        Query scale, ``K ** -0.5`` when None (MLX-LM's and the metaltile kernel's convention is 1.0).
    state_indices, A_log, dt_bias, use_beta_sigmoid, out, state_out, o_dtype, state_layout, gate, use_qk_l2norm,
    variant
        As in :func:`comba_decode_step`.

    Returns
    -------
    state_new : ndarray, float32, the layout of ``state``
    o : ndarray, shape (B, H, V)

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import gated_delta_decode_step
    >>> from cupy_comba.inputs import decode_inputs
    >>> state, q, k, v, _, beta, g = decode_inputs(2, 4, 64, 32, warm_steps=1)
    >>> vk_state = np.ascontiguousarray(state.swapaxes(-1, -2))
    >>> new_vk, o = gated_delta_decode_step(vk_state, q, k, v, beta, np.exp(g), state_layout="vk", gate="linear")
    >>> new_kv, o2 = gated_delta_decode_step(state, q, k, v, beta, g)
    >>> bool(np.allclose(new_vk.swapaxes(-1, -2), new_kv, atol=1e-6)), bool(np.allclose(o, o2))
    (True, True)
    """
    return run(True, state, q, k, v, None, beta, g, scale, True, out, state_out, o_dtype, state_layout, gate,
               use_qk_l2norm, variant, serving(state_indices, A_log, dt_bias, use_beta_sigmoid))
