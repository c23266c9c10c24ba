"""Training strategies: how one traced step is spread over GPUs.

One module per family, each emulating on meta tensors what the real wrapper
allocates and when; ``base`` is the contract they share:

- ``base``: ``StrategyConfig``, ``Run`` (what ``train`` hands a family) and ``Emulation``
  (what a one-rank wrapper adds to the plain loop);
- ``single``: one GPU, the plain loop (``memcheck.training.loop.run_steps``), which the
  one-rank families run with their emulation;
- ``data_parallel``: ``dp`` and ``dp-balanced`` (``torch.nn.DataParallel``);
- ``ddp``: ``DistributedDataParallel``'s gradient buckets;
- ``fsdp``: FSDP2's ``fully_shard``, with ``--offload params``;
- ``fsdp1``: FSDP1's ``FullyShardedDataParallel`` in its four sharding strategies, with
  ``--offload params``;
- ``zero``: DeepSpeed's ``zero1``/``zero2``/``zero3``, with ``--offload``;
- ``_sharding``: what ``fsdp``, ``fsdp1`` and ``zero`` share;
- ``tp``: tensor parallelism, not a ``train`` family: ``tp.shard`` turns a meta model into
  what one tensor-parallel rank holds and computes, before it is traced.

``train`` runs the traced steps for a ``StrategyConfig`` and says which traced
GPU each real GPU looks like: DataParallel traces every GPU; the other
strategies trace one rank, whose figures hold for every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from memcheck.enums import Strategy
from memcheck.training.loop import LossFn
from memcheck.training.strategies.base import SHARDED, Run, StrategyConfig, applicable

__all__ = ["SHARDED", "StrategyConfig", "applicable", "train"]


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
    train_step: Callable | None = None,
    loop: Mapping[str, Any] | None = None,
) -> list[int]:
    """Trace ``steps`` training steps under ``config``; return, for each real GPU, the traced GPU it matches.

    ``loop``: the job's settings of memcheck's loop, ``training.loop.run_steps``'s keywords (``Job.loop``).
    ``evaluate(module)``, when given, runs after training with the module a trainer
    would evaluate: the DataParallel wrapper under ``dp``, the model otherwise.
    """
    run = Run(config, tracer, model, batch, loss_fn, make_optimizer, steps, autocast, scaler, accumulate, evaluate,
              train_step, loop or {})
    strategy = config.strategy
    if strategy in (Strategy.DP, Strategy.DP_BALANCED):
        from memcheck.training.strategies import data_parallel as family
    elif strategy is Strategy.DDP:
        from memcheck.training.strategies import ddp as family
    elif strategy is Strategy.FSDP:
        from memcheck.training.strategies import fsdp as family
    elif strategy is Strategy.FSDP1:
        from memcheck.training.strategies import fsdp1 as family
    elif strategy in SHARDED:
        from memcheck.training.strategies import zero as family
    else:
        from memcheck.training.strategies import single as family
    return family.train(run)
