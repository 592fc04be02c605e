// delta_rule_mma.cu -- T-token passes of the gated delta rule with each chunk of 8 tokens done
// as small matrix products on the tensor cores (mma.sync m16n8k8, TF32 operands split in three
// for fp32 accuracy), one or two chunks a pass over the state (SUBS).  Either state layout; the
// state is read once, stays in registers across the T tokens and is written once, as in
// delta_rule.cu.
//
// Math.  A chunk of C = 8 tokens from the state S0 (K x V); G_t = e_0 ... e_t, r(j, t) = e_{j+1}
// ... e_t (r(t, t) = 1); fq, fk, fp the L2-norm factors (1 without use_qk_l2norm).  Tokens past
// T are padded with q = k = p = v = 0, beta = 0, e = 1, which makes them no-ops.  With V x C
// matrices whose column t belongs to token t:
//
//   [Rp | Rq] = S0^T [p_0 .. p_7 | q_0 .. q_7]                        one pass, k-dim K
//   Y   = v^T - Rp diag(G fp)
//   U^T = Y M^T,   M = (I + L)^-1 diag(beta),  L[t][j] = beta_t fp_t r(j, t) fk_j (k_j . p_t), j < t
//   O^T = scale (Rq diag(G fq) + U^T Bq),      Bq[j][t] = r(j, t) fk_j fq_t (k_j . q_t), j <= t
//   S^T = G_7 S0^T + (U^T diag(w)) [k_0 .. k_7]^T,   w_j = r(j, 7) fk_j
//
// -- the token recurrence of delta_rule.cu unrolled over the chunk (u_t is column t of U^T),
// exact algebra.  Every product with a K or V dimension runs on the tensor cores: the four above
// and the chunk's dot products, which are Gram products of the staged fragments ([p; q] k^T, and
// for use_qk_l2norm the norms); only the 8 x 8 solve for M and the factors run on CUDA cores (fp32).
//
// Two chunks a pass (SUBS = 2, tokens 0-7 and 8-15): both read [Rp | Rq] from the pass's first
// state S0; the second needs the state S1^T = G_7 S0^T + (U_0^T diag(w_0)) K_0^T the first leaves, so
//
//   [Rp | Rq]_1 = G_7 [Rp | Rq]_1(S0) + (U_0^T diag(w_0)) [X_p | X_q],   X_p[j][t] = k_{0,j} . p_{1,t}
//
// (X_q with q; one more Gram product), and each chunk then runs the formulas above in turn, its
// write included.
//
// Precision.  TF32 keeps 10 mantissa bits.  Every fp32 operand x is split as hi = x rounded to TF32,
// lo = x - hi (split() below), and a product is hi*hi + hi*lo + lo*hi ("3xTF32"): about 2^-21
// relative per product, the accuracy of an fp32 FMA chain (state error vs float64 ~1.6e-7, as the
// CUDA-core kernels).  bf16 and fp16 values are TF32 values already (lo = 0), so when q, k and p
// all are, the read and write products leave out their hi*lo term: two mma.sync instead of three,
// with the same sums.
//
// Fragments.  The state lives in registers as the fp32 accumulator of S^T (rows V, columns K):
// in each 16 x 8 tile lane (g = lane / 4, j = lane % 4) holds rows g, g + 8 and columns 2j,
// 2j + 1.  Read as an A operand (rows g, g + 8; k-columns j, j + 4) the same registers serve
// unchanged if k-column j stands for state column 2j and j + 4 for 2j + 1 -- a permutation of
// the K index, which the B operand (p, q) follows.  U^T, Y and O^T use the same trick over the
// token index.  So the state never moves between lanes.  The 16 rows of a warp's tile are 16
// value columns: row g is column 2g of the tile, row g + 8 column 2g + 1, so a lane's two values
// are adjacent in memory (one 8-byte store per state row in "kv", whose loads are two 4-byte ones --
// see the state load; one 8-byte access per pair of K in "vk").
//
// Launch geometry: delta_rule_mma<K, SLAB, SEPARATE_P, VK, SUBS> -- one CTA per (b, h, slab of SLAB
// value columns); NW = (SLAB / 16) x (K / 64) warps, each 16 value columns x 64 keys of the state
// (32 registers a lane); SLAB is 32 or 64, and at K = 64 with two chunks a pass also 128 (8 warps,
// as a 64-column slab at K = 128: one CTA a V = 128 head stages and solves each chunk once).  The
// K-reduction of a warp stays in its mma.sync accumulators; the K / 64 key parts of a value group
// add their partial [Rp | Rq] through shared memory.  The stage (MmaStage) is dynamic shared memory
// of cupy_comba.tiling.mma_stage_bytes.  At the start each thread asks L2 for a line of the state
// of the CTA a wave later.  Per pass (one chunk, or two with SUBS = 2: their solves on warps 0-1 and
// 2-3 at once, their Gram products over the value groups), four CTA barriers:
//   1. every thread stages 4 consecutive keys of one token of q, k, p (one 8- or 16-byte load
//      where the rows allow it) as B fragments -- two values, split by their reader when fp32 --
//      plus its v values and the gates, and issues the next chunk's loads; bf16 in contiguous rows
//      (the fast path, no dtype branch) is copied two chunks ahead into shared memory instead
//      (MmaRing);
//   2. every warp reads [Rp | Rq] over its keys; then the Gram products over its keys -- with one
//      chunk the warps of value group 0 form them all (the one against k inside the read loop, from
//      the fragments it loads, for 16-bit inputs), with two the value groups share them out;
//   3. warps 0 and 1 (and 2 and 3 for the second chunk) solve the 8 x 8 coefficients once for the
//      CTA (M; Bq and the per-token factors);
//   4. U, O and the write, chunk by chunk.
// A warp runs 72 mma.sync a chunk with an fp32 among q, k, p (48 for the read, 3 + 3 for U and O, 24
// for the write), 54 otherwise (32, 3 + 3, 16); the warps of value group 0 add the Gram product
// with k, and with use_qk_l2norm one more (Gated DeltaNet) or three (Comba), 8 mma.sync each (24
// with an fp32 among q, k, p).  A two-chunk pass holds only the 16-bit path (registers: the
// launch runs an fp32 among q, k, p with one chunk a pass).
//
// Where it stands (docs/benchmarks.md, "Multi-token" and "Tilings"): with few heads (B*H <= 128)
// the GPU waits on each token's latency and this kernel, 8 or 16 tokens a step, is the fastest from
// T = 5 on; with many heads a pass costs about the same whatever its fill, and
// cupy_comba.tiling.choose takes it there from T = 5, 16 tokens a pass where fewer passes pay for
// their cost (1.7 passes of 8).  B*H = 8192, K = V = 128, T = 16: 512.4 us "kv", 511.6 us "vk", x1.96
// and x1.92 of the decode step, against 980 us for the token loop; at K = 64, 128-column slabs:
// 246.8 us "kv", 251.7 us "vk" (x1.86), against 270.9 / 270.5 us in 64-column slabs.  In-kernel clocks
// (16-token passes, sixth session, before the kv loads of 4 bytes and the solve's reads ahead of its
// stores; medians, cycles) put a CTA at 16400, two CTAs an SM: setup and staging 6600 (4300 without
// the state), the read 2300, the Gram products 950, the solve 1750, U, O and the write 3300, the
// final stores 1100.
#include "common.cuh"
#include "params.cuh"

