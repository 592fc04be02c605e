// common.cuh -- dtype codes, conversions and cache-hinted accesses shared by
// every cupy_comba kernel.
//
// No CUDA headers are included: NVRTC compiles these sources with no include
// path, and the few half / bfloat16 conversions needed are one PTX
// instruction or one bit shift each.
//
// Activations arrive in any of three dtypes, chosen at run time per argument
// (a uniform branch on a kernel parameter costs nothing next to the state
// stream, and it keeps the number of compiled variants at a handful instead
// of 3^6 dtype combinations).
#pragma once

namespace comba {

// Keep in sync with cupy_comba/_dtypes.py.
enum DType : long long { F32 = 0, F16 = 1, BF16 = 2 };

__device__ __forceinline__ float bf16_bits_to_float(unsigned short bits) {
    return __uint_as_float(static_cast<unsigned int>(bits) << 16);
}

__device__ __forceinline__ float f16_bits_to_float(unsigned short bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
}

// Round to nearest even, NaN kept quiet (matches ml_dtypes / torch).
__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
}

__device__ __forceinline__ unsigned short float_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Activation loads come in two halves so that a thread can put all of its loads in flight
// before it waits for any: `load_bits` issues one load and returns the raw bits (a float's,
// or a 16-bit value zero-extended); `bits_to_float` is the first use.  A fused load-and-
// convert inside the dtype branch makes every load a full memory round trip on its own.
// One byte address for either width (the element size is 4 or 2 by dtype), so a thread keeps a
// single live address per activation element rather than one per possible dtype.
__device__ __forceinline__ unsigned load_bits(const void* base, long long i, long long dtype) {
    const char* a = static_cast<const char*>(base) + i * (dtype == F32 ? 4 : 2);
    return dtype == F32 ? *reinterpret_cast<const unsigned*>(a)
                        : static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(a));
}

__device__ __forceinline__ float bits_to_float(unsigned bits, long long dtype) {
    if (dtype == BF16) return bf16_bits_to_float(static_cast<unsigned short>(bits));
    if (dtype == F16) return f16_bits_to_float(static_cast<unsigned short>(bits));
    return __uint_as_float(bits);
}

__device__ __forceinline__ void store_act(void* base, long long i, long long dtype, float x) {
    if (dtype == BF16) {
        static_cast<unsigned short*>(base)[i] = float_to_bf16_bits(x);
    } else if (dtype == F16) {
        static_cast<unsigned short*>(base)[i] = float_to_f16_bits(x);
    } else {
        static_cast<float*>(base)[i] = x;
    }
}

// Two activation values of one row, x0 at element i and x1 at i + stride: one 4- or 8-byte store
// when `paired` (the caller has checked stride == 1 and the alignment), else two stores.
__device__ __forceinline__ void store_act_pair(void* base, long long i, long long stride, long long dtype, float x0,
                                               float x1, bool paired) {
    if (!paired) {
        store_act(base, i, dtype, x0);
        store_act(base, i + stride, dtype, x1);
    } else if (dtype == F32) {
        *reinterpret_cast<float2*>(static_cast<float*>(base) + i) = make_float2(x0, x1);
    } else {
        const unsigned b0 = dtype == BF16 ? float_to_bf16_bits(x0) : float_to_f16_bits(x0);
        const unsigned b1 = dtype == BF16 ? float_to_bf16_bits(x1) : float_to_f16_bits(x1);
        *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(base) + i) = b0 | (b1 << 16);
    }
}

// Whether every 4-key run of an activation [B, T, H, K] is one aligned vector load.
__device__ __forceinline__ bool rows_vectorisable(const void* base, long long sb, long long st, long long sh,
                                                  long long sk, long long dtype) {
    const unsigned long long bytes = dtype == F32 ? 16 : 8;
    return sk == 1 && sb % 4 == 0 && st % 4 == 0 && sh % 4 == 0 && reinterpret_cast<unsigned long long>(base) % bytes == 0;
}

// State accesses: plain loads and stores, 16 bytes (8 for the tensor-core kernel's pairs).  Not
// `.nc` (the state may be updated in place, state_out == state) and deliberately no streaming hint:
// on the H200, `.cs` loads and stores cost 4-7 % of copy bandwidth in every tiling we measured
// (docs/design.md).
__device__ __forceinline__ float4 load_state(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}

// The stores are written in PTX: NVRTC compiled the C++ float4 and float2 state stores into 4-byte
// ones in every kernel but the kv decode build, and 4-byte stores of 16-byte strided lanes send four
// times the requests to L2 (Nsight Compute on the chunked kernel: 59 % of its L2 sectors excessive,
// L2 86 % busy).  Each thread stores only elements it loaded itself, and the stored values are
// computed from the loaded ones, so in place (state_out == state) stays ordered by the data.
__device__ __forceinline__ void store_state(float* p, float4 x) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w));
}

// The states of speculative verify's tokens (written once, T of them for each state read) go out with
// the streaming hint: 0.6-1.1 % faster than plain stores at B = 512, T = 4 and B = 128, T = 16, both
// layouts (docs/serving.md), where the decode state loses 4-7 % with it.
__device__ __forceinline__ void store_token_state(float* p, float4 x) {
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w));
}

__device__ __forceinline__ void store_state(float* p, float2 x) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x.x), "f"(x.y));
}

// The two K-reductions of the delta rule for one float4 of state columns:
// sp += p * s (the correction read), sq += q * s (the readout).
__device__ __forceinline__ void accumulate_pq(float4 s, float p, float q, float (&sp)[4], float (&sq)[4]) {
    sp[0] = fmaf(p, s.x, sp[0]); sq[0] = fmaf(q, s.x, sq[0]);
    sp[1] = fmaf(p, s.y, sp[1]); sq[1] = fmaf(q, s.y, sq[1]);
    sp[2] = fmaf(p, s.z, sp[2]); sq[2] = fmaf(q, s.z, sq[2]);
    sp[3] = fmaf(p, s.w, sp[3]); sq[3] = fmaf(q, s.w, sq[3]);
}

// Decay and rank-1 write for one float4 of state columns: e * s + k * u.
__device__ __forceinline__ float4 decay_write(float4 s, float e, float k, const float (&u)[4]) {
    return make_float4(fmaf(e, s.x, k * u[0]), fmaf(e, s.y, k * u[1]), fmaf(e, s.z, k * u[2]),
                       fmaf(e, s.w, k * u[3]));
}

// One level of the transposing butterfly over x[0 .. 2*OFF): keep the half named by this lane's
// bit OFF, trade the other half with the lane across that bit; then recurse on x[0 .. OFF).
// After the levels OFF = LK/2 .. 1, lane kg holds the complete sum of value kg.  A template
// recursion rather than a loop so every index is a compile-time constant (no local memory).
template <int OFF, int N>
__device__ __forceinline__ void butterfly(float (&x)[N], int kg) {
    const bool upper = kg & OFF;
#pragma unroll
    for (int j = 0; j < OFF; ++j) {
        const float send = upper ? x[j] : x[j + OFF];
        const float keep = upper ? x[j + OFF] : x[j];
        x[j] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
    if constexpr (OFF > 1) butterfly<OFF / 2>(x, kg);
}

}  // namespace comba
