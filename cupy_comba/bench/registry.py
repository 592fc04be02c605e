"""The benchmark registry: every op the CLI can measure, with its inputs, check and byte count.

An op joins ``cupy-comba bench`` and ``cupy-comba check`` by calling
:func:`register` with a :class:`BenchOp`; the CLI never names ops itself.
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy

from .. import reference
from .._dtypes import bfloat16, float16, float32
from ..comba import VARIANTS, _decode_step, comba_decode_step
from ..recurrent import gated_delta_decode_step
from ..inputs import decode_inputs

#: Error gates of the full-size check: fp32 state, and o by its dtype's rounding.
STATE_TOLERANCE = 1e-5
OUTPUT_TOLERANCE = {bfloat16: 8e-3, float16: 1e-3, float32: 1e-5}


@dataclass
class Case:
    """One op at one shape: inputs built, outputs preallocated and NaN-poisoned."""

    run: Callable[[], object]           # launches the op once (no allocation)
    check: Callable[[], dict]           # runs once, returns {output: relative error}
    bytes_moved: int                    # the spec's byte count for one call
    tolerances: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BenchOp:
    name: str
    dims: tuple                          # names of the shape fields, e.g. ("B", "H", "K", "V")
    prepare: Callable                    # (shape, dtype, xp, seed, variant) -> Case
    variants: tuple = (None,)            # specialisations `check` exercises (None = the default choice)


OPS = {}


def register(op):
    """Add ``op`` to the registry (replacing one of the same name)."""
    OPS[op.name] = op
    return op


def _decode_prepare(comba, layout):
    """A decode-step case: Comba or Gated DeltaNet (``p = k``), state in the ``layout`` given.

    Comba in the "kv" layout takes the kernel ``variant`` (the tuned decode kernels); the
    other ops have one kernel each.
    """

    def prepare(shape, dtype, xp, seed=0, variant=None):
        B, H, K, V = shape
        state, q, k, v, p, beta, g = decode_inputs(B, H, K, V, dtype=dtype, xp=xp, seed=seed)
        if not comba:
            p = k
        if layout == "vk":
            state = xp.ascontiguousarray(xp.swapaxes(state, -1, -2))
        state_out = xp.full(state.shape, numpy.nan, dtype=float32)
        out = xp.full((B, H, V), numpy.nan, dtype=dtype)

        def run():
            if not comba:
                return gated_delta_decode_step(state, q, k, v, beta, g, out=out, state_out=state_out,
                                               state_layout=layout)
            if layout == "kv":
                return _decode_step(state, q, k, v, p, beta, g, None, out, state_out, None, variant)
            return comba_decode_step(state, q, k, v, p, beta, g, out=out, state_out=state_out, state_layout=layout)

        def check():
            state_out.fill(numpy.nan)
            out.fill(numpy.nan)
            run()
            S_ref, o_ref = reference.comba_step(state, q, k, v, p, beta, g, state_layout=layout)
            return {"state": reference.relative_error(state_out, S_ref), "o": reference.relative_error(out, o_ref)}

        isz = numpy.dtype(dtype).itemsize
        nbytes = B * H * (2 * K * V * 4 + (3 if comba else 2) * K * isz + 2 * V * isz + isz + 4)
        return Case(run, check, nbytes, {"state": STATE_TOLERANCE, "o": OUTPUT_TOLERANCE[numpy.dtype(dtype)]})

    return prepare


_DIMS = ("B", "H", "K", "V")
register(BenchOp("comba_decode_step", _DIMS, _decode_prepare(True, "kv"), variants=VARIANTS))
register(BenchOp("gated_delta_decode_step", _DIMS, _decode_prepare(False, "kv")))
register(BenchOp("gated_delta_decode_step[vk]", _DIMS, _decode_prepare(False, "vk")))
register(BenchOp("comba_decode_step[vk]", _DIMS, _decode_prepare(True, "vk")))
