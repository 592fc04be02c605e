"""Every check of the ops' arguments and its message: what was expected and what came.

All of it runs before any work.  :func:`signature` checks one call signature -- each array's
shape, strides and dtype, the options -- and returns what the plan is built from; the plan
module caches it, so a decode loop pays for these checks once.  What depends on the data
pointers (one device, overlaps, alignment, the pool updated in place) is checked per call by
:mod:`cupy_comba._plan`, against the pairs of arrays :func:`signature` lists.
"""

import collections
import math
import numbers

import numpy

from ._backend import cupy
from ._dtypes import ACTIVATION_CODES, ACTIVATION_NAMES, bfloat16, dtype_name, float32, parse_dtype
from . import families

#: Largest finite float32: a scale above it would reach the kernels as inf.
_FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)

INPUTS = ("q", "k", "v", "p", "beta", "g")
#: Every array argument, in the order the plan keeps them; from state_indices on the serving options
#: (docs/serving.md).
ARRAYS = INPUTS + ("state", "out", "state_out", "state_indices", "A_log", "dt_bias", "cu_seqlens",
                   "intermediate_states", "num_accepted_tokens")
#: Those that may be None.
OPTIONAL = ARRAYS[6:] + ("p",)
#: Positions of the state, the outputs and the serving arrays in :data:`ARRAYS`.
STATE, OUT, STATE_OUT, INTERMEDIATE = 6, 7, 8, 13
#: The outputs: what the ops write.
OUTPUTS = (STATE_OUT, OUT, INTERMEDIATE)
#: dtypes of ``state_indices`` and ``cu_seqlens`` and their kernel codes (``Params::slot_t``,
#: ``Params::cu_t``; 0: none).
INDEX_CODES = {numpy.dtype(numpy.int32): 1, numpy.dtype(numpy.int64): 2}


