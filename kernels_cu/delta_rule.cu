// delta_rule.cu -- T tokens of the gated delta rule (Comba, or Gated DeltaNet when p = k)
// in ONE launch: the state is loaded once, stays in registers across all T tokens,
// o is written per token and the final state once.  T = 1 is the decode step.
//
// Math per (b, h) and token t, with gate e = exp(g) ("log" gate) or e = g ("linear"):
//
//   u[j]       = beta * (v[j] - e * sum_i p[i] S[i,j])      (p = k for Gated DeltaNet)
//   S[i,j]     = e * S[i,j] + k[i] * u[j]
//   o[j]       = scale * (e * sum_i q[i] S_old[i,j] + (q.k) * u[j])
//
// optionally with q, k (and p) L2-normalised along K first: x / sqrt(sum x^2 + 1e-6).
//
// Layouts.  q, k, p [B, T, Hk, K]; v, o [B, T, H, V]; beta, g [B, T, H]: any strides, any
// of f32 / f16 / bf16.  Head h reads key head h / (H / Hk).  The state is C-contiguous,
// 16-byte aligned, either
//   KV: [B, H, K, V] (V contiguous; flash-linear-attention, the Comba spec), or
//   VK: [B, H, V, K] (K contiguous; MLX-LM, the metaltile seed, vLLM, SGLang).
//
// Launch geometry: one warp per task, 4 independent warps per block, grid = ceil(tasks/4).
//   KV: a task is (b, h, 16-column slab of V).  Lanes are 4 float4 columns x 8 row groups;
//       lane group rg owns rows rg, rg+8, ... (K/8 float4 registers).  The K-reductions are
//       in-register sums and three xor-shuffles.  q, k, p of the token go through a per-warp
//       shared scratch so each lane reads only its rows.
//   VK: a task is (b, h, slab of 8 * (128/K) V-rows).  Lanes are K/4 float4 positions along
//       K x 128/K row groups; each lane owns 8 rows (8 float4 registers).  A warp-wide load
//       covers whole K-rows (512 contiguous bytes); each row's K-reduction is a 4-term dot
//       product and log2(K/4) xor-shuffles.
// Tokens are processed in chunks of C = 512/K: the warp first stages the chunk's q, k, p (whole
// K vectors), its slab of v, beta and g in its shared scratch -- every load of the chunk in
// flight at once, so a memory latency is paid once per chunk rather than once per token --
// normalises them there if asked, then runs the C recurrence steps from shared memory.
#include "common.cuh"
#include "params.cuh"

namespace comba {

constexpr int kForwardWarps = 4;

template <int K>
__host__ __device__ constexpr int chunk_tokens() { return 512 / K; }

// Per-warp staging area for one chunk: q, k, p [C][K], v [C][16] (the warp's slab of V),
// beta and g [C][2].
template <int K, bool SEPARATE_P>
struct Stage {
    static constexpr int C = chunk_tokens<K>();
    static constexpr int VS = 16;
    static constexpr int FLOATS = C * ((SEPARATE_P ? 3 : 2) * K + VS + 2);
    float* q;
    float* k;
    float* p;
    float* v;
    float* bg;
    __device__ explicit Stage(float* base)
        : q(base), k(base + C * K), p(SEPARATE_P ? base + 2 * C * K : base + C * K),
          v(base + (SEPARATE_P ? 3 : 2) * C * K), bg(base + (SEPARATE_P ? 3 : 2) * C * K + C * VS) {}
};

// Stage tokens t0 .. t0+C-1 (those below T) of head (b, h): all loads issued back to back.
// v elements vbase .. vbase+nv-1 of the V axis are this warp's slab.
template <int K, bool SEPARATE_P>
__device__ __forceinline__ void stage_chunk(const Stage<K, SEPARATE_P>& st, const void* q, const void* k,
                                            const void* v, const void* p, const void* beta, const void* g,
                                            const Params& prm, long long b, long long h, long long hk,
                                            long long t0, long long vbase, int nv) {
    constexpr int C = Stage<K, SEPARATE_P>::C, VS = Stage<K, SEPARATE_P>::VS, E = K / 32;
    const int lane = threadIdx.x & 31;
    __syncwarp();  // the previous chunk is done reading the scratch
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const long long t = t0 + c;
        if (t >= prm.T) break;
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const long long i = lane + 32 * j;
            st.q[c * K + i] = load_act(q, b * prm.q_sb + t * prm.q_st + hk * prm.q_sh + i * prm.q_sk, prm.q_t);
            st.k[c * K + i] = load_act(k, b * prm.k_sb + t * prm.k_st + hk * prm.k_sh + i * prm.k_sk, prm.k_t);
            if (SEPARATE_P)
                st.p[c * K + i] = load_act(p, b * prm.p_sb + t * prm.p_st + hk * prm.p_sh + i * prm.p_sk, prm.p_t);
        }
        if (lane < nv)
            st.v[c * VS + lane] = load_act(v, b * prm.v_sb + t * prm.v_st + h * prm.v_sh + (vbase + lane) * prm.v_sv,
                                           prm.v_t);
        if (lane == 0) st.bg[2 * c] = load_act(beta, b * prm.beta_sb + t * prm.beta_st + h * prm.beta_sh, prm.beta_t);
        if (lane == 1) st.bg[2 * c + 1] = load_act(g, b * prm.g_sb + t * prm.g_st + h * prm.g_sh, prm.g_t);
    }
    if (prm.l2norm) {
        // Each lane scales the elements it staged itself: no cross-lane hazard before the barrier.
#pragma unroll
        for (int c = 0; c < C; ++c) {
            if (t0 + c >= prm.T) break;
            float sq = 0.f, sk = 0.f, sp = 0.f;
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const int i = c * K + lane + 32 * j;
                sq = fmaf(st.q[i], st.q[i], sq);
                sk = fmaf(st.k[i], st.k[i], sk);
                if (SEPARATE_P) sp = fmaf(st.p[i], st.p[i], sp);
            }
            const float fq = rsqrtf(lane_sum(sq, 1, 16) + kL2NormEps);
            const float fk = rsqrtf(lane_sum(sk, 1, 16) + kL2NormEps);
            const float fp = SEPARATE_P ? rsqrtf(lane_sum(sp, 1, 16) + kL2NormEps) : 1.f;
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const int i = c * K + lane + 32 * j;
                st.q[i] *= fq;
                st.k[i] *= fk;
                if (SEPARATE_P) st.p[i] *= fp;
            }
        }
    }
    __syncwarp();
}

