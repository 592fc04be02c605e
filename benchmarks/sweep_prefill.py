"""Long forward passes: the 64-token prefill kernels against the library's other kernels, and against
flash-linear-attention's chunked kernels in the same process (bf16, K = V = 128, CUDA-graph replay).

    PYTHONPATH=. python benchmarks/sweep_prefill.py --tiling benchmarks/results/h200-prefill-tiling.json
    PYTHONPATH=. python benchmarks/sweep_prefill.py --lengths benchmarks/results/h200-prefill-lengths.json
    PYTHONPATH=. python benchmarks/sweep_prefill.py --between benchmarks/results/h200-prefill-between.json
    PYTHONPATH=.:/tmp/site python benchmarks/sweep_prefill.py --fla benchmarks/results/h200-prefill.json
    PYTHONPATH=.:/tmp/site python benchmarks/sweep_prefill.py --wgmma benchmarks/results/h200-prefill-wgmma.json
    PYTHONPATH=. python benchmarks/sweep_prefill.py --transposed benchmarks/results/h200-prefill-transposed.json
    PYTHONPATH=. python benchmarks/sweep_prefill.py --segments benchmarks/results/h200-prefill-segments.json
    PYTHONPATH=. python benchmarks/sweep_prefill.py --slow-gates benchmarks/results/h200-prefill-slow-gates.json

A row times each of its variants in three passes over them, the second in reverse order, and keeps the smallest
median of the three (the results files' notes say which of their rows were timed in two).

``--tiling``: Gated DeltaNet and Comba, "kv" and "vk", over 1-128 heads (H = 16; H = 32 from 32 heads
on) and T = 256-4096, at each K of ``--head-sizes``: both 64-token slabs and the kernel the rules
after the prefill rule choose (`_without_prefill`).
``--lengths``: Gated DeltaNet and Comba, "kv", over 1, 16, 32, 64 and 128 heads and T = 16-65536 at each K of
``--head-sizes``: the tiling's choice, both 64-token slabs and the kernel the rules after the prefill rule
choose (and on compute capability 9.0 the transposed scan, whole and in segments).  Rows hold the times only: the
renderer marks the choice of the tree it runs in.  The file is written after every point; ``--resume`` keeps the
points a file holds and times the rest (a sweep split over several runs, ``--head-sizes`` at a time).  Both sweeps time
the wgmma scan's slabs too on compute capability 9.0, where the library takes it for bf16 inputs, and
say so in the file (``"wgmma": true``).
``--between``: Gated DeltaNet and Comba in "kv", Gated DeltaNet in "vk", K = 128, B = 1 over 16-32 heads and T =
1536-4096 (between the other sweeps' head counts and lengths): the same variants as ``--lengths``.
``--fla`` (needs torch and fla-core): the shapes of the issue's table, both ops, our choice against
``chunk_gated_delta_rule`` / ``chunk_comba``, as rows ``{op, B, T, H, K, V, dtype, ours_us, fla_us}``;
and the relative errors of o and of the final state of both against the float64 reference at B = 1,
T = 1024, H = 4 (each library's bf16 default).
``--transposed`` (compute capability 9.0): ``prefill_scan_wt`` (``{layout}64c64wt``) against the variant the rules
choose without it, over 32-128 heads, T = 256-4096 (TRANSPOSED_GRID), rows as ``--wgmma``'s.
``--segments`` (compute capability 9.0): the segmented scan (``{layout}64c64sg``) over 1-64 heads and T = 1024-16384
(SEGMENTS_GRID) against the whole transposed scan and the choice without either, and cut into each of
SEGMENT_COUNTS segments (rows as ``--wgmma``'s, with ``segments: {count: us}`` and ``auto_segments``, the count
tiling.segments gives).
``--slow-gates`` (compute capability 9.0): the relative errors of o and of the final state against the float64
reference of the segmented scan, the whole transposed scan and the choice without either, under slowly decaying
gates (g / 100) at B = 1, T = 4096, H = 4 (rows ``{op, B, T, H, g_scale, <variant>: {o, state}}``).
``--wgmma`` (compute capability 9.0; the FLA rows need torch and fla-core): Gated DeltaNet and Comba, "kv" and
"vk", K = 64 / 128, 1-128 heads, T = 256 / 1024 / 8192: both slabs of ``prefill_scan`` (``c64``) and of its
wgmma form (``c64wg``), as rows ``{op, layout, K, V, B, T, H, us}``; then the ``--fla`` shapes.
"""

