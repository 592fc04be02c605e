"""A tiny random Qwen3-Next (transformers): three Gated DeltaNet layers and one attention layer, 4 key / 8 value
heads of K = V = 128 -- shared by the transformers test and benchmarks/transformers_qwen3_next.py."""

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM


def tiny_model(dtype, seed=0):
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        max_position_embeddings=1024, layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(device="cuda", dtype=dtype).eval()
    # larger than the default init: gates and states that move, logits whose argmax is clear
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed" not in name:
                param.mul_(4.0)
    return model
