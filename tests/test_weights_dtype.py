"""The weights' dtype is part of the job (issue 17): a Hub config's ``dtype: bfloat16`` no longer
makes an fp32 job trace bf16 weights, and the report names the dtype it traced."""

import json

import pytest
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.workloads.source import load_workload

# Llama-3-8B's published config.json (hyper-parameters and "torch_dtype": "bfloat16").
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "bos_token_id": 128000, "eos_token_id": 128001,
             "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# Its parameters, by hand: embeddings and lm_head 128,256 x 4,096 = 525,336,576 each; a layer has
# q and o 4,096 x 4,096 = 16,777,216 each, k and v 4,096 x 1,024 = 4,194,304 each, gate, up and
# down 4,096 x 14,336 = 58,720,256 each, two norms of 4,096: 218,112,000; 32 layers 6,979,584,000;
# the final norm 4,096. Total 2 x 525,336,576 + 6,979,584,000 + 4,096 = 8,030,261,248.
LLAMA3_8B_PARAMS = 8_030_261_248


def _config_dir(tmp_path, **changes):
    config = {**LLAMA3_8B, **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _estimate(path, **job):
    work = load_workload(f"hf:{path}", batch_size=1, max_len=32)
    return memcheck.estimate(work.model, work.batch, memcheck.Job(device="cpu", max_len=32, **job),
                             loss_fn=work.loss_fn)


@pytest.mark.slow
@pytest.mark.parametrize("precision, weights, params", [
    ("fp32", "auto", LLAMA3_8B_PARAMS * 4),  # 32,121,044,992 B: fp32 training has fp32 weights
    ("amp-bf16", "auto", LLAMA3_8B_PARAMS * 2),  # 16,060,522,496 B: from_pretrained's dtype="auto" keeps bf16
])  # fp32 master weights under autocast and pure bf16 are checked on the small config below
def test_llama3_8b_hub_config_weights_follow_the_precision(tmp_path, precision, weights, params):
    est = _estimate(_config_dir(tmp_path), precision=precision, weights_dtype=weights)
    assert est.breakdown_at_peak.params == params
    assert est.weights_dtype == {LLAMA3_8B_PARAMS * 4: "float32", LLAMA3_8B_PARAMS * 2: "bfloat16"}[params]


def _small(tmp_path, dtype="bfloat16"):
    # two layers of width 64: 2 x (64 x 64 x 2 + 64 x 16 x 2 + 64 x 128 x 3 + 128) + 2 x 256 x 64 + 64
    return _config_dir(tmp_path, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1, vocab_size=256, bos_token_id=0, eos_token_id=0, torch_dtype=dtype)


SMALL_PARAMS = 2 * (64 * 64 * 2 + 64 * 16 * 2 + 64 * 128 * 3 + 2 * 64) + 2 * 256 * 64 + 64  # 109,888


def test_an_fp32_job_on_a_bf16_config_traces_fp32_weights_and_says_so(tmp_path):
    est = _estimate(_small(tmp_path))
    assert est.breakdown_at_peak.params == SMALL_PARAMS * 4 and est.weights_dtype == "float32"
    assert "weights cast from the model's bfloat16 to float32 for fp32" in est.assumptions
    assert est.to_dict()["weights_dtype"] == "float32"


def test_autocast_keeps_the_models_own_dtype_and_says_whose(tmp_path):
    est = _estimate(_small(tmp_path), precision="amp-bf16")
    assert est.breakdown_at_peak.params == SMALL_PARAMS * 2 and est.weights_dtype == "bfloat16"
    assert any(a.startswith("amp-bf16 over the model's own bfloat16 weights") for a in est.assumptions)


@pytest.mark.parametrize("precision, weights, factor", [("amp-bf16", "fp32", 4), ("bf16", "auto", 2)])
def test_master_weights_and_pure_bf16_on_a_bf16_config(tmp_path, precision, weights, factor):
    est = _estimate(_small(tmp_path), precision=precision, weights_dtype=weights)
    assert est.breakdown_at_peak.params == SMALL_PARAMS * factor


def test_a_config_without_a_dtype_is_fp32_as_from_config_builds_it(tmp_path):
    est = _estimate(_small(tmp_path, dtype=None), precision="amp-bf16")
    assert est.breakdown_at_peak.params == SMALL_PARAMS * 4 and est.weights_dtype == "float32"


@pytest.mark.parametrize("precision, weights, words", [
    ("fp32", "bf16", "weights_dtype bf16 contradicts precision fp32"),
    ("bf16", "fp32", "weights_dtype fp32 contradicts precision bf16"),
    ("amp-fp16", "fp16", "Attempting to unscale FP16 gradients"),
])
def test_a_weights_dtype_that_contradicts_the_precision_is_refused(precision, weights, words):
    with pytest.raises(memcheck.UsageError, match=words):
        memcheck.Job(precision=precision, weights_dtype=weights)


def test_the_header_names_the_weights_dtype_and_the_cli_refuses_a_contradiction(tmp_path):
    path = _small(tmp_path)
    runner = CliRunner()
    ok = runner.invoke(main, [f"hf:{path}", "--max-len", "32", "--device", "cpu", "--precision", "amp-bf16"])
    assert ok.exit_code == 0, ok.output
    assert "amp-bf16, bfloat16 weights" in ok.output.splitlines()[0]
    bad = runner.invoke(main, [f"hf:{path}", "--max-len", "32", "--weights-dtype", "fp16"])
    assert bad.exit_code == 2
    assert "--weights-dtype fp16 contradicts precision fp32" in bad.output
