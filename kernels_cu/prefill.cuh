// prefill.cuh -- what the long-prompt kernels share.  The gated delta rule over long forward passes in chunks of 64
// tokens on the tensor cores, in two launches: `prefill_prep` (prefill_prep.cuh), parallel over every chunk of every
// head, forms each chunk's coefficients; a scan, parallel over heads and slabs of value columns, carries the state
// from chunk to chunk and writes o -- `prefill_scan` on mma.sync (prefill.cu), `prefill_scan_wg` (prefill_wgmma.cu)
// and `prefill_scan_wt` (prefill_transposed.cu) on Hopper's warpgroup MMA.  Either state layout, Comba and Gated
// DeltaNet (p = k).  This file: the math, the precisions and the workspace of them all, and the device code they
// share -- records, operands, rows and chunk slots, staging by cp.async and by bulk copies, programmatic launches,
// the segmented scan's end words, a scan CTA's place and its o stores.
//
// Math.  A chunk of C = 64 tokens from the state S0 (K x V); G_t = e_0 ... e_t, r(j, t) = e_{j+1}
// ... e_t (r(t, t) = 1); fq, fk, fp the L2-norm factors (1 without use_qk_l2norm; 0 for the tokens
// past a sequence's end, which also get beta = 0 and e = 1 and so change nothing).  Rows are tokens:
// P, Q, Kc the chunk's raw read keys, queries and write keys (C x K), Vc its values (C x V).
//
//   L[t][j]  = beta_t fp_t fk_j r(j, t) (p_t . k_j),  j < t          (prep: a Gram product)
//   A        = (I + L)^-1 diag(beta)                                  (prep: a 64 x 64 solve)
//   Mq[t][j] = scale fq_t fk_j r(j, t) (q_t . k_j),   j <= t          (prep)
//   Y  = Vc - diag(G fp) P S0                                         (scan, with the state S0)
//   U  = A Y                                                          the chunk's corrections u_t
//   O  = diag(scale G fq) Q S0 + Mq U
//   S  = G_63 S0 + Kc^T diag(w) U,   w_j = r(j, 63) fk_j
//
// -- the token recurrence of token_loop.cu (u_t = beta_t (v_t - S^T p_t) after the decay, o_t read
// from the new state), unrolled over the chunk: exact algebra.  The decays are products of the gates
// (no logarithms, no division: a gate of 0 is exact), over blocks of 16 tokens (prefill_prep's ea, es).
//
// Precision (ACC).  The products accumulate in fp32 and the state stays fp32 from chunk to chunk in the
// accumulators.  "tf32" (ACC 0: bf16 keys, 3: fp16 or fp32 keys): mma.sync m16n8k8, each operand rounded to
// TF32 once -- bf16 keys are TF32 values already, the state, Y, U and the coefficients are rounded by whoever
// produces them -- one mma.sync a product.  "fp32" (ACC 1: bf16 keys, 2: wider): operands split as hi + lo
// (mma_ops.cuh's split), three products a product (3xTF32, fp32-accurate), two where the keys are bf16 (their
// lo is 0).  "bf16" (ACC 4, bf16 keys only): every product on mma.sync m16n8k16 with bf16 operands -- the
// keys as they are staged, the state published as bf16 for the read, Y, U and w U rounded to bf16 by the warp
// that forms them, A and Mq stored as bf16 fragments by the prep -- half the mma.sync and half the record of
// the TF32 forms, at bf16's rounding.  The scan stages bf16 keys as they are and fp16 / fp32 ones as floats
// (ACC 2 and 3).  ACC 5 and 6 are the "bf16" records of the two wgmma scans: ACC 5 prefill_scan_wg's, the same
// products with its fragments in wgmma's natural order, ACC 6 prefill_scan_wt's, A and Mq as its B tiles (WtRecord).
//
// Workspace (the `inter` pointer slot, which these kernels never hold as intermediate_states): one
// record of Record<ACC>::SIZE words a (chunk slot, value head): A and Mq as mma.sync A fragments of the
// tiles on or below the diagonal only -- TF32: 20 of the 32 16 x 8 tiles (tile (m, ks) at m (m + 1) + ks, 32
// lanes x 4 floats); bf16: 10 of the 16 16 x 16 tiles (at m (m + 1) / 2 + ks, 32 lanes x 4 bf16 pairs) --
// then G fp, scale G fq, w (64 each) and G_63.  Chunk slots: in a dense batch row b's chunk
// c is slot b ceil(T / 64) + c; in a ragged batch sequence n's chunk c is slot floor(start_n / 64) +
// n + c, which no two chunks share and which stays below floor(total / 64) + N (`first_slot`): the
// grid is sized on the host from the packed length and the number of sequences, with no device sync.  A segmented
// pass keeps kChainDoneWords words past the records (the chain's end, told to the segments), then the segments'
// maps (prefill_transposed.cu).
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "mma_ops.cuh"

