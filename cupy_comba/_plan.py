"""Launch plans: what every op does with its arguments, cached per call signature.

:func:`run` is the one path of all four ops.  Plain ``cupy.ndarray`` arguments take the fast
path: a key of a few attribute reads per array finds the call signature's :class:`Plan`
(validated once by :func:`cupy_comba._validate.signature`, with its kernel chosen by
:mod:`cupy_comba.tiling` and its arguments packed), the pointer-dependent checks run again only
when the set of data pointers changes, missing outputs are allocated, and the plan's
:class:`~cupy_comba._launcher.Launcher` launches.  NumPy arrays run the float64 reference
through the same checks; anything else is answered by a TypeError.

The kernels take their shapes, strides and options in one ``struct Params`` (packed once per
plan by :func:`cupy_comba._launcher.pack_params`) and fifteen pointers (:func:`_kernel_pointers`).
"""

import numpy

from . import families, reference, tiling
from ._backend import cupy
from ._dtypes import ACTIVATION_CODES, float32
from ._launcher import Launcher, dependent_launches, pack_params
from ._tma import StageMaps
from . import _validate
from ._validate import ARRAYS, STATE, STATE_OUT

_ND = None if cupy is None else cupy.ndarray

#: The serving arrays' pointers of a call without them.
_NO_SERVING = (None,) * 6

#: Plans by key (see :func:`run`); cleared when it outgrows PLANS_MAX.
PLANS = {}
PLANS_MAX = 256

#: Whether every kernel after a plan's first launches as a programmatic dependent of the one before on compute
#: capability 9.0, not only the scans whose ``families.Kernel.dependent`` is set.  The others measured slower so:
#: the segmented scan's chain and segments on one warpgroup a CTA at K = 128 up to 1.19 times as long (Gated
#: DeltaNet, B = 1, T = 32768, H = 32, ``kv64c64sg``: 1158.0-1174.9 us against 974.0-981.5), and at K = 64 the
#: scans of one-warpgroup CTAs: the wgmma scan over 1-32 heads and the whole transposed scan over 64
#: (h200-prefill-launches.json; docs/design.md, "Host path").  benchmarks/prefill_launches.py sets it.
ALL_DEPENDENT = False

#: The prep's CTAs an SM in its full layout (bf16 keys, K <= 128): where a prep has more CTAs than this many an SM,
#: Gated DeltaNet's runs in its lean layout (``families.Kernel.prep_lean_bytes``), five an SM, and takes 0.91-1.00 of
#: the time (the transposed scan's prep at B = 8, T = 2048, H = 16 84.7-85.2 us against 92.6-92.9, at B = 1, T =
#: 32768, H = 32 299.7-308.0 against 328.7-334.4; at B = 1, T = 4096, H = 16, two waves either way, level); where
#: they fit in one wave of four the lean layout moves nothing ahead, and the room it leaves beside them made the
#: 16-column wgmma scan, launched as its dependent, take 37.2 us against 31.5 at B = 1, T = 1024, H = 16 (one run,
#: two rounds, ``PYTHONPATH=. python benchmarks/prefill_parts.py --shapes ... --variants kv16c64wg kv128c64sg
#: kv64c64wt``; docs/design.md "Long prompts").
LEAN_PREP_WAVE = 4

