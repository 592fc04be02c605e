// delta_rule_mma.cu -- T-token passes of the gated delta rule with each chunk of 8 tokens done
// as small matrix products on the tensor cores (mma.sync m16n8k8, TF32 operands split in three
// for fp32 accuracy), one or two chunks a pass over the state (SUBS).  Either state layout; the
// state is read once, stays in registers across the T tokens and is written once, as in
// token_loop.cu.
//
// Math.  A chunk of C = 8 tokens from the state S0 (K x V); G_t = e_0 ... e_t, r(j, t) = e_{j+1}
// ... e_t (r(t, t) = 1); fq, fk, fp the L2-norm factors (1 without use_qk_l2norm).  Tokens past
// T are padded with q = k = p = v = 0, beta = 0, e = 1, which makes them no-ops.  With V x C
// matrices whose column t belongs to token t:
//
//   [Rp | Rq] = S0^T [p_0 .. p_7 | q_0 .. q_7]                        one pass, k-dim K
//   Y   = v^T - Rp diag(G fp)
//   U^T = Y M^T,   M = (I + L)^-1 diag(beta),  L[t][j] = beta_t fp_t r(j, t) fk_j (k_j . p_t), j < t
//   O^T = scale (Rq diag(G fq) + U^T Bq),      Bq[j][t] = r(j, t) fk_j fq_t (k_j . q_t), j <= t
//   S^T = G_7 S0^T + (U^T diag(w)) [k_0 .. k_7]^T,   w_j = r(j, 7) fk_j
//
// -- the token recurrence of token_loop.cu unrolled over the chunk (u_t is column t of U^T),
// exact algebra.  Every product with a K or V dimension runs on the tensor cores: the four above
// and the chunk's dot products, which are Gram products of the staged fragments ([p; q] k^T, and
// for use_qk_l2norm the norms); only the 8 x 8 solve for M and the factors run on CUDA cores (fp32).
//
// Two chunks a pass (SUBS = 2, tokens 0-7 and 8-15): both read [Rp | Rq] from the pass's first
// state S0; the second needs the state S1^T = G_7 S0^T + (U_0^T diag(w_0)) K_0^T the first leaves, so
//
//   [Rp | Rq]_1 = G_7 [Rp | Rq]_1(S0) + (U_0^T diag(w_0)) [X_p | X_q],   X_p[j][t] = k_{0,j} . p_{1,t}
//
// (X_q with q; one more Gram product), and each chunk then runs the formulas above in turn, its
// write included.
//
// Precision.  TF32 keeps 10 mantissa bits.  Every fp32 operand x is split as hi = x rounded to TF32,
// lo = x - hi (split() below), and a product is hi*hi + hi*lo + lo*hi ("3xTF32"): about 2^-21
// relative per product, the accuracy of an fp32 FMA chain (state error vs float64 ~1.6e-7, as the
// CUDA-core kernels).  bf16 and fp16 values are TF32 values already (lo = 0), so when q, k and p
// all are, the read and write products leave out their hi*lo term: two mma.sync instead of three,
// with the same sums.
//
// Fragments.  The state lives in registers as the fp32 accumulator of S^T (rows V, columns K):
// in each 16 x 8 tile lane (g = lane / 4, j = lane % 4) holds rows g, g + 8 and columns 2j,
// 2j + 1.  Read as an A operand (rows g, g + 8; k-columns j, j + 4) the same registers serve
// unchanged if k-column j stands for state column 2j and j + 4 for 2j + 1 -- a permutation of
// the K index, which the B operand (p, q) follows.  U^T, Y and O^T use the same trick over the
// token index.  So the state never moves between lanes.  The 16 rows of a warp's tile are 16
// value columns: row g is column 2g of the tile, row g + 8 column 2g + 1, so a lane's two values
// are adjacent in memory (one 8-byte store per state row in "kv", whose loads are two 4-byte ones --
// see the state load; one 8-byte access per pair of K in "vk").
//
// Launch geometry: delta_rule_mma<K, SLAB, SEPARATE_P, VK, SUBS> -- one CTA per (b, h, slab of SLAB
// value columns); NW = (SLAB / 16) x (K / 64) warps, each 16 value columns x 64 keys of the state
// (32 registers a lane); SLAB is 32 or 64, and at K = 64 with two chunks a pass also 128 (8 warps,
// as a 64-column slab at K = 128: one CTA a V = 128 head stages and solves each chunk once).  The
// K-reduction of a warp stays in its mma.sync accumulators; the K / 64 key parts of a value group
// add their partial [Rp | Rq] through shared memory.  The stage (MmaStage) is dynamic shared memory
// of cupy_comba.families.mma_stage_bytes.  At the start each thread asks L2 for a line of the state
// of the CTA a wave later.  Per pass (one chunk, or two with SUBS = 2: their solves on warps 0-1 and
// 2-3 at once, their Gram products over the value groups), four CTA barriers:
//   1. every thread stages 4 consecutive keys of one token of q, k, p (one 8- or 16-byte load
//      where the rows allow it) as B fragments -- two values, split by their reader when fp32 --
//      plus its v values and the gates, and issues the next chunk's loads; bf16 in contiguous rows
//      (the fast path, no dtype branch) is copied two chunks ahead into shared memory instead
//      (MmaRing);
//   2. every warp reads [Rp | Rq] over its keys; then the Gram products over its keys -- with one
//      chunk the warps of value group 0 form them all (the one against k inside the read loop, from
//      the fragments it loads, for 16-bit inputs), with two the value groups share them out;
//   3. warps 0 and 1 (and 2 and 3 for the second chunk) solve the 8 x 8 coefficients once for the
//      CTA (M; Bq and the per-token factors);
//   4. U, O and the write, chunk by chunk.
// A warp runs 72 mma.sync a chunk with an fp32 among q, k, p (48 for the read, 3 + 3 for U and O, 24
// for the write), 54 otherwise (32, 3 + 3, 16); the warps of value group 0 add the Gram product
// with k, and with use_qk_l2norm one more (Gated DeltaNet) or three (Comba), 8 mma.sync each (24
// with an fp32 among q, k, p).  A two-chunk pass holds only the 16-bit path (registers: the
// launch runs an fp32 among q, k, p with one chunk a pass).
//
// Why: with few heads (B*H <= 128) the GPU waits on each token's latency, and this kernel, 8 or 16
// tokens a step, is the fastest from T = 5 on; with many heads a pass costs about the same whatever
// its fill, so cupy_comba/tiling.py takes it from T = 5 (16 tokens a pass where fewer passes pay for
// their 5/3 cost).  Measured figures: docs/benchmarks.md, "Forward passes".
#include "common.cuh"
#include "params.cuh"
#include "mma_ops.cuh"
#include "mma_stage.cuh"

