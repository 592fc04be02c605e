"""comba_decode_step's CUDA kernel against the float64 reference (run on the GPU: ``pytest -m gpu``)."""

import itertools

import numpy
import pytest

from cupy_comba import bfloat16, comba_decode_step, families, gated_delta_decode_step, reference
from cupy_comba.inputs import decode_inputs, decode_token
from cupy_comba._launcher import graph_launches

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

F16, F32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
O_TOL = {bfloat16: 4e-3, F16: 1e-3, F32: 1e-6}
STATE_TOL = 1e-6


def _gpu_inputs(B, H, K, V, seed=0, **kw):
    return list(decode_inputs(B, H, K, V, xp=cupy, seed=seed, **kw))


KV_VARIANTS = tuple(f"kv{c}x{r}" for c, r in families.KV_TILINGS) + tuple(f"kv{c}w" for c in families.KV_WARP_COLS[128])


def _decode_step(state, q, k, v, p, beta, g, scale, out, state_out, o_dtype, variant, layout="kv", comba=True):
    """The op with the tiling forced (None: the op's choice)."""
    opts = dict(out=out, state_out=state_out, o_dtype=o_dtype, state_layout=layout, variant=variant)
    if comba:
        return comba_decode_step(state, q, k, v, p, beta, g, scale, **opts)
    return gated_delta_decode_step(state, q, k, v, beta, g, scale, **opts)


def _run_poisoned(args, variant=None, o_dtype=None, **kw):
    B, H, K, V = args[0].shape
    o_dtype = numpy.dtype(o_dtype or args[3].dtype)
    state_out = cupy.full((B, H, K, V), cupy.nan, F32)
    out = cupy.full((B, H, V), cupy.nan, o_dtype)
    S, o = _decode_step(*args, kw.pop("scale", None), out, state_out, None, variant)
    assert S is state_out and o is out
    return S, o


def _errors(args, S, o, scale=None):
    S_ref, o_ref = reference.comba_step(*args, scale=scale)
    return reference.relative_error(S, S_ref), reference.relative_error(o, o_ref)


SMALL = [(8, 4, 128, 128), (16, 2, 64, 128), (4, 8, 128, 64), (32, 4, 64, 64)]
ODD = [(1, 1, 128, 128), (1, 1, 64, 32), (3, 5, 64, 96), (2, 3, 128, 256), (5, 2, 128, 96), (2, 2, 64, 512),
       (257, 3, 64, 32)]
# Large grids: many CTAs per SM, several waves.
LARGE = [(600, 4, 128, 128), (257, 9, 64, 96), (100, 11, 64, 256), (301, 7, 128, 32)]


@pytest.mark.parametrize("shape", SMALL + ODD + LARGE, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", (None,) + KV_VARIANTS, ids=lambda v: v or "auto")
@pytest.mark.parametrize("dtype", [bfloat16, F16, F32], ids=lambda d: numpy.dtype(d).name)
def test_matches_reference(shape, variant, dtype):
    args = _gpu_inputs(*shape, dtype=dtype, seed=sum(shape))
    if variant is not None and variant not in families.variants("kv", shape[2], shape[3]):
        with pytest.raises(ValueError, match="cannot run"):
            _run_poisoned(args, variant)
        return
    S, o = _run_poisoned(args, variant)
    err_s, err_o = _errors(args, S, o)
    assert err_s <= STATE_TOL
    assert err_o <= O_TOL[numpy.dtype(dtype)]


@pytest.mark.parametrize("H,Hk", [(8, 2), (16, 4), (6, 1)])
@pytest.mark.parametrize("variant", families.variants("kv", 128, 64))
def test_grouped_value_heads(H, Hk, variant):
    args = _gpu_inputs(300, H, 128, 64, Hk=Hk, seed=H)
    S, o = _run_poisoned(args, variant)
    err_s, err_o = _errors(args, S, o)
    assert err_s <= STATE_TOL and err_o <= O_TOL[bfloat16]


def test_every_dtype_combination():
    """q, k, v, p, beta each in {bf16, fp16, fp32}, g in {fp32, bf16, fp16}, o in all three."""
    base = _gpu_inputs(2, 2, 64, 64, dtype=F32, seed=11)
    dts = (bfloat16, F16, F32)
    for combo in itertools.product(dts, repeat=6):
        args = [base[0]] + [a.astype(dt) for a, dt in zip(base[1:], combo)]
        for o_dtype in dts:
            S, o = _run_poisoned(args, o_dtype=o_dtype)
            err_s, err_o = _errors(args, S, o)
            assert err_s <= STATE_TOL, (combo, o_dtype)
            assert err_o <= O_TOL[numpy.dtype(o_dtype)], (combo, o_dtype)


def test_float32_output_on_request():
    args = _gpu_inputs(8, 4, 128, 128, seed=2)
    S, o = comba_decode_step(*args, o_dtype=numpy.float32)
    assert o.dtype == F32
    assert _errors(args, S, o)[1] <= 1e-6


def test_scale():
    args = _gpu_inputs(8, 4, 128, 128, seed=3, dtype=F32)
    S, o = _run_poisoned(args, scale=0.3)
    assert _errors(args, S, o, scale=0.3)[1] <= 1e-6


def test_inputs_unchanged_and_new_outputs():
    args = _gpu_inputs(8, 4, 128, 128, seed=4)
    before = [a.copy() for a in args]
    S, o = comba_decode_step(*args)
    assert S.data.ptr != args[0].data.ptr
    for a, b in zip(args, before):
        assert bool(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8)))


