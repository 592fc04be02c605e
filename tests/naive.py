"""An independent per-element formulation of the Comba step, for checking the reference."""

import math


def comba_step_naive(state, q, k, v, p, beta, g, scale=None):
    """Plain Python loops over (b, h, i, j), straight from the spec's elementwise form."""
    B, H, K, V = state.shape
    group = H // q.shape[1]
    scale = K ** -0.5 if scale is None else scale
    S_new = [[[[0.0] * V for _ in range(K)] for _ in range(H)] for _ in range(B)]
    o = [[[0.0] * V for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            hk = h // group
            e = math.exp(float(g[b, h]))
            for j in range(V):
                read = sum(float(p[b, hk, i]) * e * float(state[b, h, i, j]) for i in range(K))
                u = float(beta[b, h]) * (float(v[b, h, j]) - read)
                for i in range(K):
                    S_new[b][h][i][j] = e * float(state[b, h, i, j]) + float(k[b, hk, i]) * u
                o[b][h][j] = sum(scale * float(q[b, hk, i]) * S_new[b][h][i][j] for i in range(K))
    return S_new, o
