"""Comba decode step: one token of the decoupled-key gated delta rule for a whole batch."""

import functools

import numpy

from . import reference
from .recurrent import comba_step_with_options
from ._backend import cupy, deliver
from ._build import _PIPELINED_ROW_GROUPS, get_kernel
from ._checks import (
    c_strides, check_head_sizes, check_heads, check_outputs, check_state_dtype, check_writable_output, common_device,
    expect_shape, namespace_of, real_scalar, resolve_output_dtype, resolve_scale, signature, span_of,
)
from ._dtypes import ACTIVATION_CODES, ACTIVATION_NAMES, dtype_name, float32
from ._params import DECODE_PARAMS, pack

_WARPS_PER_BLOCK = 4        # kDecodeWarps in kernels_cu/comba_decode.cu
_MAX_TILE_FLOATS = 16384    # kMaxTileFloats: largest K*V head the pipelined kernel takes
_MAX_STAGES = 4             # heads in the shared-memory ring at most

#: Kernel variants (see _build.SPECIALISATIONS): ``warpC[kS]`` -- a task is a C-column slab of
#: one head, handled by S warps that split the K axis (S = 1 when absent); ``pipe16`` -- the
#: persistent bulk-copy ring, 16 row groups.
VARIANTS = ("warp32", "warp16", "warp32k2", "warp32k4", "pipe16")


def comba_decode_step(state, q, k, v, p, beta, g, scale=None, *, out=None, state_out=None, o_dtype=None,
                      state_layout="kv", gate="log", use_qk_l2norm=False):
    """One Comba recurrent step for every sequence of a decode batch.

    Per ``(b, h)``, with ``S = state[b, h]`` and ``e = exp(g[b, h])``::

        S     = e * S
        u     = beta * (v - S^T p)      # correction read with p, after the decay
        S_new = S + k u^T               # rank-1 write with k
        o     = S_new^T (scale * q)

    CuPy inputs run one fused CUDA kernel on their device and the current
    stream (the fp32 state is read once and written once); NumPy inputs run
    the float64 reference on the CPU and return the same dtypes.

    Parameters
    ----------
    state : ndarray, shape (B, H, K, V), float32, C-contiguous
        Recurrent state from the previous token. Never written unless it is
        also passed as ``state_out``.
    q, k, p : ndarray, shape (B, Hk, K)
        Query, write key and read key. ``H % Hk == 0``; value head ``h``
        uses key head ``h // (H // Hk)`` (grouped value attention).
    v : ndarray, shape (B, H, V)
    beta : ndarray, shape (B, H)
        Delta-rule step size.
    g : ndarray, shape (B, H)
        Log-decay (``exp(g)`` is the forget gate).
    scale : float, optional
        Query scale; ``K ** -0.5`` when None.
    out : ndarray, shape (B, H, V), optional
        Buffer for ``o`` (any strides, bfloat16 / float16 / float32).
    state_out : ndarray, shape (B, H, K, V), float32, C-contiguous, optional
        Buffer for the new state. ``state_out=state`` updates in place.
    o_dtype : dtype, optional
        dtype of a newly allocated ``o``; default ``v.dtype``.
    state_layout : {"kv", "vk"}
        ``"vk"``: the state is ``(B, H, V, K)``, K contiguous.
    gate : {"log", "linear"}
        ``"linear"``: the state is scaled by ``g`` itself.
    use_qk_l2norm : bool
        L2-normalise q, k and p along K first (eps 1e-6).

    Activations (q, k, v, p, beta, g) may each be bfloat16, float16 or
    float32 and may be strided views; K is 64 or 128, V a multiple of 32.

    Returns
    -------
    state_new : ndarray, shape (B, H, K, V), float32
        ``state_out`` when given, else a new array.
    o : ndarray, shape (B, H, V)
        ``out`` when given, else a new array of ``o_dtype``.

    Raises
    ------
    TypeError
        An argument is not an array, NumPy and CuPy arrays are mixed, or a
        dtype is not supported.
    ValueError
        Shapes disagree, arrays are on different devices, an output overlaps
        an input, ``state`` is not C-contiguous, or ``scale`` is not finite.
    NotImplementedError
        K is not 64 or 128, or V is not a multiple of 32.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import comba_decode_step, bfloat16
    >>> B, H, K, V = 2, 4, 64, 64
    >>> rng = np.random.default_rng(0)
    >>> act = lambda *s: rng.standard_normal(s).astype(bfloat16)
    >>> unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(bfloat16)
    >>> state = np.zeros((B, H, K, V), np.float32)
    >>> q, v = act(B, H, K), act(B, H, V)
    >>> k, p = unit(rng.standard_normal((B, H, K))), unit(rng.standard_normal((B, H, K)))
    >>> beta = np.full((B, H), 0.5, bfloat16); g = np.full((B, H), -0.1, np.float32)
    >>> state_new, o = comba_decode_step(state, q, k, v, p, beta, g)
    >>> state_new.shape, state_new.dtype, o.shape, o.dtype == bfloat16
    ((2, 4, 64, 64), dtype('float32'), (2, 4, 64), True)
    """
    if state_layout != "kv" or gate != "log" or use_qk_l2norm is not False:
        # The options run the delta-rule family's kernel; the default form keeps the tuned decode kernels.
        return comba_step_with_options(state, q, k, v, p, beta, g, scale, out, state_out, o_dtype,
                                       state_layout, gate, use_qk_l2norm)
    return _decode_step(state, q, k, v, p, beta, g, scale, out, state_out, o_dtype, None)


