"""A prefill and a 32-token greedy decode of a tiny random Qwen3-Next (tests/qwen3_next_tiny.py: three Gated
DeltaNet layers of 4 key / 8 value heads, K = V = 128, one attention layer) through transformers, with its own
torch implementation of the Gated DeltaNet layers and with cupy_comba.interop.transformers.patch().

    PYTHONPATH=.:tests python benchmarks/transformers_qwen3_next.py [--json FILE]

Wall time of model.generate (eager, bf16), median of 5 after a warm-up; the two ways in one process.
"""
import argparse
import json
import statistics
import time

import torch

from cupy_comba.interop import transformers as comba_transformers
from qwen3_next_tiny import tiny_model


def timed(model, ids, new):
    def once():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out
    once()
    runs = [once() for _ in range(5)]
    return statistics.median(t for t, _ in runs) * 1e3, runs[0][1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    model = tiny_model(torch.bfloat16)
    for B, T in ((1, 512), (8, 512), (1, 2048)):
        ids = torch.randint(1, 512, (B, T), device="cuda", generator=torch.Generator("cuda").manual_seed(B + T))
        ms_torch, out_torch = timed(model, ids, 32)
        comba_transformers.patch(model)
        try:
            ms_ours, out_ours = timed(model, ids, 32)
        finally:
            comba_transformers.unpatch()
        same = float((out_ours == out_torch).float().mean())
        rows.append(dict(B=B, T=T, new_tokens=32, transformers_torch_ms=round(ms_torch, 2),
                         cupy_comba_ms=round(ms_ours, 2), same_tokens_fraction=same))
        print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(what="tiny Qwen3-Next, bf16, model.generate (prefill + 32 greedy tokens), wall ms, median "
                                "of 5", torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
