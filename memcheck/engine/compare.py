"""``compare()``: the same job under every strategy that applies to a GPU count, side by side."""

from __future__ import annotations

from typing import Any

import torch

from memcheck.errors import UsageError, require_int
from memcheck.engine.estimate import estimate
from memcheck.report.results import Comparison
from memcheck.training.strategies import applicable


def compare(model: torch.nn.Module, batch: Any, *, gpus: int = 1, **kwargs) -> Comparison:
    """Estimate ``model`` under each strategy for ``gpus`` GPUs; ``kwargs`` go to ``estimate``.

    ``batch`` is one GPU's micro-batch. DataParallel scatters one batch over the
    GPUs, so its rows trace ``gpus`` micro-batches stacked: every strategy then
    sees the same batch per GPU.
    """
    require_int(gpus, "gpus")
    for key in ("strategy", "gpus", "bucket_view", "bucket_cap_mb", "offload"):
        if key in kwargs:
            raise UsageError(f"compare() sets {key} itself for each row; do not pass it")
    rows = []
    for config in applicable(gpus):
        row_batch = _stacked(batch, gpus) if config.strategy.value.startswith("dp") else batch
        rows.append(estimate(model, row_batch, strategy=config.strategy, gpus=config.gpus, **kwargs))
    return Comparison(gpus=gpus, rows=tuple(rows))


def _stacked(batch: Any, copies: int) -> Any:
    """The batch ``copies`` times along dim 0, on the meta device (shapes only)."""
    from torch.utils._pytree import tree_map_only

    def stack(t):
        if t.dim() == 0:
            return t
        return torch.empty((t.shape[0] * copies, *t.shape[1:]), dtype=t.dtype, device="meta")

    return tree_map_only(torch.Tensor, stack, batch)
