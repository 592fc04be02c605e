"""The gated delta-rule family: Gated DeltaNet and Comba steps and T-token forward passes.

One argument order for every op -- ``(state, q, k, v, [p,] beta, g)`` for steps,
``(q, k, v, [p,] beta, g)`` for multi-token forms -- and one set of options:

* ``state_layout="kv"`` (state ``[B, H, K, V]``, V contiguous) or ``"vk"`` (``[B, H, V, K]``,
  K contiguous, as MLX-LM, vLLM and SGLang keep it);
* ``gate="log"`` (state scaled by ``exp(g)``) or ``"linear"`` (scaled by ``g``);
* ``use_qk_l2norm``: L2-normalise q, k (and p) along K inside the kernel (eps 1e-6);
* grouped value attention: q, k, p have ``Hk`` heads, v, beta, g and the state ``H``,
  ``H % Hk == 0``, head ``h`` reads key head ``h // (H // Hk)``.

On CuPy arrays every op is one launch of ``kernels_cu/delta_rule.cu`` with the tiling
:mod:`cupy_comba.tiling` picks: the state is read once, stays in registers across the T tokens
(T = 1 for the steps) and is written once.  NumPy arrays run the float64 reference.
"""

import functools

import numpy

from . import reference
from ._backend import cupy, deliver
from . import tiling
from ._checks import (
    c_strides, check_head_sizes, check_heads, check_outputs, check_state_dtype, check_writable_output, common_device,
    expect_shape, namespace_of, real_scalar, resolve_output_dtype, resolve_scale, signature, span_of,
)
from ._dtypes import ACTIVATION_CODES, ACTIVATION_NAMES, dtype_name, float32
from ._params import pack

_NAMES = ("q", "k", "v", "p", "beta", "g")


def gated_delta_decode_step(state, q, k, v, beta, g, scale=None, *, out=None, state_out=None, o_dtype=None,
                            state_layout="kv", gate="log", use_qk_l2norm=False):
    """One Gated DeltaNet step (the Comba step with ``p = k``) for a decode batch.

    Parameters
    ----------
    state : ndarray, float32, C-contiguous
        ``(B, H, K, V)`` for ``state_layout="kv"``, ``(B, H, V, K)`` for ``"vk"``.
    q, k : ndarray, shape (B, Hk, K)
    v : ndarray, shape (B, H, V)
    beta, g : ndarray, shape (B, H)
    scale : float, optional
        Query scale, ``K ** -0.5`` when None (the metaltile seed and MLX-LM use 1.0).
    out, state_out, o_dtype
        As in :func:`cupy_comba.comba_decode_step`; ``state_out=state`` updates in place.
    state_layout : {"kv", "vk"}
    gate : {"log", "linear"}
    use_qk_l2norm : bool

    Returns
    -------
    state_new : ndarray, float32, the layout of ``state``
    o : ndarray, shape (B, H, V)

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import gated_delta_decode_step
    >>> from cupy_comba.inputs import decode_inputs
    >>> state, q, k, v, _, beta, g = decode_inputs(2, 4, 64, 32, warm_steps=1)
    >>> vk_state = np.ascontiguousarray(state.swapaxes(-1, -2))
    >>> new_vk, o = gated_delta_decode_step(vk_state, q, k, v, beta, np.exp(g), state_layout="vk", gate="linear")
    >>> new_kv, o2 = gated_delta_decode_step(state, q, k, v, beta, g)
    >>> bool(np.allclose(new_vk.swapaxes(-1, -2), new_kv, atol=1e-6)), bool(np.allclose(o, o2))
    (True, True)
    """
    return _run(q, k, v, None, beta, g, scale, state, True, out, state_out, o_dtype, state_layout, gate,
                use_qk_l2norm, step=True)