#: Bytes of the workspace past the records in which the segmented scan's chain tells the segments that it ended
#: (kernels_cu/prefill.cuh, ``kChainDoneWords``).
CHAIN_DONE_BYTES = 128


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
        self.pairs = sig.pairs
        self.verified = self.variant = self.kernel = self.launcher = None
        if device is not None:
            self._prepare_launch(sig)

    def _prepare_launch(self, sig):
        a = sig.arrays
        # a ragged batch by its mean length: the kernel is chosen before its lengths are known; every
        # token's state (speculative verify) is formed by the token loop only
        T = max(1, sig.T // max(sig.B, 1)) if sig.ragged else 1 if sig.per_token else sig.T
        f32_keys = any(a[n] is not None and a[n].dtype == float32 for n in ("q", "k", "p"))
        act = _activation_build(sig)
        limit = shared_limit(self.device)
        cc = cupy.cuda.Device(self.device).compute_capability
        hopper = families.runs_wgmma(cc)
        if sig.variant and families.tiling(sig.layout, sig.K, sig.variant).family in families.WGMMA_FAMILIES and \
                not hopper:
            raise ValueError(f"variant {sig.variant!r} runs on wgmma, on GPUs of compute capability 9.0 only; GPU "
                             f"{self.device} has {cc}")
        # the prefill scan on wgmma: bf16 q, k, p with bf16 products on compute capability 9.0
        wgmma = hopper and sig.bf16_keys and sig.precision in (None, "bf16")
        self.variant = sig.variant or tiling.choose(sig.layout, sig.K, sig.V, sig.comba, sig.multi, T, sig.B * sig.H,
                                                    not sig.bf16_keys, limit, bool(sig.per_token), wgmma=wgmma)
        self.kernel = kernel = families.kernel(sig.layout, self.variant, K=sig.K, separate_p=sig.comba,
                                               multi=sig.multi, f32_keys=f32_keys, precision=sig.precision,
                                               bf16_keys=sig.bf16_keys, act=act,
                                               serving=sig.pool or sig.gating or sig.beta_sigmoid or sig.ragged
                                               or bool(sig.per_token))
        needs = max(kernel.shared_bytes, kernel.prep_shared_bytes, kernel.chain_shared_bytes)
        if needs > limit:  # only a variant the caller names gets here: tiling.choose leaves out what does not fit
            raise ValueError(f"variant {self.variant!r} needs {needs} bytes of shared memory a CTA; GPU {self.device} "
                             f"allows {limit}: leave variant=None to have one chosen that fits")
        if not sig.B * sig.H:
            return
        grid = kernel.grid(sig.B, sig.H, sig.V)
        _validate.check_grid(grid, sig.B, sig.H, self.variant)
        before, workspace, seg_chunks = [], 0, 0
        if kernel.prep:  # the prefill family: every chunk's coefficients first, into a workspace
            slots = families.prefill_slots(sig.B, sig.T, sig.ragged)
            _validate.check_grid((slots * sig.H, 1, 1), sig.B, sig.H, self.variant)
            workspace = slots * sig.H * kernel.record_words * 4
        if kernel.chain:  # the segmented scan: each segment's map after the records; a ragged batch by its mean
            sms = sm_count(self.device)
            segments, seg_chunks = tiling.segments(sig.B * sig.H, sig.V, T, sms, kernel.slab)
            if sig.ragged:  # its segments' CTAs all at once, whatever the lengths
                seg_chunks = tiling.ragged_segment_chunks(seg_chunks, sig.B, sig.H, sig.V, sig.T, sms, kernel.slab)
            chain_grid, grid, seg_maps = kernel.segment_grids(sig.B, sig.T, sig.H, sig.K, sig.V, segments, seg_chunks,
                                                              sig.ragged)
            for g in (chain_grid, grid):
                _validate.check_grid(g, sig.B, sig.H, self.variant)
            workspace += CHAIN_DONE_BYTES + seg_maps * sig.H * kernel.segment_words(sig.K, sig.V) * 4
        dependent = int(cc) >= 90 and (ALL_DEPENDENT or kernel.dependent)
        # the segmented scan's prep in two parts around the chain (kernels_cu/prefill_prep.cuh, PrepSplit): where the
        # launches are dependents, a dense batch, and each row has a segment before its last
        row_chunks = -(-sig.T // families.PREFILL_CHUNK)
        lead = (-(-row_chunks // seg_chunks) - 1) * seg_chunks if kernel.chain else 0
        split = bool(kernel.chain) and dependent and dependent_launches() and not sig.ragged and lead > 0 and \
            1 < sig.B * (row_chunks - lead) <= _validate.GRID_YZ_LIMIT
        with cupy.cuda.Device(self.device):
            from ._build import get_kernel

            def compiled(expression, shared_bytes):  # the kernel, allowed its dynamic shared memory
                fn = get_kernel(kernel.source, expression, self.device)
                if fn.max_dynamic_shared_size_bytes < shared_bytes:
                    fn.max_dynamic_shared_size_bytes = shared_bytes
                return fn

            maps = None
            if kernel.prep:
                prep_bytes = kernel.prep_shared_bytes
                if slots * sig.H > LEAN_PREP_WAVE * sm_count(self.device) and kernel.prep_lean_bytes:
                    prep_bytes = kernel.prep_lean_bytes
                prep = compiled(kernel.prep, prep_bytes)
                if split:  # the lead part, a CTA a (chunk, head) of the rows' segments but their last
                    before.append((prep, (sig.B * lead * sig.H, 1, 1), kernel.prep_block, prep_bytes))
                else:
                    before.append((prep, (slots * sig.H, 1, 1), kernel.prep_block, prep_bytes))
                maps = StageMaps(a["q"], a["k"], a["p"] if a["p"] is not None else a["k"], a["v"], sig.ragged,
                                 2 if sig.bf16_keys else 4, kernel.slab, int(cc) >= 90, kernel.key_pad,
                                 kernel.swizzled_keys)
            if kernel.chain:
                before.append((compiled(kernel.chain, kernel.chain_shared_bytes), chain_grid, kernel.chain_block,
                               kernel.chain_shared_bytes))
                if split:  # the tail part, a CTA a (head, chunk of the rows' last segments)
                    before.append((prep, (sig.H, sig.B * (row_chunks - lead), 1), kernel.prep_block, prep_bytes))
            shared = kernel.shared_bytes
            # the wgmma scan's third stage: where its CTAs take one SM each anyway (more room would leave those
            # past the SMs a second wave) and a row may be long enough to use it
            if kernel.ring_shared_bytes and grid[0] * grid[1] * grid[2] <= sm_count(self.device) and \
                    sig.T >= families.WG_RING_CHUNKS * families.PREFILL_CHUNK and kernel.ring_shared_bytes <= limit:
                shared = kernel.ring_shared_bytes
            self.launcher = Launcher(compiled(kernel.expression, shared), grid, kernel.block,
                                     pack_params(sig, kernel.grid3, seg_chunks, split), numpy.float32(sig.scale),
                                     shared, before=before, workspace=workspace, maps=maps, dependent=dependent)


def _activation_build(sig):
    """The dtype code the decode step is built for (``families.kernel``'s ``act``): where q, k, p, v and o share
    a dtype and a unit stride along their last axis; else None."""
    a = sig.arrays
    rows = [a[n] for n in ("q", "k", "p", "v", "out") if a[n] is not None]
    dtypes = {x.dtype for x in rows} | {numpy.dtype(sig.o_dtype)}
    if len(dtypes) > 1 or any(x.element_strides()[-1] != 1 for x in rows):
        return None
    return ACTIVATION_CODES[dtypes.pop()]


#: Multiprocessors, by device.
_SM_COUNTS = {}


def sm_count(device):
    """The multiprocessors of ``device`` (132 on an H200), read once a device."""
    n = _SM_COUNTS.get(device)
    if n is None:
        n = _SM_COUNTS[device] = cupy.cuda.runtime.deviceGetAttribute(
            cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device)
    return n


#: The opt-in shared memory a CTA may hold, by device (cudaDevAttrMaxSharedMemoryPerBlockOptin).
_SHARED_LIMITS = {}


def shared_limit(device):
    """Bytes of dynamic shared memory a CTA may use on ``device`` (227 KB on an H100 / H200, 163 KB on
    an A100, 99 KB on sm_86 / sm_89 GPUs), read once a device."""
    limit = _SHARED_LIMITS.get(device)
    if limit is None:
        limit = _SHARED_LIMITS[device] = cupy.cuda.runtime.deviceGetAttribute(
            cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
    return limit


# -- the one path of every op ------------------------------------------------------------------------

def run(step, state, q, k, v, p, beta, g, scale, write_final, out, state_out, o_dtype, state_layout, gate, l2norm,
        variant, serving=None, precision=None):
    """Every op: ``(state_new, o)`` for steps, ``(o, final_state)`` for forward passes.

    ``step``: a decode step (``state`` required, T = 1 axes absent); ``p`` None for Gated
    DeltaNet.  The options as the public ops take them; ``serving`` None or ``(state_indices,
    A_log, dt_bias, use_beta_sigmoid, cu_seqlens, intermediate_states, num_accepted_tokens)``
    (docs/serving.md); ``precision`` None, "tf32", "bf16" or "fp32" (forward passes).
    """
    nd = _ND
    if serving is None:
        idx = a_log = dt_bias = cu = inter = accepted = None
        beta_sigmoid = False
    else:
        idx, a_log, dt_bias, beta_sigmoid, cu, inter, accepted = serving
    if (type(q) is nd and type(k) is nd and type(v) is nd and type(beta) is nd and type(g) is nd
            and (p is None or type(p) is nd) and (state is None or type(state) is nd)
            and (out is None or type(out) is nd) and (state_out is None or type(state_out) is nd)
            and (write_final is True or write_final is False) and (l2norm is True or l2norm is False)
            and (precision is None or precision == "tf32" or precision == "fp32" or precision == "bf16")
            and (serving is None or ((idx is None or type(idx) is nd) and (a_log is None or type(a_log) is nd)
                                     and (dt_bias is None or type(dt_bias) is nd) and (cu is None or type(cu) is nd)
                                     and (inter is None or type(inter) is nd)
                                     and (accepted is None or type(accepted) is nd)
                                     and (beta_sigmoid is True or beta_sigmoid is False)))):
        if scale is not None:
            scale = _validate.real_scalar("scale", scale)
        if idx is not None and state_out is None and write_final:
            state_out = state  # a pool is updated in place
        qd = q.data
        # The plan key: one flat tuple (nested ones hash slower), never read back -- the plan holds the
        # typed signature.  Per array its shape, True in place of the strides of a C-contiguous array
        # (they follow from the shape, and reading the flag is a fifth of the cost of the tuple) and
        # its dtype, three Nones for an absent one; then the options and the device.
        np_, ns, no, nso = p is None, state is None, out is None, state_out is None
        key = (q.shape, q._c_contiguous or q.strides, q.dtype, k.shape, k._c_contiguous or k.strides, k.dtype,
               v.shape, v._c_contiguous or v.strides, v.dtype,
               None if np_ else p.shape, None if np_ else p._c_contiguous or p.strides, None if np_ else p.dtype,
               beta.shape, beta._c_contiguous or beta.strides, beta.dtype, g.shape, g._c_contiguous or g.strides,
               g.dtype, None if ns else state.shape, None if ns else state._c_contiguous or state.strides,
               None if ns else state.dtype,
               None if no else out.shape, None if no else out._c_contiguous or out.strides, None if no else out.dtype,
               None if nso else state_out.shape, None if nso else state_out._c_contiguous or state_out.strides,
               None if nso else state_out.dtype,
               o_dtype, scale, write_final, state_layout, gate, l2norm, step, qd.device_id, variant, precision,
               None if serving is None else _serving_key(beta_sigmoid, idx, a_log, dt_bias, cu, inter, accepted))
        arrays = (q, k, v, p, beta, g, state, out, state_out, idx, a_log, dt_bias, cu, inter, accepted)
        try:
            plan = PLANS.get(key)
        except TypeError:  # an unhashable option: the checks name it
            plan = None
            key = None
        if plan is None:
            plan = _new_plan(step, arrays, scale, write_final, o_dtype, state_layout, gate, l2norm, variant,
                             beta_sigmoid, precision, qd.device_id)
            if len(PLANS) >= PLANS_MAX:
                PLANS.clear()
            if key is not None:
                PLANS[key] = plan
        pointers = (qd.ptr, k.data.ptr, v.data.ptr, None if np_ else p.data.ptr, beta.data.ptr, g.data.ptr,
                    None if ns else state.data.ptr, None if no else out.data.ptr,
                    None if nso else state_out.data.ptr) + \
            (_NO_SERVING if serving is None else tuple(None if a is None else a.data.ptr for a in arrays[9:]))
        if pointers != plan.verified:  # a decode loop often reuses one set of buffers: checked once
            _check_pointers(arrays, pointers, plan.device, plan.pairs)
            plan.verified = pointers
        if no or (nso and write_final):
            out, state_out, pointers = _fresh_outputs(plan, out, state_out, pointers)
        if plan.launcher is not None:
            plan.launcher(_kernel_pointers(pointers), plan.device)
        return (state_out, out) if step else (out, state_out)
    return _run_general(step, (q, k, v, p, beta, g, state, out, state_out, idx, a_log, dt_bias, cu, inter, accepted),
                        scale, write_final, o_dtype, state_layout, gate, l2norm, variant, beta_sigmoid, precision)


def serving(state_indices, A_log, dt_bias, use_beta_sigmoid, cu_seqlens=None, intermediate_states=None,
            num_accepted_tokens=None):
    """The serving options as :func:`run` takes them: None when none is used."""
    if (state_indices is None and A_log is None and dt_bias is None and use_beta_sigmoid is False
            and cu_seqlens is None and intermediate_states is None and num_accepted_tokens is None):
        return None
    return state_indices, A_log, dt_bias, use_beta_sigmoid, cu_seqlens, intermediate_states, num_accepted_tokens


def _serving_key(beta_sigmoid, *arrays):
    return (beta_sigmoid,) + tuple(None if a is None else (a.shape, a.strides, a.dtype) for a in arrays)


def _new_plan(step, arrays, scale, write_final, o_dtype, state_layout, gate, l2norm, variant, beta_sigmoid, precision,
              device):
    opts = _validate.options(scale, write_final, arrays[8], o_dtype, state_layout, gate, l2norm, variant,
                             beta_sigmoid, precision)
    sig = _validate.signature(step, arrays[3] is not None, dict(zip(ARRAYS, arrays)), *opts)
    return Plan(sig, device)


def _run_general(step, arrays, scale, write_final, o_dtype, state_layout, gate, l2norm, variant, beta_sigmoid,
                 precision):
    """Anything but plain CuPy arrays with plain options: subclasses are viewed as their base class
    and the options checked, then CuPy arrays take the fast path and NumPy arrays the float64
    reference through the same checks; mixed or foreign types raise."""
    named = dict(zip(ARRAYS, arrays))
    if step and named["state"] is None:
        raise TypeError("state must be a cupy.ndarray or numpy.ndarray, got NoneType")
    xp, named = _validate.namespace(named)
    opts = _validate.options(scale, write_final, named["state_out"], o_dtype, state_layout, gate, l2norm, variant,
                             beta_sigmoid, precision)
    scale, write_final, o_dtype, state_layout, gate, l2norm, variant, beta_sigmoid, precision = opts
    q, k, v, p, beta, g, state, out, state_out, idx, a_log, dt_bias, cu, inter, accepted = named.values()
    if xp is cupy:  # plain arrays and options now: the fast path takes them
        return run(step, state, q, k, v, p, beta, g, scale, write_final, out, state_out, o_dtype, state_layout, gate,
                   l2norm, variant, (idx, a_log, dt_bias, beta_sigmoid, cu, inter, accepted), precision)
    if idx is not None and state_out is None and write_final:
        state_out = state
    arrays = (q, k, v, p, beta, g, state, out, state_out, idx, a_log, dt_bias, cu, inter, accepted)
    plan = _new_plan(step, arrays, *opts, None)
    _check_pointers(arrays, tuple(None if a is None else a.__array_interface__["data"][0] for a in arrays), None,
                    plan.pairs)
    return _run_reference(plan.signature, arrays)


def _kernel_pointers(pointers):
    """The kernels' pointer arguments: state (o when there is no initial state: never read),
    state_out (o when none: never written), q, k, v, p (k for Gated DeltaNet), beta, g, o,
    state_indices, A_log, dt_bias, cu_seqlens, intermediate_states, num_accepted_tokens (0 when
    absent: never read)."""
    q, k, v, p, beta, g, s, o, so, idx, a_log, dt_bias, cu, inter, accepted = pointers
    return (o if s is None else s, o if so is None else so, q, k, v, k if p is None else p, beta, g, o,
            idx or 0, a_log or 0, dt_bias or 0, cu or 0, inter or 0, accepted or 0)


def _fresh_outputs(plan, out, state_out, pointers):
    """Allocate the outputs not given, on the inputs' device, apart from everything."""
    with cupy.cuda.Device(plan.device):
        if out is None:
            out = cupy.empty(plan.o_shape, plan.o_dtype)
        if state_out is None and plan.write_final:
            state_out = cupy.empty(plan.state_shape, float32)
    return out, state_out, pointers[:7] + (out.data.ptr, None if state_out is None else state_out.data.ptr) + \
        pointers[9:]


def _run_reference(sig, arrays):
    """The float64 reference on NumPy arrays, delivered into the outputs (or new arrays) in the
    dtypes the kernels would return; with a pool only the slots of the batch's rows are written."""
    q, k, v, p, beta, g, state, out, state_out, idx, a_log, dt_bias, cu, inter, accepted = arrays
    p = k if p is None else p
    options = dict(state_layout=sig.layout, gate=sig.gate, use_qk_l2norm=sig.l2norm, state_indices=idx, A_log=a_log,
                   dt_bias=dt_bias, use_beta_sigmoid=sig.beta_sigmoid)
    if cu is not None:
        options["cu_seqlens"] = cu
    if sig.per_token == 1:
        options.update(intermediate=True)
    elif sig.per_token == 2:
        options.update(num_accepted_tokens=accepted)
    if state is None:
        state = numpy.zeros(sig.state_shape)
    op = reference.comba_step if sig.step else reference.comba_loop
    S, o, *states = op(state, q, k, v, p, beta, g, sig.scale, **options)
    if sig.per_token == 1:  # the rows that ran: a padding row's are left as they were, as on the GPU
        ran = ... if idx is None else reference.live_rows(idx, state.shape[0])
        inter[ran] = states[0][ran].astype(float32)
    # a ragged batch's rows of no sequence are not written, as on the GPU
    o = _deliver(o, out, sig.o_dtype, None if cu is None else (slice(None), reference.covered_rows(cu, o.shape[1])))
    if not sig.write_final:
        S = None
    else:  # a pool: only the slots of the batch's rows
        S = _deliver(S, state_out, float32, None if idx is None else reference.live_slots(idx, state.shape[0]))
    return (S, o) if sig.step else (o, S)


def _deliver(value, buffer, dtype, where=None):
    """``value`` cast to ``dtype``: into ``buffer`` when the caller handed one over (only its elements ``where``, an
    index, when given), else a new C-contiguous array (as the kernels return; the reference's "vk" states are
    transposed views)."""
    if buffer is None:
        return numpy.ascontiguousarray(value.astype(dtype))
    where = ... if where is None else where
    buffer[where] = value[where].astype(dtype)
    return buffer


# -- pointer checks: per call, when the pointers change ----------------------------------------------

def _check_pointers(arrays, ptrs, device, pairs):
    """Per set of data pointers: every CuPy array on ``device`` (None: NumPy arrays), outputs apart
    from inputs, the state buffers 16-byte aligned (their float4 accesses).

    Memory is compared as byte ranges, first to last element: two views interleaved in one buffer
    overlap even when they share no element (an exact test costs a gcd problem per pair).
    ``state_out`` may be the state itself (the in-place update); with a pool it must be.
    """
    if device is not None:
        for a in arrays:
            if a is not None and a.data.device_id != device:
                _validate.common_device(dict(zip(ARRAYS, arrays)))  # raises, naming each array's device
    for o, i, olo, ohi, lo, hi in pairs:
        op, ip = ptrs[o], ptrs[i]
        if olo is None:  # the pool marker
            if op != ip:
                raise ValueError("with state_indices the pool is updated in place: state_out must be the pool "
                                 "itself (or None)")
            continue
        if ip + lo < op + ohi and op + olo < ip + hi:
            if o == STATE_OUT and i == STATE:
                if (op + olo, op + ohi) == (ip + lo, ip + hi):
                    continue  # state_out=state: the in-place update
                raise ValueError("state_out partially overlaps state: pass state itself for an in-place "
                                 "update, or a separate buffer")
            raise ValueError(f"{ARRAYS[o]} overlaps {ARRAYS[i]}: outputs must lie apart from the inputs and from "
                             "each other (compared as byte ranges, first to last element: views interleaved in "
                             "one buffer count as overlapping even when they share no element)")
    if device is not None:
        for name, ptr in (("state", ptrs[STATE]), ("state_out", ptrs[STATE_OUT])):
            if ptr is not None and ptr & 15:
                raise ValueError(f"{name} must start on a 16-byte boundary (e.g. a fresh allocation)")