import argparse
import itertools
import json
import os

import cupy

from cupy_comba import _plan, bfloat16, comba_forward, families, gated_delta_forward, reference, tiling
from cupy_comba.bench import environment, time_graph
from cupy_comba.inputs import forward_inputs

K = V = 128
FLA_SHAPES = ((1, 1024, 16), (1, 4096, 16), (1, 8192, 16), (1, 32768, 32), (8, 2048, 16), (4, 4096, 32))


def _call(comba, args, **opts):
    """One forward pass into buffers made once (a captured call must not allocate), NaN until it writes them."""
    q, k, v, p, beta, g, S = args
    out, state_out = cupy.full(v.shape, cupy.nan, bfloat16), cupy.full(S.shape, cupy.nan, S.dtype)
    if comba:
        return lambda: comba_forward(q, k, v, p, beta, g, initial_state=S, out=out, state_out=state_out, **opts)
    return lambda: gated_delta_forward(q, k, v, beta, g, initial_state=S, out=out, state_out=state_out, **opts)


def _without_prefill(layout, K, V, comba, T, heads):
    """The variant the rules after the prefill rule choose: the kernel the prefill kernels replace."""
    case = tiling.Case(layout, K, V, comba, True, T, heads)
    assert tiling.RULES[0].name.startswith("prefill")
    return next(rule.variant(case) for rule in tiling.RULES[1:] if rule.applies(case))


def _hopper():
    """Whether this GPU runs the wgmma scan, which the library then chooses for bf16 inputs."""
    return families.runs_wgmma(cupy.cuda.Device().compute_capability)


def _inputs(layout, K, heads, T):
    """(B, H, the forward inputs) of ``heads`` = B H heads: H = 16, H = 32 from 32 heads on."""
    H = min(16 if heads < 32 else 32, heads)
    B = heads // H
    return B, H, forward_inputs(B, T, H, K, V, xp=cupy, state_layout=layout, warm_steps=0, seed=T)


def _timed(layout, K, comba, heads, T, variants, chosen, split=None):
    """One row: the times of ``variants`` (``chosen`` among them) on one shape, printed with the best and the
    chosen one's ratio to it; ``split``: ``(B, H)`` in place of _inputs' split of the heads."""
    if split is None:
        B, H, args = _inputs(layout, K, heads, T)
    else:
        B, H = split
        args = forward_inputs(B, T, H, K, V, xp=cupy, state_layout=layout, warm_steps=0, seed=T)
    # three passes over the variants, the second in reverse order, each variant's smallest median kept: a point's
    # variants differ by a few per cent, about what one pass's interference can add to one of them
    order = list(dict.fromkeys((chosen, *variants)))
    times = {}
    for variant in order + order[::-1] + order:
        us = time_graph(_call(comba, args, state_layout=layout, variant=variant), iters=5).median_us
        times[variant] = min(us, times.get(variant, us))
    # the point's plans and their workspaces (1.4 GB at 128 heads and T = 65536) are let go, or a sweep's points
    # pile up past the GPU's memory
    del args
    _plan.PLANS.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    best = min(times, key=times.get)
    op = "comba" if comba else "gdn"
    print(f"{op:5s} {layout} K={K} heads={heads:4d} T={T:6d} " + " ".join(f"{v}={t:9.1f}" for v, t in times.items())
          + f"  best {best}, chosen {chosen} ({times[chosen] / times[best]:.3f})", flush=True)
    return dict(op=op, layout=layout, B=B, T=T, H=H, K=K, V=V, us=times)