def comba_forward(q, k, v, p, beta, g, scale=None, *, initial_state=None, output_final_state=True, out=None,
                  state_out=None, o_dtype=None, state_layout="kv", gate="log", use_qk_l2norm=False):
    """T Comba tokens in one launch: the state is read once, kept on chip, written once.

    Parameters
    ----------
    q, k, p : ndarray, shape (B, T, Hk, K)
    v : ndarray, shape (B, T, H, V)
    beta, g : ndarray, shape (B, T, H)
    scale : float, optional
    initial_state : ndarray, float32, optional
        ``(B, H, K, V)`` or ``(B, H, V, K)`` by ``state_layout``; zeros when None.
    output_final_state : bool
        Return the state after the last token (else ``None``, and it is never written).
    out : ndarray, shape (B, T, H, V), optional
    state_out : ndarray, optional
        Buffer for the final state; ``state_out=initial_state`` updates in place.
    o_dtype, state_layout, gate, use_qk_l2norm
        As in :func:`gated_delta_decode_step`.

    Returns
    -------
    o : ndarray, shape (B, T, H, V)
    final_state : ndarray, float32, or None

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import comba_forward, comba_decode_step
    >>> rng = np.random.default_rng(0)
    >>> B, T, H, K, V = 1, 3, 2, 64, 32
    >>> q, k, p = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(3))
    >>> v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    >>> beta, g = np.full((B, T, H), 0.5, np.float32), np.full((B, T, H), -0.1, np.float32)
    >>> o, S = comba_forward(q, k, v, p, beta, g, use_qk_l2norm=True)
    >>> o.shape, S.shape
    ((1, 3, 2, 32), (1, 2, 64, 32))
    """
    return _run(q, k, v, p, beta, g, scale, initial_state, output_final_state, out, state_out, o_dtype,
                state_layout, gate, use_qk_l2norm, step=False)


def gated_delta_forward(q, k, v, beta, g, scale=None, *, initial_state=None, output_final_state=True, out=None,
                        state_out=None, o_dtype=None, state_layout="kv", gate="log", use_qk_l2norm=False):
    """T Gated DeltaNet tokens in one launch (:func:`comba_forward` with ``p = k``; k is read once).

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_comba import gated_delta_forward
    >>> x = np.ones((1, 2, 1, 64), np.float32) / 8
    >>> o, S = gated_delta_forward(x, x, np.ones((1, 2, 1, 32), np.float32), np.ones((1, 2, 1), np.float32),
    ...                            np.zeros((1, 2, 1), np.float32), scale=1.0)
    >>> round(float(o[0, 1, 0, 0]), 6)
    1.0
    """
    return _run(q, k, v, None, beta, g, scale, initial_state, output_final_state, out, state_out, o_dtype,
                state_layout, gate, use_qk_l2norm, step=False)


# ------------------------------------------------------------------------------------------------

def _run(q, k, v, p, beta, g, scale, state, output_final_state, out, state_out, o_dtype, state_layout, gate,
         use_qk_l2norm, *, step, variant=None):
    """Every op of the family: validate (cached per signature), then launch or run the reference.

    ``variant`` forces a kernel tiling (:mod:`cupy_comba.tiling`; benchmarks and tests only).
    """
    if step and state is None:
        raise TypeError("state must be a cupy.ndarray or numpy.ndarray, got NoneType")
    named = {"q": q, "k": k, "v": v, "beta": beta, "g": g}
    if p is not None:
        named["p"] = p
    if state is not None:
        named["state"] = state
    xp = namespace_of(named)
    for name, a in (("out", out), ("state_out", state_out)):
        if a is not None and not isinstance(a, xp.ndarray):
            raise TypeError(f"{name} must be a {xp.__name__} array like the inputs, got {type(a).__name__}")
    device = common_device(dict(named, out=out, state_out=state_out)) if xp is cupy else None
    if scale is not None:
        scale = real_scalar("scale", scale)
    if not isinstance(use_qk_l2norm, (bool, numpy.bool_)):
        raise TypeError(f"use_qk_l2norm must be a bool, got {type(use_qk_l2norm).__name__}")
    if not output_final_state and state_out is not None:
        raise ValueError("state_out was given but output_final_state=False: nothing would be written to it")
    plan = _plan(signature(q), signature(k), signature(v), None if p is None else signature(p), signature(beta),
                 signature(g), None if state is None else signature(state),
                 None if out is None else signature(out), None if o_dtype is None else numpy.dtype(o_dtype),
                 scale, bool(output_final_state), state_layout, gate, bool(use_qk_l2norm), step, device, variant)
    inputs = (q, k, v, p, beta, g, state)
    check_outputs(dict(zip(_NAMES + ("state",), inputs)), plan.spans, out, plan.out_span, state_out,
                  plan.state_shape, "the state's shape")
    if xp is numpy:
        o, S = _numpy_run(plan, inputs, out, state_out, state_layout, gate, bool(use_qk_l2norm))
    else:
        o, S = _cuda_run(plan, inputs, out, state_out)
    return (S, o) if step else (o, S)


