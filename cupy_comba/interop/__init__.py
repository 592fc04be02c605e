"""Adapters for the frameworks the library's users live in; each imports its framework only when called.

:mod:`cupy_comba.interop.torch`
    flash-linear-attention 0.6's Gated DeltaNet and Comba calls (names, argument order, defaults)
    on torch tensors, on torch's current stream, with vLLM's pool and verify keywords.
:mod:`cupy_comba.interop.jax`
    The same calls on jax arrays.

Neither torch nor JAX is a dependency of the library: importing this package imports neither
(docs/integrations.md).
"""
