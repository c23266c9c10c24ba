"""What both trainer callbacks share: their settings, validated once, and the verdict acted on."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from memcheck.cuda.gpus import GpuSpec, resolve_gpu
from memcheck.errors import UsageError, WillNotFit, require_int
from memcheck.job import check_setting
from memcheck.report.results import Verdict
from memcheck.report.text import will_not_fit_message


@dataclass(frozen=True)
class CallbackSettings:
    """A callback's constructor arguments, checked when the callback is built (not at step 1)."""

    gpu: GpuSpec | None = None
    budget_bytes: int | None = None
    margin: float | None = None
    check_eval: bool = True
    fix: bool = True

    def __post_init__(self):
        if self.gpu is not None and not isinstance(self.gpu, GpuSpec):
            # A name or a size, resolved now so that a typo fails when the callback is built.
            if not isinstance(self.gpu, str):
                raise UsageError(f"gpu must be a name such as 'A100-80GB' or a size such as '24GiB', "
                                 f"got {self.gpu!r}")
            object.__setattr__(self, "gpu", resolve_gpu(self.gpu))
        if self.budget_bytes is not None:
            require_int(self.budget_bytes, "budget_bytes")
        check_setting("margin", self.margin)  # the Job's own check: a fraction in [0, 1)
        for name in ("check_eval", "fix"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be True or False, got {getattr(self, name)!r}")


def target(device: torch.device, settings: CallbackSettings) -> dict:
    """``check()``'s target arguments for the trainer's job. A GPU named with ``gpu=`` is the
    target whatever device the trainer runs on, so a laptop or CI dry-runs the GPU job;
    otherwise the device the trainer runs on."""
    kind = device.type
    if settings.gpu is not None:
        return {"device": "cuda", "gpu": settings.gpu, "budget_bytes": settings.budget_bytes}
    if kind == "cuda":
        return {"device": "cuda", "gpu": None, "budget_bytes": settings.budget_bytes}
    if kind == "cpu":
        if settings.budget_bytes is None:
            raise UsageError("the trainer runs on the CPU: give MemcheckCallback(gpu=\"A100-80GB\") to check the "
                             "GPU job it stands for, or budget_bytes=... for the host memory the job may use")
        return {"device": "cpu", "budget_bytes": settings.budget_bytes}
    raise UsageError(f"the trainer runs on {kind!r}; memcheck checks cuda and cpu jobs: give gpu=\"A100-80GB\" "
                     "to check the job on a CUDA GPU")


def act_on(verdict: Verdict, style: str, logger: logging.Logger, announce: bool, level: int = logging.INFO) -> None:
    """Raise ``WillNotFit`` for a job that will not fit; otherwise log the verdict's line at
    ``level``, one the trainer's log shows by default (when ``announce``: on the main process only)."""
    if not verdict.fits:
        raise WillNotFit(verdict, will_not_fit_message(verdict, style))
    if announce:
        from memcheck.report.text import verdict_line

        logger.log(level, "memcheck: %s", verdict_line(verdict))


def first_batch(loader: Any) -> Any:
    """The loader's first batch, taken without disturbing the training run: torch's CPU
    random state (which a shuffling sampler and the workers' seeds draw from) is restored."""
    base = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper keeps its own state
    with torch.random.fork_rng(devices=[]):
        return next(iter(base))
