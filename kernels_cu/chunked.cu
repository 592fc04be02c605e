// chunked.cu -- T-token passes of the gated delta rule over the state in chunks of kChunk = 4
// tokens: one pass over the register-held state serves four tokens.  The state is read once,
// stays in registers across the T tokens and is written once, as in token_loop.cu (whose header
// gives the token recurrence, the layouts and the l2norm factors).
//
// Launch geometry (cupy_comba/families.py builds the grid, block and name of each variant):
// delta_rule_kv_chunked<K, COLS, RG, SEPARATE_P> -- the tiling of delta_rule_kv: one CTA per (b, h,
//   slab of COLS columns), (COLS/4) x RG threads (KvSlab, kv_slab.cuh).
// delta_rule_vk_chunked<K, ROWS, SEPARATE_P> -- a "vk" state, built for K = 128: one CTA per (b, h,
//   slab of ROWS rows of V), ROWS / 16 warps, 8 lanes a row.
// Each kernel's section below gives its math and staging.
#include "common.cuh"
#include "params.cuh"
#include "kv_slab.cuh"

namespace comba {

// T-token passes over a "kv" state, a chunk of kChunk tokens per pass over the state.
//
// Within a chunk of c tokens from the state S0 (t = 0 .. c-1; G_t = e_0 ... e_t; r(j, t) =
// e_{j+1} ... e_t, r(t, t) = 1; ^ marks the L2-normalised vectors, the raw ones without the option):
//
//   u_t = beta_t (v_t - G_t S0^T p^_t - sum_{j<t} r(j, t) (k^_j . p^_t) u_j)
//   o_t = scale (G_t S0^T q^_t + sum_{j<=t} r(j, t) (k^_j . q^_t) u_j)
//   S   = G_{c-1} S0 + sum_j r(j, c-1) k^_j u_j^T
//
// -- the token recurrence unrolled over the chunk, exact algebra.  One pass over the register-
// held state gives all 2c K-reductions (S0^T p_t, S0^T q_t) at once; the u_t then follow from a
// c x c triangular substitution that needs only the dot products k_j . p_t and k_j . q_t of the
// staged vectors; one pass writes the state.  Per state element and token that is 2 FMAs in the
// pass and 1 + 1/c in the write (the token loop spends 2 + 2), and two barriers per chunk instead
// of two per token.  No division anywhere: a gate of 0 or a tiny one is exact.
//
// delta_rule_kv_chunked<K, COLS, RG, SEPARATE_P>: the tiling of delta_rule_kv.  Staging: thread j
// holds element j of the chunk's q, k, p (all c tokens, one float4 per vector in shared memory),
// the threads below COLS the slab of v, the first 2 kChunk threads beta and g; the dot products
// (32 slots, dot_slot below) are summed per warp by a transposing butterfly and over the warps
// through shared memory.
constexpr int kChunk = 4;

// Slots of the chunk's dot products: k_j.q_t (j <= t), k_j.p_t (j < t), |q_t|^2, |k_t|^2, |p_t|^2.
__host__ __device__ constexpr int kq_slot(int j, int t) { return t * (t + 1) / 2 + j; }       // 0 .. 9
__host__ __device__ constexpr int kp_slot(int j, int t) { return 10 + t * (t - 1) / 2 + j; }  // 10 .. 15
__host__ __device__ constexpr int nq_slot(int t) { return 16 + t; }
__host__ __device__ constexpr int nk_slot(int t) { return 20 + t; }
__host__ __device__ constexpr int np_slot(int t) { return 24 + t; }

// Component t of a float4 (t a compile-time constant after unrolling: no local memory).
__device__ __forceinline__ float component(const float4& a, int t) {
    return t == 0 ? a.x : t == 1 ? a.y : t == 2 ? a.z : a.w;
}
__device__ __forceinline__ void set_component(float4& a, int t, float x) {
    if (t == 0) a.x = x; else if (t == 1) a.y = x; else if (t == 2) a.z = x; else a.w = x;
}

// One staged row's share of the chunk's dot products: x[slot] += the row's term of slot's product
// (kq_slot, kp_slot, nq_slot, ... above), for a butterfly to sum over the rows afterwards.
__device__ __forceinline__ void add_chunk_dots(float (&x)[32], const float (&xq)[kChunk], const float (&xk)[kChunk],
                                               const float (&xp)[kChunk]) {
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
#pragma unroll
        for (int i = 0; i <= t; ++i) x[kq_slot(i, t)] = fmaf(xk[i], xq[t], x[kq_slot(i, t)]);
#pragma unroll
        for (int i = 0; i < t; ++i) x[kp_slot(i, t)] = fmaf(xk[i], xp[t], x[kp_slot(i, t)]);
        x[nq_slot(t)] = fmaf(xq[t], xq[t], x[nq_slot(t)]);
        x[nk_slot(t)] = fmaf(xk[t], xk[t], x[nk_slot(t)]);
        x[np_slot(t)] = fmaf(xp[t], xp[t], x[np_slot(t)]);
    }
}

