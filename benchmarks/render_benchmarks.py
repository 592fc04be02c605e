"""Render ``cupy-comba bench --json`` files into the tables of docs/benchmarks.md, and ``benchmarks/serving.py``'s
into those of docs/serving.md.

    python benchmarks/render_benchmarks.py docs/benchmarks.md benchmarks/results/h200-regime.json [more.json ...]
    python benchmarks/render_benchmarks.py docs/serving.md benchmarks/results/h200-serving.json

Rewrites the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` from the CLI's
reports, between ``<!-- forward:begin -->`` and ``<!-- forward:end -->`` from
``benchmarks/sweep_forward.py --json`` files, between ``<!-- tilings:begin -->``
and ``<!-- tilings:end -->`` from ``benchmarks/sweep_decode.py --json`` and
``benchmarks/sweep_forward_tilings.py --json`` files, and between ``<!-- prefill:begin -->`` and
``<!-- prefill:end -->`` from ``benchmarks/sweep_prefill.py`` files (``--fla``, ``--tiling``, ``--lengths`` and
``--between``), and between ``<!-- segments:begin -->`` and ``<!-- segments:end -->`` from its ``--segments`` file;
in docs/serving.md the decode, forward and verify tables between ``<!-- serving-decode:begin -->``,
``<!-- serving-forward:begin -->``, ``<!-- serving-verify:begin -->`` and their ends from a ``benchmarks/serving.py``
file.
"""

import json
import sys

BLOCKS = {"bench": ("<!-- bench:begin -->", "<!-- bench:end -->"),
          "forward": ("<!-- forward:begin -->", "<!-- forward:end -->"),
          "tilings": ("<!-- tilings:begin -->", "<!-- tilings:end -->"),
          "prefill": ("<!-- prefill:begin -->", "<!-- prefill:end -->"),
          "segments": ("<!-- segments:begin -->", "<!-- segments:end -->"),
          "serving-decode": ("<!-- serving-decode:begin -->", "<!-- serving-decode:end -->"),
          "serving-forward": ("<!-- serving-forward:begin -->", "<!-- serving-forward:end -->"),
          "serving-verify": ("<!-- serving-verify:begin -->", "<!-- serving-verify:end -->")}


def block_of(report):
    """The block a report fills: the serving file's three tables are each a block of their own (``serving_tables``)."""
    rows = report.get("rows") or [{}]
    if "kind" in rows[0]:
        return "serving"
    if "auto_segments" in rows[0]:
        return "segments"
    if "fla_us" in rows[0] or isinstance(rows[0].get("us"), dict):
        return "prefill"
    if "rows" in report and report["rows"] and "variant" in report["rows"][0]:
        return "tilings"
    return "forward" if "rows" in report else "bench"


def tables(report):
    """``{block: table}`` of what a report fills: the serving file its three blocks, any other report its one."""
    block = block_of(report)
    if block == "serving":
        return serving_tables(report)
    if block == "segments":
        one = prefill_segments_table(report)
    elif block == "prefill":
        one = prefill_fla_table(report) if "fla_us" in report["rows"][0] else prefill_tiling_table(report)
    elif block == "tilings":
        one = decode_tilings_table(report) if "op" in report["rows"][0] else forward_tilings_table(report)
    else:
        one = forward_table(report) if "rows" in report else decode_table(report)
    return {block: one}


def decode_tilings_table(report):
    """A ``benchmarks/sweep_decode.py --json`` file: fraction of copy of every tiling per (op, shape)."""
    env, roof = report["environment"], report["roofline"]
    lines = [f"**{env.get('gpu')}**, {env['date']}: decode steps, bf16, fraction of copy (copy "
             f"{roof['copy_gbps']:.0f} GB/s), graph replay; `*` marks the tiling `tiling.choose` picks.", "",
             "| op | B, H, K, V | tilings |", "|---|---|---|"]
    groups = {}
    for r in report["rows"]:
        groups.setdefault((r["op"], tuple(r["shape"])), []).append(r)
    for (op, shape), rows in groups.items():
        small = shape[0] * shape[1] <= 1024
        cells = ", ".join(f"{r['variant']} {r['fraction']:.3f}{' *' if r['chosen'] else ''}"
                          + (f" ({r['us']:.1f} us)" if small else "") for r in rows)
        lines.append(f"| {op} | {', '.join(map(str, shape))} | {cells} |")
    return "\n".join(lines)


