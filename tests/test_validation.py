"""Bad input is answered before any work, with a message naming what was expected and what came.

The same checks guard the NumPy and the CuPy paths; the GPU-marked tests repeat the ones whose fast
path differs (plain cupy.ndarray arguments skip the general checks until a plan is built).
"""

import numpy
import pytest

from cupy_comba import bfloat16, comba_decode_step, comba_forward, gated_delta_decode_step, gated_delta_forward, reference
from cupy_comba.inputs import decode_inputs, forward_inputs

F32 = numpy.dtype(numpy.float32)


def _step_args(xp=numpy, **kw):
    return list(decode_inputs(3, 4, 64, 64, warm_steps=2, seed=11, xp=xp, **kw))


def _poisoned_outputs(args, xp=numpy):
    return xp.full((3, 4, 64), numpy.nan, bfloat16), xp.full(args[0].shape, numpy.nan, F32)


# -- array types -------------------------------------------------------------------------------------

class _Tagged(numpy.ndarray):
    pass


def test_ndarray_subclasses_run_as_plain_arrays(tmp_path):
    args = _step_args()
    S_ref, o_ref = comba_decode_step(*args)
    mm = numpy.memmap(tmp_path / "state.bin", dtype=F32, mode="w+", shape=args[0].shape)
    mm[...] = args[0]
    tagged = args[1].view(_Tagged)
    S, o = comba_decode_step(mm, tagged, *args[2:])
    numpy.testing.assert_array_equal(S, S_ref)
    numpy.testing.assert_array_equal(o, o_ref)
    comba_decode_step(mm, *args[1:], state_out=mm)  # an output memmap is written in place
    numpy.testing.assert_array_equal(numpy.asarray(mm), S_ref)


def test_masked_arrays_are_refused():
    args = _step_args()
    args[3] = numpy.ma.masked_array(args[3], mask=numpy.zeros(args[3].shape, bool))
    with pytest.raises(TypeError, match=r"v is a masked array: its mask would be ignored"):
        comba_decode_step(*args)


@pytest.mark.parametrize("op", ["decode", "forward"])
def test_comba_without_p_names_the_gated_deltanet_op(op):
    if op == "decode":
        args = _step_args()
        with pytest.raises(TypeError, match="p must be .* got NoneType .*gated_delta_decode_step"):
            comba_decode_step(args[0], *args[1:4], None, *args[5:])
    else:
        q, k, v, p, beta, g, S = forward_inputs(2, 3, 2, 64, 32, warm_steps=1)
        with pytest.raises(TypeError, match="p must be .* got NoneType .*gated_delta_forward"):
            comba_forward(q, k, v, None, beta, g)


# -- options ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, "no", numpy.zeros(2), 1], ids=["None", "str", "array", "int"])
def test_output_final_state_must_be_a_bool(value):
    q, k, v, p, beta, g, S = forward_inputs(2, 3, 2, 64, 32, warm_steps=1)
    with pytest.raises(TypeError, match="output_final_state must be a bool"):
        gated_delta_forward(q, k, v, beta, g, initial_state=S, output_final_state=value)
    o, final = gated_delta_forward(q, k, v, beta, g, initial_state=S, output_final_state=numpy.bool_(False))
    assert final is None and o.shape == (2, 3, 2, 32)


@pytest.mark.parametrize("o_dtype,match", [("foo", "o_dtype must be .* got 'foo'"), (5, "o_dtype must be .* got 5"),
                                           (numpy.float64, "o_dtype must be .* got float64"),
                                           ([1], r"o_dtype must be .* got \[1\]")])
def test_o_dtype_errors_name_the_option(o_dtype, match):
    with pytest.raises(TypeError, match=match):
        comba_decode_step(*_step_args(), o_dtype=o_dtype)


