"""Which array backend runs: CuPy on a CUDA device, or NumPy on the CPU.

CuPy is an optional import so that the package, its float64 reference and its
NumPy path work on a machine with no GPU (and no CuPy at all).
"""

import numpy

try:  # pragma: no cover - depends on the machine
    import cupy
except ImportError:  # pragma: no cover
    cupy = None


def gpu_available():
    """True when CuPy is installed and sees at least one CUDA device."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, driver too old, ...
        return False


def is_cupy_array(x):
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_namespace(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    for a in arrays:
        if is_cupy_array(a):
            return cupy
    return numpy


def deliver(value, buffer, dtype):
    """``value`` cast to ``dtype``: into ``buffer`` when the caller handed one over, else a new array."""
    if buffer is None:
        return value.astype(dtype)
    buffer[...] = value.astype(dtype)
    return buffer
