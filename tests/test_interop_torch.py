"""cupy_comba.interop.torch: flash-linear-attention's calls on torch tensors, against the float64 reference (the
NumPy path of the public ops), on torch's stream and inside torch's CUDA graphs.  Skips without torch."""

import doctest

import numpy
import pytest

from cupy_comba import comba_forward, gated_delta_forward, reference, tiling

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from cupy_comba.interop import torch as ct  # noqa: E402

F32 = numpy.float32
O_TOL = {torch.bfloat16: 4e-3, torch.float32: 2e-6}
STATE_TOL = 1e-6
#: The 64-token chunks (the variants ``tiling.choose`` names ``...c64...``) run bf16 activations in precision "bf16":
#: their state is held to that precision's bound (tests/test_prefill_gpu.py).
BF16_STATE_TOL = 4e-3


def _np(t):
    return None if t is None else t.detach().float().cpu().numpy()


def _inputs(B, T, H, HV, K, V, dtype, seed, layout="kv", N=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = randn(B, T, H, K).to(dtype)
    k = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    p = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    v = randn(B, T, HV, V).to(dtype)
    g = (torch.nn.functional.logsigmoid(randn(B, T, HV)) / 4).to(dtype)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).to(dtype)
    head = (K, V) if layout == "kv" else (V, K)
    h0 = randn(B if N is None else N, HV, *head) * 0.3
    return q, k, v, p, g, beta, h0


def _close(o, S, o_ref, S_ref, dtype, T=1, layout="kv", heads=12):
    """o and S against the reference; K = V = 64, T tokens over ``heads`` = B * H value heads."""
    assert reference.relative_error(_np(o), o_ref) <= O_TOL[dtype]
    if S_ref is not None:
        bf16_chunks = dtype == torch.bfloat16 and "c64" in tiling.choose(layout, 64, 64, False, True, T, heads)
        assert reference.relative_error(_np(S), S_ref) <= (BF16_STATE_TOL if bf16_chunks else STATE_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_the_four_calls_equal_the_reference(T, layout, dtype):
    """Each call with flash-linear-attention's argument order (g before beta; p before v in fused_recurrent_comba),
    GVA (2 key heads, 4 value heads), in-kernel L2 norm, from a state, in both layouts."""
    q, k, v, p, g, beta, h0 = _inputs(3, T, 2, 4, 64, 64, dtype, seed=T, layout=layout)
    vf, l2 = layout == "vk", True
    opts = dict(initial_state=_np(h0), state_layout=layout, use_qk_l2norm=l2)
    o_g, S_g = gated_delta_forward(*map(_np, (q, k, v, beta, g)), **opts)
    o_c, S_c = comba_forward(*map(_np, (q, k, v, p, beta, g)), **opts)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, state_v_first=vf)
    _close(*ct.chunk_gated_delta_rule(q, k, v, g, beta, **kw), o_g, S_g, dtype, T, layout)
    _close(*ct.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, **kw), o_g, S_g, dtype, T, layout)
    _close(*ct.chunk_comba(q, k, v, p, g, beta, **kw), o_c, S_c, dtype, T, layout)
    _close(*ct.fused_recurrent_comba(q, k, p, v, g, beta, **kw), o_c, S_c, dtype, T, layout)
    o, S = ct.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, state_v_first=vf,
                                     use_qk_l2norm_in_kernel=l2)
    assert S is None and reference.relative_error(_np(o), o_g) <= O_TOL[dtype]


def test_defaults_and_a_bf16_initial_state():
    """g=None is no decay, beta=None ones, scale=None K ** -0.5; a bf16 initial_state is read as float32."""
    q, k, v, p, g, beta, h0 = _inputs(2, 3, 2, 2, 64, 64, torch.bfloat16, seed=5)
    zeros, ones = torch.zeros_like(g), torch.ones_like(beta)
    o, S = ct.fused_recurrent_gated_delta_rule(q, k, v, initial_state=h0.bfloat16(), output_final_state=True)
    o_ref, S_ref = gated_delta_forward(*map(_np, (q, k, v, ones, zeros)), initial_state=_np(h0.bfloat16()))
    _close(o, S, o_ref, S_ref, torch.bfloat16)
    o2, _ = ct.fused_recurrent_gated_delta_rule(q, k, v, initial_state=h0, scale=64 ** -0.5)
    o3, _ = ct.fused_recurrent_gated_delta_rule(q, k, v, initial_state=h0)
    assert torch.equal(o2, o3)


