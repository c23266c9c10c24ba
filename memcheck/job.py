"""One value for every setting of a training job: ``Job``, validated once, and its spellings.

Every front-end builds a ``Job``: the CLI from its flags, ``memcheck check`` from config
keys, the Python API from keyword arguments, the trainer callbacks from the trainer's
arguments, and ``plan()`` hands back the ``Job`` it recommends. ``SPELLINGS`` is the one
table of how each field is written in each of those places (and in the JSON), with the
names Hugging Face's ``TrainingArguments`` and Lightning's ``Trainer`` use for the same
thing, accepted as aliases where they mean exactly the same value.

Example:
    >>> job = Job(batch_size=8, max_len=1024, precision="amp-bf16", gpu="A100-80GB")
    >>> job.precision
    <Precision.AMP_BF16: 'amp-bf16'>
    >>> Job.from_settings({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4}).accumulate
    4
    >>> memcheck.estimate(model, batch, job)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from memcheck.choices import parse_assume
from memcheck.cuda.gpus import GpuSpec, resolve_gpu
from memcheck.enums import (Attention, Device, Dtype, FsdpSharding, Offload, Padding, Precision, StepOrder, Strategy, Task,
                            WeightsDtype)
from memcheck.errors import UsageError, closest
from memcheck.training.adapters import Lora, qlora_recipe
from memcheck.training.checkpointing import parse_checkpointing
from memcheck.training.optimizers import OPTIMIZERS, hf_optimizer
from memcheck.training.strategies import StrategyConfig
from memcheck.training.strategies.base import MixedPrecision
from memcheck.training.strategies.layout import Layout
from memcheck.units import MAX_BYTES, parse_size, short_repr

# The fraction of the capacity a plan, a check and the callbacks hold back by default. Derived
# from the published GPU runs (benchmarks/published/, README "Against published GPU measurements"):
# where the allocated peak is within 1% (16 runs: Qwen3-0.6B on RTX 4090s, torch 2.14), the
# reserved peak is within -0.3% to +1.7%; 5% covers that spread with room for the stacks not yet
# measured. On the CPU target the fp32 zoo is within 0.21% of the profiler's measured peak.
DEFAULT_MARGIN = 0.05


def limit_bytes(capacity_bytes: int, margin: float) -> int:
    """The one verdict rule's limit: the capacity less the margin, ``capacity * (1 - margin)``
    rounded down to a byte. estimate, check, plan, preflight and the callbacks all judge a
    job's total against it (``memcheck.report.results.Judgement``)."""
    return int(capacity_bytes * (1 - margin))


# The JSON's version: 2 since the settings moved into one "job" object (issue 15).
SCHEMA_VERSION = 2

# Upper bounds of the counts a user types, checked here so that no overflow or endless loop reaches
# torch, the tracer or the allocator simulation (issue 20).
# A micro-batch (or eval batch) of at most 2**24 rows and lengths of at most 2**24 tokens: far above
# any real job (the longest context windows are ~2**23 tokens), and a batch of 2**24 x 2**24 tokens
# still has an int64 numel; a tensor too large all the same is named by the trace (TraceError).
MAX_BATCH = 2**24
MAX_LEN = 2**24
# The peak is the steady state reached at step 2 (step 1 has no optimizer state); every further
# step is one more trace of the whole model (about 0.6 s for GPT-2 small on 2 cores, tens of seconds
# for a 7B model), so 100 steps bound a run while leaving room to watch a slow drift.
MAX_STEPS = 100
# As memcheck.engine.plan.MAX_GPUS: 65,536 GPUs, above the largest training clusters (~2**15 to
# 2**17 GPUs are spread over data-parallel groups of far fewer); a sharded rank's share of 1 byte
# per GPU still has a meaning there.
MAX_GPUS = 65536
# Samples per optimizer step over all GPUs: 2**24, far above the largest published global batches
# (LAMB's 65,536 for BERT); the planner factors it (trial division up to its square root).
MAX_GLOBAL_BATCH = 2**24
# ddp's bucket_cap_mb: 2**20 MiB (1 TiB), above any GPU's memory, so every bucket fits in DDP's
# int64 byte count (it multiplies by 2**20).
MAX_BUCKET_CAP_MB = 2**20
# DeepSpeed ZeRO buffer sizes (reduce_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters), in
# elements: 2**40 (2 TiB of bf16), above any GPU's memory, so the bucket's byte count stays far inside int64.
MAX_ZERO_ELEMENTS = 2**40
# Eval batches whose predictions stay on the device: 2**16 (an eval set of 65,536 batches); the trace
# concatenates N - 1 copies of one batch's predictions, which takes time in proportion to N.
MAX_EVAL_KEPT = 2**16


@dataclass(frozen=True)
class Spelling:
    """How one ``Job`` field is written in each place a user writes it."""

    field: str  # the Job field and the Python keyword of estimate(), plan(), check(), preflight()
    flag: str | None  # the CLI flag (None: not a flag)
    config: str | None  # the key in a memcheck config (None: not a config key)
    json: str  # the key in the JSON's "job" object
    aliases: tuple[str, ...] = ()  # HF TrainingArguments / Lightning names for exactly this value

    def name(self, vocabulary: str) -> str:
        """This field's name in ``vocabulary``: "python", "flag", "config" or "json"."""
        if vocabulary == "python":
            return self.field
        return getattr(self, vocabulary) or self.field


