"""Pipeline parallelism (memcheck.training.strategies.pp) against real torch.distributed.pipelining
runs on CPU gloo ranks, per rank, and the schedules' live micro-batches by hand (issue 21)."""

import pytest
import torch

SEQ, MICRO = 32, 2  # sequence length and micro-batch size


def build_llama():
    """A tiny fp32 LlamaForCausalLM (hidden 64, 4 heads, 4 layers, vocab 128) and one micro-batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=4, vocab_size=128, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (MICRO, SEQ))
    return model, {"input_ids": ids, "labels": ids.clone()}


def adamw(params):
    return torch.optim.AdamW(params)
