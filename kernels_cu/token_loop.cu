// token_loop.cu -- T >= 1 tokens of the gated delta rule (Comba, or Gated DeltaNet when p = k) for a
// whole batch in one launch, one token at a time: the fp32 state is read once, stays in registers
// across the T tokens, o is written per token and the final state once.
//
// Math per (b, h) and token, with S = state[b, h] (K x V) and gate e = exp(g) ("log") or g
// ("linear"):
//
//   u[j]       = beta * (v[j] - e * sum_i p[i] S[i,j])        correction read with p
//   S_new[i,j] = e * S[i,j] + k[i] * u[j]                     rank-1 write with k
//   o[j]       = scale * sum_i q[i] S_new[i,j]
//              = scale * (e * sum_i q[i] S[i,j] + (q.k) * u[j])
//
// The second form of o lets both K-reductions (with p and with q) and q.k come from one pass over
// the state held in registers.  With use_qk_l2norm, q, k and p are divided by sqrt(sum x^2 + 1e-6);
// the kernels reduce with the raw vectors and scale the three sums (and the k of the write) by
// those factors, so the option costs no extra pass.
//
// Layouts: state and state_out C-contiguous float32, 16-byte aligned, [B, H, K, V] ("kv") or
// [B, H, V, K] ("vk", the same S stored transposed); activations as in params.cuh (any strides,
// f32 / f16 / bf16, head h reads key head h / group).
//
// Two builds of each kernel (template flag MULTI): MULTI = false is the decode step -- one token,
// from a given state, to a written state -- with no token loop at all, so it holds no registers for
// a next token; MULTI = true takes T (and whether there is an initial state and a final state to
// write) at run time, so one compiled kernel serves every T.  The decode step is also built for one
// activation dtype with unit strides along K and V (template argument ACT, params.cuh).
//
// Launch geometry (cupy_comba/families.py builds the grid, block and name of each variant):
// delta_rule_kv<K, COLS, RG, SEPARATE_P, MULTI, ACT> -- one CTA per (b, h, slab of COLS columns of V),
//   NT = (COLS/4) x RG threads.  Thread (lc, rg) owns the float4 of columns 4lc .. 4lc+3 in rows
//   rg, rg + RG, ... (R = K/RG registers; KvSlab in kv_slab.cuh); a warp-wide load covers 128/COLS
//   rows of COLS*4 contiguous bytes.  The partial column sums of the row groups of a warp meet by
//   shuffles, those of the warps in shared memory behind one barrier; every thread adds them in
//   the same order (so every row of a column applies the same u).
// delta_rule_kv_warp<K, COLS, SEPARATE_P, ACT> -- the decode step over a few heads: one warp a CTA, a grid of
//   (b, h, slab of COLS columns) so that no division finds its coordinates.  Lane (lc, rg) owns the float4 of
//   columns 4lc .. 4lc+3 in rows rg, rg + RG, ... (RG = 32 / (COLS/4), R = K/RG: 16 float4 at COLS = 16,
//   K = 128), loads the keys of its own rows and the v of its own columns itself, and every sum meets by
//   shuffles: no shared memory, no barrier -- over a few heads the step is a chain of latencies.
// delta_rule_vk<K, R, NW, SEPARATE_P, MULTI, ACT> -- one CTA per (b, h, slab of ROWS = R*NW*RPW rows of V),
//   NW warps.  A K-row is spread over LK = min(K/4, 32) lanes, C = K/(4 LK) float4 a lane (C = 2 at
//   K = 256: keys 4 kg .. 4 kg + 3 and 128 on), so a warp-wide load covers RPW = 32/LK whole rows in
//   512-byte runs; every lane owns R rows.  The per-row K-sums run as a transposing butterfly: the BW
//   = 2 HALF lanes of a butterfly reduce HALF rows x {S p, S q} in BW - 1 shuffles, each ending with
//   one finished sum.  HALF = min(LK/2, R): at K <= 128 a butterfly spans a whole row group; at
//   K = 256 (R = 8) it spans 16 lanes and one more shuffle adds the two halves of the row.  The decode
//   step over a few heads (vk4x2) takes a grid of (b, h, slab) too (Params::grid3).
//
// Tokens: the CTA stages each token's q, k, p, its slab of v, beta and g in shared memory
// (double-buffered by token parity, so one barrier per token suffices to publish them).  Every
// load of a token is issued as raw bits before any is converted (one memory latency per token,
// not one per element); with MULTI the loads of token t+1 go out right after token t is staged
// and are in flight while token t is computed.
//
// Serving builds (SERVING, params.cuh): a pool slot per row (a padding row zeroes its o and
// returns), a ragged row's tokens, in-kernel gates, and for speculative verify the state after
// every token stored as soon as it is formed (token_state) -- the token loop is the one family
// that forms each token's state.
//
// Why this shape: ~16 float4 of state in flight per thread and many small independent CTAs per
// SM, each in its own phase (loading, computing, storing), keep HBM busy in both directions; the
// state uses plain loads and stores (common.cuh says why).
#include "common.cuh"
#include "params.cuh"
#include "kv_slab.cuh"