class ArraySig:
    """Shape, byte strides and dtype of one array."""

    __slots__ = ("shape", "strides", "dtype", "itemsize")

    def __init__(self, a):
        self.shape, self.strides, self.dtype = tuple(a.shape), tuple(a.strides), numpy.dtype(a.dtype)
        self.itemsize = self.dtype.itemsize

    def element_strides(self):
        return tuple(s // self.itemsize for s in self.strides)

    def span(self):
        """``(lo, hi)`` byte offsets from the data pointer that the array can touch."""
        lo = hi = 0
        for n, s in zip(self.shape, self.strides):
            if n == 0:
                return 0, 0
            if s < 0:
                lo += (n - 1) * s
            else:
                hi += (n - 1) * s
        return lo, hi + self.itemsize


class Signature:
    """One validated call signature: sizes, resolved options and each array's :class:`ArraySig`."""

    __slots__ = ("step", "comba", "layout", "gate", "l2norm", "write_final", "B", "T", "H", "Hk", "K", "V",
                 "scale", "o_dtype", "o_shape", "state_shape", "arrays", "variant", "multi", "pool", "N",
                 "gating", "beta_sigmoid", "pairs", "ragged", "per_token", "precision", "bf16_keys")


# -- options ---------------------------------------------------------------------------------------

def real_scalar(name, x):
    """A finite real number that float32 holds, as a Python float."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or abs(x) > _FLOAT32_MAX:
        raise ValueError(f"{name} must be finite in float32 (|{name}| <= {_FLOAT32_MAX:.4g}), got {x}")
    return x


def flag(name, x):
    """A bool (``numpy.bool_`` too) as a Python bool; TypeError otherwise."""
    if x is True or x is False or isinstance(x, numpy.bool_):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")


def choice(name, x, allowed):
    if not isinstance(x, str) or x not in allowed:
        raise ValueError(f"{name} must be {' or '.join(map(repr, allowed))}, got {x!r}")
    return x


def output_dtype(o_dtype):
    """``o_dtype`` as a numpy dtype: a dtype, a dtype's name or an alias (``"bf16"``), or None."""
    if o_dtype is None:
        return None
    try:
        dt = parse_dtype(o_dtype) if isinstance(o_dtype, str) else numpy.dtype(o_dtype)
    except TypeError:
        raise TypeError(f"o_dtype must be {ACTIVATION_NAMES} (a dtype, its name or bf16 / fp16 / fp32) or None, "
                        f"got {o_dtype!r}") from None
    if dt not in ACTIVATION_CODES:
        raise TypeError(f"o_dtype must be {ACTIVATION_NAMES}, got {_describe(dt)}")
    return dt


def options(scale, write_final, state_out, o_dtype, state_layout, gate, l2norm, variant, beta_sigmoid, precision=None):
    """Every option checked: ``(scale, write_final, o_dtype, state_layout, gate, l2norm, variant,
    beta_sigmoid, precision)``, each of a type the plan key hashes (Python bools and floats, a numpy dtype)."""
    scale = None if scale is None else real_scalar("scale", scale)
    write_final = flag("output_final_state", write_final)
    if not write_final and state_out is not None:
        raise ValueError("state_out was given but output_final_state=False: nothing would be written to it")
    if variant is not None and not isinstance(variant, str):
        raise TypeError(f"variant must be a variant name (str) or None, got {type(variant).__name__}")
    return (scale, write_final, output_dtype(o_dtype), choice("state_layout", state_layout, ("kv", "vk")),
            choice("gate", gate, ("log", "linear")), flag("use_qk_l2norm", l2norm), variant,
            flag("use_beta_sigmoid", beta_sigmoid),
            None if precision is None else choice("precision", precision, ("tf32", "fp32", "bf16")))


# -- array types -----------------------------------------------------------------------------------

def namespace(named):
    """``(xp, {name: array})`` for ``{name: array or None}``: ``numpy`` or ``cupy``, subclasses
    (``numpy.memmap``, ...) as plain ndarray views; TypeError on anything else, masked arrays and
    a mix of NumPy and CuPy.  ``None`` is allowed for the :data:`OPTIONAL` arrays."""
    kinds, plain = {}, {}
    for name, a in named.items():
        if a is None and name in OPTIONAL:
            plain[name] = None
            continue
        if cupy is not None and isinstance(a, cupy.ndarray):
            kinds.setdefault("cupy", name)
            a = a.view(cupy.ndarray) if type(a) is not cupy.ndarray else a
        elif isinstance(a, numpy.ndarray):
            if isinstance(a, numpy.ma.MaskedArray):
                raise TypeError(f"{name} is a masked array: its mask would be ignored; pass {name}.filled(...) "
                                "or a plain ndarray")
            kinds.setdefault("numpy", name)
            a = a.view(numpy.ndarray) if type(a) is not numpy.ndarray else a
        else:
            raise TypeError(f"{name} must be a cupy.ndarray or numpy.ndarray, got {type(a).__name__}")
        plain[name] = a
    if len(kinds) > 1:
        raise TypeError(f"mixed NumPy and CuPy arrays ({kinds['numpy']} is NumPy, {kinds['cupy']} is CuPy): "
                        "pass all arrays on the GPU (CuPy) or all on the CPU (NumPy)")
    return (cupy if "cupy" in kinds else numpy), plain


def common_device(named):
    """The device id shared by every CuPy array of ``{name: array or None}``; ValueError if they differ."""
    devices = {name: a.data.device_id for name, a in named.items() if a is not None}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{n} on device {d}" for n, d in devices.items())
        raise ValueError(f"all arrays must be on one device, got {where}")
    return next(iter(devices.values()))


# -- shapes, dtypes, layouts -----------------------------------------------------------------------

def _describe(dt):
    if dt.byteorder == ">" or (dt.byteorder == "=" and not dt.isnative):
        return f"big-endian {dt.name} ({dt.str!r}); convert with .astype({dt.name!r})"
    return dtype_name(dt)


def _agree(what, values):
    """The one value of ``{name: value}``; ValueError naming the odd one out (by majority) if they differ."""
    counts = collections.Counter(values.values())
    if len(counts) == 1:
        return next(iter(counts))
    common = counts.most_common(1)[0][0]
    odd = next(n for n, x in values.items() if x != common)
    agree = ", ".join(n for n, x in values.items() if x == common)
    raise ValueError(f"{odd} has {what} = {values[odd]} but {agree} {'has' if ',' not in agree else 'have'} {common}")


def _expect_ndim(name, sig, ndim, meaning):
    if len(sig.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D {meaning}, got shape {sig.shape}")


def _expect_shape(name, shape, expected, meaning):
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(expected)}, got {tuple(shape)}")


def _is_c_contiguous(sig):
    if 0 in sig.shape:
        return True
    acc = sig.itemsize
    for n, st in zip(reversed(sig.shape), reversed(sig.strides)):
        if n != 1 and st != acc:
            return False
        acc *= n
    return True


def _check_state(name, sig, shape, meaning):
    _expect_shape(name, sig.shape, shape, meaning)
    if sig.dtype != float32:
        raise TypeError(f"{name} must be float32 (the recurrent state is kept in fp32), got {_describe(sig.dtype)}")
    if not _is_c_contiguous(sig):
        raise ValueError(f"{name} must be C-contiguous (strides {sig.strides} for shape {sig.shape}); "
                         f"pass numpy/cupy.ascontiguousarray({name})")


def _check_output(name, a, sig, shape, meaning):
    """An output buffer: right shape, writable, and no element written twice."""
    _expect_shape(name, sig.shape, shape, meaning)
    span = sig.itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(sig.shape, sig.strides) if n > 1):
        if stride < span:
            raise ValueError(f"{name} has overlapping elements (strides {sig.strides}): it would be written "
                             "more than once")
        span = stride * n
    if isinstance(a, numpy.ndarray) and not a.flags.writeable:
        raise ValueError(f"{name} is read-only: an output buffer must be writable")


