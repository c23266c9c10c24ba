"""``estimate()``: trace training steps on the meta device and report the peak."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable

import torch

from memcheck import compat
from memcheck.compat import tree_map_only
from memcheck.choices import ANSWERS, NO_PADDING, PADDING, Choices
from memcheck.cuda.gpus import GpuSpec, resolve_gpu
from memcheck.engine.branches import traced_branches
from memcheck.engine.setup import TracedRun, check_packed, rank_threads, set_up, with_step_precision
from memcheck.engine.summary import result, summarise
from memcheck.enums import Device, Padding, Phase, Precision, StepOrder, Strategy
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
from memcheck.job import Job, SettingError, as_job, escape
from memcheck.report.results import Estimate
from memcheck.rules import extensions
from memcheck.rules.autocast import UserAutocast, meta_autocast_queries
from memcheck.trace.device_redirect import reads_meta_data, redirect_cuda, tracing_globals
from memcheck.trace import compiled as compiled_trace
from memcheck.trace.compiled import CompiledForward
from memcheck.trace.tracer import ForwardDone
from memcheck.training.loop import LossFn, default_loss, run_eval
from memcheck.training.strategies import train
from memcheck.training.strategies.layout import Role, roles


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
    parts = compat.compiled_parts(model, loss_fn=loss_fn, train_step=train_step)
    # torch.compile(model): its step is traced as compiled where it can be, once that is switched on
    # (memcheck.trace.compiled.TRACE_AS_COMPILED: off until it is closer to real compiled runs in every case)
    compiled_model = eager is not model and compiled_trace.TRACE_AS_COMPILED
    model, loss_fn, train_step = eager, compat.eager_function(loss_fn), compat.eager_function(train_step)
    _check_train_step(train_step, job)
    name = model_name or type(model).__name__
    kwargs = dict(loss_fn=loss_fn, eval_batch=eval_batch, top_modules=top_modules, progress=progress,
                  timeline=timeline, train_step=train_step)
    refusal = compiled_refusal(job, parts, train_step, eval_batch) if compiled_model else None
    if compiled_model and refusal is None:
        try:
            with compat.eager_stance():  # a compiled helper of the user's (loss) runs eagerly; the model's
                return _estimate_rank(model, batch, job, target, name, None, compiled=True, **kwargs)
        except Exception as exc:  # graph breaks it cannot replay, dynamic shapes, an op it cannot partition
            refusal = f"the compiled trace failed ({type(exc).__name__}: {_first_line(exc)})"
    kwargs["notes"] = compiled_note(parts, refusal)
    with compat.eager_stance():
        if job.layout is None:
            return _estimate_rank(model, batch, job, target, name, None, **kwargs)
        _check_layout(job, train_step, eval_batch)
        traced = roles(job.layout, job.tp_plan)
        return _merge_roles([_estimate_rank(model, batch, job, target, name, role, **kwargs) for role in traced],
                            traced)


def compiled_note(parts: list[str], why: str | None = None) -> tuple[str, ...]:
    """The report's line for a ``torch.compile``'d step (``compat.compiled_parts``) traced eagerly,
    and ``why`` it was not traced as compiled (the model alone is: ``compiled_refusal``)."""
    if not parts:
        return ()
    return (f"torch.compile: {', '.join(parts)} compiled; traced eagerly, as the uncompiled step runs"
            f"{'; ' + why if why else ''} ({COMPILED_EVIDENCE})",)


def compiled_refusal(job: Job, parts: list[str], train_step, eval_batch) -> str | None:
    """Why a ``torch.compile``'d model's step is not traced as compiled (None: it is). The compiled
    trace (``memcheck.trace.compiled``) is checked against real compiled CPU runs
    (benchmarks/compiled.py) only for the plain single-device fp32 step on the CPU."""
    if len(parts) > 1:
        return "more than the model is compiled"
    checks = (
        (job.device is not Device.CPU, "the compiled trace is for the cpu target only"),
        (job.precision not in (None, Precision.FP32), f"the compiled trace is for fp32 only, not {job.precision}"),
        (job.checkpointing not in (None, "none", ()), "the compiled trace does not combine with checkpointing"),
        (job.lora is not None or job.qlora, "the compiled trace does not combine with adapters"),
        (job.strategy is not Strategy.SINGLE or job.layout is not None,
         "the compiled trace is for a single device"),
        (train_step is not None, "the compiled trace runs memcheck's own loop, not a train_step"),
        (eval_batch is not None, "the compiled trace has no evaluation pass"),
    )
    return next((why for bad, why in checks if bad), None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return escape(text[0][:160]) if text else ""


def compiled_trace_note(forward: CompiledForward) -> str:
    """The report's line for a model traced as compiled."""
    fused = ("pointwise values inductor fuses not counted" if forward.fused
             else "every value of the graphs counted, inductor's fusion not modelled")
    again = ", compiled again at step 2 as TorchDynamo's guards asked" if forward.recompiled else ""
    return (f"torch.compile: the model (torch.compile(model)) compiled; traced as compiled (AOTAutograd "
            f"partition): the forward captured by TorchDynamo as one graph{again}, split into forward and "
            f"backward by the min-cut partition TorchInductor uses, convolutions channels-last as inductor "
            f"lays them out on the CPU; {fused}")


