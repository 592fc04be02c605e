// delta_rule_mma.cu -- T-token passes of the gated delta rule with each chunk of 8 tokens done
// as small matrix products on the tensor cores (mma.sync m16n8k8, TF32 operands split in three
// for fp32 accuracy).  Either state layout; the state is read once, stays in registers across
// the T tokens and is written once, as in delta_rule.cu.
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
// are adjacent in memory (one 8-byte access per state row in "kv", per pair of K in "vk").
//
// Launch geometry: delta_rule_mma<K, SLAB, SEPARATE_P, VK> -- one CTA per (b, h, slab of SLAB
// value columns); NW = (SLAB / 16) x (K / 64) warps, each 16 value columns x 64 keys of the state
// (32 registers a lane).  The K-reduction of a warp stays in its mma.sync accumulators; the K / 64
// key parts of a value group add their partial [Rp | Rq] through shared memory.  Per chunk, four
// CTA barriers:
//   1. every thread stages 4 consecutive keys of one token of q, k, p (one 8- or 16-byte load
//      where the rows allow it) as B fragments -- only the hi halves for 16-bit inputs -- plus its
//      v values and the gates, and issues the next chunk's loads; bf16 in contiguous rows (the fast
//      path, no dtype branch) is copied two chunks ahead into shared memory instead (MmaRing);
//   2. every warp reads [Rp | Rq] over its keys; the warps of value group 0 also form the Gram
//      products over theirs, the one against k inside the read loop from the fragments it loads;
//   3. warps 0 and 1 solve the chunk's 8 x 8 coefficients once for the CTA (M; Bq and the
//      per-token factors);
//   4. U, O and the write.
// A warp runs 72 mma.sync a chunk with an fp32 among q, k, p (48 for the read, 3 + 3 for U and O, 24
// for the write), 54 otherwise (32, 3 + 3, 16); the warps of value group 0 add the Gram product
// with k, and with use_qk_l2norm one more (Gated DeltaNet) or three (Comba), 8 mma.sync each (24
// with an fp32 among q, k, p).
//
// Where it stands (docs/benchmarks.md, "Multi-token" and "Tilings"): with few heads (B*H <= 128)
// the GPU waits on each token's latency and this kernel, 8 tokens a step, is the fastest from T = 6
// on; with many heads one chunk costs about the same whatever its fill, and cupy_comba.tiling.choose
// takes it there from T = 5 (B*H = 8192, K = V = 128, T = 16: 624-627 us, x2.37-2.38 of the decode
// step, against 977 us for the token loop).  In-kernel clocks at that shape (before the bf16 ring)
// put a chunk at about 6500 cycles a CTA, two CTAs an SM: staging 600-1700, the read 1500-1900, the
// solve 1150 (two warps busy), U, O and the write 900-2800.
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

// Where the write fragment of lane (g, j) is kept in its row of MmaStage::kw: swizzled so that the
// threads staging consecutive keys of one token spread over more banks.
__device__ __forceinline__ int kw_lane(int g, int j) { return 4 * g + (j ^ ((g >> 1) & 3)); }

// Read fragments of k-step n are kept at lane ^ x_swizzle(n) of their row of MmaStage::x: the 8
// threads of one 16-byte store phase of the whole fragments (4 k-steps x 2 lanes) then hit 8
// different bank groups.  (Chosen for those; the 8-byte hi-only stores of 16-bit inputs were not
// tuned separately.)
__device__ __forceinline__ int x_swizzle(int n) { return (n & 1) | ((n & 2) << 1); }