namespace comba {

// Raw bits of the activations of one token that thread `tid` of NT stages: elements tid,
// tid + NT, ... of q, k (and p), element tid of the v slab (tid < NV), and g and beta (threads
// G_TID, G_TID + 1: the two after the v slab, whose v register is then free for them, or the
// last two when the slab takes every thread).
template <int K, int NT, int NV>
struct TokenBits {
    static_assert(NV <= NT && NT >= 2, "every v element and both gates need a staging thread");
    static constexpr int E = (K + NT - 1) / NT;
    static constexpr bool SHARED = NV + 2 <= NT;
    static constexpr int G_TID = SHARED ? NV : NT - 2;
    unsigned q[E], k[E], p[E], v, own_gate;
    __device__ __forceinline__ unsigned& gate() {
        if constexpr (SHARED) return v; else return own_gate;
    }
};

// Put every load of token t of this thread in flight; nothing here waits for memory.
template <int K, int NT, int NV, bool SEPARATE_P>
__device__ __forceinline__ void issue_token(TokenBits<K, NT, NV>& x, const void* q, const void* k, const void* v,
                                            const void* p, const void* beta, const void* g, const Params& prm,
                                            int tid, int b, int h, int hk, int v0, long long t) {
    using Bits = TokenBits<K, NT, NV>;
    const long long qo = b * prm.q_sb + t * prm.q_st + hk * prm.q_sh;
    const long long ko = b * prm.k_sb + t * prm.k_st + hk * prm.k_sh;
    const long long po = b * prm.p_sb + t * prm.p_st + hk * prm.p_sh;
#pragma unroll
    for (int e = 0; e < Bits::E; ++e) {
        const int j = tid + e * NT;
        if (K % NT == 0 || j < K) {
            x.q[e] = load_bits(q, qo + j * prm.q_sk, prm.q_t);
            x.k[e] = load_bits(k, ko + j * prm.k_sk, prm.k_t);
            if (SEPARATE_P) x.p[e] = load_bits(p, po + j * prm.p_sk, prm.p_t);
        }
    }
    if (tid < NV) x.v = load_bits(v, b * prm.v_sb + t * prm.v_st + h * prm.v_sh + (v0 + tid) * prm.v_sv, prm.v_t);
    if (tid == Bits::G_TID) x.gate() = load_bits(g, b * prm.g_sb + t * prm.g_st + h * prm.g_sh, prm.g_t);
    if (tid == Bits::G_TID + 1)
        x.gate() = load_bits(beta, b * prm.beta_sb + t * prm.beta_st + h * prm.beta_sh, prm.beta_t);
}

// The token's beta and gate factor e into gates[0], gates[1].
template <int K, int NT, int NV, bool SERVING>
__device__ __forceinline__ void stage_gates(float* gates, TokenBits<K, NT, NV>& x, const Params& prm, int tid,
                                            HeadGating<SERVING> hg) {
    using Bits = TokenBits<K, NT, NV>;
    if (tid == Bits::G_TID) gates[1] = gate_of(bits_to_float(x.gate(), prm.g_t), prm, hg);
    if (tid == Bits::G_TID + 1) gates[0] = beta_of(bits_to_float(x.gate(), prm.beta_t), prm, hg);
}

template <int K, int COLS, int NW>
struct KvStage {
    float2 pq[K];      // (p, q) of each row: one 8-byte read per row in the pass
    float kv[K];       // k of each row, for the write
    float4 dots[NW];   // per-warp partial q.k, |q|^2, |k|^2, |p|^2
    float4 v[COLS / 4];
    float gates[2];    // beta, e
};

template <int K, int ROWS, bool SEPARATE_P>
struct VkStage {
    float4 q[K / 4], k[K / 4], p[SEPARATE_P ? K / 4 : 1];
    float v[ROWS];     // v of the slab's rows
    float gates[2];    // beta, e
};

template <int K, int COLS, int RG, bool SEPARATE_P, bool MULTI, int ACT, bool SERVING>
__global__ void __launch_bounds__(COLS / 4 * RG)
delta_rule_kv(COMBA_KERNEL_ARGS_NAMED(launch)) {
    decltype(auto) prm = fix_activations<ACT>(launch);
    constexpr int LC = COLS / 4, NT = LC * RG, R = K / RG, NW = NT / 32, E = TokenBits<K, NT, COLS>::E;
    static_assert(NT % 32 == 0 && K % RG == 0 && R >= 1, "bad kv tiling");
    __shared__ KvStage<K, COLS, NW> stage[2];
    __shared__ float4 red[2][NW][LC];      // per-warp partial S^T p, S^T q

    const int tid = threadIdx.x, warp = tid >> 5;
    const KvSlab<K, COLS, RG, SERVING, SERVING && MULTI> slab(prm, tid, slots, accepted);
    const int lc = slab.lc, rg = slab.rg, b = slab.b, h = slab.h, hk = slab.hk, col0 = slab.col0, col = slab.col;
    const int T = MULTI ? tokens<SERVING>(cu_seqlens, prm, b, q, k, v, p, beta, g, o) : 1;
    if (SERVING && slab.slot < 0) {  // a padding row
        zero_o(o, prm, b, h, col0, COLS, T, tid, NT);
        return;
    }
    const HeadGating gating = head_gating<SERVING>(A_log, dt_bias, h);

    // 1. Every state load of the thread before anything else.
    float4 s[R];
    slab.load(s, state, !MULTI || prm.has_initial);

    TokenBits<K, NT, COLS> x;
    if (T > 0) issue_token<K, NT, COLS, SEPARATE_P>(x, q, k, v, p, beta, g, prm, tid, b, h, hk, col0, 0);
    for (int t = 0; t < T; ++t) {
        KvStage<K, COLS, NW>& st = stage[t & 1];
        // 2. Stage token t (q.k and the squared norms on the way), then put token t+1 in flight.
        float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int j = tid + e * NT;
            if (K % NT == 0 || j < K) {
                const float xq = bits_to_float(x.q[e], prm.q_t), xk = bits_to_float(x.k[e], prm.k_t);
                const float xp = SEPARATE_P ? bits_to_float(x.p[e], prm.p_t) : xk;
                st.pq[j] = make_float2(xp, xq);
                st.kv[j] = xk;
                d.x = fmaf(xq, xk, d.x);
                d.y = fmaf(xq, xq, d.y);
                d.z = fmaf(xk, xk, d.z);
                d.w = fmaf(xp, xp, d.w);
            }
        }
        if (tid < COLS) reinterpret_cast<float*>(st.v)[tid] = bits_to_float(x.v, prm.v_t);
        stage_gates(st.gates, x, prm, tid, gating);
        if (MULTI && t + 1 < T)
            issue_token<K, NT, COLS, SEPARATE_P>(x, q, k, v, p, beta, g, prm, tid, b, h, hk, col0, t + 1);
        d.x = lane_sum(d.x, 1, 16);
        if (prm.l2norm) {
            d.y = lane_sum(d.y, 1, 16);
            d.z = lane_sum(d.z, 1, 16);
            d.w = lane_sum(d.w, 1, 16);
        }
        if ((tid & 31) == 0) st.dots[warp] = d;
        __syncthreads();

        // 3. One pass: S^T p and S^T q over this thread's rows.
        float sp[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float2 xr = st.pq[rg + i * RG];
            accumulate_pq(s[i], xr.x, xr.y, sp, sq);
        }
        // Row groups of one warp (lanes differing in bits LC .. 16) by shuffles, then the NW
        // warps through shared memory; every thread adds the warps in the same order.  `red`
        // needs no second buffer: it is rewritten only after the next token's barrier.
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            sp[c] = lane_sum(sp[c], LC, 16);
            sq[c] = lane_sum(sq[c], LC, 16);
        }
        if ((tid & 31) < LC) {
            red[0][warp][lc] = make_float4(sp[0], sp[1], sp[2], sp[3]);
            red[1][warp][lc] = make_float4(sq[0], sq[1], sq[2], sq[3]);
        }
        __syncthreads();
        float4 P = red[0][0][lc], Q = red[1][0][lc], D = st.dots[0];
#pragma unroll
        for (int w = 1; w < NW; ++w) {
            const float4 a = red[0][w][lc], c = red[1][w][lc], n = st.dots[w];
            P.x += a.x; P.y += a.y; P.z += a.z; P.w += a.w;
            Q.x += c.x; Q.y += c.y; Q.z += c.z; Q.w += c.w;
            D.x += n.x; D.y += n.y; D.z += n.z; D.w += n.w;
        }
        float fq = 1.f, fk = 1.f, fp = 1.f;
        if (prm.l2norm) {
            fq = rsqrtf(D.y + kL2NormEps);
            fk = rsqrtf(D.z + kL2NormEps);
            fp = SEPARATE_P ? rsqrtf(D.w + kL2NormEps) : fk;
        }
        const float qk = D.x * fq * fk;
        const float bt = st.gates[0], e = st.gates[1];
        const float4 vc = st.v[lc];
        const float u[4] = {bt * (vc.x - e * fp * P.x), bt * (vc.y - e * fp * P.y), bt * (vc.z - e * fp * P.z),
                            bt * (vc.w - e * fp * P.w)};
        const float uk[4] = {u[0] * fk, u[1] * fk, u[2] * fk, u[3] * fk};  // the raw k rows, normalised