@pytest.mark.parametrize("alias,dtype", [("bf16", bfloat16), ("fp16", numpy.float16), ("float32", F32)])
def test_o_dtype_takes_the_cli_aliases(alias, dtype):
    _, o = comba_decode_step(*_step_args(), o_dtype=alias)
    assert o.dtype == numpy.dtype(dtype)


@pytest.mark.parametrize("scale", [1e39, -1e39, float("inf"), float("nan")])
def test_scale_must_be_finite_in_float32(scale):
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        comba_decode_step(*_step_args(), scale=scale)


@pytest.mark.parametrize("option,value,match", [
    ("state_layout", ["kv"], "state_layout must be 'kv' or 'vk', got \\['kv'\\]"),
    ("state_layout", "KV", "state_layout must be 'kv' or 'vk', got 'KV'"),
    ("gate", {"log": 1}, "gate must be 'log' or 'linear'"),
    ("use_qk_l2norm", "yes", "use_qk_l2norm must be a bool"),
    ("variant", "kv99x9", "variant must name a 'kv' tiling at K=64"),
    ("variant", "kv128tc16", "cannot run a 'kv' state with K=64, V=64 over T tokens"),
    ("variant", 3, "variant must be a variant name"),
])
def test_option_errors(option, value, match):
    exc = TypeError if option in ("use_qk_l2norm",) or (option == "variant" and value == 3) else ValueError
    with pytest.raises(exc, match=match):
        comba_decode_step(*_step_args(), **{option: value})


def test_a_decode_only_variant_refuses_t_token_passes():
    """vk4x2 is built for the decode step only (families.VK_DECODE_TILINGS)."""
    q, k, v, p, beta, g, S = forward_inputs(1, 3, 2, 128, 32, warm_steps=1, state_layout="vk")
    with pytest.raises(ValueError, match="variant 'vk4x2' cannot run a 'vk' state with K=128, V=32 over T tokens"):
        gated_delta_forward(q, k, v, beta, g, initial_state=S, state_layout="vk", variant="vk4x2")
    step = [a[:, 0] for a in (q, k, v, beta, g)]
    S_new, o = gated_delta_decode_step(S, *step, state_layout="vk", variant="vk4x2")
    assert S_new.shape == S.shape and o.shape == (1, 2, 32)


# -- dtypes, shapes, layouts -----------------------------------------------------------------------

def test_big_endian_input_says_so():
    args = _step_args(dtype=F32)
    args[3] = args[3].astype(">f4")
    with pytest.raises(TypeError, match=r"v must be bfloat16, float16 or float32, got big-endian float32 \('>f4'\)"):
        comba_decode_step(*args)
    args = _step_args()
    args[0] = args[0].astype(">f4")
    with pytest.raises(TypeError, match=r"state must be float32 .* got big-endian float32"):
        comba_decode_step(*args)


def test_forward_blames_the_array_with_the_wrong_batch():
    q, k, v, p, beta, g, S = forward_inputs(2, 3, 2, 64, 32, warm_steps=1)
    q3 = numpy.concatenate([q, q[:1]])
    with pytest.raises(ValueError, match=r"q has \(B, T\) = \(3, 3\) but k, p, v, beta, g have \(2, 3\)"):
        comba_forward(q3, k, v, p, beta, g)


def test_non_contiguous_state_is_refused_on_the_cpu_too():
    args = _step_args()
    args[0] = numpy.asfortranarray(args[0])
    with pytest.raises(ValueError, match="state must be C-contiguous"):
        comba_decode_step(*args)


# -- outputs ---------------------------------------------------------------------------------------

