"""A DeepSpeed JSON config as a job (issue 21): ``memcheck check ds_config.json --model MODEL``.

``read_deepspeed`` maps the keys of a DeepSpeed 0.19.8 config (``deepspeed.runtime.config.
DeepSpeedConfig``) to memcheck config keys (``memcheck.job.SPELLINGS``), and lists what it
read but does not model as notes. It reads no file: ``memcheck.config_gate`` does
(``JobConfig.from_deepspeed`` for the CLI, ``deepspeed_job`` for the Python API, a ``Job``).

=========================================  ============================================
DeepSpeed                                  memcheck
=========================================  ============================================
``zero_optimization.stage`` 0              ``ddp`` (``single`` on one GPU), noted: the
                                           engine's own all-reduce is not DDP's
``zero_optimization.stage`` 1 / 2 / 3      ``zero1`` / ``zero2`` / ``zero3``
``offload_optimizer.device = "cpu"``       ``offload = "optimizer"``
``offload_param`` + ``offload_optimizer``  ``offload = "params"`` (zero3)
``bf16.enabled`` / ``fp16.enabled``        ``precision = "bf16"`` / ``"fp16"`` (ZeRO's bf16
                                           weights with an fp32 master); refused at stage 0
``torch_autocast.enabled``                 ``precision = "amp-bf16"`` / ``"amp-fp16"``
``train_micro_batch_size_per_gpu``         ``micro_batch``
``gradient_accumulation_steps``            ``accumulation``
``train_batch_size``                       checked: micro x accumulation x GPUs
``gradient_clipping``                      ``max_grad_norm``
``optimizer.type`` Adam / AdamW / SGD      ``adamw-fused`` (``adam-fused`` without
                                           ``adam_w_mode``; ``adamw`` with ``torch_adam``),
                                           ``sgd`` / ``sgd-momentum``
``reduce_bucket_size``                     ``reduce_bucket_size``
``stage3_prefetch_bucket_size``            ``prefetch_bucket_size``
``stage3_max_live_parameters``             ``max_live_parameters``
=========================================  ============================================

The world size is not in a DeepSpeed config (the launcher gives it): ``gpus`` when given,
else ``train_batch_size / (micro x accumulation)`` when all three are numbers, else
memcheck's default of 2 GPUs, noted. The batch keys are completed and checked as DeepSpeed
does (``DeepSpeedConfig._configure_train_batch_size``): a file whose three disagree is refused.

``"auto"`` values are the HF Trainer's (``transformers/integrations/deepspeed.py``,
``trainer_config_process``/``trainer_config_finalize``): a batch key is filled from the
other two (``train_batch_size = world x micro x accumulation``), ``reduce_bucket_size`` from
the model config's hidden size (``h*h``; ``stage3_prefetch_bucket_size`` ``int(0.9*h*h)``,
``stage3_param_persistence_threshold`` ``10*h``, at stage 3); any other ``"auto"`` (the
precision, the clipping) is filled by the Trainer from its own arguments, which memcheck
does not have: it is refused, naming the key.

Unknown keys are treated as DeepSpeed treats them: inside ``zero_optimization``, its
``offload_*`` sections, ``bf16`` and ``fp16`` (pydantic models that forbid extra keys) they
are an error; at the top level and in the other sections DeepSpeed ignores them, and so
does memcheck, listing each in a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from memcheck.errors import UsageError, closest

AUTO = "auto"
# memcheck's GPUs for a multi-GPU strategy when none is given (memcheck.training.strategies.base.StrategyConfig)
DEFAULT_WORLD = 2
# DeepSpeed 0.19.8's engine.py MEMORY_OPT_ALLREDUCE_SIZE: stage 0's all-reduce flattens gradients in buckets this big
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000

# deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig) 0.19.8: every field, by its name or alias, and
# its default ("stage3_*" keys are the aliases DeepSpeed documents; the bare names are accepted too,
# populate_by_name). None: no fixed default (overlap_comm: True at stage 3, else False).
ZERO_KEYS: dict[str, Any] = {
    "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 500_000_000,
    "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True, "allgather_bucket_size": 500_000_000,
    "overlap_comm": None, "compute_grad_norm": True, "load_from_fp32_weights": True, "elastic_checkpoint": False,
    "offload_param": None, "offload_optimizer": None, "zenflow": None, "sub_group_size": 1_000_000_000,
    "cpu_offload_param": None, "cpu_offload_use_pin_memory": None, "cpu_offload": None,
    "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": None, "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000, "stage3_gather_16bit_weights_on_model_save": False,
    "stage3_module_granularity_threshold": 0, "stage3_use_all_reduce_for_fetch_params": False,
    "stage3_allgather_sequential": False, "stage3_gather_fp16_weights_on_model_save": False,
    "ignore_unused_parameters": True, "legacy_stage1": False, "round_robin_gradients": False,
    "parameter_alignment": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False, "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False, "override_module_apply": True, "log_trace_cache_warnings": False,
    "enable_sanity_checks": False, "save_muon_momentum_buffer_in_memory": False, "leaf_module": None,
}
_ZERO_NAMES = {  # the bare field names DeepSpeed accepts for the stage3_* aliases
    "prefetch_bucket_size": "stage3_prefetch_bucket_size", "param_persistence_threshold":
    "stage3_param_persistence_threshold", "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters", "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
# deepspeed/runtime/zero/offload_config.py: the offload sections' fields and defaults
OFFLOAD_PARAM_KEYS = {"device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000,
                      "max_in_cpu": 1_000_000_000, "pin_memory": True}
OFFLOAD_OPTIMIZER_KEYS = {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True,
                          "pipeline_read": False, "pipeline_write": False, "fast_init": False, "ratio": 1.0,
                          "super_offload": False, "cpuadam_cores_perc": 0.8}
# deepspeed/runtime/precision_config.py: DeepSpeedBF16Config, DeepSpeedFP16Config
BF16_KEYS = {"enabled": False, "immediate_grad_update": False, "check_grad_overflow": True,
             "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
FP16_KEYS = {"enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
             "fp16_master_weights_and_grads": False}
# deepspeed/runtime/activation_checkpointing/config.py
ACTIVATION_CHECKPOINTING_KEYS = {"partition_activations": False, "contiguous_memory_optimization": False,
                                 "cpu_checkpointing": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False}
# Section keys that change nothing a rank's training step holds on the GPU: read, never noted.
_NO_MEMORY = {
    "bf16.check_grad_overflow", "fp16.auto_cast", "fp16.loss_scale", "fp16.initial_scale_power",
    "fp16.loss_scale_window", "fp16.hysteresis", "fp16.consecutive_hysteresis", "fp16.min_loss_scale",
    "activation_checkpointing.synchronize_checkpoint_boundary", "activation_checkpointing.profile",
    "activation_checkpointing.number_checkpoints",
    *(f"zero_optimization.{k}" for k in (
        "load_from_fp32_weights", "elastic_checkpoint", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "log_trace_cache_warnings",
        "enable_sanity_checks", "pipeline_loading_checkpoint", "cpu_offload_use_pin_memory", "leaf_module")),
    *(f"zero_optimization.offload_{s}.{k}" for s in ("param", "optimizer")
      for k in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "nvme_path", "pipeline_read",
                "pipeline_write", "fast_init", "cpuadam_cores_perc")),
}
# The top-level keys DeepSpeed 0.19.8 reads (DeepSpeedConfig and the sections' own readers); others it ignores.
# Those that change nothing on the GPU in a training step (logging, monitoring, checkpoint files, the
# scheduler, the learning rate) are read and not noted.
QUIET_KEYS = frozenset({
    "scheduler", "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "log_level",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "timers", "flops_profiler", "monitor_config",
    "checkpoint", "nebula", "datastates_ckpt", "autotuning", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "dataloader_drop_last", "disable_python_gc", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "vocabulary_size",
})
NOT_MODELLED_KEYS = frozenset({
    "amp", "communication_data_type", "seq_parallel_communication_data_type", "compile", "compression_training",
    "curriculum_learning", "data_efficiency", "data_types", "disable_allgather", "eigenvalue", "elasticity",
    "expert_parallel", "graph_harvesting", "hybrid_engine", "managed_gradient_accumulation", "pipeline",
    "progressive_layer_drop", "quantize_training", "sparse_attention", "sparse_gradients", "tensor_parallel",
    "use_data_before_expert_parallelism", "weight_quantization", "aio", "sequence_parallel_size",
})
_MAPPED = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "zero_optimization", "bf16", "bfloat16", "fp16", "torch_autocast", "activation_checkpointing",
})
# optimizer.type (DeepSpeed lowercases it: engine.py _configure_basic_optimizer) -> memcheck's optimizer
_OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config says of the job, in memcheck config keys."""

    settings: dict[str, Any]  # memcheck config keys (memcheck.job.SPELLINGS .config)
    notes: tuple[str, ...] = ()  # what was read and is not modelled, each naming its key
    auto: tuple[str, ...] = ()  # zero_optimization keys "auto", filled from the model's hidden size
    stage: int = 0
    world_given: bool = False