// The 8 x 8 coefficients of a chunk (the header's M, Bq, ...), one copy a CTA.
struct ChunkCoefficients {
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
template <int K, int NT, int SLAB>
struct MmaChunkBits {
    static constexpr int E = kMmaChunk * K / NT, PASSES = E / 4, EV = kMmaChunk * SLAB / NT;
    static_assert(E % 4 == 0 && PASSES <= 2 && SLAB % EV == 0, "bad staging split");
    uint4 q, k, p;
    unsigned v[EV], gate;
};

// The chunk's Gram products, each a 16 x 8 mma.sync accumulator, one per key part (summed when
// read): rows [p_0 .. p_7 | q_0 .. q_7] (or [k | q] for kGramKK) against columns k, p or q.
enum GramProduct { kGramK = 0, kGramP = 1, kGramQ = 2, kGramKK = 3 };

// The bf16 fast path's loads go out two chunks ahead, as cp.async copies of the raw bits into a
// ring of two chunk slots: the copies hold no registers while they fly (at many heads a load takes
// about a chunk's time to arrive), and each thread reads back only the bytes it copied itself, so
// no barrier guards the ring.  Entry tid + PASS NT of a plane holds the thread's 4 keys of pass
// PASS (issue_chunk's split); v holds the thread's EV values, two a word.
template <int K, int SLAB, bool SEPARATE_P>
struct MmaRing {
    static constexpr int NT = MmaShape<K, SLAB>::NT, PASSES = MmaChunkBits<K, NT, SLAB>::PASSES;
    static constexpr int EV = MmaChunkBits<K, NT, SLAB>::EV;
    uint2 qkp[2][SEPARATE_P ? 3 : 2][PASSES * NT];  // q, k, p
    unsigned v[2][NT * EV / 2];
};

template <int K, int SLAB, bool SEPARATE_P>
struct MmaStage {
    static constexpr int KS = MmaShape<K, SLAB>::KS, PLANES = SEPARATE_P ? 3 : 2;
    // B fragments over the keys, per k-step: p (k for Gated DeltaNet), q, and k for Comba (read and
    // Gram operands); kw: the write's fragments of [k_0 .. k_7]^T, per state column tile.  With an fp32
    // among q, k, p the whole {hi, hi, lo, lo}; with 16-bit inputs only the hi pair (lo = 0), which
    // leaves room for the fast path's ring in the same bytes.
    struct Full {
        uint4 x[K / 8][PLANES][32];
        uint4 kw[K / 8][32];
    };
    struct Hi {
        uint2 x[K / 8][PLANES][32];
        uint2 kw[K / 8][32];
        MmaRing<K, SLAB, SEPARATE_P> ring;
    };
    static_assert(sizeof(Hi) <= sizeof(Full), "the ring must fit beside the hi fragments");
    union {
        Full full;
        Hi hi;
    } frag;
    float4 part[SLAB / 16][KS][2][32]; // per key part: the read's Rp, Rq
    float4 gram[KS][4][32];            // per key part: the Gram products (GramProduct)
    float v[kMmaChunk][SLAB];          // v of the slab
    float e[kMmaChunk], beta[kMmaChunk];
    ChunkCoefficients coef;

    template <bool EXACT>
    __device__ __forceinline__ uint4 x(int n, int plane, int slot) const {
        if (!EXACT) return frag.full.x[n][plane][slot];
        const uint2 f = frag.hi.x[n][plane][slot];
        return make_uint4(f.x, f.y, 0u, 0u);
    }
    template <bool EXACT>
    __device__ __forceinline__ void set_x(int n, int plane, int slot, float b0, float b1) {
        if (EXACT) frag.hi.x[n][plane][slot] = make_uint2(__float_as_uint(b0), __float_as_uint(b1));
        else frag.full.x[n][plane][slot] = split_pair(b0, b1);
    }
    template <bool EXACT>
    __device__ __forceinline__ uint4 kw(int n, int slot) const {
        if (!EXACT) return frag.full.kw[n][slot];
        const uint2 f = frag.hi.kw[n][slot];
        return make_uint4(f.x, f.y, 0u, 0u);
    }
    // Value x of B fragment register i (0 or 1) of kw[n][slot].
    template <bool EXACT>
    __device__ __forceinline__ void set_kw(int n, int slot, int i, float x) {
        if (EXACT) {
            reinterpret_cast<unsigned*>(&frag.hi.kw[n][slot])[i] = __float_as_uint(x);
        } else {
            unsigned* f = reinterpret_cast<unsigned*>(&frag.full.kw[n][slot]);
            split(x, f[i], f[2 + i]);
        }
    }

