// params.cuh -- the launch parameters every delta-rule kernel takes, in one struct passed by value.
//
// Strides are in elements and may be anything (activations are often slices of a packed
// projection); a decode step is the T = 1 case with zero T strides.  Must match
// PARAMS_FIELDS in cupy_comba/_plan.py (all int64, same order).
#pragma once

#include "common.cuh"

namespace comba {

struct Params {
    long long B, T, H, group, V;              // group = H / Hk: value heads per key head
    long long q_sb, q_st, q_sh, q_sk;
    long long k_sb, k_st, k_sh, k_sk;
    long long p_sb, p_st, p_sh, p_sk;
    long long v_sb, v_st, v_sh, v_sv;
    long long beta_sb, beta_st, beta_sh;
    long long g_sb, g_st, g_sh;
    long long o_sb, o_st, o_sh, o_sv;
    long long q_t, k_t, p_t, v_t, beta_t, g_t, o_t;   // dtype codes (common.cuh)
    long long gate_linear, l2norm, has_initial, write_final;
};

constexpr float kL2NormEps = 1e-6f;

__device__ __forceinline__ float gate_of(float g, long long linear) { return linear ? g : expf(g); }

// The gates of a chunk of C tokens (the chunked kernels): threads 2t and 2t + 1 load the raw bits
// of beta_t and g_t for the c tokens present; `stage_chunk_gates` writes beta_t and the decay
// factor e_t (1 for tokens past the end: no decay).
template <int C>
__device__ __forceinline__ unsigned issue_chunk_gates(const void* beta, const void* g, const Params& prm, int tid,
                                                      int b, int h, int t0, int c) {
    const int gt = tid >> 1;
    unsigned bits = 0;
    if (tid < 2 * C && gt < c) {
        bits = (tid & 1) ? load_bits(g, b * prm.g_sb + (t0 + gt) * prm.g_st + h * prm.g_sh, prm.g_t)
                         : load_bits(beta, b * prm.beta_sb + (t0 + gt) * prm.beta_st + h * prm.beta_sh, prm.beta_t);
    }
    return bits;
}

template <int C>
__device__ __forceinline__ void stage_chunk_gates(float* e, float* beta, unsigned bits, const Params& prm, int tid,
                                                  int c) {
    const int gt = tid >> 1;
    if (tid < 2 * C) {
        if (tid & 1) e[gt] = gt < c ? gate_of(bits_to_float(bits, prm.g_t), prm.gate_linear) : 1.f;
        else beta[gt] = bits_to_float(bits, prm.beta_t);
    }
}

// Sum over the lanes that differ in bits first, 2 first, ..., last of the lane id.
__device__ __forceinline__ float lane_sum(float x, int first, int last) {
#pragma unroll
    for (int off = first; off <= last; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

}  // namespace comba
