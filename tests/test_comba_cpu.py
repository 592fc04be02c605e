"""comba_decode_step on NumPy arrays: the CPU path and every argument check (shared with the GPU path)."""

import numpy
import pytest

from cupy_comba import bfloat16, comba_decode_step, reference
from cupy_comba.inputs import decode_inputs

F16, F32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)


def _inputs(B=3, H=4, K=64, V=64, **kw):
    return list(decode_inputs(B, H, K, V, warm_steps=2, seed=7, **kw))


@pytest.mark.parametrize("dtype", [bfloat16, F16, F32], ids=lambda d: numpy.dtype(d).name)
def test_numpy_path_matches_reference(dtype):
    args = _inputs(dtype=dtype)
    S_ref, o_ref = reference.comba_step(*args)
    S, o = comba_decode_step(*args)
    assert S.dtype == F32 and o.dtype == numpy.dtype(dtype)
    assert reference.relative_error(S, S_ref) < 1e-6
    assert reference.relative_error(o, o_ref) < {F32: 1e-6, F16: 1e-3}.get(numpy.dtype(dtype), 4e-3)


def test_numpy_path_is_functional_and_supports_in_place():
    args = _inputs()
    before = [a.copy() for a in args]
    S, _ = comba_decode_step(*args)
    for a, b in zip(args, before):
        numpy.testing.assert_array_equal(a, b)
    state = args[0]
    S2, _ = comba_decode_step(*args, state_out=state)
    assert S2 is state
    numpy.testing.assert_array_equal(state, S)


def test_out_and_o_dtype():
    args = _inputs()
    out = numpy.full((3, 4, 64), numpy.nan, F32)
    state_out = numpy.full(args[0].shape, numpy.nan, F32)
    S, o = comba_decode_step(*args, out=out, state_out=state_out)
    assert o is out and S is state_out and not numpy.isnan(out).any()
    _, o32 = comba_decode_step(*args, o_dtype=numpy.float32)
    numpy.testing.assert_array_equal(o32, out)


def test_grouped_value_heads():
    args = _inputs(H=8, Hk=2)
    S_ref, o_ref = reference.comba_step(*args)
    S, o = comba_decode_step(*args)
    assert reference.relative_error(S, S_ref) < 1e-6
    assert reference.relative_error(o, o_ref) < 4e-3  # bf16 o
    # and the grouping is real: each value head reads its own key head, not head 0's
    _, o_first = reference.comba_step(args[0], *(a[:, :1].repeat(2, axis=1) for a in args[1:3]), args[3],
                                      args[4][:, :1].repeat(2, axis=1), *args[5:])
    assert reference.relative_error(o, o_first) > 0.1


def test_explicit_scale():
    args = _inputs(dtype=F32)
    _, o_ref = reference.comba_step(*args, scale=0.25)
    _, o = comba_decode_step(*args, scale=0.25)
    assert reference.relative_error(o, o_ref) < 1e-6


# ---------------------------------------------------------------------------- errors

def _replace(args, i, x):
    args = list(args)
    args[i] = x
    return args


@pytest.mark.parametrize("i,shape,match", [
    (0, (3, 4, 64), "state must be 4-D"),
    (1, (3, 4, 64, 1), "q must be 3-D"),
    (1, (3, 4, 32), r"q must have shape \(B, Hk, K\)"),
    (2, (2, 4, 64), r"k has batch B = 2 but q, p, v, beta, g, state have 3"),
    (3, (3, 4, 32), r"v must have shape \(B, H, V\)"),
    (4, (3, 4, 63), r"p must have shape"),
    (5, (3, 5), r"beta must have shape \(B, H\)"),
    (6, (3,), r"g must be 2-D \(B, H\), got shape \(3,\)"),
], ids=["state-rank", "q-rank", "q-K", "k-B", "v-V", "p-K", "beta-H", "g-rank"])
def test_shape_errors(i, shape, match):
    args = _inputs()
    bad = numpy.zeros(shape, args[i].dtype) + 0.5
    with pytest.raises(ValueError, match=match):
        comba_decode_step(*_replace(args, i, bad))


