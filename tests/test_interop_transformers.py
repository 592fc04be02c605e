"""cupy_comba.interop.transformers on a tiny random Qwen3-Next (tests/qwen3_next_tiny.py): greedy generation
through the patched Gated DeltaNet layers (prefill: chunk_gated_delta_rule, cached decode:
fused_recurrent_gated_delta_rule) against transformers' own torch implementation.  Skips without transformers."""

from unittest import mock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.qwen3_next")
pytestmark = pytest.mark.gpu

from cupy_comba.interop import transformers as comba_transformers  # noqa: E402

from qwen3_next_tiny import tiny_model  # noqa: E402


def _generate(model, ids, steps=16):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    return out.sequences, torch.stack(out.logits, 1).float()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_patched_layers_generate_the_same_tokens():
    """Prefill and cached decode through the patched layers (every Gated DeltaNet call counted), then unpatched."""
    from cupy_comba.interop import torch as ct

    ids = torch.randint(1, 512, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(dtype)
        ref = _generate(model, ids)
        chunk = mock.patch.object(ct, "chunk_gated_delta_rule", wraps=ct.chunk_gated_delta_rule)
        recurrent = mock.patch.object(ct, "fused_recurrent_gated_delta_rule",
                                      wraps=ct.fused_recurrent_gated_delta_rule)
        with chunk as chunk_calls, recurrent as recurrent_calls:
            assert comba_transformers.patch(model)
            try:
                ours = _generate(model, ids)
            finally:
                comba_transformers.unpatch()
            assert chunk_calls.call_count == 3 and recurrent_calls.call_count == 3 * 15  # 3 layers, 15 steps
            _generate(model, ids, steps=2)
            assert chunk_calls.call_count == 3  # unpatched: transformers' own functions again
        runs[dtype] = ref, ours
    (ref_tok, ref_logits), (tok, logits) = runs[torch.float32]
    assert torch.equal(tok, ref_tok)
    assert _rel(logits, ref_logits) <= 1e-5
    # bf16: the same tokens as transformers' own bf16 run, and logits as close to the fp32 run as its are
    (bref_tok, bref_logits), (btok, blogits) = runs[torch.bfloat16]
    assert torch.equal(btok, bref_tok)
    noise = _rel(bref_logits, ref_logits)
    assert _rel(blogits, ref_logits) <= 1.5 * noise


def test_a_second_patch_and_unpatch_restore_the_originals():
    import importlib

    module = importlib.import_module(comba_transformers.MODULES[0])
    before = {n: getattr(module, n) for n in vars(module) if "gated_delta_rule" in n and callable(getattr(module, n))}
    assert before
    comba_transformers.patch()
    comba_transformers.patch()
    assert all(getattr(module, n) is not f for n, f in before.items())
    comba_transformers.unpatch()
    assert all(getattr(module, n) is f for n, f in before.items())