def test_gating_ragged_and_a_vllm_pool():
    """In-kernel gating and the sigmoid of beta; a ragged batch (an empty sequence among them) from and back into
    vLLM-style pool slots ("vk" states, a padding row): against the NumPy path with the same options."""
    lens = [3, 0, 5, 1]
    total, HV = sum(lens), 4
    q, k, v, p, g, beta, _ = _inputs(1, total, 2, HV, 64, 64, torch.bfloat16, seed=11)
    pool = torch.randn(9, HV, 64, 64, device="cuda") * 0.3
    slots = torch.tensor([4, 0, -1, 7], dtype=torch.int32, device="cuda")
    cu = torch.tensor(numpy.concatenate([[0], numpy.cumsum(lens)]), dtype=torch.int64, device="cuda")
    A_log, dt_bias = torch.randn(HV, device="cuda") / 2, torch.randn(HV, device="cuda")
    host_pool = _np(pool).copy()
    o_ref, _ = gated_delta_forward(*map(_np, (q, k, v, beta, g)), initial_state=host_pool,
                                   state_indices=slots.cpu().numpy(), cu_seqlens=cu.cpu().numpy(), A_log=_np(A_log),
                                   dt_bias=_np(dt_bias), use_beta_sigmoid=True, state_layout="vk")
    before = pool.clone()
    o, S = ct.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool, state_v_first=True,
                                               cu_seqlens=cu, ssm_state_indices=slots, use_gate_in_kernel=True,
                                               A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    assert S is pool
    _close(o, pool, o_ref, host_pool, torch.bfloat16)
    untouched = [1, 2, 3, 5, 6, 8]
    assert torch.equal(pool[untouched], before[untouched])
    assert not o[0, 3:8].any()  # the padding row's tokens


def test_vllm_speculative_verify():
    """2-D ssm_state_indices with num_accepted_tokens: each token's state to its slot, each row from its accepted
    slot (a count of 0 makes a padding row), as the NumPy path computes them."""
    B, T, HV = 3, 4, 2
    q, k, v, p, g, beta, _ = _inputs(B, T, 2, HV, 64, 64, torch.bfloat16, seed=17)
    pool = torch.randn(B * T + 1, HV, 64, 64, device="cuda") * 0.3
    slots = torch.arange(B * T, dtype=torch.int64, device="cuda").reshape(B, T) + 1
    accepted = torch.tensor([2, 0, 4], dtype=torch.int32, device="cuda")
    host_pool = _np(pool).copy()
    o_ref, _ = comba_forward(*map(_np, (q, k, v, p, beta, g)), initial_state=host_pool,
                             state_indices=slots.cpu().numpy(), num_accepted_tokens=accepted.cpu().numpy())
    o, S = ct.fused_recurrent_comba(q, k, p, v, g, beta, initial_state=pool, ssm_state_indices=slots,
                                    num_accepted_tokens=accepted)
    assert S is pool
    _close(o, pool, o_ref, host_pool, torch.bfloat16)
    assert not o[1].any()


