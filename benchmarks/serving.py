"""The serving options against the dense calls and the copy, measured in one run (CUDA-graph replay).

    PYTHONPATH=. python benchmarks/serving.py [--json FILE] [--decode B,H,K,V ...] [--forward B,T,H,K,V ...]
        [--verify B,T,H,K,V ...] [--verify-tilings]

Per shape and layout, Comba decode steps (in place: the state read once and written once): ``dense`` the batch's own
states; ``pool`` through ``state_indices`` -- a random permutation of slots of a pool twice the batch; ``pool, slots
in order`` the first B slots of that pool in order (the indirection alone); ``half padding`` the random pool with
every other row a padding row; ``gating`` the pool with ``A_log``/``dt_bias``/``use_beta_sigmoid``; and ``copy through
the pool``, an in-place copy of the same slots' states (the state bytes of the pooled step, in the same order): what a
plain kernel reaches through that access pattern; ``copy, slots in order`` and ``copy, dense slots`` the same kernel
over the in-order slots and over the dense states. Forward passes likewise (dense, pool, pool + gating), ``ragged``:
the same tokens packed as B sequences of T with ``cu_seqlens``, which the rules give the dense call's kernel (they
choose a ragged batch's by its mean length); each forward row names the variant it ran. Speculative verify writing
every token's state, in both conventions, beside a copy of one state read and T writes through the same slots (on
compute capability 9.0 also with the writes as bulk copies from shared memory) and ``writes alone``, a fill of the
intermediate_states buffer (the T states' bytes written, nothing read) (with ``--verify-tilings`` also the
intermediate_states call on every token-loop tiling, ``verify tiling <variant>``). ``of copy`` is the bytes each call
must move (states read and written, activations, o) over its time, as a fraction of the device copy measured first.
"""

import argparse
import json

import cupy
import numpy

from cupy_comba import _plan, bfloat16, comba_decode_step, comba_forward, families
from cupy_comba.bench import environment, measure_copy, parse_shapes, time_graph


#: Each CTA copies 4096 floats of one batch row's pool slot onto themselves: 4 float4 a thread, every
#: load before any store, plain accesses (as the decode kernels' state).
_POOL_COPY = r"""
extern "C" __global__ void pool_copy(float* pool, const int* slots, long long row_floats) {
    float4* at = reinterpret_cast<float4*>(pool + slots[blockIdx.y] * row_floats + blockIdx.x * 4096LL) + threadIdx.x;
    float4 x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = at[i * 256];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(at + i * 256), "f"(x[i].x), "f"(x[i].y),
                     "f"(x[i].z), "f"(x[i].w));
}
"""


#: The verify pass's state traffic alone: each CTA reads 4096 floats of row b's slot once and writes them to
#: the T slots ``outs[b]`` names (one state read, T state writes), the writes of one token after another.
_FAN_COPY = r"""
extern "C" __global__ void fan_copy(float* pool, const int* first, const int* outs, int T, long long row_floats) {
    const long long at = blockIdx.x * 4096LL + 4 * threadIdx.x;
    const float4* src = reinterpret_cast<const float4*>(pool + first[blockIdx.y] * row_floats + at);
    float4 x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = src[i * 256];
    for (int t = 0; t < T; ++t) {
        float4* dst = reinterpret_cast<float4*>(pool + outs[blockIdx.y * T + t] * row_floats + at);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(dst + i * 256), "f"(x[i].x),
                         "f"(x[i].y), "f"(x[i].z), "f"(x[i].w));
    }
}
"""


#: The same traffic with the writes as bulk copies: each CTA stages its 16 KB of row b's slot in shared memory and one
#: thread stores it to each of the T slots by ``cp.async.bulk`` (compute capability 9.0): the writes leave from shared
#: memory by the copy engine of the SM, not from registers by the threads.
_FAN_BULK = r"""
extern "C" __global__ void fan_bulk(float* pool, const int* first, const int* outs, int T, long long row_floats) {
    __shared__ __align__(128) float4 buf[1024];
    const long long at = blockIdx.x * 4096LL;
    const float4* src = reinterpret_cast<const float4*>(pool + first[blockIdx.y] * row_floats + at);
#pragma unroll
    for (int i = 0; i < 4; ++i) buf[threadIdx.x + i * 256] = src[threadIdx.x + i * 256];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned from = static_cast<unsigned>(__cvta_generic_to_shared(buf));
        for (int t = 0; t < T; ++t)
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 16384;"
                         :: "l"(pool + outs[blockIdx.y * T + t] * row_floats + at), "r"(from) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the buffer outlives its reads
    }
    __syncthreads();
}
"""


