// prefill_transposed.cu -- prefill_scan_wt: the long-prompt scan transposed on Hopper's warpgroup MMA (wgmma.cuh,
// sm_90a), so that the chain from chunk to chunk never leaves the registers; whole, or in segments of a row's
// chunks scanned side by side.
//
// Math (prefill.cuh's header, transposed): the CTA holds S^T (its 64 value columns by K keys, fp32) as the accumulators
// of one wgmma m64nK, and per chunk
//   Rp^T = S^T P^T,  Rq^T = S^T Q^T                   A = S^T (bf16 fragments of the accumulators)
//   Y^T  = Vc^T - Rp^T diag(G fp)
//   U^T  = Y^T A^T                                    A = Y^T
//   O^T  = Rq^T diag(scale G fq) + U^T Mq^T            A = U^T
//   S^T  = G_63 S^T + (U^T diag(w)) Kc                 A = U^T diag(w), Kc N-major
// Every A operand is an accumulator of the step before it, converted in registers (an m64nN accumulator's
// 16 x 16 blocks are wgmma's A fragments); every B operand is staged as it arrives: the rows of Q, P and Kc by tensor
// map in boxes of 64 keys (128 bytes) by 64 tokens, 128-byte swizzled -- K-major for Q and P, N-major for Kc (Gated
// DeltaNet's P is Kc's box read both ways) --, A and Mq as the prep wrote them (WtRecord: no swizzle, K-major), and
// the v slab in the same boxes as the keys, read by ldmatrix.trans.  No shared-memory round trip and no CTA barrier
// lies between two chunks' states: one barrier a chunk frees the other stage.  o leaves through a per-warp transpose
// in shared memory, 32 bytes a token row.
//
// Segments.  Over a few heads one CTA a (row, head, slab) leaves most SMs idle and the pass waits on its chain of
// chunks.  The segmented scan cuts each row's chunks into segments of Params::seg_chunks and runs in two launches
// after the prep (PART):
//   kWtChain     a CTA a (row, segment but the last, head, slab of 64 WGS of the V + K columns of [E | M]): the chunks'
//                S -> G_63 S + Kc^T diag(w) A (Vc - diag(G fp) P S), which acts on every column alike, from
//                [E | M] = [0 | I] with Vc = 0 in M's columns and neither Rq nor o, leaves the segment's map
//                S_end = M S_start + E;
//   kWtSegments  a CTA a (row, segment, head, slab of V): the state at the segment's start composed from the
//                initial state through the earlier segments' maps, S^T <- E_j^T + S^T M_j^T (S^T as bf16, as every
//                chunk's products take it, M_j bf16 in shared memory), then the segment's chunks as above; the last
//                segment writes the final state.
// kWtWhole is the scan of a row's chunks in one CTA.  The segments' grid lists the last segments first: they compose
// the most maps.  A dense row b has ceil(ceil(T / 64) / seg_chunks) segments, its map j at index b (segments - 1) + j.
// A ragged batch (cu_seqlens) numbers its segments in the packed order: sequence n's segment j is number
// floor(first_slot(n) / seg_chunks) + n + j, which no two segments share and which stays below floor(slots /
// seg_chunks) + N (slots = floor(T / 64) + N, the records; ragged_segments) -- so the host sizes both grids from the
// packed length and N, a CTA finds its sequence by bisection (segment_row) and exits where its number names no segment,
// and segment j's map lies at its number.  The chain leaves out the last number (a last segment where it names one) and
// lists its numbers from the first: its CTAs cost alike, and those that exit then come last (listed first, they made a
// chain over one packed sequence of 32768 tokens 12 % slower at two CTAs an SM).  The maps follow the records and the
// chain's end words (prefill.cuh, kChainDoneWords) in the workspace, K V + K K / 2 words a (map, value head): E^T
// slab by slab (64 K floats each, in the accumulators' fragment order: float4 i of thread t at 4 (128 i + t)), then M
// as the compose's bf16 B operand, element (n, k) = M[n][k] at byte 16 K (k / 8) + 16 n + 2 (k % 8) (K-major, no
// swizzle).  The chain reads no state and writes no o; it skips padding rows, whose segments never read a map.
//
// Launch geometry: one CTA of WGS warpgroups (128 WGS threads) a (row, value head, slab of 64 WGS value columns);
// warpgroup g holds the slab's columns 64 g .. 64 g + 63, its warp w columns 64 g + 16 w .. + 15 (rows of S^T, U^T
// and O^T).  The warpgroups of a CTA share each chunk's stage -- Q, P, Kc and the record, staged once -- and each
// reads its own box of the v slab.  The chain takes two warpgroups a CTA where K = 128, the segments do and P is Kc
// (V a multiple of 128: a CTA's warpgroups then lie both in E's columns or both in M's), else one.
// Numerics: bf16 operands (S^T, Y^T, U^T, A, Mq, the keys, v, M) and fp32 sums, the state fp32 from the first chunk
// to the last -- the "bf16" precision.
#include "prefill_prep.cuh"
#include "wgmma.cuh"

