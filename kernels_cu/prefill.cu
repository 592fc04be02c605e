// prefill.cu -- prefill_scan, the long-prompt scan on mma.sync: one slab of value columns of one head carried from
// chunk to chunk of 64 tokens, from the records prefill_prep forms (prefill_prep.cuh; the math, the precisions and
// the workspace: prefill.cuh's header).  Every GPU from sm_80, every precision and key width; on Hopper the wgmma
// scans (prefill_wgmma.cu, prefill_transposed.cu) take bf16 keys where the tiling says so.
//
// Launch geometry.  One 256-thread CTA a (row, value head, slab of VT = 16 or 32 value columns); warp w holds token
// tile w % 4 of Y, U and O and half (w / 4) of the slab's column tiles, and of the state (K x VT fp32) key tiles
// K / 64 (w % 4) .. + K / 64 - 1 of those columns, in its accumulators; the state is also published to shared
// memory for the read.  A chunk's inputs are staged into one of two stages (ScanLayout; one where two do not fit) while
// the previous chunk is computed: on Hopper by five bulk copies from thread 0 that complete on the stage's mbarrier
// (StageMaps), else by cp.async pieces from every thread.  Three CTA barriers a chunk (four with one stage, or
// where a packed sequence's last chunk clears its neighbour's rows).
#include "prefill_prep.cuh"

