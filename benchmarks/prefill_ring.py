"""The wgmma scan's ring of stages (``prefill_scan_wg``, kernels_cu/prefill_wgmma.cu) against two stages, and
against three for every row: the library's tree as it is, and two copies of it made in a temporary directory with
a constant changed -- no room for a third stage in ``families.prefill_wg_bytes``, or ``kWgRingChunks`` and
``families.WG_RING_CHUNKS`` 0 -- each tree timed in its own process, alternating ``--rounds`` times.  Gated DeltaNet and
Comba on the 16-column and 32-column wgmma scans (bf16, K = V = 128, "kv", from a state, graph replay), dense
rows of T = 1024-8192 and packed sequences (``cu_seqlens``) of a 8192-token row, where the rules choose.

    PYTHONPATH=. python benchmarks/prefill_ring.py --json benchmarks/results/h200-prefill-ring.json

``{"environment", "runs": [{"tree": "ring" | "two stages" | "three stages", "us": {"<op> T<T> H<H> <variant>
N<sequences>": us, ...}}, ...]}`` (N None: a dense row; auto: the rules' choice).
"""

import contextlib
import os
import shutil
import sys
import tempfile

from cupy_comba.bench import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [("gdn", T, 16, "kv16c64wg", None) for T in (1024, 1536, 2048, 4096, 8192)] + \
        [("gdn", T, 32, "kv32c64wg", None) for T in (1024, 2048, 4096)] + \
        [("comba", T, 16, "kv16c64wg", None) for T in (1024, 4096)] + \
        [("gdn", 8192, 16, None, 1), ("gdn", 8192, 16, None, 4), ("gdn", 8192, 32, None, 8)]
#: (file, text, replacement) of each tree other than the library's
TREES = {
    "two stages": (("cupy_comba/families.py", "(3 if ring else 2) * stage", "2 * stage"),),
    "three stages": (("kernels_cu/prefill_wgmma.cu", "constexpr int kWgRingChunks = 24;",
                      "constexpr int kWgRingChunks = 0;"),
                     ("cupy_comba/families.py", "WG_RING_CHUNKS = 24", "WG_RING_CHUNKS = 0")),
}


def measure():
    """This process's timings of CASES, as ``{name: us}``."""
    import cupy

    from cupy_comba import bfloat16, comba_forward, gated_delta_forward
    from cupy_comba.bench import time_graph
    from cupy_comba.inputs import forward_inputs

    res = {}
    for op, T, H, variant, N in CASES:
        q, k, v, p, beta, g, S = forward_inputs(1, T, H, 128, 128, xp=cupy, warm_steps=0, seed=T, dtype=bfloat16)
        kw = dict(variant=variant)
        if N:
            kw["cu_seqlens"] = cupy.arange(N + 1, dtype=cupy.int32) * (T // N)
            S = cupy.concatenate([S] * N)
        o, so = cupy.full(v.shape, cupy.nan, bfloat16), cupy.full(S.shape, cupy.nan, S.dtype)
        if op == "comba":
            def fn():
                comba_forward(q, k, v, p, beta, g, initial_state=S, out=o, state_out=so, **kw)
        else:
            def fn():
                gated_delta_forward(q, k, v, beta, g, initial_state=S, out=o, state_out=so, **kw)
        res[f"{op} T{T} H{H} {variant or 'auto'} N{N}"] = round(time_graph(fn, iters=5).median_us, 2)
    return res


def _tree(where, edits):
    """A copy of the library's tree under ``where`` with ``edits`` made (each must apply once)."""
    for name in ("cupy_comba", "kernels_cu", "benchmarks"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(where, name))
    for path, text, replacement in edits:
        with open(os.path.join(where, path)) as f:
            source = f.read()
        if source.count(text) != 1:
            raise SystemExit(f"{path}: {text!r} is not there once; this benchmark no longer matches the tree")
        with open(os.path.join(where, path), "w") as f:
            f.write(source.replace(text, replacement))
    return where


@contextlib.contextmanager
def _trees():
    """``{name: (argv, env, cwd)}`` of the library's tree and the copies of TREES."""
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"ring": ROOT, **{name: _tree(os.path.join(tmp, str(i)), edits)
                                  for i, (name, edits) in enumerate(TREES.items())}}
        yield {name: ([sys.executable, os.path.join(root, "benchmarks", "prefill_ring.py"), "--worker"],
                      dict(os.environ, PYTHONPATH=root), root) for name, root in roots.items()}


def main():
    processes.main(measure, _trees, "tree", "times each tree is timed, in turn")


if __name__ == "__main__":
    main()
