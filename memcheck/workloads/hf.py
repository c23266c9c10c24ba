"""transformers models: build from a config on the meta device, and the worst-case padded batch.

The architecture comes from ``config.architectures`` unless a task is given. The
batch pads every sequence to ``max_len`` (``padding='max_length'``), with one
padded position so that attention masks are materialised as in real padded data.

With packing (``Job.packing``) the batch is what transformers' ``DataCollatorWithFlattening``
and TRL's padding-free collator give a causal LM: no padding and no attention mask, every
sample slot ``max_len`` tokens of packed sequences, all slots flattened into ONE row of
``batch_size * max_len`` tokens, with ``position_ids`` restarting at 0 for each sequence
(``packed_batch``). One row is the worst case as well as what those collators do: sdpa and
eager attention keep the sequences apart with a block-diagonal mask over the whole row,
(1, 1, T, T) for T = batch_size * max_len tokens, batch_size times the (B, 1, L, L) of
batch_size separate rows; flash-attention's varlen kernels need no mask either way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from memcheck.enums import Attention, Task
from memcheck.errors import ModelLoadError, UsageError
from memcheck.job import MAX_LEN, SettingError, escape
from memcheck.trace.device_redirect import cuda_stubbed, reads_meta_data

# The Auto classes that build each task's model, tried in order: the first whose mapping holds the
# config's class (text, then speech or audio models for the same task).
_AUTO_CLASS = {
    Task.CAUSAL_LM: ("AutoModelForCausalLM",),
    Task.MASKED_LM: ("AutoModelForMaskedLM",),
    Task.SEQ2SEQ: ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq"),
    Task.CLASSIFICATION: ("AutoModelForSequenceClassification", "AutoModelForAudioClassification"),
    Task.IMAGE_CLASSIFICATION: ("AutoModelForImageClassification",),
    Task.CTC: ("AutoModelForCTC",),
    Task.CONTRASTIVE: ("AutoModelForZeroShotImageClassification",),  # CLIPModel, SiglipModel, AlignModel ...
}
# Architecture-name suffixes, checked in order.
_SUFFIX_TASK = (
    ("ForImageClassification", Task.IMAGE_CLASSIFICATION),
    ("ForSequenceClassification", Task.CLASSIFICATION),
    ("ForAudioClassification", Task.CLASSIFICATION),
    ("ForCTC", Task.CTC),
    ("ForMaskedLM", Task.MASKED_LM),
    ("ForPreTraining", Task.MASKED_LM),
    ("ForCausalLM", Task.CAUSAL_LM),
    ("LMHeadModel", Task.CAUSAL_LM),
    ("ForConditionalGeneration", Task.SEQ2SEQ),
)

# What a batch is made of, from the model's main_input_name (``input_kind``).
TEXT = "text"  # input_ids, attention_mask: max_len tokens
IMAGE = "image"  # pixel_values at the config's image_size
IMAGE_TEXT = "image-text"  # both, for contrastive models: max_len tokens and an image
LOG_MEL = "log-mel"  # Whisper's input_features: num_mel_bins x 2 * max_source_positions frames, always
AUDIO = "audio"  # input_values: max_len samples of raw audio (Wav2Vec2, HuBERT, WavLM ...)
_MAIN_INPUT_KIND = {"input_ids": TEXT, "pixel_values": IMAGE, "input_values": AUDIO}


def force_offline() -> None:
    """The Hub libraries offline for the rest of this process, whatever the environment says
    (``HF_HUB_OFFLINE=0`` or ``false`` included): the variable set to 1 and, where
    huggingface_hub is already imported (it reads the variable once, at import), its
    ``constants.HF_HUB_OFFLINE`` too, which ``huggingface_hub.is_offline_mode()`` and so
    transformers read on every call. Without it a hub name that is not cached makes
    huggingface_hub connect even with ``local_files_only=True``."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True


def _custom_code(config_json: dict) -> list[str]:
    """The Python modules a config.json's ``auto_map`` names (``modeling_x.XModel`` -> ``modeling_x``;
    ``OWNER/REPO--modeling_x.XModel`` keeps its repository)."""
    auto_map = config_json.get("auto_map") if isinstance(config_json, dict) else None
    names = []
    for value in (auto_map.values() if isinstance(auto_map, dict) else ()):
        for ref in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(ref, str) and "." in ref:
                names.append(ref.rsplit(".", 1)[0])
    return list(dict.fromkeys(names))