namespace comba {

// ---------------------------------------------------------------------------------------------------
// prefill_scan: one slab of VT value columns of one head, chunk after chunk (prefill.cuh's header, "Math").
//
// A chunk's inputs -- its rows of q, k (and p) and the slab of v, as they are in memory, and its
// record -- are staged in shared memory (ScanStage) by bulk copies (StageMaps), or where the rows are
// contiguous and aligned by cp.async 16-byte pieces (else by plain loads, the same layout), the next
// chunk's in flight while one is computed when two stages fit (STAGES).  Key rows are padded by 16
// elements, which makes the read's 8-byte (16-bit keys) and 16-byte (fp32) fragment loads free of bank
// conflicts; v rows are 4 VT bytes apart, or VT elements where a bulk copy lands them.
template <int K, int VT, bool SEPARATE_P, bool K32, int RECORD>
struct ScanStage {
    static constexpr int KP = K + 16, ES = K32 ? 4 : 2, NK = SEPARATE_P ? 3 : 2;
    static constexpr int KEY_BYTES = kPrefillChunk * KP * ES;  // one of q, k, p
    static constexpr int V_ROW = 4 * VT;                       // bytes a row of the v slab (any dtype)
    static constexpr int V_AT = NK * KEY_BYTES, REC_AT = V_AT + kPrefillChunk * V_ROW;
    static constexpr int BYTES = REC_AT + 4 * RECORD;  // RECORD: Record<ACC>::SIZE
};

template <int K, int VT, bool SEPARATE_P, bool K32, int RECORD>
struct ScanLayout {
    using Stage = ScanStage<K, VT, SEPARATE_P, K32, RECORD>;
    static constexpr int HS = 4 * VT + 8;              // floats a row of 4 keys of the state (conflict-free reads)
    static constexpr int HB = 8 * VT + 32;             // bytes a row of 4 keys of the bf16 state (ACC 4; fits in HS)
    static constexpr int YS = VT == 16 ? 40 : VT + 8;  // floats a token row of Y, U, w U
    // bytes a row of token quads of the bf16 Y, U, w U (ACC 4, in the same space): 32 bytes of padding make a
    // half warp's 8-byte reads of four quad rows by four columns conflict-free
    static constexpr int YB = 8 * VT + 32;
    // S[key][col] at state[key / 4][4 col + key % 4]: a lane's 4 keys of a column in one float4
    static constexpr int STATE_AT = 0, Y_AT = 4 * (K / 4) * HS, U_AT = Y_AT + 4 * kPrefillChunk * YS;
    static constexpr int UW_AT = U_AT + 4 * kPrefillChunk * YS, STAGE_AT = UW_AT + 4 * kPrefillChunk * YS;
    static constexpr int STAGES = STAGE_AT + 2 * Stage::BYTES + 16 <= 232448 ? 2 : 1;  // the H200's 227 KB a CTA
    static constexpr int BAR_AT = STAGE_AT + STAGES * Stage::BYTES;  // a stage's mbarrier (bulk copies)
    static constexpr int BYTES = BAR_AT + 16;
    static_assert(STAGE_AT % 128 == 0 && Stage::BYTES % 128 == 0 && Stage::KEY_BYTES % 128 == 0 &&
                      Stage::REC_AT % 16 == 0,
                  "prefill_scan: bulk copies land on 128-byte (tensor) and 16-byte boundaries");
    static_assert(BYTES <= 232448, "prefill_scan: the stage does not fit in shared memory");
};

template <int K, int VT, bool SEPARATE_P, bool VK, int ACC, bool SERVING>
__global__ void __launch_bounds__(kScanThreads, 1) prefill_scan(COMBA_PREFILL_ARGS) {
    constexpr bool K32 = ACC == 2 || ACC == 3;  // q, k, p staged as fp32 (else bf16)
    // ACC 4 ("bf16"): the read [P | Q] S on bf16 products, the state published as bf16 for it
    constexpr bool B16 = bf16_products(ACC);
    using R = Record<ACC>;
    // keys as they are (bf16), split or rounded; the state, Y, U, w U and the coefficients split, or rounded
    // once by their producers
    constexpr int KM = ACC == 2 ? kSplit : ACC == 3 ? kRound : kExact;
    constexpr int SM = ACC == 1 || ACC == 2 ? kSplit : kExact;
    using Layout = ScanLayout<K, VT, SEPARATE_P, K32, R::SIZE>;
    using Stage = typename Layout::Stage;
    constexpr int C = kPrefillChunk, HS = Layout::HS, YS = Layout::YS, YB = Layout::YB, KP = Stage::KP;
    constexpr int ES = Stage::ES;
    constexpr int STAGES = Layout::STAGES;
    // warp w: token tile (and key tiles) mrow = w % 4, column tiles nt0 .. nt0 + NTW - 1 (the half w / 4)
    constexpr int MT = K / 64, NTW = VT / 16;  // a warp's key tiles (16 keys) and column tiles (8 columns)
    constexpr bool KL = KM == kSplit, SL = SM == kSplit;
    static_assert(K % 64 == 0 && VT % 16 == 0, "bad prefill tiling");
    extern __shared__ __align__(128) unsigned char prefill_smem[];
    float* const sh_state = reinterpret_cast<float*>(prefill_smem + Layout::STATE_AT);
    float* const sh_y = reinterpret_cast<float*>(prefill_smem + Layout::Y_AT);
    float* const sh_u = reinterpret_cast<float*>(prefill_smem + Layout::U_AT);
    float* const sh_uw = reinterpret_cast<float*>(prefill_smem + Layout::UW_AT);
    const float* work = inter;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, lg = lane >> 2, lj = lane & 3;
    const int mrow = warp & 3, nt0 = (warp >> 2) * NTW;
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    const ScanRow row = scan_row<K, VT, SERVING>(cu_seqlens, slots, prm, q, k, v, p, beta, g, o);
    const int b = row.b, h = row.h, hk = row.hk, col0 = row.col0, T = row.T, chunks = row.chunks;
    const long long first = row.first, head = row.head;
    launch_next();
    if (SERVING && row.slot < 0) {
        await_earlier();
        return row.zero_padding(o, prm, VT, tid, kScanThreads);
    }

    const KeyCopies copies = key_copies(q, k, p, prm, ES);
    const int v_bytes = prm.v_t == F32 ? 4 : 2;
    const bool v_copy = prm.v_sv == 1 && (prm.v_sb * v_bytes) % 16 == 0 && (prm.v_st * v_bytes) % 16 == 0 &&
                        (prm.v_sh * v_bytes) % 16 == 0 && reinterpret_cast<unsigned long long>(v) % 16 == 0;
    // Chunk c's inputs into stage `at`: cp.async pieces (one group, committed by the caller), or plain
    // stores before the caller's next barrier where rows are not copyable.
    auto stage_chunk = [&](int c, unsigned char* at) {
        const long long t0 = static_cast<long long>(c) * C;
        const int n = static_cast<int>(min(static_cast<long long>(C), T - t0));
        stage_keys<K, ES, kScanThreads>(at, q, b * prm.q_sb + t0 * prm.q_st + hk * prm.q_sh, prm.q_st, prm.q_sk,
                                        prm.q_t, n, copies.q, tid);
        stage_keys<K, ES, kScanThreads>(at + Stage::KEY_BYTES, k, b * prm.k_sb + t0 * prm.k_st + hk * prm.k_sh,
                                        prm.k_st, prm.k_sk, prm.k_t, n, copies.k, tid);
        if (SEPARATE_P)
            stage_keys<K, ES, kScanThreads>(at + 2 * Stage::KEY_BYTES, p,
                                            b * prm.p_sb + t0 * prm.p_st + hk * prm.p_sh, prm.p_st, prm.p_sk, prm.p_t,
                                            n, copies.p, tid);
        const long long v0 = b * prm.v_sb + t0 * prm.v_st + h * prm.v_sh + col0 * prm.v_sv;
        if (v_copy) {
            auto copy_v = [&](auto vb) {  // VB bytes an element: PER, a power of two, pieces a row
                constexpr int VB = decltype(vb)::value, PER = VT * VB / 16, PIECES = C * PER;
#pragma unroll
                for (int j = 0; j < (PIECES + kScanThreads - 1) / kScanThreads; ++j) {
                    const int i = tid + j * kScanThreads, t = i / PER, e = i - t * PER;
                    if (PIECES % kScanThreads == 0 || i < PIECES) {
                        const bool in = t < n;
                        copy_async16(at + Stage::V_AT + t * Stage::V_ROW + 16 * e,
                                     static_cast<const char*>(v) + (v0 + (in ? t : 0) * prm.v_st) * VB + 16 * e, in);
                    }
                }
            };
            if (v_bytes == 4) copy_v(Constant<4>{});
            else copy_v(Constant<2>{});
        } else {
            for (int i = tid; i < C * VT; i += kScanThreads) {
                const int t = i / VT, e = i - t * VT;
                const unsigned bits = t < n ? load_bits(v, v0 + t * prm.v_st + e * prm.v_sv, prm.v_t) : 0u;
                unsigned char* d = at + Stage::V_AT + t * Stage::V_ROW + e * v_bytes;
                if (v_bytes == 4) *reinterpret_cast<unsigned*>(d) = bits;
                else *reinterpret_cast<unsigned short*>(d) = static_cast<unsigned short>(bits);
            }
        }
        const float* rec = work + ((first + c) * H + h) * R::SIZE;
        for (int i = tid; i < R::SIZE / 4; i += kScanThreads)
            copy_async16(at + Stage::REC_AT + 16 * i, rec + 4 * i, true);
    };
    // Where every input is copyable (the rule for activations laid out as [B, T, H, *]), this thread's pieces are
    // fixed for the whole pass: one source pointer per input, stepped a chunk at a time, and the row guards only
    // in a sequence's last, short chunk -- a chunk's staging is then its cp.async and little else, where the
    // general path above forms every address from the strides.
    const bool fast = copies.q && copies.k && (copies.p || !SEPARATE_P) && v_copy;
    constexpr int PER = 16 / ES, KROW = K / PER, KROWS = kScanThreads / KROW;  // pieces a key row; rows a pass
    const int kt = tid / KROW, ke = (tid - kt * KROW) * PER;
    const int v_per = VT * v_bytes / 16, vt = tid / v_per, vrows = kScanThreads / v_per;  // the same for v
    const char* kfrom[3] = {
        static_cast<const char*>(q) + (b * prm.q_sb + hk * prm.q_sh + kt * prm.q_st + ke) * ES,
        static_cast<const char*>(k) + (b * prm.k_sb + hk * prm.k_sh + kt * prm.k_st + ke) * ES,
        static_cast<const char*>(p) + (b * prm.p_sb + hk * prm.p_sh + kt * prm.p_st + ke) * ES};
    const long long krow[3] = {prm.q_st * ES, prm.k_st * ES, prm.p_st * ES};  // bytes a token
    const char* vfrom = static_cast<const char*>(v) +
                        (b * prm.v_sb + h * prm.v_sh + col0 + vt * prm.v_st) * v_bytes + 16 * (tid - vt * v_per);
    const float* rfrom = work + (first * H + h) * R::SIZE + 4 * tid;
    auto stage_fast = [&](auto full, int n, unsigned char* at) {
        constexpr bool FULL = decltype(full)::value;
#pragma unroll
        for (int a = 0; a < Stage::NK; ++a) {
            const char* from = kfrom[a];
            const long long step = KROWS * krow[a];
#pragma unroll
            for (int j = 0; j < kPrefillChunk / KROWS; ++j, from += step) {
                const bool in = FULL || kt + KROWS * j < n;  // else zeros, from the chunk's first row (n >= 1)
                copy_async16(at + a * Stage::KEY_BYTES + ((kt + KROWS * j) * KP + ke) * ES,
                             in ? from : kfrom[a] - kt * krow[a], in);
            }
        }
        const long long vstep = vrows * prm.v_st * v_bytes;
        const char* from = vfrom;
        for (int t = vt; t < kPrefillChunk; t += vrows, from += vstep) {
            const bool in = FULL || t < n;
            copy_async16(at + Stage::V_AT + t * Stage::V_ROW + 16 * (tid - vt * v_per),
                         in ? from : vfrom - vt * prm.v_st * v_bytes, in);
        }
        constexpr int RP = R::SIZE / 4;  // the record's pieces
#pragma unroll
        for (int j = 0; j < (RP + kScanThreads - 1) / kScanThreads; ++j)
            if (RP % kScanThreads == 0 || tid + j * kScanThreads < RP)
                copy_async16(at + Stage::REC_AT + 16 * (tid + j * kScanThreads), rfrom + 4 * j * kScanThreads, true);
    };
    // Every input by bulk copies from thread 0 where the host made tensor maps, their coordinates the
    // sequence's first token in a ragged batch, else the row; v's rows then land at their own pitch.
#if COMBA_BULK_COPY
    const bool bulk = K + 16 <= 256 && fast && maps.use != 0;
    const int v_row = bulk ? VT * v_bytes : Stage::V_ROW;  // bytes a staged row of the v slab
    const long long t_first = row.start;
    const int b_map = row.b_map;
    unsigned long long* const bars = reinterpret_cast<unsigned long long*>(prefill_smem + Layout::BAR_AT);
    init_stage_barriers(bars, bulk, tid);
#else
    constexpr bool bulk = false;
    constexpr int v_row = Stage::V_ROW;
#endif
    // Chunk c's inputs into stage s; chunks are staged in order.  By bulk copies its rows and its record may go in
    // two calls, `rows` then `record` (bulk_stage_rows).
    auto stage_next = [&](int c, int s, bool rows = true, bool record = true) {
        unsigned char* const at = prefill_smem + Layout::STAGE_AT + s * Stage::BYTES;
        if (!fast) {
            stage_chunk(c, at);
            return;
        }
        const int n = static_cast<int>(min(static_cast<long long>(C), T - static_cast<long long>(c) * C));
#if COMBA_BULK_COPY
        if (bulk) {
            if (tid == 0 && rows)
                bulk_stage_rows<Stage>(at, maps, hk, h, col0,
                                       static_cast<int>(t_first + static_cast<long long>(c) * C), b_map, v_row,
                                       4 * R::SIZE, bars + s);
            if (tid == 0 && record) bulk_copy(at + Stage::REC_AT, rfrom, 4 * R::SIZE, bars + s);  // thread 0's rfrom
            if (!record) return;  // the pointers step once the chunk is issued whole
        } else
#endif
        if (n == C) stage_fast(Constant<true>{}, C, at);
        else stage_fast(Constant<false>{}, n, at);
#pragma unroll
        for (int a = 0; a < 3; ++a) kfrom[a] += C * krow[a];
        vfrom += C * prm.v_st * v_bytes;
        rfrom += static_cast<long long>(H) * R::SIZE;
    };

    // Chunk 0's rows and the state, inputs of the call, while the prep may still run (bulk_stage_rows)
    const bool early = bulk && chunks > 0;
    if (early) stage_next(0, 0, true, false);
    // This lane's state: key tile m = MT mrow + i holds keys 16 m + 2 lg (accumulator row lg) and
    // 16 m + 2 lg + 1 (row lg + 8) -- a permutation of the key index that makes a lane's two write-key
    // values one pair load -- and columns 8 nt + 2 lj, + 1.
    float hacc[MT][NTW][4];
    auto key_of = [&](int i) { return 16 * (MT * mrow + i) + 2 * lg; };
    if (prm.has_initial) {
        const float* src = state + head;
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const int kk = key_of(i), cc = col0 + 8 * (nt0 + nt) + 2 * lj;
                if constexpr (VK) {
                    const float2 a = *reinterpret_cast<const float2*>(src + cc * K + kk);
                    const float2 z = *reinterpret_cast<const float2*>(src + (cc + 1) * K + kk);
                    hacc[i][nt][0] = a.x; hacc[i][nt][2] = a.y; hacc[i][nt][1] = z.x; hacc[i][nt][3] = z.y;
                } else {
                    const float2 a = *reinterpret_cast<const float2*>(src + kk * V + cc);
                    const float2 z = *reinterpret_cast<const float2*>(src + (kk + 1) * V + cc);
                    hacc[i][nt][0] = a.x; hacc[i][nt][1] = a.y; hacc[i][nt][2] = z.x; hacc[i][nt][3] = z.y;
                }
            }
    } else {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) hacc[i][nt][r] = 0.f;
    }
    await_earlier();  // the records written
    if (chunks > 0) {
        stage_next(0, 0, !early, true);
        copy_async_commit();
    }
    auto publish_state = [&]() {  // the accumulators into the state slab, the read's B operand
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const int kk = key_of(i), cc = 8 * (nt0 + nt) + 2 * lj;
                if constexpr (B16) {  // keys kk, kk + 1 of a column: one bf16 pair, the lower key in the low half
                    unsigned char* at = reinterpret_cast<unsigned char*>(sh_state) + (kk >> 2) * Layout::HB +
                                        8 * cc + 2 * (kk & 3);
                    *reinterpret_cast<unsigned*>(at) = bf16_pair(hacc[i][nt][0], hacc[i][nt][2]);
                    *reinterpret_cast<unsigned*>(at + 8) = bf16_pair(hacc[i][nt][1], hacc[i][nt][3]);
                    continue;
                }
                float* at = sh_state + (kk >> 2) * HS + 4 * cc + (kk & 3);
                *reinterpret_cast<float2*>(at) =
                    make_float2(produced<SM>(hacc[i][nt][0]), produced<SM>(hacc[i][nt][2]));
                *reinterpret_cast<float2*>(at + 4) =
                    make_float2(produced<SM>(hacc[i][nt][1]), produced<SM>(hacc[i][nt][3]));
            }
    };
    publish_state();

    const int ta = 16 * mrow + lg, tb = ta + 8;  // this lane's token rows of Y, U and O
    OutRows out(o, prm, b, h, col0 + 8 * nt0 + 2 * lj, ta);
    // bf16 products (ACC 4): Y, U and w U as bf16 token quads -- tokens lj, lj + 4, lj + 8, lj + 12 of 16-token
    // step ks in quad row 4 ks + lj, 8 bytes a column, the k-slot order of the record's fragments -- so that a
    // B operand is one 8-byte read.  Rows ta and tb of a column share a quad (positions lg / 4 and 2 + lg / 4).
    unsigned char* const sh_y16 = reinterpret_cast<unsigned char*>(sh_y);
    unsigned char* const sh_u16 = reinterpret_cast<unsigned char*>(sh_u);
    unsigned char* const sh_uw16 = reinterpret_cast<unsigned char*>(sh_uw);
    const int quad_a = (4 * mrow + (lg & 3)) * YB + 2 * (lg >> 2);
    auto store_rows16 = [&](unsigned char* buf, int cc, float a0, float a1, float b0, float b1) {
        const unsigned c0 = bf16_pair(a0, b0), c1 = bf16_pair(a1, b1);  // (row ta, row tb) of columns cc, cc + 1
        unsigned short* at = reinterpret_cast<unsigned short*>(buf + quad_a + 8 * cc);
        at[0] = static_cast<unsigned short>(c0);
        at[2] = static_cast<unsigned short>(c0 >> 16);
        at[4] = static_cast<unsigned short>(c1);
        at[6] = static_cast<unsigned short>(c1 >> 16);
    };
    const long long v_t = prm.v_t;

    for (int c = 0; c < chunks; ++c) {
        // stage c & 1 (of two) holds its (c >> 1)-th chunk, the one stage its c-th
        copy_async_wait<0>();
#if COMBA_BULK_COPY
        if (bulk) mbarrier_wait(bars + (STAGES == 2 ? c & 1 : 0), (STAGES == 2 ? c >> 1 : c) & 1);
#endif
        __syncthreads();  // chunk c staged; the state of chunk c - 1 published; the other stage free
        if (STAGES == 2 && c + 1 < chunks) {
            stage_next(c + 1, (c + 1) & 1);
            copy_async_commit();
        }
        const unsigned char* st = prefill_smem + Layout::STAGE_AT + (STAGES == 2 ? (c & 1) * Stage::BYTES : 0);
        const unsigned char* sq = st;
        const unsigned char* sk = st + Stage::KEY_BYTES;
        const unsigned char* sp = SEPARATE_P ? st + 2 * Stage::KEY_BYTES : sk;
        const float* rec = reinterpret_cast<const float*>(st + Stage::REC_AT);
        const long long t0 = static_cast<long long>(c) * C;
        const int n = static_cast<int>(min(static_cast<long long>(C), T - t0));
#if COMBA_BULK_COPY
        if (bulk && SERVING && prm.cu_t && n < C)
            zero_borrowed_rows<Stage::NK, Stage::KEY_BYTES, KP * ES, kScanThreads>(const_cast<unsigned char*>(st),
                                                                                 Stage::V_AT, v_row, n, tid);
#endif

        // [Rp | Rq] = [P | Q] S0 over this warp's 16 tokens; keys permuted as in prefill_prep.  Alternate key
        // steps sum into two accumulators (ILP: each chain of dependent mma.sync half the K / 16 steps long).
        float rp2[2][NTW][4], rq2[2][NTW][4];
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) rp2[s][nt][r] = rq2[s][nt][r] = 0.f;
#pragma unroll
        for (int key = 0; key < K; key += 16) {
            const int kq = key + 4 * lj, ch = (key >> 4) & 1;
            if constexpr (B16) {
                // a lane's 4 keys of a row are the A registers as they are staged: k-slots (2 lj, 2 lj + 1) and
                // (2 lj + 8, 2 lj + 9) stand for keys 4 lj .. 4 lj + 3, which the state's bf16 quads follow
                const uint2 pa = *reinterpret_cast<const uint2*>(sp + (ta * KP + kq) * 2);
                const uint2 pb = *reinterpret_cast<const uint2*>(sp + (tb * KP + kq) * 2);
                const uint2 qa = *reinterpret_cast<const uint2*>(sq + (ta * KP + kq) * 2);
                const uint2 qb = *reinterpret_cast<const uint2*>(sq + (tb * KP + kq) * 2);
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
                    const uint2 s2 = *reinterpret_cast<const uint2*>(reinterpret_cast<const unsigned char*>(sh_state) +
                                                                     ((key >> 2) + lj) * Layout::HB +
                                                                     8 * (8 * (nt0 + nt) + lg));
                    mma_bf16(rp2[ch][nt], pa.x, pb.x, pa.y, pb.y, s2.x, s2.y);
                    mma_bf16(rq2[ch][nt], qa.x, qb.x, qa.y, qb.y, s2.x, s2.y);
                }
                continue;
            }
            const float4 pa = staged4<ES>(sp + (ta * KP + kq) * ES);
            const float4 pb = staged4<ES>(sp + (tb * KP + kq) * ES);
            const float4 qa = staged4<ES>(sq + (ta * KP + kq) * ES);
            const float4 qb = staged4<ES>(sq + (tb * KP + kq) * ES);
            const KeyStep P = key_step<KM>(pa, pb), Q = key_step<KM>(qa, qb);
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const float4 s4 =
                    *reinterpret_cast<const float4*>(sh_state + ((key >> 2) + lj) * HS + 4 * (8 * (nt0 + nt) + lg));
                key_step_mma<SM, KL, SL>(rp2[ch][nt], P, s4);
                key_step_mma<SM, KL, SL>(rq2[ch][nt], Q, s4);
            }
        }
        float rp[NTW][4], rq[NTW][4];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                rp[nt][r] = rp2[0][nt][r] + rp2[1][nt][r];
                rq[nt][r] = rq2[0][nt][r] + rq2[1][nt][r];
            }

        // Y = V - diag(G fp) Rp, into shared memory (the B operand of U = A Y); one copy of the loop a v dtype
        auto form_y = [&](auto vt) {
            constexpr long long VT_ = decltype(vt)::value;
            constexpr int VB = VT_ == F32 ? 4 : 2;
            const float ga = rec[R::GP + ta], gb = rec[R::GP + tb];
            const unsigned char* va = st + Stage::V_AT + ta * v_row;
            const unsigned char* vb = st + Stage::V_AT + tb * v_row;
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const int cc = 8 * (nt0 + nt) + 2 * lj;
                const float2 x = VT_ == F16 ? staged_f16x2(va + cc * VB) : staged2<VB>(va + cc * VB);
                const float2 z = VT_ == F16 ? staged_f16x2(vb + cc * VB) : staged2<VB>(vb + cc * VB);
                if constexpr (B16) {
                    store_rows16(sh_y16, cc, fmaf(-ga, rp[nt][0], x.x), fmaf(-ga, rp[nt][1], x.y),
                                 fmaf(-gb, rp[nt][2], z.x), fmaf(-gb, rp[nt][3], z.y));
                    continue;
                }
                *reinterpret_cast<float2*>(sh_y + ta * YS + cc) =
                    make_float2(produced<SM>(fmaf(-ga, rp[nt][0], x.x)), produced<SM>(fmaf(-ga, rp[nt][1], x.y)));
                *reinterpret_cast<float2*>(sh_y + tb * YS + cc) =
                    make_float2(produced<SM>(fmaf(-gb, rp[nt][2], z.x)), produced<SM>(fmaf(-gb, rp[nt][3], z.y)));
            }
        };
        if (v_t == BF16) form_y(Constant<BF16>{});
        else if (v_t == F16) form_y(Constant<F16>{});
        else form_y(Constant<F32>{});
        __syncthreads();

        // U = A Y: this warp's 16 rows, the tiles of A up to the diagonal (k-steps 0 .. 2 mrow + 1, or 0 .. mrow
        // of 16 tokens with bf16 products)
        const int first_tile = B16 ? mrow * (mrow + 1) / 2 : mrow * (mrow + 1);
        const float4* afrag = reinterpret_cast<const float4*>(rec + R::A) + first_tile * 32 + lane;
        const float4* mfrag = reinterpret_cast<const float4*>(rec + R::MQ) + first_tile * 32 + lane;
        // acc += the product; odd k-steps into a second accumulator (two chains of at most four mma.sync)
        auto coefficient_product = [&](const float4* frag, const float* rhs, float (&acc)[NTW][4]) {
            float odd[NTW][4];
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) odd[nt][r] = 0.f;
            if constexpr (B16) {  // the fragments' four words as they are; rhs a token-quad buffer
#pragma unroll
                for (int ks = 0; ks < C / 16; ++ks) {
                    if (ks > mrow) break;
                    const uint4 a = reinterpret_cast<const uint4*>(frag)[32 * ks];
                    const unsigned char* r0 = reinterpret_cast<const unsigned char*>(rhs) + (4 * ks + lj) * YB + 8 * lg;
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt) {
                        const uint2 bq = *reinterpret_cast<const uint2*>(r0 + 64 * (nt0 + nt));
                        mma_bf16(ks & 1 ? odd[nt] : acc[nt], a.x, a.y, a.z, a.w, bq.x, bq.y);
                    }
                }
            } else {
#pragma unroll
                for (int ks = 0; ks < C / 8; ++ks) {
                    if (ks > 2 * mrow + 1) break;  // above the diagonal: zero
                    const float4 a = frag[32 * ks];
                    unsigned ah[4], al[4];
                    a_operand4<SM>(a.x, a.y, a.z, a.w, ah, al);
                    const float* r0 = rhs + (8 * ks + lj) * YS + lg;
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt) {
                        unsigned b0h, b0l, b1h, b1l;
                        operand<SM>(r0[8 * (nt0 + nt)], b0h, b0l);
                        operand<SM>(r0[4 * YS + 8 * (nt0 + nt)], b1h, b1l);
                        mma_acc<SL, SL>(ks & 1 ? odd[nt] : acc[nt], ah, al, b0h, b1h, b0l, b1l);
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[nt][r] += odd[nt][r];
        };
        {
            float u[NTW][4];
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) u[nt][r] = 0.f;
            coefficient_product(afrag, sh_y, u);
            const float wa = rec[R::W + ta], wb = rec[R::W + tb];
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const int cc = 8 * (nt0 + nt) + 2 * lj;
                if constexpr (B16) {
                    store_rows16(sh_u16, cc, u[nt][0], u[nt][1], u[nt][2], u[nt][3]);
                    store_rows16(sh_uw16, cc, wa * u[nt][0], wa * u[nt][1], wb * u[nt][2], wb * u[nt][3]);
                    continue;
                }
                *reinterpret_cast<float2*>(sh_u + ta * YS + cc) =
                    make_float2(produced<SM>(u[nt][0]), produced<SM>(u[nt][1]));
                *reinterpret_cast<float2*>(sh_u + tb * YS + cc) =
                    make_float2(produced<SM>(u[nt][2]), produced<SM>(u[nt][3]));
                *reinterpret_cast<float2*>(sh_uw + ta * YS + cc) =
                    make_float2(produced<SM>(wa * u[nt][0]), produced<SM>(wa * u[nt][1]));
                *reinterpret_cast<float2*>(sh_uw + tb * YS + cc) =
                    make_float2(produced<SM>(wb * u[nt][2]), produced<SM>(wb * u[nt][3]));
            }
        }
        __syncthreads();

        // O = diag(scale G fq) Rq + Mq U, stored
        {
            const float ga = rec[R::GQ + ta], gb = rec[R::GQ + tb];
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                rq[nt][0] *= ga; rq[nt][1] *= ga; rq[nt][2] *= gb; rq[nt][3] *= gb;
            }
            coefficient_product(mfrag, sh_u, rq);
            out.store<NTW>(n, [&](int nt, int r) { return rq[nt][r]; });
        }

        // S = G_63 S0 + Kc^T (w U): A operand the write keys (rows: this lane's key pair), B w U; the odd token
        // steps sum into dacc, added last (two chains of four mma.sync a tile)
        {
            const float G = rec[R::G];
            float dacc[MT][NTW][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        hacc[i][nt][r] *= G;
                        dacc[i][nt][r] = 0.f;
                    }
            if constexpr (B16) {
                // k-step ks of 16 tokens: A = Kc^T, rows this lane's key pair (kk, kk + 1), k-slots the tokens
                // lj, lj + 4, lj + 8, lj + 12 of the step as the quads of w U hold them; a token's staged key
                // pair is one word, and two tokens' words give the two rows' registers (one byte_perm each)
#pragma unroll
                for (int ks = 0; ks < C / 16; ++ks) {
                    uint2 bq[NTW];
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt)
                        bq[nt] = *reinterpret_cast<const uint2*>(sh_uw16 + (4 * ks + lj) * YB +
                                                                 8 * (8 * (nt0 + nt) + lg));
#pragma unroll
                    for (int i = 0; i < MT; ++i) {
                        const unsigned* x =
                            reinterpret_cast<const unsigned*>(sk + ((16 * ks + lj) * KP + key_of(i)) * 2);
                        constexpr int W4 = 4 * KP / 2;  // words of four token rows
                        const unsigned x0 = x[0], x4 = x[W4], x8 = x[2 * W4], x12 = x[3 * W4];
                        const unsigned a0 = __byte_perm(x0, x4, 0x5410), a1 = __byte_perm(x0, x4, 0x7632);
                        const unsigned a2 = __byte_perm(x8, x12, 0x5410), a3 = __byte_perm(x8, x12, 0x7632);
#pragma unroll
                        for (int nt = 0; nt < NTW; ++nt)
                            mma_bf16(ks & 1 ? dacc[i][nt] : hacc[i][nt], a0, a1, a2, a3, bq[nt].x, bq[nt].y);
                    }
                }
            } else {
#pragma unroll
                for (int ks = 0; ks < C / 8; ++ks) {
                    const int tj = 8 * ks + lj, tj4 = tj + 4;
                    const float* r0 = sh_uw + tj * YS + lg;
                    unsigned bh[NTW][2], bl[NTW][2];
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt) {
                        operand<SM>(r0[8 * (nt0 + nt)], bh[nt][0], bl[nt][0]);
                        operand<SM>(r0[4 * YS + 8 * (nt0 + nt)], bh[nt][1], bl[nt][1]);
                    }
#pragma unroll
                    for (int i = 0; i < MT; ++i) {
                        const int kk = key_of(i);
                        const float2 x = staged2<ES>(sk + (tj * KP + kk) * ES);
                        const float2 z = staged2<ES>(sk + (tj4 * KP + kk) * ES);
                        unsigned ah[4], al[4];
                        a_operand4<KM>(x.x, x.y, z.x, z.y, ah, al);
#pragma unroll
                        for (int nt = 0; nt < NTW; ++nt)
                            mma_acc<KL, SL>(ks & 1 ? dacc[i][nt] : hacc[i][nt], ah, al, bh[nt][0], bh[nt][1],
                                            bl[nt][0], bl[nt][1]);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) hacc[i][nt][r] += dacc[i][nt][r];
        }
        publish_state();  // every warp's reads of the old state ended before the first barrier
        if (STAGES == 1 && c + 1 < chunks) {
            __syncthreads();  // every warp done with the stage
            stage_next(c + 1, 0);
            copy_async_commit();
        }
    }

    if (prm.write_final) {
        float* dst = state_out + (SERVING ? pool_head<K>(slots, prm, b, h) : head);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const int kk = key_of(i), cc = col0 + 8 * (nt0 + nt) + 2 * lj;
                if constexpr (VK) {
                    store_state(dst + cc * K + kk, make_float2(hacc[i][nt][0], hacc[i][nt][2]));
                    store_state(dst + (cc + 1) * K + kk, make_float2(hacc[i][nt][1], hacc[i][nt][3]));
                } else {
                    store_state(dst + kk * V + cc, make_float2(hacc[i][nt][0], hacc[i][nt][1]));
                    store_state(dst + (kk + 1) * V + cc, make_float2(hacc[i][nt][2], hacc[i][nt][3]));
                }
            }
    }
}

}  // namespace comba
