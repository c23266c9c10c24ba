"""transformers models: architecture from config, worst-case batch, position limits."""

import pytest
from transformers import BertConfig, GPT2Config, PegasusConfig, ViTConfig

from memcheck.enums import Task
from memcheck.errors import UsageError
from memcheck.workloads import hf
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


# --- audio, image-text: the batch follows the model's main_input_name (issue 18, cause 4) ---------------

def _tiny(name):
    """Tiny configs from the transformers config classes: 2 layers, width 64."""
    import transformers as T

    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2)
    audio = dict(small, conv_dim=(32,) * 7, vocab_size=32)
    image_text = dict(text_config=dict(small, vocab_size=1000), vision_config=dict(small, image_size=64, patch_size=8))
    return {
        # 500 source positions: (80 mel bins, 1000 frames) of input; tokens 998/999 inside the 1000-word vocabulary
        "whisper": (T.WhisperConfig(encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=2,
                                    decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                    vocab_size=1000, max_source_positions=500, pad_token_id=999, bos_token_id=998,
                                    eos_token_id=999, decoder_start_token_id=998, suppress_tokens=[],
                                    begin_suppress_tokens=[]),
                    "WhisperForConditionalGeneration", Task.SEQ2SEQ, dict(target_len=32)),
        "clip": (T.CLIPConfig(**image_text), "CLIPModel", Task.CONTRASTIVE, {}),
        "siglip": (T.SiglipConfig(**image_text), "SiglipModel", Task.CONTRASTIVE, {}),
        "wav2vec2": (T.Wav2Vec2Config(**audio), "Wav2Vec2ForCTC", Task.CTC, dict(max_len=16000, target_len=20)),
        "hubert": (T.HubertConfig(**audio), "HubertForCTC", Task.CTC, dict(max_len=16000, target_len=20)),
    }[name]


def test_whisper_gets_log_mel_features_and_labels(tmp_path):
    config, arch, _, _ = _tiny("whisper")
    work = load_workload(save(config, tmp_path, arch), batch_size=2, target_len=32)
    # 2 * max_source_positions = 1000 frames, the only length WhisperEncoder accepts
    assert {k: tuple(v.shape) for k, v in work.batch.items()} == {"input_features": (2, 80, 1000), "labels": (2, 32)}
    assert work.max_len is None and work.max_len_limit is None


def test_whisper_labels_stop_at_max_target_positions(tmp_path):
    config, arch, _, _ = _tiny("whisper")
    spec = save(config, tmp_path, arch)
    with pytest.raises(UsageError, match="give target_len") as info:
        load_workload(spec)
    assert "(the label length, 1 to 448)" in str(info.value)
    with pytest.raises(UsageError, match=r"target_len 449 exceeds WhisperForConditionalGeneration's position limit "
                                         r"of 448 \(config.max_target_positions\)"):
        load_workload(spec, target_len=449)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_image_text_models_are_contrastive_with_their_own_loss(name, tmp_path):
    config, arch, _, _ = _tiny(name)
    work = load_workload(save(config, tmp_path, arch), batch_size=2)
    limit = config.text_config.max_position_embeddings  # CLIP 77, SigLIP 64
    assert work.max_len == work.max_len_limit == limit
    assert {k: tuple(getattr(v, "shape", ())) for k, v in work.batch.items()} == {
        "input_ids": (2, limit), "attention_mask": (2, limit), "pixel_values": (2, 3, 64, 64), "return_loss": (),
    }
    assert work.batch["return_loss"] is True
    with pytest.raises(UsageError, match=rf"exceeds {arch}'s position limit of {limit} "
                                         r"\(config.text_config.max_position_embeddings\)"):
        load_workload(save(config, tmp_path, arch), max_len=limit + 1)


