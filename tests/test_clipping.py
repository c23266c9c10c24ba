"""Gradient clipping is part of the job (issue 17): ``max_grad_norm`` runs ``clip_grad_norm_``
before each optimizer step, as the HF Trainer does by default (``max_grad_norm=1.0``)."""

import torch
from torch import nn

import memcheck
from memcheck.measure.local import measure_cpu
from memcheck.training.loop import run_steps


def _build():
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)), torch.randn(64, 256)


def _loss(model, x):
    return model(x).square().mean()


def test_a_clipped_step_matches_a_real_cpu_run_of_it():
    real = measure_cpu(_build, lambda p: torch.optim.AdamW(p), loss_fn=_loss, max_grad_norm=1.0)
    with torch.device("meta"):
        model, x = _build()
    est = memcheck.estimate(model, x, memcheck.Job(device="cpu", max_grad_norm=1.0), loss_fn=_loss)
    assert abs(est.peak_bytes - real.steady_peak_bytes) <= 0.02 * real.steady_peak_bytes


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_clipping_runs_clip_grad_norm_before_the_step():
    # clip_grad_norm_ (torch/nn/utils/clip_grad.py) takes a norm of each gradient, then the norm
    # of those norms, and multiplies each gradient in place: 4 parameters here, so 5 norms
    with torch.device("meta"):
        model, x = _build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clipped, plain = _Ops(), _Ops()
    with clipped:
        run_steps(model, x, _loss, opt, 1, max_grad_norm=1.0)
    with plain:
        run_steps(model, x, _loss, opt, 1)
    assert clipped.seen.count("linalg_vector_norm.default") == 5
    assert "linalg_vector_norm.default" not in plain.seen


def test_hf_models_clip_as_the_trainer_does_and_zero_turns_it_off():
    from memcheck.workloads.hf import trainer_max_grad_norm

    assert trainer_max_grad_norm() == 1.0  # TrainingArguments.max_grad_norm's default
    assert memcheck.Job(max_grad_norm=0).max_grad_norm == 0.0
    assert memcheck.Job.from_settings({"gradient_clip_val": 0.5}).max_grad_norm == 0.5  # Lightning's name