def test_read_only_outputs_are_refused_before_anything_is_written():
    args = _step_args()
    args[0].flags.writeable = False
    out, _ = _poisoned_outputs(args)
    with pytest.raises(ValueError, match="state_out is read-only"):
        comba_decode_step(*args, out=out, state_out=args[0])
    assert numpy.isnan(out.astype(F32)).all()  # out was not written either
    ro = numpy.zeros((3, 4, 64), bfloat16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        comba_decode_step(*_step_args(), out=ro)


def test_interleaved_output_is_refused_with_the_rule():
    args = _step_args(dtype=bfloat16)
    buf = numpy.zeros((3, 4, 128), bfloat16)
    args[3] = buf[..., 0::2]
    out = buf[..., 1::2]  # shares no element with v, but their byte ranges interleave
    with pytest.raises(ValueError, match="out overlaps v: .*compared as byte ranges"):
        comba_decode_step(*args, out=out)


@pytest.mark.parametrize("name", ["v", "out"])
def test_strides_of_part_elements_are_refused(name):
    """A stride that is not a whole number of elements cannot be handed to a kernel (which takes element
    strides): refused for an input and for out alike, before anything is written."""
    args = _step_args()
    raw = numpy.zeros(3 * 4 * 64 * 4 + 64, numpy.uint8)
    odd = numpy.ndarray((3, 4, 64), F32, buffer=raw, offset=2, strides=(4 * 64 * 4 + 2, 64 * 4, 4))
    if name == "v":
        odd[...] = args[3]
        args[3], out = odd, None
    else:
        odd[...] = numpy.nan
        out = odd
    before = odd.copy()
    with pytest.raises(ValueError, match=f"{name} has strides .* not a multiple of its itemsize"):
        comba_decode_step(*args, out=out)
    assert numpy.array_equal(odd, before, equal_nan=True)


# -- the same on the GPU's fast path ---------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_fast_path_answers_alike():
    cupy = pytest.importorskip("cupy")
    args = _step_args(xp=cupy)
    with pytest.raises(ValueError, match=r"state_layout must be 'kv' or 'vk', got \['kv'\]"):
        comba_decode_step(*args, state_layout=["kv"])
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        comba_decode_step(*args, scale=1e39)
    with pytest.raises(TypeError, match="output_final_state must be a bool"):
        gated_delta_forward(*(a[:, None] for a in (args[1], args[2], args[3], args[5], args[6])),
                            initial_state=args[0], output_final_state=None)
    with pytest.raises(TypeError, match="o_dtype must be"):
        comba_decode_step(*args, o_dtype="foo")
    fortran = cupy.asfortranarray(args[0])
    with pytest.raises(ValueError, match="state must be C-contiguous"):
        comba_decode_step(fortran, *args[1:])
    _, o = comba_decode_step(*args, o_dtype="bf16")
    S_ref, o_ref = reference.comba_step(*args)
    assert o.dtype == bfloat16 and reference.relative_error(o, o_ref) < 8e-3
    _, o_gdn = gated_delta_decode_step(args[0], args[1], args[2], args[3], args[5], args[6])
    assert reference.relative_error(o_gdn, reference.gated_delta_step(args[0], *args[1:4], *args[5:])[1]) < 8e-3


def test_the_numpy_path_returns_c_contiguous_states_in_both_layouts():
    """As the kernels do: a returned "vk" state can be handed back to the next step."""
    state, q, k, v, p, beta, g = _step_args()
    vk = numpy.ascontiguousarray(state.swapaxes(-1, -2))
    S1, _ = comba_decode_step(vk, q, k, v, p, beta, g, state_layout="vk")
    assert S1.flags.c_contiguous
    S2, _ = comba_decode_step(S1, q, k, v, p, beta, g, state_layout="vk")
    assert S2.flags.c_contiguous


# -- what the kernels can index ----------------------------------------------------------------------

def _huge(shape, dtype):
    """A view of one element with ``shape`` (zero strides): never read, the checks refuse it first."""
    return numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype), shape=shape, strides=(0,) * len(shape))


def test_a_head_larger_than_the_kernels_index_is_refused():
    V = 2 ** 24 + 32  # K * V > 2**31 - 1 at K = 128
    q = _huge((1, 1, 1, 128), bfloat16)
    with pytest.raises(ValueError, match=r"K \* V = .* more than the kernels index .* V must be at most 16777215"):
        gated_delta_forward(q, q, _huge((1, 1, 1, V), bfloat16), _huge((1, 1, 1), bfloat16),
                            _huge((1, 1, 1), bfloat16))


