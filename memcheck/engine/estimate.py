"""``estimate()``: trace training steps on the meta device and report the peak."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from memcheck import compat
from memcheck.compat import tree_flatten, tree_map_only
from memcheck.choices import ANSWERS, NO_PADDING, PADDING, Choices, point_of
from memcheck.cuda.allocator import AllocatorConfig, growing_run, simulate
from memcheck.cuda.gpus import GpuSpec, local_library_versions, resolve_gpu
from memcheck.cuda.overhead import context_bytes, context_source, module_loading, workspace_allocations
from memcheck.enums import ALLOC, FREE, RECAT, Category, Device, Padding, Phase, Precision, StepOrder
from memcheck.errors import (
    MemcheckError,
    TraceError,
    UnsupportedOpError,
    UsageError,
    check_module_depth,
    exited_message,
    library_failure,
    meta_kernel_failure,
    model_frame,
    require_int,
)
from memcheck.job import Job, SettingError, as_job, escape, limit_bytes
from memcheck.report.results import (
    BatchInfo,
    Branch,
    Branches,
    Breakdown,
    DeviceMemory,
    Estimate,
    InputSpec,
    ModuleMemory,
    Work,
)
from memcheck.rules import extensions
from memcheck.rules.autocast import MetaAutocast, MetaGradScaler, UserAutocast, meta_autocast_queries
from memcheck.trace.device_redirect import reads_meta_data, redirect_cuda, tracing_globals
from memcheck.trace.tracer import ForwardDone, MemoryTracer, TraceLog
from memcheck.training.adapters import apply_adapters, quantize_4bit
from memcheck.training.checkpointing import apply_checkpointing
from memcheck.training.loop import LossFn, default_loss, run_eval, to_precision
from memcheck.training.optimizers import resolve_optimizer
from memcheck.training.strategies import train
from memcheck.training.strategies.layout import Role, roles
from memcheck.units import format_bytes

_STATE = (Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER, Category.COMMUNICATION)


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors; no weights are copied.
    A ``torch.compile``'d model's copy is the copy of the module it compiled, uncompiled."""
    model = compat.eager_module(model)
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
    extensions.twin_memo(model, memo)  # quantized weights keep their classes (bitsandbytes)
    twin = copy.deepcopy(model, memo)
    compat.uncompile_copy(twin)  # module.compile()'s call is bound to the original module
    return twin


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


# How torch says an op has no meta kernel: the dispatcher's message for an op without a Meta
# key, the one for an op without a fake impl, torch.library.custom_op's without register_fake,
# and a Python meta registration that refuses.
_NO_KERNEL = (
    re.compile(r"Could not run '([\w:.]+)' with arguments from the 'Meta' backend"),
    re.compile(r"(?:^|\s|op )([\w.]+::[\w.]+): attempted to run this operator with Meta tensors"),
    re.compile(r"no fake impl registered for <CustomOpDef\(([\w.]+::[\w.]+)\)>"),
    re.compile(r"register_meta function for (torch\.[\w.]+)\(\)"),
)
_OP_NAME = re.compile(r"\b(\w+::[\w.]+)")


def _missing_meta_kernel(exc: Exception) -> str | None:
    """The op named by a "no meta kernel" error ("" if it names none), else None."""
    message = str(exc)
    for pattern in _NO_KERNEL:
        match = pattern.search(message)
        if match:
            return match.group(1)
    if isinstance(exc, NotImplementedError) and "meta" in message.lower():
        match = _OP_NAME.search(message)
        return match.group(1) if match else ""
    return None


# The settings that choose which code runs (what a failure in library code is traced under).
_CODE_PATH = ("device", "precision", "weights_dtype", "checkpointing", "use_reentrant", "lora", "qlora", "strategy",
              "gpus", "layout", "tp_plan", "fsdp_sharding", "offload", "packing", "attn")


def settings_in_force(job: Job | None) -> str:
    """The job's settings that choose which code is traced, as the flags that give them
    (``--device cuda --checkpointing half``); the device always, the rest where not the default."""
    if job is None:
        return ""
    from memcheck.job import SPELLING

    mine, default = job.to_dict(), Job().to_dict()
    parts = []
    for field in _CODE_PATH:
        spelling = SPELLING[field]
        value, usual = mine[spelling.json], default[spelling.json]
        if field != "device" and value == usual:
            continue
        flag = spelling.flag or field
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)


