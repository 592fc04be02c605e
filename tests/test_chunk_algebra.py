"""The chunk algebra of kernels_cu/delta_rule_mma.cu (C = 8) and kernels_cu/prefill.cu (C = 64),
written out in float64 NumPy exactly as the kernels' headers state it, against the token recurrence
of the reference (no GPU needed).

Per chunk of C tokens from S0 (kv layout, K x V), tokens past T padded with zeros, beta = 0 and a
gate of 1 (prefill.cu writes the same with tokens as rows: A = M, Mq = scale Bq^T):

    [Rp | Rq] = S0^T [p | q]
    Y   = v^T - Rp diag(G fp)
    U^T = Y M^T,  M = (I + L)^-1 diag(beta),  L[t][j] = beta_t fp_t r(j, t) fk_j (k_j . p_t), j < t
    O^T = scale (Rq diag(G fq) + U^T Bq),     Bq[j][t] = r(j, t) fk_j fq_t (k_j . q_t), j <= t
    S^T = G_{C-1} S0^T + (U^T diag(w)) [k_0 .. k_{C-1}]^T,  w_j = r(j, C - 1) fk_j
"""

import numpy
import pytest

from cupy_comba import reference
from cupy_comba.inputs import forward_inputs

F64 = numpy.float64


def chunk_forward(S, q, k, v, p, beta, e, scale, l2norm, couple=True, C=8):
    """One head: S (K, V); q, k, p (T, K); v (T, V); beta, e (T,).  Returns (o (T, V), S).

    ``couple=False`` drops L, the coupling of a chunk's tokens through the state (a wrong kernel);
    ``C`` the chunk: 8 (delta_rule_mma.cu) or 64 (prefill.cu).
    """
    T = q.shape[0]
    o = numpy.empty((T, v.shape[1]))
    for t0 in range(0, T, C):
        c = min(C, T - t0)

        def pad(x, fill=0.0):
            out = numpy.full((C,) + x.shape[1:], fill)
            out[:c] = x[t0:t0 + c]
            return out

        qc, kc, pc, vc, bc, ec = pad(q), pad(k), pad(p), pad(v), pad(beta), pad(e, 1.0)
        norm = (lambda x: 1 / numpy.sqrt((x * x).sum(-1) + reference.L2NORM_EPS)) if l2norm else \
            (lambda x: numpy.ones(C))
        fq, fk, fp = norm(qc), norm(kc), norm(pc)
        G = numpy.cumprod(ec)
        r = numpy.array([[numpy.prod(ec[j + 1:t + 1]) for t in range(C)] for j in range(C)])  # r[j][t]
        kp, kq = kc @ pc.T, kc @ qc.T  # [j][t]
        L = numpy.zeros((C, C))
        Bq = numpy.zeros((C, C))
        for t in range(C):
            for j in range(C):
                if j < t and couple:
                    L[t, j] = bc[t] * fp[t] * r[j, t] * fk[j] * kp[j, t]
                if j <= t:
                    Bq[j, t] = r[j, t] * fk[j] * fq[t] * kq[j, t]
        M = numpy.linalg.solve(numpy.eye(C) + L, numpy.diag(bc))
        Rp, Rq = S.T @ pc.T, S.T @ qc.T  # V x C
        Y = vc.T - Rp * (G * fp)
        Ut = Y @ M.T
        Ot = scale * (Rq * (G * fq) + Ut @ Bq)
        w = r[:, C - 1] * fk
        S = (G[C - 1] * S.T + (Ut * w) @ kc).T
        o[t0:t0 + c] = Ot.T[:c]
    return o, S


@pytest.mark.parametrize("C,T", [(8, 1), (8, 5), (8, 8), (8, 13), (8, 24), (64, 1), (64, 63), (64, 64), (64, 65),
                                 (64, 130)])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("gate,l2norm", [("log", False), ("linear", True)], ids=["log", "linear-l2norm"])
def test_chunk_algebra_matches_the_token_recurrence(C, T, comba, gate, l2norm):
    B, H, K, V = 2, 3, 16, 12
    q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, V, gate=gate, seed=T, dtype=F64, g_dtype=F64, xp=numpy,
                                            normalize_keys=not l2norm, warm_steps=3)
    p = p if comba else k
    scale = K ** -0.5
    S_ref, o_ref = reference.comba_loop(S, q, k, v, p, beta, g, scale, gate=gate, use_qk_l2norm=l2norm)
    e = numpy.exp(g) if gate == "log" else g
    for b in range(B):
        for h in range(H):
            o, S_new = chunk_forward(S[b, h], q[b, :, h], k[b, :, h], v[b, :, h], p[b, :, h], beta[b, :, h],
                                     e[b, :, h], scale, l2norm, C=C)
            assert reference.relative_error(S_new, S_ref[b, h]) <= 1e-12
            assert reference.relative_error(o, o_ref[b, :, h]) <= 1e-12


def test_a_gate_of_zero_is_exact_in_a_64_token_chunk():
    """Linear gates with zeros inside a chunk: the running decay products (no logarithm, no division) give
    the recurrence's values, the state before a zero gate forgotten exactly."""
    q, k, v, p, beta, g, S = forward_inputs(1, 100, 1, 16, 12, gate="linear", seed=4, dtype=F64, g_dtype=F64,
                                            xp=numpy, warm_steps=3)
    g[0, [3, 40, 64, 99], 0] = 0.0
    S_ref, o_ref = reference.comba_loop(S, q, k, v, p, beta, g, 0.25, gate="linear")
    o, S_new = chunk_forward(S[0, 0], q[0, :, 0], k[0, :, 0], v[0, :, 0], p[0, :, 0], beta[0, :, 0], g[0, :, 0],
                             0.25, False, C=64)
    assert reference.relative_error(S_new, S_ref[0, 0]) <= 1e-12
    assert reference.relative_error(o, o_ref[0, :, 0]) <= 1e-12


def test_a_dropped_coupling_is_caught():
    """Without the intra-chunk coupling L the result is far off: the comparison above can fail."""
    q, k, v, p, beta, g, S = forward_inputs(1, 8, 1, 16, 12, seed=1, dtype=F64, g_dtype=F64, xp=numpy, warm_steps=3)
    S_ref, _ = reference.comba_loop(S, q, k, v, p, beta, g, 0.25)
    args = (S[0, 0], q[0, :, 0], k[0, :, 0], v[0, :, 0], p[0, :, 0], beta[0, :, 0], numpy.exp(g)[0, :, 0], 0.25, False)
    assert reference.relative_error(chunk_forward(*args)[1], S_ref[0, 0]) <= 1e-12
    assert reference.relative_error(chunk_forward(*args, couple=False)[1], S_ref[0, 0]) > 1e-3