def test_runs_on_torch_current_stream():
    """The kernel is ordered after the caller's work on torch's current stream: v2 is filled on a side stream
    behind a 20 ms sleep, and the call on that stream reads the filled values, not the NaNs before them."""
    q, k, v, p, g, beta, h0 = _inputs(2, 1, 2, 2, 64, 64, torch.float32, seed=23)
    v2 = torch.full_like(v, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(40_000_000)
        v2.copy_(v)
        o, S = ct.fused_recurrent_gated_delta_rule(q, k, v2, g, beta=beta, initial_state=h0, output_final_state=True)
    side.synchronize()
    o_ref, S_ref = gated_delta_forward(*map(_np, (q, k, v, beta, g)), initial_state=_np(h0))
    _close(o, S, o_ref, S_ref, torch.float32)


def test_captured_in_a_torch_cuda_graph_and_replayed_on_new_inputs():
    q, k, v, p, g, beta, h0 = _inputs(4, 1, 2, 4, 64, 64, torch.bfloat16, seed=29, layout="vk")
    pool = torch.randn(6, 4, 64, 64, device="cuda") * 0.3
    slots = torch.tensor([5, 1, -1, 2], dtype=torch.int32, device="cuda")
    statics = [x.clone() for x in (q, k, v, g, beta)]

    def step():
        sq, sk, sv, sg, sb = statics
        return ct.fused_recurrent_gated_delta_rule(sq, sk, sv, sg, beta=sb, initial_state=pool, state_v_first=True,
                                                   ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm: compile and plan outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = step()
    fresh = _inputs(4, 1, 2, 4, 64, 64, torch.bfloat16, seed=31, layout="vk")
    for dst, src in zip(statics, (fresh[0], fresh[1], fresh[2], fresh[4], fresh[5])):
        dst.copy_(src)
    slots.copy_(torch.tensor([0, 3, 4, -1], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    host_pool = _np(pool).copy()
    o_ref, _ = gated_delta_forward(*map(_np, (statics[0], statics[1], statics[2], statics[4], statics[3])),
                                   initial_state=host_pool, state_indices=slots.cpu().numpy(),
                                   state_layout="vk", use_qk_l2norm=True)
    graph.replay()
    torch.cuda.synchronize()
    _close(o, pool, o_ref, host_pool, torch.bfloat16)


@pytest.mark.parametrize("call,match,error", [
    (lambda a: ct.chunk_gated_delta_rule(*a, allow_neg_eigval=True), "allow_neg_eigval", NotImplementedError),
    (lambda a: ct.fused_recurrent_gated_delta_rule(*a[:3], gk=a[0]), "gk, gv", NotImplementedError),
    (lambda a: ct.chunk_gated_delta_rule(*a, not_an_option=1), "not_an_option", TypeError),
    (lambda a: ct.chunk_gated_delta_rule(*(x.cpu() for x in a)), "CUDA tensors", ValueError),
    (lambda a: ct.chunk_gated_delta_rule(a[0].cpu().numpy(), *a[1:]), "torch.Tensor", TypeError),
    (lambda a: ct.chunk_gated_delta_rule(*a, ssm_state_indices=a[0][0, 0, :, 0].int()), "initial_state",
     ValueError),
    (lambda a: ct.chunk_gated_delta_rule(*a, use_gate_in_kernel=True), "A_log", ValueError),
], ids=["neg-eigval", "gk", "unknown", "cpu", "numpy", "pool-without-state", "gate-without-A_log"])
def test_what_is_refused_says_so(call, match, error):
    q, k, v, p, g, beta, h0 = _inputs(1, 2, 2, 2, 64, 64, torch.float32, seed=37)
    with pytest.raises(error, match=match):
        call((q, k, v, g, beta))


def test_pool_errors():
    q, k, v, p, g, beta, h0 = _inputs(2, 2, 2, 2, 64, 64, torch.float32, seed=41)
    slots = torch.tensor([[0, 1], [2, 3]], device="cuda")
    cu = torch.tensor([0, 2, 4], device="cuda")
    with pytest.raises(ValueError, match="inplace_final_state must be True"):
        ct.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0, ssm_state_indices=slots[0],
                                            inplace_final_state=False)
    packed = [x.reshape((1, 4) + x.shape[2:]) for x in (q, k, v, g, beta)]
    with pytest.raises(NotImplementedError, match="view the packed"):
        ct.fused_recurrent_gated_delta_rule(*packed[:4], beta=packed[4], initial_state=h0, cu_seqlens=cu,
                                            ssm_state_indices=slots)


def test_docstring_examples():
    result = doctest.testmod(ct, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_integrations_page_gpu_blocks():
    """Every ``python gpu`` block of docs/integrations.md, in order (torch, JAX and transformers)."""
    pytest.importorskip("jax")
    pytest.importorskip("transformers.models.qwen3_next")
    import snippets

    assert snippets.run("integrations.md", "gpu") >= 5


def test_buffers_handed_over_again_and_addresses_reused():
    """The adapter keeps its CuPy view of a buffer for the next call that hands the same buffer over; another tensor
    at the same address with another shape, strides or dtype gets a view of its own.  Results equal the reference
    each time."""
    q, k, _, p, g, beta, h0 = _inputs(2, 3, 2, 2, 64, 64, torch.float32, seed=31)
    n = 2 * 3 * 2 * 64
    memory = torch.empty(n, device="cuda")

    def filled(view):  # fresh values in the memory, then the tensor that views it
        view.copy_(torch.randn(view.shape, device="cuda"))
        return view

    views = [lambda: filled(memory.view(2, 3, 2, 64)), lambda: memory.view(2, 3, 2, 64),  # the same buffer twice
             lambda: filled(memory[: n // 2].view(2, 3, 2, 32)),  # the same address, half the value columns
             lambda: filled(memory.view(2, 3, 2, 64)[..., :32]),  # the same address and shape, other strides
             lambda: filled(memory.view(torch.bfloat16)[:n].view(2, 3, 2, 64))]  # the same address and shape, bf16
    for make in views:
        v = make()
        assert v.data_ptr() == memory.data_ptr()
        h = h0[..., : v.shape[-1]].contiguous()
        o, S = ct.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h, output_final_state=True)
        o_ref, S_ref = gated_delta_forward(*map(_np, (q, k, v, beta, g)), initial_state=_np(h))
        _close(o, S, o_ref, S_ref, v.dtype)
