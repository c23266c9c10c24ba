"""``preflight()`` and ``check()``: will this job fit, and if not, what to run instead.

For the top of a training script, a trainer callback or a config gate. The job
is traced as ``estimate`` traces it (a meta twin of the model: no weights are
copied, on the host or on a GPU) and judged against the capacity minus the
margin, the limit ``memcheck plan`` keeps to. A job over the limit gets a fix on the
same card, found by ``plan`` with the job's own global batch and strategy: first at
the job's precision and optimizer, the micro-batch, accumulation and checkpointing
that reach the same global batch and fit; when none does, the same search over the
GPU's low precisions and the lighter optimizers (``plan``'s ``auto``: fused AdamW,
8-bit state, ZeRO-Offload); other hardware is suggested only when no setting on this
card fits (each fix is traced at exactly its own settings). When the training step fits
but the evaluation pass does not, the fix is the evaluation's: predictions moved
off the GPU after every batch, then a smaller evaluation batch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from memcheck.compat import tree_flatten, tree_map_only
from memcheck.engine.estimate import estimate, target_gpu
from memcheck.engine.plan import CHECKPOINTING_OPTIONS, _arity, plan
from memcheck.enums import Device, Strategy
from memcheck.errors import UsageError, WillNotFit, require_int
from memcheck.job import Job, as_job, limit_bytes
from memcheck.report.results import Estimate, EvalFix, Verdict
from memcheck.report.text import will_not_fit_message
from memcheck.trace.device_redirect import on_meta, tracing_globals


@tracing_globals()
def check(
    model: torch.nn.Module,
    batch: Any,
    job: Job | None = None,
    *,
    eval_batch: Any = None,
    fix: bool = True,
    loss_fn=None,
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    **settings,
) -> Verdict:
    """Trace the job and judge it against ``capacity * (1 - margin)``; never raises for a misfit.

    Args:
        model: the model, real (on any device, even a GPU) or meta; it is not modified
            and its weights are not copied.
        batch: the worst-case batch (every sequence padded to the longest length the job
            will see), or a factory ``make_batch(batch_size[, max_len[, target_len]])``
            that builds one; a factory needs ``batch_size``.
        job: the job (``memcheck.Job``), or its settings as keywords (``settings``, as in
            ``estimate``): ``batch_size``, ``max_len`` and ``target_len`` are the factory's
            arguments (and the report's labels); the capacity is ``budget_bytes`` or the
            GPU's (the local GPU by default); ``margin`` is the fraction of it held back
            (default ``memcheck.job.DEFAULT_MARGIN``); ``eval_batch_size`` builds the
            evaluation batch with a factory.
        eval_batch: the evaluation pass's batch.
        fix: look for a fix when the job does not fit (more traces; a few seconds each).
        loss_fn, model_name: as in ``estimate``.

    Returns:
        A ``Verdict``: ``fits``, the ``estimate``, ``limit_bytes`` and, for a job that does
        not fit, ``fix`` (a ``Plan``) or ``eval_fix``.
    """
    job = as_job(job, settings, caller="check()")
    device, config, margin = job.device, job.strategy_config, job.effective_margin
    batch_size, max_len, target_len = job.batch_size, job.max_len, job.target_len
    eval_batch_size = job.eval_batch_size
    target = target_gpu(job)
    capacity = job.budget_bytes if job.budget_bytes is not None else (target.capacity_bytes if target else None)
    if capacity is None:
        raise UsageError("a pre-flight check needs a capacity: name the GPU (gpu='H100-80GB' or gpu='24GiB') "
                         "or give budget_bytes" + ("" if device is Device.CPU else "; no local GPU was found"))

    make = batch if callable(batch) and not isinstance(batch, torch.Tensor) else None
    if make is not None:
        require_int(batch_size, "batch_size", message=(
            f"a batch factory needs batch_size= (the micro-batch to check), got {batch_size!r}"))
        make = _with_lengths(make, max_len, target_len)
        rows = batch_size * config.gpus if config.strategy in (Strategy.DP, Strategy.DP_BALANCED) else batch_size
        batch = make(rows)
    else:
        make = resizer(batch)
        rows = leading_size(batch)
        if batch_size is None:
            batch_size = rows // config.gpus if config.strategy in (Strategy.DP, Strategy.DP_BALANCED) else rows
    if eval_batch is None and eval_batch_size is not None:  # eval_batch_size: checked by the Job
        eval_batch = make(eval_batch_size)
    name = model_name or type(model).__name__
    job = job.replace(gpu=target if device is Device.CUDA else None, budget_bytes=capacity, batch_size=batch_size)
    if progress is not None:
        progress(f"tracing {name} at micro-batch {batch_size}")
    est = estimate(model, batch, job, eval_batch=eval_batch, loss_fn=loss_fn, model_name=name)
    limit = limit_bytes(capacity, margin)
    verdict = Verdict(estimate=est, capacity_bytes=capacity, margin=margin, limit_bytes=limit)
    if est.total_bytes <= limit or not fix:
        return verdict
    train_total = _train_total(est)
    if est.peak_in == "eval" and train_total <= limit:
        return Verdict(estimate=est, capacity_bytes=capacity, margin=margin, limit_bytes=limit,
                       eval_fix=_eval_fix(model, batch, eval_batch, limit, job, loss_fn, name, progress))
    found = find_fix(model, make, job.replace(global_batch=batch_size * job.accumulate * config.gpus, margin=margin),
                     loss_fn=loss_fn, model_name=name, progress=progress)
    return Verdict(estimate=est, capacity_bytes=capacity, margin=margin, limit_bytes=limit, fix=found)


# What the fix search widens to, in order, before it names other hardware: the job's own precision
# and optimizer (micro-batch, accumulation, checkpointing), then the target GPU's low precisions
# and the lighter optimizers (plan's "auto"; on the CPU target only the job's precision).
FIX_STAGES = ((None, None), ("auto", "auto"))


def find_fix(model: torch.nn.Module, make: Callable[..., Any], job: Job, *, loss_fn=None, model_name: str,
             progress=None):
    """The plan that fixes ``job`` on its own card: the job's precision and optimizer first,
    then the GPU's low precisions and lighter optimizers (``FIX_STAGES``); only the last
    stage, when nothing fits, traces what would (a larger GPU, a sharded GPU count)."""
    found = None
    for i, (precisions, optimizers) in enumerate(FIX_STAGES):
        last = i == len(FIX_STAGES) - 1
        if precisions is not None and job.device is not Device.CUDA:
            break  # the CPU target keeps the job's precision (plan's auto) and optimizer
        found = plan(model, make, job, precision_options=precisions, optimizer_options=optimizers,
                     checkpointing_options=CHECKPOINTING_OPTIONS, loss_fn=loss_fn, model_name=model_name,
                     progress=progress, length_profile=False, suggest=last or job.device is not Device.CUDA)
        if found.recommended is not None:
            return found
    return found


def preflight(model: torch.nn.Module, batch: Any, **kwargs) -> Estimate:
    """``check()``, raising ``WillNotFit`` when the job does not fit; returns the ``Estimate``.

    Call it at the top of a training script, before anything big is allocated::

        report = memcheck.preflight(model, batch, optimizer="adamw", gpu="A100-80GB",
                                    precision="amp-bf16", accumulate=4)

    ``WillNotFit``'s message is the verdict on one line and the fix on the next; the
    exception carries the whole ``Verdict`` as ``.verdict``.
    """
    verdict = check(model, batch, **kwargs)
    if not verdict.fits:
        raise WillNotFit(verdict, will_not_fit_message(verdict))
    return verdict.estimate


def leading_size(batch: Any) -> int:
    """The batch's size: the first dimension of its first tensor."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not leaves:
        raise UsageError(f"the batch holds no tensors (got {type(batch).__name__}); pass the batch the model "
                         "trains on, or a factory make_batch(batch_size)")
    if not leaves[0].dim():
        raise UsageError("the batch's first tensor is a scalar; memcheck cannot tell the batch size "
                         "(pass batch_size=, or a factory make_batch(batch_size))")
    return leaves[0].shape[0]


def resizer(batch: Any) -> Callable[[int], Any]:
    """``make(n)``: the batch with ``n`` rows, as meta tensors; every tensor whose first
    dimension is the batch size is resized along it, every other tensor is kept."""
    rows = leading_size(batch)

    def make(n: int) -> Any:
        def one(t: torch.Tensor) -> torch.Tensor:
            shape = (n, *t.shape[1:]) if t.dim() and t.shape[0] == rows else tuple(t.shape)
            return torch.empty(shape, dtype=t.dtype, device="meta")
        return tree_map_only(torch.Tensor, one, batch)

    return make


def _with_lengths(make, max_len, target_len) -> Callable[..., Any]:
    """The factory with the plan's calling convention: ``make(n)``, ``make(n, length)`` or
    ``make(n, length, target)``, whatever the user's factory takes."""
    arity = _arity(make)

    @functools.wraps(make)  # keeps the factory's signature, which the planner reads
    def on_meta_only(*args):  # a factory that names cuda (or cpu) builds meta tensors: no GPU memory
        with on_meta():
            return make(*args)

    if arity >= 3:
        return lambda n, length=max_len, target=target_len: on_meta_only(n, length, target)
    if arity == 2:
        return lambda n, length=max_len: on_meta_only(n, length)
    return on_meta_only


def _train_total(est: Estimate) -> int:
    """The training pass's own figure, judged as the estimate's total is."""
    if est.device_total_bytes is None or est.train_peak_bytes is None:
        return est.train_peak_bytes or est.peak_bytes
    return est.device_total_bytes - est.peak_bytes + est.train_peak_bytes


def _eval_fix(model, batch, eval_batch, limit, job: Job, loss_fn, name, progress) -> EvalFix | None:
    """Training fits and evaluation does not: first keep one batch of predictions on the
    device at most, then halve the evaluation batch until the evaluation pass fits (each
    traced). None when not even an evaluation batch of 1 fits."""
    make = resizer(eval_batch)
    keep = job.eval_accumulate_predictions

    def total(size: int, keep_batches: int) -> int:
        if progress is not None:
            progress(f"tracing the evaluation pass at batch {size}")
        return estimate(model, batch, job.replace(eval_batch_size=size, eval_accumulate_predictions=keep_batches),
                        eval_batch=make(size), loss_fn=loss_fn, model_name=name, top_modules=0).total_bytes

    size = leading_size(eval_batch)
    keep_after = min(keep, 1)
    if keep > 1:
        t = total(size, keep_after)
        if t <= limit:
            return EvalFix(eval_batch_size=size, eval_accumulate_predictions=keep_after,
                           predicted_device_total_bytes=t)
    while size > 1:
        size //= 2
        t = total(size, keep_after)
        if t <= limit:
            return EvalFix(eval_batch_size=size, eval_accumulate_predictions=keep_after,
                           predicted_device_total_bytes=t)
    return None
