// params.cuh -- the launch parameters every delta-rule kernel takes, in one struct passed by value,
// and what every kernel does with the serving options (docs/serving.md).
//
// Strides are in elements and may be anything (activations are often slices of a packed
// projection); a decode step is the T = 1 case with zero T strides.  Must match
// PARAMS_FIELDS in cupy_comba/_launcher.py (all int64, same order).
//
// Every kernel takes fifteen pointers: state, state_out, q, k, v, p, beta, g, o, then
//   slots    state_indices [B] (int32 or int64, stride slot_s; read when slot_t != 0): state and
//            state_out are a pool [N, H, ...] and row b's state is slot slots[b] of it;
//   A_log, dt_bias   [H] float32 (read when gate_softplus): in-kernel gating;
//   cu_seqlens       [B + 1] (int32 or int64; read when cu_t != 0): a ragged batch, row b the tokens
//                    cu_seqlens[b] .. cu_seqlens[b + 1] - 1 of packed activations (`tokens`);
//   inter            [B, T, H, ...] float32 (per_token == 1): the state after every token;
//   accepted         num_accepted_tokens [B] (per_token == 2, na_t != 0): row b starts from slot
//                    slots[b, accepted[b] - 1] (`initial_slot`).
#pragma once

#include "common.cuh"

namespace comba {

// The fields a dense call reads come first, together: a kernel's first use of each 64-byte line of its
// parameters waits for that line, and over a few heads a decode step is a chain of such latencies
// (docs/design.md).
struct Params {
    long long H, group, V;              // group = H / Hk: value heads per key head
    long long q_sb, q_sh, q_sk, k_sb, k_sh, k_sk, p_sb, p_sh, p_sk;
    long long v_sb, v_sh, v_sv, beta_sb, beta_sh, g_sb, g_sh, o_sb, o_sh, o_sv;
    long long q_t, k_t, p_t, v_t, beta_t, g_t, o_t;  // dtype codes (common.cuh)
    long long gate_linear, l2norm;
    long long grid3;                    // a decode step's grid: (b, h, slab) rather than B * H * slabs CTAs in x
    // T-token passes: the token axis
    long long B, T, q_st, k_st, p_st, v_st, beta_st, g_st, o_st, has_initial, write_final;
    // the serving options
    long long N, slot_t, slot_s;        // pool slots; slot_t: 0 no pool, 1 int32, 2 int64 indices
    long long cu_t;                     // cu_seqlens: 0 none (a dense batch), 1 int32, 2 int64
    long long per_token, slot_st, na_t; // verify: 1 intermediate_states, 2 a slot per token (slots[b, t],
                                        // T stride slot_st; num_accepted_tokens of dtype na_t, 0 none)
    long long gate_softplus, beta_sigmoid;  // in-kernel gating (gate_of, beta_of)
    long long seg_chunks;               // the segmented prefill scan (prefill_transposed.cu): chunks a segment
    long long seg_split;                // and its prep in two launches around the chain (prefill_prep.cuh, PrepSplit)
};

// The arguments of every delta-rule kernel, in launch order (cupy_comba/_launcher.py packs them): the
// fifteen pointers above, the Params (named PRM), the query scale.
#define COMBA_KERNEL_ARGS_NAMED(PRM)                                                                        \
    const float *state, float *state_out, const void *__restrict__ q, const void *__restrict__ k,            \
        const void *__restrict__ v, const void *__restrict__ p, const void *__restrict__ beta,               \
        const void *__restrict__ g, void *__restrict__ o, const void *__restrict__ slots,                    \
        const float *__restrict__ A_log, const float *__restrict__ dt_bias,                                  \
        const void *__restrict__ cu_seqlens, float *__restrict__ inter, const void *__restrict__ accepted,  \
        const Params PRM, const float scale
#define COMBA_KERNEL_ARGS COMBA_KERNEL_ARGS_NAMED(prm)

// The decode builds for one activation layout: ACT >= 0 is the dtype code (common.cuh) of q, k, p, v and
// o, fixed at compile time together with their unit strides along the key and value axes, so that every
// load, conversion and store of them is one instruction with no dtype branch and a constant offset from
// its row (over a few heads a decode step is a chain of instructions, docs/design.md); ACT = -1 reads
// them from Params.  beta and g keep their run-time codes (one scalar each a token).  A kernel that takes
// ACT names its Params argument `launch` and works on `decltype(auto) prm = fix_activations<ACT>(launch)`:
// the argument itself at ACT = -1 (the code is that of a kernel without ACT), a copy with the codes and
// strides set otherwise.
template <int ACT>
__device__ __forceinline__ decltype(auto) fix_activations(const Params& launch) {
    if constexpr (ACT < 0) {
        return (launch);  // const Params&
    } else {
        Params fixed = launch;
        fixed.q_t = fixed.k_t = fixed.p_t = fixed.v_t = fixed.o_t = ACT;
        fixed.q_sk = fixed.k_sk = fixed.p_sk = fixed.v_sv = fixed.o_sv = 1;
        return fixed;
    }
}

constexpr float kL2NormEps = 1e-6f;

// Loads the compiler issues where they are written: small per-CTA values re-read (from L1) where
// they are used rather than held in a register by every thread across the token loop, where the
// state takes the registers.
__device__ __forceinline__ float reload(const float* p) {
    float x;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}
__device__ __forceinline__ long long reload(const long long* p) {
    long long x;
    asm volatile("ld.global.nc.s64 %0, [%1];" : "=l"(x) : "l"(p));
    return x;
}
__device__ __forceinline__ long long reload(const int* p) {
    int x;
    asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(x) : "l"(p));
    return x;
}

