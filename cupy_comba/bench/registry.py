"""The benchmark registry: every op the CLI can measure, with its inputs, check and byte count.

An op joins ``cupy-comba bench`` and ``cupy-comba check`` by calling
:func:`register` with a :class:`BenchOp`; the CLI never names ops itself.
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy

from .. import reference
from .._dtypes import bfloat16, float16, float32
from .. import tiling
from ..recurrent import _run
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
    variants: Callable = lambda shape: (None,)  # shape -> specialisations `check` runs (None = default)


OPS = {}


def register(op):
    """Add ``op`` to the registry (replacing one of the same name)."""
    OPS[op.name] = op
    return op


def _decode_prepare(comba, layout):
    """A decode-step case: Comba or Gated DeltaNet (``p = k``), state in the ``layout`` given,
    run with the decode tiling ``variant`` (None: the one the op chooses)."""

    def prepare(shape, dtype, xp, seed=0, variant=None):
        B, H, K, V = shape
        state, q, k, v, p, beta, g = decode_inputs(B, H, K, V, dtype=dtype, xp=xp, seed=seed)
        if not comba:
            p = k
        if layout == "vk":
            state = xp.ascontiguousarray(xp.swapaxes(state, -1, -2))
        state_out = xp.full(state.shape, numpy.nan, dtype=float32)
        out = xp.full((B, H, V), numpy.nan, dtype=dtype)

        p_arg = p if comba else None

        def run():  # the public ops' own path, with the tiling forced when asked
            return _run(q, k, v, p_arg, beta, g, None, state, True, out, state_out, None, layout, "log", False,
                        step=True, variant=variant)

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


def _tilings(layout):
    return lambda shape: tiling.variants(layout, shape[2], shape[3])


_DIMS = ("B", "H", "K", "V")
register(BenchOp("comba_decode_step", _DIMS, _decode_prepare(True, "kv"), _tilings("kv")))
register(BenchOp("gated_delta_decode_step", _DIMS, _decode_prepare(False, "kv"), _tilings("kv")))
register(BenchOp("gated_delta_decode_step[vk]", _DIMS, _decode_prepare(False, "vk"), _tilings("vk")))
register(BenchOp("comba_decode_step[vk]", _DIMS, _decode_prepare(True, "vk"), _tilings("vk")))
