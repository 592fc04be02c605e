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

import numpy

from . import reference
from ._backend import cupy, deliver
from . import tiling
from ._checks import (
    c_strides, check_head_sizes, check_heads, check_overlaps, check_state_dtype, check_writable_output, common_device,
    expect_shape, is_c_contiguous, namespace_of, overlap_pairs, ptr_of, real_scalar, resolve_output_dtype,
    resolve_scale, span_of,
)
from ._dtypes import ACTIVATION_CODES, ACTIVATION_NAMES, dtype_name, float32
from ._launch import Launch
from ._params import pack

_NAMES = ("q", "k", "v", "p", "beta", "g")
_ALL_NAMES = _NAMES + ("state", "out", "state_out")
_ND = None if cupy is None else cupy.ndarray


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
    The common case -- every array a plain ``cupy.ndarray`` -- costs a few attribute reads per
    array: the plan is cached per (shape, strides, dtype) signature, and the checks that depend
    on the data pointers (overlaps, alignment, one device) run again only when the pointer set
    differs from the plan's last one.  Anything else takes the general checks, which name the
    problem.
    """
    if step and state is None:
        raise TypeError("state must be a cupy.ndarray or numpy.ndarray, got NoneType")
    if scale is not None:
        scale = real_scalar("scale", scale)
    if use_qk_l2norm is not False and use_qk_l2norm is not True:
        if not isinstance(use_qk_l2norm, numpy.bool_):
            raise TypeError(f"use_qk_l2norm must be a bool, got {type(use_qk_l2norm).__name__}")
        use_qk_l2norm = bool(use_qk_l2norm)
    if output_final_state is not True:
        output_final_state = bool(output_final_state)
        if not output_final_state and state_out is not None:
            raise ValueError("state_out was given but output_final_state=False: nothing would be written to it")
    nd = _ND
    if not (type(q) is nd and type(k) is nd and type(v) is nd and type(beta) is nd and type(g) is nd
            and (p is None or type(p) is nd) and (state is None or type(state) is nd)
            and (out is None or type(out) is nd) and (state_out is None or type(state_out) is nd)):
        return _run_general(q, k, v, p, beta, g, scale, state, output_final_state, out, state_out, o_dtype,
                            state_layout, gate, use_qk_l2norm, step, variant)
    qd = q.data
    # One flat tuple (nested ones hash slower), three Nones for an absent array; True in place of
    # the strides of a C-contiguous array (its strides follow from its shape; reading the flag is
    # a fifth of the cost of building the strides tuple).
    np_, ns, no, nso = p is None, state is None, out is None, state_out is None
    key = (q.shape, q._c_contiguous or q.strides, q.dtype, k.shape, k._c_contiguous or k.strides, k.dtype,
           v.shape, v._c_contiguous or v.strides, v.dtype,
           None if np_ else p.shape, None if np_ else p._c_contiguous or p.strides, None if np_ else p.dtype,
           beta.shape, beta._c_contiguous or beta.strides, beta.dtype, g.shape, g._c_contiguous or g.strides, g.dtype,
           None if ns else state.shape, None if ns else state._c_contiguous or state.strides,
           None if ns else state.dtype,
           None if no else out.shape, None if no else out._c_contiguous or out.strides, None if no else out.dtype,
           None if nso else state_out.shape, None if nso else state_out._c_contiguous or state_out.strides,
           None if nso else state_out.dtype,
           o_dtype, scale, output_final_state, state_layout, gate, use_qk_l2norm, step, qd.device_id, variant)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _cache_plan(key)
    pointers = (qd.ptr, k.data.ptr, v.data.ptr, None if np_ else p.data.ptr, beta.data.ptr, g.data.ptr,
                None if ns else state.data.ptr, None if no else out.data.ptr, None if nso else state_out.data.ptr)
    if pointers != plan.verified:  # a decode loop often reuses one set of buffers: checked once
        arrays = (q, k, v, p, beta, g, state, out, state_out)
        device = plan.device
        for a in arrays:
            if a is not None and a.data.device_id != device:
                common_device(dict(zip(_ALL_NAMES, arrays)))  # raises, naming each array's device
        _check_pointers(pointers, plan.pairs)
        plan.verified = pointers
    if no or (nso and output_final_state):
        out, state_out, pointers = _fresh_outputs(plan, out, state_out, pointers)
    if plan.launch is not None:
        _launch(plan, pointers)
    return (state_out, out) if step else (out, state_out)


def _run_general(q, k, v, p, beta, g, scale, state, write_final, out, state_out, o_dtype, state_layout, gate,
                 l2norm, step, variant):
    """Anything but plain CuPy arrays: NumPy arrays run the reference; mixed or foreign types raise."""
    arrays = (q, k, v, p, beta, g, state, out, state_out)
    xp, device = _general_checks(arrays)
    key = (*(None if a is None else (a.shape, a.strides, numpy.dtype(a.dtype)) for a in arrays), o_dtype, scale,
           write_final, state_layout, gate, l2norm, step, device, variant)
    plan = _make_plan(*key)
    if xp is cupy:  # CuPy arrays of a subclass: the kernel, checked every call
        pointers = tuple(None if a is None else a.data.ptr for a in arrays)
        _check_pointers(pointers, plan.pairs)
        if out is None or (state_out is None and write_final):
            out, state_out, pointers = _fresh_outputs(plan, out, state_out, pointers)
        if plan.launch is not None:
            _launch(plan, pointers)
        o, S = out, state_out
    else:
        check_overlaps([None if a is None else ptr_of(a) for a in arrays], plan.pairs)
        o, S = _numpy_run(plan, arrays, state_layout, gate, l2norm)
    return (S, o) if step else (o, S)


#: Launch plans by call signature (see _run); cleared when it outgrows _PLANS_MAX.
_PLANS = {}
_PLANS_MAX = 256


def _cache_plan(key):
    triples = tuple(None if key[i] is None else
                    (key[i], c_strides(key[i], key[i + 2].itemsize) if key[i + 1] is True else key[i + 1], key[i + 2])
                    for i in range(0, 27, 3))
    plan = _make_plan(*triples, *key[27:])
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _general_checks(arrays):
    """Array types and devices of anything but plain CuPy arrays: ``(xp, device)``."""
    # Required inputs always (None among them is a TypeError that names it); p and state when given.
    named = {n: a for n, a in zip(_ALL_NAMES[:7], arrays[:7]) if a is not None or n not in ("p", "state")}
    xp = namespace_of(named)
    for name, a in zip(_ALL_NAMES[7:], arrays[7:]):
        if a is not None and not isinstance(a, xp.ndarray):
            raise TypeError(f"{name} must be a {xp.__name__} array like the inputs, got {type(a).__name__}")
    return xp, (common_device(dict(zip(_ALL_NAMES, arrays))) if xp is cupy else None)


class _Plan:
    __slots__ = ("B", "T", "H", "K", "V", "scale", "o_dtype", "o_shape", "state_shape", "write_final", "pairs",
                 "launch", "step", "verified", "device")


def _make_plan(q, k, v, p, beta, g, state, out, state_out, o_dtype, scale, write_final, state_layout, gate, l2norm,
               step, device, variant):
    """Validate one call signature -- (shape, strides, dtype) of every array or None, options,
    device -- and precompute its launch."""
    o_dtype = None if o_dtype is None else numpy.dtype(o_dtype)
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
        if device is not None and not is_c_contiguous(*state[:2], 4):
            raise ValueError(f"{sname} must be C-contiguous on the GPU")
    if state_out is not None:
        check_writable_output("state_out", state_out[0], state_out[1], 4, state_shape, "the state's shape")
        check_state_dtype("state_out", state_out[2])
        if not is_c_contiguous(*state_out[:2], 4):
            raise ValueError("state_out must be C-contiguous")
    o_shape = tok + (H, V)
    if out is not None:
        check_writable_output("out", out[0], out[1], out[2].itemsize, o_shape, lead_name + "H, V)")
    o_dtype = resolve_output_dtype(out, o_dtype, v[2])

    plan = _Plan()
    plan.B, plan.T, plan.H, plan.K, plan.V, plan.step = B, T, H, K, V, step
    plan.scale, plan.o_dtype, plan.o_shape = resolve_scale(scale, K), o_dtype, o_shape
    plan.state_shape, plan.write_final = state_shape, write_final
    plan.pairs = overlap_pairs(tuple(None if s is None else span_of(s[0], s[1], s[2].itemsize)
                                     for s in (q, k, v, p, beta, g, state, out, state_out)))
    plan.launch = plan.verified = None
    plan.device = device
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
    # The decode build serves exactly one token from a given state to a written state.
    multi = not (T == 1 and state is not None and write_final)
    variant = variant or tiling.choose(state_layout, K, V, p is not None, multi, T, B * H)
    with cupy.cuda.Device(device):
        f32_keys = any(values[f"{name}_t"] == ACTIVATION_CODES[float32] for name in ("q", "k", "p"))
        kernel, grid, block, smem = tiling.launch(state_layout, variant, B * H, K, V, p is not None, multi, device,
                                                  f32_keys)
        if B * H:  # else nothing to launch: plan.launch stays None
            plan.launch = Launch(kernel, grid, block, pack(values), numpy.float32(plan.scale), smem)
    return plan


def _check_pointers(pointers, pairs):
    """Outputs apart from inputs, and the state buffers 16-byte aligned (their float4 accesses)."""
    check_overlaps(pointers, pairs)
    for name, ptr in (("state", pointers[6]), ("state_out", pointers[8])):
        if ptr is not None and ptr & 15:
            raise ValueError(f"{name} must start on a 16-byte boundary (e.g. a fresh allocation)")


def _fresh_outputs(plan, out, state_out, pointers):
    """Allocate the outputs not given, on the inputs' device, apart from everything."""
    with cupy.cuda.Device(plan.device):
        if out is None:
            out = cupy.empty(plan.o_shape, plan.o_dtype)
        if state_out is None and plan.write_final:
            state_out = cupy.empty(plan.state_shape, float32)
    return out, state_out, pointers[:7] + (out.data.ptr, None if state_out is None else state_out.data.ptr)


