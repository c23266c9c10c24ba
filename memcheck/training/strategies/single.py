"""``single``: the plain traced loop on one GPU; ``ddp``, ``fsdp`` and ``zero1-3`` run the same
loop with their emulation hooked in (the contract: ``memcheck.training.strategies.base``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from memcheck.training.loop import LossFn, run_steps
from memcheck.training.strategies.base import SHARDS_AT_INIT, Emulation, StrategyConfig


def train(
    config: StrategyConfig,
    tracer,
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    make_optimizer: Callable,
    steps: int,
    *,
    emulate: Callable[..., Emulation] | None = None,
    autocast=None,
    scaler=None,
    accumulate: int = 1,
    evaluate: Callable[[torch.nn.Module], None] | None = None,
) -> list[int]:
    """Trace ``steps`` steps of the plain loop on rank 0, with ``emulate(config, tracer, model,
    accumulate)``'s emulation when a wrapper adds to it; every rank looks like rank 0."""
    if config.strategy in SHARDS_AT_INIT:
        # Were the full parameters counted first, the simulated allocator would keep their
        # segments cached: the only way a model larger than one GPU can start is on meta.
        tracer.assume(f"{config.strategy.value}: the model is built on the meta device and only its shards are "
                      "materialised (fully_shard then to_empty; deepspeed.zero.Init)")
        for p in model.parameters():
            tracer.ignore(p)
    tracer.watch(model=model, batch=batch)
    emulation = emulate(config, tracer, model, accumulate) if emulate is not None else None
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