// Raw bits of one chunk's q, k and p that thread `tid` of NT stages: elements tid, tid + NT, ...
// of each of the kChunk tokens (0 for tokens past the end, `c` = tokens present, and for rows
// past K).  `issue` puts every load in flight and waits for none; `stage` is the first use.
template <int K, int NT, bool SEPARATE_P>
struct ChunkBits {
    static constexpr int E = (K + NT - 1) / NT, C = kChunk;
    unsigned q[E][C], k[E][C], p[E][C];

    __device__ __forceinline__ void issue(const void* qa, const void* ka, const void* pa, const Params& prm, int tid,
                                          int b, int hk, int t0, int c) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int j = tid + e * NT;
#pragma unroll
            for (int t = 0; t < C; ++t) {
                q[e][t] = k[e][t] = p[e][t] = 0;
                if (t < c && (K % NT == 0 || j < K)) {
                    const long long tt = t0 + t;
                    q[e][t] = load_bits(qa, b * prm.q_sb + tt * prm.q_st + hk * prm.q_sh + j * prm.q_sk, prm.q_t);
                    k[e][t] = load_bits(ka, b * prm.k_sb + tt * prm.k_st + hk * prm.k_sh + j * prm.k_sk, prm.k_t);
                    if (SEPARATE_P)
                        p[e][t] = load_bits(pa, b * prm.p_sb + tt * prm.p_st + hk * prm.p_sh + j * prm.p_sk, prm.p_t);
                }
            }
        }
    }

    // This thread's rows j = tid, tid + NT, ... of the chunk's q, k and p (p = k for Gated
    // DeltaNet), converted and staged as q4[at(j)], k4[at(j)], p4[at(j)] (component t: token t);
    // then on_row(xq, xk, xp) with the row's values, for the caller's per-row work.
    template <class At, class F>
    __device__ __forceinline__ void stage(int tid, const Params& prm, float4* q4, float4* k4, float4* p4, At&& at,
                                          F&& on_row) const {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int j = tid + e * NT;
            if (K % NT == 0 || j < K) {
                float xq[C], xk[C], xp[C];
#pragma unroll
                for (int t = 0; t < C; ++t) {
                    xq[t] = bits_to_float(q[e][t], prm.q_t);
                    xk[t] = bits_to_float(k[e][t], prm.k_t);
                    xp[t] = SEPARATE_P ? bits_to_float(p[e][t], prm.p_t) : xk[t];
                }
                q4[at(j)] = make_float4(xq[0], xq[1], xq[2], xq[3]);
                k4[at(j)] = make_float4(xk[0], xk[1], xk[2], xk[3]);
                p4[at(j)] = make_float4(xp[0], xp[1], xp[2], xp[3]);
                on_row(xq, xk, xp);
            }
        }
    }
};

