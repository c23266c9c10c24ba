"""``MemcheckCallback`` for the transformers ``Trainer``: the job checked before step 1.

Example:
    >>> from memcheck.integrations.transformers import MemcheckCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
    ...                   callbacks=[MemcheckCallback(gpu="A100-80GB")])
    >>> trainer.train()   # raises memcheck.WillNotFit before step 1 if the job will not fit

At ``on_train_begin`` the callback reads the job from ``TrainingArguments`` and the
model, builds the worst-case batch (every sequence padded to the longest length, see
``memcheck.workloads.hf.make_batch``), and runs ``memcheck.check`` on a meta twin of the model
(no weights are copied). The ``Verdict`` is kept as ``callback.verdict``. A job that
fits is logged in one line (logger ``memcheck.integrations.transformers``, level INFO);
a job that does not fit raises ``memcheck.WillNotFit``, whose message is the verdict
and the fix in ``TrainingArguments`` terms.

Why raise rather than set ``control.should_training_stop``: the Trainer reads that flag
only after a step, and then ends ``train()`` normally, as if the job had finished; a
job that will not fit would run its first step (and crash there) or end silently.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import os
from typing import Any

import torch
from transformers import TrainerCallback

from memcheck.engine.setup import meta_twin
from memcheck.engine.preflight import check
from memcheck.enums import FsdpSharding, Task
from memcheck.errors import UsageError, require_int
from memcheck.integrations._common import (
    CallbackSettings,
    act_on,
    first_batch,
    target,
)
from memcheck.job import Job
from memcheck.workloads.trainer_files import deepspeed_mode, fsdp1_sharding, fsdp_mixed_precision, zero_strategy
from memcheck.training.optimizers import hf_optimizer
from memcheck.report.results import Verdict
from memcheck.workloads import hf

logger = logging.getLogger(__name__)

# Optimizer classes outside torch.optim whose memory memcheck models by name: their own
# step() does not run on meta tensors (Adafactor's lr, bitsandbytes' CUDA kernels).
_CLASS_NAMES = {"Adafactor": "adafactor", "AdamW8bit": "adamw-8bit", "PagedAdamW8bit": "adamw-8bit"}
# PreTrainedTokenizerBase's model_max_length when the tokenizer names no limit (VERY_LARGE_INTEGER = int(1e30)).
_NO_TOKENIZER_LIMIT = int(1e29)
_TRAINER_FRAMES = 8  # Trainer._inner_training_loop -> CallbackHandler.on_train_begin -> call_event -> here


class MemcheckCallback(TrainerCallback):
    """Checks the job's peak memory at ``on_train_begin`` and stops it before step 1 if it will not fit.

    Args:
        gpu: the GPU the job runs on, a name (``"A100-80GB"``) or a size (``"24GiB"``); by
            default the local GPU. Only for a job on CUDA.
        budget_bytes: the capacity in bytes: required for a job on the CPU; on CUDA it
            overrides the GPU's.
        max_length: the longest sequence the job feeds (every sequence is padded to it);
            by default ``SFTConfig.max_length`` (TRL), else the tokenizer's ``model_max_length``,
            else the model's position limit.
        target_length: a seq2seq model's label length (default ``max_length``).
        margin: the fraction of the capacity held back (default memcheck's 5%).
        check_eval: also check the evaluation pass, when the job evaluates.
        fix: look for a fix when the job will not fit (a few more traces).

    What it reads:
        From ``TrainingArguments``: ``per_device_train_batch_size``,
        ``gradient_accumulation_steps``, ``gradient_checkpointing`` (as the Trainer set
        it up on the model, ``every_n_layers`` included), ``fp16``/``bf16`` (mixed
        precision; pure bf16/fp16 when the model's weights already are), the optimizer
        the Trainer built (else ``optim``, see ``HF_OPTIMIZERS``), ``per_device_eval_batch_size``,
        ``eval_strategy``, ``eval_accumulation_steps``, ``prediction_loss_only``, the
        device, the world size, ``n_gpu`` (DataParallel), ``fsdp`` and ``deepspeed`` (the
        ZeRO stage and its offload). Evaluation keeps every batch's predictions on the
        device unless ``eval_accumulation_steps`` moves them off: the callback counts the
        evaluation set's batches, and counts none without ``compute_metrics`` (the Trainer
        then keeps only the loss). The Trainer is not passed to callbacks; its
        ``compute_metrics`` and ``eval_dataset`` are read from the Trainer that fired the event.

        A Trainer subclass with its own ``compute_loss`` has it traced as it runs, on the
        meta twin (TRL's ``SFTTrainer``: its fused LM head, the entropy and token accuracy it
        logs; see ``_trainer_loss``); the counters it keeps on the trainer are put back
        afterwards. TRL's ``SFTConfig.max_length`` is the worst-case length when the callback
        is given none.

    Known limitations:
        Predictions shrunk by ``preprocess_logits_for_metrics`` are not counted; labels
        kept for metrics are not counted. Under FSDP or DeepSpeed ZeRO-3 the model is
        already sharded at ``on_train_begin`` and cannot be twinned. A model without a
        transformers config is checked on the first training batch, which is not
        necessarily the worst case (a warning says so).
    """

    def __init__(self, gpu: str | None = None, budget_bytes: int | None = None, max_length: int | None = None,
                 target_length: int | None = None, margin: float | None = None, check_eval: bool = True,
                 fix: bool = True):
        self.settings = CallbackSettings(gpu=gpu, budget_bytes=budget_bytes, margin=margin, check_eval=check_eval,
                                         fix=fix)
        for name, value in (("max_length", max_length), ("target_length", target_length)):
            if value is not None:
                require_int(value, name)
        self.max_length, self.target_length = max_length, target_length
        self.verdict: Verdict | None = None

    def on_train_begin(self, args, state, control, model=None, processing_class=None, tokenizer=None,
                       optimizer=None, train_dataloader=None, eval_dataloader=None, **kwargs):
        if model is None:
            raise UsageError("MemcheckCallback.on_train_begin got no model; it runs inside transformers.Trainer")
        trainer = _calling_trainer()
        twin = meta_twin(model)  # meta parameters: every trace below starts from this, never from the weights
        checkpointing, use_reentrant = _checkpointing(args, twin)
        strategy, gpus, extra = _strategy(args)
        batch_size = require_int(args.per_device_train_batch_size, "per_device_train_batch_size")
        job = Job(  # the Trainer's own arguments, in memcheck's words
            batch_size=batch_size, accumulate=args.gradient_accumulation_steps, precision=_precision(args, model),
            checkpointing=checkpointing, use_reentrant=use_reentrant, strategy=strategy, gpus=gpus,
            optimizer=_optimizer(args, optimizer), margin=self.settings.margin,
            max_grad_norm=float(args.max_grad_norm or 0),  # the Trainer clips when it is above 0
            packing=_packing(args), step_order="hf",  # model.zero_grad() after optimizer.step(): trainer.py:1946
            **target(args.device, self.settings), **extra,
        )
        config = getattr(model, "config", None)
        task = _task(config, model)
        eval_batch = None
        if task is not None:
            length = self._max_length(args, processing_class or tokenizer, config)
            target_len = self.target_length or length
            target_len = target_len if task is Task.SEQ2SEQ else None

            def batch(n, length=length, target=target_len):  # meta tensors: the worst case costs nothing
                return hf.make_batch(twin, config, task, n, length, target, packing=job.packing)

            job = job.replace(max_len=length, target_len=target_len)
        else:
            if train_dataloader is None:
                raise UsageError(f"{type(model).__name__} has no transformers config to build the worst-case "
                                 "batch from, and the Trainer passed no train dataloader")
            logger.warning("memcheck: %s has no transformers config; checking the first training batch, which "
                           "is not necessarily the worst case", type(model).__name__)
            batch = first_batch(train_dataloader)
            job = job.replace(batch_size=None)
        if self.settings.check_eval and _evaluates(args, trainer):
            eval_rows = require_int(args.per_device_eval_batch_size, "per_device_eval_batch_size")
            eval_rows *= gpus if strategy == "dp" else 1  # DataParallel scatters the whole batch
            keep = _kept_eval_batches(args, trainer, eval_dataloader)
            if callable(batch):
                job = job.replace(eval_batch_size=eval_rows, eval_accumulate_predictions=keep)
            else:
                from memcheck.engine.preflight import resizer

                eval_batch = resizer(batch)(eval_rows)
                job = job.replace(eval_accumulate_predictions=keep)
        with _state_kept(trainer):  # the trainer's own compute_loss runs on the twin: its counters are put back
            # torch_compile: the Trainer's accelerator compiles the model it trains (accelerate/accelerator.py:1710,
            # torch.compile(model, **dynamo_plugin.to_kwargs())); estimate traces it eagerly and says so
            traced = torch.compile(twin) if getattr(args, "torch_compile", False) else twin
            verdict = check(traced, batch, job, eval_batch=eval_batch, fix=self.settings.fix,
                            loss_fn=_trainer_loss(trainer), model_name=type(model).__name__)
        self.verdict = verdict  # kept for a caller that catches WillNotFit too
        # transformers logs at WARNING by default (its "passive" log level): a fitting job says so there
        act_on(verdict, "trainer", logger, announce=state.is_world_process_zero, level=logging.WARNING)
        return control

    def _max_length(self, args, tokenizer, config) -> int:
        """The explicit max_length, else the trainer's own truncation length (TRL's
        ``SFTConfig.max_length``), else the tokenizer's, each capped at the model's position
        limit, past which the model cannot run; else the position limit."""
        limit, key = hf.position_limit(config)
        if self.max_length is not None:
            if limit is not None and self.max_length > limit:
                raise UsageError(f"max_length={self.max_length} exceeds the model's position limit of {limit} "
                                 f"(config.{key})")
            return self.max_length
        truncated = getattr(args, "max_length", None)  # TRL's SFTConfig: every sample truncated (or packed) to it
        if isinstance(truncated, int) and not isinstance(truncated, bool) and truncated > 0:
            return min(truncated, limit) if limit is not None else truncated
        told = getattr(tokenizer, "model_max_length", None)
        if isinstance(told, int) and 0 < told < _NO_TOKENIZER_LIMIT:
            return min(told, limit) if limit is not None else told
        if limit is None:
            raise UsageError("the tokenizer names no model_max_length and the model's config no position limit; "
                             "give MemcheckCallback(max_length=...)")
        return limit


def _calling_trainer():
    """The Trainer whose event called the callback, or None.

    Callback events get the model, the tokenizer and the dataloaders but not the Trainer,
    whose ``compute_metrics`` decides whether evaluation keeps predictions at all and whose
    ``eval_dataset`` how many (the eval dataloader is built only when evaluation starts).
    The Trainer is the ``self`` of the frame that fired the event, a few frames up.
    """
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(_TRAINER_FRAMES):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
        return None
    finally:
        del frame


def _trainer_loss(trainer):
    """The loss as the Trainer computes it, when its class has its own ``compute_loss``; None
    for transformers' own, which is ``model(**batch).loss`` (memcheck's default loss).

    TRL's ``SFTTrainer`` (trl 1.16) is one: its ``compute_loss`` (trl/trainer/sft_trainer.py:1560)
    calls the model with ``fused_lm_head=True``, whose forward (``add_fused_lm_head``,
    trl/trainer/utils.py:1548, set up at sft_trainer.py:1144 with ``outputs=("log_probs",
    "entropy", "is_top1")``) projects the hidden states through the LM head in tiles
    (``ChunkedLogProbFunction``, trl/kernels/chunked_logprob.py:299) into per-token
    log-probabilities, entropy and top-1 hits instead of the full logits; the loss is the
    log-probabilities' mean, and the entropy and token accuracy it logs each step come from
    the other two (sft_trainer.py:1639-1644). All of that is traced as it runs, on the twin.
    """
    from transformers import Trainer

    if trainer is None or type(trainer).compute_loss is Trainer.compute_loss:
        return None

    def loss(model, batch):
        return trainer.compute_loss(model, dict(batch))  # a copy: compute_loss writes into its inputs

    return loss


_PLAIN = (int, float, str, bool, type(None))


def _plain(value, depth: int = 0) -> bool:
    """A number or string, or a list or dict of them (three levels at most)."""
    if isinstance(value, _PLAIN):
        return True
    if depth < 3 and isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


@contextlib.contextmanager
def _state_kept(trainer):
    """The trainer's numbers, and lists and dicts of them, put back as they were after the
    traces: a ``compute_loss`` keeps running totals on the trainer (SFTTrainer's ``_metrics``
    and ``_total_train_tokens``, sft_trainer.py:1643-1657), and a trace's synthetic values
    (``.item()`` reads 1 on meta) must not reach the real run's logs."""
    saved = {k: copy.deepcopy(v) for k, v in vars(trainer).items() if _plain(v)} if trainer is not None else {}
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(trainer, key, value)