// The state slot of batch row b: b itself without a pool, else slots[b] -- or -1 when that is
// negative or >= N: a padding row, whose state is neither read nor written and whose o is zeros
// (zero_o).  The bounds check is the kernel's: no index value makes it touch memory outside the
// pool, and checking on the host would cost a device synchronisation.  The kernels call it where
// they load the state and again where they store it (pool_head), so that no 64-bit offset
// stays live across the token loop.
//
// SERVING is every kernel's last template flag: the builds without it (the dense calls) hold no
// code for the serving options, so that those keep the registers and the code they have without
// them; Params says which of the options a serving build uses.
template <bool SERVING>
__device__ __forceinline__ long long state_slot(const void* slots, const Params& prm, int b, int col = 0) {
    if (!SERVING || !prm.slot_t) return b;
    const long long at = b * prm.slot_s + col * prm.slot_st;
    const long long i = prm.slot_t == 1 ? reload(static_cast<const int*>(slots) + at)
                                        : reload(static_cast<const long long*>(slots) + at);
    return i >= 0 && i < prm.N ? i : -1;
}

// The slot row b starts from: state_slot, or with a slot per token (vLLM's speculative decoding)
// slots[b, accepted[b] - 1] -- a padding row (-1) when accepted[b] is outside 1 .. T.
template <bool SERVING, bool VERIFY>
__device__ __forceinline__ long long initial_slot(const void* slots, const void* accepted, const Params& prm, int b) {
    if (!VERIFY || prm.per_token != 2) return state_slot<SERVING>(slots, prm, b);
    int col = 0;
    if (prm.na_t) {
        const long long na = prm.na_t == 1 ? reload(static_cast<const int*>(accepted) + b)
                                           : reload(static_cast<const long long*>(accepted) + b);
        if (na < 1 || na > prm.T) return -1;
        col = static_cast<int>(na - 1);
    }
    return state_slot<true>(slots, prm, b, col);
}

// Where the state after token t of head (b, h) goes with per_token (the token-loop kernels): its
// place in intermediate_states, or its slot slots[b, t] of the pool (nullptr for an index outside
// it: that token's state is not kept).
template <int K>
__device__ __forceinline__ float* token_state(float* inter, float* pool, const void* slots, const Params& prm, int b,
                                              int h, int t) {
    if (prm.per_token == 1) return inter + ((b * prm.T + t) * prm.H + h) * K * prm.V;
    const long long slot = state_slot<true>(slots, prm, b, t);
    return slot < 0 ? nullptr : pool + (slot * prm.H + h) * K * prm.V;
}

// With SERVING, the offset of the state of head h of row b (K x V floats) in the pool, found again
// (-1 slot: a padding row, which returned before any access).
template <int K>
__device__ __forceinline__ long long pool_head(const void* slots, const Params& prm, int b, int h) {
    return (state_slot<true>(slots, prm, b) * prm.H + h) * K * prm.V;
}
// Moves an activation (or o) pointer to token `first` of its T axis.
template <class Ptr>
__device__ __forceinline__ void to_token(Ptr& ptr, long long first, long long stride, long long dtype) {
    ptr = (Ptr)(reinterpret_cast<const char*>(ptr) + first * stride * (dtype == F32 ? 4 : 2));
}