def prefill_segments_table(report):
    """A ``benchmarks/sweep_prefill.py --segments`` file, its rows at K = 128 in "kv": the choice of the tree's rules
    without the transposed scans, the whole transposed scan, the segmented one on one warpgroup a CTA (cut as
    tiling.segments cuts it: the count in brackets), and the rules' choice."""
    from cupy_comba import tiling

    lines = ["| op | B*H | T | rules without the transposed scans | `kv64c64wt` | `kv64c64sg` (segments) | the rules' "
             "choice | choice / without |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if r["K"] != 128 or r["layout"] != "kv":
            continue
        heads, comba, us = r["B"] * r["H"], r["op"] == "comba", r["us"]
        without = tiling.choose("kv", 128, r["V"], comba, True, r["T"], heads, wgmma=True, transposed=False)
        chosen = tiling.choose("kv", 128, r["V"], comba, True, r["T"], heads, wgmma=True)
        lines.append(f"| {r['op']} | {heads} | {r['T']} | {without} {us[without]:.1f} | {us['kv64c64wt']:.1f} | "
                     f"{us['kv64c64sg']:.1f} ({r['auto_segments']}) | {chosen} {us[chosen]:.1f} | "
                     f"{us[chosen] / us[without]:.2f} |")
    return "\n".join(lines)


def prefill_fla_table(report):
    """A ``benchmarks/sweep_prefill.py --fla`` file: ours against flash-linear-attention's chunked kernels."""
    env = report["environment"]
    lines = [f"**{env.get('gpu')}**, {env['date']}: forward passes from a state, bf16, CUDA-graph replay, against "
             "flash-linear-attention 0.6's `chunk_gated_delta_rule` / `chunk_comba` in the same process.", "",
             "| op | B, T, H | K, V | ours us | M tokens/s | FLA us | FLA / ours | our kernel |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        tokens = r["B"] * r["T"] / r["ours_us"]
        lines.append(f"| {r['op']} | {r['B']}, {r['T']}, {r['H']} | {r['K']}, {r['V']} | {r['ours_us']:.1f} | "
                     f"{tokens:.1f} | {r['fla_us']:.1f} | {r['fla_us'] / r['ours_us']:.2f} | {r['ours_variant']} |")
    e = report.get("errors")
    if e:
        shape = ", ".join(f"{k} = {v}" for k, v in e["shape"].items())
        lines += ["", f"Relative errors against the float64 reference, Gated DeltaNet at {shape}, each library's "
                      f"bf16 default: ours o {e['ours_o']:.2e}, final state {e['ours_state']:.2e}; "
                      f"flash-linear-attention o {e['fla_o']:.2e}, final state {e['fla_state']:.2e}."]
    if report.get("note"):
        lines += ["", report["note"] + "."]
    return "\n".join(lines)


def prefill_tiling_table(report):
    """A ``benchmarks/sweep_prefill.py --tiling`` or ``--lengths`` file: per op, layout, K and B*H, at each T
    the variant the tree's ``tiling.choose`` picks and its time, and where another timed variant is faster,
    that one and how much slower the choice is."""
    from cupy_comba import tiling

    env = report["environment"]
    Ts = sorted({r["T"] for r in report["rows"]})
    lines = [f"**{env.get('gpu')}**, {env['date']}: forward passes from a state, V = 128, bf16, graph replay: the "
             "variant `tiling.choose` picks (without the transposed and segmented scans where the sweep did not time "
             "them) and its time in us; *best X r* where X, also timed, is faster by more than half a percent and "
             "the choice takes r times its time.", "",
             "| op | layout | K | B*H | " + " | ".join(f"T = {t}" for t in Ts) + " |",
             "|---|---|---|---|" + "---|" * len(Ts)]
    groups = {}
    for r in report["rows"]:
        groups.setdefault((r["op"], r["layout"], r.get("K", 128), r["B"] * r["H"]), {})[r["T"]] = r
    for (op, layout, K, heads), by_T in groups.items():
        cells = []
        for T in Ts:
            r = by_T.get(T)
            if r is None:
                cells.append("")
                continue
            # a row that did not time the transposed scans: the choice without them (a sweep before them)
            chosen = tiling.choose(layout, K, r.get("V", 128), op == "comba", True, T, heads,
                                   wgmma=report.get("wgmma", False), transposed=f"{layout}64c64wt" in r["us"])
            best = min(r["us"], key=r["us"].get)
            cell = f"{chosen} {r['us'][chosen]:.1f}" if chosen in r["us"] else f"{chosen} (not timed)"
            if chosen in r["us"] and r["us"][chosen] > 1.005 * r["us"][best]:  # beyond timing noise
                cell += f", *best {best} {r['us'][chosen] / r['us'][best]:.2f}*"
            cells.append(cell)
        lines.append(f"| {op} | {layout} | {K} | {heads} | " + " | ".join(cells) + " |")
    if report.get("note"):
        lines += ["", report["note"] + "."]
    return "\n".join(lines)


def forward_tilings_table(report):
    """A ``benchmarks/sweep_forward_tilings.py --json`` file: T-token time of every tiling."""
    env = report["environment"]
    Ts = sorted({r["T"] for r in report["rows"]})
    lines = [f"**{env.get('gpu')}**, {env['date']}: Gated DeltaNet forward from a state, H = {report['H']}, "
             f"V = {report['V']}, bf16, graph replay; us, and x the time of the decode step (T = 1, no variant "
             "forced).", "",
             "| layout | B*H | K | tiling | " + " | ".join(f"T = {t}" for t in Ts) + " |",
             "|---|---|---|---|" + "---|" * len(Ts)]
    groups = {}
    for r in report["rows"]:
        groups.setdefault((r["layout"], r.get("B", 512) * report["H"], r["K"], r["variant"]), {})[r["T"]] = r
    for (layout, heads, K, variant), by_t in groups.items():
        cells = " | ".join(f"{by_t[t]['us']:.1f} (x{by_t[t]['ratio_to_decode_T1']:.2f})" if t in by_t else "-"
                           for t in Ts)
        lines.append(f"| {layout} | {heads} | {K} | {variant} | {cells} |")
    return "\n".join(lines)


def forward_table(report):
    """A ``benchmarks/sweep_forward.py --json`` file: one row per (layout, B*H, T)."""
    env, roof = report["environment"], report["roofline"]
    lines = [
        f"**{env.get('gpu')}**, {env['date']}, Gated DeltaNet forward, K = V = 128, H = 16, bf16; copy roofline "
        f"{roof['copy_gbps']:.0f} GB/s; CUDA-graph replay, median of 10.",
        "",
        "| layout | B*H | T | us | M tokens/s | GB/s | x copy | time / time(T=1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['layout']} | {r['B'] * r['H']} | {r['T']} | {r['us']:.1f} | {r['tokens_per_s'] / 1e6:.2f} "
                     f"| {r['gbps']:.0f} | {r['fraction_of_copy']:.2f} | {r['ratio_to_T1']:.2f} |")
    return "\n".join(lines)


def decode_table(report):
    env, roof = report["environment"], report["roofline"]
    lines = [
        f"**{env.get('gpu', 'CPU (NumPy backend)')}**, {env['date']}, CuPy {env['cupy']}, "
        f"driver {env.get('driver')}, runtime {env.get('runtime')}; copy roofline "
        f"{roof['copy_gbps']:.0f} GB/s (cudaMemcpyAsync {roof['memcpy_gbps']:.0f}, float4 kernel "
        f"{roof['kernel_gbps']:.0f}, DRAM peak {roof['peak_gbps'] or 0:.0f}); median of {report['iters']} "
        "graph replays.",
        "",
        "| op | B, H, K, V | dtype | us (median) | min | max | eager us | host us/call | GB/s | x copy "
        "| err state | err o |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        shape = ", ".join(str(v) for v in r["shape"].values())
        host = "-" if r.get("host_us") is None else f"{r['host_us']:.1f}"
        lines.append(
            f"| {r['op']} | {shape} | {r['dtype']} | {r['us_median']:.1f} | {r['us_min']:.1f} | {r['us_max']:.1f} "
            f"| {r['us_eager']:.1f} | {host} | {r['gbps']:.0f} | {r['fraction_of_copy']:.3f} "
            f"| {r['errors']['state']:.1e} | {r['errors']['o']:.1e} |")
    return "\n".join(lines)


def serving_tables(report):
    """A ``benchmarks/serving.py --json`` file: ``{"serving-decode": table, "serving-forward": ...,
    "serving-verify": ...}``, each row a shape and layout in the file's order, times as the docs' columns put them
    (medians of the graph replays; "of copy" as the file has it)."""
    by = {}
    for r in report["rows"]:
        by.setdefault((r["layout"], tuple(r["shape"])), {})[r["kind"]] = r

    def shape(key):
        return ", ".join(map(str, key[1]))

    def us(rows, kind):
        return rows[kind]["median_us"]

    decode = ["| layout | B, H, K, V | dense us | of copy | pool us | of copy | slots in order / dense time | pooled "
              "copy, of copy | pool / pooled copy time | half padding / dense | gating / pool |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    forward = ["| layout | B, T, H, K, V | dense us | pool / dense | gating / pool | ragged / dense | ragged / pool | "
               "kernel |", "|---|---|---|---|---|---|---|---|"]
    verify = ["| layout | B, T, H, K, V | intermediate_states us | of copy | slot per token us | of copy | fan-out "
              "copy us | of copy | bulk fan-out us | of copy | writes alone us | of copy |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, rows in by.items():
        if "decode dense" in rows:
            dense, pool, copy = rows["decode dense"], rows["decode pool"], rows["copy through the pool"]
            decode.append(
                f"| {key[0]} | {shape(key)} | {dense['median_us']:.1f} | {dense['of_copy']:.3f} | "
                f"{pool['median_us']:.1f} | {pool['of_copy']:.3f} | "
                f"{us(rows, 'decode pool, slots in order') / dense['median_us']:.3f} | {copy['of_copy']:.3f} | "
                f"{pool['median_us'] / copy['median_us']:.3f} | "
                f"{us(rows, 'decode pool, half padding') / dense['median_us']:.3f} | "
                f"{us(rows, 'decode pool + gating') / pool['median_us']:.3f} |")
        if "forward dense" in rows:
            dense, pool, ragged = (us(rows, k) for k in ("forward dense", "forward pool", "forward ragged"))
            forward.append(
                f"| {key[0]} | {shape(key)} | {dense:.1f} | {pool / dense:.3f} | "
                f"{us(rows, 'forward pool + gating') / pool:.3f} | {ragged / dense:.3f} | {ragged / pool:.3f} | "
                f"`{rows['forward dense']['variant']}` |")
        if "verify intermediate_states" in rows:
            kinds = ("verify intermediate_states", "verify slot per token", "copy, one read T writes",
                     "copy, one read T bulk writes", "writes alone")
            verify.append(f"| {key[0]} | {shape(key)} | " + " | ".join(
                f"{rows[k]['median_us']:.1f} | {rows[k]['of_copy']:.3f}" if k in rows else "- | -" for k in kinds)
                          + " |")
    return {"serving-decode": "\n".join(decode), "serving-forward": "\n".join(forward),
            "serving-verify": "\n".join(verify)}


def main():
    doc, *paths = sys.argv[1:]
    text = open(doc).read()
    reports = [(path, json.load(open(path))) for path in paths]
    rendered = [(path, tables(r)) for path, r in reports]
    for name, (begin, end) in BLOCKS.items():
        mine = [(path, filled[name]) for path, filled in rendered if name in filled]
        if not mine:
            continue
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        body = "\n\n".join(t + f"\n\n(from `{path}`)" for path, t in mine)
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    with open(doc, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
