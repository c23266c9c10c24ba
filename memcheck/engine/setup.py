"""What one estimate traces, set up: the meta twin of the model (cast, quantized, with its
adapters and checkpointing; cut to one rank's share under a layout), the meta batches, the
optimizer and the tracer (``set_up`` -> ``TracedRun``), and the batch and dtype facts the
report states. ``memcheck.engine.estimate`` and ``memcheck run`` (``engine/script.py``) share it.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from memcheck import compat
from memcheck.choices import Choices
from memcheck.compat import tree_flatten, tree_map_only
from memcheck.cuda.gpus import GpuSpec, local_library_versions
from memcheck.enums import Device, Phase, Precision
from memcheck.errors import UsageError
from memcheck.job import Job, SettingError, escape
from memcheck.report.results import BatchInfo, InputSpec
from memcheck.rules import extensions
from memcheck.rules.autocast import MetaAutocast, MetaGradScaler, UserAutocast
from memcheck.trace.tracer import MemoryTracer
from memcheck.training.adapters import apply_adapters, quantize_4bit
from memcheck.training.checkpointing import apply_checkpointing
from memcheck.training.loop import to_precision
from memcheck.training.optimizers import resolve_optimizer
from memcheck.training.strategies.layout import Role


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


def check_packed(batch) -> None:
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
class TracedRun:
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


def dtype_name(dtype: torch.dtype) -> str:
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
            return own, False, (f"{precision.value} over the model's own {dtype_name(own)} weights (weights_dtype "
                                "auto, as from_pretrained loads config.json's dtype); give weights_dtype fp32 for "
                                "fp32 master weights")
        return own, False, ""
    return target, True, (f"weights cast from the model's {dtype_name(own)} to {dtype_name(target)} for "
                          f"{precision.value}" + ("" if precision.autocast_dtype is None
                                                  else f" (weights_dtype {job.weights_dtype.value})"))


def set_up(model, batch, eval_batch, job: Job, target: GpuSpec | None, name: str, progress,
            choices: Choices | None = None, role: Role | None = None) -> TracedRun:
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
    sharded = job.sharded_qlora
    if sharded:  # the FSDP/ZeRO-3 QLoRA recipe: loaded in the storage dtype (torch_dtype=bnb_4bit_quant_storage)
        weights = job.weights_dtype.torch_dtype or torch.bfloat16
        twin = twin.to(weights)
    if job.qlora:  # 4-bit linear layers, then a twin of those: bitsandbytes' quantized sizes (twin_memo)
        twin = meta_twin(quantize_4bit(twin, quant_storage=weights if sharded else torch.uint8))
    twin, adapted = apply_adapters(twin, job.lora, job.qlora, job.recipe, sharded=sharded)  # over the cast base
    wrapped = apply_checkpointing(twin, job.checkpointing, use_reentrant=job.use_reentrant)
    rank_context = None
    if role is not None:  # what one rank of the layout holds: its experts, shards, stage and tokens
        twin, batch, noted, rank_context = role.view(twin, meta_batch(batch), job.device.value)
        adapted = [*adapted, *noted]
    dtype = precision.weights_dtype  # pure bf16/fp16: float inputs in that dtype too
    if sharded and dtype is None and precision.autocast_dtype is None:
        # the sharded QLoRA model is all in its storage dtype; without autocast its float inputs (pixels, audio)
        # must be too, or its first convolution refuses them ("Input type (float) and bias type (BFloat16)")
        dtype = weights

    def prepare(b):
        return to_precision(meta_batch(b), dtype)

    mbatch = prepare(batch)
    ebatch = prepare(eval_batch) if eval_batch is not None else None
    info = describe_batch(mbatch, job.batch_size, job.max_len, job.target_len)

    arch = target.arch if target is not None else DEFAULT_ARCH
    tracer = MemoryTracer(device, arch=arch, choices=choices if choices is not None else Choices(job.assume))
    tracer.cudnn_benchmark = job.cudnn_benchmark  # read by the cuDNN convolution rule (rules/cuda_conv.py)
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
    if sharded:  # the storage dtype trains (apply_adapters' note)
        how = "" if dtype is None or dtype == precision.weights_dtype else (
            f"sharded QLoRA without autocast: float inputs cast to the weights' {dtype_name(weights)}")
    elif job.qlora:
        # prepare_model_for_kbit_training casts every fp16/bf16 weight but the 4-bit ones to fp32
        # (peft/utils/other.py:204-209), so the model's own dtype is not what trains (apply_adapters' note)
        weights, how = torch.float32, ""
    if how:
        tracer.assume(how)
    for note in packing_note(job, info, model, batch):
        tracer.assume(note)
    for note in adapted:
        tracer.assume(note)
    run = TracedRun(twin, wrapped, mbatch, ebatch, info, tracer, arch, opt_label, make_optimizer,
               weights_dtype=dtype_name(weights), rank_context=rank_context)
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


DEFAULT_ARCH = (8, 0)  # A100-class, when no GPU is named and none is local


def with_step_precision(run: TracedRun, job: Job) -> Job:
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


@contextlib.contextmanager
def rank_threads(per_node: int, device: Device, tracer):
    """On the CPU target with more than one rank a machine, trace with the intra-op threads each rank
    gets: torchrun sets ``OMP_NUM_THREADS=1`` for every process when it starts more than one a node
    and the variable is unset (torch/distributed/run.py, "Setting OMP_NUM_THREADS environment variable
    for each process to be 1 in default"). The CPU rules read the running thread count: oneDNN's
    convolution buffers, which the probes measure (memcheck.rules.cpu_kernels), are per thread, and so
    are the batch-norm and attention kernels' (Wav2Vec2's grouped positional convolution's backward,
    551,168 B on one thread and 1,108,224 B on two: a DDP job over two CPU ranks read +3.9% of its real
    run, whose ranks ran one thread each). ``per_node``: the ranks a machine (a strategy's, or the launcher's
    under ``memcheck run``). The process's count is restored on exit."""
    was = torch.get_num_threads()
    if device is not Device.CPU or per_node <= 1 or "OMP_NUM_THREADS" in os.environ or was == 1:
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
