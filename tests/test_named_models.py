"""The models issue 18's "Done when" names, each from a model file and from ``hf:``, on both
targets: the six mixture-of-experts families, the four drop-path vision models, EfficientNet,
SigLIP, SegFormer, Whisper and CLIP.

This file checks that each one *runs* end to end through the command line, the way a user
types it, and that a model file and ``hf:`` give the same figure (the same model and batch
reach the tracer either way). How close each CPU estimate is to a real CPU run is
measured where each cause was fixed, against the profiler's allocator events:
tests/test_moe.py (MoE), tests/test_host_tensors.py and tests/test_conv_models.py (drop-path
and convolution models), tests/test_hf.py (Whisper, CLIP, SigLIP).
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from click.testing import CliRunner

from memcheck.cli import main

transformers = pytest.importorskip("transformers")

LLAMA_LIKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
VISION = dict(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], num_labels=10, image_size=64)
SMALL = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2)
IMAGE_TEXT = dict(text_config=dict(SMALL, vocab_size=1000), vision_config=dict(SMALL, image_size=64, patch_size=8))


def _named():
    """name -> (config, architecture, extra CLI arguments)."""
    t = transformers
    causal = ["--batch-size", "2", "--max-len", "64"]
    images = ["--batch-size", "2"]
    return {
        "mixtral": (t.MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
                    "MixtralForCausalLM", causal),
        "qwen2_moe": (t.Qwen2MoeConfig(**LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64), "Qwen2MoeForCausalLM", causal),
        "qwen3_moe": (t.Qwen3MoeConfig(**LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       head_dim=16), "Qwen3MoeForCausalLM", causal),
        "deepseek_v3": (t.DeepseekV3Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256),
            "DeepseekV3ForCausalLM", causal),
        "gpt_oss": (t.GptOssConfig(
            vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"]),
            "GptOssForCausalLM", causal),
        "jamba": (t.JambaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
            expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0, mamba_d_state=8, mamba_expand=2,
            max_position_embeddings=256, use_mamba_kernels=False), "JambaForCausalLM", causal),
        # drop-path schedules read from torch.linspace(...).tolist() while building
        "convnext": (t.ConvNextConfig(**VISION, drop_path_rate=0.1), "ConvNextForImageClassification", images),
        "convnextv2": (t.ConvNextV2Config(**VISION, drop_path_rate=0.1), "ConvNextV2ForImageClassification",
                       images),
        "swinv2": (t.Swinv2Config(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, drop_path_rate=0.1,
                                  num_labels=10, image_size=64), "Swinv2ForImageClassification", images),
        "pvtv2": (t.PvtV2Config(**VISION, num_attention_heads=[1, 2, 4, 8], drop_path_rate=0.1),
                  "PvtV2ForImageClassification", images),
        # string padding ("valid", "same") in the depthwise blocks
        "efficientnet": (t.EfficientNetConfig(image_size=64, num_labels=10, width_coefficient=0.25,
                                              depth_coefficient=0.25, hidden_dim=320),
                         "EfficientNetForImageClassification", images),
        "segformer": (t.SegformerConfig(**VISION, num_attention_heads=[1, 2, 4, 8]),
                      "SegformerForImageClassification", images),
        "siglip": (t.SiglipConfig(**IMAGE_TEXT), "SiglipModel", images),
        "siglip_classifier": (t.SiglipConfig(**IMAGE_TEXT, num_labels=10), "SiglipForImageClassification", images),
        "clip": (t.CLIPConfig(**IMAGE_TEXT), "CLIPModel", images),
        "whisper": (t.WhisperConfig(
            encoder_layers=1, decoder_layers=1, d_model=64, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000, max_source_positions=500, pad_token_id=999,
            bos_token_id=998, eos_token_id=999, decoder_start_token_id=998, suppress_tokens=[],
            begin_suppress_tokens=[]), "WhisperForConditionalGeneration", images + ["--target-len", "16"]),
    }


NAMES = sorted(_named())
TARGETS = {"cpu": ["--device", "cpu"], "cuda": ["--gpu", "A100-80GB"]}
# hf: takes the HF Trainer's defaults (fused AdamW, clipping at 1.0), a model file plain AdamW: name one
SAME_TRAINING = ["--optimizer", "adamw-fused", "--max-grad-norm", "1.0"]


def _model_file(tmp_path, arch):
    """A model file as a user writes it: the architecture from the saved config, no make_batch (memcheck
    infers the worst-case batch from the model's config)."""
    path = tmp_path / "model.py"
    path.write_text(
        "from pathlib import Path\n\nimport transformers\n\n\n"
        "def build_model():\n"
        f"    config = transformers.AutoConfig.from_pretrained(Path(__file__).parent / 'config')\n"
        f"    return transformers.{arch}(config)\n")
    return str(path)


def _peak(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_each_named_model_runs_from_a_model_file_and_from_hf_on_both_targets(name, tmp_path):
    config, arch, options = _named()[name]
    config.architectures = [arch]
    config.save_pretrained(tmp_path / "config")
    runner = CliRunner()

    def peak(spec, target):
        result = runner.invoke(main, ["estimate", spec, *TARGETS[target], *options, *SAME_TRAINING, "--json"])
        return _peak(result)

    hf_spec, model_file = f"hf:{tmp_path / 'config'}", _model_file(tmp_path, arch)
    assert peak(hf_spec, "cpu") > 0
    # the same model and batch reach the tracer from either front door (the CPU target's model-file
    # path is the one tests/test_accuracy_cpu.py runs for every zoo model)
    assert peak(model_file, "cuda") == peak(hf_spec, "cuda")