@pytest.mark.parametrize("shape", [(16, 4, 128, 128), (700, 4, 128, 128)], ids=["small", "large"])
def test_in_place_update(shape):
    args = _gpu_inputs(*shape, seed=5)
    S_ref, o_ref = reference.comba_step(*args)
    S_func, o_func = comba_decode_step(*args)
    state = args[0]
    S, o = comba_decode_step(*args, state_out=state)
    assert S is state
    assert bool(cupy.array_equal(S, S_func)) and bool(cupy.array_equal(o.view(cupy.uint16), o_func.view(cupy.uint16)))
    assert reference.relative_error(S, S_ref) <= STATE_TOL


@pytest.mark.parametrize("B", [6, 600])
def test_strided_activations(B):
    """q, k, p, v sliced out of one packed projection; beta, g columns of a wider array; o strided."""
    H, K, V = 4, 128, 64
    args = _gpu_inputs(B, H, K, V, seed=6)
    state, q, k, v, p, beta, g = args
    packed = cupy.full((B, H, 3 * K + V + 8), cupy.nan, bfloat16)
    packed[..., :K], packed[..., K:2 * K], packed[..., 2 * K:3 * K] = q, k, p
    packed[..., 3 * K:3 * K + V] = v
    gates = cupy.full((B, 3, H), cupy.nan, F32)
    gates[:, 0], gates[:, 2] = beta.astype(F32), g
    wide_out = cupy.full((B, H, 2 * V), cupy.nan, bfloat16)
    q_s, k_s, p_s, v_s = packed[..., :K], packed[..., K:2 * K], packed[..., 2 * K:3 * K], packed[..., 3 * K:3 * K + V]
    S, o = comba_decode_step(state, q_s, k_s, v_s, p_s, gates[:, 0], gates[:, 2], out=wide_out[..., ::2])
    err_s, err_o = _errors([state, q, k, v, p, gates[:, 0], g], S, o)
    assert err_s <= STATE_TOL and err_o <= O_TOL[bfloat16]
    assert bool(cupy.isnan(wide_out[..., 1::2].astype(F32)).all())  # untouched gaps
    # head-major activations (transposed batch/head axes) and reversed K
    qt = cupy.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)
    kr = cupy.ascontiguousarray(k[..., ::-1])[..., ::-1]
    S2, o2 = comba_decode_step(state, qt, kr, v, p, beta, g)
    assert bool(cupy.array_equal(S2, S))


def test_decode_loop_does_not_drift():
    """1000 steps fed back into themselves stay within 1e-5 of a float64 loop on the same tokens."""
    B, H, K, V = 4, 4, 128, 128
    state = decode_inputs(B, H, K, V, xp=cupy, seed=8)[0]
    S64 = state.astype(cupy.float64)
    crng = cupy.random.default_rng(9)
    S = state
    for _ in range(1000):
        tok = [a.astype(bfloat16) for a in decode_token(cupy, crng, B, H, K, V)]
        tok[5] = tok[5].astype(F32)
        S, o = comba_decode_step(S, *tok, state_out=S)
        S64, o64 = reference.comba_step(S64, *tok)
    assert reference.relative_error(S, S64) <= 1e-5
    assert reference.relative_error(o, o64) <= O_TOL[bfloat16]