namespace comba {

constexpr int kPrefillChunk = 64;
constexpr int kPrefillThreads = 128, kScanThreads = 256;
// ACC 4 ("bf16"): every product of the scan on bf16 m16n8k16 (header, "Precision").
// ACC 5: the same products for prefill_scan_wg (prefill_wgmma.cu), whose record holds the fragments in the
// natural k order.
__host__ __device__ constexpr bool bf16_products(int acc) { return acc == 4 || acc == 5; }

// A chunk's record (header, "Workspace"), in 32-bit words: A's and Mq's fragments (TF32: the 20 tiles of
// 16 x 8 on or below the diagonal, 4 floats a lane; bf16: the 10 tiles of 16 x 16, 4 bf16 pairs a lane),
// then G fp, scale G fq, w (64 each) and G_63.
template <int ACC>
struct Record {
    static constexpr int TILES = bf16_products(ACC) ? 10 : 20, FRAG = TILES * 32 * 4;
    static constexpr int A = 0, MQ = FRAG, GP = 2 * FRAG, GQ = GP + 64, W = GQ + 64, G = W + 64, SIZE = GP + 256;
};

// The record of prefill_scan_wt (ACC 6, prefill_transposed.cu), in 32-bit words: A (64 x 64), then G fp, scale G fq, w
// (64 each) and G_63, then Mq (64 x 64); A and Mq as that scan's bf16 B tiles -- element (t, j) at 16-byte row t of
// block j / 8 (1 KB a block of 8 columns), zeros above the diagonal: wgmma's K-major layout with no swizzle.  The
// segments' chain copies the words before Mq alone.
struct WtRecord {
    static constexpr int A = 0, GP = 2048, GQ = GP + 64, W = GQ + 64, G = W + 64, MQ = GP + 256, SIZE = MQ + 2048;
};

// The record layout of prefill_prep<K, ACC>: SIZE 32-bit words a (chunk slot, value head) of the workspace.
template <int ACC>
struct PrepRecordOf {
    using type = Record<ACC>;
};
template <>
struct PrepRecordOf<6> {
    using type = WtRecord;
};
template <int ACC>
using PrepRecord = typename PrepRecordOf<ACC>::type;

// x rounded to TF32 (the hi of split).
__device__ __forceinline__ unsigned tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// How a value becomes a TF32 operand: as it is (a bf16 value, or one its producer rounded), rounded,
// or split into hi + lo.
enum OperandMode { kExact = 0, kRound = 1, kSplit = 2 };

template <int MODE>
__device__ __forceinline__ void operand(float x, unsigned& hi, unsigned& lo) {
    if (MODE == kSplit) split(x, hi, lo);
    else hi = MODE == kRound ? tf32(x) : __float_as_uint(x);
}

// x as its consumer reads it: rounded to TF32 once here when the consumer takes it as it is.
template <int MODE>
__device__ __forceinline__ float produced(float x) {
    return MODE == kExact ? __uint_as_float(tf32(x)) : x;
}

// d += a b on the tensor cores: a hi b hi, plus a lo b hi and a hi b lo where those operands are split.
template <bool A_LO, bool B_LO>
__device__ __forceinline__ void mma_acc(float (&d)[4], const unsigned (&ah)[4], const unsigned (&al)[4],
                                        unsigned bh0, unsigned bh1, unsigned bl0, unsigned bl1) {
    if (A_LO) mma_tf32(d[0], d[1], d[2], d[3], al, bh0, bh1);
    if (B_LO) mma_tf32(d[0], d[1], d[2], d[3], ah, bl0, bl1);
    mma_tf32(d[0], d[1], d[2], d[3], ah, bh0, bh1);
}

// d += a b on mma.sync m16n8k16 with bf16 operands: a the row tile's four registers of bf16 pairs
// (rows lg, lg + 8; k 2 lj, + 1 and 2 lj + 8, + 9), b the column's two.
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int MODE>
__device__ __forceinline__ void a_operand4(float a0, float a1, float a2, float a3, unsigned (&hi)[4],
                                           unsigned (&lo)[4]) {
    operand<MODE>(a0, hi[0], lo[0]);
    operand<MODE>(a1, hi[1], lo[1]);
    operand<MODE>(a2, hi[2], lo[2]);
    operand<MODE>(a3, hi[3], lo[3]);
}

// The A fragments of one 16-key step of two token rows (lg and lg + 8): lane lj holds keys 4 lj .. 4 lj + 3,
// the step's two k-steps taking the pairs (4 lj, 4 lj + 1) and (4 lj + 2, 4 lj + 3) as their columns
// (lj, lj + 4) -- a permutation of the key index that the B operand follows (key_step_mma).
struct KeyStep {
    unsigned h0[4], l0[4], h1[4], l1[4];
};

template <int MODE>
__device__ __forceinline__ KeyStep key_step(float4 a, float4 b) {
    KeyStep s;
    a_operand4<MODE>(a.x, b.x, a.y, b.y, s.h0, s.l0);
    a_operand4<MODE>(a.z, b.z, a.w, b.w, s.h1, s.l1);
    return s;
}

// d += the step's rows times a B column of the same four keys (x .. w), made operands by BM.
template <int BM, bool A_LO, bool B_LO>
__device__ __forceinline__ void key_step_mma(float (&d)[4], const KeyStep& a, float4 b) {
    unsigned bh[4], bl[4];
    operand<BM>(b.x, bh[0], bl[0]);
    operand<BM>(b.y, bh[1], bl[1]);
    operand<BM>(b.z, bh[2], bl[2]);
    operand<BM>(b.w, bh[3], bl[3]);
    mma_acc<A_LO, B_LO>(d, a.h0, a.l0, bh[0], bh[1], bl[0], bl[1]);
    mma_acc<A_LO, B_LO>(d, a.h1, a.l1, bh[2], bh[3], bl[2], bl[3]);
}

// Whether o's rows take a lane's two values as one store (store_act_pair).
__device__ __forceinline__ bool pairs_aligned(const void* base, long long sb, long long st, long long sh, long long s,
                                              long long dtype) {
    return s == 1 && sb % 2 == 0 && st % 2 == 0 && sh % 2 == 0 &&
           reinterpret_cast<unsigned long long>(base) % (dtype == F32 ? 8 : 4) == 0;
}

// The clamped first token of row b (0 in a dense batch).
template <bool SERVING>
__device__ __forceinline__ long long row_start(const void* cu, const Params& prm, int b) {
    if (!SERVING || !prm.cu_t) return 0;
    const long long a = prm.cu_t == 1 ? reload(static_cast<const int*>(cu) + b)
                                      : reload(static_cast<const long long*>(cu) + b);
    return min(max(a, 0LL), prm.T);
}

// The chunks of a dense row.
__device__ __forceinline__ long long row_chunks(const Params& prm) {
    return (prm.T + kPrefillChunk - 1) / kPrefillChunk;
}

// The chunk slot of row b's first chunk (header, "Workspace").
template <bool SERVING>
__device__ __forceinline__ long long first_slot(const void* cu, const Params& prm, int b) {
    if (!SERVING || !prm.cu_t) return b * row_chunks(prm);
    return row_start<SERVING>(cu, prm, b) / kPrefillChunk + b;
}

// The last row b of 0 .. B - 1 with key(b) <= x, by bisection (row 0 where there is none); whatever the keys, a row
// of the batch.
template <class Key>
__device__ __forceinline__ int last_row(int B, Key key, long long x) {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (key(mid) <= x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
// The row whose chunks hold slot `slot`, and the chunk (negative or past the row's end for a slot of
// no chunk): the last row b with first_slot(b) <= slot in a ragged batch.
template <bool SERVING>
__device__ __forceinline__ int slot_row(const void* cu, const Params& prm, long long slot, long long& chunk) {
    const int b = !SERVING || !prm.cu_t
                      ? static_cast<int>(slot / row_chunks(prm))
                      : last_row(static_cast<int>(prm.B), [&](int r) { return first_slot<SERVING>(cu, prm, r); }, slot);
    chunk = slot - first_slot<SERVING>(cu, prm, b);
    return b;
}

// ---------------------------------------------------------------------------------------------------
// Staging: a chunk's rows of q, k, p in shared memory as they are in memory (bf16) or as floats.
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

// Hopper's bulk copies (sm_90 on): a scan chunk's rows of q, k, p and v by tensor map and its record in one
// piece, from one thread, completing on an mbarrier a stage.  A TensorMap is the driver's opaque 128-byte
// descriptor (cuTensorMapEncodeTiled); StageMaps, the prefill kernels' last parameter, holds q's, k's and
// p's as [B, T, Hk, K] with a box of one head's 64 token rows, K + 16 elements wide (K + 8 for prefill_scan_wg)
// -- those past the key axis arrive as zeros, so that a row lands at the stage's padded pitch -- v's as
// [B, T, H, V] with a box
// of 64 rows of one slab, and `use` 0 where the host made none (cupy_comba/_tma.py says when; the scan
// then stages by cp.async).
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};
struct StageMaps {
    TensorMap q, k, p, v;
    long long use;
};
static_assert(sizeof(TensorMap) == 128 && sizeof(StageMaps) == 576,
              "StageMaps: cupy_comba/_tma.py writes 576 bytes, four maps and `use` at byte 512");
#define COMBA_PREFILL_ARGS COMBA_KERNEL_ARGS, const __grid_constant__ StageMaps maps
// A plan's kernels run in turn on one stream; on compute capability 9.0 a scan is launched as a programmatic
// dependent of the kernel before it (the prep, or the segmented scan's chain) where families.Kernel.dependent says
// so (cupy_comba/_launcher.py).  A kernel lets the next one launch as it begins (launch_next), and the next
// waits for the kernels before it to end and their writes to be visible (await_earlier) before it reads the
// workspace -- so its launch, its CTAs' start and its prologue overlap the tail of the kernel before.  Every CTA
// waits before it exits, whether it reads the workspace or not: a kernel's end then implies the end of those
// before it, which is all the caller's next kernel waits for.  Both are no-ops in a kernel launched the ordinary
// way.
__device__ __forceinline__ void launch_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void await_earlier() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
#if __CUDA_ARCH__ >= 900
#define COMBA_BULK_COPY 1
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                 "fence.mbarrier_init.release.cluster;\n" ::"r"(shared_address(bar))
                 : "memory");
}
// The one arrival of this phase, expecting `bytes` of bulk copies.
__device__ __forceinline__ void mbarrier_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(shared_address(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}
// The box at (element e, head h, token t, row b) of `map` into dst.
__device__ __forceinline__ void bulk_rows(void* dst, const TensorMap& map, int e, int h, int t, int b,
                                          unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(shared_address(dst)),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(e), "r"(h), "r"(t), "r"(b), "r"(shared_address(bar))
        : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     shared_address(dst)),
                 "l"(src), "r"(bytes), "r"(shared_address(bar))
                 : "memory");
}
// Orders this thread's generic stores to shared memory before later bulk copies into the same bytes.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// A scan's N stage mbarriers, initialised by thread 0 where it stages by bulk copies, before any thread
// waits on them (every thread passes the barrier: call it from uniform control flow).
template <int N = 2>
__device__ __forceinline__ void init_stage_barriers(unsigned long long* bars, bool bulk, int tid) {
    if (bulk && tid == 0)
        for (int i = 0; i < N; ++i) mbarrier_init(bars + i);
    __syncthreads();
}
// One chunk's rows into the stage at `at` by bulk copies, issued by one thread: the q, k (and p, where the stage
// holds NK = 3 key inputs) rows of key head hk and the v slab at column col0 of head h (v_row bytes a token), all
// from token t of row b_map, completing on `bar`, whose expected bytes include the chunk's record (rec_bytes), which
// the caller copies to Stage::REC_AT by bulk_copy on the same barrier.  Stage names its offsets: KEY_BYTES, NK,
// V_AT, REC_AT.  The rows are the call's inputs and the record the prep's output, so a scan launched as the prep's
// dependent issues its first chunks' rows before it awaits the prep and their records after.
template <class Stage>
__device__ __forceinline__ void bulk_stage_rows(unsigned char* at, const StageMaps& maps, int hk, int h, int col0,
                                                int t, int b_map, int v_row, int rec_bytes, unsigned long long* bar) {
    mbarrier_expect(bar, Stage::NK * Stage::KEY_BYTES + kPrefillChunk * v_row + rec_bytes);
    bulk_rows(at, maps.q, 0, hk, t, b_map, bar);
    bulk_rows(at + Stage::KEY_BYTES, maps.k, 0, hk, t, b_map, bar);
    if (Stage::NK == 3) bulk_rows(at + 2 * Stage::KEY_BYTES, maps.p, 0, hk, t, b_map, bar);
    bulk_rows(at + Stage::V_AT, maps.v, col0, h, t, b_map, bar);
}
#else
#define COMBA_BULK_COPY 0
#endif

