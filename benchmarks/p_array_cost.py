"""What Comba's separate read key costs: the decode step with p its own array vs p = k.

    PYTHONPATH=. python benchmarks/p_array_cost.py

Graph-replayed times at 896, 16, 128, 128 (bf16): Gated DeltaNet, Comba with p the very
array k, Comba with its own p, Gated DeltaNet again (docs/benchmarks.md quotes the result).
"""

import cupy
from cupy_comba import bfloat16, comba_decode_step, gated_delta_decode_step
from cupy_comba.bench import time_graph
from cupy_comba.inputs import decode_inputs

B, H, K, V = 896, 16, 128, 128
state, q, k, v, p, beta, g = decode_inputs(B, H, K, V, xp=cupy, seed=1, warm_steps=1)
so = cupy.empty_like(state)
out = cupy.empty((B, H, V), bfloat16)
pc = p.copy()
for name, fn in [
    ("gdn", lambda: gated_delta_decode_step(state, q, k, v, beta, g, out=out, state_out=so)),
    ("comba p=k", lambda: comba_decode_step(state, q, k, v, k, beta, g, out=out, state_out=so)),
    ("comba p", lambda: comba_decode_step(state, q, k, v, p, beta, g, out=out, state_out=so)),
    ("gdn again", lambda: gated_delta_decode_step(state, q, k, v, beta, g, out=out, state_out=so)),
]:
    print(name, f"{time_graph(fn, iters=10).median_us:.1f} us", flush=True)
