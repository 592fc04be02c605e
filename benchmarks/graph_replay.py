"""Per-call microseconds of a function replayed from a CUDA graph, for CuPy and for torch: the two timers the
benchmarks that put flash-linear-attention beside the library use (decode_few_heads.py, decode_dtype_builds.py,
sweep_prefill.py --fla).  ``iters`` calls are captured into one graph; the median over ``samples`` timed replays,
divided by ``iters``, is returned."""

import cupy as cp
import numpy as np


def cupy_graph(fn, iters=200, samples=5):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for _ in range(3):
            fn()
        s.synchronize()
        s.begin_capture()
        for _ in range(iters):
            fn()
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
        ts = []
        for _ in range(samples):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / iters)
    return float(np.median(ts))


def torch_graph(fn, iters=200, samples=5):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(samples):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / iters)
    return float(np.median(ts))