# One row a field, in the order the docs list them.
SPELLINGS: tuple[Spelling, ...] = (
    Spelling("device", "--device", "device", "device"),
    Spelling("gpu", "--gpu", "gpu", "gpu"),
    Spelling("budget_bytes", "--gpu-memory", "gpu_memory", "budget_bytes"),
    Spelling("batch_size", "--batch-size", "micro_batch", "micro_batch_size",
             aliases=("per_device_train_batch_size",)),  # HF TrainingArguments
    Spelling("max_len", "--max-len", "max_len", "max_len", aliases=("max_seq_length",)),  # TRL's SFTConfig
    Spelling("target_len", "--target-len", "target_len", "target_len"),
    Spelling("padding", "--padding", "padding", "padding"),
    Spelling("packing", "--packing", "packing", "packing"),  # TRL's SFTConfig name too (padding_free: VALUE_ALIASES)
    Spelling("precision", "--precision", "precision", "precision"),
    Spelling("weights_dtype", "--weights-dtype", "weights_dtype", "weights_dtype"),
    Spelling("optimizer", "--optimizer", "optimizer", "optimizer"),
    Spelling("steps", "--steps", None, "steps"),
    Spelling("accumulate", "--accumulate", "accumulation", "accumulation_steps",
             aliases=("gradient_accumulation_steps", "accumulate_grad_batches")),  # HF, Lightning
    Spelling("checkpointing", "--checkpointing", "checkpointing", "checkpointing"),
    Spelling("use_reentrant", "--reentrant", "reentrant", "use_reentrant"),
    Spelling("lora", "--lora", "lora", "lora"),
    Spelling("qlora", "--qlora", "qlora", "qlora"),
    Spelling("max_grad_norm", "--max-grad-norm", "max_grad_norm", "max_grad_norm",
             aliases=("gradient_clip_val",)),  # HF TrainingArguments' own name; Lightning's Trainer
    Spelling("step_order", "--step-order", "step_order", "step_order"),  # no trainer names it: the callbacks set it
    Spelling("strategy", "--strategy", "strategy", "strategy"),
    Spelling("gpus", "--gpus", "gpus", "gpus"),
    Spelling("bucket_view", "--bucket-view", "bucket_view", "bucket_view",
             aliases=("gradient_as_bucket_view",)),  # DistributedDataParallel's keyword
    Spelling("bucket_cap_mb", "--bucket-cap-mb", "bucket_cap_mb", "bucket_cap_mb"),
    Spelling("offload", "--offload", "offload", "offload"),
    # DeepSpeed ZeRO's buffers, in elements, under DeepSpeed's own names (zero_optimization's keys)
    Spelling("reduce_bucket_size", "--reduce-bucket-size", "reduce_bucket_size", "reduce_bucket_size"),
    Spelling("prefetch_bucket_size", "--prefetch-bucket-size", "prefetch_bucket_size", "prefetch_bucket_size",
             aliases=("stage3_prefetch_bucket_size",)),
    Spelling("max_live_parameters", "--max-live-parameters", "max_live_parameters", "max_live_parameters",
             aliases=("stage3_max_live_parameters",)),
    Spelling("layout", "--layout", "layout", "layout"),
    Spelling("tp_plan", "--tp-plan", "tp_plan", "tp_plan"),
    Spelling("fsdp_sharding", "--fsdp-sharding", "fsdp_sharding", "fsdp_sharding"),
    Spelling("gpus_per_node", "--gpus-per-node", "gpus_per_node", "gpus_per_node"),
    # FSDP2's MixedPrecisionPolicy under its own field names (also Accelerate's mixed_precision_policy keys and
    # FSDP1's MixedPrecision, which Lightning's FSDPStrategy takes); torchtitan's [training] keys as aliases
    Spelling("param_dtype", "--param-dtype", "param_dtype", "param_dtype", aliases=("mixed_precision_param",)),
    Spelling("reduce_dtype", "--reduce-dtype", "reduce_dtype", "reduce_dtype", aliases=("mixed_precision_reduce",)),
    Spelling("output_dtype", "--output-dtype", "output_dtype", "output_dtype"),
    Spelling("cast_forward_inputs", "--cast-forward-inputs", "cast_forward_inputs", "cast_forward_inputs"),
    Spelling("eval_batch_size", "--eval-batch-size", "eval_batch", "eval_batch_size",
             aliases=("per_device_eval_batch_size",)),  # HF TrainingArguments
    Spelling("eval_accumulate_predictions", "--eval-accumulate-predictions", "eval_accumulate_predictions",
             "eval_accumulate_predictions"),
    Spelling("margin", "--margin", "margin", "margin"),
    Spelling("global_batch", "--global-batch", "global_batch", "global_batch"),
    Spelling("task", "--task", "task", "task"),
    Spelling("attn", "--attn", "attn", "attn", aliases=("attn_implementation",)),  # transformers
    Spelling("assume", "--assume", "assume", "assume"),
    Spelling("trust_remote_code", "--trust-remote-code", "trust_remote_code", "trust_remote_code"),  # transformers
)
SPELLING = {s.field: s for s in SPELLINGS}


def _hf_flag(value: str):
    def to(v):
        if not isinstance(v, bool):
            raise UsageError(f"{{name}} must be true or false, got {v!r}")
        return value if v else None  # bf16=False says nothing about the precision

    return to


# TrainingArguments names whose values mean a Job field's value once translated: optim's names
# (adamw_torch_fused -> adamw-fused), bf16=True / fp16=True (the Trainer's autocast),
# activation_checkpointing=True or gradient_checkpointing=True (every repeated block), TRL's padding_free=True
# (packing). Accepted in configs and the Python API.
VALUE_ALIASES: dict[str, tuple[str, Any]] = {
    "optim": ("optimizer", hf_optimizer),
    "bf16": ("precision", _hf_flag("amp-bf16")),
    "fp16": ("precision", _hf_flag("amp-fp16")),
    "activation_checkpointing": ("checkpointing", _hf_flag("full")),  # False says nothing: none is the default
    "gradient_checkpointing": ("checkpointing", _hf_flag("full")),  # transformers 5's deprecated alias of the above
    # TRL's SFTConfig: padding_free=True flattens each batch into one row with position ids, as packing
    # does (packing=True with the default "bfd" strategy turns padding_free on: sft_trainer.py, "BFD packing
    # requires padding-free mode"); its worst case, every sample max_len tokens, is packing's. False says nothing.
    "padding_free": ("packing", _hf_flag(True)),
}


def translate_alias(key: str, value) -> tuple[str, Any] | None:
    """``(field, value)`` for a ``VALUE_ALIASES`` key, or None when the value says nothing
    (``bf16=False``); UsageError naming ``key`` for a value it cannot mean."""
    field, translate = VALUE_ALIASES[key]
    try:
        out = translate(value)
    except UsageError as exc:
        raise UsageError(str(exc).replace("{name}", key)) from None
    return None if out is None else (field, out)