// Whether the rows of a key array can be copied as 16-byte pieces into a stage of ES-byte elements
// (bf16 into 16-bit stages, fp32 into fp32 ones).
__device__ __forceinline__ bool rows_copyable(const void* base, long long sb, long long st, long long sh,
                                              long long sk, long long dtype, int es) {
    const int per = 16 / es;
    return (es == 4 ? dtype == F32 : dtype == BF16) && sk == 1 && sb % per == 0 && st % per == 0 && sh % per == 0 &&
           reinterpret_cast<unsigned long long>(base) % 16 == 0;
}

// rows_copyable for q, k and p, staged as elements of es bytes.
struct KeyCopies {
    bool q, k, p;
};
__device__ __forceinline__ KeyCopies key_copies(const void* q, const void* k, const void* p, const Params& prm,
                                                int es) {
    return {rows_copyable(q, prm.q_sb, prm.q_st, prm.q_sh, prm.q_sk, prm.q_t, es),
            rows_copyable(k, prm.k_sb, prm.k_st, prm.k_sh, prm.k_sk, prm.k_t, es),
            rows_copyable(p, prm.p_sb, prm.p_st, prm.p_sh, prm.p_sk, prm.p_t, es)};
}

// Rows t0 .. t0 + C - 1 of one key array into a stage (zeros from row n on), KP elements a row: 16-byte copies,
// or plain loads stored as ES-byte elements (bf16 bits -- the 16-bit stages hold bf16 keys only -- or floats).
template <int K, int ES, int NTHREADS, int KP = K + 16>
__device__ __forceinline__ void stage_keys(unsigned char* dst, const void* src, long long row0, long long st,
                                           long long sk, long long dtype, int n, bool copyable, int tid) {
    constexpr int PER = 16 / ES, ROW = K / PER, ROWS = NTHREADS / ROW;  // pieces a row; rows a pass
    static_assert(NTHREADS % ROW == 0 && kPrefillChunk % ROWS == 0, "whole rows a pass");
    if (copyable) {
        // thread tid copies piece tid % ROW of rows tid / ROW + ROWS j: one address each, stepped
        const int t = tid / ROW, e = (tid - t * ROW) * PER;
        const char* first = static_cast<const char*>(src) + (row0 + e) * ES;  // row 0: a chunk has one
        const char* from = first + t * st * ES;
        const long long step = ROWS * st * ES;
        unsigned char* to = dst + (t * KP + e) * ES;
#pragma unroll
        for (int j = 0; j < kPrefillChunk / ROWS; ++j, from += step) {
            const bool in = t + ROWS * j < n;
            copy_async16(to + ROWS * KP * ES * j, in ? from : first, in);
        }
        return;
    }
    for (int i = tid; i < kPrefillChunk * K; i += NTHREADS) {
        const int t = i / K, e = i - t * K;
        const unsigned bits = t < n ? load_bits(src, row0 + t * st + e * sk, dtype) : 0u;
        if (ES == 2) reinterpret_cast<unsigned short*>(dst)[t * KP + e] = static_cast<unsigned short>(bits);
        else reinterpret_cast<float*>(dst)[t * KP + e] = t < n ? bits_to_float(bits, dtype) : 0.f;
    }
}

