"""Training strategies: how one traced step is spread over GPUs.

One module per family, each emulating on meta tensors what the real wrapper
allocates and when:

- ``single``: one GPU, the plain loop (``memcheck.training.loop.run_steps``);
- ``data_parallel``: ``dp`` and ``dp-balanced`` (``torch.nn.DataParallel``);
- ``ddp``: ``DistributedDataParallel``'s gradient buckets;
- ``sharded``: ``fsdp`` (FSDP2's ``fully_shard``) and ``zero1``/``zero2``/``zero3``
  (DeepSpeed), with ``--offload``.

``train`` runs the traced steps for a ``StrategyConfig`` and says which traced
GPU each real GPU looks like: DataParallel traces every GPU; the other
strategies trace one rank, whose figures hold for every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from memcheck.enums import Offload, Strategy
from memcheck.errors import UsageError, require_int, require_positive_number
from memcheck.training.loop import LossFn, run_steps


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


def applicable(gpus: int) -> list[StrategyConfig]:
    """The strategies ``--compare`` lists for ``gpus`` GPUs."""
    if gpus <= 1:
        return [StrategyConfig()]
    return [StrategyConfig()] + [StrategyConfig(s, gpus) for s in Strategy if s.multi_gpu]


def train(
    config: StrategyConfig,
    tracer,
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    make_optimizer: Callable,
    steps: int,
    *,
    autocast=None,
    scaler=None,
    accumulate: int = 1,
    evaluate: Callable[[torch.nn.Module], None] | None = None,
) -> list[int]:
    """Trace ``steps`` training steps under ``config``; return, for each real GPU, the traced GPU it matches.

    ``evaluate(module)``, when given, runs after training with the module a trainer
    would evaluate: the DataParallel wrapper under ``dp``, the model otherwise.
    """
    strategy = config.strategy
    if strategy in (Strategy.DP, Strategy.DP_BALANCED):
        from memcheck.training.strategies.data_parallel import MetaDataParallel, balanced_loss

        tracer.multi_gpu = True
        tracer.watch(model=model, batch=batch, root_outputs=False)
        if strategy is Strategy.DP:
            wrapper = MetaDataParallel(tracer, model, config.gpus)
            tracer.watch_outputs(wrapper)
            def step_loss(_, b):
                loss = loss_fn(wrapper, b)
                # A loss computed inside the model comes back one per GPU; the HF Trainer averages it.
                return loss.mean() if isinstance(loss, torch.Tensor) and loss.dim() == 1 else loss
        else:
            step_loss = lambda m, b: balanced_loss(tracer, m, b, loss_fn, config.gpus)  # noqa: E731
        opt = make_optimizer(model.parameters())
        tracer.watch(optimizer=opt)
        run_steps(model, batch, step_loss, opt, steps, tracer.set_phase,
                  autocast=autocast, scaler=scaler, accumulate=accumulate)
        if evaluate is not None:
            evaluate(MetaDataParallel(tracer, model, config.gpus))
        return list(range(config.gpus))

    if strategy in (Strategy.FSDP, Strategy.ZERO3):
        # The full model never sits on the device: it is built on meta and only the shards are
        # materialised (FSDP2: fully_shard, then to_empty; DeepSpeed: zero.Init, which the HF
        # Trainer uses under ZeRO-3), the only way a model larger than one GPU can start. Were the
        # full parameters counted first, the simulated allocator would keep their segments cached.
        tracer.assume(f"{strategy.value}: the model is built on the meta device and only its shards are "
                      "materialised (fully_shard then to_empty; deepspeed.zero.Init)")
        for p in model.parameters():
            tracer.ignore(p)
    tracer.watch(model=model, batch=batch)
    emulation = None  # what a wrapper adds to the plain loop: make_optimizer, on_phase, close
    if strategy in SHARDED:
        from memcheck.training.strategies.sharded import sharded_emulation

        emulation = sharded_emulation(config, tracer, model, accumulate)
    elif strategy is Strategy.DDP:
        from memcheck.training.strategies.ddp import MetaDDP

        emulation = MetaDDP(tracer, model, bucket_cap_mb=config.bucket_cap_mb, bucket_view=config.bucket_view)
    opt = emulation.make_optimizer(make_optimizer) if emulation else make_optimizer(model.parameters())
    tracer.watch(optimizer=opt)

    def on_phase(step, phase):
        tracer.set_phase(step, phase)
        if emulation is not None:
            emulation.on_phase(step, phase)

    try:
        run_steps(model, batch, loss_fn, opt, steps, on_phase, autocast=autocast, scaler=scaler,
                  accumulate=accumulate)
        if evaluate is not None:
            evaluate(model)
    finally:
        if emulation is not None:
            emulation.close()
    return [0] * config.gpus
