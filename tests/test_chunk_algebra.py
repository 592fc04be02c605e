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


def _segments_model(K, V, C, chunks, seed, decay):
    """One head of Gated DeltaNet as prefill_prep<K, 6> / prefill_scan_wt form it, chunk by chunk:
    ``step(X, c, v_cols, rnd)`` applies chunk c's map X -> G_63 X + Kc^T diag(w) A (Vc - diag(G fp) Kc X) to the
    columns of X (Vc in the first ``v_cols``, zero in the rest), with ``rnd`` the rounding of the bf16 operands (A,
    v, X, Y = Vc - diag(G fp) Kc X and diag(w) U) or none; the initial state and the exact token recurrence's final
    state."""
    import ml_dtypes
    rng = numpy.random.default_rng(seed)
    T = C * chunks
    k = rng.standard_normal((T, K))
    k /= numpy.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((T, V))
    beta = 1 / (1 + numpy.exp(-rng.random(T)))
    g = -numpy.log1p(numpy.exp(-rng.standard_normal(T))) / 4 * decay
    S0 = rng.standard_normal((K, V)) / 8
    S = S0.copy()
    for t in range(T):
        S = numpy.exp(g[t]) * S
        S = S + beta[t] * numpy.outer(k[t], v[t] - k[t] @ S)
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(F64)  # noqa: E731

    def coefficients(c):
        sl = slice(c * C, (c + 1) * C)
        cum = numpy.cumsum(g[sl])
        r = numpy.exp(cum[None, :] - cum[:, None])  # r[j][t]: the decay from token j to token t
        L = numpy.tril(beta[sl, None] * (k[sl] @ k[sl].T) * r.T, -1)
        A = numpy.linalg.solve(numpy.eye(C) + L, numpy.diag(beta[sl]))
        return k[sl], A, numpy.exp(cum), v[sl], r[:, -1], numpy.exp(cum[-1])

    chunk = [coefficients(c) for c in range(chunks)]

    def step(X, c, v_cols, rnd):
        kc, A, gp, vc, w, G = chunk[c]
        vc = numpy.concatenate([vc[:, :v_cols], numpy.zeros((C, X.shape[1] - v_cols))], 1)
        Y = rnd(rnd(vc) - gp[:, None] * (rnd(kc) @ rnd(X)))
        return G * X + rnd(kc).T @ rnd(w[:, None] * (rnd(A) @ Y))

    return step, S0, S, bf16


@pytest.mark.parametrize("decay", [1.0, 0.01], ids=["fast", "slow"])
def test_segments_compose_to_the_whole_scan(decay):
    """kernels_cu/prefill_transposed.cu, "Segments": each segment's map [E | M], the chunks' recurrence over V + K
    columns from [0 | I] with Vc = 0 in M's columns, composed as S <- E_j + M_j S, gives the state of the whole
    chunk recurrence (float64: to rounding), and with the kernels' bf16 operands -- M_j and the state rounded for
    the composition too -- an error against the token recurrence within a few percent of the whole scan's, also
    where the gates decay slowly (a 1/e memory of ~500 tokens) and each segment's start depends on the ones
    before it."""
    K = V = 32
    chunks, per = 10, 3  # segments of 3, 3, 3 and 1 chunks
    step, S0, S_exact, bf16 = _segments_model(K, V, 16, chunks, 4, decay)
    for rnd in (lambda x: x, bf16):
        whole = S0
        for c in range(chunks):
            whole = step(whole, c, V, rnd)
        S = S0
        for j in range(0, chunks, per):
            if j + per < chunks:
                X = numpy.concatenate([numpy.zeros((K, V)), numpy.eye(K)], 1)
                for c in range(j, j + per):
                    X = step(X, c, V, rnd)
                S = X[:, :V] + rnd(X[:, V:]) @ rnd(S)
            else:
                for c in range(j, chunks):
                    S = step(S, c, V, rnd)
        if rnd is bf16:
            err_whole, err = (reference.relative_error(x, S_exact) for x in (whole, S))
            assert 1e-4 < err_whole and err <= 1.1 * err_whole
        else:
            assert reference.relative_error(S, whole) <= 1e-12
            assert reference.relative_error(whole, S_exact) <= 1e-12


def _ragged_numbers(cu, total, per):
    """kernels_cu/prefill_transposed.cu's bookkeeping of a ragged batch's segments, as its kernels form it from
    cu_seqlens (bounds clamped to 0 .. total, an upper one to its lower one): each sequence's first record, chunks
    and segments, and segment_row -- the sequence and segment of a number, by bisection."""
    N = len(cu) - 1
    start = [min(max(int(a), 0), total) for a in cu[:-1]]
    end = [min(max(int(z), s), total) for z, s in zip(cu[1:], start)]
    first = [s // 64 + n for n, s in enumerate(start)]
    chunks = [-(-(z - s) // 64) for s, z in zip(start, end)]
    segs = [max(1, -(-c // per)) for c in chunks]

    def segment_row(number):
        lo, hi = 0, N - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if first[mid] // per + mid <= number:
                lo = mid
            else:
                hi = mid - 1
        return lo, number - (first[lo] // per + lo)

    return first, chunks, segs, segment_row


@pytest.mark.parametrize("per", [1, 2, 3, 16])
def test_a_ragged_batch_numbers_each_segment_once(per):
    """The segmented scan's packed numbering: over sequences of 0-1000 tokens every segment j of sequence n has a
    number of its own, below the count families.Kernel.segment_grids sizes the grids by, from which segment_row
    finds (n, j) again; every other number names no segment; a segment's map, stored at its number, lies among the
    chain's (all numbers but the highest) unless it is its sequence's last.  Bounds that are not increasing keep
    every index inside the arrays: a CTA's sequence is one of the N, its records below the workspace's and the
    maps it reads below its own number."""
    from cupy_comba import families
    kernel = families.kernel("kv", "kv64c64sg", K=128, separate_p=True, multi=True, precision="bf16")
    rng = numpy.random.default_rng(per)
    for trial in range(40):
        N = int(rng.integers(1, 9))
        lengths = rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 500, 1000], N)
        cu = numpy.concatenate([[0], numpy.cumsum(lengths)])
        total = int(cu[-1])
        chain, grid, maps = kernel.segment_grids(N, total, 1, 128, 128, 0, per, True)
        numbers = grid[0] // 2  # two 64-column slabs a number
        assert maps == numbers - 1 and chain[0] == maps * 4  # the chain's CTAs cover V + K = 256 columns
        first, chunks, segs, segment_row = _ragged_numbers(cu, total, per)
        owned = {}
        for n in range(N):
            for j in range(segs[n]):
                number = first[n] // per + n + j
                assert number not in owned and 0 <= number < numbers
                owned[number] = (n, j)
                assert j == segs[n] - 1 or number < maps
        for number in range(numbers):
            n, j = segment_row(number)
            assert owned.get(number) == ((n, j) if 0 <= j < segs[n] else None)
        hostile = rng.integers(-2 * total - 5, 2 * total + 5, N + 1)
        first, chunks, segs, segment_row = _ragged_numbers(hostile, total, per)
        for number in range(numbers):
            n, j = segment_row(number)
            assert 0 <= n < N
            if 0 <= j < segs[n]:
                assert first[n] + chunks[n] <= families.prefill_slots(N, total, True)
                assert 0 <= number - j <= number
