"""``estimate()``: trace training steps on the meta device and report the peak."""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from memcheck.allocator import AllocatorConfig, simulate
from memcheck.autocast import MetaAutocast, MetaGradScaler
from memcheck.cuda_overhead import context_bytes, workspace_allocations
from memcheck.enums import Category, Device, Phase, Precision
from memcheck.errors import MemcheckError, TraceError, UnsupportedOpError, UsageError
from memcheck.gpus import GpuSpec, local_library_versions, resolve_gpu
from memcheck.optimizers import resolve_optimizer
from memcheck.report import BatchInfo, Breakdown, Estimate, InputSpec, ModuleMemory
from memcheck.tracer import ALLOC, FREE, MemoryTracer, TraceLog
from memcheck.training_loop import LossFn, default_loss, run_steps

_STATE = (Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER)


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
    gpu: str | GpuSpec | None = None,
) -> Estimate:
    """Trace ``steps`` training steps of ``model`` on ``batch`` and return the steady-state peak.

    Nothing is allocated for real: the model and batch are traced as meta tensors
    (a meta twin is made of a real model, without copying its weights; the
    caller's model is never modified).

    Args:
        model: the model, on the meta device or any other.
        batch: what ``loss_fn`` takes: a dict for ``model(**batch)``, a tensor or a tuple.
        device: the target, ``"cpu"`` or ``"cuda"``.
        optimizer: a name from ``memcheck.optimizers.OPTIMIZERS`` (``adamw``, ``adamw-fused``,
            ``adafactor``, ``adamw-8bit``, ``sgd-momentum``, ...), a function
            ``params -> Optimizer`` or an Optimizer whose class and settings are reused.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss`` for
            dicts, otherwise the output summed.
        precision: ``fp32``; pure ``bf16``/``fp16`` weights; or ``amp-bf16``/``amp-fp16``, fp32
            weights under ``torch.autocast`` (amp-fp16 with a GradScaler).
        steps: training steps to trace (at least 2: the first has no optimizer state).
        budget_bytes: if given, ``Estimate.fits`` compares it with the device total on CUDA
            (the peak on CPU); by default the named GPU's capacity.
        gpu: the CUDA target: a name from ``memcheck.gpus.GPUS`` (``"H100-80GB"``), a size
            (``"24GiB"``) or a ``GpuSpec``; by default the local GPU, if any. Its compute
            capability picks attention kernels and cuBLAS workspace sizes.

    Returns:
        An ``Estimate``; ``str()`` is the table, ``to_dict()`` the JSON.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT2LMHeadModel(GPT2Config())
        ...     ids = torch.zeros(8, 1024, dtype=torch.long)
        >>> est = memcheck.estimate(model, {"input_ids": ids, "labels": ids}, device="cpu")
        >>> est.peak_bytes

    Known limitations:
        The CUDA target is emulated on meta tensors: SDPA's kernel choice, autocast's
        casts, the caching allocator and cuBLAS's workspaces follow torch's source,
        but the CUDA context is an estimate per GPU model, and a cuDNN convolution's
        workspace is an allowance. Python functions that handle ``__torch_function__``
        hide the ops inside them from the autocast emulation (see memcheck.autocast).
    """
    device = Device.parse(device)
    precision = Precision.parse(precision)
    target_gpu = _target_gpu(gpu, device)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise UsageError(f"steps must be an integer of at least 2 (step 1 has no optimizer state), got {steps!r}")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise UsageError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
    if budget_bytes is None and target_gpu is not None and target_gpu.capacity_bytes:
        budget_bytes = target_gpu.capacity_bytes
    name = model_name or type(model).__name__
    opt_label, make_optimizer = resolve_optimizer(optimizer, device)
    loss_fn = loss_fn or default_loss

    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"{name} has no trainable parameters (none with requires_grad=True); nothing to train")
    twin = meta_twin(model)
    mbatch = meta_batch(batch)
    dtype = precision.weights_dtype
    if dtype is not None:
        twin = twin.to(dtype)
        mbatch = tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, mbatch
        )
    info = describe_batch(mbatch, batch_size, max_len, target_len)

    arch = target_gpu.arch if target_gpu is not None else DEFAULT_ARCH
    tracer = MemoryTracer(device, arch=arch)
    for key, value in local_library_versions().items():  # the CUDA/cuDNN this torch would use
        setattr(tracer, key, value)
    if device is Device.CUDA and target_gpu is None:
        tracer.assume(
            f"no GPU named (gpu=/--gpu): kernels chosen as on sm{arch[0]}{arch[1]} and a generic CUDA context"
        )
    autocast = scaler = None
    if precision.autocast_dtype is not None:
        tracer.autocast = MetaAutocast(device, precision.autocast_dtype)
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
    cuda = _on_cuda(tracer.log, arch, target_gpu, tracer.assume) if device is Device.CUDA else {}
    return _summarise(
        tracer.log, name=name, root=type(twin).__name__, device=device, precision=precision, optimizer=opt_label,
        steps=steps, batch=info, budget_bytes=budget_bytes, top_modules=top_modules, **cuda,
    )


