"""Run each decode variant a few times at one shape, for a profiler to look at.

    ncu --clock-control none -k regex:comba --metrics ... python benchmarks/profile_decode.py [B,H,K,V]
"""

import sys

import cupy
import numpy

from cupy_comba import bfloat16
from cupy_comba.bench import parse_shapes
from cupy_comba.comba import VARIANTS, _decode_step
from cupy_comba.inputs import decode_inputs

(shape,) = parse_shapes(sys.argv[1:2] or ["896,16,128,128"])
B, H, K, V = shape
args = decode_inputs(B, H, K, V, xp=cupy, seed=1, warm_steps=2)
state_out = cupy.empty(shape, numpy.float32)
out = cupy.empty((B, H, V), bfloat16)
for variant in sys.argv[2:] or VARIANTS:
    for _ in range(2):
        _decode_step(*args, None, out, state_out, None, variant)
cupy.cuda.Device().synchronize()
