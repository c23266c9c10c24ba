"""Coverage of the installed transformers: every architecture of the task mappings, at tiny size.

Each model type of the installed transformers' Auto mappings is taken once, for the first of
these tasks whose mapping holds it (``TASKS``): seq2seq, speech seq2seq, masked LM, causal LM,
CTC, image classification, contrastive (zero-shot image classification: CLIP-style), audio
classification, sequence classification. Its config class's defaults are shrunk generically
(``tiny_config``: two layers, width 64, four heads, vocabulary 1000, 64-pixel images ...),
the model is built by memcheck's own ``hf.build_model`` and fed memcheck's own worst-case
batch (``hf.make_batch``), as ``memcheck hf:DIR`` would: batch 2 of 32 tokens (16 label
tokens for seq2seq), 64x64 images, 4,000 samples of audio.

A case is then one real CPU training step pair (AdamW, ``measure_cpu``'s allocator peak from
the second step on, as tests/test_accuracy_cpu.py) against memcheck's CPU estimate of the
same two steps. ``run_case`` returns what happened, never raises: the stage that failed
(``config``, ``build``, ``batch``, ``real``, ``estimate``) and its one-line message, or both
peaks. tests/test_coverage.py asserts it; benchmarks/coverage.py prints the table.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import warnings
from dataclasses import dataclass

import torch

from memcheck.enums import Task

# (mapping name in transformers.models.auto.modeling_auto, memcheck task, the label in the table)
TASKS = (
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", Task.SEQ2SEQ, "seq2seq"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", Task.SEQ2SEQ, "speech-seq2seq"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", Task.MASKED_LM, "masked-lm"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", Task.CAUSAL_LM, "causal-lm"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", Task.CTC, "ctc"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", Task.IMAGE_CLASSIFICATION, "image-classification"),
    ("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES", Task.CONTRASTIVE, "contrastive"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", Task.CLASSIFICATION, "audio-classification"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", Task.CLASSIFICATION, "classification"),
)
BATCH, TOKENS, TARGET_TOKENS, SAMPLES, AUDIO_TARGET = 2, 32, 16, 4000, 8
LAYERS, WIDTH, HEADS, KV_HEADS, FFN, VOCAB, IMAGE = 2, 64, 4, 2, 128, 1000, 64

_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers", "text_layers")
_WIDTH_KEYS = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "d_embed", "emb_dim", "hidden_size_global",
               "projection_dim")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
              "decoder_attention_heads")
_FFN_KEYS = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
             "decoder_intermediate_size", "linear_units", "d_inner", "dim_ff")
_VOCAB_KEYS = ("vocab_size", "n_words", "entity_vocab_size", "shape_vocab_size", "pronunciation_vocab_size",
               "vocab_size_per_layer_input", "encoder_hash_byte_group_vocab")
# other sizes: an upper bound each (experts, latent-attention ranks, state-space widths, image size)
_CAPS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
         "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "n_group": 1, "topk_group": 1,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
         "moe_shared_expert_intermediate_size": 64, "first_k_dense_replace": 1,
         "head_dim": WIDTH // HEADS, "d_kv": WIDTH // HEADS, "kv_channels": WIDTH // HEADS, "dim_head": WIDTH // HEADS,
         "rotary_dim": WIDTH // HEADS, "num_key_value_heads": KV_HEADS,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
         "qk_head_dim": 32, "index_head_dim": 16, "index_topk": 16,
         "mamba_d_ssm": 128, "mamba_n_heads": 4, "mamba_num_heads": 4, "mamba_d_state": 16, "ssm_state_size": 16,
         "mamba_d_head": 32, "hidden_size_per_layer_input": 16, "pronunciation_embed_dim": 32, "shape_embed_dim": 32,
         "entity_emb_size": 32, "image_size": IMAGE, "max_source_positions": 64}
_STAGE_WIDTH = 16  # stage lists (Swin, ConvNext, ResNet ...): widths 16, 32, 64, 128


def cases() -> list[tuple[str, str, Task, str]]:
    """``(model_type, architecture, task, label)`` for every model type, its first task in ``TASKS``."""
    from transformers.models.auto import modeling_auto

    seen: dict[str, tuple[str, str, Task, str]] = {}
    for mapping, task, label in TASKS:
        for model_type, arch in getattr(modeling_auto, mapping, {}).items():
            arch = arch[0] if isinstance(arch, (list, tuple)) else arch
            seen.setdefault(model_type, (model_type, arch, task, label))
    return sorted(seen.values())


def _shrunk(values: dict, extra: dict | None = None) -> dict:
    """Overrides that shrink one (sub)config, from its default ``values`` (``to_dict()``)."""
    out: dict = {}
    staged = isinstance(values.get("depths"), list) or isinstance(values.get("depth"), list)
    layers_before = next((values[k] for k in _LAYER_KEYS if isinstance(values.get(k), int)), None)
    for key, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, dict) and "model_type" in value:  # a sub-config
            out[key] = {**value, **_shrunk(value)}
        elif key in _LAYER_KEYS and isinstance(value, int) and value > LAYERS:
            out[key] = LAYERS
        elif key in _WIDTH_KEYS and isinstance(value, int) and value > WIDTH:
            out[key] = _STAGE_WIDTH if staged else WIDTH
        elif key in _HEAD_KEYS and isinstance(value, int) and value > HEADS:
            out[key] = HEADS
        elif key in _HEAD_KEYS and isinstance(value, list) and staged:
            out[key] = [2 ** min(i, 3) for i in range(len(value))]
        elif key in _FFN_KEYS and isinstance(value, int) and value > FFN:
            out[key] = FFN
        elif key in _CAPS and isinstance(value, int) and value > _CAPS[key]:
            out[key] = _CAPS[key]
        elif key in ("depths", "depth", "block_sizes") and isinstance(value, list):
            out[key] = [1] * len(value)
        elif key in ("hidden_sizes", "embed_dims", "widths", "embedding_sizes", "embed_dim") and isinstance(value, list) \
                and all(isinstance(v, int) for v in value):
            out[key] = [_STAGE_WIDTH * 2 ** i for i in range(len(value))]
        elif key in _VOCAB_KEYS and isinstance(value, int) and value > VOCAB:
            out[key] = VOCAB
        elif key == "layer_types" and isinstance(value, list) and layers_before and len(value) == layers_before:
            out[key] = value[:LAYERS]
        elif key == "conv_dim" and isinstance(value, (list, tuple)):
            out[key] = [32] * len(value)
    if "vocab_size" in out:  # special tokens inside the smaller vocabulary
        ids = sorted({v for k, v in values.items() if k.endswith("token_id") and isinstance(v, int) and v >= VOCAB})
        top = {v: VOCAB - 1 - i for i, v in enumerate(ids)}
        for key, value in values.items():
            if key.endswith("token_id") and isinstance(value, int) and value in top:
                out[key] = top[value]
            elif key.endswith("token_id") and isinstance(value, list):
                out[key] = [top.get(v, v) for v in value if isinstance(v, int)]
    out.update(extra or {})
    return out


# Per-model settings on top of the generic shrink, each with its reason.
_LINEAR_ATTENTION_CACHE = dict(use_cache=False)  # transformers 5.23's training forward with use_cache=True raises
# "`get_seq_length` can only be called on Attention layers" when the first layer is a linear-attention or
# state-space layer: a real run cannot train them with the cache on (the Trainer's checkpointing sets it off too)
_SWIN = dict(window_size=2)  # 64 px / patch 4 = 16, 8, 4, 2 positions per side: windows of 7 do not tile them
_EFFICIENTNET = dict(width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320)  # as tests/test_conv_models.py
OVERRIDES: dict[str, dict] = {
    **{t: _LINEAR_ATTENTION_CACHE for t in (
        "bailing_hybrid", "bamba", "granitemoehybrid", "jamba", "kimi_linear", "lfm3", "qwen3_5", "qwen3_5_moe",
        "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen4_exp", "qwen4_exp_text", "recurrent_gemma")},
    "swin": _SWIN, "donut-swin": _SWIN,
    "efficientnet": _EFFICIENTNET,
    "align": dict(vision_config=_EFFICIENTNET),
}


def tiny_config(model_type: str, architecture: str):
    """The config class of ``model_type`` with its defaults shrunk (``_shrunk``) and ``OVERRIDES``, naming
    ``architecture`` as a checkpoint's config.json does."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    values = cls().to_dict()
    extra = dict(OVERRIDES.get(model_type, {}))
    for key, value in list(extra.items()):
        if isinstance(value, dict) and isinstance(values.get(key), dict):  # a sub-config: shrunk, then these
            extra[key] = {**values[key], **_shrunk(values[key]), **value}
    config = cls(**_shrunk(values, extra))
    config.architectures = [architecture]
    if config.is_encoder_decoder:
        # a checkpoint's config names them (t5-small: 0 and 0); some class defaults leave them unset
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
        if getattr(config, "decoder_start_token_id", None) is None:
            config.decoder_start_token_id = config.pad_token_id
    return config


