"""Multi-token forward (Gated DeltaNet, K = V = 128, bf16): time, tokens/s and effective GB/s over T.

    PYTHONPATH=. python benchmarks/sweep_forward.py [--json FILE]

T in {1, 2, 4, 8, 16, 64, 512, 4096} at B*H in {256, 16384} (H = 16) and T <= 16 at B*H = 16 (longer passes over so
few heads run the long-prompt kernels, which ``sweep_prefill.py`` times), both state layouts, CUDA-graph replay;
cases whose activations would exceed ~6 GB are skipped.  Also T <= 16 at B = 512, H = 16 (the speculative-verify
regime), with time(T) / time(T=1).
"""

import argparse
import json

import cupy

from cupy_comba import bfloat16, gated_delta_forward
from cupy_comba.inputs import forward_inputs
from cupy_comba.bench import environment, measure_copy, time_graph

H, K, V = 16, 128, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for layout in ("kv", "vk"):
        for heads in (16, 256, 16384, 8192):
            B = heads // H
            base = None
            for T in (1, 2, 4, 8, 16, 64, 512, 4096):
                act_bytes = B * T * H * (2 * K * 2 + 2 * V * 2 + 2 + 4)
                if act_bytes > 6e9 or (heads in (16, 8192) and T > 16):
                    continue
                q, k, v, _, beta, g, state = forward_inputs(B, T, H, K, V, xp=cupy, state_layout=layout,
                                                            warm_steps=2)
                out = cupy.empty((B, T, H, V), bfloat16)
                state_out = cupy.empty_like(state)

                def run():
                    gated_delta_forward(q, k, v, beta, g, initial_state=state, out=out, state_out=state_out,
                                        state_layout=layout)

                t = time_graph(run, iters=10)
                base = base or t.median_us
                nbytes = 2 * state.nbytes + act_bytes
                gbps = nbytes / t.median_us / 1e3
                row = dict(layout=layout, B=B, H=H, T=T, us=t.median_us, tokens_per_s=B * T / t.median_us * 1e6,
                           gbps=gbps, fraction_of_copy=gbps / roof.copy_gbps, ratio_to_T1=t.median_us / base)
                rows.append(row)
                print(f"{layout} B*H={heads:6d} T={T:5d} {t.median_us:10.1f} us "
                      f"{row['tokens_per_s'] / 1e6:8.2f} M tok/s {gbps:6.0f} GB/s "
                      f"({row['fraction_of_copy']:.2f} of copy)  x{row['ratio_to_T1']:.2f} vs T=1", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "roofline": roof.as_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
