"""Configs where they live (issue 17): ``memcheck check`` reads the job's settings from the
trainer's own TrainingArguments, LightningCLI, accelerate or DeepSpeed file (``trainer_config``)."""

import json

import pytest

from memcheck.config_gate import load_config
from memcheck.errors import UsageError
from memcheck.workloads.trainer_files import trainer_settings

GPT2 = open("examples/gpt2_small.py").read()


def _write(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return tmp_path / name


@pytest.mark.parametrize("name, text, kind, settings", [
    ("args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8,
                              "bf16": True, "optim": "adamw_torch_fused", "gradient_checkpointing": True,
                              "gradient_checkpointing_kwargs": {"use_reentrant": False}, "learning_rate": 2e-5}),
     "TrainingArguments", {"micro_batch": 4, "accumulation": 8, "precision": "amp-bf16", "optimizer": "adamw-fused",
                           "checkpointing": "full", "reentrant": False}),
    ("lightning.yaml", "trainer:\n  precision: bf16-mixed\n  accumulate_grad_batches: 2\n  strategy: deepspeed_stage_3\n"
                       "  devices: 4\ndata:\n  init_args:\n    batch_size: 16\n",
     # under DeepSpeed bf16-mixed turns on DeepSpeed's bf16 mode (Lightning's _format_precision_config): pure bf16
     "LightningCLI", {"precision": "bf16", "accumulation": 2, "strategy": "zero3", "gpus": 4, "micro_batch": 16}),
    # outside DeepSpeed, Lightning's automatic optimization zeroes the gradients between the forward and the
    # backward (loops/optimization/automatic.py:131-140): its step order
    ("lightning1.yaml", "trainer:\n  accumulate_grad_batches: 4\n  strategy: ddp\n  devices: 2\n",
     "LightningCLI", {"accumulation": 4, "strategy": "ddp", "gpus": 2, "step_order": "lightning"}),
    ("accelerate.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\n"
                        "num_processes: 8\nfsdp_config:\n  fsdp_offload_params: true\n",
     # accelerate's fsdp_version defaults to 1: FSDP1, FULL_SHARD; mixed_precision bf16 also gives FSDP a
     # MixedPrecision(param_dtype=bf16, reduce_dtype=bf16) (accelerate 1.15 state.py:1014-1015, set_mixed_precision)
     "accelerate", {"precision": "amp-bf16", "strategy": "fsdp1", "fsdp_sharding": "full_shard", "offload": "params",
                    "param_dtype": "bf16", "reduce_dtype": "bf16", "gpus": 8}),
    ("accelerate2.yaml", "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\n",
     "accelerate", {"strategy": "fsdp", "gpus": 4}),
    # FSDP2 under mixed_precision bf16: MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype all bf16)
    ("accelerate3.yaml", "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 4\nfsdp_config:\n"
                         "  fsdp_version: 2\n",
     "accelerate", {"precision": "amp-bf16", "strategy": "fsdp", "param_dtype": "bf16", "reduce_dtype": "bf16",
                    "output_dtype": "bf16", "gpus": 4}),
    ("accelerate1.yaml", "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_sharding_strategy: 2\n",
     "accelerate", {"strategy": "fsdp1", "fsdp_sharding": "shard_grad_op", "gpus": 4}),
    ("args1.json", json.dumps({"output_dir": "out", "fsdp": "hybrid_shard auto_wrap", "fsdp_config": {"version": 1}}),
     "TrainingArguments", {"strategy": "fsdp1", "fsdp_sharding": "hybrid_shard"}),
    ("ds.json", json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
                            "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer":
                                                                             {"device": "cpu"}}}),
     # DeepSpeed's bf16 mode: bf16 weights, an fp32 master in the ZeRO optimizer (zero.py's docstring: not amp-bf16,
     # which keeps fp32 weights as DeepSpeed's torch_autocast does)
     "DeepSpeed", {"micro_batch": 2, "precision": "bf16", "strategy": "zero2", "offload": "optimizer"}),
])
def test_each_trainers_file_becomes_memchecks_settings(tmp_path, name, text, kind, settings):
    assert trainer_settings(_write(tmp_path, name, text)) == (kind, settings)