namespace comba {

// The part of the scan a build runs (PART, the header's "Segments"; families.py mirrors the numbers).
enum WtPart { kWtWhole = 0, kWtChain = 1, kWtSegments = 2 };

// A stage: the rows of Q (not in the chain), Kc and P (where P is not Kc), the v slab (a box of 64 columns a
// warpgroup) -- every box 1 KB-aligned for its swizzle, side by side from the stage's start -- then the record (the
// chain's without Mq).  Two stages, the next chunk copied
// while one is computed (a third measured no faster, and at K = 64 leaves room for one CTA an SM where two fit:
// docs/design.md).  Segments compose their maps in two M buffers of 2 K K bytes from the second stage on.
template <int K, bool CHAIN, bool SEPARATE_P, int WGS = 1>
struct WtLayout {
    using R = WtRecord;
    static constexpr int BOX = kPrefillChunk * 128, TILE = K / 64 * BOX;  // Q, Kc or P: K / 64 swizzled boxes
    static constexpr int Q_AT = 0, KC_AT = CHAIN ? 0 : TILE, P_AT = SEPARATE_P ? KC_AT + TILE : KC_AT;
    static constexpr int KEY_TILES = (CHAIN ? 1 : 2) + (SEPARATE_P ? 1 : 0);
    static constexpr int V_AT = KEY_TILES * TILE, V_BYTES = WGS * BOX, BOXES = KEY_TILES * (K / 64) + WGS;
    static constexpr int REC_AT = V_AT + V_BYTES, REC_BYTES = 4 * (CHAIN ? R::MQ : R::SIZE);
    static constexpr int STAGE_BYTES = REC_AT + REC_BYTES;
    static constexpr int OT_AT = 2 * STAGE_BYTES, OT_BYTES = CHAIN ? 0 : kPrefillChunk * 16 * 2;  // a warp's o
    static constexpr int BAR_AT = OT_AT + 4 * WGS * OT_BYTES, BYTES = 1024 + BAR_AT + 16;  // 1 KB to align the boxes
    static constexpr int M_BYTES = 2 * K * K;
    static_assert(STAGE_BYTES % 1024 == 0, "prefill_scan_wt: boxes 1 KB-aligned");
    static_assert(BYTES <= 232448, "prefill_scan_wt: two stages do not fit");
    static_assert(CHAIN || STAGE_BYTES + 2 * M_BYTES <= BAR_AT, "prefill_scan_wt: no room for two segment maps");
};

#if COMBA_WGMMA
// Rows t0 .. t0 + 63 of K columns of one array (keys, or a slab of v) into K / 64 boxes of 64 rows of 128 bytes as
// bf16, swizzled as the tensor map's (16-byte piece j of row r at r 128 + 16 (j ^ (r % 8))), zeros from row n on:
// cp.async pieces where the rows allow (bf16 copies), else plain loads, rounded to bf16.
template <int K, int NTHREADS>
__device__ __forceinline__ void stage_swizzled(unsigned char* dst, const void* src, long long row0, long long st,
                                               long long sk, long long dtype, int n, bool copyable, int tid) {
    for (int i = tid; i < kPrefillChunk * K / 8; i += NTHREADS) {
        const int t = i / (K / 8), piece = i % (K / 8), half = piece >> 3, j = piece & 7;
        unsigned char* to = dst + half * WtLayout<K, false, false>::BOX + 128 * t + 16 * (j ^ (t & 7));
        if (copyable) {
            const char* from = static_cast<const char*>(src) + 2 * (row0 + 8 * piece);
            copy_async16(to, t < n ? from + 2 * t * st : from, t < n);
            continue;
        }
        unsigned e[8];
#pragma unroll
        for (int x = 0; x < 8; ++x) {
            const unsigned bits = t < n ? load_bits(src, row0 + t * st + (8 * piece + x) * sk, dtype) : 0u;
            e[x] = dtype == BF16 ? bits : bf16_pair(bits_to_float(bits, dtype), 0.f) & 0xffffu;
        }
        *reinterpret_cast<uint4*>(to) = make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16,
                                                   e[6] | e[7] << 16);
    }
}

