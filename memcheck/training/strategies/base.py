"""The strategy contract: what a training strategy is, and what its emulation provides.

A strategy spreads one traced training step over GPUs. ``StrategyConfig`` is its
validated settings. Each family lives in a module of its own beside this one and is
reached through ``memcheck.training.strategies.train``, which returns, for each real
GPU, the index of the traced GPU whose figures it shares:

- ``single`` (``single.py``) traces the plain loop on one GPU: ``[0]``.
- ``data_parallel`` (``dp``, ``dp-balanced``) runs its own loop around
  ``torch.nn.DataParallel``'s emulation, tracing every GPU (``tracer.multi_gpu``):
  ``[0, 1, ..., gpus - 1]``.
- ``ddp``, ``fsdp`` and ``zero1-3`` run the plain loop with an ``Emulation`` (below)
  hooked in, and trace rank 0, whose figures hold for every rank: ``[0] * gpus``.

An ``Emulation`` is made after ``tracer.watch(model=..., batch=...)`` and before the
optimizer, from ``emulation(config, tracer, model, accumulate)`` in its module. It
allocates what the real wrapper holds (buckets, shards, gathered copies) as meta
tensors registered with the tracer at the moment the wrapper allocates them, and frees
them when the wrapper does; what the rank does not hold (fsdp's and zero3's full
parameters) it tells the tracer to ignore. ``train`` calls, in order:

1. ``make_optimizer(make_optimizer)``: the optimizer over what the rank's optimizer
   steps on (a shard's stand-ins, a flat fp32 master, or the model's parameters);
2. ``on_phase(step, phase)`` as the loop enters each phase, after the tracer's own;
3. ``close()`` when the steps are done, even after an error: every hook removed.

Strategies that build the model on meta and materialise only shards (fsdp, zero3:
``SHARDS_AT_INIT``) have the full parameters ignored before the model is watched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from memcheck.enums import Offload, Phase, Strategy
from memcheck.errors import UsageError, require_int, require_positive_number


class Emulation(Protocol):
    """What a wrapper adds to the plain traced loop (ddp's buckets, fsdp's and zero's shards)."""

    def make_optimizer(self, make_optimizer: Callable) -> torch.optim.Optimizer:
        """The optimizer the rank steps, built with the user's ``make_optimizer(params)``."""

    def on_phase(self, step: int, phase: Phase) -> None:
        """Called as the traced loop enters ``phase`` of ``step`` (0-based)."""

    def close(self) -> None:
        """Remove every hook the emulation registered."""


@dataclass(frozen=True)
class StrategyConfig:
    """A strategy and its settings, validated."""

    strategy: Strategy = Strategy.SINGLE
    gpus: int = 1
    bucket_view: bool = False  # ddp: gradient_as_bucket_view=True
    bucket_cap_mb: float | None = None  # ddp: None is DDP's default (25, first bucket 1 MiB)
    offload: Offload = Offload.NONE  # fsdp / zero*

    @classmethod
    def parse(cls, strategy="single", gpus=None, *, bucket_view=False, bucket_cap_mb=None, offload=None):
        strategy = Strategy.parse(strategy, what="strategy")
        offload = Offload.parse(offload or "none", what="offload")
        if gpus is None:
            gpus = 1 if strategy is Strategy.SINGLE else 2
        require_int(gpus, "gpus")
        if strategy is Strategy.SINGLE and gpus != 1:
            raise UsageError(
                f"strategy 'single' runs on one GPU, got gpus={gpus}; choose dp, dp-balanced, ddp, fsdp or zero1-3"
            )
        if strategy.multi_gpu and gpus < 2:
            raise UsageError(f"strategy {strategy.value!r} needs at least 2 GPUs, got gpus={gpus}")
        if offload is not Offload.NONE and strategy not in SHARDED:
            raise UsageError(f"offload={offload.value!r} applies to fsdp and zero1-3, not {strategy.value!r}")
        if strategy is Strategy.FSDP and offload is Offload.OPTIMIZER:
            raise UsageError("fsdp has no optimizer-only offload (FSDP2's CPUOffloadPolicy moves the parameters, "
                             "gradients and optimizer state together); use offload='params', or zero1-3")
        if strategy in (Strategy.ZERO1, Strategy.ZERO2) and offload is Offload.PARAMS:
            raise UsageError(f"offload='params' needs zero3 (DeepSpeed offloads parameters in ZeRO-3 only), "
                             f"not {strategy.value}; use offload='optimizer'")
        if strategy is not Strategy.DDP and (bucket_view or bucket_cap_mb is not None):
            raise UsageError(f"bucket settings apply to ddp only, not {strategy.value!r}")
        if bucket_cap_mb is not None:
            require_positive_number(bucket_cap_mb, "bucket_cap_mb")
        return cls(strategy, gpus, bool(bucket_view), bucket_cap_mb, offload)

    @property
    def label(self) -> str:
        if self.strategy is Strategy.SINGLE:
            return "single"
        extra = ""
        if self.strategy is Strategy.DDP and self.bucket_view:
            extra = ", bucket view"
        if self.offload is not Offload.NONE:
            extra = f", offload {self.offload.value}"
        return f"{self.strategy.value} x{self.gpus}{extra}"


SHARDED = (Strategy.FSDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)
# The model is built on meta and only the shards are materialised (FSDP2: fully_shard, then
# to_empty; DeepSpeed: zero.Init, which the HF Trainer uses under ZeRO-3).
SHARDS_AT_INIT = (Strategy.FSDP, Strategy.ZERO3)


def applicable(gpus: int) -> list[StrategyConfig]:
    """The strategies ``--compare`` lists for ``gpus`` GPUs."""
    if gpus <= 1:
        return [StrategyConfig()]
    return [StrategyConfig()] + [StrategyConfig(s, gpus) for s in Strategy if s.multi_gpu]
