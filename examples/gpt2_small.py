"""GPT-2 small (124M parameters) for causal language modelling.

    memcheck examples/gpt2_small.py --max-len 1024 --batch-size 8

memcheck builds this on the meta device: no weights are allocated or downloaded.
With no make_batch here, memcheck infers the worst-case batch from the config:
input_ids, attention_mask and labels of shape (batch_size, max_len). compute_loss is
the training step's loss as a training loop computes it; memcheck calls it every step,
so a --snapshot shows this file's line under each allocation the model makes.
"""

from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config())


def compute_loss(model, batch):
    return model(**batch).loss