DEFAULT_ARCH = (8, 0)  # A100-class, when no GPU is named and none is local


def _target_gpu(gpu, device: Device) -> GpuSpec | None:
    if isinstance(gpu, GpuSpec):
        return gpu
    if gpu is not None and not isinstance(gpu, str):
        raise UsageError(f"gpu must be a name such as 'H100-80GB', a size such as '24GiB', or a GpuSpec; got {gpu!r}")
    if device is not Device.CUDA:
        if gpu is not None:
            raise UsageError(f"gpu={gpu!r} applies to the cuda target only; the target is {device.value}")
        return None
    return resolve_gpu(gpu)


def _with_workspaces(log: TraceLog, arch) -> tuple[list[tuple], list[int]]:
    """The event log with cuBLAS's workspaces allocated where a real step first needs them.

    torch keeps one workspace per (cuBLAS handle, stream) in the caching allocator; the
    forward runs on the main thread and backward on autograd's device thread, each
    with its own handle (memcheck.cuda_overhead). The first is allocated at the first
    forward, the second at the first backward; both live to the end.
    """
    by_phase = {Phase.FORWARD: [], Phase.BACKWARD: []}
    for label, nbytes in workspace_allocations(arch):
        by_phase[Phase.BACKWARD if "autograd" in label else Phase.FORWARD].append((label, nbytes))
    events, old_starts, start_of = [], set(log.step_starts), {}
    for i, ev in enumerate(log.events):
        if i in old_starts:
            start_of[i] = len(events)
        for label, nbytes in by_phase.pop(ev[5], ()):
            events.append((ALLOC, f"workspace:{label}", nbytes, Category.WORKSPACE, f"({label})", ev[5], ev[6]))
        events.append(ev)
    starts = [start_of.get(i, len(events)) for i in log.step_starts]
    return events, starts


def _on_cuda(log: TraceLog, arch, gpu: GpuSpec | None, assume) -> dict:
    """Replay the trace through the caching-allocator simulation and add what lies outside it."""
    events, starts = _with_workspaces(log, arch)
    log.events[:], log.step_starts[:] = events, starts
    sim = simulate(events, config=AllocatorConfig.from_env())
    assume("CUDA context size is an estimate per GPU model, not yet measured on this GPU")
    return {"sizes": sim.granted, "cuda": (sim.peak_reserved_bytes, context_bytes(gpu), gpu)}


def _short(module: str | None, root: str) -> str:
    if not module or module == "Global":
        return "(outside modules)"
    if module.startswith("("):
        return module
    if module == root:
        return "(model)"
    return module.split(".", 1)[1] if module.startswith(root + ".") else module


def _summarise(
    log: TraceLog, *, name, root, device, precision, optimizer, steps, batch, budget_bytes, top_modules,
    sizes=None, cuda=None,
) -> Estimate:
    """The steady-state peak and what was live at it.

    ``sizes`` gives each ALLOC event's bytes as the allocator grants them (CUDA: rounded
    blocks, what ``max_memory_allocated`` counts); by default the storages' own sizes.
    """
    events = log.events
    if sizes is None:
        sizes = [ev[2] for ev in events]
    start = log.step_starts[1] if len(log.step_starts) > 1 else 0
    live = 0
    best, best_at = -1, 0
    granted: dict = {}
    for i, ev in enumerate(events):
        kind = ev[0]
        if kind == ALLOC:
            granted[ev[1]] = sizes[i]
            live += sizes[i]
            if i >= start and live > best:
                best, best_at = live, i
        elif kind == FREE:
            live -= granted.pop(ev[1], ev[2])
    if best < 0:
        raise TraceError(f"tracing {name} recorded no memory after step 1")

    # Replay up to the peak to see what was live and why.
    state: dict[int, list] = {}
    for i, ev in enumerate(events[: best_at + 1]):
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
        **_device_totals(best, cuda),
    )


def _device_totals(allocated_peak: int, cuda) -> dict:
    if cuda is None:
        return {}
    reserved, context, gpu = cuda
    reserved = max(reserved, allocated_peak)
    return {
        # What the cache holds beyond the allocated peak: blocks too fragmented, or in the
        # wrong pool, to serve the peak's requests, so new segments had to be reserved.
        "reserved_bytes": reserved, "fragmentation_bytes": reserved - allocated_peak, "context_bytes": context,
        "device_total_bytes": reserved + context, "gpu": gpu,
    }