@dataclass(frozen=True)
class Outcome:
    """One case's result: the stage that failed and its message, or both peaks (bytes)."""

    model_type: str
    architecture: str
    task: str
    stage: str  # "ok" or the stage that failed: config, build, batch, real, estimate
    message: str = ""
    measured_bytes: int | None = None
    estimated_bytes: int | None = None

    @property
    def error(self) -> float | None:
        if self.measured_bytes and self.estimated_bytes is not None:
            return (self.estimated_bytes - self.measured_bytes) / self.measured_bytes
        return None


def _lengths(kind: str, task: Task) -> tuple[int | None, int | None]:
    from memcheck.workloads import hf

    if kind == hf.AUDIO:
        return SAMPLES, AUDIO_TARGET if task in (Task.CTC, Task.SEQ2SEQ) else None
    if kind in (hf.IMAGE, hf.LOG_MEL):
        return None, TARGET_TOKENS if task is Task.SEQ2SEQ else None
    return TOKENS, TARGET_TOKENS if task is Task.SEQ2SEQ else None


def batch_task(config, task: Task) -> Task:
    """``task``, but causal LM for a decoder-only model in the seq2seq mapping (the audio LLMs: Voxtral,
    Qwen2-Audio ...): their labels are the input ids, shifted inside the model. (``hf.infer_task`` reads
    "ForConditionalGeneration" as seq2seq and would give them shorter labels, which they reject.)"""
    return Task.CAUSAL_LM if task is Task.SEQ2SEQ and not config.is_encoder_decoder \
        and getattr(config, "main_input_name", "input_ids") == "input_ids" else task