#endif

// Segments of a ragged batch cut into segments of lc chunks (header, "Segments"): the bound on their numbers.
__device__ __forceinline__ long long ragged_segments(const Params& prm, long long lc) {
    return (prm.T / kPrefillChunk + prm.B) / lc + prm.B;
}

// The sequence of a ragged batch's segment number g, and the segment within it (negative, or past the sequence's
// segments, for a number of no segment): the last row b with floor(first_slot(b) / lc) + b <= g.
__device__ __forceinline__ int segment_row(const void* cu, const Params& prm, long long lc, long long g, int& seg) {
    auto number = [&](int b) { return first_slot<true>(cu, prm, b) / lc + b; };
    const int b = last_row(static_cast<int>(prm.B), number, g);
    seg = static_cast<int>(max(min(g - number(b), 1LL << 30), -1LL));
    return b;
}

// Two CTAs of the K = 128 chain on two warpgroups share an SM in 128 registers a thread: both builds are held to it
// (left to ptxas, the one without serving options takes 153, one CTA an SM), at a few dozen bytes of spills.
template <int K, bool SEPARATE_P, bool VK, bool SERVING, int PART, int WGS>
__global__ void __launch_bounds__(kWgThreads * WGS, PART == kWtChain && WGS == 2 ? 2 : 1)
    prefill_scan_wt(COMBA_PREFILL_ARGS) {
#if COMBA_WGMMA
    constexpr bool CHAIN = PART == kWtChain;
    using R = WtRecord;
    using L = WtLayout<K, CHAIN, SEPARATE_P, WGS>;
    constexpr int C = kPrefillChunk, KS = K / 16, NT = kWgThreads * WGS;
    static_assert(K == 64 || K == 128, "bad prefill_scan_wt tiling");
    extern __shared__ __align__(128) unsigned char prefill_smem[];
    // the swizzled boxes want 1 KB alignment (their pattern repeats every 1024 bytes)
    unsigned char* const smem = prefill_smem + ((1024 - (shared_address(prefill_smem) & 1023)) & 1023);
    const float* work = inter;

    // warpgroup wg of the CTA's WGS takes the 64 columns from 64 wg of the CTA's slab; wt is its thread, warp its warp
    const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, lane = tid & 31, warp = wt >> 5, lg = lane >> 2,
              lj = lane & 3;
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    // The CTA's place; with segments, blockIdx.x = ((i B + b) H + h) slabs + slab for the i-th segment from the end
    // of a dense batch, (i H + h) slabs + slab for the i-th segment number of a ragged one (from the end, but in the
    // chain; header, "Segments")
    const bool ragged = SERVING && prm.cu_t;
    const long long dense_chunks = row_chunks(prm);  // a dense row's
    const int lc = PART == kWtWhole ? 1 : static_cast<int>(prm.seg_chunks);
    const int slabs = (V + (CHAIN ? K : 0)) / (64 * WGS);
    // the segmented scan's launches let the next one launch once the kernel before ended: the segments, launched
    // after the chain and the split prep's tail (prefill_prep.cuh, PrepSplit), then find the flag the prep zeroed
    if constexpr (PART == kWtWhole) launch_next();
    int cta = static_cast<int>(blockIdx.x), seg = 0;
    long long map0 = 0;  // where the row's segment 0 keeps its map (a ragged batch's: its number)
    if constexpr (PART != kWtWhole) {
        const int per = (ragged ? 1 : static_cast<int>(prm.B)) * H * slabs, i = cta / per;
        cta -= i * per;
        if (ragged) {
            const long long number = CHAIN ? i : ragged_segments(prm, lc) - 1 - i;
            cta += segment_row(cu_seqlens, prm, lc, number, seg) * per;
            map0 = number - seg;
        } else {
            seg = static_cast<int>(max(1LL, (dense_chunks + lc - 1) / lc)) - 1 - (CHAIN ? 1 : 0) - i;
        }
    }
    const ScanRow row = scan_row<K, 64 * WGS, SERVING>(cu_seqlens, slots, prm, q, k, v, p, beta, g, o, cta, slabs);
    const int b = row.b, h = row.h, hk = row.hk, col0 = row.col0 + 64 * wg, T = row.T, chunks = row.chunks;
    const long long first = row.first, head = row.head;
    const int segs = PART == kWtWhole ? 1 : max(1, (chunks + lc - 1) / lc);  // the row's
    // The chain's CTAs count themselves out as they end, their maps written; the last sets the flag that the
    // segments await where the split prep's tail launches between them (prefill.cuh, kChainDoneWords)
    auto chain_done = [&] { return reinterpret_cast<unsigned*>(inter + chain_done_at(prm, R::SIZE, ragged)); };
    auto chain_ended = [&] {
        if (!prm.seg_split) return;
        __threadfence();
        __syncthreads();
        if (tid == 0 && atomicAdd(chain_done(), 1u) == gridDim.x - 1) {
            __threadfence();
            atomicExch(chain_done() + 1, 1u);
        }
    };
    if (seg < 0 || seg >= segs - (CHAIN ? 1 : 0)) {  // a number of no segment (or the last, which has no map)
        await_earlier();
        if (CHAIN) chain_ended();
        return;
    }
    if (!ragged) map0 = static_cast<long long>(b) * (segs - 1);
    if (SERVING && row.slot < 0) {  // a padding row: its o zeroed once, by its first segment's CTAs
        await_earlier();
        if (CHAIN) chain_ended();
        if (CHAIN || seg > 0) return;
        return row.zero_padding(o, prm, 64 * WGS, tid, NT);
    }
    const int c_begin = PART == kWtWhole ? 0 : seg * lc;
    const int c_end = PART == kWtWhole ? chunks : min(chunks, c_begin + lc);

    constexpr long long words = R::SIZE;
    const int slab = col0 / 64;  // this warpgroup's
    const bool m_cols = CHAIN && col0 >= V;  // M's columns of [E | M]: from the identity, with Vc = 0
    // M's columns read v on every lane and drop it by a select: a read they branch around makes ptxas serialize
    // each wgmma (C7518). The K = 128 chain on two warpgroups keeps the branch: pipelined, it needs 156 registers,
    // one CTA an SM where two fit, and runs slower (docs/design.md "Segments").
    constexpr bool SERIAL = CHAIN && K == 128 && WGS == 2;
    // [E | M] of this row's segment j and head, past the records of every chunk slot (header, "Segments")
    auto seg_map = [&](int j) {
        return inter + chain_done_at(prm, words, ragged) + kChainDoneWords +
               ((map0 + j) * H + h) * (static_cast<long long>(K) * V + K * K / 2);
    };
    const KeyCopies copies = key_copies(q, k, p, prm, 2);
    const bool v_copies = rows_copyable(v, prm.v_sb, prm.v_st, prm.v_sh, prm.v_sv, prm.v_t, 2);
    const bool bulk = maps.use != 0;
    unsigned long long* const bars = reinterpret_cast<unsigned long long*>(smem + L::BAR_AT);
    init_stage_barriers(bars, true, tid);
    // Chunk c's rows, record and v slab into stage s: bulk copies from thread 0 on the stage's mbarrier (the rows by
    // tensor map where the host made them, else cp.async pieces or loads from every thread)
    // (its rows and its record in two calls where `rows` and `record` say so: bulk_stage_rows in prefill.cuh)
    auto stage_next = [&](int c, int s, bool rows = true, bool record = true) {
        unsigned char* const at = smem + s * L::STAGE_BYTES;
        const float* rec = work + ((first + c) * H + h) * words;
        if (tid == 0 && record && !rows) {
            bulk_copy(at + L::REC_AT, rec, L::REC_BYTES, bars + s);
            return;
        }
        if (tid == 0) {
            mbarrier_expect(bars + s, L::REC_BYTES + (bulk ? L::KEY_TILES * L::TILE + (m_cols ? 0 : L::V_BYTES) : 0));
            if (record) bulk_copy(at + L::REC_AT, rec, L::REC_BYTES, bars + s);
            if (bulk) {
                const int t = static_cast<int>(row.start + static_cast<long long>(c) * C);
#pragma unroll
                for (int half = 0; half < K / 64; ++half) {
                    if (!CHAIN) bulk_rows(at + L::Q_AT + half * L::BOX, maps.q, 64 * half, hk, t, row.b_map, bars + s);
                    bulk_rows(at + L::KC_AT + half * L::BOX, maps.k, 64 * half, hk, t, row.b_map, bars + s);
                    if (SEPARATE_P)
                        bulk_rows(at + L::P_AT + half * L::BOX, maps.p, 64 * half, hk, t, row.b_map, bars + s);
                }
                if (!m_cols)
#pragma unroll
                    for (int w = 0; w < WGS; ++w)
                        bulk_rows(at + L::V_AT + w * L::BOX, maps.v, row.col0 + 64 * w, h, t, row.b_map, bars + s);
            }
        }
        if (bulk) return;
        const long long t0 = static_cast<long long>(c) * C;
        const int n = static_cast<int>(min(static_cast<long long>(C), T - t0));
        if (!CHAIN)
            stage_swizzled<K, NT>(at + L::Q_AT, q, b * prm.q_sb + t0 * prm.q_st + hk * prm.q_sh, prm.q_st,
                                  prm.q_sk, prm.q_t, n, copies.q, tid);
        stage_swizzled<K, NT>(at + L::KC_AT, k, b * prm.k_sb + t0 * prm.k_st + hk * prm.k_sh, prm.k_st, prm.k_sk,
                              prm.k_t, n, copies.k, tid);
        if (SEPARATE_P)
            stage_swizzled<K, NT>(at + L::P_AT, p, b * prm.p_sb + t0 * prm.p_st + hk * prm.p_sh, prm.p_st, prm.p_sk,
                                  prm.p_t, n, copies.p, tid);
        if (!m_cols)  // M's columns stage no v
            stage_swizzled<64 * WGS, NT>(at + L::V_AT, v,
                                         b * prm.v_sb + t0 * prm.v_st + h * prm.v_sh + row.col0 * prm.v_sv, prm.v_st,
                                         prm.v_sv, prm.v_t, n, v_copies, tid);
        copy_async_commit();
    };
    // The whole scan, its prep's dependent: the first chunk's rows and the state, inputs of the call, while the prep
    // may still run, the chunk's record once the prep is done.  The segmented scan's launches await the kernel
    // before them first.
    const bool early = PART == kWtWhole && bulk && c_begin < c_end;
    if (early) stage_next(c_begin, 0, true, false);
    if constexpr (PART != kWtWhole) {
        await_earlier();  // the records (and the segments' maps) written
        launch_next();
        if (c_begin < c_end) stage_next(c_begin, 0);
    }

    // S^T: rows ca = col0 + 16 warp + lg (accumulators 4 j, 4 j + 1) and cb = ca + 8 (4 j + 2, 4 j + 3), keys
    // 8 j + 2 lj, + 1
    float st[K / 2];
    const int ca = col0 + 16 * warp + lg, cb = ca + 8;
#pragma unroll
    for (int j = 0; j < K / 8; ++j) {
        const int key = 8 * j + 2 * lj;
        float* d = st + 4 * j;
        if (CHAIN || !prm.has_initial) {  // [0 | I], or no initial state
            d[0] = m_cols && ca - V == key, d[1] = m_cols && ca - V == key + 1;
            d[2] = m_cols && cb - V == key, d[3] = m_cols && cb - V == key + 1;
            continue;
        }
        const float* src = state + head;
        if constexpr (VK) {
            const float2 x = *reinterpret_cast<const float2*>(src + ca * K + key);
            const float2 z = *reinterpret_cast<const float2*>(src + cb * K + key);
            d[0] = x.x, d[1] = x.y, d[2] = z.x, d[3] = z.y;
        } else {
            d[0] = src[key * V + ca], d[1] = src[(key + 1) * V + ca];
            d[2] = src[key * V + cb], d[3] = src[(key + 1) * V + cb];
        }
    }
    if constexpr (PART == kWtWhole) {
        await_earlier();  // the records written
        if (c_begin < c_end) stage_next(c_begin, 0, !early, true);
    }
    const unsigned d_lo = wg_desc_lo(smem);  // the chunk loop's descriptors: wg_desc_at from a stage's low word
    auto bf16_state = [&](unsigned (&sa)[KS][4]) {  // S^T as bf16 A fragments
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const float* d = st + 8 * ks;
            sa[ks][0] = bf16_pair(d[0], d[1]), sa[ks][1] = bf16_pair(d[2], d[3]);
            sa[ks][2] = bf16_pair(d[4], d[5]), sa[ks][3] = bf16_pair(d[6], d[7]);
        }
    };

    if constexpr (PART == kWtSegments) {
        // The state at the segment's start: S^T <- E_j^T + S^T M_j^T over the earlier segments j (E_0^T alone
        // without an initial state), M_j by cp.async into the second stage, the next map copied while this one
        // multiplies.  At K = 128 E_j^T is loaded a composition ahead too, into registers (at K = 64 that made the
        // segmented scan 3 % slower: docs/design.md, "Segments").
        constexpr bool E_AHEAD = K == 128;
        const int j0 = prm.has_initial ? 0 : 1;
        // the chain ended (a dependent of the prep's tail, this launch awaited only the tail); every chain CTA runs
        // or has ended by the time this launch starts, so the wait ends (docs/design.md, "Host path")
        if (prm.seg_split && seg > 0) {
            if (tid == 0)
                while (!load_acquire(chain_done() + 1)) __nanosleep(64);
            __syncthreads();
        }
        auto load_m = [&](int j) {
            const unsigned char* src = reinterpret_cast<const unsigned char*>(seg_map(j) + static_cast<long long>(K) * V);
            unsigned char* const dst = smem + L::STAGE_BYTES + (j & 1) * L::M_BYTES;
            for (int i = tid; i < L::M_BYTES / 16; i += NT) copy_async16(dst + 16 * i, src + 16 * i, true);
            copy_async_commit();
        };
        float e[K / 2];  // E_j^T, this thread's fragments
        auto load_e = [&](int j) {
            const float4* from = reinterpret_cast<const float4*>(seg_map(j) + slab * 64 * K) + wt;
#pragma unroll
            for (int i = 0; i < K / 8; ++i) {
                const float4 x = from[128 * i];
                e[4 * i] = x.x, e[4 * i + 1] = x.y, e[4 * i + 2] = x.z, e[4 * i + 3] = x.w;
            }
        };
        if (E_AHEAD && seg > 0) load_e(0);
        if (j0 < seg) load_m(j0);
        for (int j = 0; j < seg; ++j) {
            unsigned sa[KS][4];
            if (j >= j0) {
                if (j + 1 < seg) {
                    load_m(j + 1);
                    copy_async_wait<1>();
                } else {
                    copy_async_wait<0>();
                }
                fence_async_shared();  // the copies before the tensor cores read them
                __syncthreads();
                bf16_state(sa);
            }
            if (!E_AHEAD) load_e(j);
#pragma unroll
            for (int i = 0; i < K / 2; ++i) st[i] = e[i];
            if (j < j0) {
                if (E_AHEAD && j + 1 < seg) load_e(j + 1);
                continue;
            }
            const unsigned m_lo = d_lo + (static_cast<unsigned>(L::STAGE_BYTES + (j & 1) * L::M_BYTES) >> 4);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) wgmma<K>(st, sa[ks], wg_desc_at(m_lo, 32 * K * ks, 16 * K, 128, false), true);
            wg_commit();
            if (E_AHEAD && j + 1 < seg) load_e(j + 1);  // while the tensor cores multiply
            wg_wait();
            __syncthreads();  // every warp's reads of this buffer retired before it is filled again
        }
    }

    // v by ldmatrix.trans from the warpgroup's box: lane l gives token row l & 7 of matrix l >> 3 = (column block
    // 2 warp + (l >> 3 & 1), token block j + (l >> 4)), 16-byte piece (column block) ^ (row % 8) of the row; the o
    // transpose by stmatrix.trans, the same matrices into [64 tokens][16 columns]
    const int v_lane =
        L::BOX * wg + 128 * ((lane & 7) + 8 * (lane >> 4)) + 16 * ((2 * warp + ((lane >> 3) & 1)) ^ (lane & 7));
    unsigned char* const ot = smem + L::OT_AT + (tid >> 5) * L::OT_BYTES;
    unsigned char* const ot_lane = ot + 32 * ((lane & 7) + 8 * (lane >> 4)) + 16 * ((lane >> 3) & 1);
    // o rows: 16 bytes (8 columns) a piece where o is bf16 with unit, 16-byte aligned columns, else value by value
    const long long o_row = b * prm.o_sb + h * prm.o_sh + static_cast<long long>(col0 + 16 * warp) * prm.o_sv;
    const bool o_pieces = !CHAIN && prm.o_t == BF16 && prm.o_sv == 1 && prm.o_st % 8 == 0 && (o_row & 7) == 0 &&
                          (reinterpret_cast<unsigned long long>(o) & 15) == 0;

    for (int c = c_begin; c < c_end; ++c) {
        const int i = c - c_begin, s = i & 1, sg_at = s * L::STAGE_BYTES;
        unsigned char* const sg = smem + sg_at;
        const long long t0 = static_cast<long long>(c) * C;
        const int n = static_cast<int>(min(static_cast<long long>(C), T - t0));
        mbarrier_wait(bars + s, (i >> 1) & 1);
        if (!bulk) {  // this thread's pieces of chunk c landed, and ordered before the tensor cores' reads
            copy_async_wait<0>();
            fence_async_shared();
        }
        // A ragged batch's boxes: rows n on of a sequence's last chunk hold the next sequence's tokens; zero them
        // before the barrier below publishes the stage (the chain's segments end on whole chunks). No barrier of
        // its own: a CTA barrier on a branch makes older ptxas (NVRTC 13.2's) serialize every wgmma of the kernel
        // (C7518).
        if constexpr (SERVING && !CHAIN) {
            const int borrowed = bulk && prm.cu_t ? C - n : 0;
            for (int i = tid; i < L::BOXES * borrowed * 8; i += NT) {
                const int box = i / (borrowed * 8), r = i % (borrowed * 8);
                *reinterpret_cast<uint4*>(sg + box * L::BOX + 128 * n + 16 * r) = make_uint4(0, 0, 0, 0);
            }
            if (borrowed) fence_async_shared();
        }
        __syncthreads();  // chunk c staged, every warp's reads of the other stage retired
        // The next chunk's copies: here, or in the chain on one warpgroup once its first product is on the tensor
        // cores (thread 0's copies hold its warp, and the warpgroup's wgmma waits on every warp; in the scan, which
        // issues two products before its first wait, and in the chain on two warpgroups, the later copies measured
        // slower or level: docs/design.md, "Segments")
        constexpr bool LATE_COPIES = CHAIN && WGS == 1;
        if (!LATE_COPIES && c + 1 < c_end) stage_next(c + 1, s ^ 1);
        const float* f = reinterpret_cast<const float*>(sg + L::REC_AT + 4 * R::GP);  // G fp, scale G fq, w, G_63
        const unsigned sg_lo = d_lo + (static_cast<unsigned>(sg_at) >> 4);
        // a K-major B operand of the staged key rows at `at` (Q, or P) for k-step ks
        auto key_b = [&](int at, int ks) {
            return wg_desc_at(sg_lo, at + (ks >> 2) * L::BOX + 32 * (ks & 3), 16, 1024, true);
        };

        // Rp^T = S^T P^T, Rq^T = S^T Q^T
        unsigned sa[KS][4];
        bf16_state(sa);
        float rp[32], rq[32];
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) wgmma<64>(rp, sa[ks], key_b(L::P_AT, ks), ks > 0);
        wg_commit();  // the chain's product first: Y waits on it alone
        if constexpr (!CHAIN) {
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) wgmma<64>(rq, sa[ks], key_b(L::Q_AT, ks), ks > 0);
            wg_commit();
        }
        if (LATE_COPIES && c + 1 < c_end) stage_next(c + 1, s ^ 1);
        // v as bf16 pairs: token block j's rows ca (2 j) and cb (2 j + 1); zeros in M's columns (SERIAL above)
        unsigned vq[16];
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            unsigned r[4] = {0u, 0u, 0u, 0u};
            if (!SERIAL || !m_cols) ldsm4_trans(r, sg + L::V_AT + v_lane + 1024 * j);
