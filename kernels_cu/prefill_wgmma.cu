// prefill_wgmma.cu -- prefill_scan_wg: the long-prompt scan as prefill.cu's prefill_scan writes it, on Hopper's
// warpgroup MMA (wgmma.cuh, sm_90a) with bf16 products (ACC 5: prefill_prep's bf16 record with its fragments in the
// natural k order).  prefill_transposed.cu holds the scan transposed.
//
// Math: prefill.cuh's header, chunk after chunk of 64 tokens from the state S (K x VT, fp32 in the
// accumulators):  Rp = P S,  Rq = Q S,  Y = V - diag(G fp) Rp,  U = A Y,  O = diag(scale G fq) Rq + Mq U,
// S = G_63 S + Kc^T (diag(w) U) -- every product one wgmma.mma_async m64nVTk16 chain, bf16 operands, fp32
// accumulators: the numerics of the "bf16" precision of prefill_scan (ACC 4), in another summation order.
//
// Launch geometry: one 128-thread CTA (one warpgroup) a (row, value head, slab of VT = 16 or 32 value
// columns).  Warp w owns token rows 16 w .. 16 w + 15 of Rp, Rq, Y, U and O (wgmma's M = 64 tokens) and
// key rows 64 mt + 16 w .. + 15 of each 64-key tile mt of the state (M = K as K / 64 tiles).
//
// Operands.  A from registers: P's and Q's rows by ldmatrix from the staged key rows (K + 8 elements a
// row: eight rows of 16 bytes fall in distinct banks), Kc^T by ldmatrix.trans from the same rows, A and
// Mq as the record holds them (mma.sync m16n8k16 A fragments, which are wgmma's).  B from shared memory:
// S, Y, U and w U as bf16 tiles transposed (BTile: N = VT rows of k values, no swizzle), written from the
// accumulators by stmatrix.trans -- the accumulator fragments of m64nN are mma.sync's C fragments, each
// 8 x 8 block of them one stmatrix matrix.
//
// Staging as prefill_scan: a chunk's q, k (p) rows, v slab and record by bulk copies from thread 0 on the
// stage's mbarrier where the host made tensor maps (their key boxes K + 8 wide), else by cp.async pieces
// and plain loads; two stages.  Three CTA barriers a chunk: chunk staged and S published; Y written;
// U and w U written.
#include "prefill_prep.cuh"
#include "wgmma.cuh"

namespace comba {

// Rows of this many chunks or more take prefill_scan_wg's third stage where the launch gives room for it (WgLayout).
constexpr int kWgRingChunks = 24;

// The dynamic shared memory this launch gave each CTA, in bytes.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// A B operand of N rows (columns of the product) by KD k values, bf16, K-major with no swizzle: the 8 x 8
// core matrix (n / 8, k / 8) at 16 N (k / 8) + 128 (n / 8), a row of it 16 bytes.
template <int N, int KD>
struct BTile {
    static constexpr int LBO = 16 * N, SBO = 128, BYTES = 2 * N * KD;
};

template <int K, int VT, bool SEPARATE_P, int RECORD>
struct WgLayout {
    static constexpr int KP = K + 8, NK = SEPARATE_P ? 3 : 2;
    static constexpr int KEY_BYTES = kPrefillChunk * KP * 2;
    static constexpr int V_AT = NK * KEY_BYTES, REC_AT = V_AT + kPrefillChunk * VT * 4;
    static constexpr int STAGE_BYTES = (REC_AT + 4 * RECORD + 127) / 128 * 128;
    using ST = BTile<VT, K>;
    using YT = BTile<VT, kPrefillChunk>;
    static constexpr int STATE_AT = 0, Y_AT = ST::BYTES, U_AT = Y_AT + YT::BYTES, UW_AT = U_AT + YT::BYTES;
    // the stages' three mbarriers, then the stages: two (BYTES), or three (RING_BYTES) where the launch gives the
    // room for them (prefill_scan_wg says when a row takes them)
    static constexpr int BAR_AT = (UW_AT + YT::BYTES + 127) / 128 * 128, STAGE_AT = BAR_AT + 128;
    static constexpr int BYTES = STAGE_AT + 2 * STAGE_BYTES, RING_BYTES = BYTES + STAGE_BYTES;
    static constexpr bool RING = RING_BYTES <= 232448;
    static_assert(KEY_BYTES % 128 == 0 && V_AT % 128 == 0 && REC_AT % 16 == 0, "bulk copies' alignment");
    static_assert(BYTES <= 232448, "prefill_scan_wg: two stages do not fit in shared memory");
};


#if COMBA_WGMMA
// This warp's accumulator rows (16 of an m64nN, as bf16) into the transposed tile `tile` (BTile<N, KD>), at
// k block kb0 (its rows 0-7) and kb0 + 1 (rows 8-15): one stmatrix.trans a pair of 8-column blocks.
template <int N, int KD>
__device__ __forceinline__ void store_bt(unsigned char* tile, const float (&d)[N / 2], int kb0, int lane) {
    using B = BTile<N, KD>;
    const int m = lane >> 3, i = lane & 7;
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
        unsigned char* at = tile + (kb0 + (m & 1)) * B::LBO + (j + (m >> 1)) * B::SBO + 16 * i;
        stsm4_trans(at, bf16_pair(d[4 * j], d[4 * j + 1]), bf16_pair(d[4 * j + 2], d[4 * j + 3]),
                    bf16_pair(d[4 * j + 4], d[4 * j + 5]), bf16_pair(d[4 * j + 6], d[4 * j + 7]));
    }
}
#endif