namespace comba {

constexpr int kMmaChunk = 8;

// hi, lo halves of x: x = hi + lo exactly, hi = x rounded to TF32 (10 mantissa bits, ties away from
// zero; integer arithmetic, 2 instructions against 4 for cvt.rna.tf32's inf / NaN handling).  lo goes
// to the tensor cores unrounded: whether they truncate it to TF32 or use more of its bits, the error
// stays under 2^-10 of lo, 2^-21 of x.  NaN stays NaN: hi of the canonical NaN (0x7fffffff) wraps to
// -0, but lo is NaN.  When x is already a TF32 value (every bf16 or fp16 input), hi = x and lo = 0.
__device__ __forceinline__ void split(float x, unsigned& hi, unsigned& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

// One 4-byte global load that NVVM cannot merge with its neighbour (see the kv state load).  Not
// volatile, so that it may be scheduled freely: it cannot sink past the store to its address (in
// place, state_out is state), as that store writes a value computed from it.
__device__ __forceinline__ float load_f32(const float* p) {
    float x;
    asm("ld.global.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}

// A B fragment is kept as {b0 hi, b1 hi, b0 lo, b1 lo}: the hi and lo register pairs go to mma.sync
// as they were loaded, with no moves.
__device__ __forceinline__ void split_into(unsigned* frag, int i, float x) { split(x, frag[i], frag[2 + i]); }

// Two values split into one whole B fragment.
__device__ __forceinline__ uint4 split_pair(float b0, float b1) {
    uint4 f;
    split(b0, f.x, f.z);
    split(b1, f.y, f.w);
    return f;
}

// An accumulator tile (c0 .. c3) as an A operand, split: a = (c0, c2, c1, c3) (the header's
// permutation of the k index).
__device__ __forceinline__ void a_operand(const float (&c)[4], unsigned (&hi)[4], unsigned (&lo)[4]) {
    const float a[4] = {c[0], c[2], c[1], c[3]};
#pragma unroll
    for (int i = 0; i < 4; ++i) split(a[i], hi[i], lo[i]);
}

__device__ __forceinline__ void mma_tf32(float& d0, float& d1, float& d2, float& d3, const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += (ah + al)(bh + bl) without the al bl term; b = (b0 hi, b1 hi, b0 lo, b1 lo).  B_EXACT: b is
// TF32 already (bl = 0, from bf16 / fp16 inputs), so the ah bl product is left out -- the same sum.
// The accumulator tile is d0 .. d3 (rows g, g, g + 8, g + 8; columns 2j, 2j + 1, 2j, 2j + 1).
template <bool B_EXACT = false>
__device__ __forceinline__ void mma3(float& d0, float& d1, float& d2, float& d3, const unsigned (&ah)[4],
                                     const unsigned (&al)[4], uint4 b) {
    mma_tf32(d0, d1, d2, d3, al, b.x, b.y);
    if (!B_EXACT) mma_tf32(d0, d1, d2, d3, ah, b.z, b.w);
    mma_tf32(d0, d1, d2, d3, ah, b.x, b.y);
}

template <bool B_EXACT = false>
__device__ __forceinline__ void mma3(float (&d)[4], const unsigned (&ah)[4], const unsigned (&al)[4], uint4 b) {
    mma3<B_EXACT>(d[0], d[1], d[2], d[3], ah, al, b);
}

// The state tile is kept in memory order m = (S[r][c], S[r][c + 1], S[r + 1][c], S[r + 1][c + 1]) of
// the lane's two 8-byte accesses (kernel below), so that the loaded values need no moves.  In kv,
// (r, c) = (kk, vl) and the accumulator tile of S^T is (m0, m2, m1, m3); in vk, (r, c) = (vl, kk)
// and it is m itself.
template <bool VK, bool B_EXACT>
__device__ __forceinline__ void mma3_state(float (&m)[4], const unsigned (&ah)[4], const unsigned (&al)[4], uint4 b) {
    if (VK) mma3<B_EXACT>(m[0], m[1], m[2], m[3], ah, al, b);
    else mma3<B_EXACT>(m[0], m[2], m[1], m[3], ah, al, b);
}

// The state tile as an A operand, split (a_operand of its accumulator tile).
template <bool VK>
__device__ __forceinline__ void state_a_operand(const float (&m)[4], unsigned (&hi)[4], unsigned (&lo)[4]) {
    const float a[4] = {m[0], VK ? m[2] : m[1], VK ? m[1] : m[2], m[3]};
#pragma unroll
    for (int i = 0; i < 4; ++i) split(a[i], hi[i], lo[i]);
}

// Warps of a CTA: SLAB / 16 value groups x K / 64 key parts; a warp holds 16 value columns x 64
// keys of the state (32 registers a lane).
template <int K, int SLAB>
struct MmaShape {
    static constexpr int KS = K / 64, NW = SLAB / 16 * KS, NT = 32 * NW, NKW = 8;
    // CTAs an SM: 16 warps of 256-thread CTAs (128 registers); 12 warps otherwise (168 registers),
    // which the smaller CTAs need to stay clear of spills.
    static constexpr int MIN_CTAS = NT >= 256 ? 2 : 384 / NT;
};

// Where the write fragment of lane (g, j) is kept in its row of MmaStage::kw (before the row's own
// swizzle, MmaStage::kw): lanes g and g + 4 on different banks.  Since the row swizzle the XOR here
// no longer changes the staging's wavefronts (two a store either way, by the count in MmaStage::kw);
// it stays until a GPU run checks the build without it.
__device__ __forceinline__ int kw_lane(int g, int j) { return 4 * g + (j ^ ((g >> 1) & 3)); }

// Read fragments of k-step n are kept at lane ^ x_swizzle(n) of their row of MmaStage::x.  A warp
// staging one token (K = 128; two at K = 64) stores the 8-byte fragments of 16 k-steps, two lanes
// of each: x_swizzle spreads its 32 stores over every bank, two wavefronts -- the least 256 bytes
// take.  (With (n & 1) | ((n & 2) << 1) they took four.)  The readers, one row at a time, read
// every lane of it: conflict-free under any permutation.
__device__ __forceinline__ int x_swizzle(int n) { return (n & 1) | ((n & 14) << 1); }

// The 8 x 8 coefficients of a chunk (the header's M, Bq, ...), one copy a CTA.
struct alignas(16) ChunkCoefficients {
    float l[kMmaChunk][kMmaChunk];     // -L (zero on and above the diagonal), the solve's scratch
    float m[kMmaChunk][kMmaChunk];     // M = (I + L)^-1 diag(beta)
    float bq[kMmaChunk][kMmaChunk];    // scale * Bq
    float cp[kMmaChunk], cq[kMmaChunk], w[kMmaChunk];  // G_t fp_t, scale G_t fq_t, r(j, 7) fk_j
    float g_last;                      // G_7
};

// Four consecutive keys of one token: one 8- or 16-byte load where the keys are contiguous and
// the rows aligned (`vec`), else four scalar loads (any strides).  Raw bits, converted at first
// use (common.cuh, load_bits): 4 floats, or 4 16-bit values -- packed in .x, .y after a vector
// load, one a word otherwise.
__device__ __forceinline__ uint4 load4_bits(const void* base, long long i, long long sk, long long dtype, bool vec) {
    if (vec) {
        if (dtype == F32) return *reinterpret_cast<const uint4*>(static_cast<const float*>(base) + i);
        const uint2 h = *reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(base) + i);
        return make_uint4(h.x, h.y, 0u, 0u);
    }
    return make_uint4(load_bits(base, i, dtype), load_bits(base, i + sk, dtype), load_bits(base, i + 2 * sk, dtype),
                      load_bits(base, i + 3 * sk, dtype));
}

__device__ __forceinline__ float4 bits4_to_float4(uint4 u, long long dtype, bool vec) {
    if (dtype == F32) return make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z),
                                         __uint_as_float(u.w));
    if (!vec) return make_float4(bits_to_float(u.x, dtype), bits_to_float(u.y, dtype), bits_to_float(u.z, dtype),
                                 bits_to_float(u.w, dtype));
    if (dtype == BF16) return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                                          __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
    return make_float4(f16_bits_to_float(u.x & 0xffffu), f16_bits_to_float(u.x >> 16), f16_bits_to_float(u.y & 0xffffu),
                       f16_bits_to_float(u.y >> 16));
}

// Whether every 4-key run of an activation [B, T, H, K] is one aligned vector load.
__device__ __forceinline__ bool rows_vectorisable(const void* base, long long sb, long long st, long long sh,
                                                  long long sk, long long dtype) {
    const unsigned long long bytes = dtype == F32 ? 16 : 8;
    return sk == 1 && sb % 4 == 0 && st % 4 == 0 && sh % 4 == 0 && reinterpret_cast<unsigned long long>(base) % bytes == 0;
}

// Raw bits of one chunk that thread `tid` stages: in pass P keys 4 (tid + P NT) .. + 3 of the C x K
// token-major q, k, p (one token), EV consecutive values of the v slab, and beta / g on threads
// 0 .. 2C - 1.  On the register path one pass is issued a chunk ahead; with two passes the second
// is loaded and staged in turn, so that the bits in flight and the state fit the registers
// together.  The bf16 fast path fills it from the ring (ring_bits), both passes two chunks ahead.
template <int K, int NT, int SLAB, int C>
struct MmaChunkBits {
    static constexpr int E = C * K / NT, PASSES = E / 4, EV = C * SLAB / NT;
    static_assert(E % 4 == 0 && SLAB % EV == 0, "bad staging split");
    uint4 q, k, p;
    unsigned v[EV], gate;
};

// A chunk is SUBS sub-chunks of kMmaChunk tokens (SUBS = 2: one pass over the state for 16 tokens).
template <int K, int SLAB, int SUBS>
using MmaBits = MmaChunkBits<K, MmaShape<K, SLAB>::NT, SLAB, kMmaChunk * SUBS>;

// The chunk's Gram products, each a 16 x 8 mma.sync accumulator, one per key part (summed when
// read): rows [p_0 .. p_7 | q_0 .. q_7] of a sub-chunk (or [k | q] for kGramKK) against its columns
// k, p or q; kGramX (SUBS = 2): rows [p | q] of sub-chunk 1 against the columns k of sub-chunk 0.
enum GramProduct { kGramK = 0, kGramP = 1, kGramQ = 2, kGramKK = 3, kGramX = 4 };

// Where product pr of sub-chunk s is kept in MmaStage::gram.  With two sub-chunks the products
// every chunk needs come first (k of each, the cross product), then the norms', so that the warps
// that take slot i % (SLAB / 16) share them out evenly (gram_products).
template <int SUBS>
__device__ __forceinline__ constexpr int gram_slot(int pr, int s) {
    return SUBS == 1 ? pr : pr == kGramK ? s : pr == kGramX ? 2 : pr == kGramQ ? 3 + s : pr == kGramP ? 5 + s : 7 + s;
}
template <int SUBS>
constexpr int kGramSlots = SUBS == 1 ? 4 : 9;

// The bf16 fast path's loads go out two chunks ahead, as cp.async copies of the raw bits into a
// ring of two chunk slots: the copies hold no registers while they fly (at many heads a load takes
// about a chunk's time to arrive), and each thread reads back only the bytes it copied itself, so
// no barrier guards the ring.  Entry tid + PASS NT of a plane holds the thread's 4 keys of pass
// PASS (issue_chunk's split); v holds the thread's EV values, two a word.
template <int K, int SLAB, bool SEPARATE_P, int SUBS>
struct MmaRing {
    static constexpr int NT = MmaShape<K, SLAB>::NT, PASSES = MmaBits<K, SLAB, SUBS>::PASSES;
    static constexpr int EV = MmaBits<K, SLAB, SUBS>::EV;
    uint2 qkp[2][SEPARATE_P ? 3 : 2][PASSES * NT];  // q, k, p
    unsigned v[2][NT * EV / 2];
};

template <int K, int SLAB, bool SEPARATE_P, int SUBS>
struct MmaStage {
    static constexpr int KS = MmaShape<K, SLAB>::KS, PLANES = SEPARATE_P ? 3 : 2, C = kMmaChunk * SUBS;
    // B fragments over the keys, per k-step: p (k for Gated DeltaNet), q, and k for Comba (read and
    // Gram operands); kw: the write's fragments of [k_0 .. k_7]^T, per state column tile.  Kept as
    // the values (b0, b1); with an fp32 among q, k, p the reader splits them into {hi, hi, lo, lo}
    // (16 bytes a fragment kept would not leave the registers room: two sub-chunks spilled), with
    // 16-bit inputs they are the hi pair (lo = 0).
    uint2 x_[SUBS][K / 8][PLANES][32];
    uint2 kw_[SUBS][K / 8][32];
    MmaRing<K, SLAB, SEPARATE_P, SUBS> ring;   // the fast path's copies
    float4 part[SLAB / 16][KS][2 * SUBS][32];  // per key part: the read's Rp, Rq of each sub-chunk
    float4 gram[KS][kGramSlots<SUBS>][32];     // per key part: the Gram products (gram_slot)
    // v of the slab, rows padded by 4 floats.  U's lanes read 8 bytes at v[2 lj][vl] (and 2 lj + 1),
    // which shared memory serves half a warp at a time; the pad puts the four rows of a half 8 banks
    // apart, so each half is one wavefront (Nsight Compute: four without a pad, two with 8 floats).
    float v[C][SLAB + 4];
    float e[C], beta[C];
    ChunkCoefficients coef[SUBS];

    template <bool EXACT>
    __device__ __forceinline__ static uint4 fragment(uint2 f) {
        if (EXACT) return make_uint4(f.x, f.y, 0u, 0u);
        return split_pair(__uint_as_float(f.x), __uint_as_float(f.y));
    }
    template <bool EXACT>
    __device__ __forceinline__ uint4 x(int s, int n, int plane, int slot) const {
        return fragment<EXACT>(x_[s][n][plane][slot]);
    }
    __device__ __forceinline__ void set_x(int s, int n, int plane, int slot, float b0, float b1) {
        x_[s][n][plane][slot] = make_uint2(__float_as_uint(b0), __float_as_uint(b1));
    }
    // Lane `slot`'s write fragment of state tile n, kept at slot ^ n of its row (n < 16): the warp
    // staging a token stores one key of it to each of 16 rows at once, all at the same word of
    // their slot, so without the row's swizzle the 32 stores fell on two banks (16 wavefronts each,
    // 8 stores a thread; Nsight Compute put them at 15.8 M of the kernel's 25.3 M excess
    // shared-memory wavefronts at B*H = 8192, T = 16).  With it: 16 banks, two wavefronts -- the
    // least, as the one token's 32 values all go to the same word of their slots.
    template <bool EXACT>
    __device__ __forceinline__ uint4 kw(int s, int n, int slot) const {
        return fragment<EXACT>(kw_[s][n][slot ^ n]);
    }
    // Value x of B fragment register i (0 or 1) of kw(s, n, slot).
    __device__ __forceinline__ void set_kw(int s, int n, int slot, int i, float x) {
        reinterpret_cast<unsigned*>(&kw_[s][n][slot ^ n])[i] = __float_as_uint(x);
    }

    // Entry (r, c) of the Gram product in slot j, summed over the key parts: lane 4 (r % 8) + c / 2
    // holds it, element 2 (r / 8) + c % 2 of its accumulator tile.
    __device__ __forceinline__ float dot(int j, int r, int c) const {
        float s = 0.f;
#pragma unroll
        for (int kp = 0; kp < KS; ++kp)
            s += reinterpret_cast<const float*>(&gram[kp][j][4 * (r & 7) + (c >> 1)])[2 * (r >> 3) + (c & 1)];
        return s;
    }
};

// The register path's loads of one chunk (any dtype and strides): MmaChunkBits' split, pass PASS.
template <int K, int SLAB, bool SEPARATE_P, int SUBS, int PASS>
__device__ __forceinline__ void issue_chunk(MmaBits<K, SLAB, SUBS>& x, const void* q, const void* k, const void* v,
                                            const void* p, const void* beta, const void* g, const Params& prm,
                                            bool vec, int tid, int b, int h, int hk, int slab0, int t0, int c) {
    constexpr int NT = MmaShape<K, SLAB>::NT;
    using Bits = MmaBits<K, SLAB, SUBS>;
    const int i0 = 4 * (tid + PASS * NT), t = i0 / K, kk = i0 % K;
    x.q = x.k = x.p = make_uint4(0u, 0u, 0u, 0u);
    if (t < c) {
        const long long tt = t0 + t;
        const long long iq = b * prm.q_sb + tt * prm.q_st + hk * prm.q_sh + kk * prm.q_sk;
        const long long ik = b * prm.k_sb + tt * prm.k_st + hk * prm.k_sh + kk * prm.k_sk;
        const long long ip = b * prm.p_sb + tt * prm.p_st + hk * prm.p_sh + kk * prm.p_sk;
        x.q = load4_bits(q, iq, prm.q_sk, prm.q_t, vec);
        x.k = load4_bits(k, ik, prm.k_sk, prm.k_t, vec);
        if (SEPARATE_P) x.p = load4_bits(p, ip, prm.p_sk, prm.p_t, vec);
    }
    if (PASS == 0) {
        const int iv = Bits::EV * tid, tv = iv / SLAB, vv = iv % SLAB;
        const long long vi = b * prm.v_sb + (t0 + tv) * prm.v_st + h * prm.v_sh + (slab0 + vv) * prm.v_sv;
#pragma unroll
        for (int e = 0; e < Bits::EV; ++e) x.v[e] = tv < c ? load_bits(v, vi + e * prm.v_sv, prm.v_t) : 0u;
        x.gate = issue_chunk_gates<kMmaChunk * SUBS>(beta, g, prm, tid, b, h, t0, c);
    }
}

// Stage one pass of a chunk from its raw bits.  FAST: the bits came from the ring (ring_bits), every
// one of q, k, p, v bf16 with vector rows (the kernel's `fast`), v packed two values a word, so no
// dtype or stride branch is taken per element.
template <int K, int SLAB, bool SEPARATE_P, int SUBS, int PASS, bool FAST>
__device__ __forceinline__ void stage_chunk(MmaStage<K, SLAB, SEPARATE_P, SUBS>& st, const MmaBits<K, SLAB, SUBS>& x,
                                            const Params& prm, bool vec, int tid, int c) {
    constexpr int NT = MmaShape<K, SLAB>::NT;
    using Bits = MmaBits<K, SLAB, SUBS>;
    // Token tc of the chunk is token t of sub-chunk s.
    const int i0 = 4 * (tid + PASS * NT), tc = i0 / K, s = tc / kMmaChunk, t = tc % kMmaChunk, kk = i0 % K;
    const float4 xq = bits4_to_float4(x.q, FAST ? BF16 : prm.q_t, FAST || vec);
    const float4 xk = bits4_to_float4(x.k, FAST ? BF16 : prm.k_t, FAST || vec);
    const float4 xp = SEPARATE_P ? bits4_to_float4(x.p, FAST ? BF16 : prm.p_t, FAST || vec) : xk;
    // Read operand: keys 8n + 2j, 8n + 2j + 1 are k-columns j, j + 4 (b0, b1) of lane 4t + j.
    const int n = kk >> 3, j0 = (kk & 7) >> 1, sw = x_swizzle(n);
    st.set_x(s, n, 0, (4 * t + j0) ^ sw, xp.x, xp.y);
    st.set_x(s, n, 0, (4 * t + j0 + 1) ^ sw, xp.z, xp.w);
    st.set_x(s, n, 1, (4 * t + j0) ^ sw, xq.x, xq.y);
    st.set_x(s, n, 1, (4 * t + j0 + 1) ^ sw, xq.z, xq.w);
    if constexpr (SEPARATE_P) {  // k in the same layout, for the Gram products
        st.set_x(s, n, 2, (4 * t + j0) ^ sw, xk.x, xk.y);
        st.set_x(s, n, 2, (4 * t + j0 + 1) ^ sw, xk.z, xk.w);
    }
    // Write operand: token t is k-row t / 2 (b0, even t) or t / 2 + 4 (b1, odd t) of lane (key % 8, t / 2).
    const float xs[4] = {xk.x, xk.y, xk.z, xk.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) st.set_kw(s, n, kw_lane((kk & 7) + e, t >> 1), t & 1, xs[e]);
    if (PASS == 0) {
        const int iv = Bits::EV * tid;
#pragma unroll
        for (int e = 0; e < Bits::EV; ++e) {
            const unsigned w = FAST ? x.v[e / 2] : x.v[e];
            st.v[iv / SLAB][iv % SLAB + e] =
                FAST ? __uint_as_float(e % 2 ? w & 0xffff0000u : w << 16) : bits_to_float(w, prm.v_t);
        }
        stage_chunk_gates<kMmaChunk * SUBS>(st.e, st.beta, x.gate, prm, tid, c);
    }
}

// A 16 x 8 product of fragments whose lo halves are zero when EXACT (bf16 / fp16 inputs): one
// mma.sync then, else three (3xTF32).
template <bool EXACT>
__device__ __forceinline__ void mma_fragments(float (&d)[4], const unsigned (&ah)[4], const unsigned (&al)[4],
                                              uint4 b) {
    if (EXACT) mma_tf32(d[0], d[1], d[2], d[3], ah, b.x, b.y);
    else mma3(d, ah, al, b);
}

// This warp's part (k-steps n0 .. n0 + 7) of the chunk's Gram products, into st.gram[n0 / 8]:
// A = [p_0 .. p_7 | q_0 .. q_7] as rows -- lane (g, j) holds p_g and q_g at k-columns j, j + 4 in its
// staged B fragments of p and q, exactly an A fragment's four values -- against B = k (k_j . p_t,
// k_j . q_t; with 16-bit inputs the read loop forms this one from the fragments it loads, so it is
// skipped here), and with use_qk_l2norm against B = q (|q_t|^2), for Comba also B = p (|p_t|^2)
// and A = [k | q] against k (|k_t|^2).  For Gated DeltaNet |k_t|^2 = |p_t|^2 is k_t . p_t.  With
// two sub-chunks, each sub-chunk's products and kGramX (rows [p | q] of sub-chunk 1 against k of
// sub-chunk 0), all formed here, slot j (gram_slot) by the warps of value group j % (SLAB / 16);
// with one, every product by value group 0.
template <int K, int SLAB, bool SEPARATE_P, int SUBS, bool EXACT, bool K_IN_READ>
__device__ __forceinline__ void gram_products(MmaStage<K, SLAB, SEPARATE_P, SUBS>& st, bool l2norm, int n0, int lane,
                                              int vgroup) {
    // Planes of MmaStage::x: p (k for Gated DeltaNet), q, k.
    constexpr int P = 0, Q = 1, KP = SEPARATE_P ? 2 : 0, VG = SLAB / 16;
#pragma unroll
    for (int s = 0; s < SUBS; ++s) {
#pragma unroll
        for (int pr = K_IN_READ ? kGramP : kGramK; pr <= (SUBS > 1 && s == 1 ? kGramX : kGramKK); ++pr) {
            const int j = gram_slot<SUBS>(pr, s);  // one product at a time
            if (vgroup != (SUBS == 1 ? 0 : j % VG)) continue;
            if (pr != kGramK && pr != kGramX && !(l2norm && (SEPARATE_P || pr == kGramQ))) continue;
            const int rows = pr == kGramKK ? KP : P;
            const int cols = pr == kGramP ? P : pr == kGramQ ? Q : KP, cs = pr == kGramX ? 0 : s;
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
            for (int n = 0; n < MmaShape<K, SLAB>::NKW; ++n) {
                const int slot = lane ^ x_swizzle(n0 + n);
                const uint4 xr = st.template x<EXACT>(s, n0 + n, rows, slot);
                const uint4 xq = st.template x<EXACT>(s, n0 + n, Q, slot);
                const unsigned ah[4] = {xr.x, xq.x, xr.y, xq.y}, al[4] = {xr.z, xq.z, xr.w, xq.w};
                mma_fragments<EXACT>(d, ah, al, st.template x<EXACT>(cs, n0 + n, cols, slot));
            }
            st.gram[n0 / MmaShape<K, SLAB>::NKW][j][lane] = make_float4(d[0], d[1], d[2], d[3]);
        }
    }
}

// The 8 x 8 coefficients of sub-chunk `sub` from the Gram products and gates, once a CTA, by two warps:
// role 0 (M) and role 1 (Bq and the per-token factors).  Lane t % 8 of each finds token t's norm
// factors; the others' come by shuffle.  Role 0: the lanes form the entries of -L at once, then lane
// m < 8 solves column m of M (the other lanes repeat the work of lane m % 8 and store nothing).  Role
// 1: lane t < 8 builds column t of scale * Bq, lane 8 + j the factors w_j, cp_j, cq_j.  A store to cf
// holds back every later shared-memory read (the compiler cannot tell them apart), so each role reads
// what it needs before its first store (B*H = 8192, K = V = 128, T = 16, "kv": 542.2 against 553.2
// us in the forward sweep when each row's store came before the next row's reads; design.md).
template <int K, int SLAB, bool SEPARATE_P, int SUBS>
__device__ __forceinline__ void chunk_coefficients(ChunkCoefficients& cf, const MmaStage<K, SLAB, SEPARATE_P, SUBS>& st,
                                                   int sub, const Params& prm, float scale, int role, int lane) {
    constexpr int C = kMmaChunk;
    const int t = lane & (C - 1), gk = gram_slot<SUBS>(kGramK, sub);
    float fk = 1.f, fp = 1.f, fq = 1.f;
    if (prm.l2norm) {
        fk = rsqrtf(st.dot(SEPARATE_P ? gram_slot<SUBS>(kGramKK, sub) : gk, t, t) + kL2NormEps);
        fp = SEPARATE_P ? rsqrtf(st.dot(gram_slot<SUBS>(kGramP, sub), t, t) + kL2NormEps) : fk;
        fq = rsqrtf(st.dot(gram_slot<SUBS>(kGramQ, sub), 8 + t, t) + kL2NormEps);
    }
    const float* beta = st.beta + C * sub;
    // fkj is role 1's, shuffled here before the roles part: formed inside role 1 it made three builds spill
    float e[C], fkj[C];
#pragma unroll
    for (int j = 0; j < C; ++j) {
        e[j] = st.e[C * sub + j];
        fkj[j] = __shfl_sync(0xffffffffu, fk, j);
    }
    if (role == 0) {  // column m of (I + L)^-1 diag(beta): x_t = beta_m [t == m] - sum_{j<t} L[t][j] x_j
        // -L[tt][j] = -beta_tt fp_tt r(j, tt) fk_j (k_j . p_tt), j < tt, holds no x: the lanes form its 64
        // entries at once, entry (tt, j) on lane 8 (tt % 4) + j, into cf.l; every lane then reads the rows
        // back, and the substitution is one FMA chain whose last step takes the newest x.
        const int j = t;  // so fk is fk_j
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int tt = (lane >> 3) + 4 * half;
            const float fpt = __shfl_sync(0xffffffffu, fp, tt);
            float r = 1.f;  // r(j, tt)
#pragma unroll
            for (int i = 1; i < C; ++i) r *= i > j && i <= tt ? e[i] : 1.f;
            cf.l[tt][j] = j < tt ? -beta[tt] * fpt * r * fk * st.dot(gk, tt, j) : 0.f;  // k_j . p_tt
        }
        __syncwarp();
        const int m = t;
        const float bm = beta[m];
        float x[C];
#pragma unroll
        for (int tt = 0; tt < C; ++tt) {
            const float4 la = *reinterpret_cast<const float4*>(&cf.l[tt][0]);
            const float4 lb = *reinterpret_cast<const float4*>(&cf.l[tt][4]);
            const float l[C] = {la.x, la.y, la.z, la.w, lb.x, lb.y, lb.z, lb.w};
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < tt; ++i) s = fmaf(l[i], x[i], s);
            x[tt] = tt == m ? bm : (tt < m ? 0.f : s);
        }
        if (lane < C) {
#pragma unroll
            for (int tt = 0; tt < C; ++tt) cf.m[tt][m] = x[tt];
        }
    } else {
        float G = 1.f;  // G_t
#pragma unroll
        for (int i = 0; i < C; ++i) G *= i <= t ? e[i] : 1.f;
        if (lane < C) {  // column t of scale * Bq: r(j, t) fk_j fq_t (k_j . q_t) for j <= t
            const float sq = scale * fq;
            float dot[C];  // read before the stores below
#pragma unroll
            for (int j = 0; j < C; ++j) dot[j] = st.dot(gk, 8 + t, j);  // k_j . q_t, used for j <= t
            float r = 1.f;  // r(j, t), built from j = t down
#pragma unroll
            for (int j = C - 1; j >= 0; --j) {
                cf.bq[j][t] = j <= t ? sq * r * fkj[j] * dot[j] : 0.f;
                if (j <= t && j > 0) r *= e[j];
            }
        } else if (lane < 2 * C) {
            const int j = t;
            float r = 1.f;  // r(j, 7)
#pragma unroll
            for (int i = 1; i < C; ++i) r *= i > j ? e[i] : 1.f;
            cf.w[j] = r * fk;
            cf.cp[j] = G * fp;
            cf.cq[j] = scale * G * fq;
            if (j == C - 1) cf.g_last = G;
        }
    }
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// cp.async of BYTES (4 or 8) from global to shared memory; zero-filled when !valid (src not read).
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared_address(dst)), "l"(src), "n"(BYTES),
                 "r"(valid ? BYTES : 0)
                 : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's most recent cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The fast path's copies of one chunk (tokens t0 .. t0 + c - 1; zeros past them) into ring slot
