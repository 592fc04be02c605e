"""The serving options on every kernel path (``pytest -m gpu``): state pools with padding rows and
hostile indices, in-kernel gating, a pooled decode loop captured in a CUDA graph."""

import numpy
import pytest

from cupy_comba import (
    bfloat16, comba_decode_step, comba_forward, families, gated_delta_decode_step, gated_delta_forward, reference,
)
from cupy_comba.inputs import forward_inputs

from gpu_variants import exact as _exact, runnable
from test_serving_cpu import gating_inputs

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

F32 = numpy.dtype(numpy.float32)


def _op(step, comba, state, q, k, v, p, beta, g, **opts):
    if step:
        return comba_decode_step(state, q, k, v, p, beta, g, **opts) if comba else \
            gated_delta_decode_step(state, q, k, v, beta, g, **opts)
    o, S = comba_forward(q, k, v, p, beta, g, initial_state=state, **opts) if comba else \
        gated_delta_forward(q, k, v, beta, g, initial_state=state, **opts)
    return S, o


def _case(step, layout, K, V, T, seed, B=6, N=11, H=4, Hk=2):
    """Host arrays: activations (bf16), a pool of N states and the raw gate inputs."""
    rng = numpy.random.default_rng(seed)
    q, k, v, p, _, _, _ = forward_inputs(B, T, H, K, V, Hk=Hk, warm_steps=0, seed=seed)
    if step:
        q, k, v, p = (x[:, 0] for x in (q, k, v, p))
    a, b, A_log, dt_bias = gating_inputs(rng, (B,) if step else (B, T), H)
    shape = (N, H, K, V) if layout == "kv" else (N, H, V, K)
    pool = (rng.standard_normal(shape) / 4).astype(F32)
    return pool, q, k, v, p, b, a, A_log, dt_bias


def _variants(step, layout, K, V):
    return runnable(layout, K, V, multi=not step, exact=True)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("step,T", [(True, 1), (False, 5), (False, 19)], ids=["decode", "T5", "T19"])
def test_every_kernel_path_through_a_pool_with_gating(layout, K, V, comba, step, T):
    """Pool slots in random order, padding rows (negative and >= N), A_log / dt_bias and the beta sigmoid, on
    every variant: the reference's values, untouched slots bit-identical, padding rows' o zeros."""
    pool, q, k, v, p, b, a, A_log, dt_bias = _case(step, layout, K, V, T, seed=K + T)
    idx = numpy.array([8, -1, 2, 10, 11, 0], numpy.int64)  # rows 1 and 4 are padding (N = 11)
    live, pad = [0, 2, 3, 5], [1, 4]
    opts = dict(state_layout=layout, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid=True)
    S_ref, o_ref = _op(step, comba, pool.copy(), q, k, v, p, b, a, state_indices=idx, **opts)  # NumPy: reference
    dev = [cupy.asarray(x) for x in (q, k, v, p, b, a)]
    gates = dict(A_log=cupy.asarray(A_log), dt_bias=cupy.asarray(dt_bias))
    for variant in _variants(step, layout, K, V):
        d_pool = cupy.asarray(pool)
        out = cupy.full(o_ref.shape, cupy.nan, bfloat16)
        for idx_dtype in (numpy.int64, numpy.int32):
            d_pool[...] = cupy.asarray(pool)
            out.fill(cupy.nan)
            S, o = _op(step, comba, d_pool, *dev, state_indices=cupy.asarray(idx, idx_dtype), out=out, variant=variant,
                       **{**opts, **gates}, **({} if step else _exact(variant)))
            assert S is d_pool and o is out
            S, o = cupy.asnumpy(S), cupy.asnumpy(o)
            slots = idx[live]
            assert reference.relative_error(S[slots], S_ref[slots]) < 2e-6, variant
            assert reference.relative_error(o[live], o_ref[live]) < 5e-3, variant
            assert not o[pad].astype(F32).any(), variant
            untouched = numpy.setdiff1d(numpy.arange(pool.shape[0]), slots)
            numpy.testing.assert_array_equal(S[untouched], pool[untouched])


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("step,T", [(True, 1), (False, 16)], ids=["decode", "T16"])
def test_an_identity_pool_runs_the_dense_kernel_s_math(layout, step, T):
    """The serving build with every row at its own slot equals the dense build bit for bit."""
    pool, q, k, v, p, b, a, _, _ = _case(step, layout, 128, 128, T, seed=3, N=6)
    dev = [cupy.asarray(x) for x in (q, k, v, p, b, a)]
    dense = _op(step, True, cupy.asarray(pool), *dev, state_layout=layout)
    pooled = _op(step, True, cupy.asarray(pool), *dev, state_layout=layout,
                 state_indices=cupy.arange(6, dtype=cupy.int32))
    cupy.testing.assert_array_equal(dense[0], pooled[0])
    cupy.testing.assert_array_equal(dense[1], pooled[1])


