"""``compare()``: the same job under every strategy that applies to a GPU count, side by side."""

from __future__ import annotations

from typing import Any

import torch

from memcheck.engine.estimate import estimate
from memcheck.errors import UsageError, require_int
from memcheck.job import MIXED_PRECISION_FIELDS, Job, as_job, check_setting
from memcheck.report.results import Comparison
from memcheck.training.strategies import applicable


def compare(model: torch.nn.Module, batch: Any, job: Job | None = None, *, gpus: int = 1, loss_fn=None,
            eval_batch: Any = None, model_name: str | None = None, top_modules: int = 8, progress=None,
            **settings) -> Comparison:
    """Estimate ``model`` under each strategy for ``gpus`` GPUs: ``job`` (or its settings as
    keywords, as in ``estimate``) with each strategy at its defaults.

    ``batch`` is one GPU's micro-batch. DataParallel scatters one batch over the
    GPUs, so its rows trace ``gpus`` micro-batches stacked: every strategy then
    sees the same batch per GPU; with ``packing`` (one row) the DataParallel rows are left out.
    """
    require_int(gpus, "gpus")
    check_setting("gpus", gpus)  # at most MAX_GPUS; the DataParallel rows up to MAX_DP_GPUS only (applicable)
    for key in ("strategy", "gpus", "bucket_view", "bucket_cap_mb", "offload", "fsdp_sharding", "gpus_per_node",
                *MIXED_PRECISION_FIELDS):
        if key in settings:
            raise UsageError(f"compare() sets {key} itself for each row; do not pass it")
    job = as_job(job, settings, caller="compare()")
    rows = []
    for config in applicable(gpus):
        if job.packing and config.strategy.value.startswith("dp"):
            continue  # DataParallel scatters rows, and a packed batch is one row (memcheck.job._check_packing)
        row_batch = _stacked(batch, gpus) if config.strategy.value.startswith("dp") else batch
        row = job.replace(strategy=config.strategy, gpus=config.gpus, bucket_view=False, bucket_cap_mb=None,
                          offload="none", fsdp_sharding=None, gpus_per_node=None, **MIXED_PRECISION_FIELDS)
        rows.append(estimate(model, row_batch, row, loss_fn=loss_fn, eval_batch=eval_batch, model_name=model_name,
                             top_modules=top_modules, progress=progress))
    return Comparison(gpus=gpus, rows=tuple(rows))


def _stacked(batch: Any, copies: int) -> Any:
    """The batch ``copies`` times along dim 0, on the meta device (shapes only)."""
    from memcheck.compat import tree_map_only

    def stack(t):
        if t.dim() == 0:
            return t
        return torch.empty((t.shape[0] * copies, *t.shape[1:]), dtype=t.dtype, device="meta")

    return tree_map_only(torch.Tensor, stack, batch)
