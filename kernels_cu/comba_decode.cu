// comba_decode.cu -- one Comba (decoupled-key gated delta rule) decode step.
//
// Math, per (b, h) with S = state[b, h] of shape (K, V), e = exp(g):
//
//   u[j]       = beta * (v[j] - e * sum_i p[i] S[i,j])      correction read with p
//   S_new[i,j] = e * S[i,j] + k[i] * u[j]                   rank-1 write with k
//   o[j]       = scale * sum_i q[i] S_new[i,j]
//              = scale * (e * sum_i q[i] S[i,j] + (q.k) * u[j])
//
// The second form of o lets both K-reductions (with p and with q) and the
// scalar q.k come from ONE pass over the state held in registers, so the fp32
// state is read once and written once: the whole cost of the step.
//
// Layout: state, state_out [B, H, K, V] C-contiguous float32 (V fastest).
// q, k, p [B, Hk, K]; v, o [B, H, V]; beta, g [B, H]: any strides, any of
// f32 / f16 / bf16 (codes in common.cuh), g log-space.  GVA: head h reads q,
// k, p of head h / (H / Hk).
//
// Launch geometry: one WARP per task = (b, h, slab of COLS columns of V).
// Lanes form an LC x RG grid: LC = COLS/4 lanes across the slab, one float4
// of columns each, and RG = 32/LC lane groups down K.  Lane group rg owns rows
// rg, rg+RG, rg+2RG, ... (R = K/RG rows, R float4 registers).  For a fixed
// register index the warp touches RG consecutive rows x COLS columns: full
// 32-byte sectors, COLS*4-byte contiguous runs.  The K-reduction is an
// in-register sum over R rows and then log2(RG) xor-shuffles -- no shared
// memory barrier, no __syncthreads: warps are fully independent, so the
// load phase of one warp overlaps the store phase of its neighbours.
// The small vectors q, k, p go through a per-warp shared-memory scratch
// (3*K floats) so each lane reads only the rows it owns.
// Block = WARPS warps = WARPS independent tasks; grid = ceil(tasks / WARPS).
#include "common.cuh"

namespace comba {

// Must match DECODE_FIELDS in cupy_comba/_params.py (all int64, same order).
struct DecodeParams {
    long long B, H, group, V;                 // group = H / Hk
    long long q_sb, q_sh, q_sk;
    long long k_sb, k_sh, k_sk;
    long long p_sb, p_sh, p_sk;
    long long v_sb, v_sh, v_sv;
    long long beta_sb, beta_sh;
    long long g_sb, g_sh;
    long long o_sb, o_sh, o_sv;
    long long q_t, k_t, p_t, v_t, beta_t, g_t, o_t;
};

constexpr int kDecodeWarps = 4;

template <int K, int COLS>
__global__ void __launch_bounds__(kDecodeWarps * 32)
comba_decode_step(const float* state, float* state_out,
                  const void* __restrict__ q, const void* __restrict__ k,
                  const void* __restrict__ v, const void* __restrict__ p,
                  const void* __restrict__ beta, const void* __restrict__ g,
                  void* __restrict__ o, const DecodeParams prm, const float scale) {
    constexpr int LC = COLS / 4;   // lanes across the slab
    constexpr int RG = 32 / LC;    // lane groups down K
    constexpr int R = K / RG;      // rows (float4 registers) per lane
    static_assert(K % RG == 0 && R >= 1, "K must be a multiple of the lane groups");

    __shared__ float vec[kDecodeWarps][3][K];  // q, k, p per warp

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const long long slabs = prm.V / COLS;
    const long long task = static_cast<long long>(blockIdx.x) * kDecodeWarps + warp;
    if (task >= prm.B * prm.H * slabs) return;  // whole warp leaves together

    const long long bh = task / slabs;
    const int slab = static_cast<int>(task - bh * slabs);
    const long long b = bh / prm.H;
    const long long h = bh - b * prm.H;
    const long long hk = h / prm.group;
    const int lc = lane % LC;
    const int rg = lane / LC;
    const long long col = static_cast<long long>(slab) * COLS + lc * 4;

    // 1. Issue every state load of the task before anything else: R x 16 B
    //    in flight per lane is what keeps HBM busy.
    const long long head = bh * K * prm.V;
    const float* src = state + head + col;
    float4 s[R];
#pragma unroll
    for (int i = 0; i < R; ++i) s[i] = load_stream(src + static_cast<long long>(i * RG + rg) * prm.V);

    // 2. Small vectors while the state is in flight.
    float* qs = vec[warp][0];
    float* ks = vec[warp][1];
    float* ps = vec[warp][2];
#pragma unroll
    for (int i = lane; i < K; i += 32) {
        qs[i] = load_act(q, b * prm.q_sb + hk * prm.q_sh + i * prm.q_sk, prm.q_t);
        ks[i] = load_act(k, b * prm.k_sb + hk * prm.k_sh + i * prm.k_sk, prm.k_t);
        ps[i] = load_act(p, b * prm.p_sb + hk * prm.p_sh + i * prm.p_sk, prm.p_t);
    }
    float vv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) vv[c] = load_act(v, b * prm.v_sb + h * prm.v_sh + (col + c) * prm.v_sv, prm.v_t);
    const float bt = load_act(beta, b * prm.beta_sb + h * prm.beta_sh, prm.beta_t);
    const float e = expf(load_act(g, b * prm.g_sb + h * prm.g_sh, prm.g_t));
    __syncwarp();

    // 3. One pass: S^T p, S^T q and q.k over this lane's rows.
    float sp[4] = {0.f, 0.f, 0.f, 0.f};
    float sq[4] = {0.f, 0.f, 0.f, 0.f};
    float qk = 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = i * RG + rg;
        const float pr = ps[r], qr = qs[r];
        sp[0] = fmaf(pr, s[i].x, sp[0]); sq[0] = fmaf(qr, s[i].x, sq[0]);
        sp[1] = fmaf(pr, s[i].y, sp[1]); sq[1] = fmaf(qr, s[i].y, sq[1]);
        sp[2] = fmaf(pr, s[i].z, sp[2]); sq[2] = fmaf(qr, s[i].z, sq[2]);
        sp[3] = fmaf(pr, s[i].w, sp[3]); sq[3] = fmaf(qr, s[i].w, sq[3]);
        qk = fmaf(qr, ks[r], qk);
    }
    // Lanes of one column group differ in bits LC, 2LC, ..., 16 of the lane id.
#pragma unroll
    for (int off = LC; off < 32; off <<= 1) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            sp[c] += __shfl_xor_sync(0xffffffffu, sp[c], off);
            sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], off);
        }
        qk += __shfl_xor_sync(0xffffffffu, qk, off);
    }

    float u[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = bt * (vv[c] - e * sp[c]);

    // 4. Rank-1 write with the decay folded in; the state leaves exactly once.
    float* dst = state_out + head + col;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const float kr = ks[i * RG + rg];
        float4 n;
        n.x = fmaf(e, s[i].x, kr * u[0]);
        n.y = fmaf(e, s[i].y, kr * u[1]);
        n.z = fmaf(e, s[i].z, kr * u[2]);
        n.w = fmaf(e, s[i].w, kr * u[3]);
        store_stream(dst + static_cast<long long>(i * RG + rg) * prm.V, n);
    }

    // 5. o: lane group 0 holds the whole reduction for its four columns.
    if (rg == 0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float oc = scale * fmaf(e, sq[c], qk * u[c]);
            store_act(o, b * prm.o_sb + h * prm.o_sh + (col + c) * prm.o_sv, prm.o_t, oc);
        }
    }
}

}  // namespace comba
