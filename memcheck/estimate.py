"""``estimate()``: trace training steps on the meta device and report the peak."""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from memcheck.autocast import MetaAutocast, MetaGradScaler
from memcheck.enums import Category, Device, Phase, Precision
from memcheck.errors import MemcheckError, TraceError, UnsupportedOpError, UsageError
from memcheck.optimizers import resolve_optimizer
from memcheck.report import BatchInfo, Breakdown, Estimate, InputSpec, ModuleMemory
from memcheck.tracer import ALLOC, FREE, RECAT, MemoryTracer, TraceLog
from memcheck.training_loop import LossFn, default_loss, run_steps

_STATE = (Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER)
_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
_AMP = {Precision.AMP_BF16: torch.bfloat16, Precision.AMP_FP16: torch.float16}


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors; no weights are copied."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            torch.nn.Parameter(empty, requires_grad=t.requires_grad)
            if isinstance(t, torch.nn.Parameter)
            else empty
        )
    return copy.deepcopy(model, memo)


def meta_batch(batch: Any) -> Any:
    """The batch with every tensor replaced by an empty meta tensor of the same shape and dtype."""
    return tree_map_only(
        torch.Tensor, lambda t: t if t.device.type == "meta" else torch.empty_like(t, device="meta"), batch
    )


