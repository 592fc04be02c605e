// mma_stage.cuh -- what delta_rule_mma stages in shared memory and how: the CTA's warp shape, the
// chunk's B fragments (swizzled so that the staging stores and the readers stay free of bank
// conflicts), the cp.async ring of the fast path, the Gram products and the 8 x 8 solve of a
// chunk's coefficients.  MmaStage is the kernel's dynamic shared memory; its size is mirrored by
// cupy_comba/families.py:mma_stage_bytes and checked against NVRTC's sizeof by tests/test_build.py.
#pragma once

#include "common.cuh"
#include "params.cuh"
#include "mma_ops.cuh"

namespace comba {

constexpr int kMmaChunk = 8;

// Warps of a CTA: SLAB / 16 value groups x K / 64 key parts; a warp holds 16 value columns x 64
// keys of the state (32 registers a lane).
template <int K, int SLAB>
struct MmaShape {
    static constexpr int KS = K / 64, NW = SLAB / 16 * KS, NT = 32 * NW, NKW = 8;
    // CTAs an SM: 16 warps of 256-thread CTAs (128 registers); 12 warps otherwise (168 registers),
    // which the smaller CTAs need to stay clear of spills.
    static constexpr int MIN_CTAS = NT >= 256 ? 2 : 384 / NT;
};

// Where the write fragment of lane (g, j) is kept in its row of MmaStage::kw, before the row's own
// swizzle (MmaStage::kw).  The row swizzle alone keeps the staging stores at two wavefronts, and the
// XOR changes no time by more than 1.5 % (B*H = 8192, T = 16-4096, both layouts); without it ptxas
// spills 8 bytes in the Comba "kv" 128-column build, so it stays.
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
template <int K, int SLAB, bool SEPARATE_P, int SUBS, int PASS, bool FAST, bool SERVING>
__device__ __forceinline__ void stage_chunk(MmaStage<K, SLAB, SEPARATE_P, SUBS>& st, const MmaBits<K, SLAB, SUBS>& x,
                                            const Params& prm, bool vec, int tid, int c, HeadGating<SERVING> hg) {
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
        stage_chunk_gates<kMmaChunk * SUBS>(st.e, st.beta, x.gate, prm, tid, c, hg);
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

}  // namespace comba
