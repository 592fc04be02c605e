"""The benchmark registry: every op the CLI can measure, with its inputs, check and byte count.

An op joins ``cupy-comba bench`` and ``cupy-comba check`` by calling :func:`register` with a
:class:`BenchOp`; the CLI never names ops itself.  Decode steps take ``B,H,K,V`` shapes, forward
passes ``B,T,H,K,V``.  Each case runs the public op (with ``variant=`` when a tiling is forced).
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy

from .. import families, reference, tiling
from .._dtypes import bfloat16, float16, float32
from ..decode import comba_decode_step, gated_delta_decode_step
from ..forward import comba_forward, gated_delta_forward
from ..inputs import decode_inputs, forward_inputs

#: Error gates of the full-size check: fp32 state, and o by its dtype's rounding.
STATE_TOLERANCE = 1e-5
OUTPUT_TOLERANCE = {bfloat16: 8e-3, float16: 1e-3, float32: 1e-5}
#: The state's gate where a forward pass of 16-bit activations runs the prefill kernels, whose default
#: products are bf16 (measured 1.6e-3 - 2.1e-3 against float64; docs/design.md).
HALF_PRODUCTS_STATE_TOLERANCE = 4e-3

DECODE_DIMS = ("B", "H", "K", "V")
FORWARD_DIMS = ("B", "T", "H", "K", "V")


@dataclass
class Case:
    """One op at one shape: inputs built, outputs preallocated and NaN-poisoned."""

    run: Callable[[], object]           # launches the op once (no allocation)
    check: Callable[[], dict]           # runs once, returns {output: relative error}
    bytes_moved: int                    # the fewest bytes one call must move
    tolerances: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BenchOp:
    name: str
    dims: tuple                          # names of the shape fields, e.g. ("B", "H", "K", "V")
    prepare: Callable                    # (shape, dtype, xp, seed, variant) -> Case
    variants: Callable                   # shape -> the tilings `check` runs
    layout: str = "kv"

    def heads_and_sizes(self, shape):
        """``(B * H, T, K, V)`` of a shape of this op."""
        s = dict(zip(self.dims, shape))
        return s["B"] * s["H"], s.get("T", 1), s["K"], s["V"]


OPS = {}


def register(op):
    """Add ``op`` to the registry (replacing one of the same name)."""
    OPS[op.name] = op
    return op


def half_products(layout, comba, shape, dtype, variant=None):
    """Whether a forward pass of ``shape`` (B, T, H, K, V) runs the prefill kernels' half-precision
    default: 16-bit activations on the variant forced or the one the tiling chooses."""
    B, T, H, K, V = shape
    chosen = variant or tiling.choose(layout, K, V, comba, True, T, B * H, numpy.dtype(dtype) != bfloat16)
    return numpy.dtype(dtype).itemsize == 2 and families.tiling(layout, K, chosen).family == "prefill_scan"


def _tolerances(dtype, half_products=False):
    return {"state": HALF_PRODUCTS_STATE_TOLERANCE if half_products else STATE_TOLERANCE,
            "o": OUTPUT_TOLERANCE[numpy.dtype(dtype)]}


def _decode_prepare(comba, layout):
    """A decode-step case: Comba or Gated DeltaNet (``p = k``), the state in ``layout``."""

    def prepare(shape, dtype, xp, seed=0, variant=None):
        B, H, K, V = shape
        state, q, k, v, p, beta, g = decode_inputs(B, H, K, V, dtype=dtype, xp=xp, seed=seed, state_layout=layout)
        state_out = xp.full(state.shape, numpy.nan, dtype=float32)
        out = xp.full((B, H, V), numpy.nan, dtype=dtype)
        opts = dict(out=out, state_out=state_out, state_layout=layout, variant=variant)

        def run():
            if comba:
                return comba_decode_step(state, q, k, v, p, beta, g, **opts)
            return gated_delta_decode_step(state, q, k, v, beta, g, **opts)

        def check():
            state_out.fill(numpy.nan)
            out.fill(numpy.nan)
            run()
            S_ref, o_ref = reference.comba_step(state, q, k, v, p if comba else k, beta, g, state_layout=layout)
            return {"state": reference.relative_error(state_out, S_ref), "o": reference.relative_error(out, o_ref)}

        isz = numpy.dtype(dtype).itemsize
        nbytes = B * H * (2 * K * V * 4 + (3 if comba else 2) * K * isz + 2 * V * isz + isz + 4)
        return Case(run, check, nbytes, _tolerances(dtype))

    return prepare


def _forward_prepare(comba, layout):
    """A forward-pass case: T tokens from a warmed state, the final state written."""

    def prepare(shape, dtype, xp, seed=0, variant=None):
        B, T, H, K, V = shape
        q, k, v, p, beta, g, state = forward_inputs(B, T, H, K, V, dtype=dtype, xp=xp, seed=seed, state_layout=layout)
        state_out = xp.full(state.shape, numpy.nan, dtype=float32)
        out = xp.full((B, T, H, V), numpy.nan, dtype=dtype)
        opts = dict(initial_state=state, out=out, state_out=state_out, state_layout=layout, variant=variant)

        def run():
            if comba:
                return comba_forward(q, k, v, p, beta, g, **opts)
            return gated_delta_forward(q, k, v, beta, g, **opts)

        def check():
            state_out.fill(numpy.nan)
            out.fill(numpy.nan)
            run()
            S_ref, o_ref = reference.comba_loop(state, q, k, v, p if comba else k, beta, g, state_layout=layout)
            return {"state": reference.relative_error(state_out, S_ref), "o": reference.relative_error(out, o_ref)}

        isz = numpy.dtype(dtype).itemsize
        per_token = (3 if comba else 2) * K * isz + 2 * V * isz + isz + 4
        nbytes = B * H * (2 * K * V * 4 + T * per_token)
        return Case(run, check, nbytes, _tolerances(dtype, half_products(layout, comba, shape, dtype, variant)))

    return prepare


def _variants(layout, multi):
    if multi:
        return lambda shape: families.variants(layout, shape[3], shape[4], multi=True)
    return lambda shape: families.variants(layout, shape[2], shape[3])


for _comba, _name in ((True, "comba"), (False, "gated_delta")):
    for _layout in ("kv", "vk"):
        _tag = "" if _layout == "kv" else "[vk]"
        register(BenchOp(f"{_name}_decode_step{_tag}", DECODE_DIMS, _decode_prepare(_comba, _layout),
                         _variants(_layout, False), _layout))
        register(BenchOp(f"{_name}_forward{_tag}", FORWARD_DIMS, _forward_prepare(_comba, _layout),
                         _variants(_layout, True), _layout))