_INPUTS = ("state", "q", "k", "v", "p", "beta", "g")


def _decode_step(state, q, k, v, p, beta, g, scale, out, state_out, o_dtype, variant):
    """``comba_decode_step`` with an optional forced kernel variant (see :data:`VARIANTS`).

    Everything that shapes, strides and dtypes decide is checked once per call
    signature (:func:`_plan`, cached); per call only pointers are compared, so
    the host path stays a few microseconds.
    """
    inputs = (state, q, k, v, p, beta, g)
    named = dict(zip(_INPUTS, inputs))
    xp = namespace_of(named)
    for name, a in (("out", out), ("state_out", state_out)):
        if a is not None and not isinstance(a, xp.ndarray):
            raise TypeError(f"{name} must be a {xp.__name__} array like the inputs, got {type(a).__name__}")
    device = common_device(dict(named, out=out, state_out=state_out)) if xp is cupy else None
    if scale is not None:
        scale = real_scalar("scale", scale)
    plan = _plan(signature(state), signature(q), signature(k), signature(v), signature(p),
                 signature(beta), signature(g), scale,
                 None if out is None else signature(out),
                 None if o_dtype is None else numpy.dtype(o_dtype), device, variant)
    check_outputs(named, plan.spans, out, plan.out_span, state_out, state.shape,
                  "(B, H, K, V)")
    if xp is numpy:
        return _numpy_step(plan, state, q, k, v, p, beta, g, out, state_out)
    return _cuda_step(plan, state, q, k, v, p, beta, g, out, state_out)


class _Plan:
    """Everything about a call that its shapes, strides and dtypes decide."""

    __slots__ = ("B", "H", "K", "V", "scale", "o_dtype", "params", "kernel", "grid", "block", "shared_mem",
                 "args_tail", "spans", "out_span")