class SettingError(UsageError):
    """A job setting is invalid; the message names it in the words of whoever wrote it."""

    def __init__(self, field: str, template: str):
        self.field, self.template = field, template  # the template names the field as {name}
        super().__init__(template.format(name=field))

    def worded(self, vocabulary: str) -> str:
        """The message with the field named as ``vocabulary`` ("python", "flag", "config") spells it."""
        return self.template.format(name=SPELLING[self.field].name(vocabulary))


def escape(text: str) -> str:
    """``text`` safe inside a ``SettingError`` template (its braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def _int(field: str, value, *, minimum: int = 1, optional: bool = True, text: str | None = None,
         maximum: int | None = None, why: str = ""):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingError(field, (text or "{name} must be a positive integer") + f", got {escape(short_repr(value))}")
    if maximum is not None and value > maximum:
        raise SettingError(field, f"{{name}} must be at most {maximum:,}{escape(why)}, got {escape(short_repr(value))}")
    return value


def _flag(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise SettingError(field, f"{{name}} must be true or false, got {escape(repr(value))}")
    return value


def _choice(field: str, cls, value, *, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, cls):
        return value
    if not isinstance(value, str):
        allowed = ", ".join(m.value for m in cls)
        raise SettingError(field, f"{{name}} must be a string, one of: {allowed}; got {escape(repr(value))}")
    try:
        return cls.parse(value, what=field)
    except UsageError as exc:  # "unknown precision 'bf61' (did you mean ...); allowed: ..."
        raise SettingError(field, escape(str(exc))) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """Every setting of one training job, checked once here; ``SPELLINGS`` names each field
    in the CLI, configs, the Python API and the JSON.

    Values are normalised (strings to enums, module lists to tuples, sizes to bytes); the
    settings that need the model or the machine (the local GPU, module names, the
    model's position limit) are resolved when the job is traced.
    """

    device: Device = Device.CUDA
    """The target: ``cuda`` (default) or ``cpu``. Tracing always runs on the meta device."""
    gpu: str | GpuSpec | None = None
    """The CUDA target: a name (``H100-80GB``), a size (``24GiB``) or a GpuSpec; None: the local GPU, if any."""
    budget_bytes: int | None = None
    """A memory budget in bytes (or a size such as ``"24GiB"``); by default the GPU's capacity."""
    batch_size: int | None = None
    """The micro-batch per GPU and step (the batch's own first dimension when None)."""
    max_len: int | None = None
    """Every sequence padded to this length: the worst case."""
    target_len: int | None = None
    """The label length of seq2seq models."""
    padding: Padding = Padding.MAX_LENGTH
    """``max_length``: every batch padded to ``max_len``; ``longest`` (``padding=True``): each batch
    to its longest sample, so on the CUDA target the allocator replays a run whose lengths grow
    to ``max_len``. The peak is ``max_len``'s either way."""
    packing: bool = False
    """Packed, padding-free batches (transformers' ``DataCollatorWithFlattening``, TRL's ``packing`` /
    ``padding_free``): each of ``batch_size`` sample slots is ``max_len`` tokens of packed sequences, all
    flattened into one row of ``batch_size * max_len`` tokens with position ids restarting at 0 for each
    sequence and no attention mask. Causal language models only."""
    precision: Precision | None = None
    """``fp32``; ``amp-bf16``/``amp-fp16`` (torch.autocast); pure ``bf16``/``fp16`` weights. None (unset):
    ``fp32``, or for a ``qlora`` job the QLoRA recipe's ``amp-bf16`` where the GPU has bf16
    (``memcheck.training.adapters.qlora_recipe``); the job always holds the resolved value."""
    weights_dtype: WeightsDtype = WeightsDtype.AUTO
    """The weights' dtype: ``auto`` follows the precision (fp32 weights for ``fp32``, bf16/fp16 for
    pure ``bf16``/``fp16``) and, under autocast, the model's own dtype (``from_pretrained``'s default:
    config.json's ``dtype``); or ``fp32``/``bf16``/``fp16`` for autocast over weights of that dtype."""
    optimizer: Any = "adamw"
    """A name from ``memcheck.training.optimizers.OPTIMIZERS``, a factory ``params -> Optimizer`` or an Optimizer."""
    steps: int = 2
    """Training steps to trace; the peak is taken from step 2 on (step 1 has no optimizer state)."""
    accumulate: int = 1
    """Gradient accumulation steps; the peak is the steady-state micro-step's."""
    checkpointing: str | tuple[str, ...] | None = None
    """``none``, ``full`` (every repeated block) or module names/patterns. None (unset): ``none``, or
    for a ``qlora`` job the recipe's ``full`` (PEFT's ``prepare_model_for_kbit_training`` turns it on);
    the job always holds the resolved value."""
    use_reentrant: bool = False
    """torch.utils.checkpoint's implementation."""
    lora: Lora | None = None
    """LoRA adapters set up by PEFT (``"r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05"``, ``all-linear``
    targets, ``dora=true``; True: PEFT's defaults), the base frozen; None: full fine-tuning."""
    qlora: bool = False
    """The QLoRA recipe: linear layers in 4-bit NF4 (bitsandbytes), ``prepare_model_for_kbit_training``,
    and ``lora`` (PEFT's defaults when None)."""
    max_grad_norm: float | None = None
    """Gradient clipping before each optimizer step (``clip_grad_norm_``); None or 0: none. For
    ``hf:`` models the installed Trainer's default (1.0)."""
    step_order: StepOrder = StepOrder.HF
    """Where a step zeroes the gradients, named after the loop that does it (``StepOrder``): ``hf``
    (the default, memcheck's own loop: forward, backward, clip, step, zero_grad), ``accelerate``
    (the same), ``plain`` (zero_grad first) or ``lightning`` (zero_grad between the forward and the
    backward, so the previous step's gradients are alive through the forward; the Lightning callback
    sets it). A ``train_step`` runs in its own order."""
    strategy: Strategy = Strategy.SINGLE
    """``single``, ``dp``, ``dp-balanced``, ``ddp``, ``fsdp`` (FSDP2), ``fsdp1``, ``zero1``, ``zero2``, ``zero3``."""
    gpus: int | None = None
    """GPUs of a multi-GPU strategy (None: 2 for those, 1 for single)."""
    bucket_view: bool = False
    """ddp: ``gradient_as_bucket_view``."""
    bucket_cap_mb: float | None = None
    """ddp: ``bucket_cap_mb`` (None: DDP's default, 25)."""
    offload: Offload = Offload.NONE
    """fsdp / fsdp1 / zero: ``optimizer`` or ``params`` moved to CPU memory."""
    reduce_bucket_size: int | None = None
    """zero1-3: DeepSpeed's ``reduce_bucket_size``, the IPG gradient bucket in elements (None: DeepSpeed's 5e8)."""
    prefetch_bucket_size: int | None = None
    """zero3: DeepSpeed's ``stage3_prefetch_bucket_size``, parameters gathered ahead, in elements (None: 5e7;
    0: no prefetch)."""
    max_live_parameters: int | None = None
    """zero3: DeepSpeed's ``stage3_max_live_parameters``, the gathered parameters above which nothing more is
    prefetched, in elements (None: 1e9)."""
    layout: Layout | None = None
    """Several kinds of parallelism at once (``"dp=8,tp=4,pp=2"``, see
    ``memcheck.training.strategies.layout``): ``strategy`` then runs over the layout's ``dp * cp``
    ranks (``fsdp`` when not given), ``gpus`` is the whole world, and under ``pp`` ``accumulate``
    is the pipeline's micro-batches per step. None: one kind, ``strategy`` over ``gpus``."""
    tp_plan: tuple[tuple[str, str], ...] | None = None
    """The layout's tensor-parallel plan, ``{module glob: style}`` with transformers' style names
    (``colwise``, ``rowwise``, ``colwise_gather_output``, ``embedding_rowwise``, ...;
    ``"layers.*.attn.q_proj=colwise,..."`` on the command line); None: the model's own plan as
    transformers applies it (``tp_plan="auto"``)."""
    fsdp_sharding: FsdpSharding | None = None
    """fsdp1: ``full_shard`` (None: torch's default), ``shard_grad_op``, ``no_shard`` or ``hybrid_shard``.
    HF ``TrainingArguments.fsdp`` is not an alias: it is a list of options (``"full_shard offload
    auto_wrap"``); the transformers integration reads it."""
    gpus_per_node: int | None = None
    """fsdp1 ``hybrid_shard``: GPUs per node, the group a rank shards over (None: every GPU on one node)."""
    param_dtype: Dtype | None = None
    """fsdp: ``MixedPrecisionPolicy.param_dtype``, the dtype FSDP2 all-gathers the parameters in and so
    the forward and backward compute in (``bf16``: torchtitan's default, ``mixed_precision_param``); the
    shards and the optimizer keep the weights' own dtype. None: no cast."""
    reduce_dtype: Dtype | None = None
    """fsdp: ``MixedPrecisionPolicy.reduce_dtype``, the gradients' reduce-scatter dtype (``fp32``:
    torchtitan's ``mixed_precision_reduce``). None: the gradients' own (``param_dtype``'s)."""
    output_dtype: Dtype | None = None
    """fsdp: ``MixedPrecisionPolicy.output_dtype``, each ``fully_shard`` module's floating outputs cast to it.
    None: no cast."""
    cast_forward_inputs: bool | None = None
    """fsdp: ``MixedPrecisionPolicy.cast_forward_inputs``, each ``fully_shard`` module's floating inputs cast
    to ``param_dtype``; None: the wrapper's default (FSDP2's True)."""
    eval_batch_size: int | None = None
    """Also trace an evaluation pass at this batch size."""
    eval_accumulate_predictions: int = 0
    """Evaluation batches whose predictions stay on the device."""
    margin: float | None = None
    """The fraction of the capacity held back by plan and check (None: ``DEFAULT_MARGIN``)."""
    global_batch: int | None = None
    """plan: samples per optimizer step over all GPUs."""
    task: Task | None = None
    """transformers models: what the model is trained for (decides the worst-case batch)."""
    attn: Attention | None = None
    """transformers models: the attention implementation."""
    assume: tuple[str, ...] = ()
    """Pinned answers at the data-dependent choice points (``memcheck.choices``): ``padding`` or
    ``no-padding``, ``routing=worst`` or ``routing=balanced`` (``"no-padding,routing=balanced"``).
    (): every answer a real batch can give is traced and the larger peak reported."""
    trust_remote_code: bool = False
    """``hf:`` models: let transformers run the Python files a config.json's ``auto_map`` names
    (``trust_remote_code=True``); False: a config that needs them is refused, and transformers
    is never left to ask on stdin. ``memcheck check`` accepts it only for code inside the
    config's own repository."""

    defaulted: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False, repr=False)
    """Not a setting: the ``(field, value)`` pairs filled in because the job left them unset
    (``_fill_defaults``: fp32 and none, or the QLoRA recipe's), so that a copy with another
    ``qlora``, GPU or device chooses them again and the report can say which the recipe chose
    (``recipe``); set by the job itself."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name in _CHECKS:
                object.__setattr__(self, f.name, _CHECKS[f.name](getattr(self, f.name)))
        self._fill_defaults()
        if self.device is Device.CPU and self.gpu is not None:
            raise SettingError("gpu", f"gpu={self.gpu!r} applies to the cuda target only; the target is cpu "
                                      "(give the budget as --gpu-memory)")
        _check_weights(self.precision, self.weights_dtype)
        _check_packing(self.packing, self.padding, self.task, self.strategy)
        config = self.strategy_config  # strategy, gpus, buckets and offload, checked together
        _check_adapters(self.lora, self.qlora, config.strategy)
        if self.layout is not None and self.layout.pp > 1 and self.step_order in (StepOrder.PLAIN, StepOrder.LIGHTNING):
            raise SettingError("step_order", f"{{name}} {self.step_order.value} with a pipeline (pp="
                                             f"{self.layout.pp}) is not modelled: the pipeline's step runs its "
                                             "schedule, then step, then zero_grad; drop {name}")
        replicas = self.replicas
        if self.global_batch is not None and self.global_batch % replicas:
            gpus, g = replicas, self.global_batch
            below, above = g // gpus * gpus, (g // gpus + 1) * gpus
            raise SettingError("global_batch", (
                f"global batch {g} is not divisible by {gpus} GPUs; every GPU takes the same share: "
                + (f"use a multiple of {gpus}, such as {below} or {above}" if below
                   else f"use {above} or another multiple of {gpus}")))

    def _fill_defaults(self) -> None:
        """Unset ``precision`` and ``checkpointing`` take their defaults: the QLoRA recipe's
        for a ``qlora`` job (``memcheck.training.adapters.qlora_recipe``), else fp32 and none.
        ``recipe`` names the settings the recipe filled in (the report says so)."""
        unset = [name for name in _DEFAULTED if getattr(self, name) is None]
        # what a copy (replace) carries over: the defaults it still holds
        kept = {k: v for k, v in self.defaulted if k not in unset and _CHECKS[k](v) == getattr(self, k)}
        recipe = qlora_recipe(_target_arch(self)) if self.qlora and unset else {}
        filled = {name: recipe.get(name, _DEFAULTED[name]) for name in unset}
        for name, value in filled.items():
            object.__setattr__(self, name, _CHECKS[name](value))
        object.__setattr__(self, "defaulted", tuple(sorted({**kept, **filled}.items())))

    @property
    def recipe(self) -> dict[str, str]:
        """The settings the QLoRA recipe chose because the job left them unset (the report says so)."""
        if not self.qlora:
            return {}
        return {k: v for k, v in self.defaulted if v != _DEFAULTED[k]}

    @property
    def strategy_config(self) -> StrategyConfig:
        """The strategy with its GPUs (resolved: 2 for a multi-GPU strategy by default) and settings;
        under a ``layout``, the strategy over the layout's ``dp * cp`` ranks."""
        strategy, gpus = self.strategy, self.gpus
        if self.layout is not None:
            strategy, gpus = _layout_strategy(self.layout, strategy, gpus)
        mixed_precision = self.mixed_precision
        _check_mixed_precision(self, strategy)
        try:
            return StrategyConfig.parse(strategy, gpus, bucket_view=self.bucket_view,
                                        bucket_cap_mb=self.bucket_cap_mb, offload=self.offload,
                                        reduce_bucket_size=self.reduce_bucket_size,
                                        prefetch_bucket_size=self.prefetch_bucket_size,
                                        max_live_parameters=self.max_live_parameters,
                                        fsdp_sharding=self.fsdp_sharding, gpus_per_node=self.gpus_per_node,
                                        mixed_precision=mixed_precision)
        except UsageError as exc:
            raise SettingError("strategy", escape(str(exc))) from None

    @property
    def sharded_qlora(self) -> bool:
        """A QLoRA job whose weights a sharded wrapper (fsdp, fsdp1, zero3, a layout's dp) shards: the FSDP- and
        ZeRO-3-QLoRA recipe (``memcheck.training.adapters``, "sharded QLoRA") rather than the one-GPU one."""
        return bool(self.qlora) and self.strategy_config.strategy in SHARDED_QLORA_STRATEGIES

    @property
    def mixed_precision(self) -> MixedPrecision:
        """The job's FSDP mixed-precision policy (all fields default: none)."""
        return MixedPrecision(self.param_dtype, self.reduce_dtype, self.output_dtype, self.cast_forward_inputs)

    @property
    def world(self) -> int:
        """GPUs in all: the layout's world, or the strategy's GPUs."""
        return self.layout.world if self.layout is not None else self.strategy_config.gpus

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the GPUs over which one step's samples are shared."""
        if self.layout is not None:
            return self.layout.data_parallel
        return self.strategy_config.gpus

    @property
    def effective_margin(self) -> float:
        return DEFAULT_MARGIN if self.margin is None else self.margin

    def replace(self, **changes) -> "Job":
        """A copy with ``changes`` (Python keywords), validated again. Settings the QLoRA recipe
        filled in stay the recipe's: chosen again when ``qlora``, the GPU or the device changes."""
        if self.defaulted and {"qlora", "gpu", "device"} & set(changes):
            changes = {**{name: None for name, _ in self.defaulted}, **changes}
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], *, vocabulary: str = "python", base: "Job | None" = None,
                      ) -> "Job":
        """A job from ``settings`` spelled in ``vocabulary`` ("python", "config" or "json"),
        the HF/Lightning aliases accepted too; unset fields come from ``base``.

        Raises:
            UsageError: for an unknown name (with the closest one) or a bad value, named
                in ``vocabulary``'s words.
        """
        names = {s.name(vocabulary): s.field for s in SPELLINGS if vocabulary == "python" or s.name(vocabulary)}
        names.update({alias: s.field for s in SPELLINGS for alias in s.aliases})
        changes: dict[str, Any] = {}
        setters: dict[str, str] = {}
        for key, value in settings.items():
            if key in VALUE_ALIASES and key not in names:
                translated = translate_alias(key, value)
                if translated is None:
                    continue
                field, value = translated
            else:
                field = names.get(key)
            if field is None:
                known = [*names, *VALUE_ALIASES]
                raise UsageError(f"unknown setting {key!r}{closest(key, known)}; "
                                 f"allowed: {', '.join(s.name(vocabulary) for s in SPELLINGS if s.name(vocabulary))}")
            if field in changes:
                raise UsageError(f"{key!r} sets {SPELLING[field].name(vocabulary)!r}, which {setters[field]!r} "
                                 "already set")
            changes[field], setters[field] = value, key
        try:
            return base.replace(**changes) if base is not None else cls(**changes)
        except SettingError as exc:
            raise UsageError(exc.worded(vocabulary)) from None

    def to_dict(self) -> dict:
        """The job as the JSON's ``"job"`` object, keyed by ``Spelling.json``."""
        out = {}
        for s in SPELLINGS:
            value = getattr(self, s.field)
            if s.field == "tp_plan" and value is not None:
                value = dict(value)
            elif s.field == "optimizer" and not isinstance(value, str):
                value = getattr(value, "__name__", type(value).__name__)
            elif s.field == "gpu" and isinstance(value, GpuSpec):
                value = value.name
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, (Lora, Layout)):
                value = str(value)

            elif hasattr(value, "value"):  # an enum
                value = value.value
            out[s.json] = value
        return out


