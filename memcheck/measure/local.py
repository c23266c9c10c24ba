"""Measure what a real run allocates, independently of the tracer.

On CPU the oracle is the allocator itself: the profiler with ``profile_memory=True``
(``torch.autograd.profiler.profile``, the Kineto session that ``torch.profiler.profile`` wraps,
without the wrapper's 0.6 s of start-up and post-processing a session on 2 cores)
records every allocation and free with its size and time, and the peak is the
running maximum of their sum. Nothing here uses the tracer's accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.autograd.profiler import profile, record_function

from memcheck.enums import Precision, StepOrder
from memcheck.errors import UsageError
from memcheck.report.results import Verification
from memcheck.rules.probe import cpu_memory_events
from memcheck.training.loop import LossFn, default_loss, run_steps, run_train_steps, to_precision

STEP_MARK = "memcheck.step"


def mark_step(step: int, phase) -> None:
    """A training loop's phase callback that leaves an empty profiler event named
    ``STEP_MARK.<step>`` as each step's forward begins; its timestamp starts the step."""
    if phase.value == "forward":
        with record_function(f"{STEP_MARK}.{step}"):
            pass


@dataclass(frozen=True)
class Measured:
    """Peaks of live CPU bytes, from the profiler's allocation events."""

    peak_bytes: int  # over the whole run, model construction included
    steady_peak_bytes: int  # from the start of step 2 on (optimizer state exists)


def measure_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn = default_loss,
    steps: int = 2,
    autocast_dtype: torch.dtype | None = None,
    accumulate: int = 1,
    train_step: Callable | None = None,
    max_grad_norm: float | None = None,
    order: StepOrder = StepOrder.HF,
) -> Measured:
    """Build a model and batch on CPU, train ``steps`` steps, and measure the allocator.

    ``build()`` returns ``(model, batch)``; it runs inside the profiled region so
    that the baseline (weights, batch) is measured too. ``autocast_dtype`` runs the
    forward and loss under ``torch.autocast("cpu", autocast_dtype)``; ``accumulate``
    runs that many real micro-steps per step; ``train_step(model, batch, optimizer)`` runs the
    user's own step instead of memcheck's loop (``run_train_steps``); ``order`` is memcheck's
    loop's step order (``memcheck.enums.StepOrder``).
    """
    autocast = None
    if autocast_dtype is not None:
        autocast = lambda: torch.autocast("cpu", dtype=autocast_dtype)  # noqa: E731
    with profile(use_cpu=True, profile_memory=True) as prof:
        model, batch = build()
        optimizer = make_optimizer(model.parameters())
        if train_step is not None:
            run_train_steps(model, batch, train_step, optimizer, steps, mark_step)
        else:
            run_steps(model, batch, loss_fn, optimizer, steps, mark_step, autocast=autocast, accumulate=accumulate,
                      max_grad_norm=max_grad_norm, order=order)
        del model, batch, optimizer

    return _peaks(prof.kineto_results.events())


def _peaks(raw) -> Measured:
    """The peaks of the profiler's CPU allocator events ``raw``: over the run, and from the
    ``STEP_MARK.1`` event on (else ``STEP_MARK.0``, else the start)."""
    step_start = {int(e.name().rsplit(".", 1)[1]): e.start_ns() for e in raw if e.name().startswith(STEP_MARK)}
    steady_from = step_start.get(1, step_start.get(0, 0))
    live = peak = steady = 0
    for t, n in cpu_memory_events(raw):
        live += n
        peak = max(peak, live)
        if t >= steady_from:
            steady = max(steady, live)
    return Measured(peak_bytes=peak, steady_peak_bytes=steady)


@dataclass(frozen=True)
class MeasuredCuda:
    """What a real CUDA run used, from the caching allocator's statistics and the driver."""

    peak_allocated_bytes: int  # max_memory_allocated over the whole run
    steady_peak_allocated_bytes: int  # max_memory_allocated from step 2 on
    peak_reserved_bytes: int  # max_memory_reserved over the whole run
    device_used_bytes: int  # cudaMemGetInfo total - free at the end, minus what was used before
    context_bytes: int  # device_used_bytes - memory_reserved at the end: context and libraries


