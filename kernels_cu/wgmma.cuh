// wgmma.cuh -- Hopper's warpgroup MMA as the long-prompt scans use it: shared-memory operand descriptors,
// wgmma.mma_async m64nNk16 on bf16 operands with fp32 accumulators (B K-major, or N-major where the instruction
// transposes it), its fence, commit and waits, and ldmatrix / stmatrix.trans.  The instructions are sm_90a's:
// prefill_wgmma.cu and prefill_transposed.cu are built for that target on compute capability 9.0 and empty elsewhere
// (COMBA_WGMMA; cupy_comba/_build.py, ARCH_SPECIFIC).
#pragma once

#include "mma_ops.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define COMBA_WGMMA 1
#else
#define COMBA_WGMMA 0
#endif

namespace comba {

// A warpgroup: the four warps that issue one wgmma together.
constexpr int kWgThreads = 128;

#if COMBA_WGMMA
// A wgmma shared-memory descriptor from its two 32-bit words: the low word a region's start address >> 4
// (wg_desc_lo, formed once) plus the operand's byte offset `at` >> 4 and its leading byte offset at bit 16 -- in a
// loop constants, one add where the wgmma issues (the 14-bit address field holds every shared address, so no carry
// leaves it) --; the high word the stride byte offset and, with `swizzle`, the 128-byte swizzle of the tensor maps'
// boxes (bit 62 of the descriptor).
__device__ __forceinline__ unsigned wg_desc_lo(const void* at) { return (shared_address(at) & 0x3ffff) >> 4; }
__device__ __forceinline__ unsigned long long wg_desc_at(unsigned lo, int at, unsigned lbo, unsigned sbo,
                                                         bool swizzle = false) {
    return static_cast<unsigned long long>(lo + (static_cast<unsigned>(at) >> 4) + ((lbo >> 4) << 16)) |
           static_cast<unsigned long long>((sbo >> 4) | (swizzle ? 1u << 30 : 0u)) << 32;
}
// The descriptor of an operand at `at`, formed whole (prefill_scan_wg's fixed regions).
__device__ __forceinline__ unsigned long long wg_desc(const void* at, unsigned lbo, unsigned sbo) {
    return static_cast<unsigned long long>(wg_desc_lo(at)) | static_cast<unsigned long long>(lbo >> 4) << 16 |
           static_cast<unsigned long long>(sbo >> 4) << 32;
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// All but the last committed group retired.
__device__ __forceinline__ void wg_wait_but_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// d (+)= a b: a this warp's 16 x 16 A fragment (mma.sync's), b the descriptor of a K-major B operand; d = a b
// where !acc.
template <int N>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b, bool acc);

template <>
__device__ __forceinline__ void wgmma<16>(float (&d)[8], const unsigned (&a)[4], unsigned long long b, bool acc) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
        "%12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(acc)));
}

template <>
__device__ __forceinline__ void wgmma<32>(float (&d)[16], const unsigned (&a)[4], unsigned long long b, bool acc) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(acc)));
}

// m64n64k16 and (below) m64n128k16, chosen by the accumulators' size; B N-major where TB (the instruction's
// imm-trans-b).
template <int TB>
__device__ __forceinline__ void wgmma_tb(float (&d)[32], const unsigned (&a)[4], unsigned long long b, bool acc) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 "
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(acc)), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wgmma_tb(float (&d)[64], const unsigned (&a)[4], unsigned long long b, bool acc) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 "
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(acc)), "n"(TB));
}

template <>
__device__ __forceinline__ void wgmma<64>(float (&d)[32], const unsigned (&a)[4], unsigned long long b, bool acc) {
    wgmma_tb<0>(d, a, b, acc);
}

template <>
__device__ __forceinline__ void wgmma<128>(float (&d)[64], const unsigned (&a)[4], unsigned long long b, bool acc) {
    wgmma_tb<0>(d, a, b, acc);
}

// d (+)= a b with b N-major (wgmma's transposed B): prefill_scan_wt's state update, N = 64 or 128.
template <int N>
__device__ __forceinline__ void wgmma_t(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b, bool acc) {
    wgmma_tb<1>(d, a, b, acc);
}

__device__ __forceinline__ void ldsm4(unsigned (&r)[4], const void* at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(at))
                 : "memory");
}
__device__ __forceinline__ void stsm4_trans(void* at, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_address(at)),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}
#endif

}  // namespace comba
