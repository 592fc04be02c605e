"""Kernel launches from an argument block packed once per plan, replayed as a CUDA graph.

CuPy's ``RawKernel`` call inspects every argument again on every launch: about 8 us for the
delta-rule kernels' arguments on an H200 host.  A :class:`Launcher`
lays out one plan's arguments once -- fifteen device-pointer slots, the ``Params`` struct
(:func:`pack_params`) and the scale -- so a call writes the pointers and hands them to the driver.

How it hands them over: on the H200 hosts measured (virtual machines) ``cuLaunchKernel``
takes 3.6-5.7 us of host time even for an empty kernel, ``cudaGraphLaunch`` of a one-node graph
2.0-2.6 us (``benchmarks/host_overhead.py``; docs/design.md, "Host path").  So from the second
launch on a stream, a Launcher replays a graph holding its kernel nodes (one; the prefill family's
two or three in a chain), made for that stream by capturing the launches once.  When the pointers
differ from the ones the graph's nodes hold, ``cuGraphExecKernelNodeSetParams`` (the driver API
through ctypes: CuPy does not wrap it; 1.2-1.8 us with the ctypes call, 0.5 us of it the driver's)
gives each node the new ones.  The GPU runs
the same kernel with the same arguments either way.

A stream that is capturing -- the caller building a CUDA graph of their own -- gets the plain
``cuLaunchKernel``: a graph launch cannot be captured (CUDA answers "operation not permitted when
stream is capturing" and invalidates the capture), and the caller's graph then holds an ordinary
kernel node.  ``CUPY_COMBA_GRAPH_LAUNCH=0`` in the environment turns the graph path off; so does
a driver without ``cuGraphExecKernelNodeSetParams_v2`` (CUDA < 12).

A Launcher made ``dependent`` launches its kernels after the first as programmatic dependents of the one before
(``cuLaunchKernelEx``; captured, a programmatic edge of the graph): each may start while the one before finishes,
and waits for it where it first reads what it wrote -- the prefill scan after its prep on GPUs of compute
capability 9.0 (:mod:`cupy_comba._plan`).  ``CUPY_COMBA_PDL=0`` launches them the ordinary way; so does a driver
older than CUDA 12.3.

The long-prompt kernels' scratch memory is the stream's, not the Launcher's (:class:`Workspace`): one buffer a
stream, which every Launcher launching there shares.
"""

import collections
import contextlib
import ctypes
import functools
import os
import sys
import threading

import numpy

from ._backend import cupy
from ._dtypes import ACTIVATION_CODES
from ._validate import INDEX_CODES

#: The kernels' pointer arguments, in order: state, state_out, q, k, v, p, beta, g, o, state_indices,
#: A_log, dt_bias, cu_seqlens, intermediate_states, num_accepted_tokens.
N_POINTERS = 15

#: Field order of ``struct Params`` (kernels_cu/params.cuh); every field is int64.  The fields a dense
#: call reads come first.
PARAMS_FIELDS = (
    "H", "group", "V",
    "q_sb", "q_sh", "q_sk", "k_sb", "k_sh", "k_sk", "p_sb", "p_sh", "p_sk",
    "v_sb", "v_sh", "v_sv", "beta_sb", "beta_sh", "g_sb", "g_sh", "o_sb", "o_sh", "o_sv",
    "q_t", "k_t", "p_t", "v_t", "beta_t", "g_t", "o_t",
    "gate_linear", "l2norm", "grid3",
    "B", "T", "q_st", "k_st", "p_st", "v_st", "beta_st", "g_st", "o_st", "has_initial", "write_final",
    "N", "slot_t", "slot_s", "cu_t", "per_token", "slot_st", "na_t", "gate_softplus", "beta_sigmoid",
    "seg_chunks", "seg_split",
)
PARAMS = numpy.dtype([(name, numpy.int64) for name in PARAMS_FIELDS], align=True)