// The per-token factors of a chunk: the L2-norm factors fq, fk, fp of q, k and p (1 without
// the option; fp = fk for Gated DeltaNet) from the staged squared norms, and the decays e_t.
template <bool SEPARATE_P>
struct ChunkFactors {
    float fq[kChunk], fk[kChunk], fp[kChunk], e[kChunk];
    __device__ __forceinline__ ChunkFactors(const float* dsum, const float* staged_e, const Params& prm) {
#pragma unroll
        for (int t = 0; t < kChunk; ++t) {
            fq[t] = fk[t] = fp[t] = 1.f;
            if (prm.l2norm) {
                fq[t] = rsqrtf(dsum[nq_slot(t)] + kL2NormEps);
                fk[t] = rsqrtf(dsum[nk_slot(t)] + kL2NormEps);
                fp[t] = SEPARATE_P ? rsqrtf(dsum[np_slot(t)] + kL2NormEps) : fk[t];
            }
            e[t] = staged_e[t];
        }
    }
};

// The chunk's triangular substitution for NC state columns (kv: a thread's four; vk: a lane's
// one row of V): from token t's raw K-reductions P = S0^T p_t, Q = S0^T q_t (`sums(t, P, Q)`,
// asked for once per token, in order, so a caller can add them up where they are used), its v
// (`values(t, v)`), beta_t and the dot products, u_t and o_t / scale, handed to `out(t, o)`;
// then the write's coefficients w[j] = r(j, c-1) fk_j u_j.  Returns G_{c-1}, the decay of S0
// over the chunk.  Every caller adds in the same order, so all rows of a column apply the
// identical u.
template <int NC, bool SEPARATE_P, class Sums, class Values, class Out>
__device__ __forceinline__ float chunk_solve(const ChunkFactors<SEPARATE_P>& f, const float* dsum,
                                             const float* beta, int c, float (&w)[kChunk][NC], Sums&& sums,
                                             Values&& values, Out&& out) {
    constexpr int C = kChunk;
    const float (&fq)[C] = f.fq, (&fk)[C] = f.fk, (&fp)[C] = f.fp, (&e)[C] = f.e;
    float u[C][NC];
    float G = 1.f;  // G_t
#pragma unroll
    for (int t = 0; t < C; ++t) {
#pragma unroll
        for (int cc = 0; cc < NC; ++cc) u[t][cc] = 0.f;
        if (t < c) {
            G *= e[t];
            float P[NC], Q[NC], vv[NC];
            sums(t, P, Q);
            values(t, vv);
            const float bt = beta[t];
            float a[NC], y[NC];
#pragma unroll
            for (int cc = 0; cc < NC; ++cc) {
                a[cc] = G * fp[t] * P[cc];
                y[cc] = G * fq[t] * Q[cc];
            }
            float rr = 1.f;  // r(j, t)
#pragma unroll
            for (int j = t - 1; j >= 0; --j) {
                rr *= e[j + 1];
                const float cp = rr * fk[j] * fp[t] * dsum[kp_slot(j, t)];
                const float cq = rr * fk[j] * fq[t] * dsum[kq_slot(j, t)];
#pragma unroll
                for (int cc = 0; cc < NC; ++cc) {
                    a[cc] = fmaf(cp, u[j][cc], a[cc]);
                    y[cc] = fmaf(cq, u[j][cc], y[cc]);
                }
            }
#pragma unroll
            for (int cc = 0; cc < NC; ++cc) u[t][cc] = bt * (vv[cc] - a[cc]);
            const float cqt = fk[t] * fq[t] * dsum[kq_slot(t, t)];  // r(t, t) = 1
#pragma unroll
            for (int cc = 0; cc < NC; ++cc) y[cc] = fmaf(cqt, u[t][cc], y[cc]);
            out(t, y);
        }
    }
    float rr = 1.f;  // r(j, c-1), built from the last token down
#pragma unroll
    for (int j = C - 1; j >= 0; --j) {
#pragma unroll
        for (int cc = 0; cc < NC; ++cc) w[j][cc] = 0.f;
        if (j < c) {
#pragma unroll
            for (int cc = 0; cc < NC; ++cc) w[j][cc] = rr * fk[j] * u[j][cc];
            rr *= e[j];
        }
    }
    return rr;
}

