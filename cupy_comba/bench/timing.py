"""Timing that measures the GPU, not Python.

* :func:`time_graph` -- the kernel time: ``n`` calls captured into one CUDA
  graph, replays timed with CUDA events (median / min / max per call).  No
  host work sits between the launches, so this is the GPU's own time even
  for microsecond kernels.
* :func:`time_eager` -- back-to-back plain calls between two events: what a
  caller without graphs sees (host overhead shows up when it exceeds the
  kernel time).
* :func:`host_overhead` -- wall-clock microseconds of one Python call, the
  GPU never waited on.
* :func:`time_cpu` -- the NumPy fallback, wall clock.
"""

import statistics
import time
from dataclasses import dataclass

from .. import _launcher
from .._backend import cupy


@dataclass
class Timing:
    """Per-call times in microseconds."""

    median_us: float
    min_us: float
    max_us: float
    calls_per_sample: int
    samples: int

    @classmethod
    def from_samples(cls, per_call_us, calls):
        return cls(statistics.median(per_call_us), min(per_call_us), max(per_call_us), calls, len(per_call_us))


def _events_us(stream, launch):
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    launch()
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3


def time_calls(fn, *, iters=20, warmup=3):
    """Median microseconds of single calls of ``fn``, each between two CUDA events (for long calls)."""
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    return statistics.median(_events_us(stream, fn) for _ in range(iters))


def time_graph(fn, *, iters=20, warmup=3, sample_ms=2.0, max_calls=256):
    """Median per-call GPU time of ``fn`` replayed from a CUDA graph.

    ``fn`` must launch work on the current stream and allocate nothing.
    Each sample replays a graph of ``calls`` back-to-back calls, with
    ``calls`` chosen so that a sample lasts about ``sample_ms``.
    """
    # The capture stream does not wait for the legacy default stream: without this, the samples
    # overlap whatever work is still queued there -- typically the GPU generating this case's inputs
    # (a float64 reference warm-up of a 1-2 GiB state read up to 2x slow).
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    # the graph dies here, so the workspaces its capture pinned for good need not outlive it
    with stream, _launcher.transient_captures():
        fn()
        stream.synchronize()
        once = _events_us(stream, fn)
        calls = int(max(1, min(max_calls, sample_ms * 1e3 // max(once, 1e-3))))
        stream.begin_capture()
        for _ in range(calls):
            fn()
        graph = stream.end_capture()
        for _ in range(warmup):
            graph.launch(stream)
        per_call = [_events_us(stream, lambda: graph.launch(stream)) / calls for _ in range(iters)]
        del graph  # every replay has finished: _events_us waited for its last one
        _launcher.release_workspace(cupy.cuda.Device().id, stream.ptr)
    return Timing.from_samples(per_call, calls)


def time_eager(fn, *, calls=50):
    """Per-call time of ``calls`` back-to-back eager calls between two CUDA events."""
    stream = cupy.cuda.get_current_stream()
    fn()

    def burst():
        for _ in range(calls):
            fn()

    return _events_us(stream, burst) / calls


def host_overhead(fn, *, calls=100):
    """Host microseconds of one call of ``fn`` (launch only; the GPU is not waited on)."""
    fn()
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    cupy.cuda.get_current_stream().synchronize()
    return elapsed / calls * 1e6


def time_cpu(fn, *, iters=5, warmup=1):
    """Wall-clock per-call time of a CPU (NumPy) function."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return Timing.from_samples(samples, 1)