def test_a_sequence_longer_than_the_kernels_index_is_refused():
    T = 2 ** 31
    q = _huge((1, T, 1, 64), bfloat16)
    with pytest.raises(ValueError, match="T = 2147483648 tokens is more than the kernels index"):
        gated_delta_forward(q, q, _huge((1, T, 1, 32), bfloat16), _huge((1, T, 1), bfloat16),
                            _huge((1, T, 1), bfloat16))


@pytest.mark.gpu
def test_a_grid_larger_than_the_kernels_index_is_refused():
    cupy = pytest.importorskip("cupy")
    B, H, K, V = 2 ** 25, 64, 64, 32  # B * H = 2**31 heads
    one = cupy.zeros(1, bfloat16)
    act = lambda *shape: cupy.lib.stride_tricks.as_strided(one, shape=shape, strides=(0,) * len(shape))  # noqa: E731
    base = cupy.zeros(1, numpy.float32)
    state = cupy.lib.stride_tricks.as_strided(base, shape=(B, H, K, V), strides=(H * K * V * 4, K * V * 4, V * 4, 4))
    with pytest.raises(ValueError, match=r"B \* H = 2147483648 heads need .* CTAs; the kernels index at most"):
        gated_delta_decode_step(state, act(B, 1, K), act(B, 1, K), act(B, H, V), act(B, H), act(B, H))


# -- random malformed calls ----------------------------------------------------------------------------

#: What a refused call may raise: nothing else (no IndexError, no NumPy casting error, no crash).
CLEAN = (ValueError, TypeError, NotImplementedError)


def _mutations(a, r):
    """One way to spoil array ``a`` (or to replace it), drawn by ``r``."""
    choices = [
        lambda: a.astype(r.choice([numpy.int32, numpy.float64, numpy.complex64, numpy.bool_, numpy.int8])),
        lambda: a[..., : max(a.shape[-1] - int(r.choice([1, 8])), 0)] if a.ndim else a,
        lambda: a[..., None],
        lambda: a[0] if a.ndim and a.shape[0] else a,
        lambda: numpy.swapaxes(a, 0, -1),
        lambda: a[::-1] if a.ndim else a,
        lambda: a[:, ::2] if a.ndim > 1 else a,
        lambda: a.tolist(),
        lambda: None,
        lambda: numpy.float32(1.0),
    ]
    return choices[int(r.integers(len(choices)))]()


def _hostile_indices(r, shape, n):
    """Slot indices of ``shape`` over a pool of ``n``: in range, padding, past the pool, extreme, odd dtypes."""
    values = r.integers(-2, n + 2, size=shape).astype(numpy.int64)
    if values.size and r.random() < 0.5:
        values.flat[int(r.integers(values.size))] = r.choice([2 ** 31 - 1, -2 ** 31, 2 ** 40, -(2 ** 62)])
    dtype = r.choice([numpy.int32, numpy.int64, numpy.int64, numpy.int16, numpy.uint32, numpy.float32])
    return values.astype(dtype) if dtype != numpy.int32 else values.clip(-2 ** 31, 2 ** 31 - 1).astype(dtype)