    // Entry (r, c) of Gram product pr, summed over the key parts: lane 4 (r % 8) + c / 2 holds it,
    // element 2 (r / 8) + c % 2 of its accumulator tile.
    __device__ __forceinline__ float dot(int pr, int r, int c) const {
        float s = 0.f;
#pragma unroll
        for (int kp = 0; kp < KS; ++kp)
            s += reinterpret_cast<const float*>(&gram[kp][pr][4 * (r & 7) + (c >> 1)])[2 * (r >> 3) + (c & 1)];
        return s;
    }
};

// The register path's loads of one chunk (any dtype and strides): MmaChunkBits' split, pass PASS.
template <int K, int SLAB, bool SEPARATE_P, int PASS>
__device__ __forceinline__ void issue_chunk(MmaChunkBits<K, MmaShape<K, SLAB>::NT, SLAB>& x, const void* q, const void* k,
                                            const void* v, const void* p, const void* beta, const void* g,
                                            const Params& prm, bool vec, int tid, int b, int h, int hk, int slab0,
                                            int t0, int c) {
    constexpr int NT = MmaShape<K, SLAB>::NT;
    using Bits = MmaChunkBits<K, NT, SLAB>;
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
        x.gate = issue_chunk_gates<kMmaChunk>(beta, g, prm, tid, b, h, t0, c);
    }
}

