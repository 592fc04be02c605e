"""flash-linear-attention's Gated DeltaNet and Comba calls on torch tensors, run by cupy_comba's kernels.

The four functions take flash-linear-attention 0.6's names, argument order and defaults, so that a
model written against ``fla.ops`` switches by changing its import::

    from cupy_comba.interop.torch import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

What every call does:

- **Zero copies.** q, k, v, p, g, beta, the state and the index arrays reach the kernels as they
  are (CuPy views of the tensors' memory; strided views and bf16 included); ``o`` and the final
  state are allocated by torch, on the tensors' device, and written by the kernel.  The one copy: a
  dense ``initial_state`` that is not float32 is converted (the kernels keep float32 states).
- **torch's stream.** The kernel runs on the current torch stream of the tensors' device, ordered
  with the caller's torch work, so nothing needs synchronising; under ``torch.cuda.graph`` the
  call is captured into the caller's graph.
- **Both families, one kernel set.** ``chunk_*`` and ``fused_recurrent_*`` run the same kernels
  (the library picks the token loop or the tensor-core kernel by shape); the two names are kept so
  that either call site ports unchanged.
- **vLLM's serving keywords** on every function: ``ssm_state_indices`` (a pool slot a sequence,
  ``(N,)``, or a slot per token, ``(N, T)``; a negative index is a padding row, as vLLM's
  ``PAD_SLOT_ID = -1``), ``num_accepted_tokens`` and ``inplace_final_state`` (the pool is updated
  in place and returned; vLLM's default, True).

The math is cupy_comba's (docs/api.md).  For Gated DeltaNet that is flash-linear-attention's.  For
Comba it is not: flash-linear-attention's ``chunk_comba`` / ``fused_recurrent_comba`` read the state
with p before the decay, cupy_comba after it (``u = beta (v - e S^T p)``), so the two compute
different functions; the Comba calls here keep flash-linear-attention's signatures and compute
cupy_comba's.

Not supported (a clear error, never a silent difference): per-key or per-value decays (``gk``,
``gv``), ``allow_neg_eigval``, context parallelism (``cp_context``), CPU tensors.  Accepted and
unused: ``chunk_size``, ``chunk_indices`` and ``cu_seqlens_cpu`` (the kernels need no host copy of the
bounds).
"""

from contextlib import contextmanager

import numpy

from .._backend import cupy
from .._dtypes import bfloat16
from . import _fla

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_comba", "fused_recurrent_comba"]


def _torch():
    import torch  # imported when a function is called: torch is never a dependency

    return torch


