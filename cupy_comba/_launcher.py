"""Kernel launches from an argument block packed once per plan, replayed as a one-node CUDA graph.

CuPy's ``RawKernel`` call inspects every argument again on every launch: about 8 us for the
eleven arguments of the delta-rule kernels on an H200 host.  A :class:`Launcher`
lays out one plan's arguments once -- nine device-pointer slots, the ``Params`` struct and the
scale -- so a call writes the nine pointers and hands them to the driver.

How it hands them over: on the H200 hosts measured (virtual machines) ``cuLaunchKernel``
takes 3.6-5.7 us of host time even for an empty kernel, ``cudaGraphLaunch`` of a one-node graph
2.0-2.6 us (``benchmarks/host_overhead.py``; docs/design.md, "Host path").  So from the second
launch on a stream, a Launcher replays a graph holding its one kernel node, made for that stream by
capturing the launch once.  When the pointers differ from the ones the graph's node holds,
``cuGraphExecKernelNodeSetParams`` (the driver API through ctypes: CuPy does not wrap it; 1.2-1.8
us with the ctypes call, 0.5 us of it the driver's) gives the node the new ones.  The GPU runs
the same kernel with the same arguments either way.

A stream that is capturing -- the caller building a CUDA graph of their own -- gets the plain
``cuLaunchKernel``: a graph launch cannot be captured (CUDA answers "operation not permitted when
stream is capturing" and invalidates the capture), and the caller's graph then holds an ordinary
kernel node.  ``CUPY_COMBA_GRAPH_LAUNCH=0`` in the environment turns the graph path off; so does
a driver without ``cuGraphExecKernelNodeSetParams_v2`` (CUDA < 12).
"""

import ctypes
import os
import sys
import threading

from ._backend import cupy

N_POINTERS = 9  # state, state_out, q, k, v, p, beta, g, o: the kernels' pointer arguments, in order

#: Streams a Launch keeps a graph for (a caller cycling through more streams captures again).
MAX_STREAM_GRAPHS = 8


class _KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (cuda.h, CUDA >= 12)."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _load_driver():
    """``(cuGraphGetNodes, cuGraphExecKernelNodeSetParams_v2)`` from the CUDA driver, or None."""
    if os.environ.get("CUPY_COMBA_GRAPH_LAUNCH", "1") == "0":
        return None
    try:
        lib = ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")
        get_nodes, set_params = lib.cuGraphGetNodes, lib.cuGraphExecKernelNodeSetParams_v2
    except (OSError, AttributeError):
        return None
    get_nodes.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))
    set_params.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    get_nodes.restype = set_params.restype = ctypes.c_int
    return get_nodes, set_params


_DRIVER = None if cupy is None else _load_driver()


def graph_launches():
    """Whether launches on a stream that is not capturing go through one-node CUDA graphs."""
    return _DRIVER is not None


class _StreamGraph:
    """A one-node graph made for one stream, and the pointers its kernel node holds."""

    __slots__ = ("graph", "exec", "node", "pointers")


class Launcher:
    """One compiled kernel with its grid, block and constant arguments.

    Parameters
    ----------
    kernel : cupy.RawKernel
        Compiled for the device that is current when the Launcher is made (kept alive here).
    grid, block : int
        One-dimensional launch geometry: CTAs, and threads a CTA.
    params : numpy.void
        The packed ``struct Params`` (:mod:`cupy_comba._plan`).
    scale : numpy.float32
    shared_bytes : int
        Dynamic shared memory of each CTA (the kernel's attribute already allows it).
    """

    __slots__ = ("kernel", "grid", "block", "params", "scale", "shared_bytes", "_fn", "_slots", "_written", "_keep",
                 "_argv", "_lock", "_graphs", "_node_params")

    def __init__(self, kernel, grid, block, params, scale, shared_bytes=0):
        self.kernel, self.grid, self.block, self.params, self.scale = kernel, grid, block, params, scale
        self.shared_bytes = shared_bytes
        self._fn = kernel.kernel.ptr  # the CUfunction of the current device
        self._slots = (ctypes.c_uint64 * N_POINTERS)()
        self._written = None  # the pointers in the slots
        blob = params.tobytes()
        params_buf = ctypes.create_string_buffer(blob, len(blob))
        scale_buf = ctypes.c_float(float(scale))
        base = ctypes.addressof(self._slots)
        argv = (ctypes.c_void_p * (N_POINTERS + 2))(*(base + 8 * i for i in range(N_POINTERS)),
                                                    ctypes.addressof(params_buf), ctypes.addressof(scale_buf))
        self._argv = ctypes.addressof(argv)
        node = _KernelNodeParams(self._fn, (grid, 1, 1), (block, 1, 1), shared_bytes, self._argv, None, None,
                                 None)
        self._node_params = ctypes.addressof(node)
        self._keep = (params_buf, scale_buf, argv, node)  # the driver reads these at every launch
        self._lock = threading.Lock()  # one thread at a time writes the pointer slots and launches
        self._graphs = {}  # stream handle -> _StreamGraph, or None after the stream's first launch

    def __call__(self, pointers, device):
        """Launch on the current stream of ``device`` (the kernel's) with the nine device pointers,
        a tuple, in order."""
        if cupy.cuda.runtime.getDevice() == device:
            self._launch(pointers, cupy.cuda.get_current_stream().ptr)
        else:
            with cupy.cuda.Device(device):
                self._launch(pointers, cupy.cuda.get_current_stream().ptr)

    def _launch(self, pointers, stream):
        with self._lock:
            if pointers != self._written:  # a decode loop that reuses its buffers writes them once
                self._slots[:] = pointers
                self._written = pointers
            graphs = self._graphs
            if _DRIVER is None or cupy.cuda.runtime.streamIsCapturing(stream):
                self._launch_kernel(stream)
                return
            graph = graphs.get(stream, False)
            if graph is False:  # a stream's first launch: a one-off call should not pay for a capture
                if len(graphs) >= MAX_STREAM_GRAPHS:
                    graphs.clear()
                graphs[stream] = None
                self._launch_kernel(stream)
                return
            if graph is None:
                graph = graphs[stream] = self._capture(pointers)
            elif graph.pointers != pointers:
                status = _DRIVER[1](graph.exec, graph.node, self._node_params)
                if status:
                    raise RuntimeError(f"cuGraphExecKernelNodeSetParams failed with CUresult {status}")
                graph.pointers = pointers
            cupy.cuda.runtime.graphLaunch(graph.exec, stream)

    def _launch_kernel(self, stream):
        # cuLaunchKernel copies the arguments before it returns: the slots are free again.
        cupy.cuda.driver.launchKernel(self._fn, self.grid, 1, 1, self.block, 1, 1, self.shared_bytes, stream,
                                      self._argv, 0)

    def _capture(self, pointers):
        """A graph of this kernel with the slots' arguments, captured on a private stream."""
        side = cupy.cuda.Stream(non_blocking=True)
        side.begin_capture(cupy.cuda.runtime.streamCaptureModeThreadLocal)
        try:
            self._launch_kernel(side.ptr)
        finally:
            captured = side.end_capture()
        count = ctypes.c_size_t(1)
        node = ctypes.c_void_p()
        status = _DRIVER[0](captured.graph, ctypes.byref(node), ctypes.byref(count))
        if status or count.value != 1:
            raise RuntimeError(f"cuGraphGetNodes failed with CUresult {status} ({count.value} nodes)")
        graph = _StreamGraph()
        graph.graph, graph.exec, graph.node, graph.pointers = captured, captured.graphExec, node.value, pointers
        return graph