def remote_code(directory: Path) -> list[str]:
    """What ``trust_remote_code`` would run for the config in ``directory``: the ``auto_map``
    modules of its config.json ([] when it names none or cannot be read)."""
    import json

    try:
        return _custom_code(json.loads((directory / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return []


def load_config(spec: str, *, allow_download: bool = False, trust_remote_code: bool = False):
    """Load a config from a directory holding ``config.json`` or a cached hub name (offline by
    default). ``trust_remote_code`` goes to transformers as given, True or False, never None: so
    transformers never asks on stdin whether to run a config's custom code."""
    from transformers import AutoConfig

    trust_remote_code = bool(trust_remote_code)
    try:  # transformers 5 checks field types (huggingface_hub's strict dataclasses)
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # pragma: no cover - older huggingface_hub
        StrictDataclassError = ValueError
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
            _check_config_json(path / "config.json")
            if not allow_download:
                force_offline()
            with cuda_stubbed():  # a config's code may ask the GPU
                return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if not allow_download:
            force_offline()
        with cuda_stubbed():
            return AutoConfig.from_pretrained(spec, local_files_only=not allow_download,
                                              trust_remote_code=trust_remote_code)
    except ModelLoadError:
        raise
    except RecursionError:
        raise ModelLoadError(f"hf:{spec}: its config nests too deeply to read") from None
    except StrictDataclassError as exc:  # a field of the wrong type: "Validation error for field 'n_layer':\n ..."
        text = " ".join(line.strip() for line in str(exc).strip().splitlines())
        raise ModelLoadError(f"hf:{spec}: config.json: {text[:300]}") from None
    except (OSError, ValueError, KeyError) as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise _needs_remote_code(spec, path) from None
        hint = "" if allow_download else " (memcheck looks offline only; pass --allow-download to fetch it)"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"hf:{spec}: cannot load its config{hint}: {first}") from exc
    except Exception as exc:
        if not trust_remote_code:
            raise
        raise ModelLoadError(f"hf:{spec}: its custom code (trust_remote_code) failed: "  # the user's code
                             f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                             ) from exc


def _needs_remote_code(spec: str, path: Path) -> SettingError:
    code = remote_code(path) if path.is_dir() else []
    named = f" ({', '.join(code)})" if code else ""
    return SettingError("trust_remote_code", escape(f"hf:{spec}: its config needs custom Python code{named} that "
                                                    "transformers would run; memcheck runs it only with ")
                        + "{name}" + escape(" (only if you would run that code yourself)"))


# The sizes of a config checked before anything is built (issue 20), by transformers' standard
# names (a config's attribute_map gives GPT-2's n_embd, n_head, ...): each must be a positive
# integer, at most the bound. The bounds are far above any published model (hidden 16,384 and
# 126 layers for Llama 3.1 405B, vocabularies of 2**18, DeepNet's 1,000 layers) and keep every
# weight's element count inside int64 and the build (one module a layer) short.
CONFIG_SIZES = {
    "hidden_size": 2**20, "intermediate_size": 2**22, "num_attention_heads": 2**14, "num_key_value_heads": 2**14,
    "num_hidden_layers": 1024, "vocab_size": 2**24, "max_position_embeddings": 2**40, "head_dim": 2**16,
    "n_inner": 2**22, "num_experts": 2**16, "num_local_experts": 2**16, "image_size": 2**16, "patch_size": 2**16,
    "num_channels": 2**12, "num_mel_bins": 2**12,
}


_AT_LEAST_ONE = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings",
                 "num_key_value_heads", "image_size", "patch_size", "num_channels")  # 0 of the others means none


def check_config(config, prefix: str = "", depth: int = 0) -> None:
    """ModelLoadError naming the field (as config.json spells it) for a size in ``CONFIG_SIZES``
    that is not an integer within its bound (most at least 1), or ``architectures`` that is not a list of
    names; sub-configs (``text_config``, ``vision_config``, ...) too."""
    archs = getattr(config, "architectures", None)
    if archs is not None and (not isinstance(archs, (list, tuple))
                              or not all(isinstance(a, str) and a for a in archs)):
        raise ModelLoadError(f"config.json: {prefix}architectures must be a list of model class names such as "
                             f"[\"LlamaForCausalLM\"], got {str(archs)[:80]!r}")
    names = {v: k for k, v in (getattr(config, "attribute_map", None) or {}).items()}  # n_embd -> hidden_size
    for written, value in list(vars(config).items()):
        if depth < 4 and hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            check_config(value, f"{prefix}{written}.", depth + 1)
            continue
        canonical = names.get(written, written)
        bound = CONFIG_SIZES.get(canonical)
        if bound is None or value is None:
            continue
        values = list(value.values()) if isinstance(value, dict) else value  # per stage or layer: Swin, LXMERT
        least = 1 if canonical in _AT_LEAST_ONE else 0
        for v in values if isinstance(values, (list, tuple)) else [values]:
            whole = isinstance(v, int) or isinstance(v, float) and v.is_integer()  # nan, inf: not whole
            if isinstance(v, bool) or not whole or not least <= v <= bound:
                raise ModelLoadError(f"config.json: {prefix}{written} must be an integer from {least} to {bound:,}, "
                                     f"got {str(value)[:40]}")


def _check_config_json(path: Path) -> None:
    """A config.json within memcheck's limits for config files (size, nesting: ``trainer_files``),
    checked before transformers parses it; a file that is not JSON is left to transformers to name."""
    import json

    from memcheck.workloads.trainer_files import check_config_size, parse_limited

    try:
        check_config_size(path)
        text = path.read_text(encoding="utf-8")
        parse_limited(path, json.loads, text)
    except UsageError as exc:
        raise ModelLoadError(str(exc)) from None
    except (OSError, ValueError):
        return


def _forward_takes(model: torch.nn.Module | None, *names: str) -> bool:
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return all(name in params for name in names)


def infer_task(config, model: torch.nn.Module | None = None) -> Task:
    """The task implied by the architecture name; encoder-decoders default to seq2seq, and a
    model whose forward takes ``pixel_values`` and ``return_loss`` (CLIP, SigLIP) is contrastive."""
    names = list(dict.fromkeys(([type(model).__name__] if model is not None else [])
                               + list(getattr(config, "architectures", None) or [])))
    if _forward_takes(model, "input_ids", "pixel_values", "return_loss"):
        return Task.CONTRASTIVE
    for name in names:
        for suffix, task in _SUFFIX_TASK:
            if name.endswith(suffix):
                if task is Task.SEQ2SEQ and not getattr(config, "is_encoder_decoder", False):
                    return Task.CAUSAL_LM
                return task
    if getattr(config, "is_encoder_decoder", False):
        return Task.SEQ2SEQ
    what = names[0] if names else type(config).__name__
    raise SettingError("task", escape(f"cannot tell the task of {what}; ")
                       + "pass {name}, one of: " + ", ".join(t.value for t in Task))


def _auto_class(task: Task, config):
    """The first of ``task``'s Auto classes that knows ``config``'s class (else the first, whose
    error then names the config)."""
    import transformers

    classes = [getattr(transformers, name) for name in _AUTO_CLASS[task] if hasattr(transformers, name)]
    return next((auto for auto in classes if type(config) in auto._model_mapping), classes[0])


def _without_layerdrop(config):
    """``config`` with LayerDrop off (a copy where it was on): the worst training step drops no
    layer. LayerDrop (Wav2Vec2, HuBERT: ``layerdrop`` 0.1; BART, Whisper: ``encoder_layerdrop``,
    ``decoder_layerdrop``) skips a layer when ``torch.rand([]) < layerdrop``, a CPU draw that
    would make the traced step, and its peak, random."""
    import copy

    def configs(c):
        yield c
        for value in vars(c).values():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                yield from configs(value)

    def dropping(c):
        return [k for k, v in vars(c).items() if "layerdrop" in k and isinstance(v, (int, float)) and v > 0]

    if not any(dropping(c) for c in configs(config)):
        return config
    config = copy.deepcopy(config)
    for c in configs(config):
        for key in dropping(c):
            setattr(c, key, 0.0)
    return config


def build_model(config, task: Task | None = None, attn: Attention | None = None, device="meta",
                trust_remote_code: bool = False):
    """Instantiate the architecture (or ``task``'s Auto class) from ``config`` on ``device``, with
    LayerDrop off (``_without_layerdrop``); ``trust_remote_code`` goes to the Auto class as given."""
    import transformers

    check_config(config)
    config = _without_layerdrop(config)
    kwargs = {"attn_implementation": attn.value} if attn else {}
    auto_kwargs = {**kwargs, "trust_remote_code": bool(trust_remote_code)}
    archs = getattr(config, "architectures", None) or []
    if archs and hasattr(transformers, archs[0]) and not (
            isinstance(getattr(transformers, archs[0]), type)
            and issubclass(getattr(transformers, archs[0]), transformers.PreTrainedModel)):
        raise ModelLoadError(f"config.json: architectures names {archs[0]!r}, which is not a transformers model "
                             "class (such as LlamaForCausalLM)")
    try:
        with torch.device(device):
            if task is None and archs and hasattr(transformers, archs[0]):
                return getattr(transformers, archs[0])._from_config(config, **kwargs)
            task = task or infer_task(config)
            return _auto_class(task, config).from_config(config, **auto_kwargs)
    except (UsageError, ModelLoadError):
        raise
    except (ValueError, KeyError, ImportError, TypeError, AssertionError) as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise _needs_remote_code(type(config).__name__, Path()) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot build {type(config).__name__} for task {task}: {first}") from exc
    except Exception as exc:
        if trust_remote_code:
            raise ModelLoadError(f"cannot build {type(config).__name__}: its custom code (trust_remote_code) failed: "
                                 f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
        if not isinstance(exc, (RuntimeError, ArithmeticError, AttributeError, IndexError, RecursionError)) \
                or reads_meta_data(exc):
            raise  # reads_meta_data: load_workload builds it again keeping host tensors real
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot build {type(config).__name__} from its config.json (a nonsensical value?): "
                             f"{type(exc).__name__}: {first[:200]}") from exc


def _training_arguments():
    """transformers' ``TrainingArguments``; importing it imports PEFT and bitsandbytes where they
    are installed, whose notices about this machine are kept quiet (``quiet_third_party``)."""
    from memcheck.training.adapters import quiet_third_party

    # cuda_stubbed: bitsandbytes asks every GPU's compute capability on import, starting CUDA
    with quiet_third_party(), cuda_stubbed():
        from transformers import TrainingArguments
    return TrainingArguments


def trainer_optimizer() -> str:
    """memcheck's name for the installed HF Trainer's default ``optim``: ``TrainingArguments.default_optim``
    is ``adamw_torch_fused`` with torch >= 2.8 (transformers' training_args.py, "--- Optimizer ---"),
    ``adamw_torch`` before; ``adamw`` when transformers has no such attribute."""
    from memcheck.training.optimizers import HF_OPTIMIZERS

    try:
        TrainingArguments = _training_arguments()
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "adamw"
    return HF_OPTIMIZERS.get(str(getattr(TrainingArguments, "default_optim", "adamw_torch")), "adamw")


def trainer_max_grad_norm() -> float | None:
    """The installed HF Trainer's default gradient clipping (``TrainingArguments.max_grad_norm``: 1.0)."""
    import dataclasses

    TrainingArguments = _training_arguments()
    field = next((f for f in dataclasses.fields(TrainingArguments) if f.name == "max_grad_norm"), None)
    value = None if field is None else field.default
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def checkpointing_argument() -> str:
    """The TrainingArguments name the installed transformers prefers for gradient checkpointing:
    ``activation_checkpointing`` on transformers 5 (``gradient_checkpointing`` is its deprecated
    alias, "will be removed in v6"), ``gradient_checkpointing`` before."""
    import dataclasses

    TrainingArguments = _training_arguments()
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def position_limit(config) -> tuple[int | None, str | None]:
    """The longest token sequence the position embeddings allow, and the config key it came from
    (a composite config's text part for CLIP or SigLIP: ``text_config.max_position_embeddings``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    prefix = "" if text is config else next((f"{k}." for k, v in vars(config).items() if v is text), "")
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value, prefix + key
    return None, None


def target_limit(config) -> tuple[int | None, str | None]:
    """The longest label sequence a seq2seq decoder takes (Whisper: ``max_target_positions``, 448)."""
    value = getattr(config, "max_target_positions", None)
    if isinstance(value, int) and value > 0:
        return value, "max_target_positions"
    return position_limit(config)


def input_kind(model: torch.nn.Module, config, task: Task | None = None) -> str:
    """What ``model``'s batch is made of (``TEXT``, ``IMAGE``, ``IMAGE_TEXT``, ``LOG_MEL``, ``AUDIO``),
    from its ``main_input_name``; raises ModelLoadError, in one line, for inputs memcheck cannot build."""
    main = getattr(model, "main_input_name", "input_ids")
    if task is Task.CONTRASTIVE:
        if not _forward_takes(model, "input_ids", "pixel_values", "return_loss"):
            raise ModelLoadError(f"{type(model).__name__} is no image-text model: its forward takes no input_ids, "
                                 "pixel_values and return_loss, which contrastive training feeds it")
        if _forward_takes(model, "spatial_shapes"):  # Siglip2: pixel_values are patches, sized per image
            raise ModelLoadError(f"memcheck cannot build a batch for {type(model).__name__}: it takes patchified "
                                 "images (pixel_values, pixel_attention_mask, spatial_shapes); write a model file "
                                 "with build_model() and make_batch(batch_size, max_len)")
        return IMAGE_TEXT
    if task is Task.IMAGE_CLASSIFICATION:
        return IMAGE
    if main == "input_features" and _mel_shape(config) is not None:
        return LOG_MEL
    if main in _MAIN_INPUT_KIND:
        return _MAIN_INPUT_KIND[main]
    raise ModelLoadError(f"memcheck cannot build a batch for {type(model).__name__}: its main input is {main!r}; "
                         "write a model file with build_model() and make_batch(batch_size, max_len)")


def _mel_shape(config) -> tuple[int, int] | None:
    """Whisper's log-mel input: (num_mel_bins, frames); the encoder rejects any other length than
    ``max_source_positions * conv1.stride * conv2.stride`` = 2 * max_source_positions
    (modeling_whisper.py, WhisperEncoder.forward: "expects the mel input features to be of length")."""
    bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if isinstance(bins, int) and isinstance(positions, int):
        return bins, 2 * positions
    return None


def known_kind(model, config, task: Task | None = None) -> str | None:
    """``input_kind``, or None where memcheck cannot build the inputs (a model file's own make_batch does)."""
    try:
        return input_kind(model, config, task)
    except ModelLoadError:
        return None


def takes_length(model, config, task: Task | None = None) -> bool:
    """Whether ``max_len`` sizes the batch: tokens of text, samples of raw audio; images and
    Whisper's 30-second log-mel windows have one size."""
    return input_kind(model, config, task) in (TEXT, IMAGE_TEXT, AUDIO)


def ctc_frames(model, samples: int) -> int:
    """The CTC head's output frames for ``samples`` of raw audio: each of the feature encoder's
    convolutions makes (n - kernel) // stride + 1 of n, then each adapter layer (n - 1) // stride + 1
    (``_get_feat_extract_output_lengths`` in modeling_wav2vec2.py; 320x fewer for Wav2Vec2's strides)."""
    config = model.config
    frames = samples
    for kernel, stride in zip(config.conv_kernel, config.conv_stride):
        frames = (frames - kernel) // stride + 1
    if getattr(config, "add_adapter", False):
        for _ in range(config.num_adapter_layers):
            frames = (frames - 1) // config.adapter_stride + 1
    return frames


def _counts_frames(model, task: Task | None) -> bool:
    config = getattr(model, "config", None)
    return task is Task.CTC and all(hasattr(config, key) for key in ("conv_kernel", "conv_stride"))


def check_lengths(model, config, max_len: int | None, target_len: int | None, task: Task | None = None) -> None:
    """Reject lengths the model cannot take, naming the limit and where it comes from."""
    kind = known_kind(model, config, task)
    name = type(model).__name__
    if kind in (TEXT, IMAGE_TEXT):
        limit, key = position_limit(config)
        if max_len is not None and limit is not None and max_len > limit:
            raise SettingError("max_len", "{name} " + escape(f"{max_len} exceeds {name}'s position limit of "
                                                            f"{limit} (config.{key})"))
    if target_len is None:
        return
    if kind == AUDIO and max_len is not None and _counts_frames(model, task):
        limit, key = ctc_frames(model, max_len), None
        if target_len > limit:
            raise SettingError("target_len", "{name} " + escape(f"{target_len} exceeds the {limit} frames {name}'s "
                                                               f"CTC head makes of {max_len} samples; a CTC label "
                                                               "is at most one token a frame"))
        return
    limit, key = target_limit(config) if kind in (LOG_MEL, AUDIO) else position_limit(config)
    if limit is not None and target_len > limit:
        raise SettingError("target_len", "{name} " + escape(f"{target_len} exceeds {name}'s position limit of "
                                                           f"{limit} (config.{key})"))


def default_max_len(model, config, task: Task | None = None) -> int:
    """The position limit for text (512 where the config names none); raw audio has no default."""
    if input_kind(model, config, task) == AUDIO:
        raise SettingError("max_len", escape(f"{type(model).__name__} takes raw audio: give ") + "{name} "
                           "(the longest clip in samples: 480000 for 30 s at 16 kHz)")
    limit, key = position_limit(config)
    if limit is not None and limit > MAX_LEN:
        raise SettingError("max_len", escape(f"{type(model).__name__}'s position limit {limit:,} (config.{key}) is "
                                             f"above memcheck's longest length, {MAX_LEN:,} (2**24): give ") + "{name}")
    return limit or 512


def _vision_config(config):
    return getattr(config, "vision_config", None) or config


def _pixels(config, batch_size: int, device) -> torch.Tensor:
    vision = _vision_config(config)
    size = getattr(vision, "image_size", 224)
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    return torch.randn(batch_size, getattr(vision, "num_channels", 3), *size, device=device)


def _padded_mask(batch_size: int, length: int, device) -> torch.Tensor:
    mask = torch.ones(batch_size, length, dtype=torch.long, device=device)
    if length > 1:
        mask[0, -1] = 0  # padded data: at least one padded position in the batch
    return mask


def check_packing(model, config, task: Task) -> None:
    """Refuse, naming the model, a packed batch the model cannot take: packing is for causal LMs fed
    token ids, whose forward takes ``position_ids`` (transformers reads the sequence boundaries from them)."""
    name = type(model).__name__
    if task is not Task.CAUSAL_LM:
        raise SettingError("packing", "{name} packs the token sequences of causal-lm models only; "
                           + escape(f"{name} is {task.value}") + ": drop {name}")
    if input_kind(model, config, task) != TEXT or not _forward_takes(model, "input_ids", "position_ids"):
        raise SettingError("packing", "{name} needs a model whose forward takes input_ids and position_ids (the "
                           "packed sequences' boundaries); " + escape(f"{name}'s does not") + ": drop {name}")


def packed_positions(batch_size: int, max_len: int, device="meta") -> torch.Tensor:
    """``position_ids`` (1, batch_size * max_len) of a packed row: each slot of ``max_len`` tokens
    holds two sequences (``max_len // 2`` tokens and the rest; one when ``max_len`` is 1), and the
    positions restart at 0 at each, as ``DataCollatorWithFlattening`` numbers them. Two sequences
    in a slot make transformers see a packed row (``find_packed_sequence_indices``); how many more
    a slot holds changes no tensor's size."""
    first = max_len // 2 or max_len
    slot = torch.cat([torch.arange(first, device=device), torch.arange(max_len - first, device=device)])
    return slot.repeat(batch_size).unsqueeze(0)


def packed_batch(model, config, task: Task, batch_size: int, max_len: int | None, device="meta") -> dict[str, Any]:
    """The worst-case packed batch (module docstring): ``input_ids``, ``position_ids`` and ``labels``
    of shape (1, batch_size * max_len), the labels -100 at the first token of each sequence
    (``DataCollatorWithFlattening``'s ``separator_id``), and ``use_cache=False`` where the forward
    takes it, as the HF Trainer (``TrainingArguments.use_cache``: False) and TRL's SFTTrainer
    (``compute_loss``: ``inputs["use_cache"] = False``) train: with a cache, transformers skips its
    packed-sequence check (masking_utils.py, ``_preprocess_mask_arguments``: "only if the 2D attention
    mask is explicitly None, and we don't have past_key_values") and the sequences would attend across
    their boundaries."""
    check_packing(model, config, task)
    if max_len is None:
        raise SettingError("max_len", escape(type(model).__name__) + " needs {name}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", 2)
    input_ids = torch.randint(0, max(int(vocab), 1), (1, batch_size * max_len), device=device)
    position_ids = packed_positions(batch_size, max_len, device)
    batch: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids,
                             "labels": torch.where(position_ids == 0, -100, input_ids)}
    if _forward_takes(model, "use_cache"):
        batch["use_cache"] = False
    return batch


def make_batch(model, config, task: Task, batch_size: int, max_len: int | None, target_len: int | None, device="meta",
               packing: bool = False) -> dict[str, Any]:
    """The worst-case training batch for ``task``: every sequence padded to ``max_len``; with
    ``packing``, ``packed_batch``.

    The inputs follow the model's ``main_input_name`` (``input_kind``): token ids and an
    attention mask of ones with one padded position; pixels at the config's image size;
    Whisper's log-mel features (B, num_mel_bins, 2 * max_source_positions); raw audio of
    ``max_len`` samples. The labels follow ``task``. Values are only meaningful off the meta
    device (the real runs that measure accuracy use them).
    """
    if packing:
        return packed_batch(model, config, task, batch_size, max_len, device)

    def ids(n_rows, n_cols, high, low=0):
        return torch.randint(low, max(int(high), low + 1), (n_rows, n_cols), device=device)

    name = type(model).__name__
    kind = input_kind(model, config, task)
    if kind in (TEXT, IMAGE_TEXT, AUDIO) and max_len is None:
        raise SettingError("max_len", escape(name) + " needs {name}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", 2)
    batch: dict[str, Any] = {}
    if kind in (TEXT, IMAGE_TEXT):
        batch = {"input_ids": ids(batch_size, max_len, vocab), "attention_mask": _padded_mask(batch_size, max_len, device)}
    if kind in (IMAGE, IMAGE_TEXT):
        batch["pixel_values"] = _pixels(config, batch_size, device)
    if kind == LOG_MEL:  # 30 s windows, padded with silence: no attention mask (WhisperFeatureExtractor)
        batch["input_features"] = torch.randn(batch_size, *_mel_shape(config), device=device)
    if kind == AUDIO:
        batch["input_values"] = torch.randn(batch_size, max_len, device=device)
        # the feature extractor returns a mask only for layer-norm feature encoders (wav2vec2-large-lv60 and
        # others); the group-norm ones (wav2vec2-base, hubert-base) are fed padded audio without one
        if getattr(config, "feat_extract_norm", "layer") == "layer":
            batch["attention_mask"] = _padded_mask(batch_size, max_len, device)

    if task is Task.CONTRASTIVE:
        batch["return_loss"] = True  # the model's own contrastive (CLIP) or sigmoid (SigLIP) loss
    elif task in (Task.CLASSIFICATION, Task.IMAGE_CLASSIFICATION):
        batch["labels"] = torch.randint(0, max(config.num_labels, 1), (batch_size,), device=device)
    elif task in (Task.SEQ2SEQ, Task.CTC):
        if target_len is None:  # no default: the labels' length is the job's, and decoder memory grows with it
            limit, _ = target_limit(config) if kind in (LOG_MEL, AUDIO) else position_limit(config)
            if max_len is not None and _counts_frames(model, task):
                limit = ctc_frames(model, max_len)
            what = "a seq2seq" if task is Task.SEQ2SEQ else "a CTC"
            raise SettingError("target_len", escape(f"{name} is {what} model: give ") + "{name} "
                               "(the label length, " + (f"1 to {limit})" if limit else "a positive integer)"))
        if task is Task.CTC:  # transcripts without the blank (config.pad_token_id, the CTC blank)
            blank = getattr(config, "pad_token_id", 0) or 0
            labels = ids(batch_size, target_len, vocab - 1)
            batch["labels"] = labels + (labels >= blank).long()
        else:
            batch["labels"] = ids(batch_size, target_len, vocab)
    elif kind == TEXT:
        batch["labels"] = batch["input_ids"].clone()
    else:
        raise ModelLoadError(f"memcheck cannot feed {name} for {task.value}: its input is {kind}, not token ids; "
                             "write a model file with build_model() and make_batch(batch_size, max_len)")
    return batch