// Stage one pass of a chunk from its raw bits.  FAST: the bits came from the ring (ring_bits), every
// one of q, k, p, v bf16 with vector rows (the kernel's `fast`), v packed two values a word, so no
// dtype or stride branch is taken per element.
template <int K, int SLAB, bool SEPARATE_P, int PASS, bool FAST, bool EXACT>
__device__ __forceinline__ void stage_chunk(MmaStage<K, SLAB, SEPARATE_P>& st,
                                            const MmaChunkBits<K, MmaShape<K, SLAB>::NT, SLAB>& x,
                                            const Params& prm, bool vec, int tid, int c) {
    constexpr int NT = MmaShape<K, SLAB>::NT;
    using Bits = MmaChunkBits<K, NT, SLAB>;
    const int i0 = 4 * (tid + PASS * NT), t = i0 / K, kk = i0 % K;
    const float4 xq = bits4_to_float4(x.q, FAST ? BF16 : prm.q_t, FAST || vec);
    const float4 xk = bits4_to_float4(x.k, FAST ? BF16 : prm.k_t, FAST || vec);
    const float4 xp = SEPARATE_P ? bits4_to_float4(x.p, FAST ? BF16 : prm.p_t, FAST || vec) : xk;
    // Read operand: keys 8n + 2j, 8n + 2j + 1 are k-columns j, j + 4 (b0, b1) of lane 4t + j.
    const int n = kk >> 3, j0 = (kk & 7) >> 1, sw = x_swizzle(n);
    st.template set_x<EXACT>(n, 0, (4 * t + j0) ^ sw, xp.x, xp.y);
    st.template set_x<EXACT>(n, 0, (4 * t + j0 + 1) ^ sw, xp.z, xp.w);
    st.template set_x<EXACT>(n, 1, (4 * t + j0) ^ sw, xq.x, xq.y);
    st.template set_x<EXACT>(n, 1, (4 * t + j0 + 1) ^ sw, xq.z, xq.w);
    if constexpr (SEPARATE_P) {  // k in the same layout, for the Gram products
        st.template set_x<EXACT>(n, 2, (4 * t + j0) ^ sw, xk.x, xk.y);
        st.template set_x<EXACT>(n, 2, (4 * t + j0 + 1) ^ sw, xk.z, xk.w);
    }
    // Write operand: token t is k-row t / 2 (b0, even t) or t / 2 + 4 (b1, odd t) of lane (key % 8, t / 2).
    const float xs[4] = {xk.x, xk.y, xk.z, xk.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) st.template set_kw<EXACT>(n, kw_lane((kk & 7) + e, t >> 1), t & 1, xs[e]);
    if (PASS == 0) {
        const int iv = Bits::EV * tid;
#pragma unroll
        for (int e = 0; e < Bits::EV; ++e) {
            const unsigned w = FAST ? x.v[e / 2] : x.v[e];
            st.v[iv / SLAB][iv % SLAB + e] =
                FAST ? __uint_as_float(e % 2 ? w & 0xffff0000u : w << 16) : bits_to_float(w, prm.v_t);
        }
        stage_chunk_gates<kMmaChunk>(st.e, st.beta, x.gate, prm, tid, c);
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
// and A = [k | q] against k (|k_t|^2).  For Gated DeltaNet |k_t|^2 = |p_t|^2 is k_t . p_t.
template <int K, int SLAB, bool SEPARATE_P, bool EXACT>
__device__ __forceinline__ void gram_products(MmaStage<K, SLAB, SEPARATE_P>& st, bool l2norm, int n0, int lane) {
    // Planes of MmaStage::x: p (k for Gated DeltaNet), q, k.
    constexpr int P = 0, Q = 1, KP = SEPARATE_P ? 2 : 0;
#pragma unroll
    for (int pr = EXACT ? kGramP : kGramK; pr <= kGramKK; ++pr) {  // one product at a time
        if (pr != kGramK && !(l2norm && (SEPARATE_P || pr == kGramQ))) continue;
        const int rows = pr == kGramKK ? KP : P, cols = pr == kGramK || pr == kGramKK ? KP : pr == kGramQ ? Q : P;
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
        for (int n = 0; n < MmaShape<K, SLAB>::NKW; ++n) {
            const int slot = lane ^ x_swizzle(n0 + n);
            const uint4 xr = st.template x<EXACT>(n0 + n, rows, slot);
            const uint4 xq = st.template x<EXACT>(n0 + n, Q, slot);
            const unsigned ah[4] = {xr.x, xq.x, xr.y, xq.y}, al[4] = {xr.z, xq.z, xr.w, xq.w};
            mma_fragments<EXACT>(d, ah, al, st.template x<EXACT>(n0 + n, cols, slot));
        }
        st.gram[n0 / MmaShape<K, SLAB>::NKW][pr][lane] = make_float4(d[0], d[1], d[2], d[3]);
    }
}

// The chunk's 8 x 8 coefficients from the Gram products and gates, once a CTA, by warps 0
// (M) and 1 (Bq and the per-token factors).  Lane t % 8 of each finds token t's norm factors;
// the others' come by shuffle.  Warp 0: lane m < 8 solves column m of M (the other lanes repeat
// the work of lane m % 8 and store nothing).  Warp 1: lane t < 8 builds column t of scale * Bq,
// lane 8 + j the factors w_j, cp_j, cq_j.
template <int K, int SLAB, bool SEPARATE_P>
__device__ __forceinline__ void chunk_coefficients(ChunkCoefficients& cf, const MmaStage<K, SLAB, SEPARATE_P>& st,
                                                   const Params& prm, float scale, int warp, int lane) {
    constexpr int C = kMmaChunk;
    const int t = lane & (C - 1);
    float fk = 1.f, fp = 1.f, fq = 1.f;
    if (prm.l2norm) {
        fk = rsqrtf(st.dot(SEPARATE_P ? kGramKK : kGramK, t, t) + kL2NormEps);
        fp = SEPARATE_P ? rsqrtf(st.dot(kGramP, t, t) + kL2NormEps) : fk;
        fq = rsqrtf(st.dot(kGramQ, 8 + t, t) + kL2NormEps);
    }
    float e[C], fkj[C];
#pragma unroll
    for (int j = 0; j < C; ++j) {
        e[j] = st.e[j];
        fkj[j] = __shfl_sync(0xffffffffu, fk, j);
    }
    if (warp == 0) {  // column m of (I + L)^-1 diag(beta): x_t = beta_m [t == m] - sum_{j<t} L[t][j] x_j
        const int m = t;
        float x[C];
#pragma unroll
        for (int tt = 0; tt < C; ++tt) {
            float s = 0.f, r = 1.f;
#pragma unroll
            for (int j = tt - 1; j >= 0; --j) {
                r *= e[j + 1];
                s = fmaf(r * fkj[j] * st.dot(kGramK, tt, j), x[j], s);  // k_j . p_tt
            }
            const float fpt = __shfl_sync(0xffffffffu, fp, tt), bt = st.beta[tt];
            x[tt] = tt == m ? bt : (tt < m ? 0.f : -bt * fpt * s);
            if (lane < C) cf.m[tt][m] = x[tt];
        }
    } else {
        float G = 1.f;  // G_t
#pragma unroll
        for (int i = 0; i < C; ++i) G *= i <= t ? e[i] : 1.f;
        if (lane < C) {  // column t of scale * Bq: r(j, t) fk_j fq_t (k_j . q_t) for j <= t
            const float sq = scale * fq;
            float r = 1.f;  // r(j, t), built from j = t down
#pragma unroll
            for (int j = C - 1; j >= 0; --j) {
                const float dot = st.dot(kGramK, 8 + t, j);  // k_j . q_t, used for j <= t
                cf.bq[j][t] = j <= t ? sq * r * fkj[j] * dot : 0.f;
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
template <int K, int SLAB, bool SEPARATE_P>
__device__ __forceinline__ void issue_chunk_ring(MmaRing<K, SLAB, SEPARATE_P>& ring, int slot, const void* q,
                                                 const void* k, const void* v, const void* p, const Params& prm,
                                                 int tid, int b, int h, int hk, int slab0, int t0, int c) {
    using Ring = MmaRing<K, SLAB, SEPARATE_P>;
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
template <int K, int SLAB, bool SEPARATE_P, int PASS>
__device__ __forceinline__ void ring_bits(MmaChunkBits<K, MmaShape<K, SLAB>::NT, SLAB>& x,
                                          const MmaRing<K, SLAB, SEPARATE_P>& ring, int slot, int tid) {
    using Ring = MmaRing<K, SLAB, SEPARATE_P>;
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

template <int P>
struct Pass {
    static constexpr int value = P;
};

template <bool B>
struct Flag {
    static constexpr bool value = B;
};

template <int K, int SLAB, bool SEPARATE_P, bool VK>
__global__ void __launch_bounds__(MmaShape<K, SLAB>::NT, MmaShape<K, SLAB>::MIN_CTAS)
delta_rule_mma(const float* state, float* state_out, const void* __restrict__ q, const void* __restrict__ k,
               const void* __restrict__ v, const void* __restrict__ p, const void* __restrict__ beta,
               const void* __restrict__ g, void* __restrict__ o, const Params prm, const float scale) {
    using Shape = MmaShape<K, SLAB>;
    using Bits = MmaChunkBits<K, Shape::NT, SLAB>;
    constexpr int C = kMmaChunk, NT = Shape::NT, KS = Shape::KS, NKW = Shape::NKW, NW = Shape::NW;
    static_assert(K % 64 == 0 && SLAB % 16 == 0 && (C * K) % NT == 0 && (C * SLAB) % NT == 0, "bad mma tiling");
    __shared__ MmaStage<K, SLAB, SEPARATE_P> st;

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
    // Loads go out a chunk ahead into registers (any dtype and strides; with two passes the second is
    // loaded and staged in turn); the bf16 fast path copies two chunks ahead into the ring instead
    // (MmaRing), its gates a chunk ahead of bits.gate.  The first chunk's loads go out before the
    // state's, which the read needs later.
    auto issue = [&](auto pass, int t_first, int count) {
        issue_chunk<K, SLAB, SEPARATE_P, decltype(pass)::value>(bits, q, k, v, p, beta, g, prm, vec, tid, b, h, hk,
                                                                slab0, t_first, count);
    };
    auto issue_ring = [&](int t_first) {  // the chunk from t_first into slot (t_first / C) % 2, as one group
        if (t_first < T)
            issue_chunk_ring<K, SLAB, SEPARATE_P>(st.frag.hi.ring, (t_first / C) & 1, q, k, v, p, prm, tid, b, h, hk,
                                                  slab0, t_first, min(C, T - t_first));
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
            issue(Pass<0>{}, 0, min(C, T));
        }
    }

    // acc[n]: tile n of the state in memory order (mma3_state), kk = 8 (n0 + n) + 2 lj.
    float acc[NKW][4];
    if (prm.has_initial) {
        const float* src = state + head + first;
#pragma unroll
        for (int n = 0; n < NKW; ++n, src += next_tile) {
            const float2 a = *reinterpret_cast<const float2*>(src);
            const float2 z = *reinterpret_cast<const float2*>(src + next_row);
            acc[n][0] = a.x; acc[n][1] = a.y; acc[n][2] = z.x; acc[n][3] = z.y;
        }
    } else {
#pragma unroll
        for (int n = 0; n < NKW; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    }

    // EXACT: q, k and p are all bf16 / fp16, whose values TF32 holds exactly, so the read and write
    // products skip their B operands' lo halves (two mma.sync each instead of three, same sums).
    const bool exact = prm.q_t != F32 && prm.k_t != F32 && (!SEPARATE_P || prm.p_t != F32);
    auto chunks = [&](auto exact_tag, auto fast_tag) {
        constexpr bool EXACT = decltype(exact_tag)::value, FAST = decltype(fast_tag)::value;
        static_assert(EXACT || !FAST, "the fast path is bf16");
        for (int t0 = 0; t0 < T; t0 += C) {
            const int c = min(C, T - t0);
            __syncthreads();  // the previous chunk's readers are done with the stage
            if constexpr (FAST) {
                const int slot = (t0 / C) & 1;
                copy_async_wait<1>();  // this chunk's copies have landed; the next chunk's may still fly
                ring_bits<K, SLAB, SEPARATE_P, 0>(bits, st.frag.hi.ring, slot, tid);
                stage_chunk<K, SLAB, SEPARATE_P, 0, true, true>(st, bits, prm, vec, tid, c);
                if constexpr (Bits::PASSES > 1) {
                    ring_bits<K, SLAB, SEPARATE_P, 1>(bits, st.frag.hi.ring, slot, tid);
                    stage_chunk<K, SLAB, SEPARATE_P, 1, true, true>(st, bits, prm, vec, tid, c);
                }
                issue_ring(t0 + 2 * C);  // into the slot this thread has just read
                bits.gate = gate_next;
                if (t0 + 2 * C < T)
                    gate_next = issue_chunk_gates<C>(beta, g, prm, tid, b, h, t0 + 2 * C, min(C, T - t0 - 2 * C));
            } else {
                stage_chunk<K, SLAB, SEPARATE_P, 0, false, EXACT>(st, bits, prm, vec, tid, c);
                if constexpr (Bits::PASSES > 1) {
                    issue(Pass<1>{}, t0, c);
                    stage_chunk<K, SLAB, SEPARATE_P, 1, false, EXACT>(st, bits, prm, vec, tid, c);
                }
                if (t0 + C < T) issue(Pass<0>{}, t0 + C, min(C, T - t0 - C));
            }
            __syncthreads();

            // Read: [Rp | Rq] = S0^T [p | q] over this warp's keys, then summed over the key parts.
            // Two accumulators per product (even and odd tiles) halve the chain of dependent mma.sync.
            // The warps of value group 0 (one per key part) also take the Gram products over their keys
            // (gram_products): k_j . p_t and k_j . q_t here, from the fragments the read loads; the
            // norms for use_qk_l2norm after it.
            const bool gram_warp = warp < KS;
            float rp[4] = {0.f, 0.f, 0.f, 0.f}, rq[4] = {0.f, 0.f, 0.f, 0.f};
            {
                float rp2[4] = {0.f, 0.f, 0.f, 0.f}, rq2[4] = {0.f, 0.f, 0.f, 0.f}, dk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int n = 0; n < NKW; ++n) {
                    unsigned ah[4], al[4];
                    state_a_operand<VK>(acc[n], ah, al);
                    const int slot = lane ^ x_swizzle(n0 + n);
                    const uint4 xp = st.template x<EXACT>(n0 + n, 0, slot);
                    const uint4 xq = st.template x<EXACT>(n0 + n, 1, slot);
                    mma3<EXACT>(n % 2 ? rp2 : rp, ah, al, xp);
                    mma3<EXACT>(n % 2 ? rq2 : rq, ah, al, xq);
                    if (EXACT && gram_warp) {
                        const unsigned gh[4] = {xp.x, xq.x, xp.y, xq.y}, gl[4] = {xp.z, xq.z, xp.w, xq.w};
                        mma_fragments<EXACT>(dk, gh, gl, SEPARATE_P ? st.template x<EXACT>(n0 + n, 2, slot) : xp);
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    rp[i] += rp2[i];
                    rq[i] += rq2[i];
                }
                if constexpr (KS > 1) {
                    st.part[vgroup][kpart][0][lane] = make_float4(rp[0], rp[1], rp[2], rp[3]);
                    st.part[vgroup][kpart][1][lane] = make_float4(rq[0], rq[1], rq[2], rq[3]);
                }
                if (EXACT && gram_warp) st.gram[kpart][kGramK][lane] = make_float4(dk[0], dk[1], dk[2], dk[3]);
            }
            if (gram_warp) gram_products<K, SLAB, SEPARATE_P, EXACT>(st, prm.l2norm != 0, n0, lane);
            __syncthreads();  // Gram products and the key parts' partial sums complete
            if (warp < 2) chunk_coefficients<K, SLAB, SEPARATE_P>(st.coef, st, prm, scale, warp, lane);
            __syncthreads();  // coefficients complete
            if constexpr (KS > 1) {
                // The same sum, in the same order, in every warp of a value group.
                float4 sp = st.part[vgroup][0][0][lane], sq = st.part[vgroup][0][1][lane];
#pragma unroll
                for (int j = 1; j < KS; ++j) {
                    const float4 a = st.part[vgroup][j][0][lane], z = st.part[vgroup][j][1][lane];
                    sp.x += a.x; sp.y += a.y; sp.z += a.z; sp.w += a.w;
                    sq.x += z.x; sq.y += z.y; sq.z += z.z; sq.w += z.w;
                }
                rp[0] = sp.x; rp[1] = sp.y; rp[2] = sp.z; rp[3] = sp.w;
                rq[0] = sq.x; rq[1] = sq.y; rq[2] = sq.z; rq[3] = sq.w;
            }
            const ChunkCoefficients& cf = st.coef;

            // U^T = Y M^T, O^T = Rq diag(scale G fq) + U^T (scale Bq); this lane's tokens ta, tb.
            const int ta = 2 * lj, tb = ta + 1;
            unsigned yh[4], yl[4], mb[4], bb[4];
            {
                const float y[4] = {st.v[ta][vl] - cf.cp[ta] * rp[0], st.v[tb][vl] - cf.cp[tb] * rp[1],
                                    st.v[ta][vl + 1] - cf.cp[ta] * rp[2], st.v[tb][vl + 1] - cf.cp[tb] * rp[3]};
                a_operand(y, yh, yl);
            }
            split_into(mb, 0, cf.m[lg][ta]);
            split_into(mb, 1, cf.m[lg][tb]);
            float u[4] = {0.f, 0.f, 0.f, 0.f};
            mma3(u, yh, yl, make_uint4(mb[0], mb[1], mb[2], mb[3]));
            unsigned uh[4], ul[4];
            if (kpart == 0) {  // o once per value group
                float ov[4] = {cf.cq[ta] * rq[0], cf.cq[tb] * rq[1], cf.cq[ta] * rq[2], cf.cq[tb] * rq[3]};
                a_operand(u, uh, ul);
                split_into(bb, 0, cf.bq[ta][lg]);
                split_into(bb, 1, cf.bq[tb][lg]);
                mma3(ov, uh, ul, make_uint4(bb[0], bb[1], bb[2], bb[3]));
                const long long ob = b * prm.o_sb + h * prm.o_sh + (slab0 + vl) * prm.o_sv;
                if (ta < c) store_act_pair(o, ob + (t0 + ta) * prm.o_st, prm.o_sv, prm.o_t, ov[0], ov[2], o_pairs);
                if (tb < c) store_act_pair(o, ob + (t0 + tb) * prm.o_st, prm.o_sv, prm.o_t, ov[1], ov[3], o_pairs);
            }

            // Write: S^T = G_7 S0^T + (U^T diag(w)) [k_0 .. k_7]^T.
            const float wa = cf.w[ta], wb = cf.w[tb], gl = cf.g_last;
            const float uw[4] = {u[0] * wa, u[1] * wb, u[2] * wa, u[3] * wb};
            a_operand(uw, uh, ul);
#pragma unroll
            for (int n = 0; n < NKW; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[n][i] *= gl;
                mma3_state<VK, EXACT>(acc[n], uh, ul, st.template kw<EXACT>(n0 + n, kw_lane(lg, lj)));
            }
        }
    };
    if (fast) chunks(Flag<true>{}, Flag<true>{});
    else if (exact) chunks(Flag<true>{}, Flag<false>{});
    else chunks(Flag<false>{}, Flag<false>{});

    if (prm.write_final) {
        float* dst = state_out + head + first;
#pragma unroll
        for (int n = 0; n < NKW; ++n, dst += next_tile) {
            store_state(dst, make_float2(acc[n][0], acc[n][1]));
            store_state(dst + next_row, make_float2(acc[n][2], acc[n][3]));
        }
    }
}

}  // namespace comba
