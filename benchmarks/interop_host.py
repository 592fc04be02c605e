"""Host time of a decode step through cupy_comba.interop.torch against the CuPy op it wraps (B = 8, H = 16,
K = V = 128, a pool of 64 "vk" slots, bf16), eager: wall time of many calls over their count, the GPU kept ahead.

    PYTHONPATH=. python benchmarks/interop_host.py
"""
import time

import cupy
import torch

import cupy_comba as cc
from cupy_comba.interop.torch import fused_recurrent_gated_delta_rule

B, H, K, V, N = 8, 16, 128, 128, 64
q, k = (torch.nn.functional.normalize(torch.randn(B, 1, H, K, device="cuda"), dim=-1).bfloat16() for _ in "qk")
v = torch.randn(B, 1, H, V, device="cuda").bfloat16()
g, beta = -torch.rand(B, 1, H, device="cuda") / 4, torch.rand(B, 1, H, device="cuda")
pool = torch.zeros(N, H, V, K, device="cuda")
slots = torch.arange(B, dtype=torch.int32, device="cuda") * 2


def adapter():
    fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool, state_v_first=True,
                                     ssm_state_indices=slots)


c = {n: cupy.from_dlpack(t) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta, pool=pool, slots=slots).items()}
out = cupy.empty((B, 1, H, V), cc.bfloat16)


def direct():
    cc.gated_delta_forward(c["q"], c["k"], c["v"], c["beta"], c["g"], initial_state=c["pool"],
                           state_indices=c["slots"], state_layout="vk", out=out)


for name, fn in (("cupy_comba.interop.torch", adapter), ("cupy_comba.gated_delta_forward", direct)) * 2:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name:32s} {1e6 * (t1 - t0) / n:7.1f} us a call (host)", flush=True)