// `slot`: the same split over the threads as issue_chunk, every pass at once.  The gates stay
// register loads (issue_chunk_gates): 2-byte values, on 16 threads.
template <int K, int SLAB, bool SEPARATE_P, int SUBS>
__device__ __forceinline__ void issue_chunk_ring(MmaRing<K, SLAB, SEPARATE_P, SUBS>& ring, int slot, const void* q,
                                                 const void* k, const void* v, const void* p, const Params& prm,
                                                 int tid, int b, int h, int hk, int slab0, int t0, int c) {
    using Ring = MmaRing<K, SLAB, SEPARATE_P, SUBS>;
    constexpr int NT = Ring::NT, EV = Ring::EV;
    const unsigned short *q16 = static_cast<const unsigned short*>(q), *k16 = static_cast<const unsigned short*>(k),
                         *p16 = static_cast<const unsigned short*>(p), *v16 = static_cast<const unsigned short*>(v);
#pragma unroll
    for (int pass = 0; pass < Ring::PASSES; ++pass) {
        const int e = tid + pass * NT, t = 4 * e / K, kk = 4 * e % K;
        const bool ok = t < c;
        const long long tt = t0 + (ok ? t : 0);  // a valid address either way
        copy_async<8>(&ring.qkp[slot][0][e], q16 + b * prm.q_sb + tt * prm.q_st + hk * prm.q_sh + kk, ok);
        copy_async<8>(&ring.qkp[slot][1][e], k16 + b * prm.k_sb + tt * prm.k_st + hk * prm.k_sh + kk, ok);
        if (SEPARATE_P)
            copy_async<8>(&ring.qkp[slot][2][e], p16 + b * prm.p_sb + tt * prm.p_st + hk * prm.p_sh + kk, ok);
    }
    const int iv = EV * tid, tv = iv / SLAB, vv = iv % SLAB;
    const bool ok = tv < c;
    const long long tt = t0 + (ok ? tv : 0);
    copy_async<2 * EV>(&ring.v[slot][tid * EV / 2], v16 + b * prm.v_sb + tt * prm.v_st + h * prm.v_sh + slab0 + vv, ok);
}

