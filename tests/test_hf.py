"""transformers models: architecture from config, worst-case batch, position limits."""

import pytest
from transformers import BertConfig, GPT2Config, PegasusConfig, ViTConfig

from memcheck.errors import UsageError
from memcheck.workloads.source import load_workload


def save(config, tmp_path, arch):
    config.architectures = [arch]
    config.save_pretrained(tmp_path)
    return f"hf:{tmp_path}"


def test_causal_lm_batch_is_padded_to_max_len(tmp_path):
    spec = save(GPT2Config(n_layer=1, n_embd=64, n_head=2), tmp_path, "GPT2LMHeadModel")
    work = load_workload(spec, batch_size=3, max_len=100)
    assert {k: tuple(v.shape) for k, v in work.batch.items()} == {
        "input_ids": (3, 100), "attention_mask": (3, 100), "labels": (3, 100),
    }
    assert all(p.device.type == "meta" for p in work.model.parameters())


def test_default_max_len_is_the_position_limit(tmp_path):
    spec = save(GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=256), tmp_path, "GPT2LMHeadModel")
    assert load_workload(spec).max_len == 256


def test_max_len_above_the_position_limit_is_rejected(tmp_path):
    spec = save(BertConfig(num_hidden_layers=1), tmp_path, "BertForMaskedLM")
    with pytest.raises(UsageError, match=r"max_len 1024 exceeds BertForMaskedLM's position limit of 512 \(config.max_position_embeddings\)") as info:
        load_workload(spec, max_len=1024)
    assert info.value.worded("flag").startswith("--max-len 1024 exceeds")


def test_seq2seq_needs_a_target_length(tmp_path):
    spec = save(PegasusConfig(encoder_layers=1, decoder_layers=1), tmp_path, "PegasusForConditionalGeneration")
    with pytest.raises(UsageError, match="give target_len") as info:
        load_workload(spec, max_len=64)
    assert "give --target-len (the label length, 1 to 1024)" in info.value.worded("flag")
    work = load_workload(spec, max_len=64, target_len=16, batch_size=2)
    assert tuple(work.batch["input_ids"].shape) == (2, 64)
    assert tuple(work.batch["labels"].shape) == (2, 16)


def test_classification_labels_are_one_per_sample(tmp_path):
    spec = save(BertConfig(num_hidden_layers=1), tmp_path, "BertForSequenceClassification")
    work = load_workload(spec, max_len=32, batch_size=5)
    assert tuple(work.batch["labels"].shape) == (5,)


def test_vision_batch_uses_the_config_image_size(tmp_path):
    spec = save(ViTConfig(num_hidden_layers=1, image_size=96), tmp_path, "ViTForImageClassification")
    work = load_workload(spec, batch_size=2)
    assert tuple(work.batch["pixel_values"].shape) == (2, 3, 96, 96)


def test_task_overrides_the_architecture(tmp_path):
    spec = save(BertConfig(num_hidden_layers=1), tmp_path, "BertForMaskedLM")
    work = load_workload(spec, max_len=16, task="classification")
    assert type(work.model).__name__ == "BertForSequenceClassification"


def test_unknown_task_suggests_the_closest(tmp_path):
    spec = save(BertConfig(num_hidden_layers=1), tmp_path, "BertForMaskedLM")
    with pytest.raises(UsageError, match="did you mean 'causal-lm'"):
        load_workload(spec, task="causal_lm")


def test_missing_directory_or_name_is_a_load_error(tmp_path):
    from memcheck.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="no config.json"):
        load_workload(f"hf:{tmp_path}")
    with pytest.raises(ModelLoadError, match="offline"):
        load_workload("hf:surely-not-a-cached-model/xyz")
