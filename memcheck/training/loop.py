"""The training loop memcheck traces, shared with the real runs it is measured against.

The tracer runs it on meta tensors; ``memcheck.measure.local`` runs the very same
function on real tensors under the profiler. One loop, so an estimate and a
measurement always describe the same sequence of work.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from memcheck.enums import Phase, StepOrder
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


def to_precision(batch: Any, dtype: torch.dtype | None, device: Any = None) -> Any:
    """The batch with its floating tensors in ``dtype`` (pure bf16/fp16 training; None keeps
    them) and every tensor on ``device`` (None keeps it), as the traced and real runs feed it."""
    from memcheck.compat import tree_map_only

    if dtype is None and device is None:
        return batch

    def move(t):
        if dtype is not None and t.is_floating_point():
            return t.to(device, dtype) if device is not None else t.to(dtype)
        return t.to(device) if device is not None else t

    return tree_map_only(torch.Tensor, move, batch)


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
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    clip: Callable[[list, float], Any] = torch.nn.utils.clip_grad_norm_,
    order: StepOrder = StepOrder.HF,
    set_to_none: bool = True,
) -> None:
    """Run ``steps`` full training steps in ``order`` (``StepOrder``): by default forward and
    loss, backward, clipping, step, zero_grad.

    ``order`` moves the ``zero_grad(set_to_none=set_to_none)``: ``plain`` calls it as a step begins,
    before the forward; ``lightning`` after the first micro-step's forward and loss, before its
    backward, as Lightning's ``Closure`` does (so the previous step's gradients are alive through
    that forward), and the last step's gradients stay alive after the run; ``hf`` and
    ``accelerate`` after the optimizer step. The phase of a step's first event is always
    ``FORWARD`` (the tracer starts a step there); a ``zero_grad`` before the forward is announced
    as ``FORWARD``, then ``ZERO_GRAD``, then ``FORWARD`` again. ``set_to_none=False`` zeroes the
    gradients in place instead of dropping them (torch/optim/optimizer.py, ``zero_grad``): they stay
    allocated until the next backward accumulates into them.

    With ``accumulate`` N > 1 each step runs N micro-steps of forward and backward
    (the loss divided by N, as the HF Trainer and Lightning do), so gradients stay
    live across micro-steps, then one optimizer step.

    ``autocast`` is a factory of the context the forward and loss run in (for
    mixed precision, ``lambda: torch.autocast("cuda", torch.float16)``); backward
    and the step run outside it, as the autocast recipe prescribes. ``scaler``
    is a ``torch.amp.GradScaler`` (or memcheck's meta stand-in): the loss is
    scaled before backward, and ``scaler.step``/``scaler.update`` replace
    ``optimizer.step``.
    """
    order = StepOrder.parse(order, what="step order")
    region = autocast or contextlib.nullcontext
    model.train()
    for step in range(steps):
        for micro in range(accumulate):
            on_phase(step, Phase.FORWARD)
            if order is StepOrder.PLAIN and micro == 0:
                on_phase(step, Phase.ZERO_GRAD)
                optimizer.zero_grad(set_to_none=set_to_none)
                on_phase(step, Phase.FORWARD)
            with region():
                loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TraceError(
                    f"the loss must be a one-element tensor, got {type(loss).__name__}"
                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                )
            if accumulate > 1:
                loss = loss / accumulate
            if order is StepOrder.LIGHTNING and micro == 0:
                on_phase(step, Phase.ZERO_GRAD)
                optimizer.zero_grad(set_to_none=set_to_none)
            on_phase(step, Phase.BACKWARD)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
        on_phase(step, Phase.OPTIMIZER)
        if max_grad_norm:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            clip(params, max_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if order in (StepOrder.HF, StepOrder.ACCELERATE):
            on_phase(step, Phase.ZERO_GRAD)
            optimizer.zero_grad(set_to_none=set_to_none)


TrainStep = Callable[[torch.nn.Module, Any, torch.optim.Optimizer], Any]


def run_train_steps(
    model: torch.nn.Module,
    batch: Any,
    train_step: TrainStep,
    optimizer: torch.optim.Optimizer,
    steps: int,
    on_phase: Callable[[int, Phase], None] = lambda step, phase: None,
) -> None:
    """Run the user's own ``train_step(model, batch, optimizer)`` ``steps`` times, as it is:
    its order of ``zero_grad``, its clipping, its losses. The phases follow its calls: a step
    starts in the forward; ``Tensor.backward`` starts the backward, ``optimizer.step`` the
    optimizer step (``register_step_pre_hook``) and ``optimizer.zero_grad`` the zero_grad
    phase, wherever the step calls them. ``Tensor.backward`` and the optimizer's ``zero_grad``
    are wrapped for the run and restored after it (not thread-safe)."""
    now = [0]
    hook = optimizer.register_step_pre_hook(lambda opt, args, kwargs: on_phase(now[0], Phase.OPTIMIZER))
    zero_grad, backward = optimizer.zero_grad, torch.Tensor.backward

    def marked_zero_grad(*args, **kwargs):
        on_phase(now[0], Phase.ZERO_GRAD)
        return zero_grad(*args, **kwargs)

    def marked_backward(self, *args, **kwargs):
        on_phase(now[0], Phase.BACKWARD)
        return backward(self, *args, **kwargs)

    optimizer.zero_grad = marked_zero_grad
    torch.Tensor.backward = marked_backward
    try:
        model.train()
        for step in range(steps):
            now[0] = step
            on_phase(step, Phase.FORWARD)
            train_step(model, batch, optimizer)
    finally:
        torch.Tensor.backward = backward
        del optimizer.zero_grad  # the instance attribute; the class's method again
        hook.remove()


def outputs_of(out: Any) -> list[torch.Tensor]:
    """The prediction tensors of a model output: every tensor but the loss."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # transformers' ModelOutput is a dict
        return [v for k, v in out.items() if k != "loss" and isinstance(v, torch.Tensor)]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def run_eval(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    on_phase: Callable[[int, Phase], None] = lambda step, phase: None,
    *,
    step: int = 0,
    autocast: Callable[[], ContextManager] | None = None,
    keep_batches: int = 0,
) -> None:
    """One evaluation pass as a trainer runs it: forward and loss under ``torch.no_grad()``
    (``inference_mode`` differs in autograd bookkeeping, not in the tensors it allocates;
    not measured separately).

    ``keep_batches`` N > 0 keeps the model's predictions (every output tensor but
    the loss) on the device for N eval batches, concatenated batch after batch with
    ``torch.cat`` the way the HF Trainer does without ``eval_accumulation_steps``.
    Batch N is the costliest: it runs with N-1 batches of predictions held and
    batch N-1's predictions still referenced, then the concatenation holds the
    N-1 batches, batch N and the result (2N batches) at once. So the pass runs
    batch 1, builds the N-1 batches in one concatenation, and runs batch N on top.
    """
    region = autocast or contextlib.nullcontext
    kept: list[torch.Tensor] = []

    def keep(module, args, out):
        kept.extend(outputs_of(out))

    model.eval()
    on_phase(step, Phase.EVAL)
    handle = model.register_forward_hook(keep) if keep_batches else None
    try:
        with torch.no_grad(), region():
            loss_fn(model, batch)
            if keep_batches > 1:
                previous = kept[:]
                held = [torch.cat([p] * (keep_batches - 1)) for p in previous]
                kept.clear()
                loss_fn(model, batch)  # batch N
                latest = kept[:]
                kept.clear()
                del previous  # replaced by batch N's predictions
                held = [torch.cat([h, p]) for h, p in zip(held, latest)]
                del held, latest
    finally:
        if handle is not None:
            handle.remove()
        kept.clear()
        model.train()