// Four staged keys of one row as floats (16-bit stages hold bf16: one shift or mask each).
template <int ES>
__device__ __forceinline__ float4 staged4(const unsigned char* at) {
    if (ES == 4) return *reinterpret_cast<const float4*>(at);
    const uint2 w = *reinterpret_cast<const uint2*>(at);
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u), __uint_as_float(w.y << 16),
                       __uint_as_float(w.y & 0xffff0000u));
}

// Two staged values: bf16 (ES = 2), or fp32.
template <int ES>
__device__ __forceinline__ float2 staged2(const unsigned char* at) {
    if (ES == 4) return *reinterpret_cast<const float2*>(at);
    const unsigned w = *reinterpret_cast<const unsigned*>(at);
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// lo and hi rounded to bf16 (to nearest, even) as one pair, lo in the low half: one cvt instruction, where
// float_to_bf16_bits takes six a value.  (NaN becomes the canonical bf16 NaN; the scan's state is never one
// unless an input is.)
__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ float2 staged_f16x2(const unsigned char* at) {
    const unsigned w = *reinterpret_cast<const unsigned*>(at);
    return make_float2(f16_bits_to_float(static_cast<unsigned short>(w & 0xffffu)),
                       f16_bits_to_float(static_cast<unsigned short>(w >> 16)));
}

// Four 8 x 8 matrices of 16-bit elements from shared memory, each transposed (ldmatrix .trans): lane l gives the
// address of row l % 8 of matrix l / 8, and r[m] receives its part of matrix m.
__device__ __forceinline__ void ldsm4_trans(unsigned (&r)[4], const void* at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(at))
                 : "memory");
}