def test_ctc_models_take_raw_audio_and_a_label_length(tmp_path):
    config, arch, _, _ = _tiny("wav2vec2")
    spec = save(config, tmp_path, arch)
    with pytest.raises(UsageError, match=r"takes raw audio: give max_len \(the longest clip in samples"):
        load_workload(spec)
    # the feature encoder's strides 5 * 2**6 = 320: 16000 samples -> 49 frames, so labels of 1 to 49
    with pytest.raises(UsageError, match=r"give target_len \(the label length, 1 to 49\)"):
        load_workload(spec, max_len=16000)
    with pytest.raises(UsageError, match="target_len 50 exceeds the 49 frames"):
        load_workload(spec, max_len=16000, target_len=50)
    work = load_workload(spec, max_len=16000, target_len=20, batch_size=2)
    # group-norm feature encoder (wav2vec2-base): the feature extractor gives no attention mask
    assert {k: tuple(v.shape) for k, v in work.batch.items()} == {"input_values": (2, 16000), "labels": (2, 20)}
    assert int(work.batch["labels"].shape[1]) == 20


def test_layerdrop_is_off_in_the_built_model_and_the_config_is_untouched():
    config, arch, task, _ = _tiny("wav2vec2")
    assert config.layerdrop == 0.1  # transformers' default: skips a layer when torch.rand([]) < 0.1
    model = hf.build_model(config, task)
    assert model.config.layerdrop == 0.0 and config.layerdrop == 0.1


@pytest.mark.parametrize("arch, config, message", [
    ("Speech2TextForConditionalGeneration", "Speech2TextConfig",
     "memcheck cannot build a batch for Speech2TextForConditionalGeneration: its main input is 'input_features'"),
    ("Siglip2Model", "Siglip2Config", "memcheck cannot build a batch for Siglip2Model: it takes patchified images"),
    ("Wav2Vec2ForPreTraining", "Wav2Vec2Config",
     "memcheck cannot feed Wav2Vec2ForPreTraining for masked-lm: its input is audio, not token ids"),
])
def test_a_model_memcheck_cannot_feed_is_one_line_naming_it_once(arch, config, message, tmp_path):
    import transformers

    from memcheck.errors import ModelLoadError

    spec = save(getattr(transformers, config)(), tmp_path, arch)
    with pytest.raises(ModelLoadError) as info:
        load_workload(spec, max_len=16000)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text and text.count(arch) == 1
    assert text.endswith("write a model file with build_model() and make_batch(batch_size, max_len)")


def test_an_unknown_task_names_the_architecture_once(tmp_path):
    from transformers import CLIPVisionConfig

    spec = save(CLIPVisionConfig(num_hidden_layers=1), tmp_path, "CLIPVisionModel")
    with pytest.raises(UsageError) as info:
        load_workload(spec)
    assert str(info.value) == ("cannot tell the task of CLIPVisionModel; pass task, one of: causal-lm, masked-lm, "
                               "seq2seq, classification, image-classification, ctc, contrastive")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["whisper", "clip", "siglip", "wav2vec2", "hubert"])
def test_audio_and_image_text_estimates_match_a_real_cpu_run(name, tmp_path):
    import torch

    import memcheck
    from memcheck.measure.local import measure_cpu

    config, arch, task, lengths = _tiny(name)
    work = load_workload(save(config, tmp_path, arch), batch_size=4, **lengths)
    assert work.model.__class__.__name__ == arch and hf.infer_task(config, work.model) is task
    est = memcheck.estimate(work.model, work.batch, memcheck.Job(device="cpu", optimizer="adamw"))

    def build():
        torch.manual_seed(0)
        model = hf.build_model(config, task, device="cpu")
        return model, hf.make_batch(model, config, task, 4, work.max_len, work.target_len, device="cpu")

    real = measure_cpu(build, lambda params: torch.optim.AdamW(params)).steady_peak_bytes
    error = (est.peak_bytes - real) / real
    assert abs(error) <= 0.02, f"{name}: estimated {est.peak_bytes} B, measured {real} B ({error:+.2%})"
    assert memcheck.estimate(work.model, work.batch, memcheck.Job(gpu="A100-80GB")).peak_bytes > est.peak_bytes


# ---- packing: DataCollatorWithFlattening's layout ------------------------------------------