def _random_call(r):
    """A small call, Comba or Gated DeltaNet, decode step or forward pass, with one of its arrays spoilt or one
    serving option given hostile values: ``(fn, args, kwargs, names of the arrays it may write)``."""
    comba, step = bool(r.random() < 0.5), bool(r.random() < 0.4)
    layout = str(r.choice(["kv", "vk"]))
    B, T, H, K, V = 2, 3, 2, 64, 32
    kw = dict(state_layout=layout)
    if step:
        state, q, k, v, p, beta, g = decode_inputs(B, H, K, V, warm_steps=1, seed=int(r.integers(1 << 30)),
                                                   state_layout=layout)
        args = [state, q, k, v, p, beta, g]
        writable = {"state_out"}
        if r.random() < 0.3:
            N = int(r.choice([1, 3]))
            args[0] = numpy.ascontiguousarray(numpy.broadcast_to(state[:1], (N,) + state.shape[1:]))
            kw["state_indices"] = _hostile_indices(r, (B,) if r.random() < 0.8 else (B, 2), N)
            writable.add(0)  # the pool is updated in place
    else:
        q, k, v, p, beta, g, state = forward_inputs(B, T, H, K, V, warm_steps=1, seed=int(r.integers(1 << 30)),
                                                    state_layout=layout)
        args = [q, k, v, p, beta, g]
        kw["initial_state"] = state
        writable = {"state_out", "intermediate_states"}
        u = r.random()
        if u < 0.2:
            cu = numpy.sort(r.integers(-2, B * T + 3, size=B + 1))
            if r.random() < 0.3:
                r.shuffle(cu)
            args = [a.reshape((1, B * T) + a.shape[2:]) for a in args]
            kw["cu_seqlens"] = cu.astype(r.choice([numpy.int32, numpy.int64, numpy.uint64, numpy.float32]))
        elif u < 0.4:
            kw["state_indices"] = _hostile_indices(r, (B,) if r.random() < 0.6 else (B, T), 4)
            kw["initial_state"] = numpy.concatenate([state, state])
            if r.random() < 0.5:
                kw["num_accepted_tokens"] = _hostile_indices(r, (B,), T + 1)
            writable.add("initial_state")
        elif u < 0.5:
            kw["intermediate_states"] = numpy.empty((B, T) + state.shape[1:] if r.random() < 0.5 else (B, T),
                                                    numpy.float32)
    spoilt = int(r.integers(len(args) + 2))
    if spoilt < len(args):
        args[spoilt] = _mutations(args[spoilt], r)
    elif spoilt == len(args):
        name = str(r.choice(["A_log", "dt_bias"]))
        kw.update(A_log=numpy.zeros(H, numpy.float32), dt_bias=numpy.ones(H, numpy.float32))
        kw[name] = _mutations(kw[name], r)
    if not comba:
        del args[4 if step else 3]
    fn = {(True, True): comba_decode_step, (True, False): comba_forward,
          (False, True): gated_delta_decode_step, (False, False): gated_delta_forward}[comba, step]
    return fn, args, kw, writable


def test_random_malformed_calls_fail_cleanly_or_run_and_touch_only_their_outputs():
    """1000 small calls, each with one array spoilt (a wrong dtype, rank, length, stride, type or none) or a serving
    option given hostile values (slots past the pool or at int64's ends, unsorted or out-of-range cu_seqlens, odd
    index dtypes): each either raises ValueError / TypeError / NotImplementedError with a message, or runs, leaving
    every array it was not handed for writing bit for bit as it was, and returning finite results."""
    r = numpy.random.default_rng(2026)
    outcomes = {"refused": 0, "ran": 0}
    for case in range(1000):
        fn, args, kw, writable = _random_call(r)
        named = {i: a for i, a in enumerate(args)} | kw
        before = {n: a.copy() for n, a in named.items() if isinstance(a, numpy.ndarray) and n not in writable}
        try:
            result = fn(*args, **kw)
        except CLEAN as e:
            assert len(str(e)) >= 20, f"case {case}: {type(e).__name__}({str(e)!r}) says too little"
            outcomes["refused"] += 1
            continue
        outcomes["ran"] += 1
        for n, a in before.items():
            numpy.testing.assert_array_equal(named[n], a, err_msg=f"case {case}: {fn.__name__} wrote {n}")
        for x in result:
            if x is not None and x.dtype.kind == "f":
                assert numpy.isfinite(x.astype(numpy.float32)).all(), f"case {case}: {fn.__name__} non-finite"
    assert min(outcomes.values()) >= 100, outcomes  # both outcomes are exercised