# The settings a job may leave unset, and their defaults without the QLoRA recipe (Job._fill_defaults)
_DEFAULTED = {"checkpointing": "none", "precision": "fp32"}


def _target_arch(job: "Job") -> tuple[int, int] | None:
    """The CUDA target's compute capability, for the QLoRA recipe's precision: the named GPU's,
    sm80 for a bare size, the local GPU's when none is named (sm80 assumed when there is none);
    None on the CPU target."""
    if job.device is not Device.CUDA:
        return None
    spec = resolve_gpu(job.gpu)
    return spec.arch if spec is not None else (8, 0)


def _gpu(value):
    if value is None or isinstance(value, GpuSpec):
        return value
    if not isinstance(value, str):
        raise SettingError("gpu", "{name} must be a name such as 'H100-80GB', a size such as '24GiB', or a GpuSpec; "
                                  f"got {escape(repr(value))}")
    try:
        resolve_gpu(value)  # a name or a size: never the local GPU, which only None asks for
    except UsageError as exc:
        raise SettingError("gpu", "{name}: " + escape(str(exc))) from None
    return value


def _budget(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SettingError("budget_bytes", "{name} must be a size such as '24GiB' or a byte count; "
                                           f"got {escape(repr(value))}")
    if isinstance(value, int):
        return _int("budget_bytes", value, maximum=MAX_BYTES, why=" bytes (1 PiB, far above any GPU's or host's memory)")
    return parse_size(value, what="gpu_memory")


def _optimizer(value):
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in OPTIMIZERS:
            raise SettingError("optimizer", escape(f"unknown optimizer {value!r}{closest(key, OPTIMIZERS)}; "
                                                 f"allowed: {', '.join(OPTIMIZERS)}"))
        return key
    if value is None:
        return "adamw"
    return value  # a factory or an Optimizer: memcheck.training.optimizers.resolve_optimizer checks it


def _checkpointing(value):
    if value is None:  # unset: the default (Job._fill_defaults)
        return None
    try:
        return parse_checkpointing(value)
    except UsageError as exc:
        raise SettingError("checkpointing", escape(str(exc))) from None


def _lora(value):
    try:
        return Lora.parse(value)
    except UsageError as exc:
        raise SettingError("lora", escape(str(exc))) from None


def _margin(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SettingError("margin", f"{{name}} must be a fraction in [0, 1), such as 0.05; got {escape(repr(value))}")
    return float(value)


def _max_grad_norm(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf") \
            or value > 1.7e308:  # an int beyond any float (10**400): float() would overflow
        raise SettingError("max_grad_norm", f"{{name}} must be a number of 0 or more (0: no clipping), "
                                            f"got {escape(repr(value))}")
    return float(value)


def _bucket_cap(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise SettingError("bucket_cap_mb", f"{{name}} must be a positive number, got {escape(short_repr(value))}")
    if value > MAX_BUCKET_CAP_MB:
        raise SettingError("bucket_cap_mb", f"{{name}} must be at most {MAX_BUCKET_CAP_MB:,} (1 TiB, above any GPU's "
                                            f"memory), got {escape(short_repr(value))}")
    return value


# field -> the function that checks a value and returns it normalised (idempotent)
def _assume(value):
    try:
        return parse_assume(value)
    except UsageError as exc:  # "has no answer 'no-pading' (did you mean ...); allowed: ..."
        raise SettingError("assume", "{name} " + escape(str(exc))) from None


def _check_weights(precision: Precision, weights: WeightsDtype) -> None:
    """A weights dtype that contradicts the precision is refused: fp32 and pure bf16/fp16
    training name their weights' dtype themselves; amp-fp16's GradScaler cannot unscale fp16
    gradients (torch/amp/grad_scaler.py, ``_unscale_grads_``: "Attempting to unscale FP16 gradients")."""
    if weights is WeightsDtype.AUTO:
        return
    own = {Precision.FP32: WeightsDtype.FP32, Precision.BF16: WeightsDtype.BF16, Precision.FP16: WeightsDtype.FP16}
    if precision in own and weights is not own[precision]:
        raise SettingError("weights_dtype", (
            f"{{name}} {weights.value} contradicts precision {precision.value}, which trains "
            f"{own[precision].value} weights; for autocast over {weights.value} weights use precision "
            f"amp-bf16 or amp-fp16, or drop {{name}}"))
    if precision is Precision.AMP_FP16 and weights is WeightsDtype.FP16:
        raise SettingError("weights_dtype", "{name} fp16 cannot train under amp-fp16: its GradScaler refuses fp16 "
                                            "gradients (\"Attempting to unscale FP16 gradients\"); use fp32 or bf16")


def _layout(value):
    if value is None:
        return None
    try:
        layout = Layout.parse(value)
    except UsageError as exc:
        raise SettingError("layout", "{name}: " + escape(str(exc).removeprefix("layout: "))) from None
    return None if layout.is_trivial else layout


def _tp_plan(value):
    if value is None:
        return None
    if isinstance(value, str):
        pairs = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, eq, style = part.rpartition("=")
            if not eq or not key:
                raise SettingError("tp_plan", f"{{name}}: {escape(repr(part))} is not GLOB=STYLE (write e.g. "
                                              "'layers.*.attn.q_proj=colwise,layers.*.attn.o_proj=rowwise')")
            pairs.append((key.strip(), style.strip()))
        value = pairs
    elif isinstance(value, dict):
        value = list(value.items())
    elif not isinstance(value, (list, tuple)):
        raise SettingError("tp_plan", f"{{name}} must be a table of module globs to styles, got {escape(short_repr(value))}")
    from memcheck.training.strategies.tp import check_plan

    try:
        pairs = dict(tuple(pair) for pair in value)
    except (TypeError, ValueError):
        raise SettingError("tp_plan", "{name} must be a table of module globs to styles ('colwise', 'rowwise'), "
                                      f"got {escape(short_repr(value))}") from None
    try:
        plan = check_plan(pairs)
    except UsageError as exc:
        raise SettingError("tp_plan", "{name}: " + escape(str(exc))) from None
    return tuple(plan.items())


def _layout_strategy(layout: Layout, strategy: Strategy, gpus: int | None) -> tuple[Strategy, int]:
    """The strategy and GPUs of a layout's ``dp * cp`` group; ``gpus``, when given, is the world."""
    if gpus is not None and gpus != layout.world:
        raise SettingError("gpus", f"{{name}}={gpus} differs from layout {escape(layout.label)}, which is "
                                   f"{layout.world:,} GPUs; give one or make them agree")
    if strategy in (Strategy.DP, Strategy.DP_BALANCED):
        raise SettingError("strategy", f"{{name}} {strategy.value} (DataParallel, one process) does not combine "
                                       "with a layout; use fsdp, ddp or zero1-3")
    group = layout.sharded_over
    if group == 1:
        if strategy is not Strategy.SINGLE:
            raise SettingError("strategy", f"{{name}} {strategy.value} runs over the layout's dp*cp ranks, and "
                                           f"layout {escape(layout.label)} has one; give dp=N in the layout")
        return Strategy.SINGLE, 1
    if strategy is Strategy.SINGLE:  # torchtitan's default: FSDP2 over dp_shard * cp
        return Strategy.FSDP, group
    return strategy, group


# The strategies that shard the weights themselves, under which QLoRA follows the sharded recipe
SHARDED_QLORA_STRATEGIES = (Strategy.FSDP, Strategy.FSDP1, Strategy.ZERO3)


def _check_adapters(lora, qlora: bool, strategy: Strategy) -> None:
    """The adapter settings that memcheck refuses with a strategy or each other, by name.

    - DoRA over 4-bit weights: PEFT's DoRA deep-copies each ``Linear4bit`` and dequantizes its
      weight to compute the weight norm (peft/tuners/lora/dora.py, ``DoraLinearLayer.update_layer``
      and ``forward``); memcheck's 4-bit twin lives on the meta device, where bitsandbytes' copy of
      ``Params4bit`` fails (``set_data`` of an incompatible tensor type), and no rule sizes the
      per-step dequantized weight yet. Not modelled.

    QLoRA under fsdp, fsdp1 and zero3 takes the sharded recipe (``Job.sharded_qlora``), whose uniform
    storage dtype FSDP1's flat parameters need (``memcheck.training.adapters``).
    """
    dora = lora is not None and getattr(lora, "dora", False)
    if dora and qlora:
        raise SettingError("qlora", "{name} with DoRA (PEFT's use_dora over 4-bit weights) is not modelled: DoRA "
                                    "copies and dequantizes each 4-bit weight, which memcheck cannot trace; drop "
                                    "--dora or --qlora")


def _dtype(field: str, value):
    """A ``Dtype`` from its name, torch's name (``bfloat16``) or a ``torch.dtype``; None stays None."""
    import torch

    if isinstance(value, torch.dtype):
        value = str(value)  # torch.bfloat16 -> "torch.bfloat16", which Dtype.parse reads
    if value is None or isinstance(value, Dtype) or not isinstance(value, str):
        return _choice(field, Dtype, value, optional=True)
    try:
        return Dtype.parse(value, what="\x00")
    except UsageError as exc:  # "unknown --param-dtype 'bf61' (did you mean 'bf16'?); allowed: ..."
        raise SettingError(field, escape(str(exc)).replace("\x00", "{name}", 1)) from None


# The Job fields of FSDP's mixed precision, and their defaults
MIXED_PRECISION_FIELDS = {"param_dtype": None, "reduce_dtype": None, "output_dtype": None, "cast_forward_inputs": None}


def _check_mixed_precision(job: "Job", strategy: Strategy) -> None:
    """FSDP's own casts are refused under any other strategy, naming the first field that sets one
    (DDP, DeepSpeed and DataParallel have no such policy: they train in the weights' dtype or under
    autocast); ``output_dtype`` is FSDP2's alone, and fsdp1's ``no_shard`` with a policy is not modelled."""
    changed = [f for f, default in MIXED_PRECISION_FIELDS.items() if getattr(job, f) != default]
    if not changed or strategy is Strategy.FSDP:
        return
    if strategy is Strategy.FSDP1:
        if job.output_dtype is not None:
            raise SettingError("output_dtype", "{name} is FSDP2's (MixedPrecisionPolicy); FSDP1's MixedPrecision "
                                               "has none: use strategy fsdp, or drop {name}")
        if job.fsdp_sharding is FsdpSharding.NO_SHARD and (job.param_dtype or job.reduce_dtype):
            field = "param_dtype" if job.param_dtype else "reduce_dtype"
            raise SettingError(field, "{name} with fsdp_sharding no_shard is not modelled (FSDP1 keeps the "
                                      "low-precision flat parameter from unshard to reshard there); use full_shard, "
                                      "shard_grad_op or hybrid_shard")
        return
    value = getattr(job, changed[0])
    shown = value.value if hasattr(value, "value") else str(value).lower()
    raise SettingError(changed[0], f"{{name}} {shown} applies to strategies fsdp and fsdp1 (FSDP's mixed "
                                   f"precision), not {strategy.value}: use precision amp-bf16 (autocast) or pure "
                                   "bf16 weights")


def _check_packing(packing: bool, padding: Padding, task: Task | None, strategy: Strategy) -> None:
    """Packing has no padding to vary, and packs the token sequences of causal language models
    only: an encoder-decoder's labels, a classifier's one label per sample and image or audio
    inputs have no packed form, and transformers keeps packed sequences apart only in
    ``create_causal_mask`` (masking_utils.py, ``_preprocess_mask_arguments``: "We check the
    position_ids for potential packed sequence format"). DataParallel scatters a batch's rows over
    its GPUs, and a packed batch is one row."""
    if not packing:
        return
    if padding is Padding.LONGEST:
        raise SettingError("packing", "{name} flattens every batch into one row with no padding; padding longest "
                                      "contradicts it: drop one of them")
    if task is not None and task is not Task.CAUSAL_LM:
        raise SettingError("packing", "{name} packs the token sequences of causal-lm models only, got task "
                                      f"{task.value}: drop {{name}} or give task causal-lm")
    if strategy in (Strategy.DP, Strategy.DP_BALANCED):
        raise SettingError("packing", f"{{name}} makes one row of every batch, which strategy {strategy.value} "
                                      "(DataParallel, scattering rows over its GPUs) cannot split; use ddp")


_CHECKS = {
    "device": lambda v: _choice("device", Device, v),
    "gpu": _gpu,
    "budget_bytes": _budget,
    "batch_size": lambda v: _int("batch_size", v, maximum=MAX_BATCH, why=" (2**24 rows)"),
    "max_len": lambda v: _int("max_len", v, maximum=MAX_LEN, why=" (2**24 tokens)"),
    "target_len": lambda v: _int("target_len", v, maximum=MAX_LEN, why=" (2**24 tokens)"),
    "padding": lambda v: _choice("padding", Padding, v),
    "packing": lambda v: _flag("packing", v),
    "precision": lambda v: _choice("precision", Precision, v, optional=True),
    "weights_dtype": lambda v: _choice("weights_dtype", WeightsDtype, v),
    "optimizer": _optimizer,
    "steps": lambda v: _int("steps", v, minimum=2, optional=False,
                            text="{name} must be an integer of at least 2 (step 1 has no optimizer state)",
                            maximum=MAX_STEPS, why=" (the peak is steady from step 2 on, and every step is one "
                                                   "more trace of the model)"),
    "accumulate": lambda v: _int("accumulate", v, optional=False),
    "checkpointing": _checkpointing,
    "use_reentrant": lambda v: _flag("use_reentrant", v),
    "lora": _lora,
    "qlora": lambda v: _flag("qlora", v),
    "max_grad_norm": _max_grad_norm,
    "step_order": lambda v: _choice("step_order", StepOrder, v),
    "strategy": lambda v: _choice("strategy", Strategy, v),
    "gpus": lambda v: _int("gpus", v, maximum=MAX_GPUS, why=" (2**16, above the largest training clusters' "
                                                         "data-parallel groups)"),
    "bucket_view": lambda v: _flag("bucket_view", v),
    "bucket_cap_mb": _bucket_cap,
    "offload": lambda v: _choice("offload", Offload, "none" if v is None else v),
    "reduce_bucket_size": lambda v: _int("reduce_bucket_size", v, text="{name} must be a positive integer (elements)",
                                         maximum=MAX_ZERO_ELEMENTS, why=" elements (2**40)"),
    "prefetch_bucket_size": lambda v: _int("prefetch_bucket_size", v, minimum=0,
                                           text="{name} must be an integer of 0 or more (elements)",
                                           maximum=MAX_ZERO_ELEMENTS, why=" elements (2**40)"),
    "max_live_parameters": lambda v: _int("max_live_parameters", v, minimum=0,
                                          text="{name} must be an integer of 0 or more (elements)",
                                          maximum=MAX_ZERO_ELEMENTS, why=" elements (2**40)"),
    "layout": lambda v: _layout(v),
    "tp_plan": lambda v: _tp_plan(v),
    "fsdp_sharding": lambda v: _choice("fsdp_sharding", FsdpSharding, v, optional=True),
    "gpus_per_node": lambda v: _int("gpus_per_node", v, maximum=MAX_GPUS, why=" (2**16)"),
    "param_dtype": lambda v: _dtype("param_dtype", v),
    "reduce_dtype": lambda v: _dtype("reduce_dtype", v),
    "output_dtype": lambda v: _dtype("output_dtype", v),
    "cast_forward_inputs": lambda v: None if v is None else _flag("cast_forward_inputs", v),
    "eval_batch_size": lambda v: _int("eval_batch_size", v, maximum=MAX_BATCH, why=" (2**24 rows)"),
    "eval_accumulate_predictions": lambda v: _int("eval_accumulate_predictions", v, minimum=0, optional=False,
                                                  text="{name} must be an integer of 0 or more",
                                                  maximum=MAX_EVAL_KEPT, why=" (2**16 eval batches)"),
    "margin": _margin,
    "global_batch": lambda v: _int("global_batch", v, maximum=MAX_GLOBAL_BATCH,
                                   why=" (2**24 samples, far above the largest published global batches)"),
    "task": lambda v: _choice("task", Task, v, optional=True),
    "attn": lambda v: _choice("attn", Attention, v, optional=True),
    "assume": _assume,
    "trust_remote_code": lambda v: _flag("trust_remote_code", v),
}
assert tuple(_CHECKS) == tuple(s.field for s in SPELLINGS) == tuple(f.name for f in dataclasses.fields(Job)
                                                                  if f.name != "defaulted")


def as_job(job: "Job | None", settings: Mapping[str, Any], *, caller: str) -> Job:
    """The keyword facade of ``estimate()``, ``plan()``, ``check()`` and ``preflight()``: their
    settings as Python keywords (or HF/Lightning aliases), over ``job`` when one is given.

    Raises:
        UsageError: naming an argument ``caller`` does not take, or a bad value.
    """
    if job is not None and not isinstance(job, Job):
        raise UsageError(f"{caller} takes a memcheck.Job as its third argument, got {type(job).__name__}")
    known = {s.field for s in SPELLINGS} | {a for s in SPELLINGS for a in s.aliases}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise UsageError(f"{caller} got unknown argument(s) {', '.join(unknown)}; its settings are "
                         f"{', '.join(s.field for s in SPELLINGS)} (see memcheck.job.SPELLINGS)")
    if job is not None and not settings:
        return job
    return Job.from_settings(settings, base=job)


def check_setting(field: str, value):
    """One field's value checked and normalised, as ``Job`` does, without the checks between
    fields (a config checks each key where it is written, then the whole job).

    Raises:
        SettingError: naming the field.
    """
    return _CHECKS[field](value)
