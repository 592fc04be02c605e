"""A NumPy port of the metaltile seed's two Gated DeltaNet kernels (shared/spec/metaltile_gated_delta_seed),
used as a test oracle: float32 arithmetic, linear gate, state [B, Hv, Dv, Dk], GQA, no query scale.

Each function follows its kernel line by line (``state_decayed``, ``kv_mem``, ``delta``, ``state_new``, ``y``),
vectorised over (b, hv, dv) instead of one SIMD group per (dv, b*Hv).
"""

import numpy as np

F32 = np.float32


def _gqa(x, hv):
    """Key heads -> value heads by the seed's rule: hv reads hk = hv // (Hv / Hk)."""
    return np.repeat(x, hv // x.shape[-2], axis=-2)


def mt_gated_delta_step(q, k, v, g, beta, state):
    """q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dv, Dk] -> (y, state_out)."""
    q, k, v, g, beta, state = (np.asarray(a, dtype=F32) for a in (q, k, v, g, beta, state))
    Hv = v.shape[1]
    kh, qh = _gqa(k, Hv), _gqa(q, Hv)                                   # [B, Hv, Dk]
    decayed = state * g[:, :, None, None]                               # state_decayed
    kv_mem = (decayed * kh[:, :, None, :]).sum(axis=-1, dtype=F32)     # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[:, :, None]
    s_new = decayed + kh[:, :, None, :] * delta[:, :, :, None]
    y = (s_new * qh[:, :, None, :]).sum(axis=-1, dtype=F32)
    return y, s_new


def mt_gated_delta_chunk(q, k, v, g, beta, state):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] -> (y, state_out)."""
    state = np.asarray(state, dtype=F32)
    ys = []
    for t in range(q.shape[1]):
        y, state = mt_gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return np.stack(ys, axis=1), state
