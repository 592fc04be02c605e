"""Which array backend runs: CuPy on a CUDA device, or NumPy on the CPU.

CuPy is an optional import so that the package, its float64 reference and its
NumPy path work on a machine with no GPU (and no CuPy at all).
"""

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