// The tokens of CTA row b: prm.T, or in a ragged batch (cu_t != 0, SERVING builds) the
// cu[b + 1] - cu[b] tokens of sequence b, with the activation and o pointers moved to its first
// token (the host sets their batch strides to 0).  The bounds are clamped to 0 .. prm.T: no value
// of cu_seqlens makes a kernel touch memory outside the packed arrays.  The grid is sized by the
// number of sequences, never by their lengths, so nothing on the host waits for cu_seqlens.
template <bool SERVING>
__device__ __forceinline__ int token_span(const void* cu, const Params& prm, int b, int& first) {
    first = 0;
    if (!SERVING || !prm.cu_t) return static_cast<int>(prm.T);
    const long long a = prm.cu_t == 1 ? reload(static_cast<const int*>(cu) + b)
                                      : reload(static_cast<const long long*>(cu) + b);
    const long long z = prm.cu_t == 1 ? reload(static_cast<const int*>(cu) + b + 1)
                                      : reload(static_cast<const long long*>(cu) + b + 1);
    const long long lo = min(max(a, 0LL), prm.T), hi = min(max(z, lo), prm.T);
    first = static_cast<int>(lo);
    return static_cast<int>(hi - lo);
}
template <bool SERVING, class In, class Out>
__device__ __forceinline__ int tokens(const void* cu, const Params& prm, int b, In& q, In& k, In& v, In& p, In& beta,
                                      In& g, Out& o) {
    int first;
    const int T = token_span<SERVING>(cu, prm, b, first);
    if (!SERVING || !prm.cu_t) return T;
    const long long lo = first;
    to_token(q, lo, prm.q_st, prm.q_t);
    to_token(k, lo, prm.k_st, prm.k_t);
    to_token(v, lo, prm.v_st, prm.v_t);
    to_token(p, lo, prm.p_st, prm.p_t);
    to_token(beta, lo, prm.beta_st, prm.beta_t);
    to_token(g, lo, prm.g_st, prm.g_t);
    to_token(o, lo, prm.o_st, prm.o_t);
    return T;
}

// o of a padding row: columns c0 .. c0 + n - 1 of head (b, h), every token, set to zero by the nt
// threads of the CTA that owns them.
__device__ __forceinline__ void zero_o(void* o, const Params& prm, int b, int h, int c0, int n, int T, int tid,
                                       int nt) {
    const long long ob = b * prm.o_sb + h * prm.o_sh;
    for (int t = 0; t < T; ++t)
        for (int c = tid; c < n; c += nt) store_act(o, ob + t * prm.o_st + (c0 + c) * prm.o_sv, prm.o_t, 0.f);
}

// The gate options of a build: in-kernel gating (Qwen3-Next's; head h's A_log and dt_bias, read
// where a gate is formed) and the sigmoid of beta, with SERVING; neither without.
template <bool SERVING>
struct HeadGating {
    const float* A_log;
    const float* dt_bias;
    int h;
};

template <bool SERVING>
__device__ __forceinline__ HeadGating<SERVING> head_gating(const float* A_log, const float* dt_bias, int h) {
    return HeadGating<SERVING>{A_log, dt_bias, h};
}

// The decay factor e of a token from its g: exp(g) ("log"), g ("linear"), or, with in-kernel
// gating, exp(-exp(A_log) * softplus(g + dt_bias)) with softplus(x) = x above 20 (where float32
// rounds log1p(exp(x)) to x), as vLLM's and SGLang's gating kernels compute it.
template <bool SERVING>
__device__ __forceinline__ float gate_of(float g, const Params& prm, HeadGating<SERVING> hg) {
    if (SERVING && prm.gate_softplus) {
        const float x = g + reload(hg.dt_bias + hg.h);
        return expf(-expf(reload(hg.A_log + hg.h)) * (x > 20.f ? x : log1pf(expf(x))));
    }
    return prm.gate_linear ? g : expf(g);
}

// The step size of a token from its beta: beta, or sigmoid(beta) with use_beta_sigmoid.
template <bool SERVING>
__device__ __forceinline__ float beta_of(float beta, const Params& prm, HeadGating<SERVING>) {
    return SERVING && prm.beta_sigmoid ? 1.f / (1.f + expf(-beta)) : beta;
}

// The gates of a chunk of C tokens (the chunked kernels): threads 2t and 2t + 1 load the raw bits
// of beta_t and g_t for the c tokens present; `stage_chunk_gates` writes beta_t and the decay
// factor e_t through beta_of and gate_of (beta 0 and e 1 for tokens past the end: they leave the
// state as it is).
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

template <int C, bool SERVING>
__device__ __forceinline__ void stage_chunk_gates(float* e, float* beta, unsigned bits, const Params& prm, int tid,
                                                  int c, HeadGating<SERVING> hg) {
    const int gt = tid >> 1;
    if (tid < 2 * C) {
        if (tid & 1) e[gt] = gt < c ? gate_of(bits_to_float(bits, prm.g_t), prm, hg) : 1.f;
        // past the end the bits are 0, beta 0: no write (the sigmoid of a serving build would give 1/2)
        else beta[gt] = !SERVING ? bits_to_float(bits, prm.beta_t)
                                 : gt < c ? beta_of(bits_to_float(bits, prm.beta_t), prm, hg) : 0.f;
    }
}

// Sum over the lanes that differ in bits first, 2 first, ..., last of the lane id.
__device__ __forceinline__ float lane_sum(float x, int first, int last) {
#pragma unroll
    for (int off = first; off <= last; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

}  // namespace comba
