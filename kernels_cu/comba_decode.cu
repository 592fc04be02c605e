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
// Two kernels compute this step; the op picks one per shape (comba.py):
//
// comba_decode_step_pipelined -- large batches.  A persistent CTA walks the
// heads t = blockIdx.x, blockIdx.x + gridDim.x, ...  Each head's state is one
// contiguous K*V*4-byte tile that the bulk copy engine lands in a ring of
// NSTAGE shared-memory slots, NSTAGE-1 heads ahead of the one being computed,
// so HBM always has reads in flight while the CTA computes and streams the
// previous head's writes out.  (A kernel that loads, reduces, then stores
// leaves all SMs reading together and then writing together; measured on an
// H200 that costs a quarter of the bandwidth.)
//   Block = (V/4) x RG threads: thread (cg, rg) owns columns 4cg..4cg+3 and
//   rows rg*R .. rg*R+R-1, R = K/RG.  Pass 1 reads its R float4 from the slot
//   into registers and forms partial S^T p, S^T q, q.k; partials meet in
//   shared memory (one barrier, after which the slot is handed back to the
//   copy engine), one thread per column group sums them (a second barrier).  Pass 2 writes the new state from registers with streaming
//   128-bit stores (a warp writes whole 512-byte rows).  The small vectors of
//   the next head are loaded into registers during this head and parked in a
//   double-buffered shared scratch, so their latency is never exposed.
//   Grid = min(heads, SMs): one CTA per SM (its ring takes most of the shared
//   memory).
//
// comba_decode_step -- small batches and tiles too large for the ring.
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
            const float pr = vp[r], qr = vq[r];
            sp[0] = fmaf(pr, s[j].x, sp[0]); sq[0] = fmaf(qr, s[j].x, sq[0]);
            sp[1] = fmaf(pr, s[j].y, sp[1]); sq[1] = fmaf(qr, s[j].y, sq[1]);
            sp[2] = fmaf(pr, s[j].z, sp[2]); sq[2] = fmaf(qr, s[j].z, sq[2]);
            sp[3] = fmaf(pr, s[j].w, sp[3]); sq[3] = fmaf(qr, s[j].w, sq[3]);
            qk = fmaf(qr, vk[r], qk);
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
        const float u0 = bt * (vc.x - e * P.x), u1 = bt * (vc.y - e * P.y);
        const float u2 = bt * (vc.z - e * P.z), u3 = bt * (vc.w - e * P.w);

        const long long b = t / prm.H, h = t - b * prm.H;
        if (rg == 0) {
            const long long ob = b * prm.o_sb + h * prm.o_sh + static_cast<long long>(cg * 4) * prm.o_sv;
            store_act(o, ob, prm.o_t, scale * fmaf(e, Q.x, QK * u0));
            store_act(o, ob + prm.o_sv, prm.o_t, scale * fmaf(e, Q.y, QK * u1));
            store_act(o, ob + 2 * prm.o_sv, prm.o_t, scale * fmaf(e, Q.z, QK * u2));
            store_act(o, ob + 3 * prm.o_sv, prm.o_t, scale * fmaf(e, Q.w, QK * u3));
        }

        // Pass 2: rank-1 write with the decay folded in, straight from registers.
        float* dst = state_out + t * tile + cg * 4;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const int r = j * RG + rg;
            const float kr = vk[r];
            store_stream(dst + r * V, make_float4(fmaf(e, s[j].x, kr * u0), fmaf(e, s[j].y, kr * u1),
                                                  fmaf(e, s[j].z, kr * u2), fmaf(e, s[j].w, kr * u3)));
        }
        park(buf ^ 1);
    }
}