template <int K, int COLS, int NW>
struct ChunkStage {
    float4 p[K], q[K], k[K];      // row i: component t is token t's p[i], q[i], k[i]
    float4 v[kChunk][COLS / 4];   // v of the slab, per token
    float dots[NW][32];           // per-warp partial dot products
    float dsum[32];               // the same summed over the CTA
    float e[kChunk], beta[kChunk];
};

// Every load of one chunk of a CTA's slab, as raw bits (0 for absent tokens): q, k, p (ChunkBits),
// the NV values of v from v0 on (threads below NV) and beta, g.  `stage` converts them into the
// double-buffered ChunkStage -- key j of q, k, p at at(j) -- and leaves this warp's sum of each
// dot-product slot in st.dots[warp]; a barrier publishes all of it.
template <int K, int NT, int NV, bool SEPARATE_P>
struct ChunkLoads {
    ChunkBits<K, NT, SEPARATE_P> bits;
    unsigned v[kChunk], gates;

    __device__ __forceinline__ void issue(const void* qa, const void* ka, const void* va, const void* pa,
                                          const void* beta, const void* g, const Params& prm, int tid, int b, int h,
                                          int hk, int v0, int t0, int c) {
        bits.issue(qa, ka, pa, prm, tid, b, hk, t0, c);
#pragma unroll
        for (int t = 0; t < kChunk; ++t) {
            v[t] = 0;
            if (tid < NV && t < c)
                v[t] = load_bits(va, b * prm.v_sb + (t0 + t) * prm.v_st + h * prm.v_sh + (v0 + tid) * prm.v_sv,
                                 prm.v_t);
        }
        gates = issue_chunk_gates<kChunk>(beta, g, prm, tid, b, h, t0, c);
    }

    template <class Stage, bool SERVING, class At>
    __device__ __forceinline__ void stage(Stage& st, const Params& prm, int tid, int warp, int lane, int c,
                                          HeadGating<SERVING> hg, At&& at) const {
        float x[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) x[i] = 0.f;
        bits.stage(tid, prm, st.q, st.k, st.p, at,
                   [&](const float (&xq)[kChunk], const float (&xk)[kChunk], const float (&xp)[kChunk]) {
                       add_chunk_dots(x, xq, xk, xp);
                   });
#pragma unroll
        for (int t = 0; t < kChunk; ++t)
            if (tid < NV) reinterpret_cast<float*>(st.v[t])[tid] = bits_to_float(v[t], prm.v_t);
        stage_chunk_gates<kChunk>(st.e, st.beta, gates, prm, tid, c, hg);
        butterfly<16>(x, lane);  // lane i ends with this warp's sum of slot i
        st.dots[warp][lane] = x[0];
    }
};

