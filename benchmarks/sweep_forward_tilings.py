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

from cupy_comba import bfloat16, families, gated_delta_forward, tiling
from cupy_comba.bench import environment, measure_copy, time_graph
from cupy_comba.inputs import forward_inputs

B, H, V = 512, 16, 128


def forward_us(layout, T, K, variant, batch=B):
    q, k, v, _, beta, g, state = forward_inputs(batch, T, H, K, V, xp=cupy, state_layout=layout, warm_steps=1)
    out, state_out = cupy.empty((batch, T, H, V), bfloat16), cupy.empty_like(state)
    return time_graph(lambda: gated_delta_forward(q, k, v, beta, g, initial_state=state, out=out, state_out=state_out,
                                                  state_layout=layout, variant=variant), iters=10).median_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch", type=int, nargs="*", default=[B], help="B values (H = 16)")
    ap.add_argument("--T", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--layouts", nargs="*", default=["kv", "vk"])
    ap.add_argument("--K", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--variants", nargs="*", default=None, help="only these variants (default: every one)")
    args = ap.parse_args()
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for batch in args.batch:
        for layout in args.layouts:
            for K in args.K:
                base = forward_us(layout, 1, K, None, batch)  # T = 1 from a state runs the decode build
                for variant in families.variants(layout, K, V, multi=True):
                    if args.variants is not None and variant not in args.variants:
                        continue
                    for T in args.T:
                        us = forward_us(layout, T, K, variant, batch)
                        chosen = tiling.choose(layout, K, V, False, multi=True, T=T, heads=batch * H)
                        mark = "*" if variant == chosen else " "
                        rows.append(dict(layout=layout, B=batch, K=K, variant=variant, T=T, us=us,
                                         ratio_to_decode_T1=us / base))
                        print(f"{layout} B*H={batch * H:5d} K={K:3d} {variant:9s}{mark} T={T:3d} {us:9.1f} us  "
                              f"x{us / base:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "roofline": roof.as_dict(), "H": H, "V": V,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