def describe_batch(batch: Any, batch_size: int | None, max_len: int | None, target_len: int | None) -> BatchInfo:
    """Summarise the tensors of a batch for the report."""
    if isinstance(batch, dict):
        items = [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    else:
        leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        items = [(f"input{i}", t) for i, t in enumerate(leaves)]
    inputs = tuple(InputSpec(k, tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in items)
    if batch_size is None:
        batch_size = items[0][1].shape[0] if items and items[0][1].dim() else 1
    return BatchInfo(batch_size, max_len, target_len, inputs)


_NO_KERNEL = re.compile(r"Could not run '([\w:.]+)' with arguments from the '(\w+)' backend")


def _translate(exc: Exception, model_name: str) -> MemcheckError:
    """Map an exception from the traced code to a one-line MemcheckError."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    match = _NO_KERNEL.search(str(exc))
    if match or (isinstance(exc, NotImplementedError) and "meta" in str(exc).lower()):
        op = match.group(1) if match else text
        return UnsupportedOpError(
            f"op {op} has no meta kernel, so memcheck cannot trace {model_name}; "
            "register a rule for it with memcheck.register_op_rule"
        )
    return TraceError(f"{model_name} failed while being traced: {type(exc).__name__}: {text}")


def estimate(
    model: torch.nn.Module,
    batch: Any,
    *,
    device: str | Device = Device.CUDA,
    optimizer: Any = "adamw",
    loss_fn: LossFn | None = None,
    precision: str | Precision = Precision.FP32,
    steps: int = 2,
    budget_bytes: int | None = None,
    batch_size: int | None = None,
    max_len: int | None = None,
    target_len: int | None = None,
    model_name: str | None = None,
    top_modules: int = 8,
) -> Estimate:
    """Trace ``steps`` training steps of ``model`` on ``batch`` and return the steady-state peak.

    Nothing is allocated for real: the model and batch are traced as meta tensors
    (a meta twin is made of a real model, without copying its weights; the
    caller's model is never modified).

    Args:
        model: the model, on the meta device or any other.
        batch: what ``loss_fn`` takes: a dict for ``model(**batch)``, a tensor or a tuple.
        device: the target, ``"cpu"`` or ``"cuda"``.
        optimizer: a name (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``), a function
            ``params -> Optimizer`` or an Optimizer whose class and settings are reused.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss`` for
            dicts, otherwise the output summed.
        precision: ``fp32``; pure ``bf16``/``fp16`` weights; or ``amp-bf16``/``amp-fp16``, fp32
            weights under ``torch.autocast`` (amp-fp16 with a GradScaler).
        steps: training steps to trace (at least 2: the first has no optimizer state).
        budget_bytes: if given, ``Estimate.fits`` compares the peak with it.

    Returns:
        An ``Estimate``; ``str()`` is the table, ``to_dict()`` the JSON.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT2LMHeadModel(GPT2Config())
        ...     ids = torch.zeros(8, 1024, dtype=torch.long)
        >>> est = memcheck.estimate(model, {"input_ids": ids, "labels": ids}, device="cpu")
        >>> est.peak_bytes

    Known limitations:
        The CUDA target does not yet emulate CUDA's attention kernels, autocast or the
        caching allocator; for ``device="cuda"`` the figure is allocated bytes traced
        with CPU-equivalent kernels, and the report lists what was assumed.
    """
    device = Device.parse(device)
    precision = Precision.parse(precision)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise UsageError(f"steps must be an integer of at least 2 (step 1 has no optimizer state), got {steps!r}")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise UsageError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
    name = model_name or type(model).__name__
    opt_label, make_optimizer = resolve_optimizer(optimizer, device)
    loss_fn = loss_fn or default_loss

    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"{name} has no trainable parameters (none with requires_grad=True); nothing to train")
    twin = meta_twin(model)
    mbatch = meta_batch(batch)
    if precision in _DTYPES:
        twin = twin.to(_DTYPES[precision])
        mbatch = tree_map_only(
            torch.Tensor, lambda t: t.to(_DTYPES[precision]) if t.is_floating_point() else t, mbatch
        )
    info = describe_batch(mbatch, batch_size, max_len, target_len)

    tracer = MemoryTracer(device)
    autocast = scaler = None
    if precision in _AMP:
        tracer.autocast = MetaAutocast(device, _AMP[precision])
        autocast = tracer.autocast.region
        if precision is Precision.AMP_FP16:
            scaler = MetaGradScaler()
            tracer.assume("amp-fp16: a GradScaler scales the loss; no overflow, so every step is taken")
    try:
        with tracer:
            tracer.watch(model=twin, batch=mbatch)
            opt = make_optimizer(twin.parameters())
            tracer.watch(optimizer=opt)
            run_steps(twin, mbatch, loss_fn, opt, steps, tracer.set_phase, autocast=autocast, scaler=scaler)
    except MemcheckError:
        raise
    except Exception as exc:  # the model's own code failed under the trace
        raise _translate(exc, name) from exc
    return _summarise(
        tracer.log, name=name, root=type(twin).__name__, device=device, precision=precision, optimizer=opt_label,
        steps=steps, batch=info, budget_bytes=budget_bytes, top_modules=top_modules,
    )


def _short(module: str | None, root: str) -> str:
    if not module or module == "Global":
        return "(outside modules)"
    if module.startswith("("):
        return module
    if module == root:
        return "(model)"
    return module.split(".", 1)[1] if module.startswith(root + ".") else module


def _summarise(log: TraceLog, *, name, root, device, precision, optimizer, steps, batch, budget_bytes, top_modules) -> Estimate:
    events = log.events
    start = log.step_starts[1] if len(log.step_starts) > 1 else 0
    live = 0
    best, best_at = -1, 0
    for i, ev in enumerate(events):
        kind = ev[0]
        if kind == ALLOC:
            live += ev[2]
            if i >= start and live > best:
                best, best_at = live, i
        elif kind == FREE:
            live -= ev[2]
    if best < 0:
        raise TraceError(f"tracing {name} recorded no memory after step 1")

    # Replay up to the peak to see what was live and why.
    state: dict[int, list] = {}
    for ev in events[: best_at + 1]:
        kind, sid, n, cat, module = ev[:5]
        if kind == ALLOC:
            state[sid] = [n, cat, module]
        elif kind == FREE:
            state.pop(sid, None)
        elif sid in state:
            state[sid][1] = cat
            if module is not None:
                state[sid][2] = module
    by_cat: dict[Category, int] = defaultdict(int)
    by_mod: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for n, cat, module in state.values():
        by_cat[cat] += n
        by_mod[_short(module, root)][0 if cat in _STATE else 1] += n
    modules = sorted(
        (ModuleMemory(m, s, a) for m, (s, a) in by_mod.items()), key=lambda m: -m.total
    )[:top_modules]
    peak_event = events[best_at]
    return Estimate(
        model=name, device=device, precision=precision, optimizer=optimizer, steps=steps,
        batch=batch, peak_bytes=best, breakdown_at_peak=Breakdown.from_categories(by_cat),
        peak_phase=peak_event[5], peak_module=_short(peak_event[4], root), peak_step=peak_event[6] + 1,
        modules=tuple(modules), assumptions=tuple(log.assumptions), budget_bytes=budget_bytes,
    )