namespace comba {


// Where a chunk loop stages its chunks from (delta_rule_mma's `chunks`).
enum MmaStaging { kRing, kRegs, kEither };

template <int K, int SLAB, bool SEPARATE_P, bool VK, int SUBS, bool SERVING>
__global__ void __launch_bounds__(MmaShape<K, SLAB>::NT, MmaShape<K, SLAB>::MIN_CTAS)
delta_rule_mma(COMBA_KERNEL_ARGS) {
    using Shape = MmaShape<K, SLAB>;
    using Bits = MmaBits<K, SLAB, SUBS>;
    using Stage = MmaStage<K, SLAB, SEPARATE_P, SUBS>;
    constexpr int C = kMmaChunk * SUBS, CS = kMmaChunk, NT = Shape::NT, KS = Shape::KS, NKW = Shape::NKW;
    constexpr int NW = Shape::NW;
    static_assert(K % 64 == 0 && SLAB % 16 == 0 && (C * K) % NT == 0 && (C * SLAB) % NT == 0, "bad mma tiling");
    static_assert(SUBS == 1 || SUBS == 2, "one or two sub-chunks a pass over the state");
    // The stage is dynamic shared memory (over 48 KB with two sub-chunks): the launch passes
    // sizeof(Stage) (cupy_comba.families.mma_stage_bytes, checked against this struct by test_build).
    extern __shared__ __align__(16) unsigned char mma_smem[];
    Stage& st = *reinterpret_cast<Stage*>(mma_smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, lg = lane >> 2, lj = lane & 3;
    const int kpart = warp % KS, vgroup = warp / KS, n0 = kpart * NKW;  // this warp's tiles n0 .. n0 + 7
    const int V = static_cast<int>(prm.V), H = static_cast<int>(prm.H);
    const int slabs = V / SLAB;
    const int bh = static_cast<int>(blockIdx.x) / slabs;
    const int slab0 = (static_cast<int>(blockIdx.x) - bh * slabs) * SLAB;
    const int b = bh / H, h = bh - b * H, hk = h / static_cast<int>(prm.group);
    // A ragged batch's row starts at packed token `t_row` (0 otherwise): the loads and stores add it to their
    // token index, so that the activation pointers stay kernel parameters rather than seven 64-bit registers
    // held across the chunk loop.
    int t_row;
    const int T = token_span<SERVING>(cu_seqlens, prm, b, t_row);
    const long long slot = state_slot<SERVING>(slots, prm, b);
    const long long head = (SERVING ? slot * H + h : static_cast<long long>(bh)) * K * V;
    if (SERVING && slot < 0) {  // a padding row
        void* o_row = o;
        to_token(o_row, t_row, prm.o_st, prm.o_t);
        zero_o(o_row, prm, b, h, slab0, SLAB, T, tid, NT);
        return;
    }
    const HeadGating gating = head_gating<SERVING>(A_log, dt_bias, h);
    const int vl = 16 * vgroup + 2 * lg;  // this lane's value columns vl, vl + 1 within the slab
    // A lane's state pairs: in tile n, kv keeps (value vl, vl + 1) at rows kk, kk + 1 (kk = 8n + 2 lj)
    // of S[kk][v]; vk keeps (kk, kk + 1) at rows vl, vl + 1 of S[v][kk].  Addresses are walked
    // tile by tile (32-bit offsets within the head) so that no per-tile offset stays live in a
    // register across the token loop.
    const int kk0 = 8 * n0 + 2 * lj;
    const int first = VK ? (slab0 + vl) * K + kk0 : kk0 * V + slab0 + vl;
    const int next_row = VK ? K : V, next_tile = VK ? 8 : 8 * V;

    static_assert(NW >= 2, "the coefficients take two warps");
    const bool vec = rows_vectorisable(q, prm.q_sb, prm.q_st, prm.q_sh, prm.q_sk, prm.q_t) &&
                     rows_vectorisable(k, prm.k_sb, prm.k_st, prm.k_sh, prm.k_sk, prm.k_t) &&
                     (!SEPARATE_P || rows_vectorisable(p, prm.p_sb, prm.p_st, prm.p_sh, prm.p_sk, prm.p_t));
    const bool fast = vec && prm.q_t == BF16 && prm.k_t == BF16 && (!SEPARATE_P || prm.p_t == BF16) &&
                      prm.v_t == BF16 && prm.v_sv == 1 && prm.v_sb % Bits::EV == 0 && prm.v_st % Bits::EV == 0 &&
                      prm.v_sh % Bits::EV == 0 && reinterpret_cast<unsigned long long>(v) % (2 * Bits::EV) == 0;
    // A lane's o values vl, vl + 1 (vl even) of a token as one store where o's rows are contiguous and aligned.
    const int o_bytes = prm.o_t == F32 ? 8 : 4;
    const bool o_pairs = prm.o_sv == 1 && prm.o_sb % 2 == 0 && prm.o_st % 2 == 0 && prm.o_sh % 2 == 0 &&
                         reinterpret_cast<unsigned long long>(o) % o_bytes == 0;
    Bits bits;
    // Loads go out a chunk ahead into registers (any dtype and strides; with more passes the others
    // are loaded and staged in turn); the bf16 fast path copies two chunks ahead into the ring instead
    // (MmaRing), its gates a chunk ahead of bits.gate.  The first chunk's loads go out before the
    // state's, which the read needs later.
    auto issue = [&](auto pass, int t_first, int count) {
        issue_chunk<K, SLAB, SEPARATE_P, SUBS, decltype(pass)::value>(bits, q, k, v, p, beta, g, prm, vec, tid, b, h,
                                                                      hk, slab0, t_row + t_first, count);
    };
    auto issue_ring = [&](int t_first) {  // the chunk from t_first into slot (t_first / C) % 2, as one group
        if (t_first < T)
            issue_chunk_ring<K, SLAB, SEPARATE_P, SUBS>(st.ring, (t_first / C) & 1, q, k, v, p, prm, tid, b,
                                                        h, hk, slab0, t_row + t_first, min(C, T - t_first));
        copy_async_commit();
    };
    unsigned gate_next = 0;
    if (T > 0) {
        if (fast) {
            issue_ring(0);
            issue_ring(C);
            bits.gate = issue_chunk_gates<C>(beta, g, prm, tid, b, h, t_row, min(C, T));
            if (C < T) gate_next = issue_chunk_gates<C>(beta, g, prm, tid, b, h, t_row + C, min(C, T - C));
        } else {
            if (SUBS == 1) issue(Constant<0>{}, 0, min(C, T));
        }
    }

    // The CTA that takes this one's place a wave of resident CTAs later (nsmid x MIN_CTAS blocks on)
    // finds its state in L2: each thread asks for one 128-byte line of it now (a slab is NT lines).
    // (B*H = 8192, K = V = 128, T = 16: 2-3 % faster; two waves ahead was slower.)
    if (prm.has_initial) {
        unsigned nsm;
        asm("mov.u32 %0, %%nsmid;" : "=r"(nsm));
        const unsigned later = blockIdx.x + nsm * Shape::MIN_CTAS;
        if (later < gridDim.x) {
            static_assert(K * SLAB == 32 * NT, "one line a thread");
            const int bh2 = static_cast<int>(later) / slabs, s2 = (static_cast<int>(later) - bh2 * slabs) * SLAB;
            const int b2 = bh2 / H;
            const long long slot2 = !SERVING ? 0 : b2 == b ? slot : state_slot<SERVING>(slots, prm, b2);
            const float* line = state + (SERVING ? slot2 * H + bh2 - b2 * H : static_cast<long long>(bh2)) * K * V +
                                (VK ? s2 * K + 32 * tid : (tid / (SLAB / 32)) * V + s2 + 32 * (tid % (SLAB / 32)));
            if (slot2 >= 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
        }
    }

    // acc[n]: tile n of the state in memory order (mma3_state), kk = 8 (n0 + n) + 2 lj.  In kv a lane's
    // two values adjacent in memory are c0 and c2 of an accumulator quad (m0, m2, m1, m3), which one
    // 8-byte load cannot fill: ptxas loaded such pairs into other registers and moved them over right
    // after the loads, so that every warp waited there for its whole state before it staged its first
    // chunk.  Four 4-byte loads fill the quad directly (the same sectors; the second of a pair finds
    // them in L1).  B*H = 8192, T = 16: 567.5-568.6 against 594.7-595.3 us.
    float acc[NKW][4];
    if (prm.has_initial) {
        const float* src = state + head + first;
#pragma unroll
        for (int n = 0; n < NKW; ++n, src += next_tile) {
            if constexpr (VK) {
                const float2 a = *reinterpret_cast<const float2*>(src);
                const float2 z = *reinterpret_cast<const float2*>(src + next_row);
                acc[n][0] = a.x; acc[n][1] = a.y; acc[n][2] = z.x; acc[n][3] = z.y;
            } else {
                acc[n][0] = load_f32(src);
                acc[n][1] = load_f32(src + 1);
                acc[n][2] = load_f32(src + next_row);
                acc[n][3] = load_f32(src + next_row + 1);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < NKW; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    }

    // Tile n of the final state to state_out.  The last sub-chunk's write stores each tile as soon as it
    // is formed, so that the stores drain while the others are (a warp exits only when its stores
    // have).  With the single-chain sum below: B*H = 8192, kv T = 16, 558.3-558.5 against 567.5-568.6 us
    // storing after the chunk loop (vk within 0.5 %).
    // `final_state` is this lane's first value of it (with SERVING the head found again: no 64-bit
    // offset is held across the chunk loop).
    auto final_state = [&]() { return state_out + (SERVING ? pool_head<K>(slots, prm, b, h) : head) + first; };
    auto store_tile = [&](float* final, int n) {
        float* dst = (SERVING ? final : state_out + head + first) + n * next_tile;
        store_state(dst, make_float2(acc[n][0], acc[n][1]));
        store_state(dst + next_row, make_float2(acc[n][2], acc[n][3]));
    };

    // EXACT: q, k and p are all bf16 / fp16, whose values TF32 holds exactly, so the read and write
    // products skip their B operands' lo halves (two mma.sync each instead of three, same sums).
    const bool exact = prm.q_t != F32 && prm.k_t != F32 && (!SEPARATE_P || prm.p_t != F32);
    // FROM: the chunks are staged from the ring (kRing), from registers (kRegs), or either as `fast`
    // says (kEither: with two sub-chunks the fast path and the other 16-bit inputs share one instance
    // of the chunk loop, as three instances do not fit the registers without spills).
    auto chunks = [&](auto exact_tag, auto staging_tag) {
        constexpr bool EXACT = decltype(exact_tag)::value;
        constexpr MmaStaging FROM = decltype(staging_tag)::value;
        static_assert(EXACT || FROM == kRegs, "the fast path is bf16");
        for (int t0 = 0; t0 < T; t0 += C) {
            const int c = min(C, T - t0);
            __syncthreads();  // the previous chunk's readers are done with the stage
            if (FROM == kRing || (FROM == kEither && fast)) {
                const int ring_slot = (t0 / C) & 1;
                copy_async_wait<1>();  // this chunk's copies have landed; the next chunk's may still fly
                static_for<Bits::PASSES>([&](auto pass) {
                    constexpr int P = decltype(pass)::value;
                    ring_bits<K, SLAB, SEPARATE_P, SUBS, P>(bits, st.ring, ring_slot, tid);
                    stage_chunk<K, SLAB, SEPARATE_P, SUBS, P, true, SERVING>(st, bits, prm, vec, tid, c, gating);
                });
                issue_ring(t0 + 2 * C);  // into the slot this thread has just read
                bits.gate = gate_next;
                if (t0 + 2 * C < T)
                    gate_next = issue_chunk_gates<C>(beta, g, prm, tid, b, h, t_row + t0 + 2 * C,
                                                     min(C, T - t0 - 2 * C));
            } else {
                static_for<Bits::PASSES>([&](auto pass) {
                    constexpr int P = decltype(pass)::value;
                    if constexpr (P > 0 || SUBS > 1) issue(Constant<P>{}, t0, c);
                    stage_chunk<K, SLAB, SEPARATE_P, SUBS, P, false, SERVING>(st, bits, prm, vec, tid, c, gating);
                });
                if (SUBS == 1 && t0 + C < T) issue(Constant<0>{}, t0 + C, min(C, T - t0 - C));
            }
            __syncthreads();

            // Read: [Rp | Rq] = S0^T [p | q] of every sub-chunk over this warp's keys, then summed over
            // the key parts; r[2 s] is Rp of sub-chunk s, r[2 s + 1] its Rq.  With one sub-chunk the
            // warps of value group 0 (one per key part) also take the Gram product with k over their keys
            // here, from the fragments the read loads (16-bit inputs); every other Gram product after it.
            constexpr bool K_IN_READ = SUBS == 1 && EXACT;
            constexpr int CHAINS = SUBS == 1 ? 2 : 1;  // accumulators per product (even and odd tiles)
            const bool gram_warp = K_IN_READ && vgroup == 0;
            float r[2 * SUBS][4];
            {
                float rd[CHAINS][2 * SUBS][4], dk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ch = 0; ch < CHAINS; ++ch)
#pragma unroll
                    for (int i = 0; i < 2 * SUBS; ++i) rd[ch][i][0] = rd[ch][i][1] = rd[ch][i][2] = rd[ch][i][3] = 0.f;
#pragma unroll
                for (int n = 0; n < NKW; ++n) {
                    unsigned ah[4], al[4];
                    state_a_operand<VK>(acc[n], ah, al);
                    const int slot = lane ^ x_swizzle(n0 + n);
#pragma unroll
                    for (int s = 0; s < SUBS; ++s) {
                        const uint4 xp = st.template x<EXACT>(s, n0 + n, 0, slot);
                        const uint4 xq = st.template x<EXACT>(s, n0 + n, 1, slot);
                        mma3<EXACT>(rd[n % CHAINS][2 * s], ah, al, xp);
                        mma3<EXACT>(rd[n % CHAINS][2 * s + 1], ah, al, xq);
                        if (gram_warp) {
                            const unsigned gh[4] = {xp.x, xq.x, xp.y, xq.y}, gl[4] = {xp.z, xq.z, xp.w, xq.w};
                            mma_fragments<EXACT>(dk, gh, gl, SEPARATE_P ? st.template x<EXACT>(s, n0 + n, 2, slot) : xp);
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < 2 * SUBS; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if constexpr (CHAINS == 2) r[i][e] = rd[0][i][e] + rd[1][i][e];
                        else r[i][e] = rd[0][i][e];
                    }
                    if constexpr (KS > 1) st.part[vgroup][kpart][i][lane] = make_float4(r[i][0], r[i][1], r[i][2], r[i][3]);
                }
                if (gram_warp) st.gram[kpart][kGramK][lane] = make_float4(dk[0], dk[1], dk[2], dk[3]);
            }
            gram_products<K, SLAB, SEPARATE_P, SUBS, EXACT, K_IN_READ>(st, prm.l2norm != 0, n0, lane, vgroup);
            __syncthreads();  // Gram products and the key parts' partial sums complete
            for (int s = warp >> 1; s < SUBS; s += NW >> 1)  // two warps a sub-chunk
                chunk_coefficients<K, SLAB, SEPARATE_P, SUBS>(st.coef[s], st, s, prm, scale, warp & 1, lane);
            __syncthreads();  // coefficients complete
            // Rp, Rq of sub-chunk s summed over the key parts, the same sum in the same order in every
            // warp of a value group; taken when the sub-chunk's turn comes, so that sub-chunk 1's stay
            // in shared memory while sub-chunk 0 runs.
            auto sum_parts = [&](int s) {
                if constexpr (KS > 1) {
#pragma unroll
                    for (int i = 2 * s; i < 2 * s + 2; ++i) {
                        float4 a = st.part[vgroup][0][i][lane];
#pragma unroll
                        for (int j = 1; j < KS; ++j) {
                            const float4 z = st.part[vgroup][j][i][lane];
                            a.x += z.x; a.y += z.y; a.z += z.z; a.w += z.w;
                        }
                        r[i][0] = a.x; r[i][1] = a.y; r[i][2] = a.z; r[i][3] = a.w;
                    }
                }
            };
            sum_parts(0);

            // Sub-chunk by sub-chunk: U^T = Y M^T, O^T = Rq diag(scale G fq) + U^T (scale Bq) (this lane's
            // tokens ta, tb of the sub-chunk), then the write S^T = G_7 S^T + (U^T diag(w)) [k_0 .. k_7]^T.
            // Sub-chunk 1 reads the state sub-chunk 0 leaves, so its Rp, Rq (read from the chunk's first
            // state) become G_7 Rp + (U_0^T diag(w)) X_p (and X_q), X_p[j][t] = k_j . p_t over sub-chunk
            // 0's k and 1's p (kGramX).
            const int ta = 2 * lj, tb = ta + 1;
#pragma unroll
            for (int s = 0; s < SUBS; ++s) {
                const ChunkCoefficients& cf = st.coef[s];
                const float(&rp)[4] = r[2 * s];
                const float(&rq)[4] = r[2 * s + 1];
                unsigned yh[4], yl[4], mb[4], bb[4], uh[4], ul[4];
                {
                    const float* sva = st.v[CS * s + ta];
                    const float* svb = st.v[CS * s + tb];
                    const float y[4] = {sva[vl] - cf.cp[ta] * rp[0], svb[vl] - cf.cp[tb] * rp[1],
                                        sva[vl + 1] - cf.cp[ta] * rp[2], svb[vl + 1] - cf.cp[tb] * rp[3]};
                    a_operand(y, yh, yl);
                }
                split_into(mb, 0, cf.m[lg][ta]);
                split_into(mb, 1, cf.m[lg][tb]);
                float u[4] = {0.f, 0.f, 0.f, 0.f};
                mma3(u, yh, yl, make_uint4(mb[0], mb[1], mb[2], mb[3]));
                if (kpart == s % KS) {  // o once per value group, the sub-chunks' on different key parts
                    float ov[4] = {cf.cq[ta] * rq[0], cf.cq[tb] * rq[1], cf.cq[ta] * rq[2], cf.cq[tb] * rq[3]};
                    a_operand(u, uh, ul);
                    split_into(bb, 0, cf.bq[ta][lg]);
                    split_into(bb, 1, cf.bq[tb][lg]);
                    mma3(ov, uh, ul, make_uint4(bb[0], bb[1], bb[2], bb[3]));
                    const long long ob = b * prm.o_sb + h * prm.o_sh + (slab0 + vl) * prm.o_sv;
                    const int sa = CS * s + ta, sb = sa + 1;
                    if (sa < c)
                        store_act_pair(o, ob + (t_row + t0 + sa) * prm.o_st, prm.o_sv, prm.o_t, ov[0], ov[2], o_pairs);
                    if (sb < c)
                        store_act_pair(o, ob + (t_row + t0 + sb) * prm.o_st, prm.o_sv, prm.o_t, ov[1], ov[3], o_pairs);
                }
                const float wa = cf.w[ta], wb = cf.w[tb], gl = cf.g_last;
                const float uw[4] = {u[0] * wa, u[1] * wb, u[2] * wa, u[3] * wb};
                a_operand(uw, uh, ul);
                // Written twice so that neither loop has a branch between its mma.sync: one `if` in every
                // step measured 3 % slower over 16 heads (kv, T = 512 / 4096: 123.7-124.3 / 968.9-972.3
                // against 120.4-120.9 / 941.4-945.2 us), though 1 % faster over 8192 (T = 16).
                auto write = [&](auto store) {
                    float* final = SERVING && decltype(store)::value ? final_state() : nullptr;
#pragma unroll
                    for (int n = 0; n < NKW; ++n) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[n][i] *= gl;
                        mma3_state<VK, EXACT>(acc[n], uh, ul, st.template kw<EXACT>(s, n0 + n, kw_lane(lg, lj)));
                        if constexpr (decltype(store)::value) store_tile(final, n);
                    }
                };
                if (s + 1 == SUBS && t0 + C >= T && prm.write_final) write(Constant<true>{});
                else write(Constant<false>{});
                if (s + 1 < SUBS) {
                    sum_parts(s + 1);
                    const int gx = gram_slot<SUBS>(kGramX, s + 1);
                    float(&np)[4] = r[2 * s + 2];
                    float(&nq)[4] = r[2 * s + 3];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        np[i] *= gl;
                        nq[i] *= gl;
                    }
                    mma3(np, uh, ul, split_pair(st.dot(gx, lg, ta), st.dot(gx, lg, tb)));
                    mma3(nq, uh, ul, split_pair(st.dot(gx, 8 + lg, ta), st.dot(gx, 8 + lg, tb)));
                }
            }
        }
    };
    if constexpr (SUBS == 1) {
        if (fast) chunks(Constant<true>{}, Constant<kRing>{});
        else if (exact) chunks(Constant<true>{}, Constant<kRegs>{});
        else chunks(Constant<false>{}, Constant<kRegs>{});
    } else {
        // 16-bit q, k, p only: cupy_comba.families.kernel runs an fp32 among them with 8-token chunks.
        chunks(Constant<true>{}, Constant<kEither>{});
    }

    if (prm.write_final && T <= 0) {  // no token: the state passes through
        float* final = SERVING ? final_state() : nullptr;
#pragma unroll
        for (int n = 0; n < NKW; ++n) store_tile(final, n);
    }
}

}  // namespace comba
