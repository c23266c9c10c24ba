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
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from memcheck.choices import parse_assume
from memcheck.enums import (Attention, Device, Dtype, FsdpSharding, Offload, Padding, Precision, StepOrder, Strategy, Task,
                            WeightsDtype)
from memcheck.errors import UsageError, closest
from memcheck.units import MAX_BYTES, parse_size, short_repr

# The value types below the job (the GPU table, LoRA, the checkpointing spec, optimizer names, the strategy
# and layout values) are imported where a job is built, checked or read, not here: the command line reads
# the settings' declarations to build its options, and must not import torch to show --help or to fork
# ``memcheck check``'s child (cli._in_child forks only while torch is not loaded).
if TYPE_CHECKING:
    from memcheck.cuda.gpus import GpuSpec
    from memcheck.training.adapters import Lora
    from memcheck.training.strategies import StrategyConfig
    from memcheck.training.strategies.base import MixedPrecision
    from memcheck.training.strategies.layout import Layout

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


_UNSET = object()


@dataclass(frozen=True)
class Option:
    """How ``memcheck estimate`` and ``memcheck plan`` take one setting on the command line;
    ``memcheck.cli`` builds the click option from it (the flag is ``Spelling.flag``).

    ``help`` is the option's help, or ``{command: help}`` where the commands word it apart;
    ``default`` is the flag's default where it is not the field's (the field's enum by value,
    ``None`` for a flag a job resolves later, such as ``--optimizer``); ``negatable`` gives the
    flag a ``--no-`` twin; ``commands`` are the commands that take it."""

    help: str | Mapping[str, str]
    metavar: str | None = None
    type: type | None = None  # int or float; None: text, or an on/off flag for a bool field
    default: Any = _UNSET  # _UNSET: the field's default, as the command line spells it
    show_default: bool = False
    short: str | None = None  # a one-letter twin, such as -b
    negatable: bool = False  # --x/--no-x
    commands: tuple[str, ...] = ("estimate", "plan")

    def help_for(self, command: str) -> str:
        return self.help if isinstance(self.help, str) else self.help[command]


# The sections the settings are grouped in, in the order the command line lists them
# (torchtitan's JobConfig groups its own the same way, one dataclass a section).
SECTIONS = ("target", "batch", "training", "parallelism", "evaluation", "plan")


@dataclass(frozen=True)
class Spelling:
    """One ``Job`` field's declaration: how it is written in each place a user writes it, its
    section, its check and its command-line option. Built from the field's metadata (``setting``)."""

    field: str  # the Job field and the Python keyword of estimate(), plan(), check(), preflight()
    flag: str | None  # the CLI flag (None: not a flag)
    config: str | None  # the key in a memcheck config (None: not a config key)
    json: str  # the key in the JSON's "job" object
    aliases: tuple[str, ...] = ()  # HF TrainingArguments / Lightning names for exactly this value
    section: str = "target"  # one of SECTIONS
    check: Any = None  # (field, value) -> the value checked and normalised (idempotent); SettingError naming field
    option: Option | None = None  # the command line's option (None: no estimate/plan flag)
    hf: str | None = None  # transformers' TrainingArguments name for exactly this value
    lightning: str | None = None  # Lightning's Trainer argument for exactly this value
    kept: bool = False  # plan's recommendation repeats it (flags and TOML) where the job changes it
    loop: str | None = None  # the keyword of memcheck.training.loop.run_steps it is handed down as (Job.loop)

    def name(self, vocabulary: str) -> str:
        """This field's name in ``vocabulary``: "python", "flag", "config" or "json"."""
        if vocabulary == "python":
            return self.field
        return getattr(self, vocabulary) or self.field



