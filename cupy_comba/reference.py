"""The float64 reference: the executable specification of every op.

Written once, in array-API style, so the same code runs on NumPy arrays (the
CPU path and the tests) and on CuPy arrays (the benchmark's full-size
correctness check on the GPU).  Clarity over speed: every input is upcast to
float64 and the math is written exactly as docs/design.md states it.

Shapes follow the library: ``state [B, H, K, V]``, ``q, k, p [B, Hk, K]``,
``v [B, H, V]``, ``beta, g [B, H]`` with ``H % Hk == 0`` (head ``h`` reads the
keys of head ``h // (H // Hk)``).  The serving options (docs/serving.md) are
here too: a state pool addressed by ``state_indices`` and the gates computed
from raw projections (``A_log``, ``dt_bias``, ``use_beta_sigmoid``).
"""

from ._backend import cupy as _cupy

import numpy as _numpy


def array_namespace(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    if _cupy is not None and any(isinstance(a, _cupy.ndarray) for a in arrays):
        return _cupy
    return _numpy


def _f64(xp, x):
    return xp.asarray(x).astype(xp.float64)


def _expand_heads(xp, x, heads):
    """Repeat key heads ``[B, Hk, K]`` to ``[B, H, K]`` (grouped value attention)."""
    group = heads // x.shape[1]
    return x if group == 1 else xp.repeat(x, group, axis=1)


#: Above this, softplus(x) is x (float32 rounds log1p(exp(x)) to x there), as the engines compute it.
SOFTPLUS_THRESHOLD = 20.0


def softplus(x):
    """``log(1 + exp(x))``, and ``x`` itself above :data:`SOFTPLUS_THRESHOLD`."""
    xp = array_namespace(x)
    return xp.where(x > SOFTPLUS_THRESHOLD, x, xp.log1p(xp.exp(xp.minimum(x, SOFTPLUS_THRESHOLD))))


def gates(beta, g, A_log=None, dt_bias=None, use_beta_sigmoid=False):
    """The step size and log-decay the recurrence uses, in float64, from the ops' ``beta`` and ``g``.

    With ``A_log`` and ``dt_bias`` (``[H]``), ``g`` holds the raw gate input ``a`` and the
    log-decay is ``-exp(A_log) * softplus(a + dt_bias)`` (Qwen3-Next's gating); with
    ``use_beta_sigmoid``, ``beta`` holds the logit ``b`` and the step size is ``sigmoid(b)``.
    ``beta, g [..., H]``.
    """
    xp = array_namespace(beta, g)
    beta, g = _f64(xp, beta), _f64(xp, g)
    if use_beta_sigmoid:
        beta = 1.0 / (1.0 + xp.exp(-beta))
    if A_log is not None:
        g = -xp.exp(_f64(xp, A_log)) * softplus(g + _f64(xp, dt_bias))
    return beta, g


def live_rows(state_indices, N):
    """Which rows of a batch have a slot of a pool of N (bool, the shape of ``state_indices``): an index in
    ``0 .. N - 1``; negative ones and those >= N mark padding rows."""
    xp = array_namespace(state_indices)
    idx = xp.asarray(state_indices).astype(xp.int64)
    return (idx >= 0) & (idx < N)


def live_slots(state_indices, N):
    """The pool slots a batch reads and writes: the entries of ``state_indices`` of its :func:`live_rows`."""
    xp = array_namespace(state_indices)
    return xp.asarray(state_indices).astype(xp.int64)[live_rows(state_indices, N)]


#: L2-normalisation epsilon of ``use_qk_l2norm``: ``x / sqrt(sum(x**2) + L2NORM_EPS)``.
L2NORM_EPS = 1e-6


def l2_normalize(x, eps=L2NORM_EPS):
    """``x / sqrt(sum(x**2, axis=-1) + eps)``, in the precision of ``x``."""
    xp = array_namespace(x)
    return x / xp.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _check_options(state_layout, gate):
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout must be 'kv' or 'vk', got {state_layout!r}")
    if gate not in ("log", "linear"):
        raise ValueError(f"gate must be 'log' or 'linear', got {gate!r}")


def comba_step(state, q, k, v, p, beta, g, scale=None, *, state_layout="kv", gate="log", use_qk_l2norm=False,
               state_indices=None, A_log=None, dt_bias=None, use_beta_sigmoid=False):
    """One Comba step in float64: decay, correction read with ``p``, write with ``k``.

    Parameters
    ----------
    state : array, shape (B, H, K, V) (``state_layout="kv"``) or (B, H, V, K) (``"vk"``)
    q, k, p : arrays, shape (B, Hk, K)
    v : array, shape (B, H, V)
    beta, g : arrays, shape (B, H); ``g`` is the log-decay (``gate="log"``: the
        state is scaled by ``exp(g)``) or the gate itself (``gate="linear"``).
    scale : float, optional
        Query scale, ``K ** -0.5`` when None.
    use_qk_l2norm : bool
        L2-normalise q, k and p along K first (:data:`L2NORM_EPS`).
    state_indices : int array, shape (B,), optional
        ``state`` is a pool ``(N, H, K, V)``: row b reads slot ``state_indices[b]`` and its new
        state replaces that slot; a negative index or one >= N marks a padding row (o zeros,
        no slot read or written).  A slot named by two rows ends undefined on the GPU (the
        rows race); here it takes one of their states.
    A_log, dt_bias, use_beta_sigmoid
        The gates from raw projections (:func:`gates`).

    Returns
    -------
    state_new : float64 array, the layout of ``state`` (with a pool: the whole pool)
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
    _check_options(state_layout, gate)
    xp = array_namespace(state, q, k, v, p, beta, g)
    if state_indices is not None:
        return _pooled(comba_step, state, state_indices, (q, k, v, p, beta, g), scale,
                       state_layout=state_layout, gate=gate, use_qk_l2norm=use_qk_l2norm, A_log=A_log,
                       dt_bias=dt_bias, use_beta_sigmoid=use_beta_sigmoid)
    beta, g = gates(beta, g, A_log, dt_bias, use_beta_sigmoid)
    S = _f64(xp, state)
    if state_layout == "vk":
        S = xp.swapaxes(S, -1, -2)
    H, K = S.shape[1], S.shape[2]
    if scale is None:
        scale = K ** -0.5
    q, k, p = (_expand_heads(xp, _f64(xp, x), H) for x in (q, k, p))
    if use_qk_l2norm:
        q, k, p = l2_normalize(q), l2_normalize(k), l2_normalize(p)
    v = _f64(xp, v)
    gate_value = xp.exp(g) if gate == "log" else g

    S = gate_value[..., None, None] * S                       # decay first
    u = beta[..., None] * (v - (p[..., None, :] @ S)[..., 0, :])  # read with p
    S_new = S + k[..., :, None] * u[..., None, :]             # write with k
    o = ((scale * q)[..., None, :] @ S_new)[..., 0, :]        # read the new state
    if state_layout == "vk":
        S_new = xp.swapaxes(S_new, -1, -2)
    return S_new, o


def gated_delta_step(state, q, k, v, beta, g, scale=None, **options):
    """One Gated DeltaNet step: :func:`comba_step` with the read key ``p = k``."""
    return comba_step(state, q, k, v, k, beta, g, scale, **options)


def comba_loop(state, q, k, v, p, beta, g, scale=None, *, state_indices=None, cu_seqlens=None,
               num_accepted_tokens=None, intermediate=False, **options):
    """``T`` Comba steps: ``q, k, p [B, T, Hk, K]``, ``v [B, T, H, V]``, ``beta, g [B, T, H]``.

    Returns the final state (the layout of ``state``; with ``state_indices`` the whole pool, each
    row's slot replaced by its final state) and ``o [B, T, H, V]``, float64, and with
    ``intermediate`` the state after every token, ``[B, T, ...]``.  Takes the options of
    :func:`comba_step`, and:

    cu_seqlens : int array, shape (N + 1,)
        A ragged batch: the activations packed as ``[1, total_T, ...]``, sequence n the tokens
        ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` (each bound clamped to ``0 .. total_T``, the
        upper one to at least the lower), its state row n of ``state [N, ...]`` (slot
        ``state_indices[n]`` of a pool); ``o`` is ``[1, total_T, H, V]``, zeros in the rows of no
        sequence (:func:`covered_rows`; the ops leave those rows of ``out`` as they were).
    state_indices : int array, shape (B, T)
        vLLM's speculative verify: row b starts from slot ``state_indices[b, a - 1]`` with
        ``a = num_accepted_tokens[b]`` (1 when None; a row with ``a`` outside ``1 .. T`` is padding)
        and the state after its token t replaces slot ``state_indices[b, t]`` (skipped for an index
        outside the pool).
    """
    xp = array_namespace(state, q, k, v, p, beta, g)
    acts = (q, k, v, p, beta, g)
    if cu_seqlens is not None:
        return _ragged(state, cu_seqlens, state_indices, acts, scale, **options)
    if state_indices is not None:
        if len(state_indices.shape) == 2:
            return _slot_per_token(state, state_indices, num_accepted_tokens, acts, scale, **options)
        return _pooled(comba_loop, state, state_indices, acts, scale, intermediate=intermediate, **options)
    S, outs, states = _f64(xp, state), [], []
    for t in range(q.shape[1]):
        S, o = comba_step(S, q[:, t], k[:, t], v[:, t], p[:, t], beta[:, t], g[:, t], scale, **options)
        outs.append(o)
        states.append(S)
    B, T, H, V = v.shape
    o = xp.stack(outs, axis=1) if outs else xp.zeros((B, 0, H, V), dtype=xp.float64)
    if not intermediate:
        return S, o
    return S, o, xp.stack(states, axis=1) if states else xp.zeros((B, 0) + S.shape[1:], dtype=xp.float64)


def _slot_per_token(pool, state_indices, num_accepted_tokens, acts, scale, **options):
    """vLLM's verify convention (:func:`comba_loop`), row by row."""
    xp = array_namespace(pool, *acts)
    pool = _f64(xp, pool)
    B, T = state_indices.shape
    idx = [[int(x) for x in row] for row in state_indices.tolist()]
    accepted = [1] * B if num_accepted_tokens is None else [int(x) for x in num_accepted_tokens.tolist()]
    o = xp.zeros(acts[2].shape, dtype=xp.float64)
    for b in range(B):
        if not 1 <= accepted[b] <= T or not 0 <= idx[b][accepted[b] - 1] < pool.shape[0]:
            continue  # a padding row
        first = idx[b][accepted[b] - 1]
        _, o_b, states = comba_loop(pool[first:first + 1], *(a[b:b + 1] for a in acts), scale, intermediate=True,
                                    **options)
        o[b] = o_b[0]
        for t, slot in enumerate(idx[b]):
            if 0 <= slot < pool.shape[0]:
                pool[slot] = states[0, t]
    return pool, o


def _pooled(op, pool, state_indices, acts, scale, intermediate=False, **options):
    """``op`` over the live rows of a batch: gather their slots, run, scatter; padding rows get o = 0
    (and NaN intermediate states: the kernels leave them unwritten)."""
    xp = array_namespace(pool, *acts)
    pool = _f64(xp, pool)
    idx = xp.asarray(state_indices).astype(xp.int64)
    live = xp.nonzero(live_rows(idx, pool.shape[0]))[0]
    v = acts[2]
    o = xp.zeros(v.shape, dtype=xp.float64)
    extra = dict(intermediate=True) if intermediate else {}
    states = xp.full(v.shape[:2] + pool.shape[1:], xp.nan) if intermediate else None
    if live.size:
        S, o_live, *inter = op(pool[idx[live]], *(a[live] for a in acts), scale, **extra, **options)
        o[live] = o_live
        pool[idx[live]] = S
        if intermediate:
            states[live] = inter[0]
    return (pool, o, states) if intermediate else (pool, o)


def _ragged(state, cu_seqlens, state_indices, acts, scale, **options):
    """:func:`comba_loop` sequence by sequence over a packed batch."""
    xp = array_namespace(state, *acts)
    S = _f64(xp, state)
    total = acts[0].shape[1]
    slots = None if state_indices is None else [int(x) for x in state_indices.tolist()]
    o = xp.zeros((1, total) + acts[2].shape[2:], dtype=xp.float64)
    for n, (lo, hi) in enumerate(_sequence_tokens(cu_seqlens, total)):
        row = n if slots is None else slots[n]
        if not 0 <= row < S.shape[0]:
            continue  # a padding sequence: o zeros, no state
        S_n, o_n = comba_loop(S[row:row + 1], *(a[:, lo:hi] for a in acts), scale, **options)
        o[:, lo:hi] = o_n
        S[row] = S_n[0]
    return S, o


def _sequence_tokens(cu_seqlens, total):
    """``(lo, hi)`` of each sequence of ``cu_seqlens``, its tokens ``lo .. hi - 1``: each bound clamped to
    ``0 .. total``, the upper one to at least the lower (as the kernels clamp them)."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for a, z in zip(bounds, bounds[1:]):
        lo = min(max(a, 0), total)
        yield lo, min(max(z, lo), total)


def covered_rows(cu_seqlens, total):
    """The packed tokens some sequence of ``cu_seqlens`` covers (bool ``[total]``): the rows of ``o`` a ragged
    call writes."""
    rows = _numpy.zeros(total, bool)
    for lo, hi in _sequence_tokens(cu_seqlens, total):
        rows[lo:hi] = True
    return rows


def gated_delta_loop(state, q, k, v, beta, g, scale=None, **options):
    """``T`` Gated DeltaNet steps (:func:`comba_loop` with ``p = k``)."""
    return comba_loop(state, q, k, v, k, beta, g, scale, **options)


def relative_error(x, ref):
    """Relative Frobenius error ``||x - ref|| / ||ref||`` in float64 (NaN stays NaN)."""
    xp = array_namespace(x, ref)
    x, ref = _f64(xp, x), _f64(xp, ref)
    return float(xp.linalg.norm((x - ref).ravel()) / xp.linalg.norm(ref.ravel()))