template <int K, int VT, bool SEPARATE_P, bool VK, bool SERVING>
__global__ void __launch_bounds__(kWgThreads, 1) prefill_scan_wg(COMBA_PREFILL_ARGS) {
#if COMBA_WGMMA
    using R = Record<5>;
    using L = WgLayout<K, VT, SEPARATE_P, R::SIZE>;
    constexpr int C = kPrefillChunk, KP = L::KP, MT = K / 64, NA = VT / 2, KS = K / 16;
    static_assert(K % 64 == 0 && (VT == 16 || VT == 32), "bad prefill_scan_wg tiling");
    extern __shared__ __align__(128) unsigned char prefill_smem[];
    unsigned char* const s_state = prefill_smem + L::STATE_AT;
    unsigned char* const s_y = prefill_smem + L::Y_AT;
    unsigned char* const s_u = prefill_smem + L::U_AT;
    unsigned char* const s_uw = prefill_smem + L::UW_AT;
    const float* work = inter;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, lg = lane >> 2, lj = lane & 3;
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    const ScanRow row = scan_row<K, VT, SERVING>(cu_seqlens, slots, prm, q, k, v, p, beta, g, o);
    const int b = row.b, h = row.h, hk = row.hk, col0 = row.col0, T = row.T, chunks = row.chunks;
    const long long first = row.first, head = row.head;
    launch_next();
    if (SERVING && row.slot < 0) {
        await_earlier();
        return row.zero_padding(o, prm, VT, tid, kWgThreads);
    }

    const KeyCopies copies = key_copies(q, k, p, prm, 2);
    const int v_bytes = prm.v_t == F32 ? 4 : 2, v_row = VT * v_bytes;
    const bool bulk = maps.use != 0;
    const long long t_first = row.start;
    const int b_map = row.b_map;
    unsigned long long* const bars = reinterpret_cast<unsigned long long*>(prefill_smem + L::BAR_AT);
    init_stage_barriers<3>(bars, bulk, tid);
    // Chunk c's inputs into stage s (bulk copies from thread 0 -- its rows and its record in two calls where
    // `rows` and `record` say so, bulk_stage_rows -- else cp.async pieces and plain stores that the caller's next
    // wait and barrier publish).
    auto stage_next = [&](int c, int s, bool rows = true, bool record = true) {
        unsigned char* const at = prefill_smem + L::STAGE_AT + s * L::STAGE_BYTES;
        const float* rec = work + ((first + c) * H + h) * R::SIZE;
        if (bulk) {
            if (tid == 0 && rows)
                bulk_stage_rows<L>(at, maps, hk, h, col0, static_cast<int>(t_first + static_cast<long long>(c) * C),
                                   b_map, v_row, 4 * R::SIZE, bars + s);
            if (tid == 0 && record) bulk_copy(at + L::REC_AT, rec, 4 * R::SIZE, bars + s);
            return;
        }
        const long long t0 = static_cast<long long>(c) * C;
        const int n = static_cast<int>(min(static_cast<long long>(C), T - t0));
        stage_keys<K, 2, kWgThreads, KP>(at, q, b * prm.q_sb + t0 * prm.q_st + hk * prm.q_sh, prm.q_st, prm.q_sk,
                                         prm.q_t, n, copies.q, tid);
        stage_keys<K, 2, kWgThreads, KP>(at + L::KEY_BYTES, k, b * prm.k_sb + t0 * prm.k_st + hk * prm.k_sh,
                                         prm.k_st, prm.k_sk, prm.k_t, n, copies.k, tid);
        if (SEPARATE_P)
            stage_keys<K, 2, kWgThreads, KP>(at + 2 * L::KEY_BYTES, p, b * prm.p_sb + t0 * prm.p_st + hk * prm.p_sh,
                                             prm.p_st, prm.p_sk, prm.p_t, n, copies.p, tid);
        const long long v0 = b * prm.v_sb + t0 * prm.v_st + h * prm.v_sh + col0 * prm.v_sv;
        for (int i = tid; i < C * VT; i += kWgThreads) {
            const int t = i / VT, e = i - t * VT;
            const unsigned bits = t < n ? load_bits(v, v0 + t * prm.v_st + e * prm.v_sv, prm.v_t) : 0u;
            unsigned char* d = at + L::V_AT + t * v_row + e * v_bytes;
            if (v_bytes == 4) *reinterpret_cast<unsigned*>(d) = bits;
            else *reinterpret_cast<unsigned short*>(d) = static_cast<unsigned short>(bits);
        }
        for (int i = tid; i < R::SIZE / 4; i += kWgThreads) copy_async16(at + L::REC_AT + 16 * i, rec + 4 * i, true);
        copy_async_commit();
    };
    // The stages form a ring, chunk c in stage c % ns, issued ns - 1 chunks ahead: three for a row of
    // kWgRingChunks chunks or more where the launch gave the room (docs/design.md), else two.  Past the row's end an
    // issue is an empty group of cp.async pieces, so that a chunk's copies are always followed by those of ns - 2
    // more.
    const int ns = L::RING && chunks >= kWgRingChunks && dynamic_smem_bytes() >= L::RING_BYTES ? 3 : 2;
    auto issue = [&](int c, int s) {
        if (c < chunks) stage_next(c, s);
        else if (!bulk) copy_async_commit();
    };
    // the first chunks' rows, inputs of the call, while the prep may still run; their records once it is done
    // (bulk_stage_rows)
    if (bulk)
        for (int i = 0; i + 1 < ns && i < chunks; ++i) stage_next(i, i, true, false);

    // The state: tile mt's rows 64 mt + 16 warp + lg (accumulators 4 j, 4 j + 1) and + 8 (4 j + 2, 4 j + 3), columns
    // 8 j + 2 lj, + 1 of the slab.
    float sacc[MT][NA];
    const int key0 = 16 * warp + lg;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < VT / 8; ++j) {
            const int ka = 64 * mt + key0, kb = ka + 8, cc = col0 + 8 * j + 2 * lj;
            float* d = sacc[mt] + 4 * j;
            if (!prm.has_initial) {
                d[0] = d[1] = d[2] = d[3] = 0.f;
                continue;
            }
            const float* src = state + head;
            if constexpr (VK) {
                d[0] = src[cc * K + ka], d[1] = src[(cc + 1) * K + ka];
                d[2] = src[cc * K + kb], d[3] = src[(cc + 1) * K + kb];
            } else {
                const float2 a = *reinterpret_cast<const float2*>(src + ka * V + cc);
                const float2 z = *reinterpret_cast<const float2*>(src + kb * V + cc);
                d[0] = a.x, d[1] = a.y, d[2] = z.x, d[3] = z.y;
            }
        }
    await_earlier();  // the records written
    for (int i = 0; i + 1 < ns; ++i) {
        if (!bulk) issue(i, i);
        else if (i < chunks) stage_next(i, i, false, true);
    }
    auto publish_state = [&]() {  // S as the bf16 B tile of the read, then visible to wgmma
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) store_bt<VT, K>(s_state, sacc[mt], 8 * mt + 2 * warp, lane);
        fence_async_shared();
    };
    publish_state();

    const int ta = 16 * warp + lg, tb = ta + 8;  // this lane's token rows
    OutRows out(o, prm, b, h, col0 + 2 * lj, ta);
    const long long v_t = prm.v_t;
    // ldmatrix addresses: lane l gives row l % 8 of matrix l / 8
    const int a_row = 16 * warp + (lane & 15), a_col = 8 * (lane >> 4);               // A = rows of P, Q
    const int t_row = (lane & 7) + 8 * (lane >> 4), t_col = 16 * warp + 8 * ((lane >> 3) & 1);  // A = Kc^T

    for (int c = 0, s = 0, phase = 0; c < chunks; ++c, s = s + 1 < ns ? s + 1 : 0, phase ^= s == 0) {
        if (bulk) mbarrier_wait(bars + s, phase);
        else if (ns == 3) copy_async_wait<1>();
        else copy_async_wait<0>();
        __syncthreads();  // chunk c staged, S published, the stage of chunk c - 1 free
        issue(c + ns - 1, s > 0 ? s - 1 : ns - 1);
        const unsigned char* st = prefill_smem + L::STAGE_AT + s * L::STAGE_BYTES;
        const unsigned char* sq = st;
        const unsigned char* sk = st + L::KEY_BYTES;
        const unsigned char* sp = SEPARATE_P ? st + 2 * L::KEY_BYTES : sk;
        const float* rec = reinterpret_cast<const float*>(st + L::REC_AT);
        const int n = static_cast<int>(min(static_cast<long long>(C), T - static_cast<long long>(c) * C));
        if (bulk && SERVING && prm.cu_t && n < C)
            zero_borrowed_rows<L::NK, L::KEY_BYTES, 2 * KP, kWgThreads>(const_cast<unsigned char*>(st), L::V_AT,
                                                                         v_row, n, tid);

        // [Rp | Rq] = [P | Q] S
        float rp[NA], rq[NA];
        {
            unsigned pa[KS][4], qa[KS][4];
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                ldsm4(pa[ks], sp + (a_row * KP + 16 * ks + a_col) * 2);
                ldsm4(qa[ks], sq + (a_row * KP + 16 * ks + a_col) * 2);
            }
            using ST = typename L::ST;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const unsigned long long d = wg_desc(s_state + 2 * ks * ST::LBO, ST::LBO, ST::SBO);
                wgmma<VT>(rp, pa[ks], d, ks > 0);
                wgmma<VT>(rq, qa[ks], d, ks > 0);
            }
            wg_commit();
            wg_wait();
        }
        using YT = typename L::YT;

        // Y = V - diag(G fp) Rp
        {
            const float ga = rec[R::GP + ta], gb = rec[R::GP + tb];
            const unsigned char* va = st + L::V_AT + ta * v_row;
            const unsigned char* vb = st + L::V_AT + tb * v_row;
            float y[NA];
#pragma unroll
            for (int j = 0; j < VT / 8; ++j) {
                const int cc = 8 * j + 2 * lj;
                float2 x, z;
                if (v_t == BF16) x = staged2<2>(va + 2 * cc), z = staged2<2>(vb + 2 * cc);
                else if (v_t == F16) x = staged_f16x2(va + 2 * cc), z = staged_f16x2(vb + 2 * cc);
                else x = staged2<4>(va + 4 * cc), z = staged2<4>(vb + 4 * cc);
                y[4 * j] = fmaf(-ga, rp[4 * j], x.x);
                y[4 * j + 1] = fmaf(-ga, rp[4 * j + 1], x.y);
                y[4 * j + 2] = fmaf(-gb, rp[4 * j + 2], z.x);
                y[4 * j + 3] = fmaf(-gb, rp[4 * j + 3], z.y);
            }
            store_bt<VT, C>(s_y, y, 2 * warp, lane);
            fence_async_shared();
        }
        __syncthreads();

        // U = A Y (this warp's row tile of A up to the diagonal; zeros above it)
        const uint4* afrag = reinterpret_cast<const uint4*>(rec + R::A) + warp * (warp + 1) / 2 * 32 + lane;
        const uint4* mfrag = reinterpret_cast<const uint4*>(rec + R::MQ) + warp * (warp + 1) / 2 * 32 + lane;
        auto frag = [&](const uint4* f, int ks, unsigned (&a)[4]) {
            const uint4 x = ks <= warp ? f[32 * ks] : make_uint4(0, 0, 0, 0);
            a[0] = x.x, a[1] = x.y, a[2] = x.z, a[3] = x.w;
        };
        {
            unsigned af[4][4];
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) frag(afrag, ks, af[ks]);
            float u[NA];
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                wgmma<VT>(u, af[ks], wg_desc(s_y + 2 * ks * YT::LBO, YT::LBO, YT::SBO), ks > 0);
            wg_commit();
            wg_wait();
            store_bt<VT, C>(s_u, u, 2 * warp, lane);
            const float wa = rec[R::W + ta], wb = rec[R::W + tb];