def test_heads_not_divisible():
    args = _inputs(H=4, Hk=4)
    q3 = [a[:, :3] for a in (args[1], args[2], args[4])]
    with pytest.raises(ValueError, match="multiple of key heads Hk=3"):
        comba_decode_step(args[0], q3[0], q3[1], args[3], q3[2], args[5], args[6])


@pytest.mark.parametrize("K,V,match", [(96, 64, "K=96"), (512, 64, "K=512"), (64, 48, "V=48"), (64, 16, "V=16")])
def test_unsupported_head_sizes(K, V, match):
    with pytest.raises(NotImplementedError, match=match):
        comba_decode_step(*_inputs(B=1, H=1, K=K, V=V))


@pytest.mark.parametrize("i,dtype,match", [
    (0, numpy.float64, "state must be float32"),
    (0, bfloat16, "state must be float32"),
    (1, numpy.float64, "q must be bfloat16, float16 or float32, got float64"),
    (3, numpy.int32, "v must be"),
    (6, numpy.float64, "g must be"),
])
def test_dtype_errors(i, dtype, match):
    args = _inputs()
    with pytest.raises(TypeError, match=match):
        comba_decode_step(*_replace(args, i, args[i].astype(dtype)))


def test_non_array_input():
    args = _inputs()
    with pytest.raises(TypeError, match="q must be a cupy.ndarray or numpy.ndarray, got list"):
        comba_decode_step(*_replace(args, 1, args[1].tolist()))


@pytest.mark.parametrize("scale,exc", [(float("nan"), ValueError), (float("inf"), ValueError),
                                       ("1.0", TypeError), (True, TypeError), ([1.0], TypeError)])
def test_bad_scale(scale, exc):
    with pytest.raises(exc, match="scale"):
        comba_decode_step(*_inputs(), scale=scale)


def test_state_out_checks():
    args = _inputs()
    with pytest.raises(ValueError, match="state_out must have shape"):
        comba_decode_step(*args, state_out=numpy.empty((3, 4, 64, 32), F32))
    with pytest.raises(TypeError, match="state_out must be float32"):
        comba_decode_step(*args, state_out=numpy.empty(args[0].shape, numpy.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        comba_decode_step(*args, state_out=numpy.empty((3, 4, 64, 128), F32)[..., ::2])
    flat = numpy.zeros(args[0].size + 16, F32)
    shifted = flat[16:].reshape(args[0].shape)
    shifted[...] = args[0]
    with pytest.raises(ValueError, match="partially overlaps state"):
        comba_decode_step(shifted, *args[1:], state_out=flat[:args[0].size].reshape(args[0].shape))


def test_outputs_must_not_overlap_inputs():
    args = _inputs(dtype=F32)
    v = args[3]
    with pytest.raises(ValueError, match="out overlaps v"):
        comba_decode_step(*args, out=v)
    packed = numpy.zeros(args[0].size + 64, F32)
    state_out = packed[:args[0].size].reshape(args[0].shape)
    q = packed[-64 * 12:].reshape(3, 4, 64)
    with pytest.raises(ValueError, match="state_out overlaps q"):
        comba_decode_step(args[0], q, *args[2:], state_out=state_out)


def test_out_checks():
    args = _inputs()
    with pytest.raises(ValueError, match=r"out must have shape \(B, H, V\)"):
        comba_decode_step(*args, out=numpy.empty((3, 4, 32), bfloat16))
    with pytest.raises(TypeError, match="out must be"):
        comba_decode_step(*args, out=numpy.empty((3, 4, 64), numpy.float64))
    with pytest.raises(TypeError, match="disagrees"):
        comba_decode_step(*args, out=numpy.empty((3, 4, 64), F32), o_dtype=F16)
    with pytest.raises(ValueError, match="overlapping elements"):
        comba_decode_step(*args, out=numpy.broadcast_to(numpy.empty((1, 4, 64), F32), (3, 4, 64)))


def test_empty_batch():
    args = _inputs(B=0)
    S, o = comba_decode_step(*args)
    assert S.shape == (0, 4, 64, 64) and o.shape == (0, 4, 64)
