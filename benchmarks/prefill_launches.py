"""The prefill plans' kernels launched as programmatic dependents of the kernel before them against launched one
after the other: the default choice at flash-linear-attention's table's shapes (bf16, K = V = 128, "kv", from a
state, graph replay), each setting in its own process, alternating ``--rounds`` times: every kernel after a plan's
first a dependent (``CUPY_COMBA_PDL=1`` and ``_plan.SEGMENTS_DEPENDENT``: the segmented scan's chain and segments
too), then none (``CUPY_COMBA_PDL=0``).

    PYTHONPATH=. python benchmarks/prefill_launches.py --json benchmarks/results/h200-prefill-launches.json

``{"environment", "runs": [{"dependent": bool, "us": {"<op> B<B> T<T> H<H> <variant>": us, ...}}, ...]}``.
"""

import argparse
import json
import os
import subprocess
import sys

SHAPES = ((1, 1024, 16), (1, 2048, 16), (1, 4096, 16), (1, 8192, 16), (8, 2048, 16), (4, 4096, 32),
          (1, 32768, 32))


def measure():
    """One process's timings, as ``{name: us}``, under the CUPY_COMBA_PDL it was started with."""
    import cupy

    from cupy_comba import _plan, bfloat16, comba_forward, gated_delta_forward
    _plan.SEGMENTS_DEPENDENT = True
    from cupy_comba.bench import time_graph
    from cupy_comba.inputs import forward_inputs

    res = {}
    for comba in (False, True):
        for B, T, H in SHAPES:
            q, k, v, p, beta, g, S = forward_inputs(B, T, H, 128, 128, xp=cupy, warm_steps=2, seed=T)
            out, so = cupy.empty(v.shape, bfloat16), cupy.empty_like(S)

            def run():
                if comba:
                    return comba_forward(q, k, v, p, beta, g, initial_state=S, out=out, state_out=so)
                return gated_delta_forward(q, k, v, beta, g, initial_state=S, out=out, state_out=so)

            _plan.PLANS.clear()
            us = time_graph(run, iters=9).median_us
            variant = list(_plan.PLANS.values())[0].variant
            res[f"{'comba' if comba else 'gdn'} B{B} T{T} H{H} {variant}"] = round(us, 1)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="pairs of processes (dependent launches, then in turn)")
    ap.add_argument("--json", metavar="JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(measure()), flush=True)
        return
    from cupy_comba.bench import environment

    runs = []
    for _ in range(a.rounds):
        for dependent in (True, False):
            env = dict(os.environ, CUPY_COMBA_PDL="1" if dependent else "0")
            done = subprocess.run([sys.executable, __file__, "--worker"], env=env, check=True, capture_output=True,
                                  text=True)
            runs.append({"dependent": dependent, "us": json.loads(done.stdout.strip().splitlines()[-1])})
            print("dependent" if dependent else "in turn  ", json.dumps(runs[-1]["us"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
