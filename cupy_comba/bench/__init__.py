"""Measure the kernels against the memory roofline (the library side of ``cupy-comba``).

>>> from cupy_comba import bench
>>> sorted(bench.OPS)
['comba_decode_step', 'comba_decode_step[vk]', 'gated_delta_decode_step', 'gated_delta_decode_step[vk]']
>>> bench.parse_shapes(["8,4,128,128"])
[(8, 4, 128, 128)]
"""

from .registry import OPS, BenchOp, Case, register
from .roofline import Roofline, measure_copy, measure_copy_cpu, theoretical_peak_gbps
from .suite import SHAPES, bench, environment, parse_shapes, selftest
from .timing import Timing, host_overhead, time_calls, time_cpu, time_eager, time_graph

__all__ = [
    "OPS", "BenchOp", "Case", "register", "Roofline", "measure_copy", "measure_copy_cpu",
    "theoretical_peak_gbps", "SHAPES", "bench", "environment", "parse_shapes", "selftest",
    "Timing", "host_overhead", "time_calls", "time_cpu", "time_eager", "time_graph",
]
