"""The flash-linear-attention option mapping that the torch and JAX adapters share (cupy_comba.interop._fla), run
on the CPU through a frame of NumPy arrays: every mapping against the public ops called directly."""

from contextlib import nullcontext

import numpy
import pytest

from cupy_comba import comba_forward, gated_delta_forward, reference
from cupy_comba.inputs import forward_inputs
from cupy_comba.interop import _fla

F32 = numpy.float32


class NumpyFrame:
    """NumPy arrays in the roles a framework frame plays (the NumPy path runs the float64 reference)."""

    def device(self, q, k, v):
        for n, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, numpy.ndarray):
                raise TypeError(f"{n} must be a numpy.ndarray, got {type(x).__name__}")
        return "cpu"

    def full(self, shape, value, device):
        return numpy.full(shape, value, F32)

    def float32(self, x):
        return numpy.ascontiguousarray(x, F32)

    def pool(self, state):
        return state

    def empty(self, shape, like, device):
        return numpy.full(shape, numpy.nan, F32 if like is None else like.dtype)  # poisoned: every value written

    def on(self, device):
        return nullcontext()

    def cupy(self, x, name, device):
        return x

    def results(self, o, final_state):
        return o, final_state


def _call(comba, q, k, v, p, g, beta, **kw):
    """An adapter call with flash-linear-attention's keywords, defaults as the adapters have them."""
    args = dict(scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                num_accepted_tokens=None, inplace_final_state=True, kwargs={})
    args.update(kw)
    return _fla.run(NumpyFrame(), "call", comba, q, k, v, p, g, beta, *args.values())


@pytest.fixture
def acts():
    q, k, v, p, beta, g, S = forward_inputs(3, 5, 2, 64, 32, Hk=1, seed=3, warm_steps=1)
    return q, k, v, p, g, beta, S


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_g_and_beta_reach_the_op_by_name_in_both_layouts(acts, layout):
    q, k, v, p, g, beta, S = acts
    S = numpy.ascontiguousarray(S.swapaxes(-1, -2)) if layout == "vk" else S
    o_ref, S_ref = gated_delta_forward(q, k, v, beta, g, initial_state=S, state_layout=layout, use_qk_l2norm=True)
    o, S1 = _call(False, q, k, v, None, g, beta, initial_state=S, output_final_state=True,
                  state_v_first=layout == "vk", use_qk_l2norm_in_kernel=True)
    assert reference.relative_error(o, o_ref) <= 1e-12 and reference.relative_error(S1, S_ref) <= 1e-12
    o_ref, S_ref = comba_forward(q, k, v, p, beta, g, initial_state=S, state_layout=layout)
    o, S1 = _call(True, q, k, v, p, g, beta, initial_state=S, output_final_state=True, state_v_first=layout == "vk")
    assert reference.relative_error(o, o_ref) <= 1e-12 and reference.relative_error(S1, S_ref) <= 1e-12
    o, S1 = _call(True, q, k, v, p, g, beta, initial_state=S, state_v_first=layout == "vk")
    assert S1 is None and reference.relative_error(o, o_ref) <= 1e-12


def test_defaults_gating_and_a_pool(acts):
    q, k, v, p, g, beta, S = acts
    o, _ = _call(False, q, k, v, None, None, None)
    o_ref, _ = gated_delta_forward(q, k, v, numpy.ones_like(beta), numpy.zeros_like(g))
    assert reference.relative_error(o, o_ref) <= 1e-12
    A_log = numpy.linspace(-1, 1, 2).astype(F32)
    o, _ = _call(False, q, k, v, None, g, beta, use_gate_in_kernel=True, A_log=A_log, use_beta_sigmoid_in_kernel=True)
    o_ref, _ = gated_delta_forward(q, k, v, beta, g, A_log=A_log, dt_bias=numpy.zeros(2, F32), use_beta_sigmoid=True)
    assert reference.relative_error(o, o_ref) <= 1e-12
    pool = numpy.random.default_rng(5).standard_normal((6, 2, 64, 32)).astype(F32)
    slots = numpy.array([4, -1, 0], numpy.int64)
    expect = pool.copy()
    o_ref, _ = gated_delta_forward(q, k, v, beta, g, initial_state=expect, state_indices=slots)
    o, S1 = _call(False, q, k, v, None, g, beta, initial_state=pool, ssm_state_indices=slots)
    assert S1 is pool and numpy.array_equal(pool, expect) and numpy.array_equal(o, o_ref)


