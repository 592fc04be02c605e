"""Launch plans: what every op does with its arguments, cached per call signature.

:func:`run` is the one path of all four ops.  Plain ``cupy.ndarray`` arguments take the fast
path: a key of a few attribute reads per array finds the call signature's :class:`Plan`
(validated once by :func:`cupy_comba._validate.signature`, with its kernel chosen by
:mod:`cupy_comba.tiling` and its arguments packed), the pointer-dependent checks run again only
when the set of data pointers changes, missing outputs are allocated, and the plan's
:class:`~cupy_comba._launcher.Launcher` launches.  NumPy arrays run the float64 reference
through the same checks; anything else is answered by a TypeError.

The kernels take their shapes, strides and options in one ``struct Params``
(kernels_cu/params.cuh), packed here once per plan.
"""

import numpy

from . import families, reference, tiling
from ._backend import cupy, deliver
from ._dtypes import ACTIVATION_CODES, float32
from ._launcher import Launcher
from . import _validate
from ._validate import ARRAYS

_ND = None if cupy is None else cupy.ndarray

#: Field order of ``struct Params`` (kernels_cu/params.cuh); every field is int64.
PARAMS_FIELDS = (
    "B", "T", "H", "group", "V",
    "q_sb", "q_st", "q_sh", "q_sk",
    "k_sb", "k_st", "k_sh", "k_sk",
    "p_sb", "p_st", "p_sh", "p_sk",
    "v_sb", "v_st", "v_sh", "v_sv",
    "beta_sb", "beta_st", "beta_sh",
    "g_sb", "g_st", "g_sh",
    "o_sb", "o_st", "o_sh", "o_sv",
    "q_t", "k_t", "p_t", "v_t", "beta_t", "g_t", "o_t",
    "gate_linear", "l2norm", "has_initial", "write_final",
)
PARAMS = numpy.dtype([(name, numpy.int64) for name in PARAMS_FIELDS], align=True)

#: Plans by key (see :func:`run`); cleared when it outgrows PLANS_MAX.
PLANS = {}
PLANS_MAX = 256


class Plan:
    """One validated call signature on one device (or the CPU), ready to run.

    ``signature`` is the :class:`~cupy_comba._validate.Signature`; ``kernel`` the
    :class:`~cupy_comba.families.Kernel` and ``variant`` the tiling that runs it (None on the CPU);
    ``launcher`` None when there is nothing to launch (B * H = 0, or the CPU).
    """

    __slots__ = ("signature", "device", "variant", "kernel", "launcher", "pairs", "verified", "o_shape", "o_dtype",
                 "state_shape", "write_final", "step")

    def __init__(self, sig, device):
        self.signature, self.device, self.step, self.write_final = sig, device, sig.step, sig.write_final
        self.o_shape, self.o_dtype, self.state_shape = sig.o_shape, sig.o_dtype, sig.state_shape
        self.pairs = _overlap_pairs(tuple(None if s is None else s.span() for s in sig.arrays.values()))
        self.verified = self.variant = self.kernel = self.launcher = None
        if device is not None:
            self._prepare_launch(sig)

    def _prepare_launch(self, sig):
        a = sig.arrays
        self.variant = sig.variant or tiling.choose(sig.layout, sig.K, sig.V, sig.comba, sig.multi, sig.T,
                                                    sig.B * sig.H)
        f32_keys = any(a[n] is not None and a[n].dtype == float32 for n in ("q", "k", "p"))
        self.kernel = families.kernel(sig.layout, self.variant, K=sig.K, separate_p=sig.comba, multi=sig.multi,
                                      f32_keys=f32_keys)
        if not sig.B * sig.H:
            return
        with cupy.cuda.Device(self.device):
            from ._build import get_kernel

            fn = get_kernel(self.kernel.source, self.kernel.expression, self.device)
            if fn.max_dynamic_shared_size_bytes < self.kernel.shared_bytes:
                fn.max_dynamic_shared_size_bytes = self.kernel.shared_bytes
            self.launcher = Launcher(fn, self.kernel.grid(sig.B * sig.H, sig.V), self.kernel.block, _pack(sig),
                                     numpy.float32(sig.scale), self.kernel.shared_bytes)


