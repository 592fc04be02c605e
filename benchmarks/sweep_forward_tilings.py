"""Every tiling's T-token build on forward passes: the data behind the ``multi`` branch of
cupy_comba.tiling.choose.

    PYTHONPATH=. python benchmarks/sweep_forward_tilings.py [--json FILE]

Gated DeltaNet forward passes from a state, T in {1, 4, 16} at B = 512, H = 16, V = 128, K in
{128, 64}, bf16, CUDA-graph replay; time and time(T) / time(T = 1) of the chosen decode path.
``*`` marks the tiling the op chooses for T > 1.
"""

import argparse
import json

import cupy

from cupy_comba import bfloat16, recurrent, tiling
from cupy_comba.bench import environment, measure_copy, time_graph
from cupy_comba.inputs import forward_inputs

B, H, V = 512, 16, 128


def forward_us(layout, T, K, variant):
    q, k, v, _, beta, g, state = forward_inputs(B, T, H, K, V, xp=cupy, state_layout=layout, warm_steps=1)
    out, state_out = cupy.empty((B, T, H, V), bfloat16), cupy.empty_like(state)
    return time_graph(lambda: recurrent._run(q, k, v, None, beta, g, None, state, True, out, state_out, None, layout,
                                             "log", False, step=False, variant=variant), iters=10).median_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for layout in ("kv", "vk"):
        for K in (128, 64):
            base = forward_us(layout, 1, K, None)  # T = 1 from a state runs the decode build
            picked = tiling.choose(layout, K, V, False, multi=True)
            for variant in tiling.variants(layout, K, V):
                for T in (1, 4, 16):
                    us = forward_us(layout, T, K, variant)
                    rows.append(dict(layout=layout, K=K, variant=variant, T=T, us=us, ratio_to_decode_T1=us / base))
                    mark = "*" if variant == picked else " "
                    print(f"{layout} K={K:3d} {variant:8s}{mark} T={T:2d} {us:8.1f} us  x{us / base:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "roofline": roof.as_dict(), "B": B, "H": H, "V": V,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