def looks_like_deepspeed(data: Any) -> bool:
    """Whether ``data`` is a DeepSpeed config rather than memcheck's own: keys only DeepSpeed uses."""
    return isinstance(data, dict) and (
        any(k in data for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization"))
        or isinstance(data.get("bf16"), dict) or isinstance(data.get("fp16"), dict))


def read_deepspeed(data: Mapping[str, Any], *, gpus: int | None = None) -> DeepSpeedSettings:
    """The job a DeepSpeed config describes, as memcheck config keys, with its notes.

    Args:
        data: the config's JSON object.
        gpus: the world size (the launcher's; a DeepSpeed config has none).

    Raises:
        UsageError: naming the key, for a wrong type, an unknown key where DeepSpeed refuses one, an
            "auto" memcheck cannot fill, batch sizes that disagree, or a mode memcheck does not model.
    """
    if not isinstance(data, Mapping):
        raise UsageError(f"a DeepSpeed config is a JSON object, not a {type(data).__name__}")
    notes: list[str] = []
    settings: dict[str, Any] = {}
    stage, zero = _zero_section(data)
    world, world_given = _world(data, gpus, notes)
    settings.update(_batch(data, world))
    auto = _zero_settings(zero, stage, settings, notes)
    settings.update(_strategy(stage, world, notes))
    precision = deepspeed_precision(data, stage)
    if precision is not None:
        settings["precision"] = precision
    clip = data.get("gradient_clipping")
    if clip is not None:
        if clip == AUTO:
            raise UsageError(_auto_refused("gradient_clipping", "max_grad_norm (1.0 by default)", "a number"))
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < float("inf"):
            raise UsageError(f"gradient_clipping must be a number of 0 or more (0: none), got {clip!r}")
        if clip:
            settings["max_grad_norm"] = float(clip)
    optimizer = _optimizer(data.get("optimizer"), notes)
    if optimizer is not None:
        settings["optimizer"] = optimizer
    _activation_checkpointing(data.get("activation_checkpointing"), notes)
    for key, value in data.items():
        if key in _MAPPED or key in QUIET_KEYS:
            continue
        if key in NOT_MODELLED_KEYS:
            if not (isinstance(value, dict) and value.get("enabled") is False):
                notes.append(f"{key}: read, not modelled")
        else:
            notes.append(f"{key!r}: not a DeepSpeed key{closest(str(key), [*_MAPPED, *QUIET_KEYS])}; ignored, "
                         "as DeepSpeed ignores it")
    return DeepSpeedSettings(settings, tuple(notes), auto, stage, world_given)


def fill_auto(read: DeepSpeedSettings, hidden_size: int | None, model_name: str = "the model") -> dict[str, Any]:
    """The settings of ``read`` with its hidden-size "auto" keys filled as the HF Trainer fills them
    (``trainer_config_finalize``); UsageError naming the keys when there is no hidden size."""
    if not read.auto:
        return dict(read.settings)
    if hidden_size is None:
        keys = ", ".join(f"zero_optimization.{k}" for k in read.auto)
        raise UsageError(f"{keys} is \"auto\", which the HF Trainer fills from the model config's hidden_size, and "
                         f"{model_name} has no config.hidden_size (or hidden_sizes); give a number of elements")
    out = dict(read.settings)
    h = hidden_size
    if "reduce_bucket_size" in read.auto:
        out["reduce_bucket_size"] = h * h
    if "stage3_prefetch_bucket_size" in read.auto:
        out["prefetch_bucket_size"] = int(0.9 * h * h)
    return out


def model_hidden_size(model) -> int | None:
    """The model config's hidden size as the HF Trainer takes it (``hidden_size``, else the largest of
    ``hidden_sizes``, also in ``text_config``); None without one."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        h = getattr(c, "hidden_size", None)
        if isinstance(h, int) and not isinstance(h, bool) and h > 0:
            return h
        hs = getattr(c, "hidden_sizes", None)
        if isinstance(hs, (list, tuple)) and hs and all(isinstance(x, int) and x > 0 for x in hs):
            return max(hs)
    return None


# ---- the sections ---------------------------------------------------------------------------------


def _auto_refused(key: str, source: str, what: str) -> str:
    return (f"{key} is \"auto\", which the HF Trainer fills from its own {source}; memcheck reads the DeepSpeed "
            f"config alone: give {what}")


def _count(data: Mapping, key: str, *, minimum: int = 1):
    """A positive integer key (an integral float such as 5e8 too, as DeepSpeed's pydantic takes it), "auto",
    or None when absent."""
    value = data.get(key)
    if value is None or value == AUTO:
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        worded = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise UsageError(f"{key} must be {worded} or \"auto\", got {value!r}")
    return value


def _world(data: Mapping, gpus, notes: list) -> tuple[int, bool]:
    """The world size: ``gpus``; else train_batch_size / (micro x accumulation) when all are numbers; else 2."""
    if gpus is not None:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise UsageError(f"gpus must be a positive integer, got {gpus!r}")
        return gpus, True
    tb, mb, gas = (_count(data, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps"))
    if all(isinstance(v, int) for v in (tb, mb, gas)):
        if tb % (mb * gas):
            raise UsageError(f"train_batch_size {tb} is not a multiple of train_micro_batch_size_per_gpu {mb} x "
                             f"gradient_accumulation_steps {gas}: no world size gives it (DeepSpeed refuses it too)")
        return tb // (mb * gas), True
    notes.append(f"world size: not given (--gpus) and not implied by the batch keys; memcheck's default "
                 f"{DEFAULT_WORLD} GPUs")
    return DEFAULT_WORLD, False


def _batch(data: Mapping, world: int) -> dict[str, Any]:
    """micro_batch and accumulation, completed and checked as DeepSpeedConfig._configure_train_batch_size does."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    tb, mb, gas = (_count(data, k) for k in keys)
    given = {k: v for k, v in zip(keys, (tb, mb, gas)) if isinstance(v, int)}
    for key, value in zip(keys, (tb, mb, gas)):
        if value == AUTO and len(given) < 2:
            source = {"train_batch_size": "world size x per_device_train_batch_size x gradient_accumulation_steps",
                      "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                      "gradient_accumulation_steps": "gradient_accumulation_steps"}[key]
            raise UsageError(_auto_refused(key, source, "a number (or numbers for two of train_batch_size, "
                                                        "train_micro_batch_size_per_gpu and "
                                                        "gradient_accumulation_steps)"))
    tb, mb, gas = (given.get(k) for k in keys)
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // world
    elif tb is not None and gas is not None:
        mb = tb // world // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * world
    elif tb is not None:
        gas, mb = 1, tb // world
    elif mb is not None:
        gas, tb = 1, mb * world
    else:
        raise UsageError("either train_batch_size or train_micro_batch_size_per_gpu needs to be provided "
                         "(DeepSpeed's own rule)")
    if not mb or not gas or tb != mb * gas * world:
        raise UsageError(f"train_batch_size {tb} is not train_micro_batch_size_per_gpu {mb or 0} x "
                         f"gradient_accumulation_steps {gas or 0} x {world} GPU(s) = {(mb or 0) * (gas or 0) * world}; "
                         "DeepSpeed refuses this too (give --gpus the world size, or batch sizes that agree)")
    return {"micro_batch": mb, "accumulation": gas}


def _section(data: Mapping, key: str, known: dict | None, *, where: str = "") -> dict:
    """A section's object ({} when absent or null); with ``known``, an unknown key is refused (pydantic's
    extra="forbid" in DeepSpeed)."""
    name = f"{where}{key}"
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{name} must be a JSON object, got {value!r}")
    if known is not None:
        for k in value:
            if k not in known and not (key == "zero_optimization" and k in _ZERO_NAMES):
                raise UsageError(f"{name} has no key {k!r}{closest(str(k), known)}; DeepSpeed refuses unknown keys "
                                 f"here too")
    return value


def _flag(section: Mapping, key: str, name: str):
    value = section.get(key, None)
    if value is None or isinstance(value, bool):
        return value
    raise UsageError(f"{name} must be true or false, got {value!r}")


def _zero_section(data: Mapping) -> tuple[int, dict]:
    raw = data.get("zero_optimization")
    if isinstance(raw, bool):  # DeepSpeed's legacy form: true is stage 1
        return int(raw), {}
    zero = _section(data, "zero_optimization", ZERO_KEYS)
    zero = {_ZERO_NAMES.get(k, k): v for k, v in zero.items()}
    stage = zero.get("stage", 0)
    if isinstance(stage, float) and stage.is_integer():
        stage = int(stage)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise UsageError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return stage, zero


def _strategy(stage: int, world: int, notes: list) -> dict[str, Any]:
    if stage:
        return {"strategy": f"zero{stage}", "gpus": world}
    notes.append(f"zero_optimization.stage 0: traced as {'ddp' if world > 1 else 'single'}; DeepSpeed's engine "
                 f"all-reduces after backward through flattened gradient copies of up to "
                 f"{STAGE0_ALLREDUCE_ELEMENTS:.0e} elements (engine.py allreduce_bucket), not DDP's 25 MiB buckets: "
                 "not modelled, so the estimate can be low by up to one such copy")
    return {"strategy": "ddp", "gpus": world} if world > 1 else {"strategy": "single"}


def _zero_settings(zero: dict, stage: int, settings: dict, notes: list) -> tuple[str, ...]:
    """Offload and the modelled buffer sizes into ``settings``; notes for what is read and not modelled;
    the keys whose "auto" the model's hidden size fills."""
    auto = []
    offload_param = _section(zero, "offload_param", OFFLOAD_PARAM_KEYS, where="zero_optimization.")
    offload_opt = _section(zero, "offload_optimizer", OFFLOAD_OPTIMIZER_KEYS, where="zero_optimization.")
    devices = {}
    for name, section in (("offload_param", offload_param), ("offload_optimizer", offload_opt)):
        device = section.get("device", "none")
        if device is None:
            device = "none"
        if device not in ("none", "cpu", "nvme"):
            raise UsageError(f"zero_optimization.{name}.device must be \"none\", \"cpu\" or \"nvme\", got {device!r}")
        if device == "nvme":
            raise UsageError(f"zero_optimization.{name}.device \"nvme\" is not modelled (memcheck models offload to "
                             "the CPU); estimate it with \"cpu\", whose GPU side is the same, or drop the offload")
        devices[name] = device == "cpu"
    for legacy, name in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if _flag(zero, legacy, f"zero_optimization.{legacy}"):  # deprecated forms (DeepSpeedZeroConfig new_param)
            devices[name] = True
    ratio = offload_opt.get("ratio", 1.0)
    if devices["offload_optimizer"] and ratio != 1.0:
        raise UsageError(f"zero_optimization.offload_optimizer.ratio {ratio!r}: a partial offload is not modelled "
                         "(memcheck offloads the whole optimizer, ratio 1.0)")
    if offload_opt.get("super_offload"):
        raise UsageError("zero_optimization.offload_optimizer.super_offload is not modelled")
    if stage == 0 and (devices["offload_optimizer"] or devices["offload_param"]):
        raise UsageError("zero_optimization offload needs stage 1, 2 or 3 (ZeRO-Offload); stage is 0")
    if stage == 3 and devices["offload_param"] and not devices["offload_optimizer"]:
        raise UsageError("zero_optimization.offload_param without offload_optimizer is not modelled: memcheck offloads "
                         "the parameters with the optimizer (add offload_optimizer {\"device\": \"cpu\"}) or the "
                         "optimizer alone")
    if stage in (1, 2) and devices["offload_param"]:
        notes.append(f"zero_optimization.offload_param: read, not modelled (DeepSpeed offloads parameters at stage 3 "
                     f"only; it ignores this at stage {stage})")
    if stage == 3 and devices["offload_param"]:
        settings["offload"] = "params"
    elif stage and devices["offload_optimizer"]:
        settings["offload"] = "optimizer"
    # the buffer sizes the zero emulation models (memcheck.training.strategies.zero)
    modelled = {"reduce_bucket_size": ("reduce_bucket_size", 1, 1),
                "stage3_prefetch_bucket_size": ("prefetch_bucket_size", 3, 0),
                "stage3_max_live_parameters": ("max_live_parameters", 3, 0)}
    for key, (setting, from_stage, minimum) in modelled.items():
        if key not in zero:
            continue
        if stage < from_stage:
            which = "stage 3" if from_stage == 3 else "stages 1-3"
            notes.append(f"zero_optimization.{key}: read, not modelled (used at {which}; this config is stage "
                         f"{stage})")
            continue
        if zero[key] == AUTO:
            if key == "stage3_max_live_parameters":
                raise UsageError(_auto_refused(f"zero_optimization.{key}", "settings (it has no rule for this key)",
                                               "a number of elements"))
            auto.append(key)
            continue
        if zero[key] is not None:
            settings[setting] = _count(zero, key, minimum=minimum)
    # read, traced at DeepSpeed's default: noted when the config sets another value
    for key, default in ZERO_KEYS.items():
        if key in modelled or key in ("stage", "offload_param", "offload_optimizer", "cpu_offload",
                                      "cpu_offload_param") or key not in zero:
            continue
        if f"zero_optimization.{key}" in _NO_MEMORY:
            continue
        value = zero[key]
        if key == "stage3_param_persistence_threshold" and value == AUTO:
            if stage == 3:
                notes.append("zero_optimization.stage3_param_persistence_threshold \"auto\": read, not modelled "
                             "(the HF Trainer sets 10 x hidden_size; memcheck traces DeepSpeed's default 1e5)")
            continue
        if key == "overlap_comm":
            default = stage == 3  # DeepSpeedZeroConfig.overlap_comm_valid: True at stage 3, else False
        if key.startswith("stage3_") and stage < 3:
            if value != default:
                notes.append(f"zero_optimization.{key}: read, not modelled (used at stage 3 only)")
            continue
        if key == "allgather_bucket_size":
            if stage in (1, 2):
                notes.append("zero_optimization.allgather_bucket_size: read, not modelled (DeepSpeed all-gathers the "
                             "updated partitions in place into the flat parameter buffer, with no bucket)")
            continue
        if value != default:
            notes.append(f"zero_optimization.{key} = {_json(value)}: read, not modelled (memcheck traces DeepSpeed's "
                         f"default, {_json(default)})")
    return tuple(auto)


def _json(value) -> str:
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def deepspeed_precision(data: Mapping, stage: int) -> str | None:
    """bf16/fp16 (DeepSpeed's modes: low-precision weights, an fp32 master in the optimizer) or
    torch_autocast (fp32 weights under torch.autocast) as memcheck's precision; None: fp32."""
    if "bfloat16" in data and "bf16" not in data:  # DeepSpeed's older name of the section
        data = {**data, "bf16": data["bfloat16"]}
    enabled = {}
    for key, known in (("bf16", BF16_KEYS), ("fp16", FP16_KEYS)):
        section = _section(data, key, known)
        value = section.get("enabled", False)
        if value == AUTO:
            raise UsageError(_auto_refused(f"{key}.enabled", f"{key} argument", "true or false"))
        enabled[key] = _flag(section, "enabled", f"{key}.enabled") or False
        if enabled[key]:
            for option in ("bf16_master_weights_and_grads", "bf16_optimizer_states", "fp16_master_weights_and_grads"):
                if section.get(option):
                    raise UsageError(f"{key}.{option} is not modelled: memcheck's {key} mode keeps an fp32 master "
                                     "and fp32 optimizer state, as DeepSpeed does by default")
    if enabled["bf16"] and enabled["fp16"]:
        raise UsageError("bf16 and fp16 are both enabled; DeepSpeed refuses that too (\"bfloat16 and fp16 modes "
                         "cannot be simultaneously enabled\")")
    autocast = _section(data, "torch_autocast", None)
    on = _flag(autocast, "enabled", "torch_autocast.enabled")
    if on:
        if enabled["bf16"] or enabled["fp16"]:
            raise UsageError("torch_autocast with bf16 or fp16 enabled is not modelled; use one of them")
        dtype = str(autocast.get("dtype", "bfloat16")).replace("torch.", "")
        amp = {"bfloat16": "amp-bf16", "bf16": "amp-bf16", "float16": "amp-fp16", "fp16": "amp-fp16",
               "half": "amp-fp16"}.get(dtype)
        if amp is None:
            raise UsageError(f"torch_autocast.dtype must be bfloat16 or float16, got {autocast.get('dtype')!r}")
        return amp
    low = "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else None
    if low is not None and stage == 0:
        raise UsageError(
            f"{low}.enabled at zero_optimization.stage 0 is not modelled: DeepSpeed's {low.upper()}_Optimizer keeps "
            f"{low} weights with an fp32 master and fp32 gradients, which no memcheck strategy traces (ddp with "
            f"precision {low} has no fp32 master; amp-{low} keeps fp32 weights); use stage 1-3, or estimate "
            f"memcheck MODEL --strategy ddp --precision amp-{low} as an approximation")
    return low


def _optimizer(section, notes: list) -> str | None:
    if section is None:
        notes.append("optimizer: none in the config, so the training script's own (memcheck: the model file's "
                     "make_optimizer, else adamw)")
        return None
    if not isinstance(section, dict):
        raise UsageError(f"optimizer must be a JSON object such as {{\"type\": \"AdamW\", \"params\": {{...}}}}, "
                         f"got {section!r}")
    kind = section.get("type")
    params = section.get("params") or {}
    if not isinstance(kind, str):
        raise UsageError(f"optimizer.type must be a string such as \"AdamW\", got {kind!r}")
    if not isinstance(params, dict):
        raise UsageError(f"optimizer.params must be a JSON object, got {params!r}")
    name = kind.lower()
    if name not in _OPTIMIZERS:
        raise UsageError(f"optimizer.type {kind!r} has no memcheck equivalent{closest(name, _OPTIMIZERS)}; memcheck "
                         "maps Adam, AdamW and SGD (or leave the optimizer section out to trace the script's own)")
    if name == "sgd":
        momentum = params.get("momentum", 0)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            raise UsageError(f"optimizer.params.momentum must be a number, got {momentum!r}")
        return "sgd-momentum" if momentum > 0 else "sgd"
    for key in ("adam_w_mode", "torch_adam"):
        _flag(params, key, f"optimizer.params.{key}")
    adamw = name == "adamw" or params.get("adam_w_mode", True)
    if params.get("torch_adam"):
        return "adamw" if adamw else "adam"  # torch.optim.AdamW / Adam (engine.py _configure_basic_optimizer)
    return "adamw-fused" if adamw else "adam-fused"  # DeepSpeed's FusedAdam: no step temporaries


def _activation_checkpointing(section, notes: list) -> None:
    if section is None:
        return
    if not isinstance(section, dict):
        raise UsageError(f"activation_checkpointing must be a JSON object, got {section!r}")
    notes.append("activation_checkpointing: configures deepspeed.checkpointing, which applies only where the model's "
                 "code calls it; memcheck checkpoints as --checkpointing says (torch.utils.checkpoint)")
    for key, value in section.items():
        if key not in ACTIVATION_CHECKPOINTING_KEYS:
            notes.append(f"activation_checkpointing.{key}: not a DeepSpeed key; ignored, as DeepSpeed ignores it")
        elif f"activation_checkpointing.{key}" not in _NO_MEMORY and value != ACTIVATION_CHECKPOINTING_KEYS[key]:
            notes.append(f"activation_checkpointing.{key} = {_json(value)}: read, not modelled")