// The segmented scan's chain tells the segments that it ended through kChainDoneWords words past the records of
// the workspace (128 bytes, a cache line: the maps after them stay line-aligned, as their copies need -- at a
// 16-byte offset the chain and the segments run 2-10 % slower): word 0 counts the chain's CTAs that ended,
// word 1 turns 1 when the last one did (prefill_transposed.cu, chain_ended; the segments that read maps wait for it).
// The prep zeroes them.  Only a split prep (Params::seg_split) needs them: otherwise the segments launch after the
// chain, or as its dependent, and await its end like any kernel's.
constexpr int kChainDoneWords = 32;
__device__ __forceinline__ unsigned load_acquire(const unsigned* at) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(at) : "memory");
    return v;
}
// Where the records end and the end words begin; `ragged`: a packed batch's records (a dense build passes a constant
// false, which keeps the K = 128 chain within the spills tests/test_build.py allows it)
__device__ __forceinline__ long long chain_done_at(const Params& prm, long long record_words, bool ragged) {
    const long long records = ragged ? prm.T / kPrefillChunk + prm.B : prm.B * row_chunks(prm);
    return records * prm.H * record_words;
}

// ---------------------------------------------------------------------------------------------------
// What both scans (prefill_scan, prefill_wgmma.cu's prefill_scan_wg) share: a CTA's place, the zeroing of
// a ragged chunk's borrowed rows, and the o stores.