#: The kernels index within a head, a token axis and the grid with 32-bit integers.
INDEX_LIMIT = 2 ** 31 - 1


def _check_strides(name, s):
    """The kernels take strides in elements: each must be a whole number of them."""
    if any(st % s.itemsize for st in s.strides):
        raise ValueError(f"{name} has strides {s.strides} that are not a multiple of its itemsize")


def check_head_sizes(K, V):
    if K not in families.SUPPORTED_K:
        raise NotImplementedError(f"head size K={K} is not supported: supported K are {families.SUPPORTED_K}")
    if V < 32 or V % 32:
        raise NotImplementedError(f"value head size V={V} is not supported: V must be a positive multiple of 32")
    if K * V > INDEX_LIMIT:
        raise ValueError(f"a head of K * V = {K * V} state values is more than the kernels index "
                         f"({INDEX_LIMIT}): V must be at most {INDEX_LIMIT // K}")


#: The most CTAs a launch grid holds in y and in z.
GRID_YZ_LIMIT = 65535


def check_grid(grid, B, H, variant):
    """The launch's grid ``(x, y, z)`` and its B * H heads fit the kernels' 32-bit indices and CUDA's grid."""
    ctas = grid[0] * grid[1] * grid[2]
    if B * H > INDEX_LIMIT or ctas > INDEX_LIMIT:
        raise ValueError(f"B * H = {B * H} heads need {ctas} CTAs; the kernels index at most {INDEX_LIMIT} of "
                         "either: split the batch")
    if max(grid[1:]) > GRID_YZ_LIMIT:
        raise ValueError(f"variant {variant!r} launches a grid of {grid} CTAs, at most {GRID_YZ_LIMIT} in y and z: "
                         f"H = {H} heads is too many for it; leave variant=None")


def _check_pool(sigs, B, N, T=None):
    """``state_indices``: one int32 / int64 slot per batch row (any stride), or with ``T`` one per
    token, ``(B, T)``."""
    idx = sigs["state_indices"]
    if idx.dtype not in INDEX_CODES:
        raise TypeError(f"state_indices must be int32 or int64, got {_describe(idx.dtype)}")
    if T is None:
        _expect_shape("state_indices", idx.shape, (B,), "(B,): one pool slot a batch row,")
    else:
        _expect_shape("state_indices", idx.shape, (B, T), "(B, T): a pool slot for the state after each token,")
    _check_strides("state_indices", idx)
    if N >= 2 ** 31:
        raise ValueError(f"the pool holds {N} states; at most 2**31 - 1 are addressed")


