"""Sweep the decode tilings over shapes for every decode op: the data behind cupy_comba.tiling.choose.

    PYTHONPATH=. python benchmarks/sweep_decode.py [--ops OP ...] [--json FILE] [B,H,K,V ...]

Each (op, shape, tiling): the registry's case (spec inputs, NaN-poisoned outputs) is checked
against the float64 reference, then timed from a CUDA graph; fraction of the copy measured
in the same run.  ``*`` marks the tiling the op chooses.
"""

import argparse
import json

import cupy

from cupy_comba import bfloat16, tiling
from cupy_comba.bench import OPS, environment, measure_copy, parse_shapes, time_graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["regime", "quick", "1024,16,128,128", "256,16,128,128"])
    ap.add_argument("--ops", nargs="*", default=[n for n in OPS if "decode" in n])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s (memcpy {roof.memcpy_gbps:.0f}, kernel {roof.kernel_gbps:.0f}, "
          f"peak {roof.peak_gbps or 0:.0f})", flush=True)
    rows = []
    for name in args.ops:
        op = OPS[name]
        layout = "vk" if name.endswith("[vk]") else "kv"
        for shape in parse_shapes(args.shapes):
            B, H, K, V = shape
            picked = tiling.choose(layout, K, V, name.startswith("comba"), heads=B * H)
            for variant in op.variants(shape):
                case = op.prepare(shape, bfloat16, cupy, seed=1, variant=variant)
                errors = case.check()
                t = time_graph(case.run, iters=args.iters)
                gbps = case.bytes_moved / t.median_us / 1e3
                row = dict(op=name, shape=shape, variant=variant, chosen=variant == picked, us=t.median_us,
                           us_min=t.min_us, us_max=t.max_us, gbps=gbps, fraction=gbps / roof.copy_gbps,
                           err_state=errors["state"], err_o=errors["o"])
                rows.append(row)
                print(f"{name:28s} {str(shape):20s} {variant:8s}{'*' if row['chosen'] else ' '} "
                      f"{t.median_us:9.1f} us  {gbps:6.0f} GB/s  {row['fraction']:.3f} of copy  "
                      f"err state {errors['state']:.1e} o {errors['o']:.1e}", flush=True)
                del case
                cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "roofline": roof.as_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
