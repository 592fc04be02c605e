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
// Two kernels compute this step; the op picks one per shape (comba.py's
// choose_launch, from the H200 sweep in benchmarks/sweep_decode.py):
//
// comba_decode_step<K, COLS, KS> -- warp slabs (small and mid batches, K = 64).
//   A task is (b, h, slab of COLS columns of V), handled by KS warps that split
//   the K axis (KS = 1: one warp holds the whole K axis).  In a warp, lanes form
//   an LC x RG grid: LC = COLS/4 lanes across the slab, one float4 of columns
//   each, RG = 32/LC lane groups down K; lane group rg owns rows rg, rg+RG, ...
//   of its warp's K/KS rows (R float4 registers).  One warp-wide load covers RG
//   consecutive rows x COLS*4 contiguous bytes.  The K reduction is an
//   in-register sum and log2(RG) xor-shuffles; with KS > 1 the KS partials meet
//   in shared memory behind a named barrier for those warps only, so tasks stay
//   independent and one task's loads overlap another's stores.  Block = 4 warps
//   = 4/KS tasks; grid = ceil(tasks / (4/KS)).
//
// comba_decode_step_pipelined<K, RG> -- large batches at K = 128.  A persistent
//   CTA walks the heads t = blockIdx.x, blockIdx.x + gridDim.x, ...  Each head's
//   state is one contiguous K*V*4-byte tile that the bulk copy engine lands in
//   a ring of nstage shared-memory slots, up to nstage heads ahead of the one
//   being computed, so reads stay in flight while the CTA computes and streams
//   the previous head's writes out.  Block = (V/4) x RG threads: thread (cg, rg)
//   owns columns 4cg..4cg+3 and rows rg, rg+RG, ... (R = K/RG).  Pass 1 copies
//   its R float4 from the slot into registers and forms partial S^T p, S^T q,
//   q.k; the partials meet in shared memory (barrier 1, after which the slot
//   goes back to the copy engine) and one thread per column group sums them
//   (barrier 2).  Pass 2 writes the new state from registers with streaming
//   128-bit stores, each warp whole 512-byte rows.  The next head's small
//   vectors are loaded into registers during this head and parked in a
//   double-buffered shared scratch.  Grid = min(heads, SMs x CTAs per SM).
//
// The state is 16-byte aligned (checked by the op) and touched once per
// launch, hence streaming cache hints throughout.
#include "common.cuh"
#include "bulk_copy.cuh"

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

// The pipelined kernel: the largest tile (K*V floats) it accepts, and its
// prefetch registers per thread for the small vectors (3K + V + 2 floats over
// at least 8*RG threads).
constexpr int kMaxTileFloats = 16384;
template <int K, int RG>
__host__ __device__ constexpr int prefetch_slots() {
    return (3 * K + kMaxTileFloats / K + 2 + 8 * RG - 1) / (8 * RG);
}

