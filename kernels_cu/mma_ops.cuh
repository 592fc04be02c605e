// mma_ops.cuh -- the tensor-core arithmetic of delta_rule_mma: fp32 values split into TF32 halves,
// mma.sync m16n8k8 with three products ("3xTF32", fp32-accurate), the fragment permutations that let
// the register-held state serve as an operand without moving between lanes, cp.async copies and a
// compile-time loop.  delta_rule_mma.cu's header gives the math these serve.
#pragma once

namespace comba {

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

// A constant as a type: a generic lambda called with Constant<V>{} reads V back as a constant
// expression (decltype(arg)::value), so that each call is compiled for its own V.
template <auto V>
struct Constant {
    static constexpr auto value = V;
};

// f(Constant<0>{}), ..., f(Constant<N - 1>{}): a loop whose index is a constant expression in each step.
template <int N, int I = 0, class F>
__device__ __forceinline__ void static_for(F&& f) {
    if constexpr (I < N) {
        f(Constant<I>{});
        static_for<N, I + 1>(f);
    }
}

}  // namespace comba