def pack_params(sig, grid3=False, seg_chunks=0, seg_split=False):
    """``struct Params`` of a signature, as a ``numpy.void`` scalar; ``grid3``: the kernel's grid is (b, h, slab)
    (``families.Kernel.grid3``); ``seg_chunks``: chunks a segment of the segmented prefill scan (0: none);
    ``seg_split``: its prep runs in two launches around the chain (kernels_cu/prefill_prep.cuh, ``PrepSplit``)."""
    a, step = sig.arrays, sig.step

    def strides(s):  # element strides, with a length-1 T axis inserted for steps
        es = s.element_strides()
        return es if not step else es[:1] + (0,) + es[1:]

    o = a["out"]
    o_es = strides(o) if o is not None else _c_strides(sig.o_shape, 1, step)
    values = {"B": sig.B, "T": sig.T, "H": sig.H, "group": sig.H // sig.Hk, "V": sig.V}
    for name in ("q", "k", "p", "v"):
        src = a[name] if a[name] is not None else a["k"]
        last = "v" if name == "v" else "k"
        values.update(zip((f"{name}_sb", f"{name}_st", f"{name}_sh", f"{name}_s{last}"), strides(src)))
        values[f"{name}_t"] = ACTIVATION_CODES[src.dtype]
    for name in ("beta", "g"):
        values.update(zip((f"{name}_sb", f"{name}_st", f"{name}_sh"), strides(a[name])))
        values[f"{name}_t"] = ACTIVATION_CODES[a[name].dtype]
    values.update(zip(("o_sb", "o_st", "o_sh", "o_sv"), o_es))
    values.update(o_t=ACTIVATION_CODES[sig.o_dtype], gate_linear=sig.gate == "linear", l2norm=sig.l2norm, grid3=grid3,
                  has_initial=a["state"] is not None, write_final=sig.write_final, N=sig.N,
                  slot_t=INDEX_CODES[a["state_indices"].dtype] if sig.pool else 0,
                  slot_s=a["state_indices"].element_strides()[0] if sig.pool else 0,
                  slot_st=a["state_indices"].element_strides()[1] if sig.per_token == 2 else 0,
                  per_token=sig.per_token,
                  na_t=INDEX_CODES[a["num_accepted_tokens"].dtype] if a["num_accepted_tokens"] is not None else 0,
                  cu_t=INDEX_CODES[a["cu_seqlens"].dtype] if sig.ragged else 0,
                  gate_softplus=sig.gating, beta_sigmoid=sig.beta_sigmoid, seg_chunks=seg_chunks,
                  seg_split=seg_split)
    if sig.per_token == 2:  # every token's state to its slot: no final store
        values["write_final"] = 0
    if sig.ragged:  # one packed row: each CTA moves its pointers to its sequence's first token
        values.update({f"{n}_sb": 0 for n in ("q", "k", "p", "v", "beta", "g", "o")})
    return numpy.array(tuple(int(values[n]) for n in PARAMS_FIELDS), dtype=PARAMS)[()]


def _c_strides(shape, itemsize, step):
    """Element strides of a C-contiguous array (a zero T stride inserted for steps)."""
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    es = tuple(reversed(strides))
    return es if not step else es[:1] + (0,) + es[1:]


#: Streams a Launch keeps a graph for (a caller cycling through more streams captures again).
MAX_STREAM_GRAPHS = 8


class _KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (cuda.h, CUDA >= 12)."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def libcuda():
    """The CUDA driver library through ctypes (for the entry points CuPy does not wrap), or None; opened once."""
    try:
        return ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _load_driver():
    """``(cuGraphGetNodes, cuGraphExecKernelNodeSetParams_v2, cuGraphKernelNodeGetParams_v2)`` from the
    CUDA driver, or None."""
    if os.environ.get("CUPY_COMBA_GRAPH_LAUNCH", "1") == "0":
        return None
    lib = libcuda()
    try:
        get_nodes, set_params = lib.cuGraphGetNodes, lib.cuGraphExecKernelNodeSetParams_v2
        get_params = lib.cuGraphKernelNodeGetParams_v2
    except AttributeError:  # no driver (None), or one older than CUDA 12
        return None
    get_nodes.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))
    set_params.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    get_params.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    get_nodes.restype = set_params.restype = get_params.restype = ctypes.c_int
    return get_nodes, set_params, get_params


_DRIVER = None if cupy is None else _load_driver()


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an id, padding to 8 bytes, a 64-byte value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h, CUDA >= 12)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the kernel may launch before the one before it on the
#: stream ends, and waits for it with ``griddepcontrol.wait`` (kernels_cu/prefill.cuh, ``await_earlier``).
_PROGRAMMATIC = 6


