"""Measure the kernels against the memory roofline (the library side of ``cupy-comba``).

>>> from cupy_comba import bench
>>> sorted(bench.OPS)[:4]
['comba_decode_step', 'comba_decode_step[vk]', 'comba_forward', 'comba_forward[vk]']
>>> bench.shapes_for_ops(["comba_decode_step", "comba_forward"], ["8,4,128,128", "2,16,4,128,128"])
{'comba_decode_step': [(8, 4, 128, 128)], 'comba_forward': [(2, 16, 4, 128, 128)]}
"""

from .registry import OPS, BenchOp, Case, register
from .roofline import Roofline, measure_copy, measure_copy_cpu, theoretical_peak_gbps
from .suite import FORWARD_SHAPES, SHAPES, bench, environment, estimate_cpu_seconds, parse_shapes, selftest, shapes_for_ops
from .timing import Timing, host_overhead, time_calls, time_cpu, time_eager, time_graph

__all__ = [
    "OPS", "BenchOp", "Case", "register", "Roofline", "measure_copy", "measure_copy_cpu",
    "theoretical_peak_gbps", "SHAPES", "FORWARD_SHAPES", "bench", "environment", "estimate_cpu_seconds", "parse_shapes",
    "selftest", "shapes_for_ops",
    "Timing", "host_overhead", "time_calls", "time_cpu", "time_eager", "time_graph",
]