def _pack(sig):
    """``struct Params`` of a signature, as a ``numpy.void`` scalar."""
    a, step = sig.arrays, sig.step

    def strides(s):  # element strides, with a length-1 T axis inserted for steps
        es = s.element_strides()
        return es if not step else es[:1] + (0,) + es[1:]

    o = a["out"]
    o_es = strides(o) if o is not None else _c_strides(sig.o_shape, 1, step)
    values = {"B": sig.B, "T": sig.T, "H": sig.H, "group": sig.H // sig.Hk, "V": sig.V}
    for name in ("q", "k", "p", "v"):
        src = a[name] if a[name] is not None else a["k"]
        last = "v" if name == "v" else "k"
        values.update(zip((f"{name}_sb", f"{name}_st", f"{name}_sh", f"{name}_s{last}"), strides(src)))
        values[f"{name}_t"] = ACTIVATION_CODES[src.dtype]
    for name in ("beta", "g"):
        values.update(zip((f"{name}_sb", f"{name}_st", f"{name}_sh"), strides(a[name])))
        values[f"{name}_t"] = ACTIVATION_CODES[a[name].dtype]
    values.update(zip(("o_sb", "o_st", "o_sh", "o_sv"), o_es))
    values.update(o_t=ACTIVATION_CODES[sig.o_dtype], gate_linear=sig.gate == "linear", l2norm=sig.l2norm,
                  has_initial=a["state"] is not None, write_final=sig.write_final)
    return numpy.array(tuple(int(values[n]) for n in PARAMS_FIELDS), dtype=PARAMS)[()]


def _c_strides(shape, itemsize, step):
    """Element strides of a C-contiguous array (a zero T stride inserted for steps)."""
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    es = tuple(reversed(strides))
    return es if not step else es[:1] + (0,) + es[1:]


# -- the one path of every op ------------------------------------------------------------------------

def run(step, state, q, k, v, p, beta, g, scale, write_final, out, state_out, o_dtype, state_layout, gate, l2norm,
        variant):
    """Every op: ``(state_new, o)`` for steps, ``(o, final_state)`` for forward passes.

    ``step``: a decode step (``state`` required, T = 1 axes absent); ``p`` None for Gated
    DeltaNet.  The options as the public ops take them.
    """
    nd = _ND
    if not (type(q) is nd and type(k) is nd and type(v) is nd and type(beta) is nd and type(g) is nd
            and (p is None or type(p) is nd) and (state is None or type(state) is nd)
            and (out is None or type(out) is nd) and (state_out is None or type(state_out) is nd)
            and (write_final is True or write_final is False) and (l2norm is True or l2norm is False)):
        return _run_general(step, (q, k, v, p, beta, g, state, out, state_out), scale, write_final, o_dtype,
                            state_layout, gate, l2norm, variant)
    if scale is not None:
        scale = _validate.real_scalar("scale", scale)
    qd = q.data
    # The plan key: one flat tuple (nested ones hash slower), never read back -- the plan holds the
    # typed signature.  Per array its shape, True in place of the strides of a C-contiguous array
    # (they follow from the shape, and reading the flag is a fifth of the cost of the tuple) and
    # its dtype, three Nones for an absent one; then the options and the device.
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
           o_dtype, scale, write_final, state_layout, gate, l2norm, step, qd.device_id, variant)
    try:
        plan = PLANS.get(key)
    except TypeError:  # an unhashable option: the general path names it
        return _run_general(step, (q, k, v, p, beta, g, state, out, state_out), scale, write_final, o_dtype,
                            state_layout, gate, l2norm, variant)
    if plan is None:
        plan = _new_plan(step, (q, k, v, p, beta, g, state, out, state_out), scale, write_final, o_dtype,
                         state_layout, gate, l2norm, variant, qd.device_id)
        if len(PLANS) >= PLANS_MAX:
            PLANS.clear()
        PLANS[key] = plan
    pointers = (qd.ptr, k.data.ptr, v.data.ptr, None if np_ else p.data.ptr, beta.data.ptr, g.data.ptr,
                None if ns else state.data.ptr, None if no else out.data.ptr, None if nso else state_out.data.ptr)
    if pointers != plan.verified:  # a decode loop often reuses one set of buffers: checked once
        arrays = (q, k, v, p, beta, g, state, out, state_out)
        for a in arrays:
            if a is not None and a.data.device_id != plan.device:
                _validate.common_device(dict(zip(ARRAYS, arrays)))  # raises, naming each array's device
        _check_pointers(pointers, plan.pairs)
        plan.verified = pointers
    if no or (nso and write_final):
        out, state_out, pointers = _fresh_outputs(plan, out, state_out, pointers)
    if plan.launcher is not None:
        plan.launcher(_kernel_pointers(pointers), plan.device)
    return (state_out, out) if step else (out, state_out)


def _new_plan(step, arrays, scale, write_final, o_dtype, state_layout, gate, l2norm, variant, device):
    opts = _validate.options(scale, write_final, arrays[8], o_dtype, state_layout, gate, l2norm, variant)
    sig = _validate.signature(step, arrays[3] is not None, dict(zip(ARRAYS, arrays)), *opts)
    return Plan(sig, device)