def setting(default, *, section: str, check, option: Option | None = None, flag: Any = _UNSET,
            config: Any = _UNSET, json: str | None = None, aliases: tuple[str, ...] = (), hf: str | None = None,
            lightning: str | None = None, kept: bool = False, loop: str | None = None):
    """A ``Job`` field declared once: ``default``, its ``section``, its ``check`` and its spellings
    (flag ``--field-name``, config key and JSON key ``field_name`` unless given; ``None``: not
    spelled there). ``hf`` and ``lightning`` are the trainers' names for exactly this value, read
    as aliases too; ``loop`` names the keyword of memcheck's training loop it goes down as, unchanged
    (``Job.loop``), so that its consumer there is the only other place it is written. ``SPELLINGS``,
    the checks, the CLI's options and the outputs' flags and keys are all read from it."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {', '.join(SECTIONS)}, got {section!r}")
    return dataclasses.field(default=default, metadata={"setting": dict(
        section=section, check=check, option=option, flag=flag, config=config, json=json, aliases=aliases, hf=hf,
        lightning=lightning, kept=kept, loop=loop)})


def _spelling(field: str, spec: dict) -> Spelling:
    spec = dict(spec)
    flag, config = spec.pop("flag"), spec.pop("config")
    aliases = tuple(dict.fromkeys(a for a in (spec["hf"], spec["lightning"], *spec.pop("aliases")) if a and a != field))
    return Spelling(field, "--" + field.replace("_", "-") if flag is _UNSET else flag,
                    field if config is _UNSET else config, spec.pop("json") or field, aliases, **spec)


def _ints(**limits):
    return lambda field, value: _int(field, value, **limits)


def _choices(cls, **how):
    return lambda field, value: _choice(field, cls, value, **how)


def _one(check):
    """A check of the value alone (it names its field itself)."""
    return lambda field, value: check(value)


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
    "optim": ("optimizer", lambda value: _hf_optimizer(value)),
    "bf16": ("precision", _hf_flag("amp-bf16")),
    "fp16": ("precision", _hf_flag("amp-fp16")),
    "activation_checkpointing": ("checkpointing", _hf_flag("full")),  # False says nothing: none is the default
    "gradient_checkpointing": ("checkpointing", _hf_flag("full")),  # transformers 5's deprecated alias of the above
    # TRL's SFTConfig: padding_free=True flattens each batch into one row with position ids, as packing
    # does (packing=True with the default "bfd" strategy turns padding_free on: sft_trainer.py, "BFD packing
    # requires padding-free mode"); its worst case, every sample max_len tokens, is packing's. False says nothing.
    "padding_free": ("packing", _hf_flag(True)),
}


def _hf_optimizer(value):
    from memcheck.training.optimizers import hf_optimizer

    return hf_optimizer(value)


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

    device: Device = setting(
        Device.CUDA, section="target", check=_choices(Device),
        option=Option("Target device of the estimate: cpu or cuda.", metavar="DEVICE", show_default=True))
    """The target: ``cuda`` (default) or ``cpu``. Tracing always runs on the meta device."""
    gpu: str | GpuSpec | None = setting(
        None, section="target", check=_one(lambda v: _gpu(v)),
        option=Option("Target GPU: a name (H100-80GB, A100-40GB, RTX-4090, T4, ...; see `memcheck gpus`) or a "
                      "capacity such as 24GiB. Default: the local GPU, if any. Exit code 1 when it does not fit.",
                      metavar="NAME|SIZE"))
    """The CUDA target: a name (``H100-80GB``), a size (``24GiB``) or a GpuSpec; None: the local GPU, if any."""
    budget_bytes: int | None = setting(
        None, section="target", check=_one(lambda v: _budget(v)), flag="--gpu-memory", config="gpu_memory",
        option=Option("A memory budget such as 24GiB, checked against the device total (the peak on cpu).",
                      metavar="SIZE"))
    """A memory budget in bytes (or a size such as ``"24GiB"``); by default the GPU's capacity."""
    batch_size: int | None = setting(
        None, section="batch", check=_ints(maximum=MAX_BATCH, why=" (2**24 rows)"), config="micro_batch",
        json="micro_batch_size", hf="per_device_train_batch_size",
        option=Option("Micro-batch size per step.", type=int, default=1, show_default=True, short="-b",
                      commands=("estimate",)))
    """The micro-batch per GPU and step (the batch's own first dimension when None)."""
    max_len: int | None = setting(
        None, section="batch", check=_ints(maximum=MAX_LEN, why=" (2**24 tokens)"),
        aliases=("max_seq_length",),  # TRL's SFTConfig
        option=Option("Pad every sequence to this length (the worst case). Default for hf: models: the position "
                      "limit; for raw-audio models (Wav2Vec2, HuBERT) it is samples, with no default.", type=int))
    """Every sequence padded to this length: the worst case."""
    target_len: int | None = setting(
        None, section="batch", check=_ints(maximum=MAX_LEN, why=" (2**24 tokens)"),
        option=Option("Label length for seq2seq and ctc models.", type=int))
    """The label length of seq2seq models."""
    padding: Padding = setting(
        Padding.MAX_LENGTH, section="batch", check=_choices(Padding), kept=True,
        option=Option("longest: batches padded to their longest sample (padding=True), so lengths vary up to "
                      "--max-len; on cuda the caching allocator replays a run of growing lengths.",
                      metavar="max_length|longest", show_default=True))
    """``max_length``: every batch padded to ``max_len``; ``longest`` (``padding=True``): each batch
    to its longest sample, so on the CUDA target the allocator replays a run whose lengths grow
    to ``max_len``. The peak is ``max_len``'s either way."""
    packing: bool = setting(
        False, section="batch", check=_flag,  # TRL's SFTConfig name too (padding_free: VALUE_ALIASES)
        option=Option("Packed, padding-free batches (DataCollatorWithFlattening, TRL's packing / padding_free): "
                      "each sample slot --max-len tokens of packed sequences, all flattened into one row with "
                      "position ids. Causal LMs only."))
    """Packed, padding-free batches (transformers' ``DataCollatorWithFlattening``, TRL's ``packing`` /
    ``padding_free``): each of ``batch_size`` sample slots is ``max_len`` tokens of packed sequences, all
    flattened into one row of ``batch_size * max_len`` tokens with position ids restarting at 0 for each
    sequence and no attention mask. Causal language models only."""
    precision: Precision | None = setting(
        None, section="training", check=_choices(Precision, optional=True),
        option=Option({"estimate": "fp32 (the default); amp-bf16 / amp-fp16 (torch.autocast, fp16 with a "
                                   "GradScaler); or pure bf16 / fp16 weights. With --qlora the recipe's amp-bf16 "
                                   "where the GPU has bf16 (sm80+).",
                       "plan": "The precision to plan for. Default: the GPU's best, amp-bf16 then pure bf16 on "
                               "sm80 and later, amp-fp16 before (fp32 on --device cpu)."}, metavar="PREC"))
    """``fp32``; ``amp-bf16``/``amp-fp16`` (torch.autocast); pure ``bf16``/``fp16`` weights. None (unset):
    ``fp32``, or for a ``qlora`` job the QLoRA recipe's ``amp-bf16`` where the GPU has bf16
    (``memcheck.training.adapters.qlora_recipe``); the job always holds the resolved value."""
    weights_dtype: WeightsDtype = setting(
        WeightsDtype.AUTO, section="training", check=_choices(WeightsDtype), kept=True,
        option=Option("The weights' dtype under amp-*: auto keeps the model's own (for hf: config.json's dtype, "
                      "as from_pretrained loads it); fp32 and bf16/fp16 precisions name their own.",
                      metavar="auto|fp32|bf16|fp16", show_default=True))
    """The weights' dtype: ``auto`` follows the precision (fp32 weights for ``fp32``, bf16/fp16 for
    pure ``bf16``/``fp16``) and, under autocast, the model's own dtype (``from_pretrained``'s default:
    config.json's ``dtype``); or ``fp32``/``bf16``/``fp16`` for autocast over weights of that dtype."""
    optimizer: Any = setting(
        "adamw", section="training", check=_one(lambda v: _optimizer(v)),
        option=Option("adamw (default), adamw-foreach, adamw-fused, adam, adam-fused, adafactor, adamw-8bit, "
                      "paged-adamw-8bit, paged-adamw-32bit, sgd, sgd-momentum; a model file's make_optimizer wins "
                      "unless this is given.", metavar="NAME", default=None))
    """A name from ``memcheck.training.optimizers.OPTIMIZERS``, a factory ``params -> Optimizer`` or an Optimizer."""
    steps: int = setting(
        2, section="training", config=None,
        check=_ints(minimum=2, optional=False, text="{name} must be an integer of at least 2 (step 1 has no "
                                                    "optimizer state)",
                    maximum=MAX_STEPS, why=" (the peak is steady from step 2 on, and every step is one more trace "
                                           "of the model)"),
        option=Option("Training steps to trace; the peak is taken from step 2 on.", type=int, show_default=True))
    """Training steps to trace; the peak is taken from step 2 on (step 1 has no optimizer state)."""
    accumulate: int = setting(
        1, section="batch", check=_ints(optional=False), config="accumulation", json="accumulation_steps",
        hf="gradient_accumulation_steps", lightning="accumulate_grad_batches",
        option=Option("Gradient accumulation steps.", type=int, show_default=True, commands=("estimate",)))
    """Gradient accumulation steps; the peak is the steady-state micro-step's."""
    checkpointing: str | tuple[str, ...] | None = setting(
        None, section="training", check=_one(lambda v: _checkpointing(v)),
        option=Option("Gradient checkpointing (default none; with --qlora the recipe's full, as PEFT's "
                      "prepare_model_for_kbit_training): full wraps every repeated block, half every second, "
                      "every:N every Nth (transformers' every_n_layers), selective-op every block with torchtitan's "
                      "op-level policy; or comma-separated module names/patterns (transformer.h.*).",
                      metavar="none|full|half|every:N|selective-op|LIST", commands=("estimate",)))
    """``none``, ``full`` (every repeated block) or module names/patterns. None (unset): ``none``, or
    for a ``qlora`` job the recipe's ``full`` (PEFT's ``prepare_model_for_kbit_training`` turns it on);
    the job always holds the resolved value."""
    use_reentrant: bool = setting(
        False, section="training", check=_flag, flag="--reentrant", config="reentrant",
        option=Option("Checkpoint with use_reentrant=True (default False)."))
    """torch.utils.checkpoint's implementation."""
    lora: Lora | None = setting(
        None, section="training", check=_one(lambda v: _lora(v)), kept=True,
        option=Option("Fine-tune LoRA adapters (PEFT) over the frozen model: settings as key=value (targets: "
                      "module names or all-linear); 'default' for PEFT's defaults.",
                      metavar="r=R,alpha=A,targets=T,dropout=D"))
    """LoRA adapters set up by PEFT (``"r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05"``, ``all-linear``
    targets, ``dora=true``; True: PEFT's defaults), the base frozen; None: full fine-tuning."""
    qlora: bool = setting(
        False, section="training", check=_flag, kept=True,
        option=Option("The QLoRA recipe: linear layers in 4-bit NF4 (double quantization, bf16 compute), "
                      "prepare_model_for_kbit_training, LoRA adapters (--lora's settings, else PEFT's defaults)."))
    """The QLoRA recipe: linear layers in 4-bit NF4 (bitsandbytes), ``prepare_model_for_kbit_training``,
    and ``lora`` (PEFT's defaults when None)."""
    max_grad_norm: float | None = setting(
        None, section="training", check=_one(lambda v: _max_grad_norm(v)), kept=True, loop="max_grad_norm",
        hf="max_grad_norm", lightning="gradient_clip_val",  # HF TrainingArguments' own name; Lightning's Trainer
        option=Option("Clip gradients before each step (clip_grad_norm_); 0: no clipping. Default: the HF "
                      "Trainer's 1.0 for hf: models, none for model files.", type=float, metavar="NORM"))
    """Gradient clipping before each optimizer step (``clip_grad_norm_``); None or 0: none. For
    ``hf:`` models the installed Trainer's default (1.0)."""
    step_order: StepOrder = setting(
        StepOrder.HF, section="training", check=_choices(StepOrder), kept=True, loop="order",  # the callbacks set it
        option=Option("Where each step zeroes the gradients, after the loop that runs it: hf and accelerate after "
                      "the optimizer step (memcheck's own loop), plain before the forward, lightning between the "
                      "forward and the backward (automatic optimization: the last step's gradients are alive "
                      "through the forward).", metavar="hf|accelerate|plain|lightning", show_default=True))
    """Where a step zeroes the gradients, named after the loop that does it (``StepOrder``): ``hf``
    (the default, memcheck's own loop: forward, backward, clip, step, zero_grad), ``accelerate``
    (the same), ``plain`` (zero_grad first) or ``lightning`` (zero_grad between the forward and the
    backward, so the previous step's gradients are alive through the forward; the Lightning callback
    sets it). A ``train_step`` runs in its own order."""
    set_to_none: bool = setting(
        True, section="training", check=_flag, kept=True, loop="set_to_none",
        option=Option("optimizer.zero_grad(set_to_none=...): --no-set-to-none zeroes the gradients in place, so "
                      "they stay allocated through the next forward (torch's default, and the HF Trainer's, is "
                      "set_to_none=True).", negatable=True, show_default=True))
    """``optimizer.zero_grad(set_to_none=...)`` in memcheck's loop (torch/optim/optimizer.py, ``zero_grad``):
    True (torch's default since 2.0; the HF Trainer always passes it) drops the gradients; False (a loop
    that calls ``zero_grad(set_to_none=False)``, or a Lightning ``optimizer_zero_grad`` override that does)
    fills them with zeros, so they stay allocated through the next forward and the next backward
    accumulates into them in place. A ``train_step`` zeroes as it is written."""
    cudnn_benchmark: bool = setting(
        False, section="training", check=_flag, kept=True, lightning="benchmark",
        option=Option("torch.backends.cudnn.benchmark=True (Lightning's Trainer(benchmark=True)): each convolution's "
                      "first call times every cuDNN algorithm in a search workspace (cuda target)."))
    """``torch.backends.cudnn.benchmark``: with True, each convolution's first call builds every cuDNN plan
    and times it in one search workspace (``memcheck.rules.cuda_conv``, from Conv_v8.cpp's
    ``get_plans_from_find``); False (torch's default) takes the heuristics' plan. Lightning's
    ``Trainer(benchmark=...)`` sets it. Only convolutions on the cuda target read it."""
    strategy: Strategy = setting(
        Strategy.SINGLE, section="parallelism", check=_choices(Strategy),
        option=Option("single, dp, dp-balanced, ddp, fsdp (FSDP2), fsdp1 (FullyShardedDataParallel), zero1, zero2, "
                      "zero3 (multi-GPU ones need --gpus).", metavar="NAME", show_default=True))
    """``single``, ``dp``, ``dp-balanced``, ``ddp``, ``fsdp`` (FSDP2), ``fsdp1``, ``zero1``, ``zero2``, ``zero3``."""
    gpus: int | None = setting(
        None, section="parallelism",
        check=_ints(maximum=MAX_GPUS, why=" (2**16, above the largest training clusters' data-parallel groups)"),
        option=Option("GPUs for a multi-GPU strategy (default 2; 1 for single).", type=int))
    """GPUs of a multi-GPU strategy (None: 2 for those, 1 for single)."""
    bucket_view: bool = setting(
        False, section="parallelism", check=_flag, aliases=("gradient_as_bucket_view",),  # DDP's keyword
        option=Option("ddp: gradient_as_bucket_view.", negatable=True, show_default=True))
    """ddp: ``gradient_as_bucket_view``."""
    bucket_cap_mb: float | None = setting(
        None, section="parallelism", check=_one(lambda v: _bucket_cap(v)),
        option=Option("ddp: bucket_cap_mb (DDP's default: 25).", type=float))
    """ddp: ``bucket_cap_mb`` (None: DDP's default, 25)."""
    offload: Offload = setting(
        Offload.NONE, section="parallelism", check=lambda field, v: _choice(field, Offload, "none" if v is None else v),
        option=Option("fsdp / fsdp1 / zero: move the optimizer state or the parameters to CPU memory.",
                      metavar="none|optimizer|params", show_default=True))
    """fsdp / fsdp1 / zero: ``optimizer`` or ``params`` moved to CPU memory."""
    # DeepSpeed ZeRO's buffers, in elements, under DeepSpeed's own names (zero_optimization's keys)
    reduce_bucket_size: int | None = setting(
        None, section="parallelism", kept=True,
        check=_ints(text="{name} must be a positive integer (elements)", maximum=MAX_ZERO_ELEMENTS,
                    why=" elements (2**40)"),
        option=Option("zero1-3: DeepSpeed's reduce_bucket_size, the gradient bucket (default 5e8 elements).",
                      type=int, metavar="ELEMENTS"))
    """zero1-3: DeepSpeed's ``reduce_bucket_size``, the IPG gradient bucket in elements (None: DeepSpeed's 5e8)."""
    prefetch_bucket_size: int | None = setting(
        None, section="parallelism", kept=True, aliases=("stage3_prefetch_bucket_size",),
        check=_ints(minimum=0, text="{name} must be an integer of 0 or more (elements)", maximum=MAX_ZERO_ELEMENTS,
                    why=" elements (2**40)"),
        option=Option("zero3: DeepSpeed's stage3_prefetch_bucket_size (default 5e7 elements; 0: no prefetch).",
                      type=int, metavar="ELEMENTS"))
    """zero3: DeepSpeed's ``stage3_prefetch_bucket_size``, parameters gathered ahead, in elements (None: 5e7;
    0: no prefetch)."""
    max_live_parameters: int | None = setting(
        None, section="parallelism", kept=True, aliases=("stage3_max_live_parameters",),
        check=_ints(minimum=0, text="{name} must be an integer of 0 or more (elements)", maximum=MAX_ZERO_ELEMENTS,
                    why=" elements (2**40)"),
        option=Option("zero3: DeepSpeed's stage3_max_live_parameters (default 1e9 elements).", type=int,
                      metavar="ELEMENTS"))
    """zero3: DeepSpeed's ``stage3_max_live_parameters``, the gathered parameters above which nothing more is
    prefetched, in elements (None: 1e9)."""
    layout: Layout | None = setting(
        None, section="parallelism", check=_one(lambda v: _layout(v)),
        option=Option("Several kinds of parallelism at once: dp, dp_replicate, tp, pp, cp, ep degrees, and "
                      "schedule= (gpipe, 1f1b, interleaved-1f1b, zero-bubble), virtual=, sp=true, "
                      "loss_parallel=true (torchtitan's loss parallelism: sharded logits). --strategy runs over "
                      "dp*cp (fsdp by default); one column per pipeline stage.", metavar="dp=D,tp=T,pp=P,..."))
    """Several kinds of parallelism at once (``"dp=8,tp=4,pp=2"``, see
    ``memcheck.training.strategies.layout``): ``strategy`` then runs over the layout's ``dp * cp``
    ranks (``fsdp`` when not given), ``gpus`` is the whole world, and under ``pp`` ``accumulate``
    is the pipeline's micro-batches per step. None: one kind, ``strategy`` over ``gpus``."""
    tp_plan: tuple[tuple[str, str], ...] | None = setting(
        None, section="parallelism", check=_one(lambda v: _tp_plan(v)),
        option=Option("With a layout's tp: the modules to shard and transformers' style for each (colwise, "
                      "rowwise, colwise_gather_output, embedding_rowwise, ...); default: the model's own plan as "
                      "transformers applies it (tp_plan=\"auto\").", metavar="GLOB=STYLE,..."))
    """The layout's tensor-parallel plan, ``{module glob: style}`` with transformers' style names
    (``colwise``, ``rowwise``, ``colwise_gather_output``, ``embedding_rowwise``, ...;
    ``"layers.*.attn.q_proj=colwise,..."`` on the command line); None: the model's own plan as
    transformers applies it (``tp_plan="auto"``)."""
    fsdp_sharding: FsdpSharding | None = setting(
        None, section="parallelism", check=_choices(FsdpSharding, optional=True),
        option=Option("fsdp1: FullyShardedDataParallel's sharding_strategy (default full_shard).",
                      metavar="full_shard|shard_grad_op|no_shard|hybrid_shard"))
    """fsdp1: ``full_shard`` (None: torch's default), ``shard_grad_op``, ``no_shard`` or ``hybrid_shard``.
    HF ``TrainingArguments.fsdp`` is not an alias: it is a list of options (``"full_shard offload
    auto_wrap"``); the transformers integration reads it."""
    gpus_per_node: int | None = setting(
        None, section="parallelism", check=_ints(maximum=MAX_GPUS, why=" (2**16)"),
        option=Option("GPUs a node: fsdp1 hybrid_shard's shard group (default: all of --gpus); for plan --gpus N "
                      "with no --strategy, where tensor parallelism stays (default 8).", type=int))
    """fsdp1 ``hybrid_shard``: GPUs per node, the group a rank shards over (None: every GPU on one node)."""
    # FSDP2's MixedPrecisionPolicy under its own field names (also Accelerate's mixed_precision_policy keys and
    # FSDP1's MixedPrecision, which Lightning's FSDPStrategy takes); torchtitan's [training] keys as aliases
    param_dtype: Dtype | None = setting(
        None, section="parallelism", check=lambda field, v: _dtype(field, v), kept=True,
        aliases=("mixed_precision_param",),
        option=Option("fsdp: MixedPrecisionPolicy.param_dtype, the dtype parameters are all-gathered and computed "
                      "in (torchtitan's mixed_precision_param, bf16 there); shards and optimizer keep the weights'.",
                      metavar="fp32|bf16|fp16"))
    """fsdp: ``MixedPrecisionPolicy.param_dtype``, the dtype FSDP2 all-gathers the parameters in and so
    the forward and backward compute in (``bf16``: torchtitan's default, ``mixed_precision_param``); the
    shards and the optimizer keep the weights' own dtype. None: no cast."""
    reduce_dtype: Dtype | None = setting(
        None, section="parallelism", check=lambda field, v: _dtype(field, v), kept=True,
        aliases=("mixed_precision_reduce",),
        option=Option("fsdp: MixedPrecisionPolicy.reduce_dtype, the gradients' reduce-scatter dtype (torchtitan's "
                      "mixed_precision_reduce, fp32 there). Default: --param-dtype's.", metavar="fp32|bf16|fp16"))
    """fsdp: ``MixedPrecisionPolicy.reduce_dtype``, the gradients' reduce-scatter dtype (``fp32``:
    torchtitan's ``mixed_precision_reduce``). None: the gradients' own (``param_dtype``'s)."""
    output_dtype: Dtype | None = setting(
        None, section="parallelism", check=lambda field, v: _dtype(field, v), kept=True,
        option=Option("fsdp: MixedPrecisionPolicy.output_dtype, each fully_shard module's outputs cast to it.",
                      metavar="fp32|bf16|fp16"))
    """fsdp: ``MixedPrecisionPolicy.output_dtype``, each ``fully_shard`` module's floating outputs cast to it.
    None: no cast."""
    cast_forward_inputs: bool | None = setting(
        None, section="parallelism", check=lambda field, v: None if v is None else _flag(field, v), kept=True,
        option=Option("fsdp: MixedPrecisionPolicy.cast_forward_inputs, module inputs cast to --param-dtype "
                      "(default: the wrapper's, FSDP2's on).", negatable=True))
    """fsdp: ``MixedPrecisionPolicy.cast_forward_inputs``, each ``fully_shard`` module's floating inputs cast
    to ``param_dtype``; None: the wrapper's default (FSDP2's True)."""
    eval_batch_size: int | None = setting(
        None, section="evaluation", check=_ints(maximum=MAX_BATCH, why=" (2**24 rows)"), kept=True,
        config="eval_batch", hf="per_device_eval_batch_size",
        option=Option("Also trace an evaluation pass (no_grad) at this batch size; the peak is the larger.",
                      type=int))
    """Also trace an evaluation pass at this batch size."""
    eval_accumulate_predictions: int = setting(
        0, section="evaluation", kept=True,
        check=_ints(minimum=0, optional=False, text="{name} must be an integer of 0 or more", maximum=MAX_EVAL_KEPT,
                    why=" (2**16 eval batches)"),
        option=Option("Keep N eval batches of predictions on the GPU (HF Trainer without eval_accumulation_steps).",
                      type=int, metavar="N", show_default=True))
    """Evaluation batches whose predictions stay on the device."""
    margin: float | None = setting(
        None, section="target", check=_one(lambda v: _margin(v)),
        option=Option({"estimate": "Fraction of the capacity held back; the verdict is the one check and plan give "
                                   "(default 0.05).",
                       "plan": "Fraction of the capacity held back (default 0.05: the CUDA target's device-total "
                               "accuracy target)."}, type=float))
    """The fraction of the capacity held back by plan and check (None: ``DEFAULT_MARGIN``)."""
    global_batch: int | None = setting(
        None, section="plan",
        check=_ints(maximum=MAX_GLOBAL_BATCH, why=" (2**24 samples, far above the largest published global batches)"),
        option=Option("Samples per optimizer step over all GPUs; micro-batch x accumulation x GPUs equals it. "
                      "Without it the micro-batch is maximised.", type=int, commands=("plan",)))
    """plan: samples per optimizer step over all GPUs."""
    task: Task | None = setting(
        None, section="target", check=_choices(Task, optional=True),
        option=Option("Override the architecture's task: causal-lm, masked-lm, seq2seq (text or speech, as "
                      "Whisper), classification (text or audio), image-classification, ctc (Wav2Vec2, HuBERT: "
                      "--max-len in audio samples) or contrastive (CLIP, SigLIP: text and image, the model's own "
                      "loss).", metavar="TASK"))
    """transformers models: what the model is trained for (decides the worst-case batch)."""
    attn: Attention | None = setting(
        None, section="target", check=_choices(Attention, optional=True), aliases=("attn_implementation",),
        option=Option("transformers attention implementation: eager or sdpa.", metavar="IMPL"))
    """transformers models: the attention implementation."""
    assume: tuple[str, ...] = setting(
        (), section="target", check=_one(lambda v: _assume(v)),
        option=Option("Pin data-dependent answers instead of tracing both and reporting the larger: padding or "
                      "no-padding (attention masks all ones), routing=worst or routing=balanced (MoE experts).",
                      metavar="ANSWER,ANSWER", default=None))
    """Pinned answers at the data-dependent choice points (``memcheck.choices``): ``padding`` or
    ``no-padding``, ``routing=worst`` or ``routing=balanced`` (``"no-padding,routing=balanced"``).
    (): every answer a real batch can give is traced and the larger peak reported."""
    trust_remote_code: bool = setting(
        False, section="target", check=_flag,  # transformers
        option=Option("hf: models: let transformers run the Python files config.json's auto_map names (only code "
                      "you would run yourself); without it such a config is refused."))
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
        if self.qlora and unset:
            from memcheck.training.adapters import qlora_recipe

            recipe = qlora_recipe(_target_arch(self))
        else:
            recipe = {}
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
        from memcheck.training.strategies import StrategyConfig

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
    def loop(self) -> dict[str, Any]:
        """The settings memcheck's own training loop takes, as ``memcheck.training.loop.run_steps``'s
        keywords (each declared with ``loop=``), handed down through the strategy unchanged."""
        return {s.loop: getattr(self, s.field) for s in SPELLINGS if s.loop is not None}

    @property
    def sharded_qlora(self) -> bool:
        """A QLoRA job whose weights a sharded wrapper (fsdp, fsdp1, zero3, a layout's dp) shards: the FSDP- and
        ZeRO-3-QLoRA recipe (``memcheck.training.adapters``, "sharded QLoRA") rather than the one-GPU one."""
        return bool(self.qlora) and self.strategy_config.strategy in SHARDED_QLORA_STRATEGIES

    @property
    def mixed_precision(self) -> MixedPrecision:
        """The job's FSDP mixed-precision policy (all fields default: none)."""
        from memcheck.training.strategies.base import MixedPrecision

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
        from memcheck.cuda.gpus import GpuSpec
        from memcheck.training.adapters import Lora
        from memcheck.training.strategies.layout import Layout

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
    from memcheck.cuda.gpus import resolve_gpu

    spec = resolve_gpu(job.gpu)
    return spec.arch if spec is not None else (8, 0)


def _gpu(value):
    from memcheck.cuda.gpus import GpuSpec, resolve_gpu

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
    from memcheck.training.optimizers import OPTIMIZERS

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
        from memcheck.training.checkpointing import parse_checkpointing

        return parse_checkpointing(value)
    except UsageError as exc:
        raise SettingError("checkpointing", escape(str(exc))) from None


def _lora(value):
    from memcheck.training.adapters import Lora

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
    from memcheck.training.strategies.layout import Layout

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


# One row a field, in the order the docs list them: read from each field's declaration (``setting``)
SPELLINGS: tuple[Spelling, ...] = tuple(_spelling(f.name, f.metadata["setting"]) for f in dataclasses.fields(Job)
                                        if "setting" in f.metadata)
SPELLING = {s.field: s for s in SPELLINGS}
# field -> the function that checks a value and returns it normalised (idempotent)
_CHECKS = {s.field: functools.partial(s.check, s.field) for s in SPELLINGS}


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
