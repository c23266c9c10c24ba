"""The training loop memcheck traces, shared with the real runs it is measured against.

The tracer runs it on meta tensors; ``memcheck.measure`` runs the very same
function on real tensors under the profiler. One loop, so an estimate and a
measurement always describe the same sequence of work.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from memcheck.enums import Phase
from memcheck.errors import TraceError

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for dict batches; otherwise the model's output summed."""
    if isinstance(batch, dict):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if loss is None:
            raise TraceError(
                f"{type(model).__name__}(**batch) returned no .loss; pass labels in the batch "
                "or define compute_loss(model, batch)"
            )
        return loss
    out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().sum() if out.dtype in (torch.float16, torch.bfloat16) else out.sum()


def run_steps(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    steps: int,
    on_phase: Callable[[int, Phase], None] = lambda step, phase: None,
    *,
    autocast: Callable[[], ContextManager] | None = None,
    scaler: Any = None,
) -> None:
    """Run ``steps`` full training steps: forward and loss, backward, step, zero_grad.

    ``autocast`` is a factory of the context the forward and loss run in (for
    mixed precision, ``lambda: torch.autocast("cuda", torch.float16)``); backward
    and the step run outside it, as the autocast recipe prescribes. ``scaler``
    is a ``torch.amp.GradScaler`` (or memcheck's meta stand-in): the loss is
    scaled before backward, and ``scaler.step``/``scaler.update`` replace
    ``optimizer.step``.
    """
    region = autocast or contextlib.nullcontext
    model.train()
    for step in range(steps):
        on_phase(step, Phase.FORWARD)
        with region():
            loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TraceError(
                f"the loss must be a one-element tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        on_phase(step, Phase.BACKWARD)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss
        on_phase(step, Phase.OPTIMIZER)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        on_phase(step, Phase.ZERO_GRAD)
        optimizer.zero_grad(set_to_none=True)