class _StreamHandle:
    """A CUDA stream handle in the CUDA stream protocol, which CuPy's ``Stream.from_external`` takes."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle


class _Frame:
    """torch tensors for :func:`cupy_comba.interop._fla.run`: outputs and defaults allocated by torch (so a
    call inside ``torch.cuda.graph`` allocates from the graph's pool), the kernel on torch's stream."""

    _streams = {}  # (device index, stream handle) -> cupy.cuda.Stream over torch's stream
    MAX_STREAMS = 64
    # (data pointer, shape, strides, dtype) -> the CuPy view of that memory: an engine hands over the same buffers
    # call after call.  A view holds no reference to its tensor, which would keep the tensor alive: it is used only
    # within a call, while the caller holds the tensor, and the same address, shape, strides and dtype name the
    # same elements whichever tensor holds them now.
    _views = {}
    MAX_VIEWS = 512

    def __init__(self):
        self.torch = torch = _torch()
        self.dtypes = {torch.float32: numpy.float32, torch.float16: numpy.float16, torch.bfloat16: bfloat16,
                       torch.int32: numpy.int32, torch.int64: numpy.int64}
        # The handle of a device's current stream: the raw getter that torch's compiled code calls, where this
        # build of torch has it, skips making a torch.cuda.Stream object on every call.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.stream_handle = (lambda device: raw(device.index)) if raw else \
            (lambda device: torch.cuda.current_stream(device).cuda_stream)

    def device(self, q, k, v):
        for n, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, self.torch.Tensor):
                raise TypeError(f"{n} must be a torch.Tensor, got {type(x).__name__}")
        if q.device.type != "cuda":
            raise ValueError(f"the kernels run on CUDA tensors; q is on {q.device}")
        return q.device

    def full(self, shape, value, device):
        return self.torch.full(shape, value, dtype=self.torch.float32, device=device)

    def float32(self, x):
        return x.to(self.torch.float32).contiguous()

    def pool(self, state):
        return state  # updated in place

    def empty(self, shape, like, device):
        return self.torch.empty(shape, dtype=self.torch.float32 if like is None else like.dtype, device=device)

    @contextmanager
    def on(self, device):
        handle = self.stream_handle(device)
        key = (device.index, handle)
        with cupy.cuda.Device(device.index):
            stream = self._streams.get(key)
            if stream is None:
                if len(self._streams) >= self.MAX_STREAMS:
                    self._streams.clear()
                stream = self._streams[key] = cupy.cuda.Stream.from_external(_StreamHandle(handle))
            with stream:
                yield

    def cupy(self, x, name, device):
        if x is None:
            return None
        if not isinstance(x, self.torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, q on {device}: every tensor must be on q's device")
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        dtype = self.dtypes.get(x.dtype)
        if dtype is None:  # not a dtype the kernels take: DLPack carries it, and the op names what it expects
            return cupy.from_dlpack(x.detach())
        # The same memory, viewed from the tensor's pointer, shape and strides: torch's __dlpack__ costs about
        # 30 us of host time a tensor, and the kernel is ordered with torch's work by running on its stream.
        itemsize, shape, strides = x.element_size(), tuple(x.shape), x.stride()
        extent = 0 if x.numel() == 0 else (1 + sum((n - 1) * st for n, st in zip(shape, strides))) * itemsize
        memory = cupy.cuda.UnownedMemory(key[0], extent, None, device.index)
        view = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), tuple(st * itemsize for st in strides))
        if len(self._views) >= self.MAX_VIEWS:
            self._views.clear()
        self._views[key] = view
        return view

    def results(self, o, final_state):
        return o, final_state


_DOCS = {
    "chunk_gated_delta_rule": """Gated DeltaNet over T tokens: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
    on cupy_comba's kernels.

    Parameters
    ----------
    q, k : torch.Tensor, shape (B, T, H, K)
    v : torch.Tensor, shape (B, T, HV, V)
        HV a multiple of H (grouped value attention); bf16, fp16 or fp32, any strides.
    g : torch.Tensor, shape (B, T, HV)
        Log decay (``use_gate_in_kernel=False``), or the raw gate input ``a`` of
        ``g = -exp(A_log) softplus(a + dt_bias)``.
    beta : torch.Tensor, shape (B, T, HV)
        Step sizes, or their logits with ``use_beta_sigmoid_in_kernel=True``.
    scale : float, optional
        ``K ** -0.5`` when None.
    initial_state : torch.Tensor, shape (N, HV, K, V), optional
        ``(N, HV, V, K)`` with ``state_v_first``; zeros when None.  With ``ssm_state_indices``, a pool
        (float32) of any number of slots.
    output_final_state : bool
        Return the state after the last token (float32), else None.
    use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, state_v_first, cu_seqlens
        As in flash-linear-attention 0.6 (``cu_seqlens (N + 1,)``, with B = 1 packed tensors).
    use_gate_in_kernel, A_log, dt_bias
        In-kernel gating; A_log and dt_bias ``(HV,)``.
    ssm_state_indices : torch.Tensor, int32 or int64, shape (N,) or (N, T), optional
        vLLM's pool slots (a negative one: a padding row, o zeros, its slot untouched).
    num_accepted_tokens : torch.Tensor, shape (N,), optional
        With 2-D ``ssm_state_indices``: row n starts from slot ``[n, num_accepted_tokens[n] - 1]``.
    inplace_final_state : bool
        With ``ssm_state_indices``: update the pool in place (the only form: True).

    Returns
    -------
    o : torch.Tensor, shape (B, T, HV, V), v's dtype
    final_state : torch.Tensor or None
        The pool itself with ``ssm_state_indices``; a new float32 ``(N, HV, K, V)`` tensor with
        ``output_final_state``; else None.

    Examples
    --------
    >>> import torch
    >>> from cupy_comba.interop.torch import chunk_gated_delta_rule
    >>> q, k = (torch.nn.functional.normalize(torch.randn(1, 8, 2, 64, device="cuda"), dim=-1) for _ in "qk")
    >>> v, g = torch.randn(1, 8, 4, 64, device="cuda"), -torch.rand(1, 8, 4, device="cuda")
    >>> o, ht = chunk_gated_delta_rule(q, k, v, g, torch.rand(1, 8, 4, device="cuda"), output_final_state=True)
    >>> tuple(o.shape), tuple(ht.shape)
    ((1, 8, 4, 64), (1, 4, 64, 64))
    """,

    "fused_recurrent_gated_delta_rule": """Gated DeltaNet over T tokens (decode: T = 1):
    ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` on cupy_comba's kernels, with vLLM's
    ``ssm_state_indices``, ``num_accepted_tokens`` and ``inplace_final_state``.

    The parameters are those of :func:`chunk_gated_delta_rule`, and:

    Parameters
    ----------
    g : torch.Tensor, optional
        No decay when None.
    beta : torch.Tensor, optional
        Ones when None.
    gk, gv
        Per-key / per-value decays: not supported (NotImplementedError when given).

    Returns
    -------
    o, final_state
        As in :func:`chunk_gated_delta_rule`.

    Examples
    --------
    A vLLM-style decode step over a pool of 8 slots ("vk" states, K contiguous), row 1 padding:

    >>> import torch
    >>> from cupy_comba.interop.torch import fused_recurrent_gated_delta_rule
    >>> pool = torch.zeros(8, 4, 64, 64, device="cuda")
    >>> q, k = (torch.nn.functional.normalize(torch.randn(3, 1, 2, 64, device="cuda"), dim=-1) for _ in "qk")
    >>> v, g, beta = torch.randn(3, 1, 4, 64, device="cuda"), -torch.rand(3, 1, 4, device="cuda"), torch.rand(3, 1, 4,
    ...                                                                                              device="cuda")
    >>> slots = torch.tensor([5, -1, 2], dtype=torch.int32, device="cuda")
    >>> o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool, state_v_first=True,
    ...                                          ssm_state_indices=slots)
    >>> ht is pool, bool(pool[5].any()), bool(pool[0].any()), bool(o[1].any())
    (True, True, False, False)
    """,

    "chunk_comba": """Comba over T tokens with ``fla.ops.comba.chunk_comba``'s signature and cupy_comba's math.

    flash-linear-attention's Comba reads the state with p before the decay; this one after it
    (``u = beta (v - e S^T p)``, docs/api.md): the same signature, a different function.

    Parameters
    ----------
    q, k, p : torch.Tensor, shape (B, T, H, K)
        p: the read key of the correction (Comba's auxiliary key).
    beta : torch.Tensor, optional
        Ones when None.
    use_qk_l2norm_in_kernel : bool
        Normalises p too.

    The other parameters are those of :func:`chunk_gated_delta_rule` (``state_v_first`` and the
    gating and serving options keywords here).

    Returns
    -------
    o, final_state
        As in :func:`chunk_gated_delta_rule`.

    Examples
    --------
    >>> import torch
    >>> from cupy_comba.interop.torch import chunk_comba
    >>> q, k, p = (torch.nn.functional.normalize(torch.randn(1, 8, 2, 64, device="cuda"), dim=-1) for _ in "qkp")
    >>> v, g = torch.randn(1, 8, 2, 64, device="cuda"), -torch.rand(1, 8, 2, device="cuda")
    >>> o, _ = chunk_comba(q, k, v, p, g, torch.rand(1, 8, 2, device="cuda"))
    >>> tuple(o.shape)
    (1, 8, 2, 64)
    """,

    "fused_recurrent_comba": """Comba over T tokens (decode: T = 1) with ``fla.ops.comba.fused_recurrent_comba``'s
    signature (p before v, as there) and cupy_comba's math (:func:`chunk_comba` says how it differs).

    The parameters are those of :func:`chunk_comba`, in this order.

    Returns
    -------
    o, final_state
        As in :func:`chunk_gated_delta_rule`.

    Examples
    --------
    >>> import torch
    >>> from cupy_comba.interop.torch import fused_recurrent_comba
    >>> q, k, p = (torch.nn.functional.normalize(torch.randn(2, 1, 2, 64, device="cuda"), dim=-1) for _ in "qkp")
    >>> v, g = torch.randn(2, 1, 2, 64, device="cuda"), -torch.rand(2, 1, 2, device="cuda")
    >>> o, ht = fused_recurrent_comba(q, k, p, v, g, torch.rand(2, 1, 2, device="cuda"), output_final_state=True)
    >>> tuple(ht.shape), ht.dtype
    ((2, 2, 64, 64), torch.float32)
    """,
}

chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_comba, fused_recurrent_comba = _fla.calls(
    _Frame, __name__, _DOCS)
#: The functions are made in _fla: doctest finds their examples here.
__test__ = {f.__name__: f for f in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_comba,
                                    fused_recurrent_comba)}