template <int K, int COLS, int KS>
__global__ void __launch_bounds__(kDecodeWarps * 32)
comba_decode_step(const float* state, float* state_out,
                  const void* __restrict__ q, const void* __restrict__ k,
                  const void* __restrict__ v, const void* __restrict__ p,
                  const void* __restrict__ beta, const void* __restrict__ g,
                  void* __restrict__ o, const DecodeParams prm, const float scale) {
    constexpr int LC = COLS / 4;   // lanes across the slab
    constexpr int RG = 32 / LC;    // lane groups down K
    constexpr int KR = K / KS;     // rows of K per warp (KS warps share a task)
    constexpr int R = KR / RG;     // rows (float4 registers) per lane
    constexpr int TASKS = kDecodeWarps / KS;
    static_assert(KR % RG == 0 && R >= 1 && kDecodeWarps % KS == 0, "bad decode tiling");

    __shared__ float vec[kDecodeWarps][3][K];       // q, k, p rows of each warp
    __shared__ float4 xred[kDecodeWarps][2][LC];    // per-warp S^T p, S^T q (KS > 1)
    __shared__ float xqk[kDecodeWarps];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int ks = warp % KS;
    const long long slabs = prm.V / COLS;
    const long long task = static_cast<long long>(blockIdx.x) * TASKS + warp / KS;
    if (task >= prm.B * prm.H * slabs) return;  // the KS warps of a task leave together

    const long long bh = task / slabs;
    const int slab = static_cast<int>(task - bh * slabs);
    const long long b = bh / prm.H;
    const long long h = bh - b * prm.H;
    const long long hk = h / prm.group;
    const int lc = lane % LC;
    const int rg = lane / LC;
    const int row0 = ks * KR + rg;
    const long long col = static_cast<long long>(slab) * COLS + lc * 4;

    // 1. Issue every state load of the task before anything else: R x 16 B
    //    in flight per lane is what keeps HBM busy.
    const long long head = bh * K * prm.V;
    const float* src = state + head + col;
    float4 s[R];
#pragma unroll
    for (int i = 0; i < R; ++i) s[i] = load_stream(src + static_cast<long long>(row0 + i * RG) * prm.V);

    // 2. Small vectors (this warp's rows) while the state is in flight.
    float* qs = vec[warp][0];
    float* ks_ = vec[warp][1];
    float* ps = vec[warp][2];
#pragma unroll
    for (int i = lane; i < KR; i += 32) {
        const long long r = ks * KR + i;
        qs[r] = load_act(q, b * prm.q_sb + hk * prm.q_sh + r * prm.q_sk, prm.q_t);
        ks_[r] = load_act(k, b * prm.k_sb + hk * prm.k_sh + r * prm.k_sk, prm.k_t);
        ps[r] = load_act(p, b * prm.p_sb + hk * prm.p_sh + r * prm.p_sk, prm.p_t);
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
        const int r = row0 + i * RG;
        accumulate_pq(s[i], ps[r], qs[r], sp, sq);
        qk = fmaf(qs[r], ks_[r], qk);
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
    if constexpr (KS > 1) {
        // The KS warps of a task meet at a named barrier (id 1 + task slot):
        // no CTA-wide sync, so other tasks of the block run on undisturbed.
        if (rg == 0) {
            xred[warp][0][lc] = make_float4(sp[0], sp[1], sp[2], sp[3]);
            xred[warp][1][lc] = make_float4(sq[0], sq[1], sq[2], sq[3]);
            if (lc == 0) xqk[warp] = qk;
        }
        asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / KS), "r"(KS * 32) : "memory");
        const int first = warp - ks;
        float4 P = xred[first][0][lc], Q = xred[first][1][lc];
        qk = xqk[first];
#pragma unroll
        for (int w = 1; w < KS; ++w) {  // same order in every warp: identical u everywhere
            const float4 a = xred[first + w][0][lc], c = xred[first + w][1][lc];
            P.x += a.x; P.y += a.y; P.z += a.z; P.w += a.w;
            Q.x += c.x; Q.y += c.y; Q.z += c.z; Q.w += c.w;
            qk += xqk[first + w];
        }
        sp[0] = P.x; sp[1] = P.y; sp[2] = P.z; sp[3] = P.w;
        sq[0] = Q.x; sq[1] = Q.y; sq[2] = Q.z; sq[3] = Q.w;
    }

    float u[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = bt * (vv[c] - e * sp[c]);

    // 4. Rank-1 write with the decay folded in; the state leaves exactly once.
    float* dst = state_out + head + col;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = row0 + i * RG;
        const float kr = ks_[r];
        store_stream(dst + static_cast<long long>(r) * prm.V, decay_write(s[i], e, kr, u));
    }

    // 5. o: lane group 0 of the task's first warp holds the whole reduction.
    if (rg == 0 && ks == 0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float oc = scale * fmaf(e, sq[c], qk * u[c]);
            store_act(o, b * prm.o_sb + h * prm.o_sh + (col + c) * prm.o_sv, prm.o_t, oc);
        }
    }
}

