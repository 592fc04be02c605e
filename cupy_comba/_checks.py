"""Argument checks shared by the ops: clear errors that say what was expected and what came."""

import math
import numbers

import numpy

from ._backend import cupy, is_cupy_array
from ._dtypes import ACTIVATION_CODES, ACTIVATION_NAMES, dtype_name, float32
from ._build import SUPPORTED_K


def namespace_of(named):
    """``numpy`` or ``cupy`` for a dict ``{name: array}``; TypeError on anything else or a mix."""
    kinds = {}
    for name, a in named.items():
        if is_cupy_array(a):
            kinds.setdefault("cupy", name)
        elif isinstance(a, numpy.ndarray):
            kinds.setdefault("numpy", name)
        else:
            raise TypeError(f"{name} must be a cupy.ndarray or numpy.ndarray, got {type(a).__name__}")
    if len(kinds) > 1:
        raise TypeError(
            f"mixed NumPy and CuPy inputs ({kinds['numpy']} is NumPy, {kinds['cupy']} is CuPy): "
            "pass all arrays on the GPU (CuPy) or all on the CPU (NumPy)")
    return cupy if "cupy" in kinds else numpy


def expect_shape(name, shape, expected, meaning):
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(expected)}, got {tuple(shape)}")


def check_state_dtype(name, dtype):
    if dtype != float32:
        raise TypeError(f"{name} must be float32 (the recurrent state is kept in fp32), got {dtype_name(dtype)}")


def check_head_sizes(K, V):
    if K not in SUPPORTED_K:
        raise NotImplementedError(f"head size K={K} is not supported: supported K are {SUPPORTED_K}")
    if V < 32 or V % 32:
        raise NotImplementedError(f"value head size V={V} is not supported: V must be a positive multiple of 32")


def check_heads(H, Hk):
    if Hk < 1 or H % Hk:
        raise ValueError(f"value heads H={H} must be a multiple of key heads Hk={Hk} (q, k, p have Hk heads)")


def resolve_output_dtype(out, o_dtype, default):
    """dtype of ``o``: ``out``'s (from its signature) if given, else ``o_dtype``, else ``default``."""
    if out is not None:
        if out[2] not in ACTIVATION_CODES:
            raise TypeError(f"out must be {ACTIVATION_NAMES}, got {dtype_name(out[2])}")
        if o_dtype is not None and o_dtype != out[2]:
            raise TypeError(f"o_dtype={dtype_name(o_dtype)} disagrees with out.dtype={dtype_name(out[2])}")
        return out[2]
    if o_dtype is None:
        return default
    if o_dtype not in ACTIVATION_CODES:
        raise TypeError(f"o_dtype must be {ACTIVATION_NAMES}, got {dtype_name(o_dtype)}")
    return o_dtype


def real_scalar(name, x):
    """A finite real number as a Python float (TypeError / ValueError otherwise)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def resolve_scale(scale, K):
    """``K ** -0.5`` for None; otherwise a finite real number, as a Python float."""
    return K ** -0.5 if scale is None else real_scalar("scale", scale)


def check_writable_output(name, shape, strides, itemsize, expected_shape, meaning):
    """An output buffer: right shape, and no element written twice (no zero or overlapping strides)."""
    expect_shape(name, shape, expected_shape, meaning)
    span = itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if stride < span:
            raise ValueError(f"{name} has overlapping elements (strides {tuple(strides)}): "
                             "it would be written more than once")
        span = stride * n


# -- per-call helpers: cheap enough to run on every launch --------------------------------------

def ptr_of(a):
    """Data pointer of a CuPy or NumPy array."""
    return a.data.ptr if type(a) is not numpy.ndarray else a.__array_interface__["data"][0]


def span_of(shape, strides, itemsize):
    """``(lo, hi)`` byte offsets from the data pointer that an array can touch."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def is_c_contiguous(shape, strides, itemsize):
    """Whether an array of this shape and these byte strides is C-contiguous (size-1 axes ignored)."""
    if 0 in shape:
        return True
    acc = itemsize
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != acc:
            return False
        acc *= n
    return True


def c_strides(shape, itemsize):
    """Byte strides of a C-contiguous array."""
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def common_device(arrays):
    """The device id shared by every CuPy array of ``{name: array or None}``; ValueError if they differ."""
    devices = {name: a.data.device_id for name, a in arrays.items() if a is not None}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{n} on device {d}" for n, d in devices.items())
        raise ValueError(f"all arrays must be on one device, got {where}")
    return next(iter(devices.values()))


_NAMES = ("q", "k", "v", "p", "beta", "g", "state", "out", "state_out")


def overlap_pairs(spans):
    """What :func:`check_overlaps` tests, worked out once per call signature.

    ``spans`` holds ``(lo, hi)`` byte offsets from :func:`span_of` (or None where an array is
    absent) in the order q, k, v, p, beta, g, state, out, state_out.  Returns ``(o, i, olo, ohi,
    lo, hi)`` for every output ``o`` and array ``i`` it must not share memory with, both present
    and non-empty: ``state_out`` against the inputs, ``out`` against everything else.
    """
    pairs = []
    for o, others in ((8, range(7)), (7, (0, 1, 2, 3, 4, 5, 6, 8))):
        if spans[o] is None or spans[o][0] >= spans[o][1]:
            continue
        pairs.extend((o, i, *spans[o], *spans[i]) for i in others
                     if spans[i] is not None and spans[i][0] < spans[i][1])
    return tuple(pairs)


def check_overlaps(pointers, pairs):
    """Per call: outputs share no memory with inputs or with each other; ``state_out`` may be the state.

    ``pointers`` are the data pointers in :func:`overlap_pairs`' order (None where absent),
    ``pairs`` what it returned for the call's signature.
    """
    for o, i, olo, ohi, lo, hi in pairs:
        op, ip = pointers[o], pointers[i]
        if ip + lo < op + ohi and op + olo < ip + hi:
            if o == 8 and i == 6:
                if (op + olo, op + ohi) == (ip + lo, ip + hi):
                    continue  # state_out=state: the in-place update
                raise ValueError("state_out partially overlaps state: pass state itself for an in-place "
                                 "update, or a separate buffer")
            raise ValueError(f"{_NAMES[o]} overlaps {_NAMES[i]}: outputs must not share memory with inputs")
