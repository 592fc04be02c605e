// prefill_prep.cuh -- prefill_prep, the coefficients of every chunk of every value head at once: the decays, the
// Gram products, A = (I + L)^-1 diag(beta), Mq and the per-token factors of prefill.cuh's math, into one record a
// (chunk slot, value head) of the workspace for each scan's ACC.  Built into the modules of the scans (prefill.cu,
// prefill_wgmma.cu, prefill_transposed.cu).
//
// Launch geometry.  One 128-thread CTA a (chunk slot, value head), its keys staged in shared memory (PrepLayout);
// the Gram tiles on or below the diagonal shared out evenly over the four warps, each warp applying its tiles'
// decays as it stores them, threads 0 .. 63 the diagonal blocks' substitution, one column each, and the four warps
// the blocks below the diagonal on mma.sync.  Where a segmented pass's launches are dependents the prep runs in two
// launches around the chain (PrepSplit).
#pragma once
#include "prefill.cuh"

namespace comba {

// ---------------------------------------------------------------------------------------------------
// prefill_prep: the coefficients of one chunk of one value head (prefill.cuh's header, "Math").  The chunk's rows
// of q, k and p are staged first (bf16 by cp.async, or as floats); the Gram products then run from shared
// memory, the 20 tiles on or below the diagonal of each shared out evenly, five a warp over all the
// keys (GramTiles), each written once.
//
// Shared memory: q's rows at 0, k's at KEY_BYTES, p's at P_AT; once the Gram products are in registers, L (then
// X = (I + L)^-1, which takes L's place: x_entry) and Mq at 0 and GRAM_BYTES / 2, and the off-diagonal solve's
// 16 x 8 scratch a warp at ZW_AT, over q and k.  Gated DeltaNet's k, handed over as p, is staged once, at
// KEY_BYTES, and its CTA needs SHARED_P_BYTES (the launch passes BYTES or SHARED_P_BYTES by the op).
//
// Gram rows are 68 floats: S = 4 (mod 32) makes the solve's A-operand reads and the fragments' output (rows
// lg, columns lj of a tile) free of bank conflicts, and the transposed reads (rows lj, columns lg) and the Gram
// products' 8-byte stores two-way at most.  At K = 128 Comba's three staged bf16 key arrays are 55.3 KB, four
// CTAs an SM; Gated DeltaNet's two 36.9 KB, five (its registers allow no more).
template <int K, bool K32>
struct PrepLayout {
    static constexpr int KP = K + 16, ES = K32 ? 4 : 2, S = kPrefillChunk + 4;
    static constexpr int KEY_BYTES = kPrefillChunk * KP * ES;
    static constexpr int GRAM_BYTES = 4 * 2 * kPrefillChunk * S;  // L (then X) and Mq
    static constexpr int ZW_AT = GRAM_BYTES, ZW_BYTES = 4 * 4 * 16 * 8;
    static constexpr int P_AT = 2 * KEY_BYTES > ZW_AT + ZW_BYTES ? 2 * KEY_BYTES : ZW_AT + ZW_BYTES;
    static constexpr int BYTES = P_AT + KEY_BYTES, SHARED_P_BYTES = P_AT;
};

// One step of an inclusive product scan over lanes `delta` apart: x times the value of the lane `delta` below, where
// there is one.
__device__ __forceinline__ float scan_up_product(float x, int delta) {
    float y;
    asm("{\n .reg .pred p;\n shfl.sync.up.b32 %0|p, %1, %2, 0, 0xffffffff;\n @!p mov.f32 %0, 0f3F800000;\n}\n"
        : "=f"(y) : "f"(x), "r"(delta));
    return x * y;
}

// Entry (r, c) of X = (I + L)^-1, r on or below c's block: the diagonal blocks stand where L's did, those below
// the diagonal transposed into the blocks above it (which L never uses).
__device__ __forceinline__ float x_entry(const float* xs, int r, int c) {
    constexpr int S = kPrefillChunk + 4;
    return (r >> 4) == (c >> 4) ? xs[r * S + c] : xs[c * S + r];
}

// Warp w's Gram tiles (16 x 8, on or below the diagonal): row tile M0's column tiles 0 .. N0 - 1, then
// row tile M1's C1 .. C1 + 4 - N0 -- five a warp: {0: 0-1, 3: 0-2}, {3: 3-7}, {1: 0-3, 2: 0}, {2: 1-5}.
template <int W>
struct GramTiles {
    static constexpr int M0 = W == 0 ? 0 : W == 1 ? 3 : W == 2 ? 1 : 2;
    static constexpr int N0 = W == 0 ? 2 : W == 1 ? 5 : W == 2 ? 4 : 5;
    static constexpr int C0 = W == 1 ? 3 : W == 3 ? 1 : 0;
    static constexpr int M1 = W == 0 ? 3 : 2, C1 = 0, N1 = 5 - N0;
};

// A lower-triangular 64 x 64 matrix into prefill_prep's ACC 6 record (WtRecord) as prefill_scan_wt's B tile: uint4
// i holds columns 8 (i / 64) .. + 7 of row t = i % 64, zeros above the diagonal; row8(t, j, x) gives entries (t, j)
// .. (t, j + 7), j a multiple of 8; items first, first + stride, ...  Consecutive threads take consecutive rows:
// the stores are whole 512-byte lines, and a row's eight entries read as two float4 from rows of 68 floats fall in
// distinct banks for each eight threads.
template <class Row8>
__device__ __forceinline__ void wt_tile(float* at, Row8 row8, int first, int stride) {
    uint4* const words = reinterpret_cast<uint4*>(at);
#pragma unroll 4
    for (int i = first; i < 512; i += stride) {
        const int t = i & 63, j = 8 * (i >> 6);
        unsigned w[4] = {0u, 0u, 0u, 0u};
        if (j <= t) {
            float x[8];
            row8(t, j, x);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int c = j + 2 * u;
                w[u] = bf16_pair(c <= t ? x[2 * u] : 0.f, c < t ? x[2 * u + 1] : 0.f);
            }
        }
        words[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// Entries (t, j) .. (t, j + 7) of a matrix in rows of 68 floats, j a multiple of 8.
__device__ __forceinline__ void gram_row8(const float* m, int t, int j, float (&x)[8]) {
    constexpr int S = kPrefillChunk + 4;
    const float4 a = *reinterpret_cast<const float4*>(m + t * S + j);
    const float4 b = *reinterpret_cast<const float4*>(m + t * S + j + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// The prep of a segmented pass in two launches, where its kernels launch as programmatic dependents
// (cupy_comba/_plan.py): the lead part forms the chunks of every segment but a row's last, which are all the chain
// reads; the tail part, launched as the chain's dependent, forms the last segments' chunks beside the chain, in the
// room its CTAs leave an SM.  Dense batches only (a ragged batch's last segments lie scattered).  The lead part is a
// grid of B * lead_chunks * H CTAs, the tail part one of (H, B * tail_chunks): a CTA a (chunk, head) either way, in
// the order of the records.  The segments launch, the tail's dependent, awaits the tail's end, and the chain's
// through the workspace (kChainDoneWords).
struct PrepSplit {
    long long slot;  // this CTA's chunk slot
    int h;           // and value head
    __device__ __forceinline__ PrepSplit(const Params& prm) {
        // 32-bit: a row's chunks and a grid's CTAs fit (cupy_comba/_validate.py checks the grids)
        const unsigned H = static_cast<unsigned>(prm.H), rc = static_cast<unsigned>(row_chunks(prm));
        if (prm.seg_split) {
            const unsigned lc = static_cast<unsigned>(prm.seg_chunks), lead = ((rc + lc - 1) / lc - 1) * lc;
            if (gridDim.y > 1) {  // the tail part
                const unsigned i = blockIdx.y, n = rc - lead;
                slot = static_cast<long long>(i / n) * rc + lead + i % n, h = static_cast<int>(blockIdx.x);
                return;
            }
            const unsigned i = blockIdx.x / H;
            slot = static_cast<long long>(i / lead) * rc + i % lead, h = static_cast<int>(blockIdx.x % H);
            return;
        }
        slot = blockIdx.x / H, h = static_cast<int>(blockIdx.x % H);
    }
};

// Five CTAs an SM where they fit: with bf16 keys (ACC 0, 1 and 4-6) at K <= 128 a CTA needs at most 96 registers
// and 57.1 KB of shared memory (Comba: four CTAs an SM within its 228 KB) or 38.7 KB (Gated DeltaNet: five); wider
// keys stage twice the bytes.
template <int K, int ACC, bool SERVING>
__global__ void __launch_bounds__(kPrefillThreads, (ACC <= 1 || ACC >= 4) && K <= 128 ? 5 : 1)
prefill_prep(COMBA_PREFILL_ARGS) {
    // keys as they are (bf16), split or rounded; A and Mq rounded for a scan that reads them as they are
    constexpr bool K32 = ACC == 2 || ACC == 3;
    using R = PrepRecord<ACC>;
    constexpr int KM = ACC == 2 ? kSplit : ACC == 3 ? kRound : kExact, CM = ACC == 1 || ACC == 2 ? kSplit : kExact;
    constexpr bool KL = KM == kSplit;
    using Layout = PrepLayout<K, K32>;
    constexpr int C = kPrefillChunk, S = Layout::S, KP = Layout::KP, ES = Layout::ES;
    static_assert(K % 16 == 0 && kPrefillThreads == 2 * C, "keys in steps of 16; two threads a column");
    extern __shared__ __align__(128) unsigned char prefill_smem[];
    unsigned char* const sq = prefill_smem;
    // Gated DeltaNet hands k as p (the same array): its rows are staged once, where p's are
    const bool p_is_k = p == k && prm.p_sb == prm.k_sb && prm.p_st == prm.k_st && prm.p_sh == prm.k_sh &&
                        prm.p_sk == prm.k_sk && prm.p_t == prm.k_t;
    unsigned char* const sk = prefill_smem + Layout::KEY_BYTES;
    unsigned char* const sp = p_is_k ? sk : prefill_smem + Layout::P_AT;
    float* const gram_p = reinterpret_cast<float*>(prefill_smem);  // p_t . k_j, then L, then X = (I + L)^-1
    float* const gram_q = gram_p + C * S;                          // q_t . k_j, then Mq
    float* const xs = gram_p;
    // per token: the gate, beta, the L2-norm factors, and the decays within the token's block of 16
    __shared__ __align__(16) float e[C], bt[C], fq[C], fk[C], fp[C], ea[C], es[C];
    float* work = inter;
    launch_next();

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, lg = lane >> 2, lj = lane & 3;
    const int H = static_cast<int>(prm.H);
    // chunk slot `slot` of value head h
    auto prep_chunk = [&](const long long slot, const int h) {
        const int hk = h / static_cast<int>(prm.group);
        long long chunk;
        const int b = slot_row<SERVING>(cu_seqlens, prm, slot, chunk);
        const int T = tokens<SERVING>(cu_seqlens, prm, b, q, k, v, p, beta, g, o);
        if (chunk < 0 || chunk * C >= T) return;  // a slot of no chunk (ragged batches)
        const long long t0 = chunk * C;
        const int n = static_cast<int>(min(static_cast<long long>(C), T - t0));
        float* rec = work + (slot * H + h) * R::SIZE;

        // the gates' loads first (threads 0 .. 63, a token each), so that they arrive with the keys, not after them
        const bool token_in = tid < n;
        const HeadGating gating = head_gating<SERVING>(A_log, dt_bias, h);
        unsigned gbits = 0u, bbits = 0u;
        if (token_in) {
            gbits = load_bits(g, b * prm.g_sb + (t0 + tid) * prm.g_st + h * prm.g_sh, prm.g_t);
            bbits = load_bits(beta, b * prm.beta_sb + (t0 + tid) * prm.beta_st + h * prm.beta_sh, prm.beta_t);
        }
        stage_keys<K, ES, kPrefillThreads>(sq, q, b * prm.q_sb + t0 * prm.q_st + hk * prm.q_sh, prm.q_st, prm.q_sk,
                                           prm.q_t, n,
                                           rows_copyable(q, prm.q_sb, prm.q_st, prm.q_sh, prm.q_sk, prm.q_t, ES), tid);
        stage_keys<K, ES, kPrefillThreads>(sk, k, b * prm.k_sb + t0 * prm.k_st + hk * prm.k_sh, prm.k_st, prm.k_sk,
                                           prm.k_t, n,
                                           rows_copyable(k, prm.k_sb, prm.k_st, prm.k_sh, prm.k_sk, prm.k_t, ES), tid);
        if (!p_is_k)
            stage_keys<K, ES, kPrefillThreads>(sp, p, b * prm.p_sb + t0 * prm.p_st + hk * prm.p_sh, prm.p_st, prm.p_sk,
                                               prm.p_t, n,
                                               rows_copyable(p, prm.p_sb, prm.p_st, prm.p_sh, prm.p_sk, prm.p_t, ES),
                                               tid);
        copy_async_commit();

        // the gates (e = 1 and beta = 0 past the end), while the keys arrive
        if (tid < C) {
            e[tid] = token_in ? gate_of<SERVING>(bits_to_float(gbits, prm.g_t), prm, gating) : 1.f;
            bt[tid] = token_in ? beta_of<SERVING>(bits_to_float(bbits, prm.beta_t), prm, gating) : 0.f;
        }
        copy_async_wait<0>();
        __syncthreads();

        // the L2-norm factors (1 without use_qk_l2norm; 0 past the end)
        if (prm.l2norm) {
            for (int t = warp; t < C; t += 4) {
                float sq2 = 0.f, sk2 = 0.f, sp2 = 0.f;
                for (int key = 4 * lane; key < K; key += 128) {
                    const float4 a = staged4<ES>(sq + (t * KP + key) * ES);
                    const float4 c = staged4<ES>(sk + (t * KP + key) * ES);
                    const float4 d = staged4<ES>(sp + (t * KP + key) * ES);
                    sq2 += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
                    sk2 += c.x * c.x + c.y * c.y + c.z * c.z + c.w * c.w;
                    sp2 += d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w;
                }
                sq2 = lane_sum(sq2, 1, 16);
                sk2 = lane_sum(sk2, 1, 16);
                sp2 = lane_sum(sp2, 1, 16);
                if (lane == 0) {
                    const bool in = t < n;
                    fq[t] = in ? rsqrtf(sq2 + kL2NormEps) : 0.f;
                    fk[t] = in ? rsqrtf(sk2 + kL2NormEps) : 0.f;
                    fp[t] = in ? rsqrtf(sp2 + kL2NormEps) : 0.f;
                }
            }
        } else if (tid < C) {
            const float f = tid < n ? 1.f : 0.f;
            fq[tid] = fk[tid] = fp[tid] = f;
        }
        // The decay within blocks of 16 tokens, in token order: ea_t = e_{16 I} ... e_t over t's block I (tid < 64),
        // es_t = e_{t + 1} ... e_{16 I + 15} (tid >= 64; 1 at the block's end).  Across blocks r(j, t) = es_j P ea_t,
        // P the product over the whole blocks between.
        {
            const int t = tid & (C - 1), first = t & ~15;
            const bool suffix = tid >= C;
            float x = 1.f;
#pragma unroll
            for (int u = 0; u < 16; u += 4) {
                const float4 e4 = *reinterpret_cast<const float4*>(e + first + u);
                const float ev[4] = {e4.x, e4.y, e4.z, e4.w};
#pragma unroll
                for (int w = 0; w < 4; ++w) x = (suffix ? first + u + w > t : first + u + w <= t) ? x * ev[w] : x;
            }
            (suffix ? es : ea)[t] = x;
        }

        // Gram products: this warp's five tiles (GramTiles), the warp a template constant so that the accumulators
        // are exactly those five; keys in steps of 16, lane lj holding keys 4 lj .. 4 lj + 3 (the two k-steps'
        // columns (lj, lj + 4) the pairs (4 lj, 4 lj + 1) and (4 lj + 2, 4 lj + 3): a permutation of the key index
        // that A and B share).
        float gp[5][4], gq[5][4];
#pragma unroll
        for (int i = 0; i < 5; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) gp[i][r] = gq[i][r] = 0.f;
        // row tile m's column tiles c0 .. c0 + N - 1 into accumulators F .. F + N - 1
        auto tiles = [&](int m, auto first, auto width, int c0, int kq) {
            constexpr int F = decltype(first)::value;
            const int r0 = 16 * m + lg;
            if constexpr (!K32) {
                // bf16 keys: bf16 products are exact in fp32, so m16n8k16 on the staged words as they are gives the
                // sums of the TF32 path in half the mma.sync (k-slots 2 lj, 2 lj + 1, 2 lj + 8, 2 lj + 9 for keys
                // 4 lj .. 4 lj + 3, as in the scan's read)
                const uint2 pa = *reinterpret_cast<const uint2*>(sp + (r0 * KP + kq) * 2);
                const uint2 pb = *reinterpret_cast<const uint2*>(sp + ((r0 + 8) * KP + kq) * 2);
                const uint2 qa = *reinterpret_cast<const uint2*>(sq + (r0 * KP + kq) * 2);
                const uint2 qb = *reinterpret_cast<const uint2*>(sq + ((r0 + 8) * KP + kq) * 2);
#pragma unroll
                for (int i = 0; i < decltype(width)::value; ++i) {
                    const uint2 kr = *reinterpret_cast<const uint2*>(sk + ((8 * (c0 + i) + lg) * KP + kq) * 2);
                    mma_bf16(gp[F + i], pa.x, pb.x, pa.y, pb.y, kr.x, kr.y);
                    mma_bf16(gq[F + i], qa.x, qb.x, qa.y, qb.y, kr.x, kr.y);
                }
                return;
            }
            const float4 pa = staged4<ES>(sp + (r0 * KP + kq) * ES), pb = staged4<ES>(sp + ((r0 + 8) * KP + kq) * ES);
            const float4 qa = staged4<ES>(sq + (r0 * KP + kq) * ES), qb = staged4<ES>(sq + ((r0 + 8) * KP + kq) * ES);
            unsigned ph0[4], pl0[4], ph1[4], pl1[4], qh0[4], ql0[4], qh1[4], ql1[4];
            a_operand4<KM>(pa.x, pb.x, pa.y, pb.y, ph0, pl0);
            a_operand4<KM>(pa.z, pb.z, pa.w, pb.w, ph1, pl1);
            a_operand4<KM>(qa.x, qb.x, qa.y, qb.y, qh0, ql0);
            a_operand4<KM>(qa.z, qb.z, qa.w, qb.w, qh1, ql1);
#pragma unroll
            for (int i = 0; i < decltype(width)::value; ++i) {
                // the key row as a B operand, formed once for both products
                const float4 kr = staged4<ES>(sk + ((8 * (c0 + i) + lg) * KP + kq) * ES);
                unsigned bh[4], bl[4];
                operand<KM>(kr.x, bh[0], bl[0]);
                operand<KM>(kr.y, bh[1], bl[1]);
                operand<KM>(kr.z, bh[2], bl[2]);
                operand<KM>(kr.w, bh[3], bl[3]);
                mma_acc<KL, KL>(gp[F + i], ph0, pl0, bh[0], bh[1], bl[0], bl[1]);
                mma_acc<KL, KL>(gp[F + i], ph1, pl1, bh[2], bh[3], bl[2], bl[3]);
                mma_acc<KL, KL>(gq[F + i], qh0, ql0, bh[0], bh[1], bl[0], bl[1]);
                mma_acc<KL, KL>(gq[F + i], qh1, ql1, bh[2], bh[3], bl[2], bl[3]);
            }
        };
        // This warp's tiles over every key, then into L and Mq with their factors, as (row, column) pairs of a tile in
        // 8-byte stores:
        //   L[t][j] = beta_t fp_t fk_j r(j, t) (p_t . k_j), j < t;
        //   Mq[t][j] = scale fq_t fk_j r(j, t) (q_t . k_j), j <= t;
        // zeros above the diagonal.  r(j, t) across blocks of 16 from the block products (ea, es): es_j, the whole
        // blocks between, ea_t.  Within a diagonal block, r(j, t) = f_{16 I} ... f_t with f_u = e_u past j and 1 up to
        // it: a product scan over the eight lanes of a column (rows lg, then lg + 8).  Threads 0 .. 63 then form the
        // record's gates of token c = tid: G_c fp_c, scale G_c fq_c, w_c = fk_c r(c, 63), G_63.
        auto gram = [&](auto warp_c) {
            using G = GramTiles<decltype(warp_c)::value>;
#pragma unroll 1
            for (int key = 0; key < K; key += 16) {
                tiles(G::M0, Constant<0>{}, Constant<G::N0>{}, G::C0, key + 4 * lj);
                if constexpr (G::N1 > 0) tiles(G::M1, Constant<G::N0>{}, Constant<G::N1>{}, G::C1, key + 4 * lj);
            }
            __syncthreads();  // the staged keys are read: the Gram matrices take their place
            float pb[4];  // the products over whole blocks
#pragma unroll
            for (int i = 0; i < 4; ++i) pb[i] = ea[16 * i + 15];
            // the row factors of the warp's two row tiles (rows 16 M + lg, + 8): beta_t fp_t and scale fq_t, and those
            // times ea_t for the blocks below the diagonal
            float rl[2][2], rq[2][2], rla[2][2], rqa[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = 16 * (i ? G::M1 : G::M0) + lg + 8 * h;
                    rl[i][h] = bt[row] * fp[row];
                    rq[i][h] = scale * fq[row];
                    rla[i][h] = rl[i][h] * ea[row];
                    rqa[i][h] = rq[i][h] * ea[row];
                }
#pragma unroll
            for (int f = 0; f < 5; ++f) {
                const int i = f < G::N0 ? 0 : 1, m = i ? G::M1 : G::M0, ct = i ? G::C1 + f - G::N0 : G::C0 + f;
                const int t = 16 * m + lg, j = 8 * ct + 2 * lj;  // rows t, t + 8; columns j, j + 1
                const float2 kj = *reinterpret_cast<const float2*>(fk + j);
                float l[2][2], mq[2][2];
                if (ct / 2 < m) {  // a block below the diagonal: fk_j es_j (blocks between) times the row's ea_t
                    float between = 1.f;
#pragma unroll
                    for (int u = ct / 2 + 1; u < m; ++u) between *= pb[u];
                    const float2 sj = *reinterpret_cast<const float2*>(es + j);
                    const float cf[2] = {kj.x * (sj.x * between), kj.y * (sj.y * between)};
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            l[h][c] = gp[f][2 * h + c] * (rla[i][h] * cf[c]);
                            mq[h][c] = gq[f][2 * h + c] * (rqa[i][h] * cf[c]);
                        }
                } else {  // a diagonal block: the scan down the column, from the top of the block
                    float x[2][2];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int c = 0; c < 2; ++c) x[h][c] = t + 8 * h > j + c ? e[t + 8 * h] : 1.f;
#pragma unroll
                    for (int d = 1; d < 8; d *= 2)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
#pragma unroll
                            for (int c = 0; c < 2; ++c) x[h][c] = scan_up_product(x[h][c], 4 * d);
#pragma unroll
                    for (int c = 0; c < 2; ++c) x[1][c] *= __shfl_sync(0xffffffffu, x[0][c], 28 + lj);
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int row = t + 8 * h, col = j + c;
                            const float rk = (c ? kj.y : kj.x) * x[h][c];
                            l[h][c] = row > col ? gp[f][2 * h + c] * (rl[i][h] * rk) : 0.f;
                            mq[h][c] = row >= col ? gq[f][2 * h + c] * (rq[i][h] * rk) : 0.f;
                        }
                }
                const int at = t * S + j;
                *reinterpret_cast<float2*>(gram_p + at) = make_float2(l[0][0], l[0][1]);
                *reinterpret_cast<float2*>(gram_p + at + 8 * S) = make_float2(l[1][0], l[1][1]);
                *reinterpret_cast<float2*>(gram_q + at) = make_float2(mq[0][0], mq[0][1]);
                *reinterpret_cast<float2*>(gram_q + at + 8 * S) = make_float2(mq[1][0], mq[1][1]);
            }
            if (tid < C) {
                const int c = tid, blk = c >> 4;
                float before = 1.f, after = 1.f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    before = i < blk ? before * pb[i] : before;
                    after = i > blk ? after * pb[i] : after;
                }
                const float Gc = before * ea[c];
                rec[R::GP + c] = Gc * fp[c];
                rec[R::GQ + c] = scale * Gc * fq[c];
                rec[R::W + c] = fk[c] * (es[c] * after);
                if (c == C - 1) rec[R::G] = Gc;
            }
        };
        if (warp == 0) gram(Constant<0>{});
        else if (warp == 1) gram(Constant<1>{});
        else if (warp == 2) gram(Constant<2>{});
        else gram(Constant<3>{});
        __syncthreads();

        // X = (I + L)^-1 blockwise over 16 x 16 blocks: the four diagonal blocks by forward substitution (thread 16 i +
        // c holds column c of block i in registers), then the blocks below them down each column of blocks j,
        //   X_ij = -X_ii sum_{k = j .. i - 1} L_ik X_kj,
        // whose X_kj are diagonal or above X_ij in the same columns. X takes L's place (x_entry): a diagonal block once
        // every thread has read L's, a block below the diagonal transposed into the one above it, which L never uses;
        // the L_ik still to be read lie strictly below the diagonal.
        // Mq in the record (ACC 0 .. 5: A fragments, the layout under "A and Mq" below; ACC 6: a B tile, wt_tile),
        // items first, first + stride, ...
        auto mq_record = [&](int first, int stride) {
            if constexpr (ACC == 6) {
                wt_tile(rec + R::MQ, [&](int t, int j, float (&x)[8]) { gram_row8(gram_q, t, j, x); }, first, stride);
            } else if constexpr (bf16_products(ACC)) {
                constexpr int D = ACC == 5 ? 1 : 4, E = ACC == 5 ? 2 : 1;
                unsigned* const words = reinterpret_cast<unsigned*>(rec);
                for (int i = first; i < R::TILES * 32; i += stride) {
                    const int f = i >> 5, l = i & 31;
                    const int m = f < 1 ? 0 : f < 3 ? 1 : f < 6 ? 2 : 3, ks = f - m * (m + 1) / 2;
                    const float* m0 = gram_q + (16 * m + (l >> 2)) * S + 16 * ks + E * (l & 3);
                    const float* m1 = m0 + 8 * S;
                    *reinterpret_cast<uint4*>(words + R::MQ + 4 * i) =
                        make_uint4(bf16_pair(m0[0], m0[D]), bf16_pair(m1[0], m1[D]), bf16_pair(m0[8], m0[8 + D]),
                                   bf16_pair(m1[8], m1[8 + D]));
                }
            } else {
                for (int i = first; i < R::TILES * 32; i += stride) {
                    const int f = i >> 5, l = i & 31;
                    const int m = f < 2 ? 0 : f < 6 ? 1 : f < 12 ? 2 : 3, ks = f - m * (m + 1);
                    const int r0 = 16 * m + (l >> 2), c0 = 8 * ks + (l & 3);
                    *reinterpret_cast<float4*>(rec + R::MQ + 4 * i) =
                        make_float4(produced<CM>(gram_q[r0 * S + c0]), produced<CM>(gram_q[(r0 + 8) * S + c0]),
                                    produced<CM>(gram_q[r0 * S + c0 + 4]), produced<CM>(gram_q[(r0 + 8) * S + c0 + 4]));
                }
            }
        };
        float xd[16];
        if (tid < C) {
            const int base = 16 * (tid >> 4), c = tid & 15;
#pragma unroll
            for (int i = 0; i < 16; ++i) xd[i] = i == c ? 1.f : 0.f;
#pragma unroll
            for (int j = 0; j < 15; ++j) {
                const float xj = xd[j];
#pragma unroll
                for (int t = j + 1; t < 16; ++t) xd[t] = fmaf(-gram_p[(base + t) * S + base + j], xj, xd[t]);
            }
        } else {  // meanwhile warps 2 and 3 put Mq in the record
            mq_record(tid - C, C);
        }
        __syncthreads();
        if (tid < C) {
            const int base = 16 * (tid >> 4), c = tid & 15;
#pragma unroll
            for (int t = 0; t < 16; ++t) xs[(base + t) * S + base + c] = xd[t];
        }
        __syncthreads();
        // The blocks below the diagonal on the tensor cores, a 16 x 8 half of a block (columns c0 .. c0 + 7) at a time:
        // Z = sum_k L_ik X_kj, then X_ij = -X_ii Z.  The TF32 records take split operands (3xTF32, fp32-accurate as the
        // substitution); the bf16 records (XM = kRound) TF32-rounded ones, one product each: they round A to bf16 once
        // it is formed, so the split's extra products cost them issue slots and bought no accuracy.  Z passes through
        // the warp's 16 x 8 floats at ZW_AT, [row][column], to become a B operand.  The halves of a column of blocks
        // need only each other's rows above them, so each is one warp's, down the rows with no CTA barrier: warps 0 and
        // 1 the halves of column 0 (blocks 1, 2, 3: 4 + 6 + 8 k-steps), warps 2 and 3 those of columns 1 (blocks 2, 3)
        // and 2 (block 3), 14 k-steps.
        float* const zw = reinterpret_cast<float*>(prefill_smem + Layout::ZW_AT) + 128 * warp;
        constexpr int XM = ACC >= 4 ? kRound : kSplit;  // the bf16 records (ACC 4-6)
        constexpr bool XL = XM == kSplit;
        auto below = [&](int i, int j) {
            const int c0 = 16 * j + 8 * (warp & 1);
            float z[4] = {0.f, 0.f, 0.f, 0.f}, x[4] = {0.f, 0.f, 0.f, 0.f};
            for (int kk = 16 * j; kk < 16 * i; kk += 8) {
                const float* l = gram_p + (16 * i + lg) * S + kk + lj;
                unsigned ah[4], al[4], bh0, bl0, bh1, bl1;
                a_operand4<XM>(l[0], l[8 * S], l[4], l[8 * S + 4], ah, al);
                operand<XM>(x_entry(xs, kk + lj, c0 + lg), bh0, bl0);
                operand<XM>(x_entry(xs, kk + lj + 4, c0 + lg), bh1, bl1);
                mma_acc<XL, XL>(z, ah, al, bh0, bh1, bl0, bl1);
            }
            zw[8 * lg + 2 * lj] = z[0];
            zw[8 * lg + 2 * lj + 1] = z[1];
            zw[8 * (lg + 8) + 2 * lj] = z[2];
            zw[8 * (lg + 8) + 2 * lj + 1] = z[3];
            __syncwarp();
#pragma unroll
            for (int ks = 0; ks < 16; ks += 8) {
                const float* xi = xs + (16 * i + lg) * S + 16 * i + ks + lj;
                unsigned ah[4], al[4], bh0, bl0, bh1, bl1;
                a_operand4<XM>(xi[0], xi[8 * S], xi[4], xi[8 * S + 4], ah, al);
                operand<XM>(zw[8 * (ks + lj) + lg], bh0, bl0);
                operand<XM>(zw[8 * (ks + lj + 4) + lg], bh1, bl1);
                mma_acc<XL, XL>(x, ah, al, bh0, bh1, bl0, bl1);
            }
            // X_ij transposed, above the diagonal: entry (16 i + lg, c0 + 2 lj) at row c0 + 2 lj, column 16 i + lg
            float* out = xs + (c0 + 2 * lj) * S + 16 * i + lg;
            out[0] = -x[0];
            out[S] = -x[1];
            out[8] = -x[2];
            out[S + 8] = -x[3];
            __syncwarp();  // zw read, and X_ij visible to this warp's lanes, before its next block
        };
        if (warp < 2) {
            below(1, 0);
            below(2, 0);
            below(3, 0);
        } else {
            below(2, 1);
            below(3, 1);
            below(3, 2);
        }
        __syncthreads();

        // A (and Mq, above) as A fragments. TF32: tile (m, ks) at m (m + 1) + ks, lane (lg, lj) the float4 (rows 16 m +
        // lg, + 8; columns 8 ks + lj, + 4). bf16: tile (m, ks) at m (m + 1) / 2 + ks, lane (lg, lj) four bf16 pairs --
        // rows 16 m + lg, + 8 by columns (16 ks + lj, + 4), then (+ 8, + 12): k-slots 2 lj, 2 lj + 1, 2 lj + 8, 2 lj +
        // 9 stand for tokens lj, lj + 4, lj + 8, lj + 12 of the step, the order of the scan's token quads (ACC 4); with
        // ACC 5 for tokens 2 lj, 2 lj + 1, 2 lj + 8, 2 lj + 9 (the natural order of wgmma's B tiles). ACC 6: both as
        // the transposed scan's B tiles (wt_tile).
        if constexpr (ACC == 6) {
            // A = X diag(beta): x_entry eight entries at a time -- X's diagonal blocks by rows (two float4), those
            // below the diagonal (stored transposed) by columns
            wt_tile(rec + WtRecord::A, [&](int t, int j, float (&x)[8]) {
                if ((t >> 4) == (j >> 4)) {
                    gram_row8(xs, t, j, x);
                } else {
#pragma unroll
                    for (int u = 0; u < 8; ++u) x[u] = xs[(j + u) * S + t];
                }
#pragma unroll
                for (int u = 0; u < 8; ++u) x[u] *= bt[j + u];
            }, tid, kPrefillThreads);
            return;
        } else if constexpr (bf16_products(ACC)) {
            constexpr int D = ACC == 5 ? 1 : 4, E = ACC == 5 ? 2 : 1;  // the second token of a pair; lane's step
            unsigned* const words = reinterpret_cast<unsigned*>(rec);
            for (int i = tid; i < R::TILES * 32; i += kPrefillThreads) {
                const int f = i >> 5, l = i & 31;
                const int m = f < 1 ? 0 : f < 3 ? 1 : f < 6 ? 2 : 3, ks = f - m * (m + 1) / 2;
                const int r0 = 16 * m + (l >> 2), c0 = 16 * ks + E * (l & 3);
                const float b0 = bt[c0], b1 = bt[c0 + D], b2 = bt[c0 + 8], b3 = bt[c0 + 8 + D];  // A = X diag(beta)
                auto x = [&](int r, int c) { return x_entry(xs, r0 + r, c0 + c); };
                *reinterpret_cast<uint4*>(words + R::A + 4 * i) =
                    make_uint4(bf16_pair(x(0, 0) * b0, x(0, D) * b1), bf16_pair(x(8, 0) * b0, x(8, D) * b1),
                               bf16_pair(x(0, 8) * b2, x(0, 8 + D) * b3), bf16_pair(x(8, 8) * b2, x(8, 8 + D) * b3));
            }
            return;
        } else {
        for (int i = tid; i < R::TILES * 32; i += kPrefillThreads) {
            const int f = i >> 5, l = i & 31;
            const int m = f < 2 ? 0 : f < 6 ? 1 : f < 12 ? 2 : 3, ks = f - m * (m + 1);
            const int r0 = 16 * m + (l >> 2), c0 = 8 * ks + (l & 3);
            const float b0 = bt[c0], b1 = bt[c0 + 4];  // A = X diag(beta)
            *reinterpret_cast<float4*>(rec + R::A + 4 * i) =
                make_float4(produced<CM>(x_entry(xs, r0, c0) * b0), produced<CM>(x_entry(xs, r0 + 8, c0) * b0),
                            produced<CM>(x_entry(xs, r0, c0 + 4) * b1), produced<CM>(x_entry(xs, r0 + 8, c0 + 4) * b1));
        }
        }
    };

    if constexpr (ACC == 6) {  // the segmented scan's prep, maybe split (PrepSplit)
        const PrepSplit at(prm);
        if (prm.seg_split && at.slot == 0 && at.h == 0 && tid < kChainDoneWords)
            reinterpret_cast<unsigned*>(work + chain_done_at(prm, R::SIZE, SERVING && prm.cu_t))[tid] = 0u;
        prep_chunk(at.slot, at.h);
    } else {
        const long long cta = blockIdx.x;
        prep_chunk(cta / H, static_cast<int>(cta % H));
    }
}

}  // namespace comba
