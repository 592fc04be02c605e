"""flash-linear-attention's Gated DeltaNet and Comba calls on jax arrays, run by cupy_comba's kernels.

The same four functions as :mod:`cupy_comba.interop.torch` -- flash-linear-attention 0.6's names,
argument order and defaults, vLLM's ``ssm_state_indices`` / ``num_accepted_tokens`` -- taking and
returning jax arrays on a GPU.  Arrays cross through DLPack without copies, with two differences
that JAX's semantics ask for:

- **Ordered by waiting.** A call waits until its inputs are ready (``block_until_ready``), runs its
  kernel on a CuPy stream of the arrays' device and waits for it before it returns, so its outputs
  are complete whatever JAX does with them next.  It is not traced: call it outside ``jax.jit``.
- **No array is written.** jax arrays are immutable, so with ``ssm_state_indices`` the pool is copied
  first and the copy, updated, is returned as the final state (one pass over the pool: a serving
  engine that wants the in-place update calls the torch adapter or the CuPy ops).

Everything else -- options, defaults, what is refused, and how Comba's math differs from
flash-linear-attention's -- is as in :mod:`cupy_comba.interop.torch`.

>>> import jax, jax.numpy as jnp
>>> from cupy_comba.interop.jax import chunk_gated_delta_rule
>>> key = jax.random.split(jax.random.PRNGKey(0), 5)
>>> q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in
...         (jax.random.normal(key[0], (1, 8, 2, 64)), jax.random.normal(key[1], (1, 8, 2, 64))))
>>> v = jax.random.normal(key[2], (1, 8, 4, 64))
>>> g, beta = -jax.random.uniform(key[3], (1, 8, 4)), jax.random.uniform(key[4], (1, 8, 4))
>>> o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
>>> o.shape, ht.shape
((1, 8, 4, 64), (1, 4, 64, 64))
"""

from contextlib import contextmanager

from .._backend import cupy
from . import _fla

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_comba", "fused_recurrent_comba"]


def _jax():
    import jax  # imported when a function is called: JAX is never a dependency

    return jax


class _Frame:
    """jax arrays for :func:`cupy_comba.interop._fla.run`: inputs waited for, outputs allocated by CuPy
    and handed to JAX once the kernel is done."""

    _streams = {}  # device ordinal -> cupy.cuda.Stream

    def __init__(self):
        self.jax = _jax()

    def _device_of(self, x, name):
        if not isinstance(x, self.jax.Array):
            raise TypeError(f"{name} must be a jax.Array, got {type(x).__name__}")
        devices = x.devices()
        if len(devices) != 1:
            raise ValueError(f"{name} is sharded over {len(devices)} devices: pass single-device arrays")
        (device,) = devices
        if device.platform != "gpu":
            raise ValueError(f"the kernels run on GPU arrays; {name} is on {device}")
        return device

    def device(self, q, k, v):
        for n, x in (("k", k), ("v", v)):
            self._device_of(x, n)
        return self._device_of(q, "q")

    def full(self, shape, value, device):
        return cupy.full(shape, value, cupy.float32)

    def float32(self, x):
        return x.astype(self.jax.numpy.float32) if x.dtype != self.jax.numpy.float32 else x

    def pool(self, state):
        return self.cupy(state, "initial_state", None).copy()  # the updated copy is the final state

    def empty(self, shape, like, device):
        return cupy.empty(shape, cupy.float32 if like is None else like.dtype)

    @contextmanager
    def on(self, device):
        ordinal = device.local_hardware_id
        stream = self._streams.get(ordinal)
        with cupy.cuda.Device(ordinal):
            if stream is None:
                stream = self._streams[ordinal] = cupy.cuda.Stream(non_blocking=True)
            with stream:
                yield
            stream.synchronize()  # the outputs are complete before JAX sees them

    def cupy(self, x, name, device):
        if x is None or isinstance(x, cupy.ndarray):
            return x
        if device is not None and self._device_of(x, name) != device:
            raise ValueError(f"{name} is on {self._device_of(x, name)}, q on {device}: every array must be on "
                             "q's device")
        x.block_until_ready()
        return cupy.from_dlpack(x)

    def results(self, o, final_state):
        from_dlpack = self.jax.dlpack.from_dlpack
        return from_dlpack(o), None if final_state is None else from_dlpack(final_state)


_DOCS = {
    "chunk_gated_delta_rule": """:func:`cupy_comba.interop.torch.chunk_gated_delta_rule` on jax arrays (a pool
    is returned updated, as a new array).""",
    "fused_recurrent_gated_delta_rule": """:func:`cupy_comba.interop.torch.fused_recurrent_gated_delta_rule` on
    jax arrays.""",
    "chunk_comba": """:func:`cupy_comba.interop.torch.chunk_comba` (cupy_comba's Comba, flash-linear-attention's
    signature) on jax arrays.""",
    "fused_recurrent_comba": """:func:`cupy_comba.interop.torch.fused_recurrent_comba` (p before v) on jax
    arrays.""",
}

chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_comba, fused_recurrent_comba = _fla.calls(
    _Frame, __name__, _DOCS)
