"""Kernel launches straight through the CUDA driver, from an argument block packed once per plan.

CuPy's ``RawKernel`` call inspects every argument again on every launch: about 8 us for the
eleven arguments of the delta-rule kernels on the H200 host we measure on, where
``cuLaunchKernel`` itself takes about 5 us (``benchmarks/host_overhead.py``).  A :class:`Launch`
lays out one plan's arguments once -- nine device-pointer slots, the ``Params`` struct and the
scale -- so a call writes the nine pointers and calls the driver.
"""

import ctypes
import threading

from ._backend import cupy

N_POINTERS = 9  # state, state_out, q, k, v, p, beta, g, o: the kernels' pointer arguments, in order


class Launch:
    """One compiled kernel with its grid, block and constant arguments.

    Parameters
    ----------
    kernel : cupy.RawKernel
        Compiled for the device that is current when the Launch is made (kept alive here).
    grid, block : tuple of int
        One-dimensional launch geometry, ``(n,)``.
    params : numpy.void
        The packed ``struct Params`` (:mod:`cupy_comba._params`).
    scale : numpy.float32
    """

    __slots__ = ("kernel", "grid", "block", "params", "scale", "_fn", "_slots", "_written", "_keep", "_argv",
                 "_lock")

    def __init__(self, kernel, grid, block, params, scale):
        self.kernel, self.grid, self.block, self.params, self.scale = kernel, grid, block, params, scale
        self._fn = kernel.kernel.ptr  # the CUfunction of the current device
        self._slots = (ctypes.c_uint64 * N_POINTERS)()
        self._written = None  # the pointers in the slots
        blob = params.tobytes()
        params_buf = ctypes.create_string_buffer(blob, len(blob))
        scale_buf = ctypes.c_float(float(scale))
        base = ctypes.addressof(self._slots)
        argv = (ctypes.c_void_p * (N_POINTERS + 2))(*(base + 8 * i for i in range(N_POINTERS)),
                                                    ctypes.addressof(params_buf), ctypes.addressof(scale_buf))
        self._keep = (params_buf, scale_buf, argv)  # the driver reads these at every launch
        self._argv = ctypes.addressof(argv)
        self._lock = threading.Lock()  # one thread at a time writes the pointer slots and launches

    def __call__(self, pointers, stream):
        """Launch on ``stream`` (a ``CUstream`` handle) with the nine device pointers, a tuple, in order."""
        with self._lock:
            if pointers != self._written:  # a decode loop that reuses its buffers writes them once
                self._slots[:] = pointers
                self._written = pointers
            # cuLaunchKernel copies the arguments before it returns: the slots are free again.
            cupy.cuda.driver.launchKernel(self._fn, self.grid[0], 1, 1, self.block[0], 1, 1, 0, stream, self._argv, 0)
