"""GPT-2 small (124M parameters) for causal language modelling.

    memcheck examples/gpt2_small.py --max-len 1024 --batch-size 8

memcheck builds this on the meta device: no weights are allocated or downloaded.
With no make_batch here, memcheck infers the worst-case batch from the config:
input_ids, attention_mask and labels of shape (batch_size, max_len).
"""

from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config())
