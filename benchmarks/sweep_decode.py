"""Sweep the decode kernel variants over shapes: the data behind comba.choose_launch.

    PYTHONPATH=. python benchmarks/sweep_decode.py [--json FILE] [B,H,K,V ...]

Each shape: inputs built once (spec recipe), every variant checked against the
float64 reference, then timed from a CUDA graph; fraction of the copy
measured in the same run.
"""

import argparse
import json

import cupy
import numpy

from cupy_comba import bfloat16, reference
from cupy_comba.bench import environment, measure_copy, parse_shapes, time_graph
from cupy_comba.comba import VARIANTS, _decode_step, _ring_layout, choose_launch
from cupy_comba.inputs import decode_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["regime", "quick", "1024,16,128,128", "256,16,128,128"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    roof = measure_copy()
    print(f"copy {roof.copy_gbps:.0f} GB/s (memcpy {roof.memcpy_gbps:.0f}, kernel {roof.kernel_gbps:.0f}, "
          f"peak {roof.peak_gbps or 0:.0f})", flush=True)
    rows = []
    for shape in parse_shapes(args.shapes):
        B, H, K, V = shape
        inputs = decode_inputs(B, H, K, V, xp=cupy, seed=1)
        S_ref, o_ref = reference.comba_step(*inputs)
        state_out = cupy.empty(inputs[0].shape, numpy.float32)
        out = cupy.empty((B, H, V), bfloat16)
        nbytes = B * H * (8 * K * V + 6 * K + 4 * V + 6)
        picked = choose_launch(B * H, K, V, 0)
        for variant in VARIANTS:
            if variant.startswith("pipe") and _ring_layout(K, V, int(variant[4:]), 0) is None:
                continue
            state_out.fill(numpy.nan)
            out.fill(numpy.nan)

            def run():
                _decode_step(*inputs, None, out, state_out, None, variant)

            run()
            err_s = reference.relative_error(state_out, S_ref)
            err_o = reference.relative_error(out, o_ref)
            t = time_graph(run, iters=args.iters)
            gbps = nbytes / t.median_us / 1e3
            row = dict(shape=shape, variant=variant, chosen=variant == picked, us=t.median_us, us_min=t.min_us,
                       us_max=t.max_us, gbps=gbps, fraction=gbps / roof.copy_gbps, err_state=err_s, err_o=err_o)
            rows.append(row)
            print(f"{str(shape):22s} {variant:6s}{'*' if variant == picked else ' '} {t.median_us:9.1f} us "
                  f"[{t.min_us:.1f}, {t.max_us:.1f}]  {gbps:6.0f} GB/s  {row['fraction']:.3f} of copy  "
                  f"err state {err_s:.1e} o {err_o:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "roofline": roof.as_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
