"""Run transformers' Qwen3-Next (and Qwen3.5) Gated DeltaNet layers on cupy_comba's kernels::

    from cupy_comba.interop import transformers as comba_transformers
    comba_transformers.patch()                              # models built from here on
    model = AutoModelForCausalLM.from_pretrained(...)       # its linear-attention layers call cupy_comba
    comba_transformers.unpatch()                            # transformers' own functions again

transformers' ``Qwen3NextGatedDeltaNet`` (and Qwen3.5's) layers compute their gates and keys in torch
and hand the recurrence to two functions: a chunked one for a prompt and a recurrent one for each
cached decode step -- flash-linear-attention's ``chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule`` where it is installed, else transformers' torch loops
(``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``).  Depending on the
transformers version a layer finds them as module globals when it runs or binds them when it is
built.  :func:`patch` replaces both with the :mod:`cupy_comba.interop.torch` functions: the module
globals (every layer that looks them up, and every layer built afterwards) and, given a ``model``,
the functions its layers have bound.  The states in the layer cache stay float32
``[B, HV, K, V]``, as the layers keep them; nothing else of the model changes.  Imports
transformers only when called.
"""

from . import torch as _ops

#: The modeling modules whose Gated DeltaNet layers bind the two functions (those the installed
#: transformers has are patched).
MODULES = ("transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5",
           "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
#: What the layers call, by role: the module globals (flash-linear-attention's names and transformers'
#: torch fallbacks) and the layer attributes some versions bind at build time.
_GLOBALS = {"chunk_gated_delta_rule": "chunk", "torch_chunk_gated_delta_rule": "chunk",
            "fused_recurrent_gated_delta_rule": "recurrent", "torch_recurrent_gated_delta_rule": "recurrent"}
_ATTRIBUTES = {"chunk_gated_delta_rule": "chunk", "recurrent_gated_delta_rule": "recurrent"}
def _known(function):
    """The keyword names ``function`` takes (its ``**kwargs`` aside)."""
    import inspect

    return frozenset(n for n, p in inspect.signature(function).parameters.items() if p.kind != p.VAR_KEYWORD)


_CHUNK_KEYWORDS = _known(_ops.chunk_gated_delta_rule)
_RECURRENT_KEYWORDS = _known(_ops.fused_recurrent_gated_delta_rule)


def _chunk(*args, **kwargs):
    """:func:`cupy_comba.interop.torch.chunk_gated_delta_rule` as a Gated DeltaNet layer calls it: the layers pass
    the model call's own keywords (``use_cache``, attention metadata) down, which transformers' torch functions
    ignore too."""
    return _ops.chunk_gated_delta_rule(*args, **{n: x for n, x in kwargs.items() if n in _CHUNK_KEYWORDS})


def _recurrent(*args, **kwargs):
    """:func:`cupy_comba.interop.torch.fused_recurrent_gated_delta_rule` as a Gated DeltaNet layer calls it."""
    return _ops.fused_recurrent_gated_delta_rule(*args, **{n: x for n, x in kwargs.items()
                                                          if n in _RECURRENT_KEYWORDS})


_ROLES = {"chunk": _chunk, "recurrent": _recurrent}

_saved_globals = {}   # module name -> {global name: original}
_saved_layers = []    # (layer, {attribute: original})


def _modules():
    import importlib

    found = []
    for name in MODULES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    if not found:
        raise ImportError("transformers with Qwen3-Next (transformers.models.qwen3_next) is not installed")
    return found


def patch(model=None):
    """Route the Gated DeltaNet layers of transformers' Qwen3-Next / Qwen3.5 models to cupy_comba.

    Parameters
    ----------
    model : torch.nn.Module, optional
        A model already built: its layers are switched too (models built after the call are switched by
        the modeling modules' patch).

    Returns
    -------
    list of str
        The modeling modules patched.
    """
    patched = []
    for module in _modules():
        saved = _saved_globals.setdefault(module.__name__, {})
        for name, role in _GLOBALS.items():
            if name in vars(module):
                saved.setdefault(name, getattr(module, name))
                setattr(module, name, _ROLES[role])
        patched.append(module.__name__)
    if model is not None:
        for layer in model.modules():
            bound = {attr: role for attr, role in _ATTRIBUTES.items() if callable(getattr(layer, attr, None))}
            if len(bound) == len(_ATTRIBUTES):
                _saved_layers.append((layer, {attr: getattr(layer, attr) for attr in bound}))
                for attr, role in bound.items():
                    setattr(layer, attr, _ROLES[role])
    return patched


def unpatch():
    """Undo :func:`patch`: the modeling modules' functions and every switched layer's, as they were."""
    import importlib

    for module_name, saved in _saved_globals.items():
        module = importlib.import_module(module_name)
        for name, original in saved.items():
            setattr(module, name, original)
    _saved_globals.clear()
    for layer, saved in reversed(_saved_layers):
        for attr, original in saved.items():
            setattr(layer, attr, original)
    _saved_layers.clear()
