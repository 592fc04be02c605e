// copy.cu -- the roofline reference: a vectorised device-to-device copy.
//
// dst[i] = src[i] over n float4s, grid-stride, 16-byte streaming loads and
// stores (the same access style as the decode kernels, so the ratio of the
// two measures the kernels' design, not the load width).
// Launch: 256 threads per block, a few blocks per SM; n in float4 units.
#include "common.cuh"

namespace comba {

__global__ void __launch_bounds__(256) copy_float4(const float* __restrict__ src, float* __restrict__ dst,
                                                   const long long n) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        store_stream(dst + 4 * i, load_stream(src + 4 * i));
    }
}

}  // namespace comba