def _point(layout, K, comba, heads, T, wgmma, split=None):
    """One row: the times of the tiling's choice, both 64-token slabs (of both scans with ``wgmma``, and there the
    transposed scan, whole and in segments, at K = 64 and 128) and the kernel the rules after the prefill rule
    choose; ``split`` as _timed's."""
    scans = ("c64", "c64wg") if wgmma and K in families.FAMILY_K else ("c64",)
    transposed = tuple(f"{layout}{slab}c64{part}" for slab in (64, 128) for part in ("wt", "sg")) \
        if wgmma and K in (64, 128) else ()
    return _timed(layout, K, comba, heads, T, (_without_prefill(layout, K, V, comba, T, heads),
                                               *(f"{layout}{slab}{scan}" for scan in scans for slab in (16, 32)),
                                               *transposed),
                  tiling.choose(layout, K, V, comba, True, T, heads, wgmma=wgmma), split)


def sweep_tiling(layouts, head_sizes, wgmma):
    return [_point(layout, K, comba, heads, T, wgmma) for K, layout in itertools.product(head_sizes, layouts)
            for comba in (False, True) for heads in (1, 16, 32, 64, 128) for T in (256, 512, 1024, 4096)]


#: ``--lengths``: T = 16-65536, with both sides of each of the tiling's prefill thresholds (tiling.PREFILL_MIN_T,
#: tiling.PREFILL_MIN_T_WGMMA, tiling.TRANSPOSED_MIN_T) -- for T = 17 and 33, whose 16-token steps cost what T = 32
#: and 48 cost, those two -- and the lengths where the segmented scan begins (tiling.SEGMENTED_MIN_T,
#: tiling.PAIRED_SEGMENTS_MIN_T)
LENGTHS = (16, 32, 48, 49, 64, 96, 97, 112, 113, 128, 160, 161, 176, 177, 192, 256, 512, 513, 1024, 2048, 4096, 8192,
           65536)


def sweep_lengths(head_sizes, wgmma, rows=(), save=None):
    """The tiling's choice against the 64-token slabs and the kernel they replace, at every T of LENGTHS; the
    points of ``rows`` (a file this sweep began) kept and not timed again, ``save(rows)`` after each new one."""
    rows = list(rows)
    done = {(r["op"], r["K"], r["B"] * r["H"], r["T"]) for r in rows}
    for K, comba, heads, T in itertools.product(head_sizes, (False, True), (1, 16, 32, 64, 128), LENGTHS):
        if ("comba" if comba else "gdn", K, heads, T) in done:
            continue
        rows.append(_point("kv", K, comba, heads, T, wgmma))
        if save:
            save(rows)
    return rows


#: ``--between``: B = 1 over 16-32 heads (32-64 slabs of 64 columns) at K = 128 and T = 1536-4096, between the other
#: sweeps' head counts and lengths, where the 32-column wgmma scan leaves SMs idle and the segmented scan begins, one
#: warpgroup a CTA or two
BETWEEN_GRID = tuple((layout, comba, heads, T) for layout, comba in (("kv", False), ("kv", True), ("vk", False))
                     for heads in (16, 20, 24, 28, 32) for T in (1536, 2048, 2560, 3072, 4096))


def sweep_between(wgmma):
    """Every 64-token variant (as ``--lengths`` times them) over BETWEEN_GRID."""
    return [_point(layout, 128, comba, heads, T, wgmma, split=(1, heads)) for layout, comba, heads, T in BETWEEN_GRID]


#: ``--wgmma``: the grid of the wgmma scan against prefill_scan, both slabs (vk over 128 heads to T = 1024)
WGMMA_GRID = tuple((K, layout, comba, heads, T) for K in (128, 64) for layout in ("kv", "vk") for comba in (False, True)
                   for heads in (1, 16, 64, 128) for T in (256, 1024, 8192)
                   if not (layout == "vk" and heads == 128 and T == 8192))


