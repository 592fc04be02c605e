"""Dtypes the kernels accept, and their codes on the device side.

The codes must match ``enum DType`` in ``kernels_cu/common.cuh``.
"""

import ml_dtypes
import numpy

bfloat16 = numpy.dtype(ml_dtypes.bfloat16)
float16 = numpy.dtype(numpy.float16)
float32 = numpy.dtype(numpy.float32)

#: Activation dtypes (q, k, v, p, beta, g and o) and their kernel codes.
ACTIVATION_CODES = {float32: 0, float16: 1, bfloat16: 2}
ACTIVATION_NAMES = "bfloat16, float16 or float32"


def dtype_name(dt):
    """Short readable name of a dtype (``bfloat16`` rather than ``|V2``)."""
    return "bfloat16" if dt == bfloat16 else numpy.dtype(dt).name


def parse_dtype(name):
    """Map ``'bf16' | 'bfloat16' | 'fp16' | 'float16' | 'fp32' | 'float32'`` to a dtype."""
    table = {
        "bf16": bfloat16, "bfloat16": bfloat16,
        "fp16": float16, "f16": float16, "float16": float16, "half": float16,
        "fp32": float32, "f32": float32, "float32": float32,
    }
    try:
        return table[str(name).lower()]
    except KeyError:
        raise TypeError(f"unknown dtype {name!r}: expected one of {sorted(table)}") from None
