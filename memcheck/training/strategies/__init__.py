"""Training strategies: how one traced step is spread over GPUs.

The contract is written in ``base`` (``StrategyConfig``, the ``Emulation`` protocol); one
module per family emulates on meta tensors what the real wrapper allocates and when:

- ``single``: one GPU, the plain loop (which ``ddp``, ``fsdp`` and ``zero`` run too);
- ``data_parallel``: ``dp`` and ``dp-balanced`` (``torch.nn.DataParallel``);
- ``ddp``: ``DistributedDataParallel``'s gradient buckets;
- ``fsdp``: FSDP2's ``fully_shard``; ``zero``: DeepSpeed's ZeRO-1/2/3; both with
  ``--offload``, on the shared machinery of ``_sharding``.

``train`` runs the traced steps for a ``StrategyConfig`` and says which traced GPU each
real GPU looks like: DataParallel traces every GPU; the other strategies trace one rank,
whose figures hold for every rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from memcheck.enums import Strategy
from memcheck.training.loop import LossFn
from memcheck.training.strategies import data_parallel, ddp, fsdp, single, zero
from memcheck.training.strategies.base import SHARDED, Emulation, StrategyConfig, applicable

__all__ = ["SHARDED", "Emulation", "StrategyConfig", "applicable", "train"]

# strategy -> emulation(config, tracer, model, accumulate) of the wrappers that hook into the plain loop
_EMULATIONS = {Strategy.DDP: ddp.emulation, Strategy.FSDP: fsdp.emulation, Strategy.ZERO1: zero.emulation,
               Strategy.ZERO2: zero.emulation, Strategy.ZERO3: zero.emulation}


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
    run = dict(autocast=autocast, scaler=scaler, accumulate=accumulate, evaluate=evaluate)
    if config.strategy in (Strategy.DP, Strategy.DP_BALANCED):
        return data_parallel.train(config, tracer, model, batch, loss_fn, make_optimizer, steps, **run)
    return single.train(config, tracer, model, batch, loss_fn, make_optimizer, steps,
                        emulate=_EMULATIONS.get(config.strategy), **run)