def build(config, task: Task, device):
    """memcheck's own model (the architecture ``config`` names) and worst-case batch for ``task``."""
    from memcheck.workloads import hf

    model = hf.build_model(config, None, device=device)
    task = batch_task(config, task) if hf.input_kind(model, config, task) == hf.TEXT else task
    kind = hf.input_kind(model, config, task)
    max_len, target_len = _lengths(kind, task)
    return model, hf.make_batch(model, config, task, BATCH, max_len, target_len, device=device)


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:200]


def run_case(model_type: str, architecture: str, task: Task, label: str) -> Outcome:
    """Build, measure and estimate one case; never raises (the failing stage is in the outcome)."""
    import memcheck
    from memcheck.measure.local import measure_cpu

    def failed(stage, exc):
        return Outcome(model_type, architecture, label, stage, _line(exc))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(model_type, architecture)
        except Exception as exc:  # noqa: BLE001 - a census records every failure
            return failed("config", exc)
        try:
            with torch.device("meta"):
                model, batch = build(config, task, torch.device("meta"))
        except Exception as exc:  # noqa: BLE001
            stage = "batch" if "batch" in str(exc) or "feed" in str(exc) else "build"
            return failed(stage, exc)

        def real():
            torch.manual_seed(0)
            return build(config, task, torch.device("cpu"))

        try:
            measured = measure_cpu(real, lambda p: torch.optim.AdamW(p), steps=2).steady_peak_bytes
        except Exception as exc:  # noqa: BLE001
            return failed("real", exc)
        try:
            est = memcheck.estimate(model, batch, device="cpu", optimizer="adamw")
        except Exception as exc:  # noqa: BLE001
            return failed("estimate", exc)
    return Outcome(model_type, architecture, label, "ok", "", measured, est.peak_bytes)