def test_runs_on_current_stream_and_in_a_cuda_graph():
    args = _gpu_inputs(8, 4, 128, 128, seed=10)
    state_out = cupy.full(args[0].shape, cupy.nan, F32)
    out = cupy.full((8, 4, 128), cupy.nan, bfloat16)
    cupy.cuda.Device().synchronize()  # the inputs and the poison done: a non-blocking stream does not wait for them
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        comba_decode_step(*args, out=out, state_out=state_out)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    err_s, err_o = _errors(args, state_out, out)
    assert err_s <= STATE_TOL and err_o <= O_TOL[bfloat16]


def _launcher_of(args):
    """The Launcher of the plan a decode call with these arrays (and given outputs) runs."""
    from cupy_comba._plan import PLANS
    return next(plan.launcher for plan in PLANS.values()
                if plan.signature.arrays["q"].shape == args[1].shape
                and plan.signature.arrays["state"].shape == args[0].shape and plan.signature.arrays["out"] is not None)


@pytest.mark.parametrize("stream_kind", ["null", "non-blocking"])
def test_repeated_calls_through_the_graph_launch(stream_kind):
    """A decode loop as engines run it: the state ping-pongs between two buffers, the outputs
    between two, fresh activations every token.  From the second launch on a stream the op replays
    a one-node graph whose kernel node takes the new pointers; every step must match the reference."""
    B, H, K, V = 5, 3, 128, 96
    crng = cupy.random.default_rng(21)
    state = decode_inputs(B, H, K, V, xp=cupy, seed=21)[0]
    buffers = [cupy.full(state.shape, cupy.nan, F32) for _ in range(2)]
    outs = [cupy.full((B, H, V), cupy.nan, bfloat16) for _ in range(2)]
    stream = cupy.cuda.Stream.null if stream_kind == "null" else cupy.cuda.Stream(non_blocking=True)
    S = state
    with stream:
        for t in range(6):
            tok = [a.astype(bfloat16) for a in decode_token(cupy, crng, B, H, K, V)]
            tok[5] = tok[5].astype(F32)
            S_ref, o_ref = reference.comba_step(S, *tok)
            S_new, o = comba_decode_step(S, *tok, out=outs[t % 2], state_out=buffers[t % 2])
            assert S_new is buffers[t % 2] and o is outs[t % 2]
            assert reference.relative_error(S_new, S_ref) <= STATE_TOL, t
            assert reference.relative_error(o, o_ref) <= O_TOL[bfloat16], t
            outs[(t + 1) % 2].fill(cupy.nan)  # the next step's outputs poisoned again
            if t:
                buffers[(t + 1) % 2].fill(cupy.nan)
            S = S_new
    launcher = _launcher_of([S] + tok)
    if graph_launches():
        assert launcher._graphs.get(stream.ptr) is not None  # the loop did replay a graph


def test_a_callers_capture_after_graph_launches_on_the_same_stream():
    """Once the op replays its own graph on a stream, capturing that stream must still work: a
    graph launch cannot be captured, so the op launches the kernel there (the caller's graph
    holds an ordinary kernel node)."""
    args = _gpu_inputs(4, 4, 64, 64, seed=22)
    out, state_out = cupy.empty((4, 4, 64), bfloat16), cupy.empty(args[0].shape, F32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):  # the second and third calls replay the op's graph
            comba_decode_step(*args, out=out, state_out=state_out)
        out.fill(cupy.nan)
        state_out.fill(cupy.nan)
        stream.begin_capture()
        comba_decode_step(*args, out=out, state_out=state_out)
        graph = stream.end_capture()
        assert bool(cupy.isnan(state_out).all())  # the capture ran nothing ...
        graph.launch(stream)
    stream.synchronize()
    err_s, err_o = _errors(args, state_out, out)  # ... the replay did
    assert err_s <= STATE_TOL and err_o <= O_TOL[bfloat16]


def test_plain_kernel_launches_when_graph_launches_are_off(monkeypatch):
    from cupy_comba import _launcher
    monkeypatch.setattr(_launcher, "_DRIVER", None)
    assert not graph_launches()
    args = _gpu_inputs(3, 2, 128, 64, seed=23)
    for _ in range(3):
        S, o = _run_poisoned(args)
        err_s, err_o = _errors(args, S, o)
        assert err_s <= STATE_TOL and err_o <= O_TOL[bfloat16]


