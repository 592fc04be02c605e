// kv_slab.cuh -- the slab of a "kv" state one CTA of delta_rule_kv or delta_rule_kv_chunked holds in
// registers: COLS value columns of one head, RG row groups.
#pragma once

#include "common.cuh"
#include "params.cuh"

namespace comba {

// One CTA of the kv tiling: head bh = (b, h) and the slab of COLS columns it owns; thread tid owns
// the float4 of columns col .. col + 3 in rows rg, rg + RG, ...  The head's state is at `head`; with
// SERVING in slot `slot` of a pool (state_slot; -1: a padding row, nothing there), found again
// where it is stored.
// VERIFY: the token loop's slot per token (initial_slot).  32-bit index math (the grid and the row
// offsets of one head fit), 64-bit addresses.
template <int K, int COLS, int RG, bool SERVING, bool VERIFY = false>
struct KvSlab {
    static constexpr int LC = COLS / 4, R = K / RG;
    int lc, rg, V, H, b, h, hk, col0, col;
    long long slot, head;
    // A one-dimensional grid: CTA x is slab x % slabs of head x / slabs.
    __device__ __forceinline__ KvSlab(const Params& prm, int tid, const void* slots, const void* accepted) {
        const int slabs = static_cast<int>(prm.V) / COLS, bh = static_cast<int>(blockIdx.x) / slabs;
        const int b_ = bh / static_cast<int>(prm.H), h_ = bh - b_ * static_cast<int>(prm.H);
        init(prm, tid, static_cast<int>(blockIdx.x) - bh * slabs, b_, h_, h_ / static_cast<int>(prm.group), bh, slots,
             accepted);
    }
    // Slab `slab` of head h of row b, named by the caller (a grid of three dimensions).
    __device__ __forceinline__ KvSlab(const Params& prm, int tid, int slab, int b_, int h_, const void* slots,
                                      const void* accepted) {
        init(prm, tid, slab, b_, h_, static_cast<int>(static_cast<unsigned>(h_) / static_cast<unsigned>(prm.group)),
             static_cast<long long>(b_) * static_cast<int>(prm.H) + h_, slots, accepted);
    }
    __device__ __forceinline__ void init(const Params& prm, int tid, int slab, int b_, int h_, int hk_, long long bh,
                                         const void* slots, const void* accepted) {
        lc = tid % LC;
        rg = tid / LC;
        V = static_cast<int>(prm.V);
        H = static_cast<int>(prm.H);
        b = b_;
        h = h_;
        hk = hk_;
        col0 = slab * COLS;
        col = col0 + lc * 4;
        slot = initial_slot<SERVING, VERIFY>(slots, accepted, prm, b);
        head = SERVING ? (slot * H + h) * K * V : bh * K * V;
    }
    // Every state load of the thread at once (zeros when there is no initial state).
    __device__ __forceinline__ void load(float4 (&s)[R], const float* state, bool has_initial) const {
        if (has_initial) {
            const float* src = state + head + col;
#pragma unroll
            for (int i = 0; i < R; ++i) s[i] = load_state(src + (rg + i * RG) * V);
        } else {
#pragma unroll
            for (int i = 0; i < R; ++i) s[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    __device__ __forceinline__ void store(const float4 (&s)[R], float* state_out, const void* slots,
                                          const Params& prm) const {
        float* dst = state_out + (SERVING ? pool_head<K>(slots, prm, b, h) : head) + col;
#pragma unroll
        for (int i = 0; i < R; ++i) store_state(dst + (rg + i * RG) * V, s[i]);
    }
    // The thread's part of the slab into the head state that starts at `head_state` (a token's state
    // of speculative verify).
    __device__ __forceinline__ void store_head(const float4 (&s)[R], float* head_state) const {
        float* dst = head_state + col;
#pragma unroll
        for (int i = 0; i < R; ++i) store_token_state(dst + (rg + i * RG) * V, s[i]);
    }
};

}  // namespace comba
