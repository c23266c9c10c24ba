"""A training step of its own: zero_grad() after the forward, as many scripts write it.

    memcheck examples/late_zero_grad.py --batch-size 64 --device cpu

Calling ``optimizer.zero_grad()`` between the forward and the backward keeps the previous
step's gradients alive through the whole forward, so the activations and a full set of
gradients are live together: memcheck traces this file's ``train_step`` as it is, instead of
its own loop (forward, backward, step, zero_grad).
"""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10))


def make_batch(batch_size, max_len=None):
    return torch.randn(batch_size, 512), torch.randint(0, 10, (batch_size,))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def train_step(model, batch, optimizer):
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()  # after the forward: last step's gradients were alive until here
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
