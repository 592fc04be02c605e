// decode_step.cu -- one decode step of the gated delta rule (Comba, or Gated DeltaNet when
// p = k) for a whole batch.  The fp32 state is read once and written once: the whole cost.
//
// Math per (b, h), with S = state[b, h] (K x V) and gate e = exp(g) ("log") or g ("linear"):
//
//   u[j]       = beta * (v[j] - e * sum_i p[i] S[i,j])        correction read with p
//   S_new[i,j] = e * S[i,j] + k[i] * u[j]                     rank-1 write with k
//   o[j]       = scale * sum_i q[i] S_new[i,j]
//              = scale * (e * sum_i q[i] S[i,j] + (q.k) * u[j])
//
// The second form of o lets both K-reductions (with p and with q) and q.k come from ONE pass
// over the state held in registers.  With use_qk_l2norm, q, k and p are divided by
// sqrt(sum x^2 + 1e-6); the kernels reduce with the raw vectors and scale the three sums (and
// the k of the write) by those factors, so the option costs no extra pass.
//
// Layouts: state and state_out C-contiguous float32, 16-byte aligned, [B, H, K, V] ("kv") or
// [B, H, V, K] ("vk", the same S stored transposed); activations as in params.cuh (any
// strides, f32 / f16 / bf16, head h reads key head h / group).
//
// decode_step_kv<K, COLS, RG, SEPARATE_P> -- one CTA per (b, h, slab of COLS columns of V),
//   (COLS/4) x RG threads.  Thread (lc, rg) owns the float4 of columns 4lc .. 4lc+3 in rows
//   rg, rg + RG, ... (R = K/RG registers); a warp-wide load covers 128/COLS rows of COLS*4
//   contiguous bytes.  q, k, p pass through shared memory.  The partial column sums of the row
//   groups of a warp meet by shuffles, those of the warps in shared memory behind one barrier;
//   every thread adds them in the same order (so every row of a column applies the same u).
// decode_step_vk<K, R, NW, SEPARATE_P> -- one CTA per (b, h, slab of R*NW*(128/K) rows of V),
//   NW warps.  LK = K/4 lanes hold one float4 each along a K-row (a warp-wide load covers
//   128/K whole rows, 512 contiguous bytes); every lane owns R rows.  The per-row K-sums run
//   as a transposing butterfly: the LK lanes of a row group reduce LK values (LK/2 rows x
//   {S p, S q}) in LK-1 shuffles and each ends holding one finished sum.
//
// Why this shape: ~16 float4 of state in flight per thread and many small independent CTAs
// per SM, each in its own phase (loading, reducing, storing), keep HBM busy in both
// directions; the state uses plain loads and stores (common.cuh says why).  The tilings are
// swept by benchmarks/sweep_decode.py and chosen per shape in cupy_comba/tiling.py.
#include "common.cuh"
#include "params.cuh"

namespace comba {

template <int K, int COLS, int RG, bool SEPARATE_P>
__global__ void __launch_bounds__(COLS / 4 * RG)
decode_step_kv(const float* state, float* state_out, const void* __restrict__ q, const void* __restrict__ k,
               const void* __restrict__ v, const void* __restrict__ p, const void* __restrict__ beta,
               const void* __restrict__ g, void* __restrict__ o, const Params prm, const float scale) {
    constexpr int LC = COLS / 4, NT = LC * RG, R = K / RG, NW = NT / 32;
    static_assert(NT % 32 == 0 && K % RG == 0 && R >= 1, "bad kv tiling");
    __shared__ float2 pq[K];              // (p, q) of each row: one 8-byte read per row in the pass
    __shared__ float kv[K];               // k of each row, for the write
    __shared__ float4 red[2][NW][LC];     // per-warp partial S^T p, S^T q
    __shared__ float4 dots[NW];           // per-warp partial q.k, |q|^2, |k|^2, |p|^2
    __shared__ __align__(16) float vs[COLS];   // v of the slab
    __shared__ float gates[2];            // beta, e

    const int tid = threadIdx.x, lc = tid % LC, rg = tid / LC, warp = tid >> 5;
    // 32-bit index math (the grid and the row offsets of one head fit), 64-bit addresses.
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    const int slabs = V / COLS;
    const int bh = static_cast<int>(blockIdx.x) / slabs;
    const int col = (static_cast<int>(blockIdx.x) - bh * slabs) * COLS + lc * 4;
    const int b = bh / H, h = bh - b * H, hk = h / static_cast<int>(prm.group);
    const long long head = static_cast<long long>(bh) * K * V;

    // 1. Every state load of the thread before anything else.
    float4 s[R];
    const float* src = state + head + col;
#pragma unroll
    for (int i = 0; i < R; ++i) s[i] = load_state(src + (rg + i * RG) * V);

    // 2. The small vectors while the state is in flight; q.k and the squared norms on the way.
    float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = tid; j < K; j += NT) {
        const float xq = load_act(q, b * prm.q_sb + hk * prm.q_sh + j * prm.q_sk, prm.q_t);
        const float xk = load_act(k, b * prm.k_sb + hk * prm.k_sh + j * prm.k_sk, prm.k_t);
        const float xp = SEPARATE_P ? load_act(p, b * prm.p_sb + hk * prm.p_sh + j * prm.p_sk, prm.p_t) : xk;
        pq[j] = make_float2(xp, xq);
        kv[j] = xk;
        d.x = fmaf(xq, xk, d.x);
        d.y = fmaf(xq, xq, d.y);
        d.z = fmaf(xk, xk, d.z);
        d.w = fmaf(xp, xp, d.w);
    }
    // v of the slab and the two gates: staged too, so no thread carries them through the pass.
    if (tid < COLS) {  // NT >= COLS always
        const long long c = col - lc * 4 + tid;
        vs[tid] = load_act(v, b * prm.v_sb + h * prm.v_sh + c * prm.v_sv, prm.v_t);
    }
    if (tid == NT - 1) gates[0] = load_act(beta, b * prm.beta_sb + h * prm.beta_sh, prm.beta_t);
    if (tid == NT - 2) gates[1] = gate_of(load_act(g, b * prm.g_sb + h * prm.g_sh, prm.g_t), prm.gate_linear);
    d.x = lane_sum(d.x, 1, 16);
    if (prm.l2norm) {
        d.y = lane_sum(d.y, 1, 16);
        d.z = lane_sum(d.z, 1, 16);
        d.w = lane_sum(d.w, 1, 16);
    }
    if ((tid & 31) == 0) dots[warp] = d;
    __syncthreads();

