"""Decode steps over 1-512 heads: every decode variant (Gated DeltaNet and Comba, kv and vk) beside
flash-linear-attention's fused recurrent kernels, in one process, both CUDA-graph replayed; each variant
timed in two rounds, the lower kept.

    PYTHONPATH=.:<fla-core and einops> python benchmarks/decode_few_heads.py --json FILE

FLA (fla-core 0.6.0 and einops, with torch) is a measuring tool here, never a dependency.
"""
import argparse
import json

import cupy as cp
import torch
import torch.nn.functional as F
from fla.ops.comba import fused_recurrent_comba
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

import cupy_comba as cc
from graph_replay import cupy_graph, torch_graph
from cupy_comba import families, tiling

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
args = ap.parse_args()


rows = []
K = V = 128
C = cp.from_dlpack
for B, H in ((1, 1), (1, 4), (1, 8), (1, 16), (2, 16), (4, 16), (8, 16), (16, 16), (32, 16)):
    gen = torch.Generator(device="cuda").manual_seed(B * H)
    q = torch.randn(B, 1, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    k = F.normalize(torch.randn(B, 1, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, 1, H, V, device="cuda", generator=gen).to(torch.bfloat16)
    beta = torch.rand(B, 1, H, device="cuda", generator=gen).sigmoid().to(torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, 1, H, device="cuda", generator=gen)) / 4).float()
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen) * 0.3
    p = F.normalize(torch.randn(B, 1, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    res = {"B": B, "H": H}
    res["fla_us"] = torch_graph(lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                                         output_final_state=True))
    res["fla_comba_us"] = torch_graph(lambda: fused_recurrent_comba(q, k, p, v, g, beta, initial_state=h0,
                                                                    output_final_state=True))
    cq, ck, cv, cpp, cb, cg = (C(x[:, 0]) for x in (q, k, v, p, beta, g))
    states = {"kv": C(h0), "vk": cp.ascontiguousarray(C(h0).swapaxes(-1, -2))}
    for _ in range(2):  # two rounds, the lower time kept
        for op in ("", "comba "):
            for layout, S in states.items():
                so, oo = cp.empty_like(S), cp.empty((B, H, V), cc.bfloat16)
                for var in families.variants(layout, K, V):
                    if op:
                        fn = lambda: cc.comba_decode_step(S, cq, ck, cv, cpp, cb, cg, out=oo, state_out=so,
                                                          state_layout=layout, variant=var)
                    else:
                        fn = lambda: cc.gated_delta_decode_step(S, cq, ck, cv, cb, cg, out=oo, state_out=so,
                                                                state_layout=layout, variant=var)
                    key = f"{op}{layout}:{var}"
                    res[key] = min(cupy_graph(fn), res.get(key, float("inf")))
    for op in ("", "comba "):
        for layout in states:
            res[f"{op}{layout}:chosen"] = tiling.choose(layout, K, V, bool(op), False, 1, B * H)
    rows.append(res)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"what": "gated_delta_decode_step and comba_decode_step (kv, vk), K = V = 128, bf16 (g float32), "
                           "every decode variant (the lower of two rounds), and flash-linear-attention's "
                           "fused_recurrent_gated_delta_rule / fused_recurrent_comba (kv state), CUDA-graph replay",
                   "rows": rows}, f, indent=1)