// CTAs an SM, as many as the registers allow without spilling (left free, ptxas takes 220-250 a
// thread): four 128-thread CTAs (128 registers) for Gated DeltaNet over 64-column slabs, which sum
// each token's column sums where they are used (LAZY below); three for Comba, whose p adds to the
// staging; six 64-thread CTAs (168 registers) for 32-column slabs.  (Summed lazily, the 32-column
// slabs spill at 168 registers and ran 1.15-1.2x slower at 255, four CTAs an SM.)
template <int K, int COLS, int RG, bool SEPARATE_P, bool SERVING>
__global__ void __launch_bounds__(COLS / 4 * RG, COLS == 64 && !SEPARATE_P ? 4 : 384 / (COLS / 4 * RG))
delta_rule_kv_chunked(COMBA_KERNEL_ARGS) {
    constexpr int LC = COLS / 4, NT = LC * RG, R = K / RG, NW = NT / 32, C = kChunk;
    static_assert(NT % 32 == 0 && K % RG == 0 && COLS <= NT && 2 * C <= NT, "bad kv tiling");
    __shared__ ChunkStage<K, COLS, NW> stage[2];
    __shared__ float4 red[NW][2 * C][LC];  // per-warp partial S0^T p_t, S0^T q_t

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const KvSlab<K, COLS, RG, SERVING> slab(prm, tid, slots, accepted);
    const int lc = slab.lc, rg = slab.rg, b = slab.b, h = slab.h, hk = slab.hk, col0 = slab.col0, col = slab.col;
    const int T = tokens<SERVING>(cu_seqlens, prm, b, q, k, v, p, beta, g, o);
    if (SERVING && slab.slot < 0) {  // a padding row
        zero_o(o, prm, b, h, col0, COLS, T, tid, NT);
        return;
    }
    const HeadGating gating = head_gating<SERVING>(A_log, dt_bias, h);

    float4 s[R];
    slab.load(s, state, prm.has_initial);

    for (int t0 = 0, n = 0; t0 < T; t0 += C, ++n) {
        ChunkStage<K, COLS, NW>& st = stage[n & 1];
        const int c = min(C, T - t0);
        // 1. Every load of the chunk in flight before any is used.
        ChunkLoads<K, NT, COLS, SEPARATE_P> loads;
        loads.issue(q, k, v, p, beta, g, prm, tid, b, h, hk, col0, t0, c);
        // 2. Stage the chunk; this thread's share of the 28 dot products on the way.
        loads.stage(st, prm, tid, warp, lane, c, gating, [](int j) { return j; });
        __syncthreads();
        if (warp == 0) {
            float sum = st.dots[0][lane];
#pragma unroll
            for (int w = 1; w < NW; ++w) sum += st.dots[w][lane];
            st.dsum[lane] = sum;  // read after the next barrier
        }

        // 3. One pass: S0^T p_t and S0^T q_t for the whole chunk.
        float P[C][4], Q[C][4];
#pragma unroll
        for (int t = 0; t < C; ++t)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) P[t][cc] = Q[t][cc] = 0.f;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int r = rg + i * RG;
            const float4 pp = st.p[r], qq = st.q[r];
#pragma unroll
            for (int t = 0; t < C; ++t) accumulate_pq(s[i], component(pp, t), component(qq, t), P[t], Q[t]);
        }