def _fan_copy(pool, first, outs, source=_FAN_COPY, name="fan_copy"):
    """A call that copies slot ``first[b]`` of the pool into the slots ``outs[b, :]`` for every row b."""
    kernel = cupy.RawKernel(source, name)
    row = pool[0].size
    assert row % 4096 == 0, "the fan-out copy takes a multiple of 4096 floats a slot"
    B, T = outs.shape
    return lambda: kernel((row // 4096, B), (256,), (pool, first, outs, numpy.int32(T), numpy.int64(row)))


def _pool_copy(pool, slots):
    """A call that copies the pool slots `slots` name onto themselves."""
    kernel = cupy.RawKernel(_POOL_COPY, "pool_copy")
    row = pool[0].size
    assert row % 4096 == 0, "the pooled copy takes a multiple of 4096 floats a slot"
    return lambda: kernel((row // 4096, slots.size), (256,), (pool, slots, numpy.int64(row)))


def _acts(rng, lead, H, K, V):
    q, k, p = (rng.standard_normal(lead + (H, K), dtype=cupy.float32).astype(bfloat16) / 8 for _ in range(3))
    v = rng.standard_normal(lead + (H, V), dtype=cupy.float32).astype(bfloat16)
    beta = rng.random(lead + (H,), dtype=cupy.float32).astype(bfloat16)
    g = (-rng.random(lead + (H,), dtype=cupy.float32) / 4).astype(bfloat16)
    return q, k, v, p, beta, g


def _row(kind, layout, shape, t, nbytes, copy_gbps, **extra):
    frac = nbytes / t.median_us / 1e3 / copy_gbps
    print(f"{kind:<28} {layout} {str(shape):<26} {t.median_us:9.1f} us  [{t.min_us:.1f}, {t.max_us:.1f}]  "
          f"{frac:.3f} of copy", flush=True)
    return dict(kind=kind, layout=layout, shape=list(shape), median_us=round(t.median_us, 2),
                min_us=round(t.min_us, 2), max_us=round(t.max_us, 2), bytes=nbytes, of_copy=round(frac, 4), **extra)


def decode(shape, layout, copy_gbps):
    B, H, K, V = shape
    rng = cupy.random.default_rng(0)
    q, k, v, p, beta, g = _acts(rng, (B,), H, K, V)
    sshape = (H, K, V) if layout == "kv" else (H, V, K)
    state = (rng.standard_normal((B,) + sshape, dtype=cupy.float32) / 8)
    pool = (rng.standard_normal((2 * B,) + sshape, dtype=cupy.float32) / 8)
    slots = cupy.asarray(numpy.random.default_rng(1).permutation(2 * B)[:B].astype(numpy.int32))
    in_order = cupy.arange(B, dtype=cupy.int32)  # slots 0 .. B - 1 of the same pool: the indirection alone
    half = slots.copy()
    half[1::2] = -1
    gates = dict(A_log=cupy.zeros(H, cupy.float32), dt_bias=cupy.ones(H, cupy.float32), use_beta_sigmoid=True)
    out = cupy.empty((B, H, V), bfloat16)
    act = sum(a.nbytes for a in (q, k, v, p, beta, g)) + out.nbytes
    per_row = 2 * state.nbytes // B
    opts = dict(out=out, state_layout=layout)
    cases = [
        ("decode dense", lambda: comba_decode_step(state, q, k, v, p, beta, g, state_out=state, **opts), B),
        ("decode pool", lambda: comba_decode_step(pool, q, k, v, p, beta, g, state_indices=slots, **opts), B),
        ("decode pool, slots in order",
         lambda: comba_decode_step(pool, q, k, v, p, beta, g, state_indices=in_order, **opts), B),
        ("decode pool, half padding",
         lambda: comba_decode_step(pool, q, k, v, p, beta, g, state_indices=half, **opts), (B + 1) // 2),
        ("decode pool + gating",
         lambda: comba_decode_step(pool, q, k, v, p, beta, g, state_indices=slots, **opts, **gates), B),
    ]
    rows = [_row(kind, layout, shape, time_graph(fn), rows * per_row + act, copy_gbps) for kind, fn, rows in cases]
    return rows + [_row(kind, layout, shape, time_graph(_pool_copy(where, idx)), B * per_row, copy_gbps)
                   for kind, where, idx in (("copy through the pool", pool, slots),
                                            ("copy, slots in order", pool, in_order),
                                            ("copy, dense slots", state, in_order))]


def forward(shape, layout, copy_gbps):
    B, T, H, K, V = shape
    rng = cupy.random.default_rng(0)
    q, k, v, p, beta, g = _acts(rng, (B, T), H, K, V)
    sshape = (H, K, V) if layout == "kv" else (H, V, K)
    state = (rng.standard_normal((B,) + sshape, dtype=cupy.float32) / 8)
    pool = (rng.standard_normal((2 * B,) + sshape, dtype=cupy.float32) / 8)
    slots = cupy.asarray(numpy.random.default_rng(1).permutation(2 * B)[:B].astype(numpy.int32))
    gates = dict(A_log=cupy.zeros(H, cupy.float32), dt_bias=cupy.ones(H, cupy.float32), use_beta_sigmoid=True)
    out = cupy.empty((B, T, H, V), bfloat16)
    nbytes = sum(a.nbytes for a in (q, k, v, p, beta, g)) + out.nbytes + 2 * state.nbytes
    opts = dict(out=out, state_layout=layout)
    packed = [a.reshape((1, B * T) + a.shape[2:]) for a in (q, k, v, p, beta, g, out)]
    cu = cupy.arange(0, B * T + 1, T, dtype=cupy.int32)
    cases = [
        ("forward dense", lambda: comba_forward(q, k, v, p, beta, g, initial_state=state, state_out=state, **opts)),
        ("forward pool", lambda: comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=slots, **opts)),
        ("forward pool + gating", lambda: comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=slots,
                                                        **opts, **gates)),
        ("forward ragged", lambda: comba_forward(*packed[:6], initial_state=state, state_out=state, cu_seqlens=cu,
                                                 out=packed[6], state_layout=layout)),
    ]
    return [_row(kind, layout, shape, time_graph(fn), nbytes, copy_gbps, variant=_variant(fn))
            for kind, fn in cases]


def _variant(fn):
    """The variant the plan of ``fn``'s call runs (the call made once more, from a fresh plan)."""
    _plan.PLANS.clear()
    fn()
    (plan,) = _plan.PLANS.values()
    return plan.variant


def verify(shape, layout, copy_gbps, tilings=False):
    """Speculative verify writing every token's state: SGLang's intermediate_states and vLLM's slot per
    token; the bytes are one state read, T state writes, the activations and o.  ``copy, one read T
    writes``: the same state traffic through the same slots with nothing computed (its fraction
    counts its state bytes only); ``writes alone``: the T states' bytes written in one contiguous
    fill, nothing read."""
    B, T, H, K, V = shape
    rng = cupy.random.default_rng(0)
    q, k, v, p, beta, g = _acts(rng, (B, T), H, K, V)
    sshape = (H, K, V) if layout == "kv" else (H, V, K)
    pool = rng.standard_normal((B * (T + 1),) + sshape, dtype=cupy.float32) / 8
    perm = numpy.random.default_rng(1).permutation(B * (T + 1))
    first = cupy.asarray(perm[:B].astype(numpy.int32))
    per_token = cupy.asarray(perm[B:B * (T + 1)].reshape(B, T).astype(numpy.int32))
    accepted = cupy.ones(B, cupy.int32)
    inter = cupy.empty((B, T) + sshape, cupy.float32)
    out = cupy.empty((B, T, H, V), bfloat16)
    head = 4 * H * K * V
    nbytes = sum(a.nbytes for a in (q, k, v, p, beta, g)) + out.nbytes + (1 + T) * B * head
    opts = dict(out=out, state_layout=layout)

    def intermediate(variant=None):  # SGLang's convention, on the chosen tiling or a named one
        return lambda: comba_forward(q, k, v, p, beta, g, initial_state=pool, state_indices=first,
                                     intermediate_states=inter, output_final_state=False, variant=variant, **opts)
    cases = [
        ("verify intermediate_states", intermediate()),
        ("verify slot per token", lambda: comba_forward(q, k, v, p, beta, g, initial_state=pool,
                                                        state_indices=per_token, num_accepted_tokens=accepted,
                                                        **opts)),
    ]
    rows = [_row(kind, layout, shape, time_graph(fn), nbytes, copy_gbps) for kind, fn in cases]
    for variant in families.variants(layout, K, V, multi=True, token_loop=True) if tilings else ():
        rows.append(_row(f"verify tiling {variant}", layout, shape, time_graph(intermediate(variant)), nbytes,
                         copy_gbps))
    fans = [("copy, one read T writes", _fan_copy(pool, first, per_token))]
    if families.runs_wgmma(cupy.cuda.Device().compute_capability):
        fans.append(("copy, one read T bulk writes", _fan_copy(pool, first, per_token, _FAN_BULK, "fan_bulk")))
    rows += [_row(kind, layout, shape, time_graph(fan), (1 + T) * B * head, copy_gbps) for kind, fan in fans]
    return rows + [_row("writes alone", layout, shape, time_graph(lambda: inter.fill(0)), T * B * head, copy_gbps)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", nargs="*", default=["measure", "64,16,128,128"])
    ap.add_argument("--forward", nargs="*", default=["512,4,16,128,128", "512,16,16,128,128", "1,4096,16,128,128"])
    ap.add_argument("--verify", nargs="*", default=["512,4,16,128,128", "128,16,16,128,128"])
    ap.add_argument("--verify-tilings", action="store_true", help="the verify call on every token-loop tiling too")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for layout in ("kv", "vk"):
        for shape in parse_shapes(args.decode):
            rows += decode(shape, layout, roof.copy_gbps)
        for shape in parse_shapes(args.forward, dims=("B", "T", "H", "K", "V")):
            rows += forward(shape, layout, roof.copy_gbps)
        for shape in parse_shapes(args.verify, dims=("B", "T", "H", "K", "V")):
            rows += verify(shape, layout, roof.copy_gbps, args.verify_tilings)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment(), copy_gbps=roof.copy_gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
