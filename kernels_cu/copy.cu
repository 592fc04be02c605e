// copy.cu -- the roofline reference: a vectorised device-to-device copy.
//
// dst[i] = src[i] over n float4s with 16-byte loads and stores (the same
// access style as the decode kernels, so the ratio of the two measures
// the kernels' design, not the load width).  Each thread moves UNROLL float4
// per grid-stride step, all loads issued before the stores, so every SM keeps
// enough bytes in flight.  Launch: 512 threads per block, a few blocks per SM.
#include "common.cuh"

namespace comba {

__global__ void __launch_bounds__(512) copy_float4(const float* __restrict__ src, float* __restrict__ dst,
                                                   const long long n) {
    constexpr int UNROLL = 4;
    const long long threads = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    long long i = first;
    for (; i + (UNROLL - 1) * threads < n; i += UNROLL * threads) {
        float4 x[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) x[u] = load_state(src + 4 * (i + u * threads));
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) store_state(dst + 4 * (i + u * threads), x[u]);
    }
    for (; i < n; i += threads) store_state(dst + 4 * i, load_state(src + 4 * i));
}

}  // namespace comba
