// prefill.cu -- long forward passes of the gated delta rule in chunks of 64 tokens on the tensor
// cores, in two kernels: `prefill_prep`, parallel over every chunk of every head, forms each chunk's
// coefficients; `prefill_scan`, parallel over heads and slabs of value columns, carries the state
// from chunk to chunk and writes o.  Either state layout, Comba and Gated DeltaNet (p = k).
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
// (ACC 2 and 3).  ACC 5 and 6 are the "bf16" records of the two wgmma scans (prefill_wgmma.cu): ACC 5 the same
// products with its fragments in wgmma's natural order, ACC 6 A and Mq as the transposed scan's B tiles (WtRecord).
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
// maps (prefill_wgmma.cu).
//
// Launch geometry.  prep: one 128-thread CTA a (chunk slot, value head), its keys staged in shared
// memory (PrepLayout); the Gram tiles on or below the diagonal shared out evenly over the four warps, each
// warp applying its tiles' decays as it stores them, threads 0 .. 63 the diagonal blocks' substitution,
// one column each, and the four warps the blocks below the diagonal on mma.sync.  scan: one 256-thread
// CTA a (row, value head, slab of VT = 16 or 32 value columns); warp w holds token tile w % 4 of Y, U
// and O and half (w / 4) of the slab's column tiles, and of the state (K x VT fp32) key tiles
// K / 64 (w % 4) .. + K / 64 - 1 of those columns, in its accumulators; the state is also published
// to shared memory for the read.  A chunk's inputs are staged into one of two stages (ScanLayout; one
// where two do not fit) while the previous chunk is computed: on Hopper by five bulk copies from thread 0
// that complete on the stage's mbarrier (StageMaps), else by cp.async pieces from every thread.  Three CTA
// barriers a chunk (four with one stage, or where a packed sequence's last chunk clears its neighbour's rows).
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

// The record of prefill_scan_wt (ACC 6, prefill_wgmma.cu), in 32-bit words: A (64 x 64), then G fp, scale G fq, w
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

// ---------------------------------------------------------------------------------------------------
// prefill_prep: the coefficients of one chunk of one value head (header).  The chunk's rows of q, k
// and p are staged first (bf16 by cp.async, or as floats); the Gram products then run from shared
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

__device__ __forceinline__ void ldsm4_trans(unsigned (&r)[4], const void* at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(at))
                 : "memory");
}

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

// The segmented scan's chain tells the segments that it ended through kChainDoneWords words past the records of
// the workspace (128 bytes, a cache line: the maps after them stay line-aligned, as their copies need -- at a
// 16-byte offset the chain and the segments run 2-10 % slower): word 0 counts the chain's CTAs that ended,
// word 1 turns 1 when the last one did (prefill_wgmma.cu, chain_ended; the segments that read maps wait for it).
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

// ---------------------------------------------------------------------------------------------------
// prefill_scan: one slab of VT value columns of one head, chunk after chunk (header).
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
