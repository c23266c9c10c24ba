"""The engine's in-place gradient accumulation (memcheck.rules.autograd), against real CPU runs.

A loop over the slices of one tensor sends the engine one full-size gradient per slice
(``select_backward``); a real run sums them in place, where a traced backward would add a
buffer for each. The oracle is ``measure_cpu``'s allocator peak over two SGD steps.
"""

import pytest
import torch
from torch import nn

import memcheck
from memcheck.measure.local import measure_cpu

TOLERANCE = 0.02  # as tests/test_accuracy_cpu.py


class ExpertLoop(nn.Module):
    """transformers' eager experts loop in small: each slice ``w[e]`` of one parameter
    multiplies the input, so ``w``'s gradient gets one (8, 256, 64) buffer per expert."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 256, 64) * 0.02)

    def forward(self, x):
        return sum((x @ self.w[e].t()).pow(2).sum() for e in range(self.w.shape[0]))


class TimeLoop(nn.Module):
    """The PyTorch path of Mamba's selective scan in small: ``a[:, :, t]`` for every step t."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):  # x: (batch, 32, time)
        a = self.proj(x.transpose(1, 2)).transpose(1, 2).exp()
        state = torch.zeros_like(a[:, :, 0])
        for t in range(a.shape[-1]):
            state = a[:, :, t] * state + x[:, :, t]
        return state.pow(2).sum()


CASES = {
    "expert loop": (ExpertLoop, lambda: torch.randn(128, 64)),
    "time loop": (TimeLoop, lambda: torch.randn(4, 32, 64)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_slice_gradients_accumulate_in_place_as_in_a_real_cpu_run(name):
    make_model, make_batch = CASES[name]

    def build():
        torch.manual_seed(0)
        return make_model(), make_batch()

    loss = lambda model, batch: model(batch)  # noqa: E731
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    measured = measure_cpu(build, sgd, loss_fn=loss, steps=2).steady_peak_bytes
    with torch.device("meta"):
        model, batch = build()
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    error = (est.peak_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, f"{name}: estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
