// bulk_copy.cuh -- Hopper's bulk copy engine (cp.async.bulk) and mbarriers, as thin PTX wrappers.
//
// One thread asks the copy engine for a contiguous global -> shared copy;
// completion is counted in bytes on an mbarrier that every consumer thread
// waits on by phase parity.  The copy runs without registers or issue slots,
// so a CTA can keep several tiles in flight while it computes on another.
// sm_90 and newer: on older GPUs these compile to traps (the op never picks the
// pipelined kernel there), so one source still builds for every architecture.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define COMBA_NO_BULK_COPY 1
#endif

namespace comba {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
#ifdef COMBA_NO_BULK_COPY
    __trap();
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}

// Make initialised barriers visible to the async proxy (the copy engine).
__device__ __forceinline__ void mbar_fence_init() {
#ifdef COMBA_NO_BULK_COPY
    __trap();
#else
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Order this thread's earlier generic-proxy shared-memory accesses before later
// async-proxy (bulk copy) writes to the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef COMBA_NO_BULK_COPY
    __trap();
#else
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
#ifdef COMBA_NO_BULK_COPY
    __trap();
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#ifdef COMBA_NO_BULK_COPY
    __trap();
#else
    unsigned done;
    do {
        asm volatile(
            "{\n"
            "  .reg .pred p;\n"
            "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "  selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    } while (!done);
#endif
}

// Global -> shared copy of `bytes` (a multiple of 16, both addresses 16-byte
// aligned), completing `bytes` transactions on `bar`.  The state is read
// exactly once, so hint the L2 to evict it first.
__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
#ifdef COMBA_NO_BULK_COPY
    __trap();
#else
    asm volatile(
        "{\n"
        "  .reg .b64 policy;\n"
        "  createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "  cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], policy;\n"
        "}\n" ::"r"(smem_addr(dst_smem)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
#endif
}

}  // namespace comba