def _tiny_llama(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return config, save(config, tmp_path, "LlamaForCausalLM")


def test_a_packed_batch_is_one_row_of_every_slot_with_restarting_positions(tmp_path):
    import torch

    config, spec = _tiny_llama(tmp_path)
    work = load_workload(spec, batch_size=3, max_len=10, packing=True)
    # 3 slots x 10 tokens = 30 tokens in one row; no attention mask (transformers then reads position_ids)
    assert {k: tuple(v.shape) for k, v in work.batch.items() if torch.is_tensor(v)} == {
        "input_ids": (1, 30), "position_ids": (1, 30), "labels": (1, 30)}
    assert work.batch["use_cache"] is False  # as the HF Trainer and TRL's SFTTrainer train
    real = hf.make_batch(work.model, config, Task.CAUSAL_LM, 3, 10, None, device="cpu", packing=True)
    # each slot holds two sequences, 10 // 2 = 5 tokens and the other 5, positions restarting at 0
    assert real["position_ids"].tolist() == [[0, 1, 2, 3, 4] * 6]
    # DataCollatorWithFlattening's separator: -100 at the first token of every sequence, the ids elsewhere
    starts = real["position_ids"] == 0
    assert (real["labels"][starts] == -100).all() and torch.equal(real["labels"][~starts], real["input_ids"][~starts])


@pytest.mark.parametrize("config, arch, words, target_len", [
    (BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64),
     "BertForMaskedLM", "BertForMaskedLM is masked-lm", None),
    (PegasusConfig(encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=2,
                   decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64),
     "PegasusForConditionalGeneration", "PegasusForConditionalGeneration is seq2seq", 8),
])
def test_packing_is_refused_for_models_that_are_not_causal_lms(config, arch, words, target_len, tmp_path):
    from memcheck.job import SettingError

    with pytest.raises(SettingError, match="packs the token sequences of causal-lm models only") as exc:
        load_workload(save(config, tmp_path, arch), batch_size=2, max_len=16, target_len=target_len,
                      packing=True)
    assert words in str(exc.value)


@pytest.mark.slow
def test_a_packed_llama_estimate_matches_a_real_cpu_run_of_flattened_sequences(tmp_path):
    """memcheck's packed batch (meta) against a real step on what DataCollatorWithFlattening makes of
    three sequences per slot (100 + 90 + 66 = 256 tokens, 4 slots: one row of 1024), trained as the
    HF Trainer and TRL do (use_cache=False): transformers sees the packing and sdpa gets a (1, 1,
    1024, 1024) block-diagonal mask."""
    import torch
    from transformers import DataCollatorWithFlattening
    from transformers.masking_utils import find_packed_sequence_indices

    import memcheck
    from memcheck.measure.local import measure_cpu

    config, spec = _tiny_llama(tmp_path)
    work = load_workload(spec, batch_size=4, max_len=256, packing=True)
    est = memcheck.estimate(work.model, work.batch, memcheck.Job(device="cpu", optimizer="adamw", packing=True,
                                                                 batch_size=4, max_len=256))
    assert "(1, 1, 1024, 1024) block-diagonal mask" in "\n".join(est.assumptions)
    text = " ".join(str(est).split())  # the table wraps its lines at 80 columns
    assert "batch 4 x 256 tokens packed" in text
    assert "worst-case packed batch: input_ids (1, 1024), position_ids (1, 1024), labels (1, 1024)" in text

    def flattened():
        g = torch.Generator().manual_seed(0)
        features = [{"input_ids": torch.randint(0, 1000, (n,), generator=g).tolist()}
                    for _ in range(4) for n in (100, 90, 66)]
        return {**DataCollatorWithFlattening()(features, return_tensors="pt"), "use_cache": False}

    real_batch = flattened()
    assert tuple(real_batch["input_ids"].shape) == (1, 1024) and "attention_mask" not in real_batch
    assert find_packed_sequence_indices(real_batch["position_ids"]) is not None  # transformers sees 12 sequences

    def build():
        torch.manual_seed(0)
        return hf.build_model(config, Task.CAUSAL_LM, device="cpu"), flattened()

    real = measure_cpu(build, lambda params: torch.optim.AdamW(params)).steady_peak_bytes
    error = (est.peak_bytes - real) / real
    assert abs(error) <= 0.02, f"estimated {est.peak_bytes} B, measured {real} B ({error:+.2%})"
