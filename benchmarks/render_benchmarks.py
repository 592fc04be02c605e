"""Render ``cupy-comba bench --json`` files into the tables of docs/benchmarks.md.

    python benchmarks/render_benchmarks.py docs/benchmarks.md docs/bench-h200-regime.json [more.json ...]

Rewrites the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``.  Takes both the
CLI's reports and ``benchmarks/sweep_forward.py --json`` files.
"""

import json
import sys

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def table(report):
    return forward_table(report) if "rows" in report else decode_table(report)


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


def main():
    doc, *reports = sys.argv[1:]
    text = open(doc).read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = "\n\n".join(table(json.load(open(path))) + f"\n\n(from `{path}`)" for path in reports)
    with open(doc, "w") as f:
        f.write(f"{head}{BEGIN}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    main()
