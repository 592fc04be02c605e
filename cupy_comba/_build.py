"""Build and cache the CUDA kernels.

Every compiled variant is listed in :data:`SPECIALISATIONS`, the one place
that says what exists.  A module is compiled by NVRTC through
``cupy.RawModule`` the first time a kernel of it runs on a device, once per
(device, module); CuPy's on-disk kernel cache makes later processes skip
NVRTC entirely.

Sources live in ``kernels_cu/`` and are found with :mod:`importlib.resources`,
so an installed wheel and a source checkout behave alike.  ``#include "x.cuh"``
lines are expanded here rather than through an include path, so that CuPy's
cache key (a hash of the source text) changes whenever a header does.
"""

import functools
import re
from importlib import resources
from typing import NamedTuple

from ._backend import cupy

#: Tilings of the delta-rule kernels (kernels_cu/delta_rule.cu): ``(COLS, RG)`` of
#: ``delta_rule_kv`` -- a CTA is a COLS-column slab of one head, RG row groups -- and, per K,
#: ``(R, NW)`` of ``delta_rule_vk`` -- NW warps, R state rows per lane.
KV_TILINGS = ((64, 8), (64, 4), (32, 8), (32, 16))
#: Tilings of ``delta_rule_kv_chunked`` (T-token passes, kChunk tokens per pass over the state):
#: those whose state, 2 x kChunk column sums and staging fit the registers without spilling.
KV_CHUNKED_TILINGS = ((64, 8), (32, 8))
VK_TILINGS = {64: ((8, 2), (16, 2)), 128: ((16, 2), (16, 4))}
#: Slabs of ``delta_rule_vk_chunked`` (T-token passes over a "vk" state, kChunk tokens per pass): a CTA
#: is a slab of ROWS rows of V of one head, ROWS / 16 warps; built for K = VK_CHUNKED_K.
VK_CHUNKED_ROWS = (64, 32)
#: The head size ``delta_rule_vk_chunked`` is built for (8 lanes of 16 keys a row).
VK_CHUNKED_K = 128
#: Slabs of ``delta_rule_mma`` (kernels_cu/delta_rule_mma.cu, either layout): a CTA is a slab of
#: SLAB value columns of one head, (SLAB / 16) x (K / 64) warps.
MMA_SLABS = (64, 32)
#: Tokens a pass of ``delta_rule_mma`` takes over the state: one or two sub-chunks of 8.
MMA_CHUNKS = (8, 16)
#: The wide slab of ``delta_rule_mma``, built at K = 64 with 16-token passes only: the same 256-thread
#: CTA (8 warps) as a 64-column slab at K = 128, so that one CTA stages and solves each chunk of a
#: V = 128 head, where two 64-column CTAs each do.  (8-token chunks do not divide among its threads.)
MMA_WIDE_SLAB, MMA_WIDE_K = 128, 64
#: The builds of ``delta_rule_mma``, (K, SLAB, tokens a pass), the one list that the specialisations
#: below and ``tiling.variants`` both read.
MMA_BUILDS = tuple((K, slab, chunk) for K in (64, 128) for slab in MMA_SLABS for chunk in MMA_CHUNKS) + (
    (MMA_WIDE_K, MMA_WIDE_SLAB, 16),)


def _flag(x):
    return str(bool(x)).lower()


