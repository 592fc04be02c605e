"""Decode steps over 1-128 heads: every decode variant (Gated DeltaNet kv and vk, Comba kv) beside
flash-linear-attention's fused recurrent kernels, in one process, both CUDA-graph replayed.

    PYTHONPATH=.:<fla-core and einops> python benchmarks/decode_few_heads.py --json FILE

FLA (fla-core 0.6.0 and einops, with torch) is a measuring tool here, never a dependency.
"""
import argparse
import json

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F
from fla.ops.comba import fused_recurrent_comba
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

import cupy_comba as cc
from cupy_comba import families, tiling

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
args = ap.parse_args()

def cupy_graph(fn, iters=200):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for _ in range(3): fn()
        s.synchronize(); s.begin_capture()
        for _ in range(iters): fn()
        g = s.end_capture(); g.launch(s); s.synchronize()
        ts = []
        for _ in range(5):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s); g.launch(s); b.record(s); b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / iters)
    return float(np.median(ts))

def torch_graph(fn, iters=200):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / iters)
    return float(np.median(ts))

rows = []
K = V = 128
C = cp.from_dlpack
for B, H in ((1, 1), (1, 4), (1, 8), (1, 16), (2, 16), (4, 16), (8, 16)):
    gen = torch.Generator(device="cuda").manual_seed(B * H)
    q = torch.randn(B, 1, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    k = F.normalize(torch.randn(B, 1, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, 1, H, V, device="cuda", generator=gen).to(torch.bfloat16)
    beta = torch.rand(B, 1, H, device="cuda", generator=gen).sigmoid().to(torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, 1, H, device="cuda", generator=gen)) / 4).float()
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen) * 0.3
    fla = torch_graph(lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True))
    cq, ck, cv, cb, cg = (C(x[:, 0]) for x in (q, k, v, beta, g))
    res = {"B": B, "H": H, "fla_us": fla}
    p = F.normalize(torch.randn(B, 1, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    res["fla_comba_us"] = torch_graph(lambda: fused_recurrent_comba(q, k, p, v, g, beta, initial_state=h0,
                                                                    output_final_state=True))
    cpp = C(p[:, 0])
    for var in families.variants("kv", K, V):  # Comba, kv
        S, so, oo = C(h0), cp.empty_like(C(h0)), cp.empty((B, H, V), cc.bfloat16)
        res[f"comba kv:{var}"] = cupy_graph(lambda: cc.comba_decode_step(S, cq, ck, cv, cpp, cb, cg, out=oo, state_out=so,
                                                                         variant=var))
    res["comba kv:chosen"] = tiling.choose("kv", K, V, True, False, 1, B * H)
    for layout in ("kv", "vk"):
        S = C(h0) if layout == "kv" else cp.ascontiguousarray(C(h0).swapaxes(-1, -2))
        so, oo = cp.empty_like(S), cp.empty((B, H, V), cc.bfloat16)
        chosen = tiling.choose(layout, K, V, False, False, 1, B * H)
        for var in families.variants(layout, K, V):
            t = cupy_graph(lambda: cc.gated_delta_decode_step(S, cq, ck, cv, cb, cg, out=oo, state_out=so, state_layout=layout, variant=var))
            res[f"{layout}:{var}"] = t
        res[f"{layout}:chosen"] = chosen
    rows.append(res)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"what": "gated_delta_decode_step (kv, vk) and comba_decode_step (kv), K = V = 128, bf16, every "
                           "decode variant, and flash-linear-attention's fused_recurrent_gated_delta_rule / "
                           "fused_recurrent_comba (kv state), CUDA-graph replay",
                   "rows": rows}, f, indent=1)
