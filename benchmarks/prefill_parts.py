"""The kernels of a long forward pass apart: the whole pass, then each launch alone (graph-replayed by itself, the
workspace as the pass left it) -- the prep and the scan, and the segmented scan's chain between them -- for the
variant the rules choose without the transposed scans and for each of ``--variants``, on the shapes of
flash-linear-attention's table and over 64 heads (bf16, K = V = ``--head-size``, 128 unless given, "kv", compute
capability 9.0).

    PYTHONPATH=. python benchmarks/prefill_parts.py --variants kv64c64wt --json benchmarks/results/h200-prefill-parts.json
    PYTHONPATH=. python benchmarks/prefill_parts.py --ops gdn --shapes 8,2048,16 1,8192,16   # a quick subset
    PYTHONPATH=. python benchmarks/prefill_parts.py --ops gdn --head-size 64 --shapes 1,4096,16 --variants kv64c64sg
    PYTHONPATH=. python benchmarks/prefill_parts.py --ops gdn --pool --shapes 1,8192,16 --variants kv128c64sg
    PYTHONPATH=. python benchmarks/prefill_parts.py --pool --ragged --shapes 1,4096,16 --variants kv64c64sg

Rows ``{op, B, T, H, K, [pool,] [ragged,] <variant>: us, <variant>:prep: us, [<variant>:chain: us,] <variant>:scan:
us, ...}``, the rules' choice without the transposed scans first.  ``--pool``: each row's initial and final state in a
slot of a pool of 2 B states, the slots drawn at random (``state_indices``), as a serving engine calls; ``--ragged``:
the B rows packed into one as B sequences of T tokens (``cu_seqlens``).
"""

import argparse
import json

import cupy
import numpy

from cupy_comba import _plan, bfloat16, comba_forward, gated_delta_forward, tiling
from cupy_comba.bench import environment, time_graph
from cupy_comba.inputs import forward_inputs

SHAPES = ((1, 1024, 16), (1, 4096, 16), (1, 8192, 16), (1, 32768, 32), (8, 2048, 16), (4, 4096, 32), (2, 1024, 64))


def _parts(fn):
    """``(variant, {"": whole pass, ":prep": ..., [":chain": ...,] ":scan": ...})`` of the plan ``fn`` runs, in us.
    A prep split around the chain (kernels_cu/prefill_prep.cuh, ``PrepSplit``) is timed as its two parts in turn."""
    fn()
    cupy.cuda.Device().synchronize()
    plan = list(_plan.PLANS.values())[-1]
    launcher = plan.launcher
    times = {"": time_graph(fn, iters=5).median_us}
    steps = launcher._steps
    parts = {2: {":prep": (0,), ":scan": (1,)}, 3: {":prep": (0,), ":chain": (1,), ":scan": (2,)},
             4: {":prep": (0, 2), ":chain": (1,), ":scan": (3,)}}[len(steps)]
    configs = launcher._configs
    for name, which in parts.items():  # a graph of those launches alone, in turn
        alone = tuple(steps[i] for i in which), (None,) * len(which)
        primed = []

        def call():
            # the whole pass first, on the timing's stream: the launches alone then read a workspace as the pass
            # leaves it (the segments await the chain's flag in it).  The launcher keeps a graph of its launches a
            # stream handle, and a new stream may get a handle back: forgotten, so that each call launches the
            # steps as set here.
            if not primed:
                launcher._steps, launcher._configs = steps, configs
                launcher._graphs.clear()
                fn()
                primed.append(True)
            launcher._steps, launcher._configs = alone
            launcher._graphs.clear()
            fn()

        times[name] = time_graph(call, iters=5).median_us
    launcher._steps, launcher._configs = steps, configs
    launcher._graphs.clear()
    _plan.PLANS.clear()
    return plan.variant, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["kv64c64wt", "kv64c64sg"],
                    help="timed beside the rules' choice without the transposed scans")
    ap.add_argument("--shapes", nargs="+", metavar="B,T,H", help="in place of the table's shapes and 64 heads")
    ap.add_argument("--ops", default="gdn,comba", help="comma-separated: gdn, comba")
    ap.add_argument("--head-size", type=int, default=128, choices=(64, 128), help="K = V")
    ap.add_argument("--pool", action="store_true", help="states in a pool of 2 B, at random slots")
    ap.add_argument("--ragged", action="store_true", help="the rows packed as sequences of one row (cu_seqlens)")
    ap.add_argument("--json", metavar="JSON")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    K = a.head_size
    rows = []
    for comba in [op == "comba" for op in a.ops.split(",")]:
        for B, T, H in shapes:
            q, k, v, p, beta, g, S = forward_inputs(B, T, H, K, K, xp=cupy, warm_steps=0, seed=T, dtype=bfloat16)
            out = cupy.empty(v.shape, bfloat16)
            states = dict(initial_state=S, state_out=cupy.empty_like(S))
            if a.pool:  # the final states go back to the pool's slots, in place
                rng = numpy.random.default_rng(T)
                pool = cupy.asarray(rng.standard_normal((2 * B,) + S.shape[1:]).astype(numpy.float32) / 8)
                slots = cupy.asarray(rng.permutation(2 * B)[:B].astype(numpy.int32))
                states = dict(initial_state=pool, state_indices=slots)
            if a.ragged:
                q, k, v, p, beta, g, out = (x.reshape((1, B * T) + x.shape[2:]) for x in (q, k, v, p, beta, g, out))
                states["cu_seqlens"] = cupy.arange(0, B * T + 1, T, dtype=cupy.int32)
            row = dict(op="comba" if comba else "gdn", B=B, T=T, H=H, K=K, **({"pool": True} if a.pool else {}),
                       **({"ragged": True} if a.ragged else {}))
            for variant in (tiling.choose("kv", K, K, comba, True, T, B * H, wgmma=True, transposed=False),
                            *a.variants):
                if comba:
                    def fn():
                        comba_forward(q, k, v, p, beta, g, out=out, variant=variant, **states)
                else:
                    def fn():
                        gated_delta_forward(q, k, v, beta, g, out=out, variant=variant, **states)
                name, times = _parts(fn)
                row.update({name + part: t for part, t in times.items()})
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