DS_AUTO = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize("name, text", [
    ("ds.json", json.dumps({**DS_AUTO, "bf16": {"enabled": True}})),  # memcheck check ds_config.json's reading
    # the HF Trainer fills bf16.enabled from bf16=True (integrations/deepspeed.py, fill_match)
    ("args.json", json.dumps({"output_dir": "out", "bf16": True, "deepspeed": "ds_auto.json"})),
    # Lightning adds {"bf16": {"enabled": True}} for bf16-mixed (fabric/strategies/deepspeed.py)
    ("lightning.yaml", "trainer:\n  precision: bf16-mixed\n  strategy: deepspeed_stage_2\n  devices: 2\n"),
    # accelerate sets bf16.enabled for mixed_precision bf16 (DeepSpeedPlugin.set_mixed_precision), from its
    # own keys or from the config file it names
    ("accelerate.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
                        "deepspeed_config:\n  zero_stage: 2\n"),
    ("accelerate_file.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
                             "deepspeed_config:\n  deepspeed_config_file: ds_auto.json\n"),
])
def test_deepspeeds_bf16_is_pure_bf16_on_every_path(tmp_path, name, text):
    # DeepSpeed's bf16 mode casts the weights to bf16 and keeps an fp32 master in the ZeRO optimizer:
    # memcheck's pure bf16 under zero1-3 (zero.py's docstring), never amp-bf16 (fp32 weights, autocast)
    _write(tmp_path, "ds_auto.json", json.dumps(DS_AUTO))
    _, settings = trainer_settings(_write(tmp_path, name, text))
    assert (settings["precision"], settings["strategy"]) == ("bf16", "zero2")


def test_deepspeeds_bf16_at_stage_0_is_refused_on_the_trainers_path_as_on_the_ds_config_path(tmp_path):
    _write(tmp_path, "ds0.json", json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 0}}))
    with pytest.raises(UsageError, match="bf16.enabled at zero_optimization.stage 0 is not modelled"):
        trainer_settings(_write(tmp_path, "args.json", json.dumps({"output_dir": "o", "bf16": True,
                                                                   "deepspeed": "ds0.json"})))


def test_a_trainingarguments_file_gives_the_same_result_as_the_same_job_in_memchecks_keys(tmp_path):
    _write(tmp_path, "gpt2_small.py", GPT2)
    _write(tmp_path, "args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 2,
                                              "gradient_accumulation_steps": 4, "bf16": True,
                                              "optim": "adamw_torch_fused", "gradient_checkpointing": True}))
    _write(tmp_path, "memcheck.toml", 'model = "gpt2_small.py"\nmax_len = 64\ngpu = "A100-80GB"\n\n'
                                      '[jobs.from_args]\ntrainer_config = "args.json"\n\n'
                                      '[jobs.ours]\nmicro_batch = 2\naccumulation = 4\nprecision = "amp-bf16"\n'
                                      'optimizer = "adamw-fused"\ncheckpointing = "full"\n')
    # the same Job value, so the same trace (tests/test_vocabulary.py runs such a pair through memcheck check)
    jobs = {c.name: c.job for c in load_config(tmp_path / "memcheck.toml")}
    assert jobs["from_args"] == jobs["ours"]


def test_a_setting_in_both_files_is_refused_naming_both(tmp_path):
    _write(tmp_path, "gpt2_small.py", GPT2)
    _write(tmp_path, "args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 2}))
    _write(tmp_path, "memcheck.toml", 'model = "gpt2_small.py"\ngpu = "A100-80GB"\nmicro_batch = 8\n'
                                      'trainer_config = "args.json"\n')
    with pytest.raises(UsageError, match="'micro_batch' sets 'micro_batch', which args.json \\(TrainingArguments\\) "
                                         "sets too; give it in one place"):
        load_config(tmp_path / "memcheck.toml")


@pytest.mark.parametrize("name, text, words", [
    ("other.json", json.dumps({"lr": 1}), "not a trainer config memcheck reads"),
    ("args.json", json.dumps({"output_dir": "o", "optim": "lomo"}), "optim='lomo' has no memcheck equivalent"),
    ("l.yaml", "trainer:\n  strategy: xla\n", "trainer.strategy 'xla' has no memcheck equivalent"),
    ("args.json", "{not json", "not valid JSON"),
])
def test_a_file_memcheck_cannot_read_is_one_line_naming_it(tmp_path, name, text, words):
    with pytest.raises(UsageError, match=words):
        trainer_settings(_write(tmp_path, name, text))
