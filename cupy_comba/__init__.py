"""cupy_comba: fused recurrent kernels for Comba and Gated DeltaNet, on CuPy.

Public ops take CuPy arrays (and run a CUDA kernel on their device and the
current stream) or NumPy arrays (and run the float64 reference on the CPU).
"""

from pathlib import Path as _Path

# A source checkout keeps cli/ and kernels_cu/ beside this package; an
# installed wheel has them inside it as cupy_comba.cli / cupy_comba.kernels_cu.
# Make the checkout resolve the same names, so code and tests use one spelling.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "kernels_cu" / "__init__.py").is_file() and not (_Path(__file__).parent / "kernels_cu").exists():
    __path__.append(str(_checkout))  # noqa: F821 - package __path__

from ._backend import gpu_available  # noqa: E402
from ._dtypes import bfloat16  # noqa: E402
from .decode import comba_decode_step, gated_delta_decode_step  # noqa: E402
from .forward import comba_forward, gated_delta_forward  # noqa: E402
from . import families, reference, tiling  # noqa: E402

__version__ = "0.1.0"

__all__ = ["comba_decode_step", "gated_delta_decode_step", "comba_forward", "gated_delta_forward", "reference",
           "families", "tiling", "bfloat16", "gpu_available", "__version__"]