#pragma unroll
        for (int t = 0; t < C; ++t) {
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
                P[t][cc] = lane_sum(P[t][cc], LC, 16);
                Q[t][cc] = lane_sum(Q[t][cc], LC, 16);
            }
            if (lane < LC) {
                red[warp][t][lc] = make_float4(P[t][0], P[t][1], P[t][2], P[t][3]);
                red[warp][C + t][lc] = make_float4(Q[t][0], Q[t][1], Q[t][2], Q[t][3]);
            }
        }
        __syncthreads();

        // 4. Every thread: the chunk's u_t and o_t for its four columns (chunk_solve).
        //    Token t's column sums, summed over the warps where the solve uses them (LAZY), so that
        //    the chunk's eight float4 are never live at once; the 32-column slabs sum them all first,
        //    which their register budget holds without spilling (the launch bounds above).
        constexpr bool LAZY = COLS == 64;
        auto column_sums = [&](int t, float4& Pt, float4& Qt) {
            Pt = red[0][t][lc];
            Qt = red[0][C + t][lc];
#pragma unroll
            for (int w = 1; w < NW; ++w) {
                const float4 a = red[w][t][lc], z = red[w][C + t][lc];
                Pt.x += a.x; Pt.y += a.y; Pt.z += a.z; Pt.w += a.w;
                Qt.x += z.x; Qt.y += z.y; Qt.z += z.z; Qt.w += z.w;
            }
        };
        float4 Ps[LAZY ? 1 : C], Qs[LAZY ? 1 : C];
        if constexpr (!LAZY) {
#pragma unroll
            for (int t = 0; t < C; ++t) column_sums(t, Ps[t], Qs[t]);
        }
        const ChunkFactors<SEPARATE_P> f(st.dsum, st.e, prm);
        const long long ob = b * prm.o_sb + h * prm.o_sh;
        float w[C][4];
        const float rr = chunk_solve<4, SEPARATE_P>(
            f, st.dsum, st.beta, c, w,
            [&](int t, float (&P)[4], float (&Q)[4]) {
                float4 Pt, Qt;
                if constexpr (LAZY) {
                    column_sums(t, Pt, Qt);
                } else {
                    Pt = Ps[t];
                    Qt = Qs[t];
                }
                P[0] = Pt.x; P[1] = Pt.y; P[2] = Pt.z; P[3] = Pt.w;
                Q[0] = Qt.x; Q[1] = Qt.y; Q[2] = Qt.z; Q[3] = Qt.w;
            },
            [&](int t, float (&vv)[4]) {
                const float4 vt = st.v[t][lc];
                vv[0] = vt.x; vv[1] = vt.y; vv[2] = vt.z; vv[3] = vt.w;
            },
            [&](int t, const float (&ot)[4]) {
                if (rg == 0) {
#pragma unroll
                    for (int cc = 0; cc < 4; ++cc)
                        store_act(o, ob + (t0 + t) * prm.o_st + (col + cc) * prm.o_sv, prm.o_t, scale * ot[cc]);
                }
            });

        // 5. The write: S = G_{c-1} S0 + sum_j r(j, c-1) k^_j u_j^T, in registers.
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float4 kk = st.k[rg + i * RG];
            float4 x4 = make_float4(rr * s[i].x, rr * s[i].y, rr * s[i].z, rr * s[i].w);
#pragma unroll
            for (int j = 0; j < C; ++j) {
                const float kj = component(kk, j);
                x4.x = fmaf(kj, w[j][0], x4.x);
                x4.y = fmaf(kj, w[j][1], x4.y);
                x4.z = fmaf(kj, w[j][2], x4.z);
                x4.w = fmaf(kj, w[j][3], x4.w);
            }
            s[i] = x4;
        }
    }

    if (prm.write_final) slab.store(s, state_out, slots, prm);
}


// ---------------------------------------------------------------------------------------------
// delta_rule_vk_chunked<K, ROWS, SEPARATE_P>: the chunk algebra above over a "vk" state ([V, K],
// K contiguous), built for K = 128.  A CTA is a slab of ROWS rows of V of one head, NW = ROWS / 16
// warps.  The 8 lanes kl of a row group (rgp = lane / 8, four a warp) hold, in each of their
// RL = 4 rows, the float4 of keys 32 m + 4 kl (m < 4): 64 state registers, and a warp-wide load
// covers the 128 contiguous bytes of one key quarter of four rows.  The pass sums 16 keys in the
// thread; each row's 2 kChunk sums then meet over its 8 lanes in a transposing butterfly (7
// shuffles), after which lane kl holds sum kl of every row of its group (S0^T p_kl for kl < 4, else
// S0^T q_{kl-4}).  Through the warp's scratch in shared memory lane kl < RL solves row kl of its
// group (chunk_solve, one column) and publishes the row's write coefficients, which the other lanes
// read back for the write.  A row never needs another warp: besides __syncwarp, one barrier per
// chunk (publishing the staged activations, double-buffered) is all the CTA waits for.
//
// Staging: the chunk's q, k and p as in delta_rule_kv_chunked (a float4 of the 4 tokens per key),
// key 32 m + 4 kl + i stored at 32 m + 8 i + kl, so that the 8 lanes of a row group read 8
// consecutive float4 (one wavefront; four row groups read the same ones).
struct VkChunkScratch {
    static constexpr int RL = 4;
    float sums[4][RL * 8 + 8];  // [rgp][row * 8 + sum], padded: the four row groups write distinct banks
    float4 w[4][RL];            // the write's coefficients w_0 .. w_3 of each row
    float dsum[32];             // the chunk's dot products, summed over the warps
};