def measure_cuda(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn = default_loss,
    steps: int = 3,
    precision: str = "fp32",
    baseline_used_bytes: int = 0,
    accumulate: int = 1,
    on_phase: Callable | None = None,
    order: StepOrder = StepOrder.HF,
) -> MeasuredCuda:
    """Train ``steps`` real steps on the current CUDA device and read its memory.

    Run it in a fresh process: the allocator's peaks and the driver's used memory
    describe the whole process. ``build()`` returns ``(model, batch)`` on the CPU;
    they are moved to the GPU here (in the target dtype for pure bf16/fp16), so the
    allocator sees one allocation per tensor, as the trace does.
    ``baseline_used_bytes`` is what the device had in use before this process
    started (other processes), subtracted from the driver's figure.
    """
    precision = Precision.parse(precision)
    dtype, amp = precision.weights_dtype, precision.autocast_dtype
    model, batch = build()
    model = model.to("cuda", dtype) if dtype is not None else model.to("cuda")
    batch = to_precision(batch, dtype, "cuda")
    optimizer = make_optimizer(model.parameters())
    autocast = (lambda: torch.autocast("cuda", dtype=amp)) if amp is not None else None
    scaler = torch.amp.GradScaler("cuda") if precision is Precision.AMP_FP16 else None
    first = {}

    def mark(step, phase):
        if on_phase is not None:
            on_phase(step, phase)
        if step == 1 and phase.value == "forward" and not first:
            torch.cuda.synchronize()
            first["allocated"] = torch.cuda.max_memory_allocated()
            first["reserved"] = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()

    run_steps(model, batch, loss_fn, optimizer, steps, mark, autocast=autocast, scaler=scaler,
              accumulate=accumulate, order=order)
    torch.cuda.synchronize()
    steady = torch.cuda.max_memory_allocated()
    reserved = max(first.get("reserved", 0), torch.cuda.max_memory_reserved())
    free, total = torch.cuda.mem_get_info()
    used = total - free - baseline_used_bytes
    return MeasuredCuda(
        peak_allocated_bytes=max(first.get("allocated", 0), steady),
        steady_peak_allocated_bytes=steady,
        peak_reserved_bytes=reserved,
        device_used_bytes=used,
        context_bytes=used - torch.cuda.memory_reserved(),
    )


def verify(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    device: str,
    predicted_bytes: int,
    loss_fn: LossFn = default_loss,
    precision: str = "fp32",
    accumulate: int = 1,
    steps: int = 20,
    order: StepOrder = StepOrder.HF,
) -> Verification:
    """Run a configuration for real for ``steps`` optimizer steps and compare with the prediction.

    On ``cuda`` the measured figure is the driver's used memory of this process
    (nvidia-smi before CUDA starts, ``cudaMemGetInfo`` after), as the prediction's
    device total is; an out-of-memory error is a measured result, and the GPU memory
    is released afterwards. On ``cpu`` it is the allocator's steady-state peak from
    the profiler. ``build()`` returns the model (already checkpointed as planned)
    and the worst-case batch on the CPU.
    """
    precision = Precision.parse(precision)
    if device == "cpu":
        if precision.weights_dtype is not None:  # pure bf16/fp16: weights and float inputs in that dtype
            plain, dtype = build, precision.weights_dtype

            def build():
                model, batch = plain()
                return model.to(dtype), to_precision(batch, dtype)

        measured = measure_cpu(build, make_optimizer, loss_fn=loss_fn, steps=steps,
                               autocast_dtype=precision.autocast_dtype, accumulate=accumulate, order=order)
        return Verification("cpu", steps, predicted_bytes, measured.steady_peak_bytes, None, None, False)
    if not torch.cuda.is_available():
        raise UsageError("--measure on the cuda target needs a CUDA GPU, and torch sees none here")
    from memcheck.cuda.gpus import device_used_bytes

    baseline = device_used_bytes() or 0
    done = {"steps": 0}

    def count(step, phase):
        if phase.value == "optimizer_step":
            done["steps"] = step + 1

    try:
        real = measure_cuda(build, make_optimizer, loss_fn=loss_fn, steps=steps, precision=precision.value,
                            baseline_used_bytes=baseline, accumulate=accumulate, on_phase=count, order=order)
    except torch.cuda.OutOfMemoryError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "CUDA out of memory"
        return Verification("cuda", done["steps"], predicted_bytes, None, torch.cuda.max_memory_allocated(),
                            torch.cuda.max_memory_reserved(), True, first)
    finally:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return Verification("cuda", steps, predicted_bytes, real.device_used_bytes, real.peak_allocated_bytes,
                        real.peak_reserved_bytes, False)


def measure_script(argv: list[str]) -> Measured:
    """Run a training script (``["train.py", ARGS...]``) for real on the CPU, in this process, as
    ``python train.py ARGS`` would (its folder first on ``sys.path``), and measure the allocator
    over its whole run: the oracle of ``memcheck run``. ``steady_peak_bytes`` is from the end of
    its first optimizer step on (torch's global step hook leaves the mark)."""
    import runpy
    import sys
    from pathlib import Path

    from torch.optim.optimizer import register_optimizer_step_post_hook

    path = Path(argv[0]).resolve()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    done = [0]

    def mark(optimizer, args, kwargs):
        done[0] += 1
        with record_function(f"{STEP_MARK}.{done[0]}"):
            pass

    sys.argv, sys.path[:0] = [str(path), *argv[1:]], [str(path.parent)]
    handle = register_optimizer_step_post_hook(mark)
    try:
        with profile(use_cpu=True, profile_memory=True) as prof:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        handle.remove()
        sys.argv, sys.path[:] = saved_argv, saved_path
    return _peaks(prof.kineto_results.events())