    // 3. One pass: S^T p and S^T q over this thread's rows.
    float sp[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const float2 x = pq[rg + i * RG];
        accumulate_pq(s[i], x.x, x.y, sp, sq);
    }
    // Row groups of one warp (lanes differing in bits LC .. 16) by shuffles, then the NW warps
    // through shared memory; every thread adds the warps in the same order.
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
    float4 P = red[0][0][lc], Q = red[1][0][lc], D = dots[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) {
        const float4 a = red[0][w][lc], c = red[1][w][lc], t = dots[w];
        P.x += a.x; P.y += a.y; P.z += a.z; P.w += a.w;
        Q.x += c.x; Q.y += c.y; Q.z += c.z; Q.w += c.w;
        D.x += t.x; D.y += t.y; D.z += t.z; D.w += t.w;
    }
    float fq = 1.f, fk = 1.f, fp = 1.f;
    if (prm.l2norm) {
        fq = rsqrtf(D.y + kL2NormEps);
        fk = rsqrtf(D.z + kL2NormEps);
        fp = SEPARATE_P ? rsqrtf(D.w + kL2NormEps) : fk;
    }
    const float qk = D.x * fq * fk;
    const float bt = gates[0], e = gates[1];
    const float4 vc = *reinterpret_cast<const float4*>(vs + lc * 4);
    const float u[4] = {bt * (vc.x - e * fp * P.x), bt * (vc.y - e * fp * P.y), bt * (vc.z - e * fp * P.z),
                        bt * (vc.w - e * fp * P.w)};
    const float uk[4] = {u[0] * fk, u[1] * fk, u[2] * fk, u[3] * fk};  // the raw k rows, normalised

    // 4. Rank-1 write with the decay folded in; the state leaves exactly once.
    float* dst = state_out + head + col;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = rg + i * RG;
        store_state(dst + r * V, decay_write(s[i], e, kv[r], uk));
    }
    if (rg == 0) {
        const float qs4[4] = {Q.x, Q.y, Q.z, Q.w};
        const long long ob = b * prm.o_sb + h * prm.o_sh;
#pragma unroll
        for (int c = 0; c < 4; ++c)
            store_act(o, ob + (col + c) * prm.o_sv, prm.o_t, scale * fmaf(e * fq, qs4[c], qk * u[c]));
    }
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, a.w * b.w)));
}