__device__ __forceinline__ int vk_chunk_slot(int key) { return (key & ~31) | ((key & 3) << 3) | ((key >> 2) & 7); }

template <int K, int ROWS, bool SEPARATE_P, bool SERVING>
__global__ void __launch_bounds__(ROWS * 2, ROWS == 64 && !SEPARATE_P ? 4 : 384 / (ROWS * 2))
delta_rule_vk_chunked(COMBA_KERNEL_ARGS) {
    constexpr int NW = ROWS / 16, NT = NW * 32, RL = 4, KF = 4, C = kChunk;
    static_assert(K == 128 && ROWS % 16 == 0 && 2 * C <= NT && ROWS <= NT, "bad vk chunked tiling");
    __shared__ ChunkStage<K, ROWS, NW> stage[2];
    __shared__ VkChunkScratch scratch[NW];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, kl = lane & 7, rgp = lane >> 3;
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    const int slabs = V / ROWS;
    const int bh = static_cast<int>(blockIdx.x) / slabs;
    const int slab0 = (static_cast<int>(blockIdx.x) - bh * slabs) * ROWS;
    const int b = bh / H, h = bh - b * H, hk = h / static_cast<int>(prm.group);
    const int T = tokens<SERVING>(cu_seqlens, prm, b, q, k, v, p, beta, g, o);
    const long long slot = state_slot<SERVING>(slots, prm, b);
    if (SERVING && slot < 0) {  // a padding row
        zero_o(o, prm, b, h, slab0, ROWS, T, tid, NT);
        return;
    }
    const HeadGating gating = head_gating<SERVING>(A_log, dt_bias, h);
    VkChunkScratch& sc = scratch[warp];
    // Row i of this lane within the slab; float4 m of it holds keys 32 m + 4 kl .. + 3.
    auto row = [&](int i) { return warp * 16 + i * 4 + rgp; };
    const long long head = (SERVING ? slot * H + h : static_cast<long long>(bh)) * V * K +
                           static_cast<long long>(slab0) * K + 4 * kl;

    float4 s[RL][KF];
    if (prm.has_initial) {
        const float* src = state + head;
#pragma unroll
        for (int i = 0; i < RL; ++i)
#pragma unroll
            for (int m = 0; m < KF; ++m) s[i][m] = load_state(src + row(i) * K + 32 * m);
    } else {
#pragma unroll
        for (int i = 0; i < RL; ++i)
#pragma unroll
            for (int m = 0; m < KF; ++m) s[i][m] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    for (int t0 = 0, n = 0; t0 < T; t0 += C, ++n) {
        ChunkStage<K, ROWS, NW>& st = stage[n & 1];
        const int c = min(C, T - t0);
        // 1. Every load of the chunk in flight before any is used.
        ChunkLoads<K, NT, ROWS, SEPARATE_P> loads;
        loads.issue(q, k, v, p, beta, g, prm, tid, b, h, hk, slab0, t0, c);
        // 2. Stage the chunk (keys at vk_chunk_slot); this thread's share of the dot products on the way.
        loads.stage(st, prm, tid, warp, lane, c, gating, vk_chunk_slot);
        __syncthreads();
        {
            float sum = st.dots[0][lane];
#pragma unroll
            for (int w = 1; w < NW; ++w) sum += st.dots[w][lane];
            sc.dsum[lane] = sum;  // every warp its own copy: no second barrier
        }

        // 3. One pass: this thread's 16 keys of S0^T p_t and S0^T q_t for each of its rows, then the
        //    row group's butterflies.
        float P[RL][C], Q[RL][C];
#pragma unroll
        for (int i = 0; i < RL; ++i)
#pragma unroll
            for (int t = 0; t < C; ++t) P[i][t] = Q[i][t] = 0.f;
#pragma unroll
        for (int m = 0; m < KF; ++m) {
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
                const int at = 32 * m + 8 * cc + kl;  // vk_chunk_slot(32 m + 4 kl + cc)
                const float4 pp = st.p[at], qq = st.q[at];
#pragma unroll
                for (int i = 0; i < RL; ++i) {
                    const float x1 = component(s[i][m], cc);
#pragma unroll
                    for (int t = 0; t < C; ++t) {
                        P[i][t] = fmaf(x1, component(pp, t), P[i][t]);
                        Q[i][t] = fmaf(x1, component(qq, t), Q[i][t]);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < RL; ++i) {
            float y[2 * C];
#pragma unroll
            for (int t = 0; t < C; ++t) {
                y[t] = P[i][t];
                y[C + t] = Q[i][t];
            }
            butterfly<4>(y, kl);  // lane kl: sum kl of row i
            sc.sums[rgp][i * 8 + kl] = y[0];
        }
        __syncwarp();

        // 4. Lane kl < RL of a row group: u_t and o_t of row kl of the group (chunk_solve).
        if (kl < RL) {
            const int r = row(kl);
            const ChunkFactors<SEPARATE_P> f(sc.dsum, st.e, prm);
            const long long ob = b * prm.o_sb + h * prm.o_sh + (slab0 + r) * prm.o_sv;
            float w[C][1];
            chunk_solve<1, SEPARATE_P>(
                f, sc.dsum, st.beta, c, w,
                [&](int t, float (&Pt)[1], float (&Qt)[1]) {
                    Pt[0] = sc.sums[rgp][kl * 8 + t];
                    Qt[0] = sc.sums[rgp][kl * 8 + C + t];
                },
                [&](int t, float (&vv)[1]) { vv[0] = reinterpret_cast<const float*>(st.v[t])[r]; },
                [&](int t, const float (&ot)[1]) { store_act(o, ob + (t0 + t) * prm.o_st, prm.o_t, scale * ot[0]); });
            sc.w[rgp][kl] = make_float4(w[0][0], w[1][0], w[2][0], w[3][0]);
        }
        __syncwarp();

        // 5. The write: S = G_{c-1} S0 + sum_j r(j, c-1) k^_j u_j^T, in registers.
        float G = 1.f;  // G_{c-1}, multiplied in chunk_solve's order
#pragma unroll
        for (int j = C - 1; j >= 0; --j)
            if (j < c) G *= st.e[j];
        float4 wr[RL];
#pragma unroll
        for (int i = 0; i < RL; ++i) wr[i] = sc.w[rgp][i];
#pragma unroll
        for (int m = 0; m < KF; ++m) {
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
                const float4 kk = st.k[32 * m + 8 * cc + kl];
#pragma unroll
                for (int i = 0; i < RL; ++i) {
                    float x1 = G * component(s[i][m], cc);
                    x1 = fmaf(kk.x, wr[i].x, x1);
                    x1 = fmaf(kk.y, wr[i].y, x1);
                    x1 = fmaf(kk.z, wr[i].z, x1);
                    x1 = fmaf(kk.w, wr[i].w, x1);
                    set_component(s[i][m], cc, x1);
                }
            }
        }
    }

    if (prm.write_final) {
        float* dst = state_out + (SERVING ? pool_head<K>(slots, prm, b, h) + slab0 * K + 4 * kl : head);
#pragma unroll
        for (int i = 0; i < RL; ++i)
#pragma unroll
            for (int m = 0; m < KF; ++m) store_state(dst + row(i) * K + 32 * m, s[i][m]);
    }
}

}  // namespace comba