def _load_launch_ex():
    """``cuLaunchKernelEx`` from the CUDA driver where programmatic dependent launches may be used, or None."""
    if os.environ.get("CUPY_COMBA_PDL", "1") == "0":
        return None
    lib = libcuda()
    version = ctypes.c_int(0)
    try:
        launch, get_version = lib.cuLaunchKernelEx, lib.cuDriverGetVersion
    except AttributeError:
        return None
    # a programmatic launch captured into a graph becomes a programmatic edge from CUDA 12.3 on
    if get_version(ctypes.byref(version)) or version.value < 12030:
        return None
    launch.argtypes = (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    launch.restype = ctypes.c_int
    return launch


_LAUNCH_EX = None if cupy is None else _load_launch_ex()


def dependent_launches():
    """Whether a Launcher made with ``dependent=True`` launches its kernels as programmatic dependents: the driver
    has ``cuLaunchKernelEx`` and ``CUPY_COMBA_PDL`` is not ``0``."""
    return _LAUNCH_EX is not None


def graph_launches():
    """Whether launches on a stream that is not capturing go through CUDA graphs."""
    return _DRIVER is not None


class _StreamGraph:
    """A graph made for one stream, and the pointers its kernel nodes hold."""

    __slots__ = ("graph", "exec", "node", "pointers")


class Launcher:
    """One compiled kernel (after up to two others, launched in turn with the same arguments) with its grid, block
    and constant arguments.

    Parameters
    ----------
    kernel : cupy.RawKernel
        Compiled for the device that is current when the Launcher is made (kept alive here).
    grid : tuple
        CTAs ``(x, y, z)``.
    block : int
        Threads a CTA (in x).
    params : numpy.void
        The packed ``struct Params`` (:func:`pack_params`).
    scale : numpy.float32
    shared_bytes : int
        Dynamic shared memory of each CTA (the kernel's attribute already allows it).
    before : sequence of tuple
        ``(kernel, grid, block, shared_bytes)`` of each kernel launched first, in order (the prefill
        family's ``prefill_prep``, and the segmented scan's chain); one whose grid is empty is left out.
    workspace : int
        Bytes of scratch memory the kernels take in the ``intermediate_states`` pointer slot, from the
        stream's workspace (:func:`workspace`), which every Launcher launching on that stream shares.
    maps : cupy_comba._tma.StageMaps, optional
        The prefill kernels' last argument, pointed at each launch's q, k, p and v.
    dependent : bool
        Launch each kernel after the first as a programmatic dependent of the one before (``cuLaunchKernelEx``;
        the prefill kernels, which wait for it themselves: kernels_cu/prefill.cuh, ``await_earlier``), where the
        driver has them and ``CUPY_COMBA_PDL`` is not ``0``; the kernels' GPU must be of compute capability 9.0
        or later.
    """

    __slots__ = ("kernel", "grid", "block", "params", "scale", "shared_bytes", "_steps", "_slots", "_written", "_keep",
                 "_argv", "_lock", "_graphs", "_node_params", "workspace", "_maps", "_configs")

    def __init__(self, kernel, grid, block, params, scale, shared_bytes=0, *, before=(), workspace=0, maps=None,
                 dependent=False):
        self.kernel, self.grid, self.block, self.params, self.scale = kernel, grid, block, params, scale
        self.shared_bytes, self.workspace = shared_bytes, workspace
        steps = [step for step in before if step[1][0] > 0] + [(kernel, grid, block, shared_bytes)]
        self._steps = tuple((k.kernel.ptr, g, b, s) for k, g, b, s in steps)  # CUfunctions of the current device
        self._slots = (ctypes.c_uint64 * N_POINTERS)()
        self._written = None  # the pointers in the slots
        blob = params.tobytes()
        params_buf = ctypes.create_string_buffer(blob, len(blob))
        scale_buf = ctypes.c_float(float(scale))
        base = ctypes.addressof(self._slots)
        args = [base + 8 * i for i in range(N_POINTERS)] + [ctypes.addressof(params_buf), ctypes.addressof(scale_buf)]
        if maps is not None:
            args.append(maps.address)
        self._maps = maps
        argv = (ctypes.c_void_p * len(args))(*args)
        self._argv = ctypes.addressof(argv)
        nodes = [_KernelNodeParams(fn, g, (b, 1, 1), s, self._argv, None, None, None)
                 for fn, g, b, s in self._steps]
        self._node_params = tuple(ctypes.addressof(n) for n in nodes)
        self._configs = tuple(_programmatic(g, b, s) if i and dependent and dependent_launches() else None
                              for i, (_, g, b, s) in enumerate(self._steps))
        self._keep = (params_buf, scale_buf, argv, nodes, [k for k, *_ in steps])  # read at every launch
        self._lock = threading.Lock()  # one thread at a time writes the pointer slots and launches
        self._graphs = {}  # stream handle -> _StreamGraph, or None after the stream's first launch

    def __call__(self, pointers, device):
        """Launch on the current stream of ``device`` (the kernel's) with the :data:`N_POINTERS`
        device pointers, a tuple, in order."""
        if cupy.cuda.runtime.getDevice() == device:
            self._launch(pointers, cupy.cuda.get_current_stream().ptr, device)
        else:
            with cupy.cuda.Device(device):
                self._launch(pointers, cupy.cuda.get_current_stream().ptr, device)

    def _launch(self, pointers, stream, device, scratch=None):
        if self.workspace and scratch is None:
            # The stream's workspace is held from the prep's launch to the scan's: another Launcher on the stream
            # (from another thread) launches its kernels, which overwrite the records, after these, not between them.
            scratch = workspace(device, stream)
            with scratch.lock:
                self._launch(pointers, stream, device, scratch)
            return
        with self._lock:
            capturing = cupy.cuda.runtime.streamIsCapturing(stream)
            if scratch is not None:
                pointers = pointers[:_WORKSPACE] + (scratch.reserve(self.workspace, capturing),) + \
                    pointers[_WORKSPACE + 1:]
            if pointers != self._written:  # a decode loop that reuses its buffers writes them once
                self._slots[:] = pointers
                self._written = pointers
                if self._maps is not None:
                    self._maps.update((pointers[2], pointers[3], pointers[5], pointers[4]))
            graphs = self._graphs
            if _DRIVER is None or capturing:
                self._launch_kernels(stream)
                return
            graph = graphs.get(stream, False)
            if graph is False:  # a stream's first launch: a one-off call should not pay for a capture
                if len(graphs) >= MAX_STREAM_GRAPHS:
                    graphs.clear()
                graphs[stream] = None
                self._launch_kernels(stream)
                return
            if graph is None:
                graph = graphs[stream] = self._capture(pointers)
            elif graph.pointers != pointers:
                for node, node_params in zip(graph.node, self._node_params):
                    status = _DRIVER[1](graph.exec, node, node_params)
                    if status:
                        raise RuntimeError(f"cuGraphExecKernelNodeSetParams failed with CUresult {status}")
                graph.pointers = pointers
            cupy.cuda.runtime.graphLaunch(graph.exec, stream)

    def _launch_kernels(self, stream):
        # cuLaunchKernel copies the arguments before it returns: the slots are free again.
        for (fn, grid, block, shared), config in zip(self._steps, self._configs):
            if config is None:
                cupy.cuda.driver.launchKernel(fn, *grid, block, 1, 1, shared, stream, self._argv, 0)
                continue
            config.stream = stream
            status = _LAUNCH_EX(ctypes.byref(config), fn, self._argv, None)
            if status:
                raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")

    def _capture(self, pointers):
        """A graph of the kernels with the slots' arguments, captured on a private stream; its kernel
        nodes in launch order (a capture of launches in turn is a chain, which cuGraphGetNodes may list
        in any order: each node is matched to its kernel by its function and grid)."""
        side = cupy.cuda.Stream(non_blocking=True)
        side.begin_capture(cupy.cuda.runtime.streamCaptureModeThreadLocal)
        try:
            self._launch_kernels(side.ptr)
        finally:
            captured = side.end_capture()
        n = len(self._steps)
        count = ctypes.c_size_t(n)
        nodes = (ctypes.c_void_p * n)()
        status = _DRIVER[0](captured.graph, nodes, ctypes.byref(count))
        if status or count.value != n:
            raise RuntimeError(f"cuGraphGetNodes failed with CUresult {status} ({count.value} nodes)")
        order = list(nodes)
        if n > 1:
            by_kernel = {}
            for node in order:
                p = _KernelNodeParams()
                status = _DRIVER[2](node, ctypes.byref(p))
                if status:
                    raise RuntimeError(f"cuGraphKernelNodeGetParams failed with CUresult {status}")
                by_kernel[p.func, tuple(p.grid)] = node
            order = [by_kernel[fn, tuple(grid)] for fn, grid, *_ in self._steps]
        graph = _StreamGraph()
        graph.graph, graph.exec, graph.node, graph.pointers = captured, captured.graphExec, tuple(order), pointers
        return graph


def _programmatic(grid, block, shared_bytes):
    """The ``CUlaunchConfig`` of a programmatic dependent launch (its stream set at each launch); it holds its
    attribute."""
    attribute = _LaunchAttribute(id=_PROGRAMMATIC, value=1)
    config = _LaunchConfig(grid, (block, 1, 1), shared_bytes, None, ctypes.pointer(attribute), 1)
    config._attribute = attribute
    return config


#: The pointer slot the prefill kernels take their workspace in (intermediate_states, which they never keep).
_WORKSPACE = 13
#: Workspaces that a capturing stream used: a captured graph holds their addresses for as long as it lives.
_CAPTURED = {}

#: Streams (of all devices) whose workspaces are kept; the least recently used one past them is let go.
MAX_WORKSPACES = 16
#: Workspaces are allocated in steps of this many bytes.
WORKSPACE_STEP = 1 << 20


class Workspace:
    """The scratch memory of the prefill kernels on one stream: one buffer, shared by every call on the stream and
    grown to the largest call's need.

    Calls on one stream run in turn on the GPU, so each call's records may overwrite the last one's; a serving
    engine's prompts, whose packed lengths differ from step to step, then hold the memory of its largest call, not
    that of every shape it has seen.  ``lock`` is held while a call reserves the buffer and launches its kernels.
    """

    __slots__ = ("buffer", "lock")

    def __init__(self):
        self.buffer = None
        self.lock = threading.Lock()

    def reserve(self, nbytes, capturing):
        """The buffer's device address, grown first to at least ``nbytes``.  A buffer that a capturing stream used
        is kept for good (``_CAPTURED``): the graph holds its address."""
        buf = self.buffer
        if buf is None or buf.nbytes < nbytes:
            # the buffer let go returns to CuPy's pool for this stream: whatever is allocated from it next is
            # written after the kernels queued on the stream that read it
            buf = self.buffer = _allocate(-(-max(nbytes, 1) // WORKSPACE_STEP) * WORKSPACE_STEP)
        if capturing:
            _CAPTURED[id(buf)] = buf
        return buf.data.ptr


def _allocate(nbytes):
    return cupy.empty(nbytes, numpy.uint8)


_WORKSPACES = collections.OrderedDict()  # (device, stream handle, thread or None) -> Workspace, most recent last
_WORKSPACES_GUARD = threading.Lock()


def workspace(device, stream):
    """The :class:`Workspace` of stream handle ``stream`` on ``device``.  ``cudaStreamPerThread`` names each
    thread's own default stream, which gets a workspace a thread."""
    key = _stream_key(device, stream)
    with _WORKSPACES_GUARD:
        found = _WORKSPACES.get(key)
        if found is None:
            found = _WORKSPACES[key] = Workspace()
            while len(_WORKSPACES) > MAX_WORKSPACES:  # a call that holds one it let go keeps it till it ends
                _WORKSPACES.popitem(last=False)
        else:
            _WORKSPACES.move_to_end(key)
    return found


def release_workspace(device, stream):
    """Let go of the workspace of stream handle ``stream`` on ``device`` (a stream about to be destroyed, its work
    done), so that another stream given the handle later does not keep it."""
    with _WORKSPACES_GUARD:
        _WORKSPACES.pop(_stream_key(device, stream), None)


def _stream_key(device, stream):
    return device, stream, threading.get_ident() if stream == _PER_THREAD_STREAM else None


#: ``cudaStreamPerThread``: the handle of the calling thread's default stream.
_PER_THREAD_STREAM = None if cupy is None else cupy.cuda.runtime.streamPerThread


@contextlib.contextmanager
def transient_captures():
    """A block whose CUDA graphs are all destroyed before it ends (the timing helpers'): the workspaces first
    captured inside it are let go on leaving it, where a caller's own captures keep theirs for good.  Not for a
    block that another thread's capture may overlap."""
    kept = set(_CAPTURED)
    try:
        yield
    finally:
        for key in [key for key in _CAPTURED if key not in kept]:
            del _CAPTURED[key]