def _translate(exc: Exception, model_name: str, job: Job | None = None) -> MemcheckError:
    """Map an exception from the traced code to a one-line MemcheckError."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    known = extensions.explain_failure(exc)  # an extension that calls its CUDA library directly
    if known:
        return UnsupportedOpError(f"{known}; cannot trace {model_name}")
    if reads_meta_data(exc):  # not a missing kernel: the model reads values
        return TraceError(
            f"{model_name} reads tensor data (.numpy()/.tolist()/...) that meta tensors do not have, "
            f"so memcheck cannot trace it ({type(exc).__name__}: {text})"
        )
    if "Storage size calculation overflowed" in text or isinstance(exc, OverflowError):
        return TraceError(  # a job too large for int64 sizes (issue 20): the batch, not the model, is at fault
            f"{model_name} makes a tensor too large to represent at this batch size and length "
            f"({type(exc).__name__}: {text[:160]}); lower the batch size or the length")
    op = _missing_meta_kernel(exc)
    if op is not None:
        what = f"op {op}" if op else f"an op ({text[:120]})"
        return UnsupportedOpError(
            f"{what} has no meta kernel and no memcheck rule, so memcheck cannot trace {model_name}; "
            "register one with memcheck.register_op_rule (see examples/custom_op_rule.py)"
        )
    where = model_frame(exc)
    text = text if len(text) <= 200 else text[:199] + "…"
    op = meta_kernel_failure(exc)
    if op is not None:  # the model's inputs may be wrong, or the meta kernel stricter than the real one
        return TraceError(
            f"{where + ': ' if where else ''}{model_name} failed while being traced, in the meta kernel of "
            f"{op}: {type(exc).__name__}: {text} (either the model passes it inputs no kernel accepts, or that "
            "meta kernel is stricter than the target's real kernel: then register a rule for the op with "
            "memcheck.register_op_rule, see examples/custom_op_rule.py; --debug shows the traceback)"
        )
    library = library_failure(exc)
    if library is not None:  # stock code the user did not write: memcheck's failure to trace it, not the model's
        package, location, function, traced_op = library
        settings = settings_in_force(job)
        return TraceError(
            f"memcheck could not trace {model_name}{' with ' + settings if settings else ''}: {type(exc).__name__}: "
            f"{text}, raised inside {package} ({location}, {function}"
            f"{', while tracing ' + traced_op if traced_op else ''}), not in the model's own code; if a real run "
            "with these settings works, memcheck is at fault: please report it (--debug shows the traceback)")
    return TraceError(f"{where + ': ' if where else ''}{model_name} failed while being traced: "
                      f"{type(exc).__name__}: {text} (fix the model code there; --debug shows the traceback)")


@tracing_globals()
def estimate(
    model: torch.nn.Module,
    batch: Any,
    job: Job | None = None,
    *,
    loss_fn: LossFn | None = None,
    eval_batch: Any = None,
    model_name: str | None = None,
    top_modules: int = 8,
    progress: Callable[[str], None] | None = None,
    timeline: bool = False,
    train_step: Callable | None = None,
    **settings,
) -> Estimate:
    """Trace ``job.steps`` training steps of ``model`` on ``batch`` and return the steady-state peak.

    Nothing is allocated for real: the model and batch are traced as meta tensors
    (a meta twin is made of a real model, without copying its weights; the
    caller's model is never modified).

    Args:
        model: the model, on the meta device or any other.
        batch: what ``loss_fn`` takes: a dict for ``model(**batch)``, a tensor or a tuple.
        job: every setting of the job (``memcheck.Job``); or give them as keywords
            (``settings``), or both (the keywords change the job). The settings that
            matter here: ``device`` (``cuda`` or ``cpu``), ``gpu`` (a name such as
            ``"H100-80GB"``, a size such as ``"24GiB"`` or a GpuSpec; by default the local
            GPU, if any), ``budget_bytes`` (by default the GPU's capacity), ``precision``
            (``fp32``; pure ``bf16``/``fp16``; ``amp-bf16``/``amp-fp16`` under torch.autocast,
            fp16 with a GradScaler), ``optimizer`` (a name from
            ``memcheck.training.optimizers.OPTIMIZERS``, a function ``params -> Optimizer`` or
            an Optimizer whose class and settings are reused), ``steps`` (at least 2),
            ``accumulate``, ``checkpointing`` (``none``, ``full`` or module names) with
            ``use_reentrant``, ``strategy`` over ``gpus`` (``batch`` is one GPU's
            micro-batch, except under ``dp``/``dp-balanced``, where it is the batch
            DataParallel scatters), ``bucket_view``/``bucket_cap_mb`` (ddp), ``offload``
            (fsdp / zero), ``eval_accumulate_predictions``; ``batch_size``, ``max_len`` and
            ``target_len`` label the report. See ``memcheck.job.SPELLINGS``.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss`` for
            dicts, otherwise the output summed.
        eval_batch: a batch for an evaluation pass after training (no autograd, same
            precision); the peak is the larger of training's and evaluation's.
        model_name: the name the report uses (default: the model's class).
        top_modules: how many modules the report lists (the identical copies of a repeated
            block, all listed, count as one).
        progress: called with a short line as the trace enters each phase (the CLI's
            stderr progress on a terminal).
        timeline: also keep the busiest GPU's memory event by event as ``Estimate.timeline``
            (a ``memcheck.report.timeline.Timeline``), for ``write_snapshot`` and ``plot_timeline``,
            with each allocation's Python stack (``memcheck.trace.stacks``; a few percent of the trace).
        train_step: the user's own ``train_step(model, batch, optimizer)``, traced as it is
            instead of memcheck's loop (``loss_fn`` is then unused): its order of ``zero_grad``,
            clipping, several losses. Its own ``torch.autocast`` regions are emulated (the
            report then says amp-bf16/amp-fp16), so ``precision`` must be ``fp32`` or pure
            ``bf16``/``fp16``, and ``accumulate`` 1.

    Returns:
        An ``Estimate``; ``str()`` is the table, ``to_dict()`` the JSON, ``.job`` the job traced.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT2LMHeadModel(GPT2Config())
        ...     ids = torch.zeros(8, 1024, dtype=torch.long)
        >>> est = memcheck.estimate(model, {"input_ids": ids, "labels": ids}, memcheck.Job(device="cpu"))
        >>> est.peak_bytes

    Known limitations:
        The CUDA target is emulated on meta tensors: SDPA's kernel choice, autocast's
        casts, the caching allocator and cuBLAS's workspaces follow torch's source,
        but the CUDA context is an estimate per GPU model, and a cuDNN convolution's
        workspace is an allowance. Python functions that handle ``__torch_function__``
        hide the ops inside them from the autocast emulation (see memcheck.rules.autocast).
    """
    job = as_job(job, settings, caller="estimate()")
    eager = compat.eager_module(model)
    target = _validate(eager, batch, job, eval_batch, top_modules)  # first: it refuses a model nested too deep
    notes = compiled_note(compat.compiled_parts(model, loss_fn=loss_fn, train_step=train_step))
    model, loss_fn, train_step = eager, compat.eager_function(loss_fn), compat.eager_function(train_step)
    _check_train_step(train_step, job)
    name = model_name or type(model).__name__
    kwargs = dict(loss_fn=loss_fn, eval_batch=eval_batch, top_modules=top_modules, progress=progress,
                  timeline=timeline, train_step=train_step, notes=notes)
    with compat.eager_stance():
        if job.layout is None:
            return _estimate_rank(model, batch, job, target, name, None, **kwargs)
        _check_layout(job, train_step, eval_batch)
        traced = roles(job.layout, job.tp_plan)
        return _merge_roles([_estimate_rank(model, batch, job, target, name, role, **kwargs) for role in traced],
                            traced)


def compiled_note(parts: list[str]) -> tuple[str, ...]:
    """The report's line for a ``torch.compile``'d step (``compat.compiled_parts``): traced eagerly."""
    if not parts:
        return ()
    return (f"torch.compile: {', '.join(parts)} compiled; traced eagerly, as the uncompiled step runs "
            f"({COMPILED_EVIDENCE})",)


# What benchmarks/compiled.py measured (results/compiled-*.md): TorchInductor's compiled step against
# the eager one, real CPU runs of 7 models, torch 2.13; the eager trace is not a bound either way.
COMPILED_EVIDENCE = "a compiled step measured 33% below to 12% above the eager one on real CPU runs"


def _estimate_rank(model, batch, job: Job, target: GpuSpec | None, name: str, role: Role | None, *,
                   loss_fn, eval_batch, top_modules, progress, timeline, train_step, notes=()) -> Estimate:
    """``estimate()`` of one rank: every GPU of a strategy, or one pipeline rank of a layout."""
    if role is not None:
        train_step = role.train_step(job)
        if role.layout.cp > 1 and NO_PADDING not in job.assume:  # torch's context_parallel takes no mask
            job = job.replace(assume=(*job.assume, NO_PADDING))  # (_check_layout refused a pinned padding)

    def traced(choices: Choices, forward_only: bool = False) -> tuple[_Run, list[int] | None]:
        run = _set_up(model, batch, eval_batch, job, target, name, progress, choices, role)
        if train_step is not None and role is None:
            run.tracer.assume(f"the training step is the model's own {getattr(train_step, '__name__', 'train_step')}"
                              "(model, batch, optimizer), traced as it is")
        for note in notes:
            run.tracer.assume(note)
        run.tracer.stop_at_backward = forward_only
        run.tracer.record_stacks = timeline  # the snapshot's frames
        try:
            return run, _trace(run, job, target, loss_fn or default_loss, name, train_step)
        except ForwardDone:
            return run, None

    run, gpu_map = traced(Choices(job.assume))
    (run, gpu_map, devices), branches = _branches(run, gpu_map, traced, job, target, name, top_modules)
    job = _with_step_precision(run, job)
    taken = job if branches is None else job.replace(assume=tuple(sorted(
        set(job.assume) | set(branches.taken), key=ANSWERS.index)))  # shorter traces take the same branch
    shorter = _shorter_traces(model, batch, taken, target, loss_fn or default_loss, name, run.tracer.assume,
                              train_step, role)
    if devices is None or shorter is not None:
        devices = _summarise(run, gpu_map, job, target, name, top_modules, shorter)
    return _result(run, gpu_map, devices, job, target, name, timeline, branches)


def _check_layout(job: Job, train_step, eval_batch) -> None:
    """What a layout cannot be combined with (yet)."""
    if train_step is not None:
        raise SettingError("layout", "{name} traces each rank's own step (its pipeline schedule); a train_step "
                                     "of your own is not combined with a layout yet")
    if job.layout.cp > 1 and PADDING in job.assume:
        raise SettingError("assume", "{name} padding (an attention mask) does not combine with cp: torch's "
                                     "context_parallel takes causal attention with no mask")
    if eval_batch is not None and (job.layout.pp > 1 or job.layout.cp > 1):
        raise SettingError("layout", "{name}: an evaluation pass under pipeline or context parallelism is not modelled; "
                                     "leave out the eval batch")


def _merge_roles(ranks: list[Estimate], traced: list[Role]) -> Estimate:
    """One Estimate of a layout: a column per traced pipeline rank (every rank alike without pp)."""
    devices = tuple(dataclasses.replace(e.busiest, index=i, role=role.label)
                    for i, (e, role) in enumerate(zip(ranks, traced)))
    busiest = max(devices, key=lambda d: (d.total_bytes, -d.index))
    first = ranks[busiest.index]
    assumptions = list(dict.fromkeys(a for e in ranks for a in e.assumptions))
    return dataclasses.replace(first, job=ranks[0].job, devices=devices, busiest_gpu=busiest.index,
                               assumptions=tuple(assumptions))


def _branches(run: _Run, gpu_map: list[int], traced: Callable, job: Job, target: GpuSpec | None,
              name: str, top_modules: int) -> tuple[tuple[_Run, list[int], list | None], Branches | None]:
    """The trace whose data-dependent answers give the larger peak (``memcheck.choices``).

    The first trace answers every choice point with its first answer and notes the points
    whose answer decided something; the whole step is then traced again with each other
    combination of answers at those points (the job's pinned ones stay). An unpadded batch is
    first traced to the end of its first forward only, and not further when that is bounded
    by the first trace (``_bounded_by``). The trace with the largest device total (peak on
    the CPU) wins; ties keep the first. Returns the winner's run, GPU map and summaries."""
    others = run.tracer.choices.alternatives()
    if not others:
        return (run, gpu_map, None), None
    first = run.tracer.choices
    names = list(first.consulted)
    start = time.perf_counter()
    candidates, bounded = [(run, gpu_map)], []
    for answers in others:
        if _only_padding_differs(first, answers) and first.in_forwards_only(PADDING):
            prefix, done = traced(Choices(job.assume, forced=answers), forward_only=True)
            if done is None and _bounded_by(run.tracer.log, prefix.tracer.log):
                bounded.append(answers)
                continue
        candidates.append(traced(Choices(job.assume, forced=answers)))
        names += [n for n in candidates[-1][0].tracer.choices.consulted if n not in names]
    seconds = time.perf_counter() - start
    totals, summaries = [], []
    for r, g in candidates:
        devices = _summarise(r, g, _with_step_precision(r, job), target, name, top_modules)
        busiest = max(devices, key=lambda d: d.total_bytes)
        totals.append((busiest.total_bytes, busiest.peak_bytes))
        summaries.append(devices)
    best = max(range(len(candidates)), key=lambda i: (totals[i][0], -i))
    mine = candidates[best][0].tracer.log.assumptions
    traces = []
    for i, (r, _) in enumerate(candidates):
        own = tuple(a for a in r.tracer.log.assumptions if a not in mine) if i != best else tuple(
            a for a in mine if len(candidates) > 1
            and all(a not in c[0].tracer.log.assumptions for j, c in enumerate(candidates) if j != best))
        answers = r.tracer.choices.taken(names)
        traces.append(Branch(answers=tuple(a for a in answers if a not in job.assume), total_bytes=totals[i][0],
                             peak_bytes=totals[i][1], only_here=own))
    for answers in bounded:  # traced to the end of step 1's forward only
        traces.append(Branch(answers=tuple(a for a in answers if a not in job.assume), total_bytes=None,
                             peak_bytes=None, only_here=(), bounded=True))
    winner = traces[best]
    branches = Branches(taken=winner.answers, traces=(winner, *traces[:best], *traces[best + 1:]),
                        seconds=round(seconds, 3))
    return (*candidates[best], summaries[best]), branches


def _only_padding_differs(first: Choices, answers: tuple[str, ...]) -> bool:
    """Whether the alternative ``answers`` change only the ``padding`` point, to ``no-padding``."""
    changed = [a for a in answers if a != first.answer(point_of(a).name)]
    return changed == [NO_PADDING]


def _forward_prefix(log: TraceLog) -> list[tuple]:
    """The events of step 1 before its backward begins: the setup and the first forward and loss."""
    out = []
    for ev in log.events:
        if ev[6] > 0 or ev[5] in (Phase.BACKWARD, Phase.OPTIMIZER, Phase.ZERO_GRAD, Phase.EVAL):
            break
        out.append(ev)
    return out


def _bounded_by(base: TraceLog, alt: TraceLog) -> bool:
    """Whether the trace ``alt`` (stopped where step 1's backward begins) is bounded by ``base``
    over the whole step: its first forward made no assumption ``base`` did not (the same
    kernels), allocated a subsequence of ``base``'s allocations (same size, module and GPU,
    in order: the same ops, some skipped, as an unpadded batch skips its attention mask),
    and ends it with no more live bytes, per category and in all, than ``base`` held at the
    same point, never peaking above ``base``'s forward peak. The backward then runs the
    same kernels over no more saved tensors."""
    if any(a not in base.assumptions for a in alt.assumptions):
        return False
    mine, theirs = _forward_prefix(base), _forward_prefix(alt)
    if not mine or len(theirs) != len(alt.events):
        return False
    allocs = iter((ev[2], ev[4], ev[7]) for ev in mine if ev[0] == ALLOC)
    if not all(any(sig == other for other in allocs) for sig in ((ev[2], ev[4], ev[7]) for ev in theirs
                                                                 if ev[0] == ALLOC)):
        return False
    (base_live, base_peak), (alt_live, alt_peak) = _live_by_category(mine), _live_by_category(theirs)
    return alt_peak <= base_peak and all(n <= base_live.get(c, 0) for c, n in alt_live.items())


def _live_by_category(events: list[tuple]) -> tuple[dict, int]:
    """The bytes live at the end of ``events`` by category, and the peak of their sum."""
    sizes, cats, live, peak = {}, {}, 0, 0
    for kind, sid, n, cat, *_ in events:
        if kind == ALLOC:
            sizes[sid], cats[sid] = n, cat
            live += n
            peak = max(peak, live)
        elif kind == FREE and sid in sizes:
            live -= sizes.pop(sid)
            cats.pop(sid)
        elif kind == RECAT and sid in cats:
            cats[sid] = cat
    by_cat: dict = defaultdict(int)
    for sid, n in sizes.items():
        by_cat[cats[sid]] += n
    return by_cat, peak


def _validate(model, batch, job: Job, eval_batch, top_modules) -> GpuSpec | None:
    """What the job alone cannot check (the call's other arguments); returns the CUDA target."""
    target = target_gpu(job)
    if isinstance(model, torch.nn.Module):
        check_module_depth(model, type(model).__name__)
    if job.padding is Padding.LONGEST and job.device is Device.CUDA:
        if job.max_len is None:
            raise SettingError("padding", "{name} longest needs max_len, the length the longest batch is padded to")
        if not _at_length(batch, job.max_len, 1)[1]:
            raise SettingError("padding", f"{{name}} longest shortens the batch's dimensions of max_len={job.max_len}, "
                                          "but no tensor of the batch has one")
    if job.packing:
        _check_packed(batch)
    if job.eval_accumulate_predictions and eval_batch is None:
        raise UsageError("eval_accumulate_predictions needs an eval batch (eval_batch= / --eval-batch-size)")
    require_int(top_modules, "top_modules", minimum=0,
                message=f"top_modules must be an integer of 0 or more, got {top_modules!r}")
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return target


def _check_packed(batch) -> None:
    """A packed batch is a dict with ``position_ids`` and no attention mask: transformers reads the
    packed sequences' boundaries from ``position_ids`` only when ``attention_mask`` is None
    (masking_utils.py, ``_preprocess_mask_arguments``), as ``DataCollatorWithFlattening`` gives it."""
    if not isinstance(batch, dict):
        raise SettingError("packing", "{name} needs a dict batch holding input_ids and position_ids (as "
                                      f"DataCollatorWithFlattening gives it), got {escape(type(batch).__name__)}")
    if batch.get("attention_mask") is not None:
        raise SettingError("packing", "{name} needs a batch without attention_mask: with one, transformers ignores "
                                      "the position ids and the packed sequences attend to each other; drop it")
    if not isinstance(batch.get("position_ids"), torch.Tensor):
        raise SettingError("packing", "{name} needs position_ids in the batch, restarting at 0 for each packed "
                                      f"sequence; its keys are {escape(', '.join(map(str, batch)) or 'none')}")


def packing_note(job: Job, info: BatchInfo, model: torch.nn.Module, batch: Any) -> list[str]:
    """The report's lines on a packed batch: its layout, what attention does with it, and a cache
    that would keep transformers from seeing the packing."""
    if not job.packing:
        return []
    ids = next((i for i in info.inputs if i.name == "position_ids"), None)
    tokens = ids.shape[-1] if ids is not None and ids.shape else None
    if job.batch_size and job.max_len and tokens == job.batch_size * job.max_len:
        layout = (f"{job.batch_size} sample slot(s) of {job.max_len} tokens flattened into one row of {tokens} "
                  "(DataCollatorWithFlattening, TRL padding_free)")
    else:
        layout = "the batch's rows hold packed sequences"
    rows, t = (ids.shape[0] if ids is not None and len(ids.shape) == 2 else "B"), tokens or "T"
    head = f"packing: {layout}, position ids restarting at 0 for each sequence, no attention mask"
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):  # not a transformers model: its own code reads the ids
        return [head]
    cache = getattr(config, "use_cache", False)
    if cache and not (isinstance(batch, dict) and batch.get("use_cache") is False):
        return [head + "; the model's config has use_cache=True and the batch does not pass use_cache=False, so "
                "transformers builds a cache and skips its packed-sequence check: the sequences attend across "
                "their boundaries, as traced (the HF Trainer and TRL's SFTTrainer train with use_cache=False)"]
    return [head + f"; transformers' sdpa and eager attention keep the sequences apart with a ({rows}, 1, {t}, {t}) "
            "block-diagonal mask, the trace taking every row as holding two or more sequences (a real row of one "
            "sequence needs no mask); flash_attention_2's varlen kernels, which need none, are not modelled for "
            "transformers models"]


@dataclass
class _Run:
    """What one estimate traces: the meta twin, its batches, the tracer and the optimizer."""

    twin: torch.nn.Module
    wrapped: tuple[str, ...]  # the modules wrapped in torch.utils.checkpoint
    batch: Any
    eval_batch: Any
    info: BatchInfo
    tracer: MemoryTracer
    arch: tuple[int, int]
    optimizer_label: str
    make_optimizer: Callable
    autocast: Any = None
    scaler: Any = None
    weights_dtype: str = "float32"  # the floating dtype of the traced weights (most bytes)
    user_autocast: UserAutocast | None = None  # a train_step's own torch.autocast regions, once traced
    rank_context: Callable | None = None  # a layout rank's context for its steps (cp's ring attention)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The floating dtype holding most of ``model``'s parameter bytes (float32 if none)."""
    by_dtype: dict = defaultdict(int)
    for p in model.parameters():
        if p.is_floating_point():
            by_dtype[p.dtype] += p.numel() * p.element_size()
    return max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def resolve_weights_dtype(model: torch.nn.Module, job: Job) -> tuple[torch.dtype, bool, str]:
    """The dtype of the traced weights, whether the model's weights are cast to it, and a
    line for the report when that is not plain.

    fp32 training casts to float32 and pure bf16/fp16 to that dtype, whatever the model was
    built in; under autocast the weights stay in the model's own dtype (``auto``: what
    ``from_pretrained`` loads by default, config.json's ``dtype`` on transformers 5) unless
    ``weights_dtype`` names one. A contradiction between the two is refused when the Job is made.
    """
    own = model_dtype(model)
    precision, asked = job.precision, job.weights_dtype.torch_dtype
    if precision is Precision.FP32:
        target = torch.float32
    elif precision.weights_dtype is not None:
        target = precision.weights_dtype
    else:
        target = asked or own
    if target == own:
        if precision.autocast_dtype is not None and job.weights_dtype.value == "auto" and own != torch.float32:
            return own, False, (f"{precision.value} over the model's own {_dtype_name(own)} weights (weights_dtype "
                                "auto, as from_pretrained loads config.json's dtype); give weights_dtype fp32 for "
                                "fp32 master weights")
        return own, False, ""
    return target, True, (f"weights cast from the model's {_dtype_name(own)} to {_dtype_name(target)} for "
                          f"{precision.value}" + ("" if precision.autocast_dtype is None
                                                  else f" (weights_dtype {job.weights_dtype.value})"))


def _set_up(model, batch, eval_batch, job: Job, target: GpuSpec | None, name: str, progress,
            choices: Choices | None = None, role: Role | None = None) -> _Run:
    """The meta twin (checkpointed, cast; cut to one rank's share under a layout), the meta
    batches, the optimizer and the tracer."""
    device, precision = job.device, job.precision
    opt_label, make_optimizer = resolve_optimizer(job.optimizer, device)
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"{name} has no trainable parameters (none with requires_grad=True); nothing to train")
    twin = meta_twin(model)
    weights, cast, how = resolve_weights_dtype(model, job)
    if cast:
        twin = twin.to(weights)
    if job.qlora:  # 4-bit linear layers, then a twin of those: bitsandbytes' quantized sizes (twin_memo)
        twin = meta_twin(quantize_4bit(twin))
    twin, adapted = apply_adapters(twin, job.lora, job.qlora, job.recipe)  # LoRA / QLoRA over the cast base
    wrapped = apply_checkpointing(twin, job.checkpointing, use_reentrant=job.use_reentrant)
    rank_context = None
    if role is not None:  # what one rank of the layout holds: its experts, shards, stage and tokens
        twin, batch, noted, rank_context = role.view(twin, meta_batch(batch), job.device.value)
        adapted = [*adapted, *noted]
    dtype = precision.weights_dtype  # pure bf16/fp16: float inputs in that dtype too

    def prepare(b):
        return to_precision(meta_batch(b), dtype)

    mbatch = prepare(batch)
    ebatch = prepare(eval_batch) if eval_batch is not None else None
    info = describe_batch(mbatch, job.batch_size, job.max_len, job.target_len)

    arch = target.arch if target is not None else DEFAULT_ARCH
    tracer = MemoryTracer(device, arch=arch, choices=choices if choices is not None else Choices(job.assume))
    if progress is not None:
        tracer.on_phase = lambda step, phase: progress(
            f"tracing {name}: " + ("evaluation" if phase is Phase.EVAL
                                   else f"step {step + 1} of {job.steps}, {phase.value}"))
    for key, value in local_library_versions().items():  # the CUDA/cuDNN this torch would use
        setattr(tracer, key, value)
    if device is Device.CUDA and target is None:
        tracer.assume(
            f"no GPU named (gpu=/--gpu): kernels chosen as on sm{arch[0]}{arch[1]} and a generic CUDA context"
        )
    if job.qlora:
        # prepare_model_for_kbit_training casts every fp16/bf16 weight but the 4-bit ones to fp32
        # (peft/utils/other.py:204-209), so the model's own dtype is not what trains (apply_adapters' note)
        weights, how = torch.float32, ""
    if how:
        tracer.assume(how)
    for note in packing_note(job, info, model, batch):
        tracer.assume(note)
    for note in adapted:
        tracer.assume(note)
    run = _Run(twin, wrapped, mbatch, ebatch, info, tracer, arch, opt_label, make_optimizer,
               weights_dtype=_dtype_name(weights), rank_context=rank_context)
    if precision.autocast_dtype is not None:
        tracer.autocast = MetaAutocast(device, precision.autocast_dtype)
        run.autocast = tracer.autocast.region
        if precision is Precision.AMP_FP16:
            run.scaler = MetaGradScaler()
            tracer.assume("amp-fp16: a GradScaler scales the loss; no overflow, so every step is taken")
    if job.accumulate > 2 and (role is None or role.layout.pp == 1):
        tracer.assume(f"accumulate={job.accumulate}: 2 micro-steps per step traced; "
                      f"micro-steps 3 to {job.accumulate} repeat the second")
    return run


def _check_train_step(train_step, job: Job) -> None:
    """What a user's own training step cannot be combined with (yet)."""
    if train_step is None:
        return
    if not callable(train_step):
        raise UsageError(f"train_step must be a function train_step(model, batch, optimizer), got {train_step!r}")
    if job.precision.autocast_dtype is not None:
        raise SettingError("precision", f"{{name}} {job.precision.value} is memcheck's autocast around its own "
                                        "loop; with a train_step write torch.autocast in the step (memcheck "
                                        "emulates it) and give fp32 or pure bf16/fp16")
    if job.accumulate != 1:
        raise SettingError("accumulate", "{name} must be 1 with a train_step: the step accumulates as it is written")
    if job.step_order is not StepOrder.HF:
        raise SettingError("step_order", f"{{name}} {job.step_order.value} is the order of memcheck's own loop; a "
                                         "train_step runs in the order it is written: drop {name}")


def _trace(run: _Run, job: Job, target: GpuSpec | None, loss_fn: LossFn, name: str,
           train_step: Callable | None = None) -> list[int]:
    """Run the traced steps under the job's strategy; for each real GPU, the traced GPU it matches."""
    tracer, steps = run.tracer, job.steps

    def evaluate(module):
        tracer.set_phase(steps, Phase.EVAL)  # the eval batch arrives with the evaluation, not in training
        tracer.watch(batch=run.eval_batch)
        run_eval(module, run.eval_batch, loss_fn, tracer.set_phase, step=steps, autocast=run.autocast,
                 keep_batches=job.eval_accumulate_predictions)

    run.user_autocast = UserAutocast(tracer, job.device) if train_step is not None else None
    regions = run.user_autocast.patched() if run.user_autocast is not None else contextlib.nullcontext()
    try:
        # the model's .cuda() and torch.cuda.* never reach the GPU; a train_step's torch.autocast is emulated
        rank = run.rank_context() if run.rank_context is not None else contextlib.nullcontext()
        with redirect_cuda(target), tracer, regions, meta_autocast_queries(tracer, job.device), \
                extensions.tracing(tracer, job.device), rank, rank_threads(job, tracer):
            return train(job.strategy_config, tracer, run.twin, run.batch, loss_fn, run.make_optimizer, steps,
                         autocast=run.autocast, scaler=run.scaler, accumulate=min(job.accumulate, 2),
                         evaluate=evaluate if run.eval_batch is not None else None, train_step=train_step,
                         max_grad_norm=job.max_grad_norm, order=job.step_order)
    except MemcheckError:
        raise
    except Exception as exc:  # the model's own code failed under the trace
        raise _translate(exc, name, job) from exc
    except ForwardDone:  # the tracer's own stop at step 1's backward
        raise
    except BaseException as exc:  # sys.exit(), GeneratorExit, ... from the model's code: never a verdict
        exited = exited_message(exc, f"{where + ': ' if (where := model_frame(exc)) else ''}{name}",
                                " while being traced")
        if exited is None:  # Ctrl-C, the time limit, memcheck's own ForwardDone
            raise
        raise TraceError(exited) from exc


@contextlib.contextmanager
def rank_threads(job: Job, tracer: MemoryTracer):
    """On the CPU target with more than one rank a machine, trace with the intra-op threads each rank
    gets: torchrun sets ``OMP_NUM_THREADS=1`` for every process when it starts more than one a node
    and the variable is unset (torch/distributed/run.py, "Setting OMP_NUM_THREADS environment variable
    for each process to be 1 in default"). The CPU rules read the running thread count: oneDNN's
    convolution buffers, which the probes measure (memcheck.rules.cpu_kernels), are per thread, and so
    are the batch-norm and attention kernels' (Wav2Vec2's grouped positional convolution's backward,
    551,168 B on one thread and 1,108,224 B on two: a DDP job over two CPU ranks read +3.9% of its real
    run, whose ranks ran one thread each). The process's count is restored on exit."""
    per_node = min(job.gpus_per_node or job.world, job.world)
    was = torch.get_num_threads()
    if job.device is not Device.CPU or per_node <= 1 or "OMP_NUM_THREADS" in os.environ or was == 1:
        yield
        return
    tracer.assume(f"CPU target, {per_node} ranks a machine: each runs 1 intra-op thread, as torchrun sets "
                  "OMP_NUM_THREADS=1 when it starts more than one process a node (set OMP_NUM_THREADS to trace "
                  "with another count)")
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def _with_step_precision(run: _Run, job: Job) -> Job:
    """The job as traced: a train_step's own ``torch.autocast`` regions make it amp-bf16/amp-fp16."""
    precision = run.user_autocast.precision(job.precision) if run.user_autocast is not None else job.precision
    if precision is job.precision:
        return job
    run.tracer.assume(f"the train_step's own torch.autocast ({precision.value}) emulated on the target's autocast "
                      "lists; a GradScaler it uses is traced as torch runs it on meta tensors")
    try:
        return job.replace(precision=precision)
    except SettingError:  # e.g. autocast to fp16 over fp16 weights: reported as the job was given
        return job


def _shorter_traces(model, batch, job: Job, target: GpuSpec | None, loss_fn: LossFn, name: str,
                    assume: Callable[[str], None], train_step: Callable | None = None,
                    role: Role | None = None) -> list | None:
    """For ``padding="longest"`` on the CUDA target: the job traced again at a half and a
    quarter of ``max_len`` (every batch dimension of that size shortened), so the allocator
    can replay steps of any length between; with the traced length first. None otherwise."""
    if job.padding is not Padding.LONGEST:
        return None
    if job.device is not Device.CUDA:
        assume("padding=longest changes nothing on the cpu target: its allocator caches no blocks")
        return None
    length = job.max_len
    lengths = [length, -(-length // 2), -(-length // 4)]
    if len(set(lengths)) < 3:
        assume(f"padding=longest: max_len {length} is too short for lengths to vary; traced at {length} only")
        return None
    traces = [(length, None)]
    for short in lengths[1:]:
        shortened, _ = _at_length(batch, length, short)  # _validate checked it has such a dimension
        sub = job.replace(padding=Padding.MAX_LENGTH, max_len=short, eval_batch_size=None, eval_accumulate_predictions=0)
        again = _set_up(model, shortened, None, sub, target, name, None, role=role)
        try:
            _trace(again, sub, target, loss_fn, name, train_step)
        except MemcheckError as exc:  # the batch at max_len traced; only the shortened one fails
            detail = escape(str(exc).splitlines()[0].split(" (fix the model code there")[0].split(
                " (--debug shows the traceback)")[0])
            raise SettingError("padding", (
                f"{{name}} longest traces the batch with its dimensions of {length} cut to {short}, and "
                f"{escape(name)} fails on that batch ({detail}); padding longest is for batches whose sequence "
                "dimension is max_len and nothing else has that size")) from None
        traces.append((short, again.tracer.log))
    return traces


def _at_length(batch: Any, length: int, short: int) -> tuple[Any, bool]:
    """``batch`` with every dimension (after the first) of size ``length`` cut to ``short``;
    a tensor that appears twice (``input_ids`` as ``labels``) stays one tensor."""
    cut_to: dict[int, torch.Tensor] = {}

    def cut(t: torch.Tensor) -> torch.Tensor:
        if length not in t.shape[1:]:
            return t
        if id(t) not in cut_to:
            shape = [short if d and n == length else n for d, n in enumerate(t.shape)]
            cut_to[id(t)] = torch.empty(shape, dtype=t.dtype, device="meta")
        return cut_to[id(t)]

    return tree_map_only(torch.Tensor, cut, batch), bool(cut_to)


def _summarise(run: _Run, gpu_map: list[int], job: Job, target: GpuSpec | None, name: str,
               top_modules: int, shorter: list | None = None) -> list[DeviceMemory]:
    """Each real GPU's memory; ranks that look alike are summarised once."""
    traced_summaries: dict[int, DeviceMemory] = {}
    devices = []
    for index, traced in enumerate(gpu_map):
        if traced not in traced_summaries:
            traced_summaries[traced] = _device_summary(
                run.tracer.log, traced, index, job.device, run.arch, target, root=type(run.twin).__name__,
                name=name, top_modules=top_modules, shorter=shorter, margin=job.effective_margin,
                assume=run.tracer.assume,
            )
        devices.append(dataclasses.replace(traced_summaries[traced], index=index))
    if job.device is Device.CUDA:
        loading = module_loading()
        run.tracer.assume(f"CUDA context for {loading} module loading"
                          + (" (CUDA_MODULE_LOADING=EAGER: the measured eager-minus-lazy difference of "
                             "pytorch#86509 added)" if loading == "eager" else
                             " (torch's default; CUDA_MODULE_LOADING=EAGER adds every library kernel)")
                          + f", {context_source(target)}")
    return devices


def _result(run: _Run, gpu_map: list[int], devices: list[DeviceMemory], job: Job, target: GpuSpec | None,
            name: str, timeline: bool, branches: Branches | None = None) -> Estimate:
    """The busiest GPU's figures (and every GPU's, under a multi-GPU strategy) as an Estimate."""
    busiest = max(devices, key=lambda d: (d.total_bytes, -d.index))
    budget = job.budget_bytes
    if budget is None and target is not None and target.capacity_bytes:
        budget = target.capacity_bytes
    return Estimate(
        model=name, job=job, optimizer=run.optimizer_label, batch=run.info, devices=tuple(devices),
        busiest_gpu=busiest.index, assumptions=tuple(run.tracer.log.assumptions), budget_bytes=budget, gpu=target,
        checkpointing=run.wrapped, work=_work(run.tracer.log, step=job.steps - 1, micro_steps=min(job.accumulate, 2)),
        weights_dtype=run.weights_dtype, module_loading=module_loading() if job.device is Device.CUDA else None,
        context_source=context_source(target) if job.device is Device.CUDA else None,
        timeline=_timeline(run.tracer.log, gpu_map[busiest.index], busiest, job.device, run.arch,
                           root=type(run.twin).__name__) if timeline else None,
        branches=branches,
    )


_MICRO_PHASES = (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD)


def _work(log: TraceLog, *, step: int, micro_steps: int) -> Work:
    """The last traced step's compute on its busiest GPU (by FLOPs), per micro-step."""
    per_gpu: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (s, phase, gpu), (flops, low, kernels) in log.work.items():
        if s != step:
            continue
        if phase in _MICRO_PHASES:
            per_gpu[gpu][0] += flops
            per_gpu[gpu][1] += low
            per_gpu[gpu][2] += kernels
        elif phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD):
            per_gpu[gpu][3] += kernels
    flops, low, kernels, opt = max(per_gpu.values(), default=[0, 0, 0, 0])
    return Work(flops // micro_steps, low // micro_steps, kernels // micro_steps, opt)


DEFAULT_ARCH = (8, 0)  # A100-class, when no GPU is named and none is local


def target_gpu(job: Job) -> GpuSpec | None:
    """The CUDA target's GpuSpec: the job's GPU (a name, a size or a spec, checked by the
    Job, which also refuses one on the CPU target), else the local GPU; None on the CPU."""
    if job.device is not Device.CUDA:
        return None
    return job.gpu if isinstance(job.gpu, GpuSpec) else resolve_gpu(job.gpu)


def _with_workspaces(events: list[tuple], arch, start: int) -> tuple[list[tuple], int]:
    """One GPU's events with cuBLAS's workspaces allocated where a real step first needs
    them, and where event ``start`` (the steady state's first) now is.

    torch keeps one workspace per (cuBLAS handle, stream) in the caching allocator; the
    forward runs on the main thread and backward on autograd's device thread, each
    with its own handle (memcheck.cuda.overhead). The first is allocated at the first
    forward, the second at the first backward; both live to the end.
    """
    by_phase = {Phase.FORWARD: [], Phase.BACKWARD: []}
    for label, nbytes in workspace_allocations(arch):
        by_phase[Phase.BACKWARD if "autograd" in label else Phase.FORWARD].append((label, nbytes))
    out, new_start = [], None
    for i, ev in enumerate(events):
        for label, nbytes in by_phase.pop(ev[5], ()):
            out.append((ALLOC, f"workspace:{label}:{ev[7]}", nbytes, Category.WORKSPACE, f"({label})", ev[5],
                        ev[6], ev[7]))
        if i == start:
            new_start = len(out)
        out.append(ev)
    return out, len(out) if new_start is None else new_start


def _top_modules(rows: list[ModuleMemory], top: int) -> list[ModuleMemory]:
    """The rows of the ``top`` largest groups, a group being the rows of one repeated block that
    hold exactly the same bytes (``model.layers.7.mlp`` beside ``model.layers.3.mlp``,
    ``ModuleMemory.repeat_key``) or a row alone, so the report can show each group whole
    (``memcheck.report.text`` draws a group as one row)."""
    keys: list = []
    for m in rows:
        if m.repeat_key not in keys:
            if len(keys) == top:
                break
            keys.append(m.repeat_key)
    kept = set(keys)
    return [m for m in rows if m.repeat_key in kept]


def _short(module: str | None, root: str) -> str:
    if not module or module == "Global":
        return "(outside modules)"
    if module.startswith("("):
        return module
    if module == root:
        return "(model)"
    return module.split(".", 1)[1] if module.startswith(root + ".") else module


def _device_events(log: TraceLog, traced: int, device: Device, arch) -> tuple[list[tuple], int]:
    """One traced GPU's events (with cuBLAS's workspaces on CUDA), and the index of step 2's first."""
    second = log.step_starts[1] if len(log.step_starts) > 1 else 0
    events, start = [], None
    for i, ev in enumerate(log.events):
        if ev[7] != traced:
            continue
        if start is None and i >= second:
            start = len(events)
        events.append(ev)
    start = len(events) if start is None else start
    if device is Device.CUDA:
        events, start = _with_workspaces(events, arch, start)
    return events, start


def _timeline(log: TraceLog, traced: int, busiest: DeviceMemory, device: Device, arch, *, root: str):
    """The busiest GPU's memory event by event (``estimate(timeline=True)``)."""
    from memcheck.report.timeline import build_timeline

    events, start = _device_events(log, traced, device, arch)
    return build_timeline(events, start, device=device, gpu=busiest.index, context_bytes=busiest.context_bytes,
                          config=AllocatorConfig.from_env(), module_label=lambda m: _short(m, root),
                          stacks=log.stacks)


def _device_summary(log: TraceLog, traced: int, index: int, device: Device, arch, gpu: GpuSpec | None, *,
                    root: str, name: str, top_modules: int, shorter: list | None = None,
                    margin: float = 0.0, assume: Callable[[str], None] = lambda text: None) -> DeviceMemory:
    """The steady-state peak of one traced GPU (or the CPU), what was live at it, and on CUDA
    what the caching allocator reserves and the device shows in use.

    ``shorter``: ``(length, log)`` traces of the same job at shorter lengths, and the
    traced length first, for a run whose batch lengths vary (``padding="longest"``)."""
    events, start = _device_events(log, traced, device, arch)
    eval_start = next((i for i, ev in enumerate(events) if ev[5] is Phase.EVAL), len(events))
    cuda = None
    if device is Device.CUDA:
        sim = _allocator_life(events, start, eval_start, gpu)
        sizes, life, life_events = sim.granted, sim, events
        grown = None if shorter is None else _growing_life(events, start, eval_start, gpu, shorter, traced, arch,
                                                           margin, assume)
        if grown is not None:
            life, life_events = grown
        cuda = (life, life_events, context_bytes(gpu))
    else:
        sizes = [ev[2] for ev in events]

    live = 0
    best = train_best = eval_best = -1
    best_at = 0
    granted: dict = {}
    for i, ev in enumerate(events):
        kind = ev[0]
        if kind == ALLOC:
            granted[ev[1]] = sizes[i]
            live += sizes[i]
            if i >= start:
                if i < eval_start:
                    train_best = max(train_best, live)
                else:
                    eval_best = max(eval_best, live)
                if live > best:
                    best, best_at = live, i
        elif kind == FREE:
            live -= granted.pop(ev[1], ev[2])
    if best < 0:
        raise TraceError(f"tracing {name} recorded no memory after step 1")

    # Replay up to the peak to see what was live and why.
    # Categories set just after the peak's allocation (a buffer created, then registered)
    # belong to it too, so the replay runs on through those RECAT events.
    end = best_at + 1
    while end < len(events) and events[end][0] == RECAT:
        end += 1
    state: dict = {}
    for i, ev in enumerate(events[:end]):
        kind, sid, n, cat, module = ev[:5]
        if kind == ALLOC:
            state[sid] = [sizes[i], cat, module]
        elif kind == FREE:
            state.pop(sid, None)
        elif sid in state:
            state[sid][1] = cat
            if module is not None:
                state[sid][2] = module
    by_cat: dict[Category, int] = defaultdict(int)
    by_mod: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # state, not state, saved for backward
    for n, cat, module in state.values():
        by_cat[cat] += n
        row = by_mod[_short(module, root)]
        row[0 if cat in _STATE else 1] += n
        if cat is Category.ACTIVATION:
            row[2] += n
    modules = _top_modules(
        sorted((ModuleMemory(m, st, act, saved) for m, (st, act, saved) in by_mod.items()), key=lambda m: -m.total),
        top_modules)
    peak_event = events[best_at]
    return DeviceMemory(
        index=index, peak_bytes=best, breakdown_at_peak=Breakdown.from_categories(by_cat),
        peak_phase=peak_event[5], peak_module=_short(peak_event[4], root), peak_step=peak_event[6] + 1,
        modules=tuple(modules), train_peak_bytes=max(train_best, 0),
        eval_peak_bytes=eval_best if eval_best >= 0 else None, **_device_totals(best, cuda),
    )


def _allocator_life(events: list, start: int, eval_start: int, gpu: GpuSpec | None):
    """The caching allocator over the process's life: the setup (weights, batch), the traced
    steps, the last step replayed until the allocator's layout repeats, then the evaluation,
    on the GPU beside its context (``_replayed``)."""
    room = None if gpu is None else gpu.capacity_bytes - context_bytes(gpu)
    return _replayed(events, (start, eval_start), room)[0]


def _replayed(events: list, repeat: tuple[int, int], room: int | None):
    """``simulate`` with ``repeat``, first with unbounded memory, as the allocator behaves while
    nothing fails; then, when that reserves more than ``room``, again at ``room``: a real
    run's ``cudaMalloc`` fails there and the allocator gives cached segments back and retries
    (``CUDACachingAllocator.cpp``, ``release_cached_blocks``). Returns the run's figures (the
    bounded replay's when it completes) and the unbounded reserved peak."""
    config = AllocatorConfig.from_env()
    sim = simulate(events, config=config, repeat=repeat)
    if room is None or sim.peak_reserved_bytes <= room or sim.peak_allocated_bytes > room:
        return sim, sim.peak_reserved_bytes  # it fits without giving anything back, or nothing can make it fit
    bounded = simulate(events, config=config, capacity=room, repeat=repeat)
    return (sim if bounded.first_oom is not None else bounded), sim.peak_reserved_bytes


GROWING_STEPS = 16  # a padding="longest" run: steps from max_len / 16 up to max_len


def growing_lengths(max_len: int, steps: int = GROWING_STEPS) -> list[int]:
    """The batch lengths of a run whose batches grow to ``max_len`` in ``steps`` even steps."""
    return sorted({max(1, max_len * i // steps) for i in range(1, steps + 1)})


def _lagrange(points: list[tuple[int, int]], x: int) -> int:
    """The quadratic (or lower) through ``points`` at ``x``, rounded up to whole bytes."""
    from fractions import Fraction

    total = Fraction(0)
    for j, (xj, yj) in enumerate(points):
        term = Fraction(yj)
        for k, (xk, _) in enumerate(points):
            if k != j:
                term *= Fraction(x - xk, xj - xk)
        total += term
    return max(0, -(-total.numerator // total.denominator))


def _signature(ev: tuple) -> tuple:
    """What must agree for two traces' events to be the same op's: kind, category, phase, step,
    and for an allocation its module."""
    return ev[0], ev[3], ev[5], ev[6], ev[4] if ev[0] == ALLOC else None


def _aligned(base: list, other: list) -> list | None:
    """For each event of ``base`` (the max_len trace), the index of the same event in ``other``
    (a shorter trace), or None where only ``base`` has it (a kernel that takes another
    algorithm above a size: CUDA's embedding backward sorts above 3,072 indices); None when
    ``other`` has events ``base`` lacks. Matched in order: an event of ``base`` that does not
    match ``other``'s next is taken as one only ``base`` has."""
    pairs, j = [], 0
    for ev in base:
        if j < len(other) and _signature(other[j]) == _signature(ev):
            pairs.append(j)
            j += 1
        else:
            pairs.append(None)
    return pairs if j == len(other) else None


def _growing_life(events: list, start: int, eval_start: int, gpu: GpuSpec | None, shorter: list, traced: int,
                  arch, margin: float, assume: Callable[[str], None]):
    """The caching allocator over a run whose batches grow to the traced length (issue 22).

    Its steps are replayed at ``growing_lengths``; an allocation's size at a length no trace
    had is the quadratic through its sizes in the three traces (exact for sizes linear or
    quadratic in the length, as activations and attention scores are). Lengths that grow
    leave cached segments too small for the next step: the cache fills until the allocator
    must give segments back, so the run is replayed on the GPU less the margin, and its
    figures are those of a GPU that keeps the margin free. Falls back to the steady
    max-length life (with a note) when the traces differ op for op."""
    (length, _), *others = shorter
    base = events[:eval_start]
    points = []  # (length, its trace's index of each max_len event, or None, and its events)
    partial = False
    for l, log in others:
        evs, _ = _device_events(log, traced, Device.CUDA, arch)
        pairs = _aligned(base, evs)
        if pairs is None:
            assume(f"padding=longest: the traces at {length} and {l} tokens differ op for op, so the run of "
                   f"growing lengths was not replayed; reserved is that of steps at {length} tokens")
            return None
        partial |= None in pairs
        points.append((l, pairs, evs))
    lengths = growing_lengths(length)

    def sizes_at(l: int) -> list[int]:
        sizes = [ev[2] for ev in base]
        if l == length:
            return sizes
        known = next(((pairs, evs) for x, pairs, evs in points if x == l), None)
        for n in range(len(base)):
            if known is not None:
                pairs, evs = known
                if pairs[n] is not None:
                    sizes[n] = evs[pairs[n]][2]
            elif all(pairs[n] is not None for _, pairs, _ in points):
                sizes[n] = _lagrange([(length, sizes[n])] + [(x, evs[pairs[n]][2]) for x, pairs, evs in points], l)
        return sizes

    run, last = growing_run(events, start, eval_start, sizes_at, lengths)
    run += [(*ev[:6], len(lengths), *ev[7:]) for ev in events[eval_start:]]  # the evaluation, after training
    room = None if gpu is None else limit_bytes(gpu.capacity_bytes, margin) - context_bytes(gpu)
    sim, grown = _replayed(run, (last, last + eval_start - start), room)
    traced_lengths = ", ".join(str(x) for x in [length] + [p[0] for p in points])
    note = (f"padding=longest: the caching allocator replayed {len(lengths)} steps of lengths growing from "
            f"{lengths[0]} to {length} tokens (sizes between the traced {traced_lengths} "
            f"interpolated per allocation), then {length} until it settled"
            + (f"; buffers only the {length}-token trace has (a kernel that switches algorithm with the "
               f"size, such as CUDA's sorting embedding backward) are replayed at their {length}-token size "
               "at every length" if partial else ""))
    if sim.peak_reserved_bytes < grown:  # the bounded replay completed
        note += (f"; unbounded its cache would grow to {format_bytes(grown)}, so it was "
                 f"replayed on the {gpu.name} less the {margin:.0%} margin, where it gives cached segments "
                 "back and completes")
    assume(note)
    return sim, run


def _device_totals(allocated_peak: int, cuda) -> dict:
    if cuda is None:
        return {}
    sim, events, context = cuda
    reserved = max(sim.peak_reserved_bytes, allocated_peak)
    at = events[sim.reserved_peak_event] if sim.reserved_peak_event is not None else None
    last_step = max((ev[6] for ev in events if ev[5] is not Phase.EVAL), default=0) + 1  # 1-based
    return {
        # What the cache holds beyond the allocated peak: blocks too fragmented, or in the
        # wrong pool, to serve the peak's requests, so new segments had to be reserved.
        "reserved_bytes": reserved, "fragmentation_bytes": reserved - allocated_peak, "context_bytes": context,
        "device_total_bytes": reserved + context,
        "reserved_peak_phase": None if at is None else at[5],
        "reserved_peak_step": None if at is None else at[6] + 1 + sim.reserved_peak_repeat,
        "steady_step": None if sim.steady_repeats is None else last_step + sim.steady_repeats - 1,
        "released_cached": sim.released,
    }
