"""Build options of kernels_cu/delta_rule.cu compared on the GPU, every tiling: a register cap
(COMBA_OTHER_REGS: __launch_bounds__ min-blocks leaving that many registers beside the state).

    PYTHONPATH=. python benchmarks/prefetch_experiment.py [--json FILE]

Decode steps at B*H = 14336 (B = 896, H = 16; K = 128 and 64), forward passes of T = 1, 4, 16 at
B = 512, H = 16; K = V = 128 unless said, bf16, CUDA-graph replay.
"""

import argparse
import json

import cupy

from cupy_comba import _build, bfloat16, recurrent, tiling
from cupy_comba.bench import measure_copy, time_graph
from cupy_comba.inputs import decode_inputs, forward_inputs

CONFIGS = {"default": (), "cap": ("-DCOMBA_OTHER_REGS=64", "-DCOMBA_OTHER_REGS_1=64")}


def decode_case(comba, layout, B, H, K, V, variant):
    state, q, k, v, p, beta, g = decode_inputs(B, H, K, V, xp=cupy, warm_steps=1)
    if layout == "vk":
        state = cupy.ascontiguousarray(state.swapaxes(-1, -2))
    out, state_out = cupy.empty((B, H, V), bfloat16), cupy.empty_like(state)
    p = p if comba else None
    return lambda: recurrent._run(q, k, v, p, beta, g, None, state, True, out, state_out, None, layout, "log",
                                  False, step=True, variant=variant), 2 * state.nbytes


def forward_case(layout, B, T, H, K, V, variant):
    q, k, v, _, beta, g, state = forward_inputs(B, T, H, K, V, xp=cupy, state_layout=layout, warm_steps=1)
    out, state_out = cupy.empty((B, T, H, V), bfloat16), cupy.empty_like(state)
    return lambda: recurrent._run(q, k, v, None, beta, g, None, state, True, out, state_out, None, layout, "log",
                                  False, step=False, variant=variant), 2 * state.nbytes


CASES = []
for lay in ("kv", "vk"):
    for K in (128, 64):
        for var in tiling.variants(lay, K, 128):
            for c in (True, False):
                CASES.append((f"{'comba' if c else 'gdn'} {lay} K={K} {var}",
                              lambda c=c, lay=lay, K=K, var=var: decode_case(c, lay, 896, 16, K, 128, var)))
    for var in tiling.variants(lay, 128, 128):
        for T in (1, 4, 16):
            CASES.append((f"fwd {lay} B=512 T={T} {var}",
                          lambda lay=lay, T=T, var=var: forward_case(lay, 512, T, 16, 128, 128, var)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    copy = measure_copy().copy_gbps
    print(f"copy {copy:.0f} GB/s", flush=True)
    base = _build.NVRTC_OPTIONS
    rows = []
    for name, opts in CONFIGS.items():
        _build.NVRTC_OPTIONS = base + opts
        _build._module.cache_clear()
        _build._kernels.clear()
        recurrent._plan.cache_clear()
        for label, make in CASES:
            fn, nbytes = make()
            us = time_graph(fn, iters=10).median_us
            frac = nbytes / us / 1e3 / copy
            rows.append(dict(config=name, case=label, us=us, fraction_of_copy=frac))
            print(f"{name:9s} {label:32s} {us:9.1f} us  {frac:.3f} of copy", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