#: module name -> (source file, kernel name expressions compiled from it)
SPECIALISATIONS = {
    "delta_rule_kv": (
        "delta_rule.cu",
        tuple(f"comba::delta_rule_kv<{K}, {c}, {r}, {_flag(sep)}, {_flag(multi)}>"
              for K in (64, 128) for c, r in KV_TILINGS for sep in (True, False) for multi in (False, True)),
    ),
    "delta_rule_vk": (
        "delta_rule.cu",
        tuple(f"comba::delta_rule_vk<{K}, {r}, {w}, {_flag(sep)}, {_flag(multi)}>"
              for K in (64, 128) for r, w in VK_TILINGS[K] for sep in (True, False) for multi in (False, True)),
    ),
    "delta_rule_kv_chunked": (
        "delta_rule.cu",
        tuple(f"comba::delta_rule_kv_chunked<{K}, {c}, {r}, {_flag(sep)}>"
              for K in (64, 128) for c, r in KV_CHUNKED_TILINGS for sep in (True, False)),
    ),
    "delta_rule_vk_chunked": (
        "delta_rule.cu",
        tuple(f"comba::delta_rule_vk_chunked<{VK_CHUNKED_K}, {r}, {_flag(sep)}>" for r in VK_CHUNKED_ROWS
              for sep in (True, False)),
    ),
    "delta_rule_mma": (
        "delta_rule_mma.cu",
        tuple(f"comba::delta_rule_mma<{K}, {slab}, {_flag(sep)}, {_flag(vk)}, {chunk // 8}>"
              for K, slab, chunk in MMA_BUILDS for sep in (True, False) for vk in (False, True)),
    ),
    "copy": ("copy.cu", ("comba::copy_float4",)),
}

#: Head sizes K every kernel family is specialised for.
SUPPORTED_K = (64, 128)

NVRTC_OPTIONS = ("--std=c++17",)

_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def kernel_source(filename):
    """The full text of ``kernels_cu/<filename>`` with local includes expanded once."""
    root = resources.files("cupy_comba.kernels_cu")
    seen = set()

    def expand(match):
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _INCLUDE.sub(expand, (root / name).read_text())

    return _INCLUDE.sub(expand, (root / filename).read_text())


@functools.cache
def _module(name):
    filename, expressions = SPECIALISATIONS[name]
    # RawModule compiles lazily and keeps one binary per device.
    return cupy.RawModule(code=kernel_source(filename), options=NVRTC_OPTIONS, name_expressions=list(expressions))


_kernels = {}


def get_kernel(module, expression, device_id):
    """The compiled kernel ``expression`` of ``module`` on device ``device_id``.

    The caller must already have ``device_id`` current (RawModule loads its
    binary for the current device).
    """
    key = (module, expression, device_id)
    fn = _kernels.get(key)
    if fn is None:
        fn = _kernels[key] = _module(module).get_function(expression)
    return fn


class Build(NamedTuple):
    """One kernel as NVRTC built it: its ptxas resource report and its PTX entry."""

    report: str  #: the ``--ptxas-options=-v`` lines of the kernel (registers, spills, stack)
    ptx: str     #: the kernel's ``.entry`` in the module's PTX (up to the next entry)


def compile_for_arch(module, arch="sm_90"):
    """Compile every specialisation of ``module`` with NVRTC for ``arch``; no GPU needed.

    Returns ``{expression: Build}``, so tests can check registers, spills and the
    instructions a kernel's accesses became.
    """
    from cupy_backends.cuda.libs import nvrtc

    filename, expressions = SPECIALISATIONS[module]
    prog = nvrtc.createProgram(kernel_source(filename), filename, (), ())
    try:
        for e in expressions:
            nvrtc.addNameExpression(prog, e)
        options = NVRTC_OPTIONS + (f"--gpu-architecture={arch}", "--ptxas-options=-v")
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {filename}:\n{nvrtc.getProgramLog(prog)}") from err
        log = nvrtc.getProgramLog(prog)
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in expressions}
    finally:
        nvrtc.destroyProgram(prog)
    return {e: Build(_report_for(log, mangled), _entry_of(ptx, mangled)) for e, mangled in lowered.items()}


def _entry_of(ptx, mangled):
    """The PTX of one kernel: its ``.entry`` up to the next one."""
    for block in ptx.split(".entry ")[1:]:
        if block.startswith(mangled + "("):
            return block
    raise RuntimeError(f"no PTX entry for {mangled}")


def _report_for(log, mangled):
    """The ptxas block (``Compiling entry function ...`` up to the next one) of one kernel."""
    for block in log.split("Compiling entry function")[1:]:
        if block.lstrip(" '").startswith(mangled + "'"):
            return block
    raise RuntimeError(f"no ptxas report for {mangled} in the NVRTC log:\n{log}")