        // 4. Rank-1 write with the decay folded in, in registers; o of this token.
#pragma unroll
        for (int i = 0; i < R; ++i) s[i] = decay_write(s[i], e, st.kv[rg + i * RG], uk);
        if constexpr (SERVING && MULTI) {  // speculative verify: every token's state
            if (prm.per_token) {
                float* dst = token_state<K>(inter, state_out, slots, prm, b, h, t);
                if (dst) slab.store_head(s, dst);
            }
        }
        if (rg == 0) {
            const float qs4[4] = {Q.x, Q.y, Q.z, Q.w};
            const long long ob = b * prm.o_sb + t * prm.o_st + h * prm.o_sh;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                store_act(o, ob + (col + c) * prm.o_sv, prm.o_t, scale * fmaf(e * fq, qs4[c], qk * u[c]));
        }
    }

    // 5. The state leaves exactly once.
    if (!MULTI || prm.write_final) slab.store(s, state_out, slots, prm);
}

template <int K, int COLS, bool SEPARATE_P, int ACT, bool SERVING>
__global__ void __launch_bounds__(32)
delta_rule_kv_warp(COMBA_KERNEL_ARGS_NAMED(launch)) {
    constexpr int LC = COLS / 4, RG = 32 / LC, R = K / RG;
    static_assert(LC * RG == 32 && RG >= 4 && K % RG == 0, "bad one-warp kv tiling");
    decltype(auto) prm = fix_activations<ACT>(launch);
    const int lane = threadIdx.x;
    // A grid of (b, h, slab): no division finds the CTA's coordinates.
    const KvSlab<K, COLS, RG, SERVING> slab(prm, lane, blockIdx.z, blockIdx.x, blockIdx.y, slots, accepted);
    const int rg = slab.rg, b = slab.b, h = slab.h, hk = slab.hk;
    if (SERVING && slab.slot < 0) {  // a padding row
        zero_o(o, prm, b, h, slab.col0, COLS, 1, lane, 32);
        return;
    }
    const HeadGating gating = head_gating<SERVING>(A_log, dt_bias, h);

    // 1. Every load of the lane before anything else: its state, then as raw bits the keys of its rows
    //    (rg, rg + RG, ...), the v of its four columns, beta and g.
    float4 s[R];
    slab.load(s, state, true);
    unsigned xq[R], xk[R], xp[SEPARATE_P ? R : 1], xv[4];
    const long long qo = b * prm.q_sb + hk * prm.q_sh + rg * prm.q_sk;
    const long long ko = b * prm.k_sb + hk * prm.k_sh + rg * prm.k_sk;
    const long long po = b * prm.p_sb + hk * prm.p_sh + rg * prm.p_sk, vo = b * prm.v_sb + h * prm.v_sh;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        xq[i] = load_bits(q, qo + i * RG * prm.q_sk, prm.q_t);
        xk[i] = load_bits(k, ko + i * RG * prm.k_sk, prm.k_t);
        if (SEPARATE_P) xp[i] = load_bits(p, po + i * RG * prm.p_sk, prm.p_t);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) xv[c] = load_bits(v, vo + (slab.col + c) * prm.v_sv, prm.v_t);
    const unsigned xb = load_bits(beta, b * prm.beta_sb + h * prm.beta_sh, prm.beta_t);
    const unsigned xg = load_bits(g, b * prm.g_sb + h * prm.g_sh, prm.g_t);

    // 2. One pass over the lane's rows: its parts of S^T p, S^T q, q.k and the squared norms.
    float sp[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, kr[R];
    float4 d = make_float4(0.f, 0.f, 0.f, 0.f);  // q.k, |q|^2, |k|^2, |p|^2
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const float xq_i = bits_to_float(xq[i], prm.q_t);
        kr[i] = bits_to_float(xk[i], prm.k_t);
        const float xp_i = SEPARATE_P ? bits_to_float(xp[i], prm.p_t) : kr[i];
        accumulate_pq(s[i], xp_i, xq_i, sp, sq);
        d.x = fmaf(xq_i, kr[i], d.x);
        d.y = fmaf(xq_i, xq_i, d.y);
        d.z = fmaf(kr[i], kr[i], d.z);
        d.w = fmaf(xp_i, xp_i, d.w);
    }
    // 3. The sums over the row groups (the lanes that differ in bits LC .. 16), in every lane.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        sp[c] = lane_sum(sp[c], LC, 16);
        sq[c] = lane_sum(sq[c], LC, 16);
    }
    float fq = 1.f, fk = 1.f, fp = 1.f;
    if (prm.l2norm) {
        fq = rsqrtf(lane_sum(d.y, LC, 16) + kL2NormEps);
        fk = rsqrtf(lane_sum(d.z, LC, 16) + kL2NormEps);
        fp = SEPARATE_P ? rsqrtf(lane_sum(d.w, LC, 16) + kL2NormEps) : fk;
    }
    const float qk = lane_sum(d.x, LC, 16) * fq * fk;
    const float bt = beta_of(bits_to_float(xb, prm.beta_t), prm, gating);
    const float e = gate_of(bits_to_float(xg, prm.g_t), prm, gating);
    float u[4], uk[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        u[c] = bt * (bits_to_float(xv[c], prm.v_t) - e * fp * sp[c]);
        uk[c] = u[c] * fk;  // the raw k rows, normalised
    }

    // 4. The rank-1 write with the decay folded in; o of column col + rg from the lanes of row groups 0-3.