@pytest.mark.parametrize("step", [True, False], ids=["decode", "forward"])
def test_hostile_indices_touch_nothing_outside_the_pool(step):
    """int64 extremes, negatives, indices >= N: padding rows; a slot named twice is left undefined (the rows
    race) but nothing outside the pool is touched (the suite's compute-sanitizer run checks the accesses)."""
    pool, q, k, v, p, b, a, _, _ = _case(step, "kv", 128, 128, 1 if step else 9, seed=4, B=7, N=5)
    idx = numpy.array([2 ** 62, -2 ** 63, 5, 1, -1, 1, 2 ** 31], numpy.int64)
    dev = [cupy.asarray(x) for x in (q, k, v, p, b, a)]
    d_pool = cupy.asarray(pool)
    S, o = _op(step, True, d_pool, *dev, state_indices=cupy.asarray(idx))
    o = cupy.asnumpy(o).astype(F32)
    assert not o[[0, 1, 2, 4, 6]].any() and numpy.isfinite(o).all()
    S = cupy.asnumpy(S)
    numpy.testing.assert_array_equal(S[[0, 2, 3, 4]], pool[[0, 2, 3, 4]])
    assert numpy.isfinite(S[1]).all()
    with pytest.raises(TypeError, match="state_indices must be int32 or int64"):
        _op(step, True, d_pool, *dev, state_indices=cupy.zeros(7, cupy.uint32))


def test_a_pooled_decode_loop_replays_in_a_cuda_graph():
    """Captured once with device-resident indices; replayed after writing new ones into the same buffer."""
    pool, q, k, v, p, b, a, A_log, dt_bias = _case(True, "vk", 128, 128, 1, seed=9, B=4, N=8)
    d = [cupy.asarray(x) for x in (q, k, v, p, b, a)]
    d_pool, idx, out = cupy.asarray(pool), cupy.asarray([3, 1, 6, -1], cupy.int32), cupy.empty((4, 4, 128), bfloat16)
    gates = dict(A_log=cupy.asarray(A_log), dt_bias=cupy.asarray(dt_bias), use_beta_sigmoid=True)
    call = dict(state_indices=idx, out=out, state_layout="vk", **gates)
    stream = cupy.cuda.Stream(non_blocking=True)
    expected = pool.copy()
    with stream:  # every write to the buffers on the replaying stream, ordered before each replay
        comba_decode_step(d_pool, *d, **call)  # plan and build outside the capture
        d_pool[...] = cupy.asarray(pool)
        stream.begin_capture()
        comba_decode_step(d_pool, *d, **call)
        graph = stream.end_capture()
        for slots in ([3, 1, 6, -1], [0, 7, -5, 2]):
            idx[...] = cupy.asarray(slots, cupy.int32)
            graph.launch(stream)
            stream.synchronize()
            S_ref, o_ref = comba_decode_step(expected, q, k, v, p, b, a, state_indices=numpy.array(slots),
                                             state_layout="vk", A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid=True)
            assert reference.relative_error(cupy.asnumpy(d_pool), expected) < 2e-6
            assert reference.relative_error(cupy.asnumpy(out), o_ref) < 5e-3


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("pool", [False, True], ids=["states", "pool"])
def test_every_kernel_path_runs_a_ragged_batch(layout, K, V, comba, pool):
    """Sequences of 0 to 37 tokens packed in one row, on every variant: equal to the reference (NumPy path),
    which runs them one by one; with a pool, gating and a padding sequence too."""
    lengths = [5, 0, 37, 1, 16, 9]
    N, H = len(lengths), 4
    rng = numpy.random.default_rng(K + V)
    q, k, v, p, _, _, _ = forward_inputs(1, sum(lengths), H, K, V, Hk=2, warm_steps=0, seed=K)
    a, b, A_log, dt_bias = gating_inputs(rng, (1, sum(lengths)), H)
    shape = (H, K, V) if layout == "kv" else (H, V, K)
    cu = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
    opts = dict(state_layout=layout, cu_seqlens=cu)
    if pool:
        S0 = (rng.standard_normal((N + 3,) + shape) / 4).astype(F32)
        opts.update(state_indices=numpy.array([7, 2, -1, 0, 8, 4], numpy.int64), A_log=A_log, dt_bias=dt_bias,
                    use_beta_sigmoid=True)
    else:
        S0 = (rng.standard_normal((N,) + shape) / 4).astype(F32)
    S_ref, o_ref = _op(False, comba, S0.copy(), q, k, v, p, b, a, **opts)
    dev = [cupy.asarray(x) for x in (q, k, v, p, b, a)]
    d_opts = {n: cupy.asarray(x) if isinstance(x, numpy.ndarray) else x for n, x in opts.items()}
    for variant in _variants(False, layout, K, V):
        d_S0 = cupy.asarray(S0)
        out = cupy.full(o_ref.shape, cupy.nan, bfloat16)
        if pool:
            S, o = _op(False, comba, d_S0, *dev, out=out, variant=variant, **d_opts, **_exact(variant))
        else:
            S, o = _op(False, comba, d_S0, *dev, out=out, state_out=cupy.full(S0.shape, cupy.nan, F32),
                       variant=variant, **d_opts, **_exact(variant))
        assert o is out
        assert reference.relative_error(S, S_ref) < 2e-6, variant
        assert reference.relative_error(o, o_ref) < 5e-3, variant
        if pool:
            assert not cupy.asnumpy(o)[:, 5:42].astype(F32).any(), variant  # sequence 2 (tokens 5 .. 41) is padding


