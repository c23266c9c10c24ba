"""transformers models: build from a config on the meta device, and the worst-case padded batch.

The architecture comes from ``config.architectures`` unless a task is given. The
batch pads every sequence to ``max_len`` (``padding='max_length'``), with one
padded position so that attention masks are materialised as in real padded data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from memcheck.enums import Attention, Task
from memcheck.errors import ModelLoadError, UsageError
from memcheck.job import SettingError, escape

_AUTO_CLASS = {
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.MASKED_LM: "AutoModelForMaskedLM",
    Task.SEQ2SEQ: "AutoModelForSeq2SeqLM",
    Task.CLASSIFICATION: "AutoModelForSequenceClassification",
    Task.IMAGE_CLASSIFICATION: "AutoModelForImageClassification",
}
# Architecture-name suffixes, checked in order.
_SUFFIX_TASK = (
    ("ForImageClassification", Task.IMAGE_CLASSIFICATION),
    ("ForSequenceClassification", Task.CLASSIFICATION),
    ("ForMaskedLM", Task.MASKED_LM),
    ("ForPreTraining", Task.MASKED_LM),
    ("ForCausalLM", Task.CAUSAL_LM),
    ("LMHeadModel", Task.CAUSAL_LM),
    ("ForConditionalGeneration", Task.SEQ2SEQ),
)


def load_config(spec: str, *, allow_download: bool = False):
    """Load a config from a directory holding ``config.json`` or a cached hub name (offline by default)."""
    from transformers import AutoConfig

    path = Path(spec).expanduser()
    # A hub name is NAME or OWNER/NAME; anything else that is not a directory is a path that is
    # wrong, and saying so beats the hub client's "Repo id must be in the form ..."
    if not path.is_dir() and (path.exists() or spec.startswith(("/", ".", "~")) or spec.count("/") > 1):
        what = "is a file, not a directory" if path.exists() else "is no such directory"
        raise ModelLoadError(f"hf:{spec} {what}; give a directory holding config.json or a hub name such as gpt2")
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"hf:{spec}: the directory has no config.json")
            return AutoConfig.from_pretrained(str(path))
        if not allow_download:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return AutoConfig.from_pretrained(spec, local_files_only=not allow_download)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        hint = "" if allow_download else " (memcheck looks offline only; pass --allow-download to fetch it)"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"hf:{spec}: cannot load its config{hint}: {first}") from exc


def infer_task(config, model: torch.nn.Module | None = None) -> Task:
    """The task implied by the architecture name; encoder-decoders default to seq2seq."""
    names = list(getattr(config, "architectures", None) or [])
    if model is not None:
        names.insert(0, type(model).__name__)
    for name in names:
        for suffix, task in _SUFFIX_TASK:
            if name.endswith(suffix):
                if task is Task.SEQ2SEQ and not getattr(config, "is_encoder_decoder", False):
                    return Task.CAUSAL_LM
                return task
    if getattr(config, "is_encoder_decoder", False):
        return Task.SEQ2SEQ
    raise SettingError("task", escape(f"cannot tell the task of {type(config).__name__} (architectures={names or None}); ")
                       + "pass {name}, one of: " + ", ".join(t.value for t in Task))


def build_model(config, task: Task | None = None, attn: Attention | None = None, device="meta"):
    """Instantiate the architecture (or ``task``'s Auto class) from ``config`` on ``device``."""
    import transformers

    kwargs = {"attn_implementation": attn.value} if attn else {}
    archs = getattr(config, "architectures", None) or []
    try:
        with torch.device(device):
            if task is None and archs and hasattr(transformers, archs[0]):
                return getattr(transformers, archs[0])._from_config(config, **kwargs)
            task = task or infer_task(config)
            auto = getattr(transformers, _AUTO_CLASS[task])
            return auto.from_config(config, **kwargs)
    except (UsageError, ModelLoadError):
        raise
    except (ValueError, KeyError, ImportError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot build {type(config).__name__} for task {task}: {first}") from exc


def trainer_optimizer() -> str:
    """memcheck's name for the installed HF Trainer's default ``optim``: ``TrainingArguments.default_optim``
    is ``adamw_torch_fused`` with torch >= 2.8 (transformers' training_args.py, "--- Optimizer ---"),
    ``adamw_torch`` before; ``adamw`` when transformers has no such attribute."""
    from memcheck.training.optimizers import HF_OPTIMIZERS

    try:
        from transformers import TrainingArguments
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "adamw"
    return HF_OPTIMIZERS.get(str(getattr(TrainingArguments, "default_optim", "adamw_torch")), "adamw")


def trainer_max_grad_norm() -> float | None:
    """The installed HF Trainer's default gradient clipping (``TrainingArguments.max_grad_norm``: 1.0)."""
    import dataclasses

    from transformers import TrainingArguments

    field = next((f for f in dataclasses.fields(TrainingArguments) if f.name == "max_grad_norm"), None)
    value = None if field is None else field.default
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def checkpointing_argument() -> str:
    """The TrainingArguments name the installed transformers prefers for gradient checkpointing:
    ``activation_checkpointing`` on transformers 5 (``gradient_checkpointing`` is its deprecated
    alias, "will be removed in v6"), ``gradient_checkpointing`` before."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def position_limit(config) -> tuple[int | None, str | None]:
    """The longest sequence the position embeddings allow, and the config key it came from."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value, key
    return None, None


def is_vision(model: torch.nn.Module) -> bool:
    return getattr(model, "main_input_name", "input_ids") == "pixel_values"


def check_lengths(model, config, max_len: int | None, target_len: int | None) -> None:
    """Reject lengths the model cannot take, naming the limit and where it comes from."""
    if is_vision(model):
        return
    limit, key = position_limit(config)
    name = type(model).__name__
    if max_len is not None and limit is not None and max_len > limit:
        raise SettingError("max_len", "{name} " + escape(f"{max_len} exceeds {name}'s position limit of {limit} "
                                                        f"(config.{key})"))
    if target_len is not None and limit is not None and target_len > limit:
        raise SettingError("target_len", "{name} " + escape(f"{target_len} exceeds {name}'s position limit of "
                                                           f"{limit} (config.{key})"))


def default_max_len(model, config) -> int:
    limit, _ = position_limit(config)
    return limit or 512


def make_batch(model, config, task: Task, batch_size: int, max_len: int | None, target_len: int | None, device="meta") -> dict[str, Any]:
    """The worst-case training batch for ``task``: every sequence padded to ``max_len``.

    Values are only meaningful off the meta device (the real runs that measure
    accuracy use them): random token ids, an attention mask of ones with one
    padded position, labels as the task wants them.
    """
    def ids(n_rows, n_cols, high):
        return torch.randint(0, max(int(high), 1), (n_rows, n_cols), device=device)

    if is_vision(model) or task is Task.IMAGE_CLASSIFICATION:
        size = getattr(config, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(config, "num_channels", 3)
        return {
            "pixel_values": torch.randn(batch_size, channels, *size, device=device),
            "labels": torch.randint(0, max(config.num_labels, 1), (batch_size,), device=device),
        }
    if max_len is None:
        raise SettingError("max_len", escape(type(model).__name__) + " needs {name}")
    vocab = getattr(config, "vocab_size", 2)
    input_ids = ids(batch_size, max_len, vocab)
    mask = torch.ones(batch_size, max_len, dtype=torch.long, device=device)
    if max_len > 1:
        mask[0, -1] = 0  # padded data: at least one padded position in the batch
    batch = {"input_ids": input_ids, "attention_mask": mask}
    if task is Task.SEQ2SEQ:
        if target_len is None:  # no default: the labels' length is the job's, and decoder memory grows with it
            limit, _ = position_limit(config)
            raise SettingError("target_len", escape(type(model).__name__) + " is a seq2seq model: give {name} "
                               "(the label length, " + (f"1 to {limit})" if limit else "a positive integer)"))
        batch["labels"] = ids(batch_size, target_len, vocab)
    elif task is Task.CLASSIFICATION:
        batch["labels"] = torch.randint(0, max(config.num_labels, 1), (batch_size,), device=device)
    else:
        batch["labels"] = input_ids.clone()
    return batch