#pragma unroll
    for (int i = 0; i < R; ++i) s[i] = decay_write(s[i], e, kr[i], uk);
    if (rg < 4) {
        const float oq = rg == 0 ? sq[0] : rg == 1 ? sq[1] : rg == 2 ? sq[2] : sq[3];
        const float ou = rg == 0 ? u[0] : rg == 1 ? u[1] : rg == 2 ? u[2] : u[3];
        store_act(o, b * prm.o_sb + h * prm.o_sh + (slab.col + rg) * prm.o_sv, prm.o_t,
                  scale * fmaf(e * fq, oq, qk * ou));
    }
    slab.store(s, state_out, slots, prm);
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, a.w * b.w)));
}

template <int K, int R, int NW, bool SEPARATE_P, bool MULTI, int ACT, bool SERVING>
__global__ void __launch_bounds__(NW * 32)
delta_rule_vk(COMBA_KERNEL_ARGS_NAMED(launch)) {
    decltype(auto) prm = fix_activations<ACT>(launch);
    constexpr int C = K > 128 ? K / 128 : 1, LK = K / 4 / C, RPW = 32 / LK;
    constexpr int HALF = LK / 2 < R ? LK / 2 : R, BW = 2 * HALF, NB = R / HALF;
    constexpr int ROWS = R * NW * RPW, NT = NW * 32, E = TokenBits<K, NT, ROWS>::E;
    static_assert(R % HALF == 0, "bad vk tiling: a lane's rows must fill whole butterflies");
    __shared__ VkStage<K, ROWS, SEPARATE_P> stage[2];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kg = lane % LK, hg = lane / LK;
    // 32-bit index math (the grid and the row offsets of one head fit), 64-bit addresses.
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    // A grid of B * H * slabs CTAs in x, or for a decode step over a few heads of (b, h, slab): no division
    // (Params::grid3; in x the slabs of a head are neighbours, which a decode step over many heads needs:
    // 0.90 of the copy against 0.97 in the order of (b, h, slab), docs/design.md).
    int b, h, slab0, hk, bh;  // bh = b * H + h
    if (!MULTI && prm.grid3) {
        b = blockIdx.x;
        h = blockIdx.y;
        slab0 = blockIdx.z * ROWS;
        hk = static_cast<int>(static_cast<unsigned>(h) / static_cast<unsigned>(prm.group));
        bh = b * H + h;
    } else {
        const int slabs = V / ROWS;
        bh = static_cast<int>(blockIdx.x) / slabs;
        slab0 = (static_cast<int>(blockIdx.x) - bh * slabs) * ROWS;
        b = bh / H;
        h = bh - b * H;
        hk = h / static_cast<int>(prm.group);
    }
    const int T = MULTI ? tokens<SERVING>(cu_seqlens, prm, b, q, k, v, p, beta, g, o) : 1;
    const long long slot = initial_slot<SERVING, SERVING && MULTI>(slots, accepted, prm, b);
    if (SERVING && slot < 0) {  // a padding row
        zero_o(o, prm, b, h, slab0, ROWS, T, tid, NT);
        return;
    }
    const long long head = SERVING ? (slot * H + h) * V * K : static_cast<long long>(bh) * V * K;
    const HeadGating gating = head_gating<SERVING>(A_log, dt_bias, h);
    // Row i of this lane within the slab; the RPW row groups of a warp read consecutive rows.
    auto local = [&](int i) { return (i * NW + warp) * RPW + hg; };
    // The lane's float4 c of row i in a slab whose lane-kg part starts at `rows` (+ 4 kg): 4 LK c further.
    auto at = [&](auto* rows, int i, int c) { return rows + local(i) * K + c * LK * 4; };

    // 1. Every state load of the lane before anything else.
    float4 s[R][C];
    if (!MULTI || prm.has_initial) {
        const float* src = state + head + slab0 * K + kg * 4;
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int c = 0; c < C; ++c) s[i][c] = load_state(at(src, i, c));
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int c = 0; c < C; ++c) s[i][c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    TokenBits<K, NT, ROWS> x;
    if (T > 0) issue_token<K, NT, ROWS, SEPARATE_P>(x, q, k, v, p, beta, g, prm, tid, b, h, hk, slab0, 0);
    // A p lane ends a butterfly with S p of row n*HALF + kg % HALF, a q lane with S q of that row.
    const bool p_lane = (BW == LK ? kg : kg % BW) < HALF;
    for (int t = 0; t < T; ++t) {
        VkStage<K, ROWS, SEPARATE_P>& st = stage[t & 1];
        // 2. Stage token t, then put token t+1 in flight.
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int j = tid + e * NT;
            if (K % NT == 0 || j < K) {
                reinterpret_cast<float*>(st.q)[j] = bits_to_float(x.q[e], prm.q_t);
                reinterpret_cast<float*>(st.k)[j] = bits_to_float(x.k[e], prm.k_t);
                if (SEPARATE_P) reinterpret_cast<float*>(st.p)[j] = bits_to_float(x.p[e], prm.p_t);
            }
        }
        if (tid < ROWS) st.v[tid] = bits_to_float(x.v, prm.v_t);
        stage_gates(st.gates, x, prm, tid, gating);
        if (MULTI && t + 1 < T)
            issue_token<K, NT, ROWS, SEPARATE_P>(x, q, k, v, p, beta, g, prm, tid, b, h, hk, slab0, t + 1);
        __syncthreads();

        float4 cq[C], ck[C], cp[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            cq[c] = st.q[kg + c * LK];
            ck[c] = st.k[kg + c * LK];
            cp[c] = SEPARATE_P ? st.p[kg + c * LK] : ck[c];
        }
        // The lane's part of a dot product along the row, then the sum over the row's LK lanes.
        auto row_dot = [&](const float4 (&a)[C], const float4 (&z)[C]) {
            float d = dot4(a[0], z[0]);
#pragma unroll
            for (int c = 1; c < C; ++c) d += dot4(a[c], z[c]);
            return lane_sum(d, 1, LK / 2);
        };
        const float bt = st.gates[0], e = st.gates[1];
        float fq = 1.f, fk = 1.f, fp = 1.f;
        if (prm.l2norm) {
            fq = rsqrtf(row_dot(cq, cq) + kL2NormEps);
            fk = rsqrtf(row_dot(ck, ck) + kL2NormEps);
            fp = SEPARATE_P ? rsqrtf(row_dot(cp, cp) + kL2NormEps) : fk;
        }
        const float qk = row_dot(cq, ck) * fq * fk;

        // 3. Row sums by butterflies of BW values: HALF rows x {S p, S q} per butterfly.
        const long long ob = b * prm.o_sb + t * prm.o_st + h * prm.o_sh;
        float ub[NB];  // u of row n*HALF + kg % HALF
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            float y[BW];
#pragma unroll
            for (int j = 0; j < HALF; ++j) {
                y[j] = dot4(cp[0], s[n * HALF + j][0]);
                y[HALF + j] = dot4(cq[0], s[n * HALF + j][0]);
#pragma unroll
                for (int c = 1; c < C; ++c) {
                    y[j] += dot4(cp[c], s[n * HALF + j][c]);
                    y[HALF + j] += dot4(cq[c], s[n * HALF + j][c]);
                }
            }
            butterfly<HALF>(y, kg);
            if constexpr (BW < LK) y[0] = lane_sum(y[0], BW, LK / 2);  // the row's other lanes
            const float sum = y[0] * (p_lane ? fp : fq);
            const float u = bt * (st.v[local(n * HALF + kg % HALF)] - e * sum);  // valid on the p lanes
            const float u_pair = __shfl_xor_sync(0xffffffffu, u, HALF);             // the q lanes get their row's u
            if (!p_lane && (BW == LK || kg < BW))
                store_act(o, ob + (slab0 + local(n * HALF + (BW == LK ? kg : kg % BW) - HALF)) * prm.o_sv, prm.o_t,
                          scale * fmaf(e, sum, qk * u_pair));
            ub[n] = p_lane ? u : u_pair;
        }

        // 4. Rank-1 write with the decay folded in, in registers.
        float4 kn[C];
