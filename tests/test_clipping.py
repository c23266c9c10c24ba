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


def test_on_cuda_clipping_adds_foreach_norms_partial_sums():
    # ForeachReduceOp.cu (foreach_tensor_norm_cuda): output_per_tensor of ntensors x max chunks
    # (65,536 elements each) fp32 values. Here one fp32 group of 2 gradients, a (1000, 1000)
    # weight of 1,000,000 elements (ceil(1,000,000 / 65,536) = 16 chunks) and its 1,000 bias:
    # 2 x 16 x 4 = 128 B, transient, in the optimizer phase; nothing of the kind on the cpu target.
    from memcheck.enums import ALLOC, Category, Device, Phase
    from memcheck.rules.cuda_norms import foreach_norm_scratch
    from memcheck.trace.tracer import MemoryTracer
    from memcheck.training.strategies.base import Run, StrategyConfig

    assert foreach_norm_scratch([[1_000_000, 1_000]]) == [128]

    def temporaries(device):
        with torch.device("meta"):
            model, x = nn.Linear(1000, 1000), torch.empty(4, 1000)
        tracer = MemoryTracer(device)
        with tracer:
            tracer.watch(model=model, batch=x)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            run = Run(StrategyConfig.parse("single", None), tracer, model, x, _loss, None, 1,
                      loop={"max_grad_norm": 1.0})
            run.run_steps(_loss, opt, tracer.set_phase)
        return [e[2] for e in tracer.log.events
                if e[0] == ALLOC and e[3] is Category.TEMPORARY and e[5] is Phase.OPTIMIZER]

    assert 128 in temporaries(Device.CUDA) and 128 not in temporaries(Device.CPU)