// This thread's bits of pass PASS of the chunk in ring slot `slot`, as stage_chunk's FAST form takes
// them: q, k, p as vector-loaded bf16 (packed in .x, .y), v two values a word.
template <int K, int SLAB, bool SEPARATE_P, int SUBS, int PASS>
__device__ __forceinline__ void ring_bits(MmaBits<K, SLAB, SUBS>& x, const MmaRing<K, SLAB, SEPARATE_P, SUBS>& ring,
                                          int slot, int tid) {
    using Ring = MmaRing<K, SLAB, SEPARATE_P, SUBS>;
    const int e = tid + PASS * Ring::NT;
    const uint2 fq = ring.qkp[slot][0][e], fk = ring.qkp[slot][1][e];
    x.q = make_uint4(fq.x, fq.y, 0u, 0u);
    x.k = make_uint4(fk.x, fk.y, 0u, 0u);
    if (SEPARATE_P) {
        const uint2 fp = ring.qkp[slot][2][e];
        x.p = make_uint4(fp.x, fp.y, 0u, 0u);
    }
    if (PASS == 0) {
#pragma unroll
        for (int i = 0; i < Ring::EV / 2; ++i) x.v[i] = ring.v[slot][tid * Ring::EV / 2 + i];
    }
}

// A constant as a type: a generic lambda called with Constant<V>{} reads V back as a constant
// expression (decltype(arg)::value), so that each call is compiled for its own V.
template <auto V>
struct Constant {
    static constexpr auto value = V;
};