// ---------------------------------------------------------------------------
// Pipelined (bulk-copy ring) kernel.  Dynamic shared memory, in order:
//   bars[nstage] (u64, padded to 128 B) | tiles[nstage][K*V] | vecs[2][NV]
//   | red[2][RG][V/4] (float4) | tot[2][V/4] (float4) | qkred[RG + 1]
// with NV = 3K + V + 2 rounded up to a multiple of 4: q | k | p | v | beta, g.
template <int K, int RG>
__global__ void __launch_bounds__(kMaxTileFloats / K / 4 * RG)  // (V/4) x RG threads at the largest V
comba_decode_step_pipelined(const float* state, float* state_out,
                            const void* __restrict__ q, const void* __restrict__ k,
                            const void* __restrict__ v, const void* __restrict__ p,
                            const void* __restrict__ beta, const void* __restrict__ g,
                            void* __restrict__ o, const DecodeParams prm, const float scale,
                            const int nstage) {
    constexpr int R = K / RG;
    constexpr int PF = prefetch_slots<K, RG>();
    const int V = static_cast<int>(prm.V);
    const int CG = V / 4;
    const int T = CG * RG;
    const int tid = threadIdx.x;
    const int cg = tid % CG;
    const int rg = tid / CG;
    const int tile = K * V;
    const int NV = (3 * K + V + 2 + 3) & ~3;
    const long long heads = prm.B * prm.H;

    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem);
    float* tiles = reinterpret_cast<float*>(smem + ((nstage * 8 + 127) & ~127));
    float* vecs = tiles + nstage * tile;
    float4* red = reinterpret_cast<float4*>(vecs + 2 * NV);   // [2][RG][CG]: S^T p, S^T q partials
    float4* tot = red + 2 * RG * CG;                           // [2][CG]: their sums
    float* qkred = reinterpret_cast<float*>(tot + 2 * CG);     // [RG] partials of q.k, then the sum

    // Small vectors of head t -> registers (element j of the concatenation).
    float pf[PF];
    auto prefetch = [&](long long t) {
        const long long b = t / prm.H, h = t - b * prm.H, hk = h / prm.group;
#pragma unroll
        for (int s = 0; s < PF; ++s) {
            const int j = tid + s * T;
            float x = 0.f;
            if (j < K) x = load_act(q, b * prm.q_sb + hk * prm.q_sh + j * prm.q_sk, prm.q_t);
            else if (j < 2 * K) x = load_act(k, b * prm.k_sb + hk * prm.k_sh + (j - K) * prm.k_sk, prm.k_t);
            else if (j < 3 * K) x = load_act(p, b * prm.p_sb + hk * prm.p_sh + (j - 2 * K) * prm.p_sk, prm.p_t);
            else if (j < 3 * K + V) x = load_act(v, b * prm.v_sb + h * prm.v_sh + (j - 3 * K) * prm.v_sv, prm.v_t);
            else if (j == 3 * K + V) x = load_act(beta, b * prm.beta_sb + h * prm.beta_sh, prm.beta_t);
            else if (j == 3 * K + V + 1) x = load_act(g, b * prm.g_sb + h * prm.g_sh, prm.g_t);
            pf[s] = x;
        }
    };
    auto park = [&](int buf) {
#pragma unroll
        for (int s = 0; s < PF; ++s) {
            const int j = tid + s * T;
            if (j < NV) vecs[buf * NV + j] = pf[s];
        }
    };
    auto issue = [&](int stage, long long t) {
        const unsigned bytes = static_cast<unsigned>(tile) * 4u;
        mbar_arrive_expect_tx(&bars[stage], bytes);
        bulk_load(tiles + static_cast<long long>(stage) * tile, state + t * tile, bytes, &bars[stage]);
    };

    if (tid == 0) {
        for (int s = 0; s < nstage; ++s) mbar_init(&bars[s], 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (tid == 0) {
        for (int s = 0; s < nstage; ++s) {
            const long long t = blockIdx.x + static_cast<long long>(s) * gridDim.x;
            if (t < heads) issue(s, t);
        }
    }
    if (blockIdx.x < heads) {
        prefetch(blockIdx.x);
        park(0);
    }

    int i = 0;
    for (long long t = blockIdx.x; t < heads; t += gridDim.x, ++i) {
        const int stage = i % nstage;
        const int buf = i & 1;
        if (t + gridDim.x < heads) prefetch(t + gridDim.x);
        __syncthreads();  // vecs[buf] parked by every thread
        mbar_wait(&bars[stage], static_cast<unsigned>(i / nstage) & 1u);

        const float* vq = vecs + buf * NV;
        const float* vk = vq + K;
        const float* vp = vq + 2 * K;
        const float* vv = vq + 3 * K;
        const float* slot = tiles + static_cast<long long>(stage) * tile + cg * 4;

        // Pass 1: this thread's rows into registers, partial reductions.
        float4 s[R];
        float sp[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, qk = 0.f;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const int r = j * RG + rg;
            s[j] = *reinterpret_cast<const float4*>(slot + r * V);
            accumulate_pq(s[j], vp[r], vq[r], sp, sq);
            qk = fmaf(vq[r], vk[r], qk);
        }
        red[rg * CG + cg] = make_float4(sp[0], sp[1], sp[2], sp[3]);
        red[(RG + rg) * CG + cg] = make_float4(sq[0], sq[1], sq[2], sq[3]);
        if (cg == 0) qkred[rg] = qk;
        __syncthreads();  // partials visible; every thread is done reading the slot

        if (tid == 0) {
            const long long next = t + static_cast<long long>(nstage) * gridDim.x;
            if (next < heads) {
                fence_proxy_async_shared();
                issue(stage, next);
            }
        }
        // Row groups -> totals: one thread per column group sums the RG partials
        // (every thread summing them would read RG times more shared memory).
        if (rg == 0) {
            float4 P = red[cg], Q = red[RG * CG + cg];
#pragma unroll
            for (int w = 1; w < RG; ++w) {
                const float4 a = red[w * CG + cg], c = red[(RG + w) * CG + cg];
                P.x += a.x; P.y += a.y; P.z += a.z; P.w += a.w;
                Q.x += c.x; Q.y += c.y; Q.z += c.z; Q.w += c.w;
            }
            tot[cg] = P;
            tot[CG + cg] = Q;
            if (cg == 0) {
                float QK = 0.f;
#pragma unroll
                for (int w = 0; w < RG; ++w) QK += qkred[w];
                qkred[RG] = QK;
            }
        }
        __syncthreads();  // totals visible
        const float4 P = tot[cg], Q = tot[CG + cg];
        const float QK = qkred[RG];
        const float bt = vv[V], e = expf(vv[V + 1]);
        const float4 vc = *reinterpret_cast<const float4*>(vv + cg * 4);
        const float u[4] = {bt * (vc.x - e * P.x), bt * (vc.y - e * P.y), bt * (vc.z - e * P.z),
                            bt * (vc.w - e * P.w)};

        const long long b = t / prm.H, h = t - b * prm.H;
        if (rg == 0) {
            const long long ob = b * prm.o_sb + h * prm.o_sh + static_cast<long long>(cg * 4) * prm.o_sv;
            store_act(o, ob, prm.o_t, scale * fmaf(e, Q.x, QK * u[0]));
            store_act(o, ob + prm.o_sv, prm.o_t, scale * fmaf(e, Q.y, QK * u[1]));
            store_act(o, ob + 2 * prm.o_sv, prm.o_t, scale * fmaf(e, Q.z, QK * u[2]));
            store_act(o, ob + 3 * prm.o_sv, prm.o_t, scale * fmaf(e, Q.w, QK * u[3]));
        }

        // Pass 2: rank-1 write with the decay folded in, straight from registers.
        float* dst = state_out + t * tile + cg * 4;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const int r = j * RG + rg;
            const float kr = vk[r];
            store_stream(dst + r * V, decay_write(s[j], e, kr, u));
        }
        park(buf ^ 1);
    }
}

}  // namespace comba
