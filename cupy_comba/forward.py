"""Forward passes: T tokens of the gated delta rule for a batch of sequences, in one launch.

``comba_forward(q, k, v, p, beta, g)`` and ``gated_delta_forward(q, k, v, beta, g)``: the state
is read once (or starts at zero), stays on chip across the T tokens and is written once; o is
written per token.  :mod:`cupy_comba.tiling` picks the kernel by T and batch: the token loop,
4-token chunks, 8- and 16-token chunks on the tensor cores, or for long prompts over few heads
64-token chunks whose coefficients are formed for every chunk at once (docs/design.md).  The
options are those of the decode steps, ``cu_seqlens`` for ragged batches (docs/serving.md) and
``precision``.
"""

from ._plan import run, serving


def comba_forward(q, k, v, p, beta, g, scale=None, *, initial_state=None, output_final_state=True, state_indices=None,
                  A_log=None, dt_bias=None, use_beta_sigmoid=False, cu_seqlens=None, intermediate_states=None,
                  num_accepted_tokens=None, out=None, state_out=None, o_dtype=None, state_layout="kv", gate="log",
                  use_qk_l2norm=False, variant=None, precision=None):
    """T Comba tokens in one launch: the state is read once, kept on chip, written once.

    Equal to T calls of :func:`cupy_comba.comba_decode_step`, token t's state feeding token
    t + 1's.

    Parameters
    ----------
    q, k, p : ndarray, shape (B, T, Hk, K)
    v : ndarray, shape (B, T, H, V)
    beta, g : ndarray, shape (B, T, H)
    scale : float, optional
        Query scale; ``K ** -0.5`` when None.
    initial_state : ndarray, float32, C-contiguous, optional
        ``(B, H, K, V)`` or ``(B, H, V, K)`` by ``state_layout``; zeros when None.  Never written
        unless it is also passed as ``state_out``.
    output_final_state : bool
        Return the state after the last token (else ``None``, and no state is written).
    state_indices : ndarray, shape (B,) (N with ``cu_seqlens``; (B, T) for speculative verify), int32 or int64, optional
        ``initial_state`` is a pool: sequence b starts from slot ``state_indices[b]`` and, with
        ``output_final_state``, its final state replaces that slot in place (the pool is
        returned).  Negative indices and those >= the pool's size mark padding rows, as in
        :func:`cupy_comba.comba_decode_step`.
    A_log, dt_bias, use_beta_sigmoid
        In-kernel gating, as in :func:`cupy_comba.comba_decode_step`.
    intermediate_states : ndarray, shape (B, T) + the state's head shape, float32, optional
        Speculative verify (SGLang's and FlashInfer's convention): receives the state after every
        token; with ``output_final_state=False`` nothing else is written (the pool or
        ``initial_state`` is left as it was).  Runs a token-loop kernel.
    num_accepted_tokens : ndarray, shape (B,), int32 or int64, optional
        With a 2-D ``state_indices (B, T)`` (vLLM's convention: the state after token t of row b
        goes to slot ``state_indices[b, t]``, an index outside the pool skips it): row b starts
        from slot ``state_indices[b, num_accepted_tokens[b] - 1]`` (slot ``[b, 0]`` when None); a
        value outside 1 .. T makes row b a padding row.
    cu_seqlens : ndarray, shape (N + 1,), int32 or int64, optional
        A ragged batch of N sequences packed along T: q, k, v, p, beta, g are ``(1, total_T, ...)``
        and sequence n is tokens ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` (zero-length ones
        too); ``o`` is ``(1, total_T, H, V)``, the states ``(N, ...)``.  One launch, read on the
        device (CUDA-graph capturable); bounds outside ``0 .. total_T`` are clamped.
    out : ndarray, shape (B, T, H, V), optional
    state_out : ndarray, float32, optional
        Buffer for the final state; ``state_out=initial_state`` updates in place.
    o_dtype, state_layout, gate, use_qk_l2norm, variant
        As in :func:`cupy_comba.comba_decode_step`.
    precision : {None, "tf32", "bf16", "fp32"}
        The products of the 64-token prefill kernels: "bf16" (bf16 q, k, p; else "tf32") runs them all
        on bf16 operands, the fastest (a state error of ~2e-3 relative against float64 over long
        prompts, at bf16's rounding); "tf32" rounds their operands to TF32 (~3e-4); "fp32" splits them
        for fp32 accuracy (~2e-7).  None: "bf16" for 16-bit q, k, p and v, else "fp32".  Every other
        kernel is fp32-accurate whatever it says (docs/design.md).

    Returns
    -------
    o : ndarray, shape (B, T, H, V)
    final_state : ndarray, float32, or None

    Examples
    --------
    >>> from cupy_comba import comba_forward
    >>> from cupy_comba.inputs import forward_inputs
    >>> q, k, v, p, beta, g, S0 = forward_inputs(1, 3, 2, 64, 32, warm_steps=1)
    >>> o, S = comba_forward(q, k, v, p, beta, g, initial_state=S0)
    >>> o.shape, S.shape
    ((1, 3, 2, 32), (1, 2, 64, 32))
    """
    if p is None:
        raise TypeError("p must be a cupy.ndarray or numpy.ndarray, got NoneType (for p = k use gated_delta_forward)")
    return run(False, initial_state, q, k, v, p, beta, g, scale, output_final_state, out, state_out, o_dtype,
               state_layout, gate, use_qk_l2norm, variant,
               serving(state_indices, A_log, dt_bias, use_beta_sigmoid, cu_seqlens, intermediate_states,
                       num_accepted_tokens), precision)


def gated_delta_forward(q, k, v, beta, g, scale=None, *, initial_state=None, output_final_state=True,
                        state_indices=None, A_log=None, dt_bias=None, use_beta_sigmoid=False, cu_seqlens=None,
                        intermediate_states=None, num_accepted_tokens=None, out=None, state_out=None,
                        o_dtype=None, state_layout="kv", gate="log", use_qk_l2norm=False, variant=None,
                        precision=None):
    """T Gated DeltaNet tokens in one launch (:func:`comba_forward` with ``p = k``; k is read once).

    Parameters
    ----------
    q, k : ndarray, shape (B, T, Hk, K)
    v : ndarray, shape (B, T, H, V)
    beta, g : ndarray, shape (B, T, H)
    scale, initial_state, output_final_state, state_indices, A_log, dt_bias, use_beta_sigmoid, cu_seqlens,
    intermediate_states, num_accepted_tokens, out, state_out, o_dtype, state_layout, gate, use_qk_l2norm, variant,
    precision
        As in :func:`comba_forward`.

    Returns
    -------
    o : ndarray, shape (B, T, H, V)
    final_state : ndarray, float32, or None

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import gated_delta_forward
    >>> x = np.ones((1, 2, 1, 64), np.float32) / 8
    >>> o, S = gated_delta_forward(x, x, np.ones((1, 2, 1, 32), np.float32), np.ones((1, 2, 1), np.float32),
    ...                            np.zeros((1, 2, 1), np.float32), scale=1.0)
    >>> round(float(o[0, 1, 0, 0]), 6)
    1.0
    """
    return run(False, initial_state, q, k, v, None, beta, g, scale, output_final_state, out, state_out, o_dtype,
               state_layout, gate, use_qk_l2norm, variant,
               serving(state_indices, A_log, dt_bias, use_beta_sigmoid, cu_seqlens, intermediate_states,
                       num_accepted_tokens), precision)
