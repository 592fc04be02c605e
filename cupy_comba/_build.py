"""Compile the kernels: one specialisation at a time, when a call first needs it, once per process.

Each specialisation (:func:`cupy_comba.families.specialisations` lists them) is its own
``cupy.RawModule`` with one name expression, so a first call compiles only the kernel it runs
(about a second) and CuPy's on-disk kernel cache serves it to every later process.  Threads that
ask for the same specialisation at once wait for one compile and share one kernel object.
:func:`precompile` builds them all for a device (``cupy-comba precompile``, for container images),
and a marker file beside CuPy's cache records each one built, for ``cupy-comba info``.

Sources live in ``kernels_cu/`` and are found with :mod:`importlib.resources`, so an installed
wheel and a source checkout behave alike.  ``#include "x.cuh"`` lines are expanded here rather
than through an include path, so that CuPy's cache key (a hash of the source text) changes
whenever a header does.
"""

import functools
import hashlib
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import NamedTuple

from . import families
from ._backend import cupy

NVRTC_OPTIONS = ("--std=c++17",)

#: Sources built for the arch-specific target on compute capability 9.0 (sm_90a): the prefill scans on wgmma
#: (elsewhere they are built empty, and the plans refuse them).
ARCH_SPECIFIC = ("prefill_wgmma.cu", "prefill_transposed.cu")


def target(source, arch):
    """The architecture ``kernels_cu/<source>`` is built for on a GPU of ``arch`` (``"sm_90"``): ``"sm_90a"`` for
    ARCH_SPECIFIC sources there, else ``arch``."""
    return "sm_90a" if source in ARCH_SPECIFIC and arch == "sm_" + families.WGMMA_CAPABILITY else arch


def nvrtc_options(source, arch):
    """NVRTC's options for ``kernels_cu/<source>`` on ``arch``: CuPy adds ``-arch`` for the GPU itself."""
    built = target(source, arch)
    return NVRTC_OPTIONS + ((f"-arch={built}",) if built != arch else ())


_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


@functools.cache
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


# -- kernels on a device ------------------------------------------------------------------------

_kernels = {}                # (source, expression, device) -> cupy.RawKernel
_modules = {}                # (source, expression, *options) -> cupy.RawModule
_locks = {}                  # (source, expression) -> the lock its first compile holds
_locks_guard = threading.Lock()


def get_kernel(source, expression, device):
    """The compiled kernel ``expression`` of ``kernels_cu/<source>`` on device ``device``.

    Compiles (or loads from CuPy's disk cache) on first use; ``device`` is made current for the
    load.  Safe to call from several threads at once.
    """
    key = (source, expression, device)
    fn = _kernels.get(key)
    if fn is not None:
        return fn
    with _locks_guard:
        lock = _locks.setdefault(key[:2], threading.Lock())
    with lock:
        fn = _kernels.get(key)
        if fn is None:
            options = nvrtc_options(source, _arch(device))
            module = _modules.get(key[:2] + options)
            if module is None:
                module = _modules[key[:2] + options] = cupy.RawModule(code=kernel_source(source), options=options,
                                                                       name_expressions=[expression])
            with cupy.cuda.Device(device):
                fn = module.get_function(expression)
                fn.attributes  # noqa: B018 - loads the binary now, inside the lock
            _mark_built(source, expression, device)
            _kernels[key] = fn
    return fn


def loaded():
    """``(source, expression, device)`` of every kernel loaded in this process."""
    return sorted(_kernels)


# -- what the disk cache holds --------------------------------------------------------------------

def cache_dir():
    """CuPy's kernel cache directory (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


def _marker(source, expression, arch):
    digest = hashlib.sha256("\0".join((kernel_source(source), *nvrtc_options(source, arch), expression,
                                       arch)).encode()).hexdigest()
    return os.path.join(cache_dir(), "cupy_comba", f"{digest[:32]}.{arch}")


def _arch(device):
    return "sm_" + cupy.cuda.Device(device).compute_capability


def _mark_built(source, expression, device):
    path = _marker(source, expression, _arch(device))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    except OSError:  # a read-only cache: CuPy reads it, nothing to record
        pass


def is_built(source, expression, arch):
    """Whether this source of ``expression`` was built for ``arch`` (``"sm_90"``) into this cache."""
    return os.path.exists(_marker(source, expression, arch))


def precompile(specialisations, device, *, jobs=None, progress=None):
    """Build every ``(source, expression)`` of ``specialisations`` for ``device``, ``jobs`` at once.

    NVRTC runs outside the GIL, so threads compile in parallel.  ``progress(source, expression)``
    is called as each one finishes.
    """
    jobs = jobs or min(8, os.cpu_count() or 1)

    def build(item):
        with cupy.cuda.Device(device):
            get_kernel(*item, device)
        return item

    with ThreadPoolExecutor(jobs) as pool:
        for item in pool.map(build, specialisations):
            if progress:
                progress(*item)


# -- builds without a GPU (tests) -----------------------------------------------------------------

class Build(NamedTuple):
    """One kernel as NVRTC built it: its ptxas resource report, its PTX entry and ptxas's notes on it."""

    report: str  #: the ``--ptxas-options=-v`` lines of the kernel (registers, spills, stack)
    ptx: str     #: the kernel's ``.entry`` in the PTX
    notes: tuple  #: ptxas's coded remarks on the kernel, ``(C7518) Potential Performance Loss: ...``


def compile_for_arch(source, expressions, arch="sm_90", *, jobs=None):
    """Compile each of ``expressions`` of ``kernels_cu/<source>`` with NVRTC for ``arch``, in
    parallel; no GPU needed.  Returns ``{expression: Build}``."""
    from cupy_backends.cuda.libs import nvrtc

    text = kernel_source(source)

    def one(expression):
        prog = nvrtc.createProgram(text, source, (), ())
        try:
            nvrtc.addNameExpression(prog, expression)
            try:
                nvrtc.compileProgram(prog, NVRTC_OPTIONS + (f"--gpu-architecture={target(source, arch)}",
                                                            "--ptxas-options=-v"))
            except nvrtc.NVRTCError as err:
                raise RuntimeError(f"NVRTC failed on {source} for {expression}:\n{nvrtc.getProgramLog(prog)}") from err
            log = nvrtc.getProgramLog(prog)
            ptx = nvrtc.getPTX(prog)
            ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
            mangled = nvrtc.getLoweredName(prog, expression)
        finally:
            nvrtc.destroyProgram(prog)
        return expression, Build(_report_for(log, mangled), _entry_of(ptx, mangled), _notes_for(log, mangled))

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        return dict(pool.map(one, expressions))


def _entry_of(ptx, mangled):
    """The PTX of one kernel: its ``.entry`` up to the next one."""
    for block in ptx.split(".entry ")[1:]:
        if block.startswith(mangled + "("):
            return block
    raise RuntimeError(f"no PTX entry for {mangled}")


def _notes_for(log, mangled):
    """ptxas's coded remarks (``ptxas info : (C7518) ...``) that name the kernel."""
    return tuple(line.split(":", 1)[1].strip() for line in log.splitlines()
                 if line.startswith("ptxas") and ": (C" in line and f"'{mangled}'" in line)


def _report_for(log, mangled):
    """The ptxas block (``Compiling entry function ...`` up to the next one) of one kernel."""
    for block in log.split("Compiling entry function")[1:]:
        if block.lstrip(" '").startswith(mangled + "'"):
            return block
    raise RuntimeError(f"no ptxas report for {mangled} in the NVRTC log:\n{log}")