def _check_ragged(sigs, tokens):
    """``cu_seqlens``: int32 / int64 ``(N + 1,)``, N >= 1, with packed activations ``(1, total_T, ...)``.
    Returns N."""
    cu = sigs["cu_seqlens"]
    if cu.dtype not in INDEX_CODES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got {_describe(cu.dtype)}")
    if len(cu.shape) != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape (N + 1,) with N >= 1 sequences, got {cu.shape}")
    _check_strides("cu_seqlens", cu)
    for n in tokens:
        if sigs[n].shape[0] != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along T: {n} must have shape "
                             f"(1, total_T, ...), got {sigs[n].shape}")
    return cu.shape[0] - 1


def _check_verify(sigs, step, ragged, write_final, B, T, state_shape):
    """The speculative-verify options: 0 none, 1 intermediate_states, 2 a slot per token."""
    idx, inter, accepted = sigs["state_indices"], sigs["intermediate_states"], sigs["num_accepted_tokens"]
    two_d = idx is not None and len(idx.shape) == 2
    if accepted is not None and not two_d:
        raise ValueError("num_accepted_tokens picks each row's initial slot among state_indices (B, T): "
                         "it takes 2-D state_indices")
    if inter is None and not two_d:
        return 0
    if step or ragged:
        what = "intermediate_states" if inter is not None else "2-D state_indices"
        raise ValueError(f"{what} keep the state after every token of a forward pass over (B, T) tokens: "
                         f"not {'a decode step' if step else 'with cu_seqlens'}")
    if inter is not None and two_d:
        raise ValueError("intermediate_states and 2-D state_indices are two conventions for the same states: "
                         "pass one")
    if two_d:
        if not write_final:
            raise ValueError("2-D state_indices write the state after every token to its slot: "
                             "output_final_state must be True")
        if accepted is not None:
            if accepted.dtype not in INDEX_CODES:
                raise TypeError(f"num_accepted_tokens must be int32 or int64, got {_describe(accepted.dtype)}")
            _expect_shape("num_accepted_tokens", accepted.shape, (B,), "(B,)")
            _check_strides("num_accepted_tokens", accepted)
        return 2
    shape = (B, T) + state_shape[1:]
    _check_state("intermediate_states", inter, shape, "(B, T) + the state's head shape")
    return 1


def _check_gating(sigs, H, gate):
    """``A_log`` and ``dt_bias``: both or neither, float32 ``(H,)``, contiguous; a log gate."""
    a_log, dt_bias = sigs["A_log"], sigs["dt_bias"]
    if (a_log is None) != (dt_bias is None):
        given, missing = ("A_log", "dt_bias") if dt_bias is None else ("dt_bias", "A_log")
        raise ValueError(f"{given} was given without {missing}: in-kernel gating takes both "
                         "(g = -exp(A_log) * softplus(g + dt_bias))")
    if a_log is None:
        return False
    if gate != "log":
        raise ValueError("A_log and dt_bias compute a log-decay (g = -exp(A_log) * softplus(a + dt_bias)): "
                         f"they take gate='log', got gate={gate!r}")
    for name, s in (("A_log", a_log), ("dt_bias", dt_bias)):
        _expect_shape(name, s.shape, (H,), "(H,): one value a value head,")
        if s.dtype != float32:
            raise TypeError(f"{name} must be float32, got {_describe(s.dtype)}")
        if H > 1 and s.strides[0] != s.itemsize:
            raise ValueError(f"{name} must be contiguous, got strides {s.strides}")
    return True


