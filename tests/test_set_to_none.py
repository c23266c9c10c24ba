"""``set_to_none`` (``--no-set-to-none``): a loop whose ``optimizer.zero_grad(set_to_none=False)``
zeroes the gradients in place (torch/optim/optimizer.py, ``zero_grad``: ``p.grad.zero_()`` instead of
``p.grad = None``) keeps them allocated through the next forward. Checked against REAL CPU runs of
such loops, measured with the profiler's allocator events from the start of the second optimizer
step (as ``memcheck.measure.local`` measures), on tests/test_step_order.py's probe: a frozen
featurizer whose 4,194,304 B output is a transient of the forward, under a trainable head.

Hand arithmetic (tests/test_step_order.py's docstring): every order's peak is in the forward, where
the head's gradients G = 300,040 fp32 parameters x 4 B = 1,200,160 B are alive only when zero_grad
left them allocated, so

    estimate(set_to_none=False) - estimate(set_to_none=True) = G = 1,200,160 B, exactly

in memcheck's own order (zero_grad after the step) and in the plain order (zero_grad first) alike.
"""

from __future__ import annotations

import functools

import pytest
from torch.utils.data import DataLoader

import memcheck
from test_step_order import BATCH, GRADS, TOLERANCE, Probe, Rows, _adamw, _batch, _close, _loss, _mark, _measured


@functools.lru_cache(maxsize=None)
def _estimate(order: str, set_to_none: bool) -> int:
    job = memcheck.Job(device="cpu", optimizer=_adamw, step_order=order, set_to_none=set_to_none)
    return memcheck.estimate(Probe(), _batch(), job, loss_fn=_loss).total_bytes


def _loop(order: str, set_to_none: bool, steps: int = 2) -> None:
    """A plain PyTorch loop: zero_grad first (``plain``) or after the step (``hf``)."""
    model = Probe()
    optimizer = _adamw(model.parameters())
    for step, batch in zip(range(steps), DataLoader(Rows(), batch_size=BATCH)):
        _mark(step)
        if order == "plain":
            optimizer.zero_grad(set_to_none=set_to_none)
        _loss(model, batch).backward()
        optimizer.step()
        if order == "hf":
            optimizer.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("order", ["hf", "plain"])
def test_zero_grad_without_set_to_none_keeps_the_gradients_through_the_forward(order):
    kept, freed = _measured(lambda: _loop(order, False)), _measured(lambda: _loop(order, True))
    _close(_estimate(order, False), kept, f"{order} loop, zero_grad(set_to_none=False)")
    _close(_estimate(order, True), freed, f"{order} loop, zero_grad(set_to_none=True)")
    # the hand arithmetic: the head's gradients, 1,200,160 B, alive at the forward's peak; the real runs differ
    # by them too (torch 2.13 on CPU: 11,194,520 B - 9,994,360 B = 1,200,160 B, each estimate exact)
    assert abs((kept - freed) - GRADS) <= TOLERANCE * kept
    assert _estimate(order, False) - _estimate(order, True) == GRADS == 1_200_160
    # and memcheck's default would miss them by more than the CPU target's tolerance
    assert abs(_estimate(order, True) - kept) / kept > TOLERANCE


def test_set_to_none_is_a_flag_a_config_key_and_a_json_key():
    from click.testing import CliRunner

    from memcheck.cli import main

    job = memcheck.Job.from_settings({"set_to_none": False}, vocabulary="config")
    assert job.set_to_none is False and job.to_dict()["set_to_none"] is False and job.loop["set_to_none"] is False
    assert memcheck.Job().set_to_none is True  # torch's default, and the HF Trainer's
    with pytest.raises(memcheck.errors.UsageError, match="set_to_none must be true or false"):
        memcheck.Job(set_to_none="no")
    help_text = CliRunner().invoke(main, ["estimate", "--help"]).output
    assert "--set-to-none / --no-set-to-none" in help_text


PROBE_FILE = """
import torch


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(256, 256)

    def forward(self, x):  # a 64 x 16,384 x 4 B = 4 MiB transient under no grad, then the head
        features = x.repeat(1, 64).view(x.shape[0], 64, 256).amax(1)
        return self.head(features)


model = M()


def make_batch(batch_size, max_len):
    return torch.randn(batch_size, 256)


def compute_loss(model, batch):
    return model(batch).sum()
"""


def test_the_flag_reaches_the_traced_loop(tmp_path):
    # the head's gradients, (256 * 256 + 256) params x 4 B = 263,168 B, alive at the forward's peak (the
    # 4 MiB transient's) only with --no-set-to-none: the peaks differ by exactly that
    import json

    from click.testing import CliRunner

    from memcheck.cli import main

    model = tmp_path / "model.py"
    model.write_text(PROBE_FILE)
    out = {}
    for flag in ("--set-to-none", "--no-set-to-none"):
        result = CliRunner().invoke(main, ["estimate", str(model), "--device", "cpu", "--max-len", "8", "-b", "64",
                                           "--json", flag])
        assert result.exit_code == 0, result.output
        out[flag] = json.loads(result.stdout)
    assert out["--no-set-to-none"]["job"]["set_to_none"] is False
    assert out["--set-to-none"]["peak_phase"] == out["--no-set-to-none"]["peak_phase"] == "forward"
    assert out["--no-set-to-none"]["peak_bytes"] - out["--set-to-none"]["peak_bytes"] == 263_168