// The (row b, value head h, slab of VT columns from col0) of CTA `cta` = (b H + h) slabs + slab (slabs: V / VT
// unless given; blockIdx.x unless the kernel maps its grid otherwise), its key head hk, tokens T (the activation and
// o pointers moved to them in a ragged batch), first token `start` in the packed rows and the row b_map that the
// tensor maps address it by, chunks, first record slot, state slot (negative: a padding row) and the offset of its
// state head.
struct ScanRow {
    int b, h, hk, col0, T, chunks, b_map;
    long long start, first, slot, head;
    // The o of a padding row (pool slot -1), every token of the slab, zeroed by the `threads` threads of the CTA.
    __device__ __forceinline__ void zero_padding(void* o, const Params& prm, int slab, int tid, int threads) const {
        zero_o(o, prm, b, h, col0, slab, T, tid, threads);
    }
};
template <int K, int VT, bool SERVING, class In, class Out>
__device__ __forceinline__ ScanRow scan_row(const void* cu, const void* slots, const Params& prm, In& q, In& k,
                                            In& v, In& p, In& beta, In& g, Out& o, int cta = blockIdx.x,
                                            int slabs = 0) {
    ScanRow r;
    const int H = static_cast<int>(prm.H);
    if (!slabs) slabs = static_cast<int>(prm.V) / VT;
    const int bh = cta / slabs;
    r.col0 = (cta - bh * slabs) * VT;
    r.b = bh / H;
    r.h = bh - r.b * H;
    r.hk = r.h / static_cast<int>(prm.group);
    r.start = row_start<SERVING>(cu, prm, r.b);
    r.b_map = SERVING && prm.cu_t ? 0 : r.b;
    r.first = first_slot<SERVING>(cu, prm, r.b);
    r.T = tokens<SERVING>(cu, prm, r.b, q, k, v, p, beta, g, o);
    r.chunks = (r.T + kPrefillChunk - 1) / kPrefillChunk;
    r.slot = state_slot<SERVING>(slots, prm, r.b);
    r.head = (SERVING ? r.slot * H + r.h : static_cast<long long>(bh)) * K * prm.V;
    return r;
}