def test_pointer_checks_run_again_when_the_buffers_change():
    """Overlaps and alignment are checked once per set of pointers: a call that reuses a checked
    call signature with new buffers that overlap must still be refused, and in-place still work."""
    args = _gpu_inputs(2, 2, 64, 64, seed=24)
    out, state_out = cupy.empty((2, 2, 64), bfloat16), cupy.empty(args[0].shape, F32)
    for _ in range(2):
        comba_decode_step(*args, out=out, state_out=state_out)
    with pytest.raises(ValueError, match="out overlaps v"):
        comba_decode_step(*args, out=args[3], state_out=state_out)
    flat = cupy.empty(args[0].size + 4, F32)
    shifted, overlapping = flat[4:].reshape(args[0].shape), flat[:-4].reshape(args[0].shape)
    with pytest.raises(ValueError, match="partially overlaps"):
        comba_decode_step(shifted, *args[1:], out=out, state_out=overlapping)
    state = args[0].copy()
    S, o = comba_decode_step(state, *args[1:], out=out, state_out=state)
    assert S is state and _errors(args, S, o)[0] <= STATE_TOL


def test_gpu_argument_errors():
    args = _gpu_inputs(2, 2, 64, 64, seed=12)
    with pytest.raises(TypeError, match="mixed NumPy and CuPy"):
        comba_decode_step(args[0], cupy.asnumpy(args[1]), *args[2:])
    with pytest.raises(TypeError, match=r"mixed NumPy and CuPy arrays \(state_out is NumPy"):
        comba_decode_step(*args, state_out=numpy.empty(args[0].shape, F32))
    with pytest.raises(ValueError, match="C-contiguous"):
        comba_decode_step(cupy.asfortranarray(args[0]), *args[1:])
    with pytest.raises(ValueError, match="out overlaps state"):
        comba_decode_step(*args, out=args[0].reshape(-1)[:2 * 2 * 64].reshape(2, 2, 64))
    with pytest.raises(ValueError, match="partially overlaps"):
        flat = cupy.empty(args[0].size + 4, F32)
        comba_decode_step(flat[4:].reshape(args[0].shape), *args[1:], state_out=flat[:-4].reshape(args[0].shape))
    with pytest.raises(NotImplementedError, match="K=32"):
        comba_decode_step(*_gpu_inputs(2, 2, 32, 64))
    with pytest.raises(ValueError, match="16-byte boundary"):
        flat = cupy.empty(args[0].size + 1, F32)
        comba_decode_step(flat[1:].reshape(args[0].shape), *args[1:])
    with pytest.raises(ValueError, match="variant must name a 'kv' tiling at K=64, one of .* got 'warp7'"):
        _decode_step(*args, None, None, None, None, "warp7")
    with pytest.raises(ValueError, match="cannot run"):
        _decode_step(*_gpu_inputs(2, 2, 128, 96), None, None, None, None, "kv64x8")


def test_a_grid_of_heads_refuses_more_than_it_holds():
    """The one-warp decode step launches a grid of (B, H, slabs) CTAs (families.Kernel.grid3): at most 65535 heads,
    refused with an error naming the limit before any work."""
    args = _gpu_inputs(1, 65536, 64, 32, seed=5)
    with pytest.raises(ValueError, match="at most 65535 in y and z"):
        _decode_step(*args, None, None, None, None, "kv16w")
    assert _decode_step(*_gpu_inputs(1, 64, 64, 32, seed=5), None, None, None, None, "kv16w")[0].shape == \
        (1, 64, 64, 32)


def test_empty_batch():
    S, o = comba_decode_step(*_gpu_inputs(0, 4, 64, 64))
    assert S.shape == (0, 4, 64, 64) and o.shape == (0, 4, 64)


def test_torch_interop_without_copies():
    torch = pytest.importorskip("torch")
    args = _gpu_inputs(4, 4, 128, 128, seed=13)
    t_args = [torch.from_dlpack(a) for a in args]
    c_args = [cupy.from_dlpack(t) for t in t_args]
    assert all(c.data.ptr == t.data_ptr() for c, t in zip(c_args, t_args))
    t_state_out = torch.empty_like(t_args[0])
    S, o = comba_decode_step(*c_args, state_out=cupy.from_dlpack(t_state_out))
    torch.cuda.synchronize()
    assert S.data.ptr == t_state_out.data_ptr()
    assert _errors(args, cupy.from_dlpack(t_state_out), o)[0] <= STATE_TOL
    assert torch.from_dlpack(o).dtype == torch.bfloat16


def test_jax_interop():
    jax = pytest.importorskip("jax")
    args = _gpu_inputs(4, 4, 64, 64, seed=14)
    j_args = [jax.dlpack.from_dlpack(a) for a in args]
    c_args = [cupy.from_dlpack(j) for j in j_args]
    S, o = comba_decode_step(*c_args)
    assert _errors(args, S, o)[0] <= STATE_TOL
    assert jax.dlpack.from_dlpack(S).shape == (4, 4, 64, 64)