#pragma unroll
            for (int e = 0; e < 4; ++e) vq[2 * j + e] = !SERIAL && m_cols ? 0u : r[e];
        }
        const float G = f[R::G - R::GP];
#pragma unroll
        for (int i = 0; i < K / 2; ++i) st[i] *= G;
        if (CHAIN) wg_wait();
        else wg_wait_but_one();

        // Y^T = Vc^T - Rp^T diag(G fp) as A fragments; U^T = Y^T A^T, into rp
        unsigned ya[4][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 x = staged2<2>(reinterpret_cast<const unsigned char*>(vq + 2 * j));
            const float2 z = staged2<2>(reinterpret_cast<const unsigned char*>(vq + 2 * j + 1));
            const float2 gp = *reinterpret_cast<const float2*>(f + 8 * j + 2 * lj);
            const int ks = j >> 1, hi = 2 * (j & 1);
            ya[ks][hi] = bf16_pair(x.x - rp[4 * j] * gp.x, x.y - rp[4 * j + 1] * gp.y);
            ya[ks][hi + 1] = bf16_pair(z.x - rp[4 * j + 2] * gp.x, z.y - rp[4 * j + 3] * gp.y);
        }
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            wgmma<64>(rp, ya[ks], wg_desc_at(sg_lo, L::REC_AT + 4 * R::A + 2048 * ks, 1024, 128, false), ks > 0);
        wg_commit();
        wg_wait();

        // the A fragments of U^T and U^T diag(w); O^T = Rq^T diag(scale G fq)
        unsigned ua[4][4], uw[4][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int t = 8 * j + 2 * lj;
            const float u0 = rp[4 * j], u1 = rp[4 * j + 1], u2 = rp[4 * j + 2], u3 = rp[4 * j + 3];
            const float2 w = *reinterpret_cast<const float2*>(f + (R::W - R::GP) + t);
            const int ks = j >> 1, hi = 2 * (j & 1);
            ua[ks][hi] = bf16_pair(u0, u1), ua[ks][hi + 1] = bf16_pair(u2, u3);
            uw[ks][hi] = bf16_pair(u0 * w.x, u1 * w.y), uw[ks][hi + 1] = bf16_pair(u2 * w.x, u3 * w.y);
        }
        // S^T = G_63 S^T + (U^T diag(w)) Kc;  O^T += U^T Mq^T
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            wgmma_t<K>(st, uw[ks], wg_desc_at(sg_lo, L::KC_AT + 2048 * ks, L::BOX, 1024, true), true);
        wg_commit();
        if constexpr (CHAIN) {
            wg_wait();
            continue;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 gq = *reinterpret_cast<const float2*>(f + (R::GQ - R::GP) + 8 * j + 2 * lj);
            rq[4 * j] *= gq.x, rq[4 * j + 1] *= gq.y, rq[4 * j + 2] *= gq.x, rq[4 * j + 3] *= gq.y;
        }
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            wgmma<64>(rq, ua[ks], wg_desc_at(sg_lo, L::REC_AT + 4 * R::MQ + 2048 * ks, 1024, 128, false), true);
        wg_commit();
        wg_wait();

        // o: this warp's 16 columns of tokens 8 j + 2 lj (+ 1)
        if (o_pieces) {
#pragma unroll
            for (int j = 0; j < 8; j += 2)
                stsm4_trans(ot_lane + 256 * j, bf16_pair(rq[4 * j], rq[4 * j + 1]), bf16_pair(rq[4 * j + 2], rq[4 * j + 3]),
                            bf16_pair(rq[4 * j + 4], rq[4 * j + 5]), bf16_pair(rq[4 * j + 6], rq[4 * j + 7]));
            __syncwarp();
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int piece = lane + 32 * r, t = piece >> 1;
                if (t < n)
                    *reinterpret_cast<uint4*>(static_cast<unsigned short*>(o) + o_row + (t0 + t) * prm.o_st +
                                              8 * (piece & 1)) = *reinterpret_cast<const uint4*>(ot + 16 * piece);
            }
            __syncwarp();
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int t = 8 * j + 2 * lj + (e & 1);
                    if (t < n)
                        store_act(o, o_row + (t0 + t) * prm.o_st + (lg + 8 * (e >> 1)) * prm.o_sv, prm.o_t,
                                  rq[4 * j + e]);
                }
        }
    }

    if constexpr (CHAIN) {  // the segment's map: E^T as fragments, M as the compose's B operand
        float* const map = seg_map(seg);
        if (!m_cols) {
            float4* const e = reinterpret_cast<float4*>(map + slab * 64 * K) + wt;
#pragma unroll
            for (int i = 0; i < K / 8; ++i) e[128 * i] = make_float4(st[4 * i], st[4 * i + 1], st[4 * i + 2], st[4 * i + 3]);
        } else {  // accumulator (row m, key) is M[key][m]: element (n = key, k = m) of the B image
            unsigned short* const m = reinterpret_cast<unsigned short*>(map + static_cast<long long>(K) * V);
            const int ma = ca - V, mb = ma + 8;
#pragma unroll
            for (int j = 0; j < K / 8; ++j) {
                const int key = 8 * j + 2 * lj;
                m[ma / 8 * 8 * K + key * 8 + ma % 8] = float_to_bf16_bits(st[4 * j]);
                m[ma / 8 * 8 * K + (key + 1) * 8 + ma % 8] = float_to_bf16_bits(st[4 * j + 1]);
                m[mb / 8 * 8 * K + key * 8 + mb % 8] = float_to_bf16_bits(st[4 * j + 2]);
                m[mb / 8 * 8 * K + (key + 1) * 8 + mb % 8] = float_to_bf16_bits(st[4 * j + 3]);
            }
        }
        chain_ended();
    } else if (prm.write_final && seg == segs - 1) {
        float* dst = state_out + (SERVING ? pool_head<K>(slots, prm, b, h) : head);
#pragma unroll
        for (int j = 0; j < K / 8; ++j) {
            const int key = 8 * j + 2 * lj;
            const float* d = st + 4 * j;
            if constexpr (VK) {
                store_state(dst + ca * K + key, make_float2(d[0], d[1]));
                store_state(dst + cb * K + key, make_float2(d[2], d[3]));
            } else {
                dst[key * V + ca] = d[0], dst[(key + 1) * V + ca] = d[1];
                dst[key * V + cb] = d[2], dst[(key + 1) * V + cb] = d[3];
            }
        }
    }
#endif
}

}  // namespace comba