def signature(step, comba, arrays, scale, write_final, o_dtype, state_layout, gate, l2norm, variant, beta_sigmoid,
              precision=None):
    """Validate one call: ``arrays`` is ``{name: array or None}`` in :data:`ARRAYS` order (plain
    ndarrays), the options as :func:`options` returned them.  Returns a :class:`Signature`."""
    sigs = {n: None if a is None else ArraySig(a) for n, a in arrays.items()}
    pool = sigs["state_indices"] is not None
    state_name = "state" if step else "initial_state"
    lead_state = "N" if pool else "B"
    state_meaning = f"({lead_state}, H, K, V)" if state_layout == "kv" else f"({lead_state}, H, V, K)"
    lead = ("B",) if step else ("B", "T")
    lead_text = "(" + ", ".join(lead) + ", "
    keys = [n for n in ("q", "k", "p") if sigs[n] is not None]
    for n in keys:
        _expect_ndim(n, sigs[n], len(lead) + 2, lead_text + "Hk, K)")
    _expect_ndim("v", sigs["v"], len(lead) + 2, lead_text + "H, V)")
    for n in ("beta", "g"):
        _expect_ndim(n, sigs[n], len(lead) + 1, lead_text + "H)")
    tokens = keys + ["v", "beta", "g"]
    if pool and sigs["state"] is None:
        raise ValueError("state_indices names slots of a state pool: pass the pool as initial_state "
                         f"{state_meaning}")
    if step:  # a step's sizes come from its state
        _expect_ndim("state", sigs["state"], 4, state_meaning)
        s = sigs["state"].shape
        N, H, K, V = s if state_layout == "kv" else (s[0], s[1], s[3], s[2])
        head_k, head_v = sigs["q"].shape[-1], sigs["v"].shape[-1]
        if (K, V) != (head_k, head_v) and (V, K) == (head_k, head_v):
            want = (N, H, V, K) if state_layout == "kv" else (N, H, K, V)
            raise ValueError(f"state must have shape {state_meaning} for state_layout={state_layout!r} = {want}, "
                             f"got {s} (a state in the other layout?)")
        T = 1
        if pool:
            B = _agree("batch B", {n: sigs[n].shape[0] for n in tokens})
        else:
            B = _agree("batch B", {n: sigs[n].shape[0] for n in tokens} | {"state": N})
    else:
        B, T = _agree("(B, T)", {n: sigs[n].shape[:2] for n in tokens})
        H = _agree("value heads H", {n: sigs[n].shape[2] for n in ("v", "beta", "g")})
        K = _agree("head size K", {n: sigs[n].shape[-1] for n in keys})
        V = sigs["v"].shape[-1]
        if sigs["cu_seqlens"] is not None:
            B = _check_ragged(sigs, tokens)  # the sequences: rows of the state and of state_indices
        if pool:
            _expect_ndim(state_name, sigs["state"], 4, state_meaning)
        N = sigs["state"].shape[0] if pool else B
    Hk = _agree("key heads Hk", {n: sigs[n].shape[len(lead)] for n in keys})
    if Hk < 1 or H % Hk:
        raise ValueError(f"value heads H={H} must be a multiple of key heads Hk={Hk} (q, k, p have Hk heads)")
    ragged = sigs["cu_seqlens"] is not None
    tok = (B,) if step else ((1,) if ragged else (B,)) + (T,)
    for n in keys:
        _expect_shape(n, sigs[n].shape, tok + (Hk, K), lead_text + "Hk, K)")
    _expect_shape("v", sigs["v"].shape, tok + (H, V), lead_text + "H, V)")
    for n in ("beta", "g"):
        _expect_shape(n, sigs[n].shape, tok + (H,), lead_text + "H)")
    check_head_sizes(K, V)
    if T > INDEX_LIMIT:
        raise ValueError(f"T = {T} tokens is more than the kernels index ({INDEX_LIMIT}): split the sequence")
    for n in tokens:
        s = sigs[n]
        if s.dtype not in ACTIVATION_CODES:
            raise TypeError(f"{n} must be {ACTIVATION_NAMES}, got {_describe(s.dtype)}")
        _check_strides(n, s)
    state_shape = (N, H, K, V) if state_layout == "kv" else (N, H, V, K)
    if sigs["state"] is not None:
        _check_state(state_name, sigs["state"], state_shape, f"{state_meaning} for state_layout={state_layout!r}")
    if pool:
        two_d = not step and len(sigs["state_indices"].shape) == 2
        _check_pool(sigs, B, N, T if two_d else None)
    gating = _check_gating(sigs, H, gate)
    per_token = _check_verify(sigs, step, ragged, write_final, B, T, state_shape)
    if per_token == 1:
        _check_output("intermediate_states", arrays["intermediate_states"], sigs["intermediate_states"],
                      (B, T) + state_shape[1:], "(B, T) + the state's head shape")
    if sigs["state_out"] is not None:
        _check_output("state_out", arrays["state_out"], sigs["state_out"], state_shape, "the state's shape")
        _check_state("state_out", sigs["state_out"], state_shape, "the state's shape")
    o_shape = tok + (H, V)  # (1, total_T, H, V) for a ragged batch
    if sigs["out"] is not None:
        out = sigs["out"]
        _check_output("out", arrays["out"], out, o_shape, lead_text + "H, V)")
        _check_strides("out", out)
        if out.dtype not in ACTIVATION_CODES:
            raise TypeError(f"out must be {ACTIVATION_NAMES}, got {_describe(out.dtype)}")
        if o_dtype is not None and o_dtype != out.dtype:
            raise TypeError(f"o_dtype={dtype_name(o_dtype)} disagrees with out.dtype={dtype_name(out.dtype)}")
        o_dtype = out.dtype
    multi = ragged or per_token or not (T == 1 and sigs["state"] is not None and write_final)
    bf16_keys = all(sigs[n].dtype == bfloat16 for n in keys)  # the prefill kernels stage those as they are
    if variant is not None:
        # a known name, else ValueError; a variant built for T-token passes only runs one step as one
        multi = multi or families.tiling(state_layout, K, variant).passes_only
        allowed = families.variants(state_layout, K, V, multi, token_loop=bool(per_token))
        if variant not in allowed:
            raise ValueError(f"variant {variant!r} cannot run a {state_layout!r} state with K={K}, V={V}"
                             f"{' over T tokens' if multi else ' for one step'}"
                             f"{' keeping every token' + chr(39) + 's state' if per_token else ''}; "
                             f"expected one of {allowed}")
        t = families.tiling(state_layout, K, variant)
        wide = not bf16_keys
        if t.family == "prefill_scan" and not families.prefill_fits(K, t.slab, comba, wide):
            raise ValueError(f"variant {variant!r} with {'fp32 or fp16' if wide else 'bf16'} q, k, p at K={K} "
                             f"does not fit in shared memory{' (Comba)' if comba else ''}; expected one of "
                             f"{tuple(a for a in allowed if not a.endswith('c64'))} or a 16-column slab for "
                             "Gated DeltaNet")
    sig = Signature()
    sig.step, sig.comba, sig.layout, sig.gate, sig.l2norm, sig.write_final = (step, comba, state_layout, gate, l2norm,
                                                                              write_final)
    sig.B, sig.T, sig.H, sig.Hk, sig.K, sig.V, sig.N = B, T, H, Hk, K, V, N
    sig.pool, sig.gating, sig.beta_sigmoid, sig.ragged, sig.per_token = pool, gating, beta_sigmoid, ragged, per_token
    sig.scale = K ** -0.5 if scale is None else scale
    sig.o_dtype = sigs["v"].dtype if o_dtype is None else o_dtype
    sig.o_shape, sig.state_shape, sig.arrays, sig.variant, sig.multi = o_shape, state_shape, sigs, variant, multi
    if precision is None and (step or any(sigs[n].dtype.itemsize != 2 for n in keys + ["v"])):
        precision = "fp32"  # else None: the half-precision default of forward passes (families.kernel: "bf16")
    sig.precision, sig.bf16_keys = precision, bf16_keys
    sig.pairs = _overlap_pairs(tuple(None if a is None else a.span() for a in sigs.values()), pool)
    return sig


def _overlap_pairs(spans, pool):
    """What the plan's pointer check tests, worked out once per signature: ``(o, i, olo, ohi, lo, hi)``
    for every output ``o`` and array ``i`` it must not share memory with, both present and non-empty
    (each output against every other array, each pair of outputs once), in :data:`ARRAYS` order,
    with the byte spans of :meth:`ArraySig.span`; with a pool, ``(STATE_OUT, STATE, None, ...)``
    asks that state_out be the state itself."""
    pairs = []
    for o in OUTPUTS:
        if spans[o] is None or spans[o][0] >= spans[o][1]:
            continue
        pairs.extend((o, i, *spans[o], *spans[i]) for i in range(len(ARRAYS))
                     if i != o and not (i in OUTPUTS and OUTPUTS.index(i) < OUTPUTS.index(o))  # each pair once
                     and spans[i] is not None and spans[i][0] < spans[i][1])
    if pool and spans[STATE_OUT] is not None:
        pairs.append((STATE_OUT, STATE, None, None, None, None))
    return tuple(pairs)