# What benchmarks/compiled.py measured (results/compiled-*.md): TorchInductor's compiled step against
# the eager one, real CPU runs of 7 models, torch 2.13; the eager trace is not a bound either way.
COMPILED_EVIDENCE = "a compiled step measured 33% below to 12% above the eager one on real CPU runs"


def _estimate_rank(model, batch, job: Job, target: GpuSpec | None, name: str, role: Role | None, *,
                   loss_fn, eval_batch, top_modules, progress, timeline, train_step, notes=(),
                   compiled: bool = False) -> Estimate:
    """``estimate()`` of one rank: every GPU of a strategy, or one pipeline rank of a layout."""
    if role is not None:
        train_step = role.train_step(job)
        if role.layout.cp > 1 and NO_PADDING not in job.assume:  # torch's context_parallel takes no mask
            job = job.replace(assume=(*job.assume, NO_PADDING))  # (_check_layout refused a pinned padding)

    def traced(choices: Choices, forward_only: bool = False) -> tuple[TracedRun, list[int] | None]:
        run = set_up(model, batch, eval_batch, job, target, name, progress, choices, role)
        forward = CompiledForward(run.twin).install(run.tracer) if compiled else None
        if train_step is not None and role is None:
            run.tracer.assume(f"the training step is the model's own {getattr(train_step, '__name__', 'train_step')}"
                              "(model, batch, optimizer), traced as it is")
        for note in notes:
            run.tracer.assume(note)
        run.tracer.stop_at_backward = forward_only
        run.tracer.record_stacks = timeline  # the snapshot's frames
        try:
            gpu_map = _trace(run, job, target, loss_fn or default_loss, name, train_step)
        except ForwardDone:
            gpu_map = None
        if forward is not None:
            forward.check()  # one graph, or the eager trace (graph breaks run eager code between graphs)
            run.tracer.assume(compiled_trace_note(forward))
        return run, gpu_map

    run, gpu_map = traced(Choices(job.assume))
    (run, gpu_map, devices), branches = traced_branches(run, gpu_map, traced, job, target, name, top_modules)
    job = with_step_precision(run, job)
    taken = job if branches is None else job.replace(assume=tuple(sorted(
        set(job.assume) | set(branches.taken), key=ANSWERS.index)))  # shorter traces take the same branch
    shorter = _shorter_traces(model, batch, taken, target, loss_fn or default_loss, name, run.tracer.assume,
                              train_step, role)
    if devices is None or shorter is not None:
        devices = summarise(run, gpu_map, job, target, name, top_modules, shorter)
    return result(run, gpu_map, devices, job, target, name, timeline, branches)


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
        check_packed(batch)
    if job.eval_accumulate_predictions and eval_batch is None:
        raise UsageError("eval_accumulate_predictions needs an eval batch (eval_batch= / --eval-batch-size)")
    require_int(top_modules, "top_modules", minimum=0,
                message=f"top_modules must be an integer of 0 or more, got {top_modules!r}")
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return target


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


def _trace(run: TracedRun, job: Job, target: GpuSpec | None, loss_fn: LossFn, name: str,
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
                extensions.tracing(tracer, job.device), rank, \
                rank_threads(min(job.gpus_per_node or job.world, job.world), job.device, tracer):
            return train(job.strategy_config, tracer, run.twin, run.batch, loss_fn, run.make_optimizer, steps,
                         autocast=run.autocast, scaler=run.scaler, accumulate=min(job.accumulate, 2),
                         evaluate=evaluate if run.eval_batch is not None else None, train_step=train_step,
                         loop=job.loop)
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
        again = set_up(model, shortened, None, sub, target, name, None, role=role)
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


def target_gpu(job: Job) -> GpuSpec | None:
    """The CUDA target's GpuSpec: the job's GPU (a name, a size or a spec, checked by the
    Job, which also refuses one on the CPU target), else the local GPU; None on the CPU."""
    if job.device is not Device.CUDA:
        return None
    return job.gpu if isinstance(job.gpu, GpuSpec) else resolve_gpu(job.gpu)


