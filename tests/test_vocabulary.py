"""The user's vocabulary (issue 17): Lightning's precision names, HF TrainingArguments' names in
configs and the Python API, and ``half`` checkpointing wherever checkpointing is given."""

import json

import pytest
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.enums import Precision

GPT2 = "examples/gpt2_small.py"


@pytest.mark.parametrize("lightning, ours", [("bf16-mixed", "amp-bf16"), ("16-mixed", "amp-fp16"),
                                             ("bf16-true", "bf16"), ("16-true", "fp16"), ("32-true", "fp32"),
                                             ("32", "fp32"), (16, "amp-fp16")])
def test_lightning_precision_names_mean_memchecks(lightning, ours):
    # lightning/fabric/plugins/precision/precision.py:24: "32" is "32-true", "16" is "16-mixed"
    assert Precision.parse(lightning) is Precision.parse(ours)


def _json(*args):
    result = CliRunner().invoke(main, [GPT2, "--max-len", "64", "--gpu", "A100-80GB", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_precision_bf16_mixed_is_amp_bf16_on_the_command_line():
    mixed, amp = _json("--precision", "bf16-mixed"), _json("--precision", "amp-bf16")
    assert mixed["job"]["precision"] == "amp-bf16"
    assert mixed["device_total_bytes"] == amp["device_total_bytes"]


def test_half_checkpointing_wraps_every_second_repeated_block_in_estimate():
    # GPT-2 small has 12 blocks, transformer.h.0 to h.11: half wraps h.0, h.2, ..., h.10
    data = _json("--checkpointing", "half")
    assert data["checkpointed_modules"] == [f"transformer.h.{i}" for i in range(0, 12, 2)]
    assert data["job"]["checkpointing"] == "half"


def test_every_n_checkpointing_wraps_every_nth_repeated_block_as_every_n_layers_does():
    # every:5 over h.0 to h.11: h.0, h.5, h.10 (transformers' every_n_layers=5 picks the same)
    data = _json("--checkpointing", "every:5")
    assert data["checkpointed_modules"] == ["transformer.h.0", "transformer.h.5", "transformer.h.10"]
    assert memcheck.Job(checkpointing="every:2") is not None


@pytest.mark.parametrize("bad", ["every:0", "every:x", "every:"])
def test_every_n_names_a_bad_n(bad):
    with pytest.raises(memcheck.UsageError, match="every:N needs a whole number N of at least 1"):
        memcheck.Job(checkpointing=bad)


def test_trainingarguments_names_are_the_same_job():
    hf = memcheck.Job.from_settings({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                     "bf16": True, "optim": "adamw_torch_fused", "gradient_checkpointing": True})
    ours = memcheck.Job(batch_size=4, accumulate=2, precision="amp-bf16", optimizer="adamw-fused",
                        checkpointing="full")
    assert hf == ours
    # transformers 5's own name for it (gradient_checkpointing is its deprecated alias)
    assert memcheck.Job.from_settings({"activation_checkpointing": True}).checkpointing == "full"
    # False says nothing: the default stays
    assert memcheck.Job.from_settings({"fp16": False, "gradient_checkpointing": False}) == memcheck.Job()


@pytest.mark.parametrize("settings, words", [
    ({"bf16": "yes"}, "bf16 must be true or false, got 'yes'"),
    ({"optim": "adamw_torch_fusd"}, "optim='adamw_torch_fusd' has no memcheck equivalent (did you mean "
                                    "'adamw_torch_fused'?)"),
    ({"bf16": True, "precision": "fp32"}, "'precision' sets 'precision', which 'bf16' already set"),
])
def test_trainingarguments_names_are_checked_and_named(settings, words):
    with pytest.raises(memcheck.UsageError) as err:
        memcheck.Job.from_settings(settings)
    assert words in str(err.value)


def test_a_config_in_trainingarguments_names_gives_the_same_result(tmp_path):
    (tmp_path / "gpt2_small.py").write_text(open(GPT2).read())
    (tmp_path / "memcheck.toml").write_text(
        'model = "gpt2_small.py"\nmax_len = 64\ngpu = "A100-80GB"\n\n'
        '[jobs.hf]\nper_device_train_batch_size = 2\nbf16 = true\noptim = "adamw_torch_fused"\n'
        'gradient_checkpointing = true\n\n'
        '[jobs.ours]\nmicro_batch = 2\nprecision = "amp-bf16"\noptimizer = "adamw-fused"\ncheckpointing = "full"\n')
    result = CliRunner().invoke(main, ["check", str(tmp_path / "memcheck.toml"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    totals = {r["job"]: r["total_bytes"] for r in data["results"]}
    assert set(totals) == {"hf", "ours"} and totals["hf"] == totals["ours"]


def test_a_config_names_both_keys_that_set_one_setting(tmp_path):
    (tmp_path / "gpt2_small.py").write_text(open(GPT2).read())
    (tmp_path / "memcheck.toml").write_text('model = "gpt2_small.py"\ngpu = "A100-80GB"\nmicro_batch = 2\n'
                                            'per_device_train_batch_size = 4\n')
    result = CliRunner().invoke(main, ["check", str(tmp_path / "memcheck.toml")])
    assert result.exit_code == 2
    assert "'per_device_train_batch_size' sets 'micro_batch', which 'micro_batch' already set" in result.output