#if COMBA_BULK_COPY
// A ragged batch's last chunk of a sequence (n < 64 tokens) staged by bulk copies: the boxes' rows n on hold
// the next sequence's tokens; zero them in the NK key arrays (KEY_BYTES apart, ROW bytes a row) and the v
// slab (V_ROW bytes a row from V_AT), as cp.async does, and publish that to the CTA and to later bulk copies.
template <int NK, int KEY_BYTES, int ROW, int NTHREADS>
__device__ __forceinline__ void zero_borrowed_rows(unsigned char* stage, int v_at, int v_row, int n, int tid) {
    constexpr int PR = ROW / 16;  // 16-byte pieces a key row
    const int rows = kPrefillChunk - n, vr = v_row / 16;
    for (int i = tid; i < NK * rows * PR; i += NTHREADS) {
        const int a = i / (rows * PR), r = i - a * rows * PR;
        *reinterpret_cast<uint4*>(stage + a * KEY_BYTES + (n + r / PR) * ROW + 16 * (r % PR)) = make_uint4(0, 0, 0, 0);
    }
    for (int i = tid; i < rows * vr; i += NTHREADS)
        *reinterpret_cast<uint4*>(stage + v_at + (n + i / vr) * v_row + 16 * (i % vr)) = make_uint4(0, 0, 0, 0);
    fence_async_shared();  // before a later bulk copy into these bytes
    __syncthreads();
}
#endif

// A lane's token rows ta and ta + 8 of every chunk's o, at columns col + 8 j, + 1 of its fragments j: bf16
// pairs through a pointer stepped a chunk at a time where o is bf16 with aligned pairs (the usual output),
// else stores from the strides.
struct OutRows {
    void* o;
    unsigned char* row;  // bf16 pairs: row ta's first pair in this chunk
    long long at, st, sv, dtype;  // else: the element of row ta's first column in this chunk
    int ta;
    bool pairs, pairs16;
    __device__ __forceinline__ OutRows(void* o_, const Params& prm, int b, int h, int col, int ta_)
        : o(o_), st(prm.o_st), sv(prm.o_sv), dtype(prm.o_t), ta(ta_) {
        pairs = pairs_aligned(o_, prm.o_sb, prm.o_st, prm.o_sh, prm.o_sv, prm.o_t);
        pairs16 = pairs && dtype == BF16;
        at = b * prm.o_sb + ta * st + h * prm.o_sh + col * sv;
        row = static_cast<unsigned char*>(o_) + 2 * at;
    }
    // This chunk's rows (n tokens): fragment j's values f(j, 0), f(j, 1) in row ta, f(j, 2), f(j, 3) in row
    // ta + 8; then the next chunk.
    template <int FRAGS, class F>
    __device__ __forceinline__ void store(int n, F f) {
        const bool a = ta < n, z = ta + 8 < n;
        if (pairs16) {
#pragma unroll
            for (int j = 0; j < FRAGS; ++j) {
                if (a) *reinterpret_cast<unsigned*>(row + 16 * j) = bf16_pair(f(j, 0), f(j, 1));
                if (z) *reinterpret_cast<unsigned*>(row + 16 * st + 16 * j) = bf16_pair(f(j, 2), f(j, 3));
            }
        } else {
#pragma unroll
            for (int j = 0; j < FRAGS; ++j) {
                const long long e = at + 8 * j * sv;
                if (a) store_act_pair(o, e, sv, dtype, f(j, 0), f(j, 1), pairs);
                if (z) store_act_pair(o, e + 8 * st, sv, dtype, f(j, 2), f(j, 3), pairs);
            }
        }
        row += 2 * kPrefillChunk * st;
        at += kPrefillChunk * st;
    }
};

}  // namespace comba