def _task(config, model):
    """The task whose worst-case batch memcheck builds, or None to check the first training batch:
    audio models (raw audio, log-mel features) are sized by the processor, which the callback
    does not see."""
    if config is None:
        return None
    try:
        task = hf.infer_task(config, model)
    except UsageError:
        return None
    return task if hf.known_kind(model, config, task) in (hf.TEXT, hf.IMAGE, hf.IMAGE_TEXT) else None


def _packing(args) -> bool:
    """Whether TRL's SFTTrainer flattens each batch into one packed row: its own rule,
    ``args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})``
    (trl/trainer/sft_trainer.py, "BFD packing requires padding-free mode"). The "wrapped" strategy
    packs rows of max_length with an attention mask, whose worst case is the padded batch's.
    TrainingArguments have none of these: False."""
    if getattr(args, "padding_free", False) is True:
        return True
    return getattr(args, "packing", False) is True and getattr(args, "packing_strategy", "bfd") in ("bfd", "bfd_split")


def _precision(args, model) -> str:
    """Pure bf16/fp16 when the weights already are (a model loaded in that dtype); otherwise
    fp16=True / bf16=True are the Trainer's autocast (mixed precision), except under DeepSpeed,
    where they fill its config's ``bf16.enabled`` / ``fp16.enabled``: DeepSpeed's bf16/fp16 mode,
    bf16 weights with an fp32 master, pure ``bf16`` (``trainer_files.deepspeed_mode``)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes == {torch.bfloat16}:
        return "bf16"
    if dtypes == {torch.float16}:
        return "fp16"
    precision = "amp-bf16" if args.bf16 else "amp-fp16" if args.fp16 else "fp32"
    if args.deepspeed and int(args.world_size) > 1:  # _strategy reads the same config
        ds = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
        if ds is not None:
            precision = deepspeed_mode(precision, ds, zero_strategy(ds, 2)[0]) or "fp32"
    return precision


def _checkpointing(args, twin) -> tuple[str | tuple[str, ...], bool]:
    """The checkpointing the job runs with, and its ``use_reentrant``.

    The Trainer turns transformers' own checkpointing on before ``on_train_begin`` (and a
    user may have): the twin inherits the flags, so they are read from it, which also
    tells ``every_n_layers`` (the layers flagged) and the kwargs given. Then they are
    turned off on the twin and handed to memcheck as ``full`` or the flagged layers'
    names, so that the fix's search compares with and without checkpointing.
    """
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before 4.52 flags the stack, not each layer
        GradientCheckpointingLayer = ()
    flagged = [m for m in twin.modules() if getattr(m, "gradient_checkpointing", False) is True]
    disable = getattr(twin, "activation_checkpointing_disable", None) or getattr(
        twin, "gradient_checkpointing_disable", None)
    if not flagged or disable is None:
        # Not applied yet (or not by transformers, and then traced as it runs).
        on = bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))
        kwargs = (getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
        reentrant = kwargs.get("use_reentrant", False) if isinstance(kwargs, dict) else False
        return ("full" if on and not flagged else "none"), bool(reentrant)
    func = getattr(flagged[-1], "_gradient_checkpointing_func", None)
    reentrant = bool((getattr(func, "keywords", None) or {}).get("use_reentrant", False))
    layers = [(n, m) for n, m in twin.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    chosen = tuple(n for n, m in layers if m.gradient_checkpointing)
    disable()
    return ("full" if not layers or len(chosen) == len(layers) else chosen), reentrant


def _strategy(args) -> tuple[str, int | None, dict]:
    """memcheck's strategy, GPU count and strategy settings for the Trainer's launch."""
    world = max(int(args.world_size), 1)
    if world < 2:
        n_gpu = int(getattr(args, "n_gpu", 1) or 1)
        return ("dp", n_gpu, {}) if n_gpu > 1 else ("single", None, {})
    if args.deepspeed:
        ds = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
        if ds is None:
            raise UsageError(f"deepspeed={args.deepspeed!r}: its config was not loaded by TrainingArguments")
        return zero_strategy(ds, world)
    if args.fsdp:
        fsdp = args.fsdp_config if isinstance(getattr(args, "fsdp_config", None), dict) else {}
        offloaded = "offload" in str(args.fsdp) or bool(fsdp.get("cpu_offload"))
        extra = {"offload": "params"} if offloaded else {}
        precision = "amp-bf16" if getattr(args, "bf16", False) else "amp-fp16" if getattr(args, "fp16", False) else None
        if str(fsdp.get("version", 2)).strip() == "1":
            extra.update(_fsdp1_sharding(args.fsdp, fsdp, world))
            return "fsdp1", world, {**extra, **fsdp_mixed_precision(precision, "fsdp1", extra["fsdp_sharding"])}
        return "fsdp", world, {**extra, **fsdp_mixed_precision(precision, "fsdp", output_dtype=True)}
    cap = getattr(args, "ddp_bucket_cap_mb", None)
    return "ddp", world, ({"bucket_cap_mb": cap} if cap else {})


def _fsdp1_sharding(words, fsdp_config: dict, world: int) -> dict:
    """fsdp1's settings for ``fsdp_config["version"] == 1`` (training_args.py, ``_fsdp_plugin_args``:
    FSDP1's sharding strategy is ``fsdp_config["reshard_after_forward"]``, default ``"full_shard"``,
    or the strategy word of the legacy ``fsdp`` string). ``hybrid_shard`` shards over the GPUs
    of this node, as FSDP1 does without a mesh (torch/distributed/fsdp/_init_utils.py:160-163,
    ``device_count()``), read from the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, accelerate) so that
    no device is probed here. The Trainer's FSDP1 default ``backward_prefetch="NO_PREFETCH"`` is not
    modelled: memcheck gathers one unit ahead (torch's ``BACKWARD_PRE``), an upper bound."""
    listed = words.split() if isinstance(words, str) else list(words) if isinstance(words, (list, tuple)) else []
    named = [w for w in listed if str(w).lower() in {s.value for s in FsdpSharding} | {"hybrid_shard_zero2"}]
    sharding = fsdp1_sharding(fsdp_config.get("reshard_after_forward", named[0] if named else "full_shard"),
                              where="fsdp_config reshard_after_forward")
    out: dict = {"fsdp_sharding": sharding}
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(local) if local.isdigit() else 0
    if sharding == "hybrid_shard" and 0 < per_node < world and world % per_node == 0:
        out["gpus_per_node"] = per_node
    return out


def _optimizer(args, optimizer) -> Any:
    """The Trainer's own optimizer (its class and settings are reused), or memcheck's name for it."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the real one
    if isinstance(optimizer, torch.optim.Optimizer):
        if type(optimizer).__module__.startswith("torch.optim"):
            return optimizer
        if type(optimizer).__name__ in _CLASS_NAMES:
            return _CLASS_NAMES[type(optimizer).__name__]
        return optimizer
    return hf_optimizer(args.optim, getattr(args, "optim_args", None))


def _evaluates(args, trainer) -> bool:
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if strategy == "no" and not getattr(args, "eval_on_start", False):
        return False
    return trainer is None or trainer.eval_dataset is not None


def _kept_eval_batches(args, trainer, eval_dataloader) -> int:
    """How many evaluation batches' predictions the Trainer holds on the device at once.

    ``Trainer.evaluation_loop`` concatenates every batch's predictions on the device and
    moves them off only every ``eval_accumulation_steps`` batches (None: at the end).
    Each batch's predictions are gathered from every process first, so a process holds
    ``world_size`` batches' worth per step.
    """
    if args.prediction_loss_only or getattr(args, "batch_eval_metrics", False):
        return 0
    if trainer is not None:
        if trainer.compute_metrics is None:  # Trainer.evaluate then passes prediction_loss_only=True
            return 0
        if trainer.preprocess_logits_for_metrics is not None:
            logger.warning("memcheck: predictions reduced by preprocess_logits_for_metrics are not counted")
            return 0
    world = max(int(args.world_size), 1)
    steps = _eval_steps(args, trainer, eval_dataloader, world)
    if args.eval_accumulation_steps:
        every = args.eval_accumulation_steps
        return min(every, steps) * world if steps else every * world
    if steps is None:
        logger.warning("memcheck: the evaluation set's size is unknown; counting one batch of predictions kept")
        return world
    return steps * world


def _eval_steps(args, trainer, eval_dataloader, world: int) -> int | None:
    """Evaluation batches per process, from the eval dataloader or the Trainer's eval dataset."""
    if eval_dataloader is not None:
        try:
            return len(eval_dataloader)
        except TypeError:
            return None
    datasets = getattr(trainer, "eval_dataset", None)
    if datasets is None:
        return None
    rows = args.per_device_eval_batch_size * max(int(getattr(args, "n_gpu", 1) or 1), 1) * world
    try:
        sizes = [len(d) for d in (datasets.values() if isinstance(datasets, dict) else [datasets])]
    except TypeError:  # an IterableDataset
        return None
    return max(math.ceil(n / rows) for n in sizes) if sizes else None