class _Plan:
    __slots__ = ("B", "T", "H", "K", "V", "scale", "scale_arg", "o_dtype", "o_shape", "state_shape", "write_final",
                 "spans", "out_span", "kernel", "grid", "block", "params", "step")


@functools.lru_cache(maxsize=256)
def _plan(q, k, v, p, beta, g, state, out, o_dtype, scale, write_final, state_layout, gate, l2norm, step, device,
          variant):
    """Validate one call signature and precompute its launch (cached)."""
    reference._check_options(state_layout, gate)
    sig = {"q": q, "k": k, "v": v, "p": p, "beta": beta, "g": g}
    lead, lead_name = (2, "(B, ") if step else (3, "(B, T, ")
    state_meaning = "(B, H, K, V)" if state_layout == "kv" else "(B, H, V, K)"
    if step and len(state[0]) != 4:
        raise ValueError(f"state must be 4-D {state_meaning}, got shape {state[0]}")
    for name in ("q", "k", "p"):
        if sig[name] is not None and len(sig[name][0]) != lead + 1:
            raise ValueError(f"{name} must be {lead + 1}-D {lead_name}Hk, K), got shape {sig[name][0]}")
    if len(v[0]) != lead + 1:
        raise ValueError(f"v must be {lead + 1}-D {lead_name}H, V), got shape {v[0]}")
    if step:  # a step's sizes come from its state: every other shape is checked against them
        B, H, K, V = state[0] if state_layout == "kv" else (*state[0][:2], state[0][3], state[0][2])
        Hk, T = q[0][1], 1
        if (K, V) != (q[0][-1], v[0][-1]) and (V, K) == (q[0][-1], v[0][-1]):
            want = (B, H, V, K) if state_layout == "kv" else (B, H, K, V)
            raise ValueError(f"state must have shape {state_meaning} for state_layout={state_layout!r} = {want}, "
                             f"got {state[0]} (a state in the other layout?)")
    else:
        (B, T, Hk, K), (H, V) = q[0], v[0][2:]
    check_heads(H, Hk)
    tok = (B,) if step else (B, T)
    for name in ("q", "k", "p"):
        if sig[name] is not None:
            expect_shape(name, sig[name][0], tok + (Hk, K), lead_name + "Hk, K)")
    expect_shape("v", v[0], tok + (H, V), lead_name + "H, V)")
    expect_shape("beta", beta[0], tok + (H,), lead_name + "H)")
    expect_shape("g", g[0], tok + (H,), lead_name + "H)")
    check_head_sizes(K, V)
    for name, s in sig.items():
        if s is None:
            continue
        if s[2] not in ACTIVATION_CODES:
            raise TypeError(f"{name} must be {ACTIVATION_NAMES}, got {dtype_name(s[2])}")
        if any(st % s[2].itemsize for st in s[1]):
            raise ValueError(f"{name} has strides {s[1]} that are not a multiple of its itemsize")
    state_shape = (B, H, K, V) if state_layout == "kv" else (B, H, V, K)
    sname = "state" if step else "initial_state"
    if state is not None:
        expect_shape(sname, state[0], state_shape, f"{state_meaning} for state_layout={state_layout!r}")
        check_state_dtype(sname, state[2])
        if device is not None and B * H and state[1] != c_strides(state[0], 4):
            raise ValueError(f"{sname} must be C-contiguous on the GPU")
    o_shape = tok + (H, V)
    if out is not None:
        check_writable_output("out", out[0], out[1], out[2].itemsize, o_shape, lead_name + "H, V)")
    o_dtype = resolve_output_dtype(out, o_dtype, v[2])

    plan = _Plan()
    plan.B, plan.T, plan.H, plan.K, plan.V, plan.step = B, T, H, K, V, step
    plan.scale, plan.o_dtype, plan.o_shape = resolve_scale(scale, K), o_dtype, o_shape
    plan.scale_arg = numpy.float32(plan.scale)  # the kernel's exact C type, built once
    plan.state_shape, plan.write_final = state_shape, write_final
    plan.spans = tuple(None if s is None else span_of(s[0], s[1], s[2].itemsize)
                       for s in (q, k, v, p, beta, g, state))
    plan.out_span = None if out is None else span_of(out[0], out[1], out[2].itemsize)
    plan.kernel = plan.grid = plan.block = plan.params = None
    if device is None:
        return plan

    def strides(s):  # element strides, with a length-1 T axis inserted for steps
        es = tuple(st // s[2].itemsize for st in s[1])
        return es if not step else es[:1] + (0,) + es[1:]

    o_es = strides((o_shape, out[1] if out is not None else c_strides(o_shape, o_dtype.itemsize), o_dtype))
    values = {"B": B, "T": T, "H": H, "group": H // Hk, "V": V}
    for name in ("q", "k", "p", "v"):
        src = sig[name] if sig[name] is not None else sig["k"]
        last = "v" if name == "v" else "k"
        values.update(zip((f"{name}_sb", f"{name}_st", f"{name}_sh", f"{name}_s{last}"), strides(src)))
        values[f"{name}_t"] = ACTIVATION_CODES[src[2]]
    for name in ("beta", "g"):
        values.update(zip((f"{name}_sb", f"{name}_st", f"{name}_sh"), strides(sig[name])))
        values[f"{name}_t"] = ACTIVATION_CODES[sig[name][2]]
    values.update(zip(("o_sb", "o_st", "o_sh", "o_sv"), o_es))
    values["o_t"] = ACTIVATION_CODES[o_dtype]
    values.update(gate_linear=gate == "linear", l2norm=l2norm, has_initial=state is not None,
                  write_final=write_final)
    plan.params = pack(values)
    # The decode build serves exactly one token from a given state to a written state.
    multi = not (T == 1 and state is not None and write_final)
    variant = variant or tiling.choose(state_layout, K, V, p is not None, multi)
    kernel, grid, block = tiling.launch(state_layout, variant, B * H, K, V, p is not None, multi, device)
    plan.kernel, plan.grid, plan.block = kernel, grid, block
    return plan


def _cuda_run(plan, inputs, out, state_out):
    q, k, v, p, beta, g, state = inputs
    if cupy.cuda.runtime.getDevice() != q.data.device_id:
        with cupy.cuda.Device(q.data.device_id):
            return _cuda_run(plan, inputs, out, state_out)
    for name, a in (("state", state), ("state_out", state_out)):
        if a is not None and a.data.ptr & 15:
            raise ValueError(f"{name} must start on a 16-byte boundary (e.g. a fresh allocation)")
    if out is None:
        out = cupy.empty(plan.o_shape, plan.o_dtype)
    if state_out is None and plan.write_final:
        state_out = cupy.empty(plan.state_shape, float32)
    if plan.B * plan.H:
        src = state if state is not None else out          # not read when there is no initial state
        dst = state_out if state_out is not None else out  # not written when write_final is off
        plan.kernel(plan.grid, plan.block,
                    (src, dst, q, k, v, p if p is not None else k, beta, g, out, plan.params, plan.scale_arg))
    return out, state_out


def _numpy_run(plan, inputs, out, state_out, state_layout, gate, l2norm):
    q, k, v, p, beta, g, state = inputs
    p = k if p is None else p
    options = dict(state_layout=state_layout, gate=gate, use_qk_l2norm=l2norm)
    if state is None:
        state = numpy.zeros(plan.state_shape)
    if plan.step:
        S, o = reference.comba_step(state, q, k, v, p, beta, g, plan.scale, **options)
    else:
        S, o = reference.comba_loop(state, q, k, v, p, beta, g, plan.scale, **options)
    return deliver(o, out, plan.o_dtype), (deliver(S, state_out, float32) if plan.write_final else None)