#pragma unroll
            for (int j = 0; j < VT / 8; ++j) {
                u[4 * j] *= wa, u[4 * j + 1] *= wa, u[4 * j + 2] *= wb, u[4 * j + 3] *= wb;
            }
            store_bt<VT, C>(s_uw, u, 2 * warp, lane);
            fence_async_shared();
        }
        __syncthreads();

        // O = diag(scale G fq) Rq + Mq U;  S = G_63 S + Kc^T (w U)
        {
            unsigned mf[4][4], kt[MT][4][4];
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) frag(mfrag, ks, mf[ks]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
                    ldsm4_trans(kt[mt][ks], sk + ((16 * ks + t_row) * KP + 64 * mt + t_col) * 2);
            const float qa_ = rec[R::GQ + ta], qb_ = rec[R::GQ + tb], G = rec[R::G];
#pragma unroll
            for (int j = 0; j < VT / 8; ++j) {
                rq[4 * j] *= qa_, rq[4 * j + 1] *= qa_, rq[4 * j + 2] *= qb_, rq[4 * j + 3] *= qb_;
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < NA; ++r) sacc[mt][r] *= G;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                wgmma<VT>(rq, mf[ks], wg_desc(s_u + 2 * ks * YT::LBO, YT::LBO, YT::SBO), true);
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    wgmma<VT>(sacc[mt], kt[mt][ks], wg_desc(s_uw + 2 * ks * YT::LBO, YT::LBO, YT::SBO), true);
            wg_commit();
            wg_wait();
        }
        out.store<VT / 8>(n, [&](int j, int r) { return rq[4 * j + r]; });
        publish_state();  // every warp's read of the old S ended before the second barrier
    }

    if (prm.write_final) {
        float* dst = state_out + (SERVING ? pool_head<K>(slots, prm, b, h) : head);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < VT / 8; ++j) {
                const int ka = 64 * mt + key0, kb = ka + 8, cc = col0 + 8 * j + 2 * lj;
                const float* d = sacc[mt] + 4 * j;
                if constexpr (VK) {
                    dst[cc * K + ka] = d[0], dst[(cc + 1) * K + ka] = d[1];
                    dst[cc * K + kb] = d[2], dst[(cc + 1) * K + kb] = d[3];
                } else {
                    store_state(dst + ka * V + cc, make_float2(d[0], d[1]));
                    store_state(dst + kb * V + cc, make_float2(d[2], d[3]));
                }
            }
    }
#endif
}

}  // namespace comba
