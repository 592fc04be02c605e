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
// The next token's small vectors are loaded into registers while the current token is
// computed, so their latency is hidden behind the work of the token before.
#include "common.cuh"

namespace comba {

// Must match FORWARD_FIELDS in cupy_comba/_params.py (all int64, same order).
struct ForwardParams {
    long long B, T, H, group, V;              // group = H / Hk
    long long q_sb, q_st, q_sh, q_sk;
    long long k_sb, k_st, k_sh, k_sk;
    long long p_sb, p_st, p_sh, p_sk;
    long long v_sb, v_st, v_sh, v_sv;
    long long beta_sb, beta_st, beta_sh;
    long long g_sb, g_st, g_sh;
    long long o_sb, o_st, o_sh, o_sv;
    long long q_t, k_t, p_t, v_t, beta_t, g_t, o_t;
    long long gate_linear, l2norm, has_initial, write_final;
};

constexpr int kForwardWarps = 4;
constexpr float kL2NormEps = 1e-6f;

__device__ __forceinline__ float warp_sum(float x, int first, int last) {
#pragma unroll
    for (int off = first; off <= last; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

__device__ __forceinline__ float gate_of(float g, long long linear) { return linear ? g : expf(g); }

// ---------------------------------------------------------------------------------------
// KV layout.
template <int K, bool SEPARATE_P>
__device__ __forceinline__ void forward_kv(const float* state, float* state_out, const void* q, const void* k,
                                           const void* v, const void* p, const void* beta, const void* g, void* o,
                                           const ForwardParams& prm, float scale, long long task,
                                           float (*smem)[K]) {
    constexpr int COLS = 16, LC = 4, RG = 8, R = K / RG, E = K / 32;
    const int lane = threadIdx.x & 31;
    const long long slabs = prm.V / COLS;
    const long long bh = task / slabs;
    const long long b = bh / prm.H, h = bh - b * prm.H, hk = h / prm.group;
    const int lc = lane % LC, rg = lane / LC;
    const long long col = (task - bh * slabs) * COLS + lc * 4;
    float* qs = smem[0];
    float* ks = smem[1];
    float* ps = smem[SEPARATE_P ? 2 : 1];  // Gated DeltaNet reads with k: no third vector at all

    const long long head = bh * K * prm.V;
    float4 s[R];
    if (prm.has_initial) {
#pragma unroll
        for (int i = 0; i < R; ++i) s[i] = load_stream(state + head + static_cast<long long>(i * RG + rg) * prm.V + col);
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) s[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    // Token-t vectors in registers: lane holds elements lane + 32 j of q, k, p.
    float nq[E], nk[E], np[E], nv[4], nbeta, ng;
    auto fetch = [&](long long t) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const long long i = lane + 32 * j;
            nq[j] = load_act(q, b * prm.q_sb + t * prm.q_st + hk * prm.q_sh + i * prm.q_sk, prm.q_t);
            nk[j] = load_act(k, b * prm.k_sb + t * prm.k_st + hk * prm.k_sh + i * prm.k_sk, prm.k_t);
            if (SEPARATE_P) np[j] = load_act(p, b * prm.p_sb + t * prm.p_st + hk * prm.p_sh + i * prm.p_sk, prm.p_t);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c)
            nv[c] = load_act(v, b * prm.v_sb + t * prm.v_st + h * prm.v_sh + (col + c) * prm.v_sv, prm.v_t);
        nbeta = load_act(beta, b * prm.beta_sb + t * prm.beta_st + h * prm.beta_sh, prm.beta_t);
        ng = load_act(g, b * prm.g_sb + t * prm.g_st + h * prm.g_sh, prm.g_t);
    };
    fetch(0);

    for (long long t = 0; t < prm.T; ++t) {
        // Park token t's q, k, p (normalised if asked) in the warp's scratch.
        float fq = 1.f, fk = 1.f, fp = 1.f;
        if (prm.l2norm) {
            float sq = 0.f, sk = 0.f, spp = 0.f;
#pragma unroll
            for (int j = 0; j < E; ++j) {
                sq = fmaf(nq[j], nq[j], sq);
                sk = fmaf(nk[j], nk[j], sk);
                if (SEPARATE_P) spp = fmaf(np[j], np[j], spp);
            }
            fq = rsqrtf(warp_sum(sq, 1, 16) + kL2NormEps);
            fk = rsqrtf(warp_sum(sk, 1, 16) + kL2NormEps);
            if (SEPARATE_P) fp = rsqrtf(warp_sum(spp, 1, 16) + kL2NormEps);
        }
        __syncwarp();  // the previous token is done reading the scratch
#pragma unroll
        for (int j = 0; j < E; ++j) {
            qs[lane + 32 * j] = nq[j] * fq;
            ks[lane + 32 * j] = nk[j] * fk;
            if (SEPARATE_P) ps[lane + 32 * j] = np[j] * fp;
        }
        const float v0 = nv[0], v1 = nv[1], v2 = nv[2], v3 = nv[3];
        const float bt = nbeta, e = gate_of(ng, prm.gate_linear);
        if (t + 1 < prm.T) fetch(t + 1);
        __syncwarp();

        float sp[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, qk = 0.f;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int r = i * RG + rg;
            accumulate_pq(s[i], ps[r], qs[r], sp, sq);
            qk = fmaf(qs[r], ks[r], qk);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            sp[c] = warp_sum(sp[c], LC, 16);
            sq[c] = warp_sum(sq[c], LC, 16);
        }
        qk = warp_sum(qk, LC, 16);
        const float u[4] = {bt * (v0 - e * sp[0]), bt * (v1 - e * sp[1]), bt * (v2 - e * sp[2]),
                            bt * (v3 - e * sp[3])};
#pragma unroll
        for (int i = 0; i < R; ++i) s[i] = decay_write(s[i], e, ks[i * RG + rg], u);
        if (rg == 0) {
            const long long ob = b * prm.o_sb + t * prm.o_st + h * prm.o_sh;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                store_act(o, ob + (col + c) * prm.o_sv, prm.o_t, scale * fmaf(e, sq[c], qk * u[c]));
        }
    }
    if (prm.write_final) {
#pragma unroll
        for (int i = 0; i < R; ++i) store_stream(state_out + head + static_cast<long long>(i * RG + rg) * prm.V + col, s[i]);
    }
}

// ---------------------------------------------------------------------------------------
// VK layout.
template <int K, bool SEPARATE_P>
__device__ __forceinline__ void forward_vk(const float* state, float* state_out, const void* q, const void* k,
                                           const void* v, const void* p, const void* beta, const void* g, void* o,
                                           const ForwardParams& prm, float scale, long long task) {
    constexpr int LK = K / 4, RG = 32 / LK, NR = 8, ROWS = NR * RG;
    const int lane = threadIdx.x & 31;
    const long long slabs = prm.V / ROWS;
    const long long bh = task / slabs;
    const long long b = bh / prm.H, h = bh - b * prm.H, hk = h / prm.group;
    const int kg = lane % LK, rg = lane / LK;
    const long long row0 = (task - bh * slabs) * ROWS + rg;  // this lane's rows: row0 + RG i
    const long long head = bh * prm.V * K;

    float4 s[NR];
    if (prm.has_initial) {
#pragma unroll
        for (int i = 0; i < NR; ++i) s[i] = load_stream(state + head + (row0 + i * RG) * K + kg * 4);
    } else {
#pragma unroll
        for (int i = 0; i < NR; ++i) s[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    float nq[4], nk[4], np[4], nv[NR], nbeta, ng;
    auto fetch = [&](long long t) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const long long i = kg * 4 + c;
            nq[c] = load_act(q, b * prm.q_sb + t * prm.q_st + hk * prm.q_sh + i * prm.q_sk, prm.q_t);
            nk[c] = load_act(k, b * prm.k_sb + t * prm.k_st + hk * prm.k_sh + i * prm.k_sk, prm.k_t);
            if (SEPARATE_P) np[c] = load_act(p, b * prm.p_sb + t * prm.p_st + hk * prm.p_sh + i * prm.p_sk, prm.p_t);
        }
#pragma unroll
        for (int i = 0; i < NR; ++i)
            nv[i] = load_act(v, b * prm.v_sb + t * prm.v_st + h * prm.v_sh + (row0 + i * RG) * prm.v_sv, prm.v_t);
        nbeta = load_act(beta, b * prm.beta_sb + t * prm.beta_st + h * prm.beta_sh, prm.beta_t);
        ng = load_act(g, b * prm.g_sb + t * prm.g_st + h * prm.g_sh, prm.g_t);
    };
    fetch(0);

    for (long long t = 0; t < prm.T; ++t) {
        float4 cq = make_float4(nq[0], nq[1], nq[2], nq[3]);
        float4 ck = make_float4(nk[0], nk[1], nk[2], nk[3]);
        float4 cp = SEPARATE_P ? make_float4(np[0], np[1], np[2], np[3]) : ck;
        if (prm.l2norm) {
            const float fq = rsqrtf(warp_sum(cq.x * cq.x + cq.y * cq.y + cq.z * cq.z + cq.w * cq.w, 1, LK / 2)
                                    + kL2NormEps);
            const float fk = rsqrtf(warp_sum(ck.x * ck.x + ck.y * ck.y + ck.z * ck.z + ck.w * ck.w, 1, LK / 2)
                                    + kL2NormEps);
            cq = make_float4(cq.x * fq, cq.y * fq, cq.z * fq, cq.w * fq);
            ck = make_float4(ck.x * fk, ck.y * fk, ck.z * fk, ck.w * fk);
            if (SEPARATE_P) {
                const float fp = rsqrtf(warp_sum(cp.x * cp.x + cp.y * cp.y + cp.z * cp.z + cp.w * cp.w, 1, LK / 2)
                                        + kL2NormEps);
                cp = make_float4(cp.x * fp, cp.y * fp, cp.z * fp, cp.w * fp);
            } else {
                cp = ck;
            }
        }
        float cv[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) cv[i] = nv[i];
        const float bt = nbeta, e = gate_of(ng, prm.gate_linear);
        if (t + 1 < prm.T) fetch(t + 1);

        const float qk = warp_sum(cq.x * ck.x + cq.y * ck.y + cq.z * ck.z + cq.w * ck.w, 1, LK / 2);
        const long long ob = b * prm.o_sb + t * prm.o_st + h * prm.o_sh;
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const float sp = warp_sum(cp.x * s[i].x + cp.y * s[i].y + cp.z * s[i].z + cp.w * s[i].w, 1, LK / 2);
            const float sq = warp_sum(cq.x * s[i].x + cq.y * s[i].y + cq.z * s[i].z + cq.w * s[i].w, 1, LK / 2);
            const float u = bt * (cv[i] - e * sp);
            s[i] = make_float4(fmaf(e, s[i].x, ck.x * u), fmaf(e, s[i].y, ck.y * u), fmaf(e, s[i].z, ck.z * u),
                               fmaf(e, s[i].w, ck.w * u));
            if (kg == 0) store_act(o, ob + (row0 + i * RG) * prm.o_sv, prm.o_t, scale * fmaf(e, sq, qk * u));
        }
    }
    if (prm.write_final) {
#pragma unroll
        for (int i = 0; i < NR; ++i) store_stream(state_out + head + (row0 + i * RG) * K + kg * 4, s[i]);
    }
}

// ---------------------------------------------------------------------------------------
template <int K, bool VK, bool SEPARATE_P>
__global__ void __launch_bounds__(kForwardWarps * 32)
delta_rule_forward(const float* state, float* state_out, const void* __restrict__ q, const void* __restrict__ k,
                   const void* __restrict__ v, const void* __restrict__ p, const void* __restrict__ beta,
                   const void* __restrict__ g, void* __restrict__ o, const ForwardParams prm, const float scale) {
    __shared__ float scratch[kForwardWarps][VK ? 1 : (SEPARATE_P ? 3 : 2)][K];  // KV only
    const int warp = threadIdx.x >> 5;
    const long long rows_per_task = VK ? 8 * (128 / K) : 16;  // V-rows (VK) or V-columns (KV) per warp
    const long long task = static_cast<long long>(blockIdx.x) * kForwardWarps + warp;
    if (task >= prm.B * prm.H * (prm.V / rows_per_task)) return;  // whole warp leaves together
    if constexpr (VK) {
        forward_vk<K, SEPARATE_P>(state, state_out, q, k, v, p, beta, g, o, prm, scale, task);
    } else {
        forward_kv<K, SEPARATE_P>(state, state_out, q, k, v, p, beta, g, o, prm, scale, task, scratch[warp]);
    }
}

}  // namespace comba