def sweep_wgmma():
    """The 64-token scans on both slabs, mma.sync (``c64``) and wgmma (``c64wg``), over WGMMA_GRID."""
    return [_timed(layout, K_, comba, heads, T, [f"{layout}{slab}{scan}" for scan in ("c64", "c64wg")
                                                 for slab in (16, 32)],
                   tiling.choose(layout, K_, V, comba, True, T, heads, wgmma=True))
            for K_, layout, comba, heads, T in WGMMA_GRID]


#: ``--transposed``: the transposed wgmma scan (``{layout}64c64wt``) against the other scans' choice, 32-128 heads
TRANSPOSED_GRID = tuple((K, layout, comba, heads, T) for K, layout, comba in ((128, "kv", False), (128, "kv", True),
                                                                              (128, "vk", False), (64, "kv", False))
                        for heads in (32, 64, 128) for T in (256, 1024, 4096))


def sweep_transposed():
    """``prefill_scan_wt`` against what the rules choose without it, over TRANSPOSED_GRID."""
    rows = []
    for K_, layout, comba, heads, T in TRANSPOSED_GRID:
        without = tiling.choose(layout, K_, V, comba, True, T, heads, wgmma=True, transposed=False)
        rows.append(_timed(layout, K_, comba, heads, T, (without, f"{layout}64c64wt"),
                           tiling.choose(layout, K_, V, comba, True, T, heads, wgmma=True)))
    return rows


#: ``--segments``: the segmented scan (``{layout}64c64sg``) against the whole transposed scan and the other scans'
#: choice, 1-64 heads (B = 1; 64 heads as B = 2, H = 32), T = 1024-16384 ("vk" and K = 64 at two lengths)
SEGMENTS_GRID = tuple((K, layout, comba, heads, T) for K, layout, comba in ((128, "kv", False), (128, "kv", True))
                      for heads in (1, 4, 8, 16, 32, 64) for T in (1024, 2048, 4096, 8192, 16384)
                      if heads * T <= 32 * 16384) + \
    tuple((K, layout, False, heads, T) for K, layout in ((128, "vk"), (64, "kv")) for heads in (1, 8, 16, 32)
          for T in (2048, 8192))
#: ... and at each point the segmented scan cut into so many segments (the rows' ``segments``)
SEGMENT_COUNTS = (2, 4, 8, 16)