// One level of the transposing butterfly over x[0 .. 2*OFF): keep the half named by this lane's
// bit OFF, trade the other half with the lane across that bit; then recurse on x[0 .. OFF).
// After the levels OFF = LK/2 .. 1, lane kg holds the complete sum of value kg.  A template
// recursion rather than a loop so every index is a compile-time constant (no local memory).
template <int OFF, int N>
__device__ __forceinline__ void butterfly(float (&x)[N], int kg) {
    const bool upper = kg & OFF;
#pragma unroll
    for (int j = 0; j < OFF; ++j) {
        const float send = upper ? x[j] : x[j + OFF];
        const float keep = upper ? x[j + OFF] : x[j];
        x[j] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
    if constexpr (OFF > 1) butterfly<OFF / 2>(x, kg);
}

template <int K, int R, int NW, bool SEPARATE_P>
__global__ void __launch_bounds__(NW * 32)
decode_step_vk(const float* state, float* state_out, const void* __restrict__ q, const void* __restrict__ k,
               const void* __restrict__ v, const void* __restrict__ p, const void* __restrict__ beta,
               const void* __restrict__ g, void* __restrict__ o, const Params prm, const float scale) {
    constexpr int LK = K / 4, RPW = 32 / LK, HALF = LK / 2, ROWS = R * NW * RPW, NB = R / HALF;
    static_assert(R % HALF == 0, "bad vk tiling: a lane's rows must fill whole butterflies");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kg = lane % LK, hg = lane / LK;
    // 32-bit index math (the grid and the row offsets of one head fit), 64-bit addresses.
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    const int slabs = V / ROWS;
    const int bh = static_cast<int>(blockIdx.x) / slabs;
    const int slab0 = (static_cast<int>(blockIdx.x) - bh * slabs) * ROWS;
    const int b = bh / H, h = bh - b * H, hk = h / static_cast<int>(prm.group);
    const long long head = static_cast<long long>(bh) * V * K;
    // Row i of this lane; the RPW row groups of a warp read consecutive rows.
    auto row = [&](int i) { return slab0 + (i * NW + warp) * RPW + hg; };

    // 1. Every state load of the lane before anything else.
    float4 s[R];
    const float* src = state + head + kg * 4;
#pragma unroll
    for (int i = 0; i < R; ++i) s[i] = load_state(src + row(i) * K);

    // 2. This lane's four elements of q, k, p; v of the rows whose u it will compute.
    auto load4 = [&](const void* x, long long base, long long stride, long long dtype) {
        const long long i0 = base + (kg * 4) * stride;
        return make_float4(load_act(x, i0, dtype), load_act(x, i0 + stride, dtype),
                           load_act(x, i0 + 2 * stride, dtype), load_act(x, i0 + 3 * stride, dtype));
    };
    const float4 cq = load4(q, b * prm.q_sb + hk * prm.q_sh, prm.q_sk, prm.q_t);
    const float4 ck = load4(k, b * prm.k_sb + hk * prm.k_sh, prm.k_sk, prm.k_t);
    float4 cp = ck;
    if constexpr (SEPARATE_P) cp = load4(p, b * prm.p_sb + hk * prm.p_sh, prm.p_sk, prm.p_t);
    float vr[NB];
#pragma unroll
    for (int n = 0; n < NB; ++n)
        vr[n] = load_act(v, b * prm.v_sb + h * prm.v_sh + row(n * HALF + kg % HALF) * prm.v_sv, prm.v_t);
    const float bt = load_act(beta, b * prm.beta_sb + h * prm.beta_sh, prm.beta_t);
    const float e = gate_of(load_act(g, b * prm.g_sb + h * prm.g_sh, prm.g_t), prm.gate_linear);

    float fq = 1.f, fk = 1.f, fp = 1.f;
    if (prm.l2norm) {
        fq = rsqrtf(lane_sum(dot4(cq, cq), 1, HALF) + kL2NormEps);
        fk = rsqrtf(lane_sum(dot4(ck, ck), 1, HALF) + kL2NormEps);
        fp = SEPARATE_P ? rsqrtf(lane_sum(dot4(cp, cp), 1, HALF) + kL2NormEps) : fk;
    }
    const float qk = lane_sum(dot4(cq, ck), 1, HALF) * fq * fk;

    // 3. Row sums by butterflies of LK values: HALF rows x {S p, S q} per butterfly.
    const bool p_lane = kg < HALF;  // ends with S p of row n*HALF + kg, else S q of row n*HALF + kg - HALF
    const long long ob = b * prm.o_sb + h * prm.o_sh;
    float ub[NB];                   // u of row n*HALF + kg % HALF
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        float x[LK];
#pragma unroll
        for (int j = 0; j < HALF; ++j) {
            x[j] = dot4(cp, s[n * HALF + j]);
            x[HALF + j] = dot4(cq, s[n * HALF + j]);
        }
        butterfly<HALF>(x, kg);
        const float sum = x[0] * (p_lane ? fp : fq);
        const float u = bt * (vr[n] - e * sum);                       // valid on the p lanes
        const float u_pair = __shfl_xor_sync(0xffffffffu, u, HALF);  // the q lanes get their row's u
        if (!p_lane) store_act(o, ob + row(n * HALF + kg - HALF) * prm.o_sv, prm.o_t, scale * fmaf(e, sum, qk * u_pair));
        ub[n] = p_lane ? u : u_pair;
    }

    // 4. Rank-1 write with the decay folded in.
    const float4 kn = make_float4(ck.x * fk, ck.y * fk, ck.z * fk, ck.w * fk);
    float* dst = state_out + head + kg * 4;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const float ui = __shfl_sync(0xffffffffu, ub[i / HALF], hg * LK + i % HALF);
        store_state(dst + row(i) * K, make_float4(fmaf(e, s[i].x, kn.x * ui), fmaf(e, s[i].y, kn.y * ui),
                                                  fmaf(e, s[i].z, kn.z * ui), fmaf(e, s[i].w, kn.w * ui)));
    }
}

}  // namespace comba