def _run_general(step, arrays, scale, write_final, o_dtype, state_layout, gate, l2norm, variant):
    """Anything but plain CuPy arrays with plain options: NumPy arrays run the reference, CuPy
    subclasses the kernel with every check every call; mixed or foreign types raise."""
    named = dict(zip(ARRAYS, arrays))
    if step and named["state"] is None:
        raise TypeError("state must be a cupy.ndarray or numpy.ndarray, got NoneType")
    xp, named = _validate.namespace(named)
    arrays = tuple(named.values())
    device = _validate.common_device(named) if xp is cupy else None
    plan = _new_plan(step, arrays, scale, write_final, o_dtype, state_layout, gate, l2norm, variant, device)
    if xp is not cupy:
        _check_overlaps(tuple(None if a is None else a.__array_interface__["data"][0] for a in arrays), plan.pairs)
        return _run_reference(plan, arrays)
    q, k, v, p, beta, g, state, out, state_out = arrays
    pointers = tuple(None if a is None else a.data.ptr for a in arrays)
    _check_pointers(pointers, plan.pairs)
    if out is None or (state_out is None and plan.write_final):
        out, state_out, pointers = _fresh_outputs(plan, out, state_out, pointers)
    if plan.launcher is not None:
        plan.launcher(_kernel_pointers(pointers), plan.device)
    return (state_out, out) if step else (out, state_out)


def _kernel_pointers(pointers):
    """The kernels' pointer arguments: state (o when there is no initial state: never read),
    state_out (o when none: never written), q, k, v, p (k for Gated DeltaNet), beta, g, o."""
    q, k, v, p, beta, g, s, o, so = pointers
    return (o if s is None else s, o if so is None else so, q, k, v, k if p is None else p, beta, g, o)


def _fresh_outputs(plan, out, state_out, pointers):
    """Allocate the outputs not given, on the inputs' device, apart from everything."""
    with cupy.cuda.Device(plan.device):
        if out is None:
            out = cupy.empty(plan.o_shape, plan.o_dtype)
        if state_out is None and plan.write_final:
            state_out = cupy.empty(plan.state_shape, float32)
    return out, state_out, pointers[:7] + (out.data.ptr, None if state_out is None else state_out.data.ptr)


def _run_reference(plan, arrays):
    q, k, v, p, beta, g, state, out, state_out = arrays
    sig = plan.signature
    p = k if p is None else p
    options = dict(state_layout=sig.layout, gate=sig.gate, use_qk_l2norm=sig.l2norm)
    if state is None:
        state = numpy.zeros(sig.state_shape)
    if sig.step:
        S, o = reference.comba_step(state, q, k, v, p, beta, g, sig.scale, **options)
    else:
        S, o = reference.comba_loop(state, q, k, v, p, beta, g, sig.scale, **options)
    o = deliver(o, out, sig.o_dtype)
    S = deliver(S, state_out, float32) if sig.write_final else None
    return (S, o) if sig.step else (o, S)


# -- pointer checks: per call, when the pointers change ----------------------------------------------

def _overlap_pairs(spans):
    """What :func:`_check_overlaps` tests, worked out once per signature: ``(o, i, olo, ohi, lo, hi)``
    for every output ``o`` and array ``i`` it must not share memory with, both present and non-empty
    (``state_out`` against the inputs, ``out`` against everything else), in :data:`ARRAYS` order,
    with the byte spans of :meth:`ArraySig.span`."""
    pairs = []
    for o, others in ((8, range(7)), (7, (0, 1, 2, 3, 4, 5, 6, 8))):
        if spans[o] is None or spans[o][0] >= spans[o][1]:
            continue
        pairs.extend((o, i, *spans[o], *spans[i]) for i in others
                     if spans[i] is not None and spans[i][0] < spans[i][1])
    return tuple(pairs)


def _check_overlaps(pointers, pairs):
    """Outputs share no memory with inputs or each other; ``state_out`` may be the state itself.

    Memory is compared as byte ranges, first to last element: two views interleaved in one buffer
    overlap even when they share no element (an exact test costs a gcd problem per pair).
    """
    for o, i, olo, ohi, lo, hi in pairs:
        op, ip = pointers[o], pointers[i]
        if ip + lo < op + ohi and op + olo < ip + hi:
            if o == 8 and i == 6:
                if (op + olo, op + ohi) == (ip + lo, ip + hi):
                    continue  # state_out=state: the in-place update
                raise ValueError("state_out partially overlaps state: pass state itself for an in-place "
                                 "update, or a separate buffer")
            raise ValueError(f"{ARRAYS[o]} overlaps {ARRAYS[i]}: outputs must lie apart from the inputs and from "
                             "each other (compared as byte ranges, first to last element: views interleaved in "
                             "one buffer count as overlapping even when they share no element)")


def _check_pointers(pointers, pairs):
    """Outputs apart from inputs, and the state buffers 16-byte aligned (their float4 accesses)."""
    _check_overlaps(pointers, pairs)
    for name, ptr in (("state", pointers[6]), ("state_out", pointers[8])):
        if ptr is not None and ptr & 15:
            raise ValueError(f"{name} must start on a 16-byte boundary (e.g. a fresh allocation)")
