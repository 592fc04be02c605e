"""Decode steps on the builds for one activation dtype (families.kernel's ``act``, kernels_cu/params.cuh) against the
builds that read dtypes and strides at run time, in one process, alternating, the lower of two rounds kept: every
decode variant over 1-128 heads (K = V = 128, bf16, g float32) beside flash-linear-attention's fused recurrent
kernels, and the chosen tiling at four decode batches against the device-to-device copy.  All CUDA-graph replayed.

    PYTHONPATH=.:<fla-core and einops> python benchmarks/decode_dtype_builds.py --json FILE

The run-time builds are had by calling families.kernel with ``act=None`` (a patch of this process only).
FLA (fla-core 0.6.0 and einops, with torch) is a measuring tool here, never a dependency.
"""
import argparse
import json

import cupy as cp
import torch
import torch.nn.functional as F
from fla.ops.comba import fused_recurrent_comba
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from graph_replay import cupy_graph, torch_graph

import cupy_comba as cc
from cupy_comba import _plan, families, tiling
from cupy_comba.bench import measure_copy
from cupy_comba.inputs import decode_inputs

LIBRARY_KERNEL = families.kernel
MODES = ("fixed", "runtime")  # the build for one activation dtype (where the call's allow it), the run-time one


def set_mode(mode):
    """Plans made from here on take the builds of ``mode``."""
    families.kernel = LIBRARY_KERNEL if mode == "fixed" else \
        (lambda *a, act=None, **kw: LIBRARY_KERNEL(*a, act=None, **kw))
    _plan.PLANS.clear()


def step(op, S, q, k, v, p, beta, g, out, state_out, layout, variant=None):
    if op == "gdn":
        return lambda: cc.gated_delta_decode_step(S, q, k, v, beta, g, out=out, state_out=state_out,
                                                  state_layout=layout, variant=variant)
    return lambda: cc.comba_decode_step(S, q, k, v, p, beta, g, out=out, state_out=state_out, state_layout=layout,
                                        variant=variant)


ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
args = ap.parse_args()
K = V = 128
C = cp.from_dlpack
OPS = (("gdn", "kv"), ("comba", "kv"), ("gdn", "vk"), ("comba", "vk"))

rows = []  # 1-128 heads: every decode variant in both modes, FLA beside them
for B, H in ((1, 1), (1, 4), (1, 8), (1, 16), (2, 16), (4, 16), (8, 16)):
    gen = torch.Generator(device="cuda").manual_seed(B * H)
    q = torch.randn(B, 1, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    k = F.normalize(torch.randn(B, 1, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, 1, H, V, device="cuda", generator=gen).to(torch.bfloat16)
    p = F.normalize(torch.randn(B, 1, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    beta = torch.rand(B, 1, H, device="cuda", generator=gen).sigmoid().to(torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, 1, H, device="cuda", generator=gen)) / 4).float()
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen) * 0.3
    res = {"B": B, "H": H}
    res["fla gdn"] = torch_graph(lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                                          output_final_state=True), samples=7)
    res["fla comba"] = torch_graph(lambda: fused_recurrent_comba(q, k, p, v, g, beta, initial_state=h0,
                                                                 output_final_state=True), samples=7)
    cq, ck, cv, cpp, cb, cg = (C(x[:, 0]) for x in (q, k, v, p, beta, g))
    states = {"kv": C(h0), "vk": cp.ascontiguousarray(C(h0).swapaxes(-1, -2))}
    for _ in range(2):  # two rounds, alternating the modes; the lower time kept
        for mode in MODES:
            set_mode(mode)
            for op, layout in OPS:
                S = states[layout]
                so, oo = cp.empty_like(S), cp.empty((B, H, V), cc.bfloat16)
                for var in families.variants(layout, K, V):
                    key = f"{op} {layout}:{var} {mode}"
                    t = cupy_graph(step(op, S, cq, ck, cv, cpp, cb, cg, oo, so, layout, var), samples=7)
                    res[key] = min(t, res.get(key, float("inf")))
    rows.append(res)
    chosen = {f"{op} {lay}": tiling.choose(lay, K, V, op == "comba", heads=B * H) for op, lay in OPS}
    print(B * H, "FLA gdn %.2f comba %.2f" % (res["fla gdn"], res["fla comba"]),
          {k: "%s %.2f / %.2f" % (v, res[f"{k}:{v} fixed"], res[f"{k}:{v} runtime"]) for k, v in chosen.items()},
          flush=True)

roof = measure_copy()
big = []  # the chosen tiling at four decode batches, both modes, against the copy
for B, H, K2, V2 in ((896, 16, 128, 128), (448, 32, 128, 128), (1280, 16, 64, 128), (64, 16, 128, 128)):
    st, q2, k2, v2, p2, b2, g2 = decode_inputs(B, H, K2, V2, xp=cp, seed=1)
    for layout in ("kv", "vk"):
        S = st if layout == "kv" else cp.ascontiguousarray(st.swapaxes(-1, -2))
        so, oo = cp.empty_like(S), cp.empty((B, H, V2), cc.bfloat16)
        for op in ("gdn", "comba"):
            r = {"shape": (B, H, K2, V2), "layout": layout, "op": op}
            for _ in range(2):
                for mode in MODES:
                    set_mode(mode)
                    t = cupy_graph(step(op, S, q2, k2, v2, p2, b2, g2, oo, so, layout), 50, samples=7)
                    r[mode] = min(t, r.get(mode, float("inf")))
            nbytes = 8 * B * H * K2 * V2 + 2 * B * H * (4 * K2 if op == "comba" else 3 * K2)  # state, keys and v
            r["frac_fixed"] = nbytes / r["fixed"] / 1e3 / roof.copy_gbps
            r["frac_runtime"] = nbytes / r["runtime"] / 1e3 / roof.copy_gbps
            big.append(r)
            print("big", r, flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"tiny": rows, "big": big, "copy_gbps": roof.copy_gbps}, f, indent=1)