def _launch(plan, pointers):
    """The plan's kernel on the current stream of its device.  Kernel pointer order: state (o when
    there is no initial state: never read), state_out (o when none: never written), q, k, v, p (k
    for Gated DeltaNet), beta, g, o."""
    q, k, v, p, beta, g, s, o, so = pointers
    args = (o if s is None else s, o if so is None else so, q, k, v, k if p is None else p, beta, g, o)
    if cupy.cuda.runtime.getDevice() == plan.device:
        plan.launch(args, cupy.cuda.get_current_stream().ptr)
    else:
        with cupy.cuda.Device(plan.device):
            plan.launch(args, cupy.cuda.get_current_stream().ptr)


def _numpy_run(plan, arrays, state_layout, gate, l2norm):
    q, k, v, p, beta, g, state, out, state_out = arrays
    p = k if p is None else p
    options = dict(state_layout=state_layout, gate=gate, use_qk_l2norm=l2norm)
    if state is None:
        state = numpy.zeros(plan.state_shape)
    if plan.step:
        S, o = reference.comba_step(state, q, k, v, p, beta, g, plan.scale, **options)
    else:
        S, o = reference.comba_loop(state, q, k, v, p, beta, g, plan.scale, **options)
    return deliver(o, out, plan.o_dtype), (deliver(S, state_out, float32) if plan.write_final else None)