// ---------------------------------------------------------------------------------------
// KV layout.
template <int K, bool SEPARATE_P>
__device__ __forceinline__ void forward_kv(const float* state, float* state_out, const void* q, const void* k,
                                           const void* v, const void* p, const void* beta, const void* g, void* o,
                                           const Params& prm, float scale, long long task, float* scratch) {
    constexpr int COLS = 16, LC = 4, RG = 8, R = K / RG;
    using St = Stage<K, SEPARATE_P>;
    const Stage<K, SEPARATE_P> st(scratch);
    const int lane = threadIdx.x & 31;
    const long long slabs = prm.V / COLS;
    const long long bh = task / slabs;
    const long long b = bh / prm.H, h = bh - b * prm.H, hk = h / prm.group;
    const int lc = lane % LC, rg = lane / LC;
    const long long slab0 = (task - bh * slabs) * COLS;
    const long long col = slab0 + lc * 4;

    const long long head = bh * K * prm.V;
    float4 s[R];
    if (prm.has_initial) {
#pragma unroll
        for (int i = 0; i < R; ++i) s[i] = load_state_evict_first(state + head + static_cast<long long>(i * RG + rg) * prm.V + col);
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) s[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    for (long long t0 = 0; t0 < prm.T; t0 += St::C) {
        stage_chunk<K, SEPARATE_P>(st, q, k, v, p, beta, g, prm, b, h, hk, t0, slab0, COLS);
        for (int c = 0; c < St::C && t0 + c < prm.T; ++c) {
            const float* qs = st.q + c * K;
            const float* ks = st.k + c * K;
            const float* ps = st.p + c * K;  // = ks for Gated DeltaNet
            const float4 vc = *reinterpret_cast<const float4*>(st.v + c * St::VS + lc * 4);
            const float bt = st.bg[2 * c], e = gate_of(st.bg[2 * c + 1], prm.gate_linear);

            float sp[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, qk = 0.f;
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const int r = i * RG + rg;
                accumulate_pq(s[i], ps[r], qs[r], sp, sq);
                qk = fmaf(qs[r], ks[r], qk);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                sp[j] = lane_sum(sp[j], LC, 16);
                sq[j] = lane_sum(sq[j], LC, 16);
            }
            qk = lane_sum(qk, LC, 16);
            const float u[4] = {bt * (vc.x - e * sp[0]), bt * (vc.y - e * sp[1]), bt * (vc.z - e * sp[2]),
                                bt * (vc.w - e * sp[3])};
#pragma unroll
            for (int i = 0; i < R; ++i) s[i] = decay_write(s[i], e, ks[i * RG + rg], u);
            if (rg == 0) {
                const long long ob = b * prm.o_sb + (t0 + c) * prm.o_st + h * prm.o_sh;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    store_act(o, ob + (col + j) * prm.o_sv, prm.o_t, scale * fmaf(e, sq[j], qk * u[j]));
            }
        }
    }
    if (prm.write_final) {
#pragma unroll
        for (int i = 0; i < R; ++i) store_state_evict_first(state_out + head + static_cast<long long>(i * RG + rg) * prm.V + col, s[i]);
    }
}

// ---------------------------------------------------------------------------------------
// VK layout.
template <int K, bool SEPARATE_P>
__device__ __forceinline__ void forward_vk(const float* state, float* state_out, const void* q, const void* k,
                                           const void* v, const void* p, const void* beta, const void* g, void* o,
                                           const Params& prm, float scale, long long task, float* scratch) {
    constexpr int LK = K / 4, RG = 32 / LK, NR = 8, ROWS = NR * RG;
    using St = Stage<K, SEPARATE_P>;
    static_assert(ROWS <= St::VS, "the staged v slab must hold the warp's rows");
    const Stage<K, SEPARATE_P> st(scratch);
    const int lane = threadIdx.x & 31;
    const long long slabs = prm.V / ROWS;
    const long long bh = task / slabs;
    const long long b = bh / prm.H, h = bh - b * prm.H, hk = h / prm.group;
    const int kg = lane % LK, rg = lane / LK;
    const long long slab0 = (task - bh * slabs) * ROWS;
    const long long row0 = slab0 + rg;  // this lane's rows: row0 + RG i
    const long long head = bh * prm.V * K;

    float4 s[NR];
    if (prm.has_initial) {
#pragma unroll
        for (int i = 0; i < NR; ++i) s[i] = load_state_evict_first(state + head + (row0 + i * RG) * K + kg * 4);
    } else {
#pragma unroll
        for (int i = 0; i < NR; ++i) s[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    for (long long t0 = 0; t0 < prm.T; t0 += St::C) {
        stage_chunk<K, SEPARATE_P>(st, q, k, v, p, beta, g, prm, b, h, hk, t0, slab0, ROWS);
        for (int c = 0; c < St::C && t0 + c < prm.T; ++c) {
            const float4 cq = *reinterpret_cast<const float4*>(st.q + c * K + kg * 4);
            const float4 ck = *reinterpret_cast<const float4*>(st.k + c * K + kg * 4);
            const float4 cp = *reinterpret_cast<const float4*>(st.p + c * K + kg * 4);
            const float bt = st.bg[2 * c], e = gate_of(st.bg[2 * c + 1], prm.gate_linear);
            const float qk = lane_sum(cq.x * ck.x + cq.y * ck.y + cq.z * ck.z + cq.w * ck.w, 1, LK / 2);
            const long long ob = b * prm.o_sb + (t0 + c) * prm.o_st + h * prm.o_sh;
#pragma unroll
            for (int i = 0; i < NR; ++i) {
                const float sp = lane_sum(cp.x * s[i].x + cp.y * s[i].y + cp.z * s[i].z + cp.w * s[i].w, 1, LK / 2);
                const float sq = lane_sum(cq.x * s[i].x + cq.y * s[i].y + cq.z * s[i].z + cq.w * s[i].w, 1, LK / 2);
                const float u = bt * (st.v[c * St::VS + rg + i * RG] - e * sp);
                s[i] = make_float4(fmaf(e, s[i].x, ck.x * u), fmaf(e, s[i].y, ck.y * u), fmaf(e, s[i].z, ck.z * u),
                                   fmaf(e, s[i].w, ck.w * u));
                if (kg == 0) store_act(o, ob + (row0 + i * RG) * prm.o_sv, prm.o_t, scale * fmaf(e, sq, qk * u));
            }
        }
    }
    if (prm.write_final) {
#pragma unroll
        for (int i = 0; i < NR; ++i) store_state_evict_first(state_out + head + (row0 + i * RG) * K + kg * 4, s[i]);
    }
}

// ---------------------------------------------------------------------------------------
template <int K, bool VK, bool SEPARATE_P>
__global__ void __launch_bounds__(kForwardWarps * 32)
delta_rule_forward(const float* state, float* state_out, const void* __restrict__ q, const void* __restrict__ k,
                   const void* __restrict__ v, const void* __restrict__ p, const void* __restrict__ beta,
                   const void* __restrict__ g, void* __restrict__ o, const Params prm, const float scale) {
    __shared__ __align__(16) float scratch[kForwardWarps][Stage<K, SEPARATE_P>::FLOATS];
    const int warp = threadIdx.x >> 5;
    const long long rows_per_task = VK ? 8 * (128 / K) : 16;  // V-rows (VK) or V-columns (KV) per warp
    const long long task = static_cast<long long>(blockIdx.x) * kForwardWarps + warp;
    if (task >= prm.B * prm.H * (prm.V / rows_per_task)) return;  // whole warp leaves together
    if constexpr (VK) {
        forward_vk<K, SEPARATE_P>(state, state_out, q, k, v, p, beta, g, o, prm, scale, task, scratch[warp]);
    } else {
        forward_kv<K, SEPARATE_P>(state, state_out, q, k, v, p, beta, g, o, prm, scale, task, scratch[warp]);
    }
}

}  // namespace comba
