"""A lean kernel launch: the plan's constant arguments packed once, per call only pointers.

CuPy's ``RawKernel.__call__`` converts every argument on every call (about 10 us for
our eleven arguments, the struct among them).  Here the constant arguments (the ``Params``
struct and the scale) live in arrays built once per launch plan, and a call writes the array
pointers and their addresses into one small buffer and hands it to ``cuLaunchKernel``.
The buffer is made per call, so concurrent calls from several threads never share it;
CUDA copies the arguments at launch, so it may go as soon as the launch returns.
"""

import numpy

from ._backend import cupy


class Launch:
    """``launch(stream_ptr, *pointers)`` runs ``kernel`` on the pointers and the constants."""

    __slots__ = ("_func", "_grid", "_block", "_consts", "_const_addrs", "_n", "_offsets")

    def __init__(self, kernel, grid, block, consts, n_pointers):
        self._func = kernel.kernel.ptr           # the CUfunction on the current device
        self._grid, self._block = grid, block
        self._consts = [numpy.array(c) for c in consts]   # kept alive: their bytes are the arguments
        self._const_addrs = numpy.array([a.ctypes.data for a in self._consts], numpy.uint64)
        self._n = n_pointers
        self._offsets = numpy.arange(n_pointers, dtype=numpy.uint64) * numpy.uint64(8)

    def __call__(self, stream_ptr, *pointers):
        n = self._n
        buf = numpy.empty(2 * n + len(self._consts), numpy.uint64)
        buf[:n] = pointers
        base = buf.__array_interface__["data"][0]
        buf[n:2 * n] = self._offsets + numpy.uint64(base)   # argv[i] -> the i-th pointer value
        buf[2 * n:] = self._const_addrs                      # argv[n + j] -> the j-th constant
        cupy.cuda.driver.launchKernel(self._func, self._grid[0], 1, 1, self._block[0], 1, 1, 0, stream_ptr,
                                      base + 8 * n, 0)