#pragma unroll
        for (int c = 0; c < C; ++c) kn[c] = make_float4(ck[c].x * fk, ck[c].y * fk, ck[c].z * fk, ck[c].w * fk);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float ui = __shfl_sync(0xffffffffu, ub[i / HALF], hg * LK + i % HALF);
#pragma unroll
            for (int c = 0; c < C; ++c)
                s[i][c] = make_float4(fmaf(e, s[i][c].x, kn[c].x * ui), fmaf(e, s[i][c].y, kn[c].y * ui),
                                      fmaf(e, s[i][c].z, kn[c].z * ui), fmaf(e, s[i][c].w, kn[c].w * ui));
        }
        if constexpr (SERVING && MULTI) {  // speculative verify: every token's state
            if (prm.per_token) {
                if (float* dst = token_state<K>(inter, state_out, slots, prm, b, h, t)) {
                    dst += slab0 * K + kg * 4;
#pragma unroll
                    for (int i = 0; i < R; ++i)
#pragma unroll
                        for (int c = 0; c < C; ++c) store_token_state(at(dst, i, c), s[i][c]);
                }
            }
        }
    }

    // 5. The state leaves exactly once.
    if (!MULTI || prm.write_final) {
        float* dst = state_out + (SERVING ? pool_head<K>(slots, prm, b, h) : head) + slab0 * K + kg * 4;
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int c = 0; c < C; ++c) store_state(at(dst, i, c), s[i][c]);
    }
}

}  // namespace comba
