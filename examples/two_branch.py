"""A hand-written model with its own batch, loss and optimizer.

    memcheck examples/two_branch.py --batch-size 64 --device cpu
"""

import torch
from torch import nn


class TwoBranch(nn.Module):
    """An image branch (CNN) and a tabular branch (MLP) joined by a head."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 16, 5, stride=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.table = nn.Sequential(nn.Linear(40, 256), nn.ReLU(), nn.Linear(256, 128))
        self.head = nn.Linear(16 * 15 * 15 + 128, 5)

    def forward(self, image, table):
        return self.head(torch.cat([self.image(image), self.table(table)], dim=1))


def build_model():
    return TwoBranch()


def make_batch(batch_size, max_len=None):
    return torch.randn(batch_size, 3, 64, 64), torch.randn(batch_size, 40), torch.randint(0, 5, (batch_size,))


def compute_loss(model, batch):
    image, table, labels = batch
    return nn.functional.cross_entropy(model(image, table), labels)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)