@functools.lru_cache(maxsize=256)
def _plan(state, q, k, v, p, beta, g, scale, out, o_dtype, device, variant):
    """Validate a call signature once and precompute its launch (cached per signature)."""
    sig = {"state": state, "q": q, "k": k, "v": v, "p": p, "beta": beta, "g": g}
    shapes = {n: s[0] for n, s in sig.items()}
    if len(shapes["state"]) != 4:
        raise ValueError(f"state must be 4-D (B, H, K, V), got shape {shapes['state']}")
    B, H, K, V = shapes["state"]
    for name in ("q", "k", "p"):
        if len(shapes[name]) != 3:
            raise ValueError(f"{name} must be 3-D (B, Hk, K), got shape {shapes[name]}")
    Hk = shapes["q"][1]
    check_heads(H, Hk)
    for name in ("q", "k", "p"):
        expect_shape(name, shapes[name], (B, Hk, K), "(B, Hk, K)")
    expect_shape("v", shapes["v"], (B, H, V), "(B, H, V)")
    expect_shape("beta", shapes["beta"], (B, H), "(B, H)")
    expect_shape("g", shapes["g"], (B, H), "(B, H)")
    check_head_sizes(K, V)
    check_state_dtype("state", state[2])
    for name in ("q", "k", "v", "p", "beta", "g"):
        if sig[name][2] not in ACTIVATION_CODES:
            raise TypeError(f"{name} must be {ACTIVATION_NAMES}, got {dtype_name(sig[name][2])}")
    if device is not None and B * H and state[1] != c_strides(state[0], 4):
        raise ValueError("state must be C-contiguous on the GPU (pass cupy.ascontiguousarray(state))")
    for name, s in sig.items():
        if any(st % s[2].itemsize for st in s[1]):
            raise ValueError(f"{name} has strides {s[1]} that are not a multiple of its itemsize")

    if out is not None:
        check_writable_output("out", out[0], out[1], out[2].itemsize, (B, H, V), "(B, H, V)")
    o_dtype = resolve_output_dtype(out, o_dtype, v[2])

    plan = _Plan()
    plan.B, plan.H, plan.K, plan.V = B, H, K, V
    plan.spans = tuple(span_of(*sig[n][:2], sig[n][2].itemsize) for n in _INPUTS)
    plan.out_span = None if out is None else span_of(out[0], out[1], out[2].itemsize)
    plan.scale = resolve_scale(scale, K)
    plan.o_dtype = o_dtype
    plan.params = plan.kernel = plan.grid = plan.block = plan.shared_mem = plan.args_tail = None
    if device is None:
        return plan

    o_strides = out[1] if out is not None else (H * V * o_dtype.itemsize, V * o_dtype.itemsize, o_dtype.itemsize)
    es = {n: tuple(st // s[2].itemsize for st in s[1]) for n, s in sig.items()}
    o_es = tuple(st // o_dtype.itemsize for st in o_strides)
    values = {"B": B, "H": H, "group": H // Hk, "V": V}
    for name, suffix in (("q", "k"), ("k", "k"), ("p", "k"), ("v", "v")):
        values.update({f"{name}_sb": es[name][0], f"{name}_sh": es[name][1], f"{name}_s{suffix}": es[name][2]})
    for name in ("beta", "g"):
        values.update({f"{name}_sb": es[name][0], f"{name}_sh": es[name][1]})
    values.update({"o_sb": o_es[0], "o_sh": o_es[1], "o_sv": o_es[2]})
    for name in ("q", "k", "p", "v", "beta", "g"):
        values[f"{name}_t"] = ACTIVATION_CODES[sig[name][2]]
    values["o_t"] = ACTIVATION_CODES[o_dtype]
    plan.params = pack(DECODE_PARAMS, values)

    launch = choose_launch(B * H, K, V, device) if variant is None else variant
    plan.kernel, plan.grid, plan.block, plan.shared_mem, extra = _launch_config(launch, B * H, K, V, device)
    plan.args_tail = (plan.params, numpy.float32(plan.scale)) + extra
    return plan


@functools.lru_cache(maxsize=None)
def _device_limits(device):
    attrs = cupy.cuda.Device(device).attributes
    return (attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerBlockOptin"],
            attrs["MaxSharedMemoryPerMultiprocessor"], int(cupy.cuda.Device(device).compute_capability))


def _ring_layout(K, V, rg, device):
    """``(nstage, shared bytes, CTAs per SM)`` of the pipelined kernel, or None if it cannot take the shape."""
    _, per_block, per_sm, cc = _device_limits(device)
    if K * V > _MAX_TILE_FLOATS or (K, rg) not in _PIPELINED_ROW_GROUPS or cc < 90:
        return None
    nv = (3 * K + V + 2 + 3) & ~3
    fixed = 128 + 2 * nv * 4 + (2 * rg + 2) * (V // 4) * 16 + (rg + 1) * 4
    tile = K * V * 4
    nstage = min(_MAX_STAGES, (per_block - fixed) // tile)
    if nstage < 2:
        return None
    smem = fixed + nstage * tile
    return nstage, smem, max(1, per_sm // (smem + 1024))


def choose_launch(heads, K, V, device):
    """The kernel variant for a shape, from the H200 sweep (benchmarks/sweep_decode.py):

    * K = 128, a large batch (>= 32 heads per SM): the pipelined ring (0.77 of copy at
      B*H = 14336 against 0.72 for the best warp tiling);
    * otherwise warp slabs: 16 columns for K = 64 batches that fill the GPU; for smaller
      batches the K axis is split over 2 or 4 warps, so that more, shorter tasks spread
      over the SMs (B*H = 128: 6.1 us against 7.9 us unsplit).
    """
    sms = _device_limits(device)[0]
    if K == 128 and heads >= 32 * sms and _ring_layout(K, V, 16, device) is not None:
        return "pipe16"
    slab_tasks = heads * V // 32
    if K == 64 and slab_tasks >= 32 * sms:
        return "warp16"
    if slab_tasks >= 8 * sms:
        return "warp32k2"
    return "warp32k4"


def _launch_config(variant, heads, K, V, device):
    """``(kernel, grid, block, shared_mem, extra args)`` of one variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; expected one of {VARIANTS}")
    with cupy.cuda.Device(device):
        if variant.startswith("warp"):
            cols, _, ks = variant[4:].partition("k")
            cols, ks = int(cols), int(ks or 1)
            tasks, per_block = heads * (V // cols), _WARPS_PER_BLOCK // ks
            kernel = get_kernel("comba_decode", f"comba::comba_decode_step<{K}, {cols}, {ks}>", device)
            return kernel, ((tasks + per_block - 1) // per_block,), (_WARPS_PER_BLOCK * 32,), 0, ()
        rg = int(variant[4:])
        layout = _ring_layout(K, V, rg, device)
        if layout is None:
            raise ValueError(f"variant {variant} cannot take K={K}, V={V} (shared memory or row groups)")
        nstage, smem, per_sm = layout
        kernel = get_kernel("comba_decode", f"comba::comba_decode_step_pipelined<{K}, {rg}>", device)
        if kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        grid = max(1, min(heads, _device_limits(device)[0] * per_sm))
        return kernel, (grid,), ((V // 4) * rg,), smem, (numpy.int32(nstage),)


def _cuda_step(plan, state, q, k, v, p, beta, g, out, state_out):
    # The state streams through 16-byte vector accesses and bulk copies.
    if state.data.ptr & 15 or (state_out is not None and state_out.data.ptr & 15):
        raise ValueError("state and state_out must start on a 16-byte boundary (e.g. a fresh allocation "
                         "or a view at a whole-head offset)")
    device = state.data.device_id
    if cupy.cuda.runtime.getDevice() != device:
        with cupy.cuda.Device(device):
            return _cuda_step(plan, state, q, k, v, p, beta, g, out, state_out)
    if state_out is None:
        state_out = cupy.empty(state.shape, float32)
    if out is None:
        out = cupy.empty((plan.B, plan.H, plan.V), plan.o_dtype)
    if plan.B * plan.H:
        plan.kernel(plan.grid, plan.block, (state, state_out, q, k, v, p, beta, g, out) + plan.args_tail,
                    shared_mem=plan.shared_mem)
    return state_out, out


def _numpy_step(plan, state, q, k, v, p, beta, g, out, state_out):
    S, o = reference.comba_step(state, q, k, v, p, beta, g, plan.scale)
    return deliver(S, state_out, float32), deliver(o, out, plan.o_dtype)