// Where a chunk loop stages its chunks from (delta_rule_mma's `chunks`).
enum MmaStaging { kRing, kRegs, kEither };

// f(Constant<0>{}), ..., f(Constant<N - 1>{}): a loop whose index is a constant expression in each step.
template <int N, int I = 0, class F>
__device__ __forceinline__ void static_for(F&& f) {
    if constexpr (I < N) {
        f(Constant<I>{});
        static_for<N, I + 1>(f);
    }
}

template <int K, int SLAB, bool SEPARATE_P, bool VK, int SUBS>
__global__ void __launch_bounds__(MmaShape<K, SLAB>::NT, MmaShape<K, SLAB>::MIN_CTAS)
delta_rule_mma(const float* state, float* state_out, const void* __restrict__ q, const void* __restrict__ k,
               const void* __restrict__ v, const void* __restrict__ p, const void* __restrict__ beta,
               const void* __restrict__ g, void* __restrict__ o, const Params prm, const float scale) {
    using Shape = MmaShape<K, SLAB>;
    using Bits = MmaBits<K, SLAB, SUBS>;
    using Stage = MmaStage<K, SLAB, SEPARATE_P, SUBS>;
    constexpr int C = kMmaChunk * SUBS, CS = kMmaChunk, NT = Shape::NT, KS = Shape::KS, NKW = Shape::NKW;
    constexpr int NW = Shape::NW;
    static_assert(K % 64 == 0 && SLAB % 16 == 0 && (C * K) % NT == 0 && (C * SLAB) % NT == 0, "bad mma tiling");
    static_assert(SUBS == 1 || SUBS == 2, "one or two sub-chunks a pass over the state");
    // The stage is dynamic shared memory (over 48 KB with two sub-chunks): the launch passes
    // sizeof(Stage) (cupy_comba.tiling.mma_stage_bytes, checked against this struct by test_build).
    extern __shared__ __align__(16) unsigned char mma_smem[];
    Stage& st = *reinterpret_cast<Stage*>(mma_smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, lg = lane >> 2, lj = lane & 3;
    const int kpart = warp % KS, vgroup = warp / KS, n0 = kpart * NKW;  // this warp's tiles n0 .. n0 + 7
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H), T = static_cast<int>(prm.T);
    const int slabs = V / SLAB;
    const int bh = static_cast<int>(blockIdx.x) / slabs;
    const int slab0 = (static_cast<int>(blockIdx.x) - bh * slabs) * SLAB;
    const int b = bh / H, h = bh - b * H, hk = h / static_cast<int>(prm.group);
    const long long head = static_cast<long long>(bh) * K * V;
    const int vl = 16 * vgroup + 2 * lg;  // this lane's value columns vl, vl + 1 within the slab
    // A lane's state pairs: in tile n, kv keeps (value vl, vl + 1) at rows kk, kk + 1 (kk = 8n + 2 lj)
    // of S[kk][v]; vk keeps (kk, kk + 1) at rows vl, vl + 1 of S[v][kk].  Addresses are walked
    // tile by tile (32-bit offsets within the head) so that no per-tile offset stays live in a
    // register across the token loop.
    const int kk0 = 8 * n0 + 2 * lj;
    const int first = VK ? (slab0 + vl) * K + kk0 : kk0 * V + slab0 + vl;
    const int next_row = VK ? K : V, next_tile = VK ? 8 : 8 * V;

    static_assert(NW >= 2, "the coefficients take two warps");
    const bool vec = rows_vectorisable(q, prm.q_sb, prm.q_st, prm.q_sh, prm.q_sk, prm.q_t) &&
                     rows_vectorisable(k, prm.k_sb, prm.k_st, prm.k_sh, prm.k_sk, prm.k_t) &&
                     (!SEPARATE_P || rows_vectorisable(p, prm.p_sb, prm.p_st, prm.p_sh, prm.p_sk, prm.p_t));
    const bool fast = vec && prm.q_t == BF16 && prm.k_t == BF16 && (!SEPARATE_P || prm.p_t == BF16) &&
                      prm.v_t == BF16 && prm.v_sv == 1 && prm.v_sb % Bits::EV == 0 && prm.v_st % Bits::EV == 0 &&
                      prm.v_sh % Bits::EV == 0 && reinterpret_cast<unsigned long long>(v) % (2 * Bits::EV) == 0;
    // A lane's o values vl, vl + 1 (vl even) of a token as one store where o's rows are contiguous and aligned.
    const int o_bytes = prm.o_t == F32 ? 8 : 4;
    const bool o_pairs = prm.o_sv == 1 && prm.o_sb % 2 == 0 && prm.o_st % 2 == 0 && prm.o_sh % 2 == 0 &&
                         reinterpret_cast<unsigned long long>(o) % o_bytes == 0;
    Bits bits;
    // Loads go out a chunk ahead into registers (any dtype and strides; with more passes the others
    // are loaded and staged in turn); the bf16 fast path copies two chunks ahead into the ring instead
    // (MmaRing), its gates a chunk ahead of bits.gate.  The first chunk's loads go out before the
    // state's, which the read needs later.
    auto issue = [&](auto pass, int t_first, int count) {
        issue_chunk<K, SLAB, SEPARATE_P, SUBS, decltype(pass)::value>(bits, q, k, v, p, beta, g, prm, vec, tid, b, h,
                                                                      hk, slab0, t_first, count);
    };
    auto issue_ring = [&](int t_first) {  // the chunk from t_first into slot (t_first / C) % 2, as one group
        if (t_first < T)
            issue_chunk_ring<K, SLAB, SEPARATE_P, SUBS>(st.ring, (t_first / C) & 1, q, k, v, p, prm, tid, b,
                                                        h, hk, slab0, t_first, min(C, T - t_first));
        copy_async_commit();
    };
    unsigned gate_next = 0;
    if (T > 0) {
        if (fast) {
            issue_ring(0);
            issue_ring(C);
            bits.gate = issue_chunk_gates<C>(beta, g, prm, tid, b, h, 0, min(C, T));
            if (C < T) gate_next = issue_chunk_gates<C>(beta, g, prm, tid, b, h, C, min(C, T - C));
        } else {
            if (SUBS == 1) issue(Constant<0>{}, 0, min(C, T));
        }
    }

    // The CTA that takes this one's place a wave of resident CTAs later (nsmid x MIN_CTAS blocks on)
    // finds its state in L2: each thread asks for one 128-byte line of it now (a slab is NT lines).
    // (B*H = 8192, K = V = 128, T = 16: 2-3 % faster; two waves ahead was slower.)
    if (prm.has_initial) {
        unsigned nsm;
        asm("mov.u32 %0, %%nsmid;" : "=r"(nsm));
        const unsigned later = blockIdx.x + nsm * Shape::MIN_CTAS;
        if (later < gridDim.x) {
            static_assert(K * SLAB == 32 * NT, "one line a thread");
            const int bh2 = static_cast<int>(later) / slabs, s2 = (static_cast<int>(later) - bh2 * slabs) * SLAB;
            const float* line = state + static_cast<long long>(bh2) * K * V +
                                (VK ? s2 * K + 32 * tid : (tid / (SLAB / 32)) * V + s2 + 32 * (tid % (SLAB / 32)));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
        }
    }

    // acc[n]: tile n of the state in memory order (mma3_state), kk = 8 (n0 + n) + 2 lj.  In kv a lane's
    // two values adjacent in memory are c0 and c2 of an accumulator quad (m0, m2, m1, m3), which one
    // 8-byte load cannot fill: ptxas loaded such pairs into other registers and moved them over right
    // after the loads, so that every warp waited there for its whole state before it staged its first
    // chunk.  Four 4-byte loads fill the quad directly (the same sectors; the second of a pair finds
    // them in L1).  B*H = 8192, T = 16: 567.5-568.6 against 594.7-595.3 us.
    float acc[NKW][4];
    if (prm.has_initial) {
        const float* src = state + head + first;
#pragma unroll
        for (int n = 0; n < NKW; ++n, src += next_tile) {
            if constexpr (VK) {
                const float2 a = *reinterpret_cast<const float2*>(src);
                const float2 z = *reinterpret_cast<const float2*>(src + next_row);
                acc[n][0] = a.x; acc[n][1] = a.y; acc[n][2] = z.x; acc[n][3] = z.y;
            } else {
                acc[n][0] = load_f32(src);
                acc[n][1] = load_f32(src + 1);
                acc[n][2] = load_f32(src + next_row);
                acc[n][3] = load_f32(src + next_row + 1);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < NKW; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    }

    // Tile n of the final state to state_out.  The last sub-chunk's write stores each tile as soon as it
    // is formed, so that the stores drain while the others are (a warp exits only when its stores
    // have).  With the single-chain sum below: B*H = 8192, kv T = 16, 558.3-558.5 against 567.5-568.6 us
    // storing after the chunk loop (vk within 0.5 %).
    auto store_tile = [&](int n) {
        float* dst = state_out + head + first + n * next_tile;
        store_state(dst, make_float2(acc[n][0], acc[n][1]));
        store_state(dst + next_row, make_float2(acc[n][2], acc[n][3]));
    };

    // EXACT: q, k and p are all bf16 / fp16, whose values TF32 holds exactly, so the read and write
    // products skip their B operands' lo halves (two mma.sync each instead of three, same sums).
    const bool exact = prm.q_t != F32 && prm.k_t != F32 && (!SEPARATE_P || prm.p_t != F32);
    // FROM: the chunks are staged from the ring (kRing), from registers (kRegs), or either as `fast`
    // says (kEither: with two sub-chunks the fast path and the other 16-bit inputs share one instance
    // of the chunk loop, as three instances do not fit the registers without spills).
    auto chunks = [&](auto exact_tag, auto staging_tag) {
        constexpr bool EXACT = decltype(exact_tag)::value;
        constexpr MmaStaging FROM = decltype(staging_tag)::value;
        static_assert(EXACT || FROM == kRegs, "the fast path is bf16");
        for (int t0 = 0; t0 < T; t0 += C) {
            const int c = min(C, T - t0);
            __syncthreads();  // the previous chunk's readers are done with the stage
            if (FROM == kRing || (FROM == kEither && fast)) {
                const int slot = (t0 / C) & 1;
                copy_async_wait<1>();  // this chunk's copies have landed; the next chunk's may still fly
                static_for<Bits::PASSES>([&](auto pass) {
                    constexpr int P = decltype(pass)::value;
                    ring_bits<K, SLAB, SEPARATE_P, SUBS, P>(bits, st.ring, slot, tid);
                    stage_chunk<K, SLAB, SEPARATE_P, SUBS, P, true>(st, bits, prm, vec, tid, c);
                });
                issue_ring(t0 + 2 * C);  // into the slot this thread has just read
                bits.gate = gate_next;
                if (t0 + 2 * C < T)
                    gate_next = issue_chunk_gates<C>(beta, g, prm, tid, b, h, t0 + 2 * C, min(C, T - t0 - 2 * C));
            } else {
                static_for<Bits::PASSES>([&](auto pass) {
                    constexpr int P = decltype(pass)::value;
                    if constexpr (P > 0 || SUBS > 1) issue(Constant<P>{}, t0, c);
                    stage_chunk<K, SLAB, SEPARATE_P, SUBS, P, false>(st, bits, prm, vec, tid, c);
                });
                if (SUBS == 1 && t0 + C < T) issue(Constant<0>{}, t0 + C, min(C, T - t0 - C));
            }
            __syncthreads();

            // Read: [Rp | Rq] = S0^T [p | q] of every sub-chunk over this warp's keys, then summed over
            // the key parts; r[2 s] is Rp of sub-chunk s, r[2 s + 1] its Rq.  With one sub-chunk the
            // warps of value group 0 (one per key part) also take the Gram product with k over their keys
            // here, from the fragments the read loads (16-bit inputs); every other Gram product after it.
            constexpr bool K_IN_READ = SUBS == 1 && EXACT;
            constexpr int CHAINS = SUBS == 1 ? 2 : 1;  // accumulators per product (even and odd tiles)
            const bool gram_warp = K_IN_READ && vgroup == 0;
            float r[2 * SUBS][4];
            {
                float rd[CHAINS][2 * SUBS][4], dk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ch = 0; ch < CHAINS; ++ch)
#pragma unroll
                    for (int i = 0; i < 2 * SUBS; ++i) rd[ch][i][0] = rd[ch][i][1] = rd[ch][i][2] = rd[ch][i][3] = 0.f;
#pragma unroll
                for (int n = 0; n < NKW; ++n) {
                    unsigned ah[4], al[4];
                    state_a_operand<VK>(acc[n], ah, al);
                    const int slot = lane ^ x_swizzle(n0 + n);
#pragma unroll
                    for (int s = 0; s < SUBS; ++s) {
                        const uint4 xp = st.template x<EXACT>(s, n0 + n, 0, slot);
                        const uint4 xq = st.template x<EXACT>(s, n0 + n, 1, slot);
                        mma3<EXACT>(rd[n % CHAINS][2 * s], ah, al, xp);
                        mma3<EXACT>(rd[n % CHAINS][2 * s + 1], ah, al, xq);
                        if (gram_warp) {
                            const unsigned gh[4] = {xp.x, xq.x, xp.y, xq.y}, gl[4] = {xp.z, xq.z, xp.w, xq.w};
                            mma_fragments<EXACT>(dk, gh, gl, SEPARATE_P ? st.template x<EXACT>(s, n0 + n, 2, slot) : xp);
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < 2 * SUBS; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if constexpr (CHAINS == 2) r[i][e] = rd[0][i][e] + rd[1][i][e];
                        else r[i][e] = rd[0][i][e];
                    }
                    if constexpr (KS > 1) st.part[vgroup][kpart][i][lane] = make_float4(r[i][0], r[i][1], r[i][2], r[i][3]);
                }
                if (gram_warp) st.gram[kpart][kGramK][lane] = make_float4(dk[0], dk[1], dk[2], dk[3]);
            }
            gram_products<K, SLAB, SEPARATE_P, SUBS, EXACT, K_IN_READ>(st, prm.l2norm != 0, n0, lane, vgroup);
            __syncthreads();  // Gram products and the key parts' partial sums complete
            for (int s = warp >> 1; s < SUBS; s += NW >> 1)  // two warps a sub-chunk
                chunk_coefficients<K, SLAB, SEPARATE_P, SUBS>(st.coef[s], st, s, prm, scale, warp & 1, lane);
            __syncthreads();  // coefficients complete
            // Rp, Rq of sub-chunk s summed over the key parts, the same sum in the same order in every
            // warp of a value group; taken when the sub-chunk's turn comes, so that sub-chunk 1's stay
            // in shared memory while sub-chunk 0 runs.
            auto sum_parts = [&](int s) {
                if constexpr (KS > 1) {
#pragma unroll
                    for (int i = 2 * s; i < 2 * s + 2; ++i) {
                        float4 a = st.part[vgroup][0][i][lane];
#pragma unroll
                        for (int j = 1; j < KS; ++j) {
                            const float4 z = st.part[vgroup][j][i][lane];
                            a.x += z.x; a.y += z.y; a.z += z.z; a.w += z.w;
                        }
                        r[i][0] = a.x; r[i][1] = a.y; r[i][2] = a.z; r[i][3] = a.w;
                    }
                }
            };
            sum_parts(0);

            // Sub-chunk by sub-chunk: U^T = Y M^T, O^T = Rq diag(scale G fq) + U^T (scale Bq) (this lane's
            // tokens ta, tb of the sub-chunk), then the write S^T = G_7 S^T + (U^T diag(w)) [k_0 .. k_7]^T.
            // Sub-chunk 1 reads the state sub-chunk 0 leaves, so its Rp, Rq (read from the chunk's first
            // state) become G_7 Rp + (U_0^T diag(w)) X_p (and X_q), X_p[j][t] = k_j . p_t over sub-chunk
            // 0's k and 1's p (kGramX).
            const int ta = 2 * lj, tb = ta + 1;
#pragma unroll
            for (int s = 0; s < SUBS; ++s) {
                const ChunkCoefficients& cf = st.coef[s];
                const float(&rp)[4] = r[2 * s];
                const float(&rq)[4] = r[2 * s + 1];
                unsigned yh[4], yl[4], mb[4], bb[4], uh[4], ul[4];
                {
                    const float* sva = st.v[CS * s + ta];
                    const float* svb = st.v[CS * s + tb];
                    const float y[4] = {sva[vl] - cf.cp[ta] * rp[0], svb[vl] - cf.cp[tb] * rp[1],
                                        sva[vl + 1] - cf.cp[ta] * rp[2], svb[vl + 1] - cf.cp[tb] * rp[3]};
                    a_operand(y, yh, yl);
                }
                split_into(mb, 0, cf.m[lg][ta]);
                split_into(mb, 1, cf.m[lg][tb]);
                float u[4] = {0.f, 0.f, 0.f, 0.f};
                mma3(u, yh, yl, make_uint4(mb[0], mb[1], mb[2], mb[3]));
                if (kpart == s % KS) {  // o once per value group, the sub-chunks' on different key parts
                    float ov[4] = {cf.cq[ta] * rq[0], cf.cq[tb] * rq[1], cf.cq[ta] * rq[2], cf.cq[tb] * rq[3]};
                    a_operand(u, uh, ul);
                    split_into(bb, 0, cf.bq[ta][lg]);
                    split_into(bb, 1, cf.bq[tb][lg]);
                    mma3(ov, uh, ul, make_uint4(bb[0], bb[1], bb[2], bb[3]));
                    const long long ob = b * prm.o_sb + h * prm.o_sh + (slab0 + vl) * prm.o_sv;
                    const int sa = CS * s + ta, sb = sa + 1;
                    if (sa < c) store_act_pair(o, ob + (t0 + sa) * prm.o_st, prm.o_sv, prm.o_t, ov[0], ov[2], o_pairs);
                    if (sb < c) store_act_pair(o, ob + (t0 + sb) * prm.o_st, prm.o_sv, prm.o_t, ov[1], ov[3], o_pairs);
                }
                const float wa = cf.w[ta], wb = cf.w[tb], gl = cf.g_last;
                const float uw[4] = {u[0] * wa, u[1] * wb, u[2] * wa, u[3] * wb};
                a_operand(uw, uh, ul);
                // Written twice so that neither loop has a branch between its mma.sync: one `if` in every
                // step measured 3 % slower over 16 heads (kv, T = 512 / 4096: 123.7-124.3 / 968.9-972.3
                // against 120.4-120.9 / 941.4-945.2 us), though 1 % faster over 8192 (T = 16).
                auto write = [&](auto store) {
#pragma unroll
                    for (int n = 0; n < NKW; ++n) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[n][i] *= gl;
                        mma3_state<VK, EXACT>(acc[n], uh, ul, st.template kw<EXACT>(s, n0 + n, kw_lane(lg, lj)));
                        if constexpr (decltype(store)::value) store_tile(n);
                    }
                };
                if (s + 1 == SUBS && t0 + C >= T && prm.write_final) write(Constant<true>{});
                else write(Constant<false>{});
                if (s + 1 < SUBS) {
                    sum_parts(s + 1);
                    const int gx = gram_slot<SUBS>(kGramX, s + 1);
                    float(&np)[4] = r[2 * s + 2];
                    float(&nq)[4] = r[2 * s + 3];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        np[i] *= gl;
                        nq[i] *= gl;
                    }
                    mma3(np, uh, ul, split_pair(st.dot(gx, lg, ta), st.dot(gx, lg, tb)));
                    mma3(nq, uh, ul, split_pair(st.dot(gx, 8 + lg, ta), st.dot(gx, 8 + lg, tb)));
                }
            }
        }
    };
    if constexpr (SUBS == 1) {
        if (fast) chunks(Constant<true>{}, Constant<kRing>{});
        else if (exact) chunks(Constant<true>{}, Constant<kRegs>{});
        else chunks(Constant<false>{}, Constant<kRegs>{});
    } else {
        // 16-bit q, k, p only: cupy_comba.tiling.launch runs an fp32 among them with 8-token chunks.
        chunks(Constant<true>{}, Constant<kEither>{});
    }

    if (prm.write_final && T <= 0) {  // no token: the state passes through
#pragma unroll
        for (int n = 0; n < NKW; ++n) store_tile(n);
    }
}

}  // namespace comba