def sweep_segments(save=None):
    """Over SEGMENTS_GRID: the rules' choice, the segmented scan with tiling.segments' count and each of
    SEGMENT_COUNTS, the whole transposed scan, and the choice without the transposed scans; ``save(rows)``, if
    given, after each row."""
    rows = []
    for K_, layout, comba, heads, T in SEGMENTS_GRID:
        H = min(heads, 32)
        B = heads // H
        without = tiling.choose(layout, K_, V, comba, True, T, heads, wgmma=True, transposed=False)
        row = _timed(layout, K_, comba, heads, T, (without, f"{layout}64c64wt", f"{layout}64c64sg"),
                     tiling.choose(layout, K_, V, comba, True, T, heads, wgmma=True), (B, H))
        args = forward_inputs(B, T, H, K_, V, xp=cupy, state_layout=layout, warm_steps=0, seed=T)
        chunks, auto, row["segments"] = -(-T // 64), tiling.segments, {}
        try:
            for n in SEGMENT_COUNTS:
                if n <= chunks:
                    per = -(-chunks // n)
                    tiling.segments = lambda *_, n=n, per=per: (-(-chunks // per), per)
                    _plan.PLANS.clear()  # a plan holds its segments
                    call = _call(comba, args, state_layout=layout, variant=f"{layout}64c64sg")
                    row["segments"][n] = time_graph(call, iters=5).median_us
        finally:
            tiling.segments = auto
            _plan.PLANS.clear()
        row["auto_segments"] = tiling.segments(heads, V, T, cupy.cuda.Device().attributes["MultiProcessorCount"])[0]
        print("   segments " + " ".join(f"{n}: {t:.1f}" for n, t in row["segments"].items())
              + f"  (tiling.segments: {row['auto_segments']})", flush=True)
        rows.append(row)
        if save:
            save(rows)
    return rows


def segment_errors():
    """The relative errors of o and of the final state against the float64 reference under slowly decaying gates
    (g / 100: a 1/e memory of ~500 tokens, where each segment's start depends on all before it), Gated DeltaNet and
    Comba at B = 1, T = 4096, H = 4 from a warmed state: the segmented scan as tiling.segments cuts it, the whole
    transposed scan, and the choice without either."""
    rows = []
    for comba in (False, True):
        q, k, v, p, beta, g, S = forward_inputs(1, 4096, 4, K, V, xp=cupy, warm_steps=4, seed=4196)
        g = g / 100
        h = cupy.asnumpy
        S_ref, o_ref = reference.comba_loop(h(S), h(q), h(k), h(v), h(p if comba else k), h(beta), h(g))
        without = tiling.choose("kv", K, V, comba, True, 4096, 4, wgmma=True, transposed=False)
        row = dict(op="comba" if comba else "gdn", B=1, T=4096, H=4, g_scale=0.01)
        for variant in (without, "kv64c64wt", "kv64c64sg"):
            out, state_out = _call(comba, (q, k, v, p, beta, g, S), variant=variant)()
            row[variant] = {"o": float(reference.relative_error(out, o_ref)),
                            "state": float(reference.relative_error(state_out, S_ref))}
        print("   slow gates " + " ".join(f"{v}: o {e['o']:.2e} state {e['state']:.2e}" for v, e in row.items()
                                          if isinstance(e, dict)) + f" ({row['op']})", flush=True)
        rows.append(row)
    return rows


def sweep_fla(save=None):
    """The shapes of FLA_SHAPES against flash-linear-attention, ours on the library's choice (the wgmma scan's
    rule on compute capability 9.0), then the accuracy of both; ``save(rows, errors)``, if given, after each row
    and once more with the errors, so that a run stopped early leaves what it measured."""
    import torch
    from fla.ops.comba import chunk_comba
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from graph_replay import torch_graph

    T_ = lambda a: torch.from_dlpack(a)  # noqa: E731 - the same memory, no copy
    rows = []
    hopper = _hopper()
    for B, T, H in FLA_SHAPES:
        args = forward_inputs(B, T, H, K, V, xp=cupy, warm_steps=0, seed=T + H)
        q, k, v, p, beta, g, S = (T_(a) for a in args)
        for comba in (False, True):
            variant = tiling.choose("kv", K, V, comba, True, T, B * H, wgmma=hopper)
            ours = time_graph(_call(comba, args), iters=5).median_us
            if comba:
                fla = torch_graph(lambda: chunk_comba(q, k, v, p, g, beta, initial_state=S, output_final_state=True),
                                  iters=5, samples=3)
            else:
                fla = torch_graph(lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S,
                                                                 output_final_state=True), iters=5, samples=3)
            row = dict(op="comba" if comba else "gdn", B=B, T=T, H=H, K=K, V=V, dtype="bfloat16", ours_us=ours,
                       fla_us=fla, ours_variant=variant)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if save:
                save(rows, None)
    # accuracy of each library's bf16 default against float64 (Gated DeltaNet; FLA's Comba is another function)
    args = forward_inputs(1, 1024, 4, K, V, xp=cupy, warm_steps=4, seed=5)
    host = [cupy.asnumpy(a) for a in args]
    S_ref, o_ref = reference.comba_loop(host[6], host[0], host[1], host[2], host[1], host[4], host[5])
    o, S = gated_delta_forward(*args[:3], *args[4:6], initial_state=args[6])
    q, k, v, p, beta, g, S0 = (T_(a) for a in args)
    of, Sf = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    errors = dict(ours_o=reference.relative_error(o, o_ref), ours_state=reference.relative_error(S, S_ref),
                  fla_o=reference.relative_error(cupy.from_dlpack(of.contiguous()), o_ref),
                  fla_state=reference.relative_error(cupy.from_dlpack(Sf.contiguous()), S_ref),
                  shape=dict(B=1, T=1024, H=4, K=K, V=V))
    print(json.dumps(errors), flush=True)
    if save:
        save(rows, errors)
    return rows, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiling", metavar="JSON")
    ap.add_argument("--layouts", default="kv,vk")
    ap.add_argument("--head-sizes", default="128", help="K values for --tiling, comma-separated (V = 128)")
    ap.add_argument("--fla", metavar="JSON")
    ap.add_argument("--transposed", metavar="JSON", help="the transposed wgmma scan against the other scans' choice "
                                                         "(TRANSPOSED_GRID)")
    ap.add_argument("--segments", metavar="JSON", help="the segmented scan against the whole scans, and by its "
                                                       "number of segments (SEGMENTS_GRID)")
    ap.add_argument("--slow-gates", metavar="JSON", help="the segmented scan's errors against the reference under "
                                                         "slowly decaying gates, beside the whole scans'")
    ap.add_argument("--lengths", metavar="JSON", help="the tiling's choice against the best, T = 16 - 65536 (kv, "
                                                      "--head-sizes); written after every point")
    ap.add_argument("--between", metavar="JSON", help="the tiling's choice against the best over 16-32 heads, T = "
                                                      "1536-4096 (BETWEEN_GRID)")
    ap.add_argument("--resume", action="store_true", help="with --lengths: keep the points its file holds and time "
                                                          "the rest")
    ap.add_argument("--wgmma", metavar="JSON", help="the wgmma scan against prefill_scan (WGMMA_GRID), and against "
                                                    "flash-linear-attention on the FLA_SHAPES (needs torch, fla-core)")
    a = ap.parse_args()
    if a.wgmma:
        rows = sweep_wgmma()
        fla, _ = sweep_fla()
        with open(a.wgmma, "w") as f:
            json.dump({"environment": environment(), "rows": rows, "fla": fla}, f, indent=1)
    if a.lengths:
        report = {"environment": environment(), "wgmma": _hopper(), "rows": []}
        if a.resume and os.path.exists(a.lengths):  # its points kept, if they are of a GPU of the same kind
            with open(a.lengths) as f:
                report = json.load(f)
            if report["wgmma"] != _hopper() or report["environment"]["gpu"] != environment()["gpu"]:
                raise SystemExit(f"{a.lengths} holds a sweep of another GPU: leave out --resume")

        def save(rows):
            with open(a.lengths, "w") as f:
                json.dump(dict(report, rows=rows), f, indent=1)

        sweep_lengths([int(k) for k in a.head_sizes.split(",")], _hopper(), report["rows"], save)
    if a.between:
        rows = sweep_between(_hopper())
        with open(a.between, "w") as f:
            json.dump({"environment": environment(), "wgmma": _hopper(), "rows": rows}, f, indent=1)
    if a.tiling:
        rows = sweep_tiling(a.layouts.split(","), [int(k) for k in a.head_sizes.split(",")], _hopper())
        with open(a.tiling, "w") as f:
            json.dump({"environment": environment(), "wgmma": _hopper(), "rows": rows}, f, indent=1)
    if a.segments:
        def save(rows):
            with open(a.segments, "w") as f:
                json.dump({"environment": environment(), "rows": rows}, f, indent=1)

        sweep_segments(save)
    if a.slow_gates:
        with open(a.slow_gates, "w") as f:
            json.dump({"environment": environment(), "rows": segment_errors()}, f, indent=1)
    if a.transposed:
        rows = sweep_transposed()
        with open(a.transposed, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    if a.fla:
        def save(rows, errors):
            report = {"environment": environment(), "rows": rows}
            if errors:
                report["errors"] = errors
            with open(a.fla, "w") as f:
                json.dump(report, f, indent=1)

        sweep_fla(save)


if __name__ == "__main__":
    main()
