"""The prefill plans' kernels launched as programmatic dependents of the kernel before them against launched one
after the other: the default choice at flash-linear-attention's table's shapes (bf16, K = V = 128, "kv", from a
state, graph replay), the segmented scan on one and two warpgroups a CTA (both ops, ``SEGMENTED_POINTS``) and the
wgmma scans at K = 64 over 1-128 heads (Gated DeltaNet, ``K64_POINTS``), each setting
in its own process, alternating ``--rounds`` times: every kernel after a plan's first a dependent
(``CUPY_COMBA_PDL=1`` and ``_plan.ALL_DEPENDENT``: those whose ``families.Kernel.dependent`` is False too), then
none (``CUPY_COMBA_PDL=0``).

    PYTHONPATH=. python benchmarks/prefill_launches.py --json benchmarks/results/h200-prefill-launches.json

``{"environment", "runs": [{"dependent": bool, "us": {"<op> B<B> T<T> H<H> [K64 ]<variant>": us, ...}}, ...]}``
(the default choices' keys end in the variant the rules took).
"""

import importlib.util
import os

from cupy_comba.bench import processes


def _sweep_prefill():
    """benchmarks/sweep_prefill.py as a module: its shapes and its forward-pass closures."""
    spec = importlib.util.spec_from_file_location("sweep_prefill",
                                                  os.path.join(os.path.dirname(__file__), "sweep_prefill.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: (B, T, H, variant) of the wgmma scans at K = 64, V = 128: the 16- and 32-column slabs, and the transposed scan
#: over 64 heads (one CTA an SM) and 128 (in pairs: one two-warpgroup CTA an SM).
K64_POINTS = ((1, 512, 16, "kv16c64wg"), (1, 1024, 16, "kv16c64wg"), (1, 8192, 1, "kv16c64wg"),
              (1, 8192, 32, "kv16c64wg"), (1, 256, 32, "kv32c64wg"), (1, 1024, 32, "kv32c64wg"),
              (1, 1024, 64, "kv32c64wg"), (1, 256, 64, "kv64c64wt"), (1, 320, 64, "kv64c64wt"),
              (1, 1024, 64, "kv64c64wt"), (1, 4096, 64, "kv64c64wt"), (1, 256, 128, "kv128c64wt"),
              (1, 1024, 128, "kv128c64wt"), (1, 4096, 128, "kv128c64wt"))


#: (B, T, H, variant) of the segmented scan at K = V = 128, on one warpgroup a 64-column CTA and on two a 128-column
#: one: over 16 heads from T = 4096 and 32 at T = 32768, and eight rows of 2048 (one segment a row, no chain).
SEGMENTED_POINTS = tuple((B, T, H, f"kv{slab}c64sg") for B, T, H in ((1, 4096, 16), (1, 8192, 16), (1, 32768, 32),
                                                                     (8, 2048, 16)) for slab in (64, 128))


def measure():
    """One process's timings, as ``{name: us}``, under the CUPY_COMBA_PDL it was started with: the shapes of
    flash-linear-attention's table and B = 1, T = 2048, H = 16, then SEGMENTED_POINTS and K64_POINTS."""
    import cupy

    from cupy_comba import _plan
    from cupy_comba.bench import time_graph
    from cupy_comba.inputs import forward_inputs

    sweep = _sweep_prefill()
    _plan.ALL_DEPENDENT = True

    def timed(comba, B, T, H, K=sweep.K, variant=None):
        """``"<op> B<B> T<T> H<H> [K64 ]<variant>"`` and the call's time in us (the variant the rules take where
        None)."""
        args = forward_inputs(B, T, H, K, sweep.V, xp=cupy, warm_steps=2, seed=T)
        _plan.PLANS.clear()
        us = time_graph(sweep._call(comba, args, variant=variant), iters=9).median_us
        variant = list(_plan.PLANS.values())[0].variant
        return f"{'comba' if comba else 'gdn'} B{B} T{T} H{H} {'K64 ' if K == 64 else ''}{variant}", round(us, 1)

    res = dict(timed(comba, B, T, H) for comba in (False, True)
               for B, T, H in sweep.FLA_SHAPES[:1] + ((1, 2048, 16),) + sweep.FLA_SHAPES[1:])
    res.update(timed(comba, B, T, H, variant=variant) for comba in (False, True)
               for B, T, H, variant in SEGMENTED_POINTS)
    res.update(timed(False, B, T, H, 64, variant) for B, T, H, variant in K64_POINTS)
    return res


def main():
    processes.main(measure, lambda: processes.same_tree(__file__, {
        dependent: dict(os.environ, CUPY_COMBA_PDL="1" if dependent else "0") for dependent in (True, False)}),
        "dependent", "pairs of processes (dependent launches, then in turn)")


if __name__ == "__main__":
    main()