// ---------------------------------------------------------------------------
// Head-per-CTA kernel: one CTA of (V/4) x RG threads per head, every state
// element loaded straight into registers with 128-bit loads (a warp reads or
// writes whole V-rows), no shared-memory staging of the state.  Small
// register footprints (R = K/RG float4) give 32-64 warps per SM, and that
// many independent load/store streams are what the H200's memory system needs.
// Static shared memory: red[2][RG][V/4] (float4) | tot[2][V/4] | qkred[RG + 1].
template <int K, int RG>
__global__ void __launch_bounds__(32 * RG)  // V <= 128
comba_decode_step_head(const float* state, float* state_out,
                       const void* __restrict__ q, const void* __restrict__ k,
                       const void* __restrict__ v, const void* __restrict__ p,
                       const void* __restrict__ beta, const void* __restrict__ g,
                       void* __restrict__ o, const DecodeParams prm, const float scale) {
    constexpr int R = K / RG;
    const int V = static_cast<int>(prm.V);
    const int CG = V / 4;
    const int tid = threadIdx.x;
    const int cg = tid % CG;
    const int rg = tid / CG;
    const long long t = blockIdx.x;
    const long long b = t / prm.H, h = t - b * prm.H, hk = h / prm.group;

    extern __shared__ __align__(16) float4 shm[];
    float4* red = shm;                                          // [2][RG][CG]
    float4* tot = red + 2 * RG * CG;                            // [2][CG]
    float* qkred = reinterpret_cast<float*>(tot + 2 * CG);      // [RG + 1]

    // 1. State first, then this thread's rows of q, k, p and columns of v.
    const float* src = state + t * K * V + cg * 4;
    float4 s[R];
#pragma unroll
    for (int j = 0; j < R; ++j) s[j] = load_stream(src + (j * RG + rg) * V);
    float qr[R], kr[R], pr[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
        const long long r = j * RG + rg;
        qr[j] = load_act(q, b * prm.q_sb + hk * prm.q_sh + r * prm.q_sk, prm.q_t);
        kr[j] = load_act(k, b * prm.k_sb + hk * prm.k_sh + r * prm.k_sk, prm.k_t);
        pr[j] = load_act(p, b * prm.p_sb + hk * prm.p_sh + r * prm.p_sk, prm.p_t);
    }
    float vv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) vv[c] = load_act(v, b * prm.v_sb + h * prm.v_sh + (cg * 4 + c) * prm.v_sv, prm.v_t);
    const float bt = load_act(beta, b * prm.beta_sb + h * prm.beta_sh, prm.beta_t);
    const float e = expf(load_act(g, b * prm.g_sb + h * prm.g_sh, prm.g_t));

    // 2. Partial S^T p, S^T q, q.k over this thread's rows.
    float sp[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, qk = 0.f;
#pragma unroll
    for (int j = 0; j < R; ++j) {
        sp[0] = fmaf(pr[j], s[j].x, sp[0]); sq[0] = fmaf(qr[j], s[j].x, sq[0]);
        sp[1] = fmaf(pr[j], s[j].y, sp[1]); sq[1] = fmaf(qr[j], s[j].y, sq[1]);
        sp[2] = fmaf(pr[j], s[j].z, sp[2]); sq[2] = fmaf(qr[j], s[j].z, sq[2]);
        sp[3] = fmaf(pr[j], s[j].w, sp[3]); sq[3] = fmaf(qr[j], s[j].w, sq[3]);
        qk = fmaf(qr[j], kr[j], qk);
    }
    red[rg * CG + cg] = make_float4(sp[0], sp[1], sp[2], sp[3]);
    red[(RG + rg) * CG + cg] = make_float4(sq[0], sq[1], sq[2], sq[3]);
    if (cg == 0) qkred[rg] = qk;
    __syncthreads();

    // 3. One thread per column group sums the row groups.
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
    __syncthreads();
    const float4 P = tot[cg];
    const float u0 = bt * (vv[0] - e * P.x), u1 = bt * (vv[1] - e * P.y);
    const float u2 = bt * (vv[2] - e * P.z), u3 = bt * (vv[3] - e * P.w);
    if (rg == 0) {
        const float4 Q = tot[CG + cg];
        const float QK = qkred[RG];
        const long long ob = b * prm.o_sb + h * prm.o_sh + static_cast<long long>(cg * 4) * prm.o_sv;
        store_act(o, ob, prm.o_t, scale * fmaf(e, Q.x, QK * u0));
        store_act(o, ob + prm.o_sv, prm.o_t, scale * fmaf(e, Q.y, QK * u1));
        store_act(o, ob + 2 * prm.o_sv, prm.o_t, scale * fmaf(e, Q.z, QK * u2));
        store_act(o, ob + 3 * prm.o_sv, prm.o_t, scale * fmaf(e, Q.w, QK * u3));
    }

    // 4. Rank-1 write with the decay folded in.
    float* dst = state_out + t * K * V + cg * 4;
#pragma unroll
    for (int j = 0; j < R; ++j) {
        store_stream(dst + (j * RG + rg) * V, make_float4(fmaf(e, s[j].x, kr[j] * u0), fmaf(e, s[j].y, kr[j] * u1),
                                                          fmaf(e, s[j].z, kr[j] * u2), fmaf(e, s[j].w, kr[j] * u3)));
    }
}

}  // namespace comba