def test_a_ragged_prefill_replays_in_a_cuda_graph_with_new_lengths():
    """cu_seqlens stays on the device: a captured call follows new lengths written into the same buffer."""
    H, K, V, total = 4, 128, 128, 48
    q, k, v, p, beta, g, _ = forward_inputs(1, total, H, K, V, warm_steps=0, seed=2)
    S0 = (numpy.random.default_rng(3).standard_normal((3, H, K, V)) / 4).astype(F32)
    d = [cupy.asarray(x) for x in (q, k, v, p, beta, g)]
    d_S0, cu = cupy.asarray(S0), cupy.asarray([0, 10, 30, 48], cupy.int64)
    out, S = cupy.empty((1, total, H, V), bfloat16), cupy.empty_like(d_S0)
    call = dict(initial_state=d_S0, cu_seqlens=cu, out=out, state_out=S)
    comba_forward(*d, **call)
    cupy.cuda.Device().synchronize()  # that call done: a non-blocking stream does not wait for the null stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the new lengths written on the replaying stream, ordered before each replay
        stream.begin_capture()
        comba_forward(*d, **call)
        graph = stream.end_capture()
        for bounds in ([0, 10, 30, 48], [0, 1, 2, 48], [0, 48, 48, 48]):
            cu[...] = cupy.asarray(bounds, cupy.int64)
            graph.launch(stream)
            stream.synchronize()
            o_ref, S_ref = comba_forward(q, k, v, p, beta, g, initial_state=S0, cu_seqlens=numpy.array(bounds))
            assert reference.relative_error(cupy.asnumpy(S), S_ref) < 2e-6
            assert reference.relative_error(cupy.asnumpy(out), o_ref) < 5e-3


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
@pytest.mark.parametrize("comba", [True, False], ids=["comba", "gdn"])
@pytest.mark.parametrize("T", [4, 16])
def test_every_token_loop_variant_keeps_every_token_s_state(layout, K, V, comba, T):
    """Both verify conventions on every token-loop variant: SGLang's intermediate_states (a pool with a
    padding row, output_final_state False: the pool untouched) and vLLM's slot per token with accepted
    counts (a count of 0 a padding row, a slot of -1 a token whose state is not kept)."""
    B, H, N = 4, 4, 3 * 4 * T
    rng = numpy.random.default_rng(K + T)
    q, k, v, p, beta, g, _ = forward_inputs(B, T, H, K, V, Hk=2, warm_steps=0, seed=T)
    shape = (H, K, V) if layout == "kv" else (H, V, K)
    pool = (rng.standard_normal((N,) + shape) / 4).astype(F32)
    idx1 = numpy.array([5, -1, 0, 9], numpy.int32)
    idx2 = rng.permutation(N)[:B * T].reshape(B, T).astype(numpy.int64)
    idx2[0, T - 1] = -1
    accepted = numpy.array([1, T, 0, 2], numpy.int32)
    inter_ref = numpy.full((B, T) + shape, 3.0, F32)
    o1_ref, _ = _op(False, comba, pool.copy(), q, k, v, p, beta, g, state_layout=layout, state_indices=idx1,
                    intermediate_states=inter_ref, output_final_state=False)[::-1]
    pool2_ref, o2_ref = _op(False, comba, pool.copy(), q, k, v, p, beta, g, state_layout=layout, state_indices=idx2,
                            num_accepted_tokens=accepted)
    dev = [cupy.asarray(x) for x in (q, k, v, p, beta, g)]
    for variant in families.variants(layout, K, V, multi=True, token_loop=True):
        d_pool, inter = cupy.asarray(pool), cupy.full(inter_ref.shape, 3.0, F32)
        out = cupy.full(o1_ref.shape, cupy.nan, bfloat16)
        _op(False, comba, d_pool, *dev, state_layout=layout, state_indices=cupy.asarray(idx1),
            intermediate_states=inter, output_final_state=False, out=out, variant=variant)
        cupy.testing.assert_array_equal(d_pool, cupy.asarray(pool))
        assert reference.relative_error(inter[[0, 2, 3]], inter_ref[[0, 2, 3]]) < 2e-6, variant
        assert bool((inter[1] == 3.0).all()) and reference.relative_error(out, o1_ref) < 5e-3, variant
        out.fill(cupy.nan)
        S, o = _op(False, comba, d_pool, *dev, state_layout=layout, state_indices=cupy.asarray(idx2),
                   num_accepted_tokens=cupy.asarray(accepted), out=out, variant=variant)
        assert S is d_pool
        assert reference.relative_error(S, pool2_ref) < 2e-6, variant
        assert reference.relative_error(o, o2_ref) < 5e-3, variant