@pytest.mark.parametrize("kw,error,match", [
    (dict(allow_neg_eigval=True), NotImplementedError, "allow_neg_eigval"),
    (dict(kwargs={"head_first": True}), TypeError, "head_first"),
    (dict(ssm_state_indices=numpy.zeros(3, numpy.int32)), ValueError, "pass the pool as initial_state"),
    (dict(ssm_state_indices=numpy.zeros(3, numpy.int32), initial_state=numpy.zeros((4, 2, 64, 32), F32),
          inplace_final_state=False), ValueError, "inplace_final_state must be True"),
    (dict(ssm_state_indices=numpy.zeros((3, 5), numpy.int32), initial_state=numpy.zeros((4, 2, 64, 32), F32),
          cu_seqlens=numpy.array([0, 5, 10, 15])), NotImplementedError, "view the packed"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log"),
], ids=["neg-eigval", "unknown", "pool-no-state", "not-in-place", "2d-ragged", "gate-no-A_log"])
def test_refusals_before_any_work(acts, kw, error, match):
    q, k, v, p, g, beta, S = acts
    with pytest.raises(error, match=match):
        _call(False, q, k, v, None, g, beta, **kw)


def test_unused_options_are_accepted(acts):
    q, k, v, p, g, beta, S = acts
    o, _ = _call(False, q, k, v, None, g, beta, kwargs={"chunk_size": 64, "cu_seqlens_cpu": None,
                                                          "chunk_indices": None})
    o_ref, _ = gated_delta_forward(q, k, v, beta, g)
    assert reference.relative_error(o, o_ref) <= 1e-12


def test_the_adapters_import_no_framework():
    import subprocess
    import sys

    code = ("import sys, cupy_comba.interop.torch, cupy_comba.interop.jax, cupy_comba.interop.transformers; "
            "print(sorted(m for m in ('torch', 'jax', 'transformers') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_the_public_signatures_run_on_any_frame(acts):
    """The adapters' four functions come from _fla.calls: made over the NumPy frame they take
    flash-linear-attention's argument order (g before beta; p before v in fused_recurrent_comba; gk, gv between
    g and beta) and compute what the ops compute."""
    import inspect

    from cupy_comba.interop import jax as cj
    from cupy_comba.interop import torch as ct

    names = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_comba", "fused_recurrent_comba")
    made = dict(zip(names, _fla.calls(NumpyFrame, __name__, dict.fromkeys(names, ""))))
    for n in names:
        assert inspect.signature(made[n]) == inspect.signature(getattr(ct, n)) == inspect.signature(getattr(cj, n))
        assert getattr(ct, n).__module__ == ct.__name__ and getattr(ct, n).__doc__
    q, k, v, p, g, beta, S = acts
    o_g, S_g = gated_delta_forward(q, k, v, beta, g, initial_state=S)
    o_c, S_c = comba_forward(q, k, v, p, beta, g, initial_state=S)
    for o, S1, ref in ((*made["chunk_gated_delta_rule"](q, k, v, g, beta, None, S, True), (o_g, S_g)),
                       (*made["fused_recurrent_gated_delta_rule"](q, k, v, g, None, None, beta, None, S, True),
                        (o_g, S_g)),
                       (*made["chunk_comba"](q, k, v, p, g, beta, None, S, True), (o_c, S_c)),
                       (*made["fused_recurrent_comba"](q, k, p, v, g, beta, None, S, True), (o_c, S_c))):
        assert reference.relative_error(o, ref[0]) <= 1e-12 and reference.relative_error(S1, ref[1]) <= 1e-12
    with pytest.raises(NotImplementedError, match="gk, gv"):
        made["fused_recurrent_gated_delta_rule"](q, k, v, g, q)
    with pytest.raises(NotImplementedError, match="cp_context"):
        made["chunk_gated_delta_rule"](q, k, v, g, beta, cp_context=object())


def test_doctest_finds_the_torch_examples():
    import doctest

    from cupy_comba.interop import torch as ct

    found = {t.name.rsplit(".", 1)[-1] for t in doctest.DocTestFinder().find(ct) if t.examples}
    assert {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_comba",
            "fused_recurrent_comba"} <= found
