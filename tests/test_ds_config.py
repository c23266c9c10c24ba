"""DeepSpeed JSON configs as the job (memcheck.workloads.deepspeed; ``memcheck check ds_config.json --model``).

The expected values are DeepSpeed's own rules worked by hand (``DeepSpeedConfig._configure_train_batch_size``:
train_batch_size = micro x accumulation x world size) and the HF Trainer's "auto" rules
(``trainer_config_finalize``: reduce_bucket_size = h*h, stage3_prefetch_bucket_size = int(0.9*h*h)).
One test traces a 3-block MLP (the ``Net`` of tests/test_sharded.py) to show a bucket size reaching the
zero emulation; the rest read configs only.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memcheck
from memcheck.cli import main
from memcheck.errors import UsageError
from memcheck.job import Job
from memcheck.workloads.deepspeed import read_deepspeed

# transformers' docs, "ZeRO-3 example" (the HF Trainer's DeepSpeed guide), with its "auto"s for
# the precision and the clipping written out and the three batch keys given as numbers.
HF_ZERO3 = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
}


def test_the_hf_zero3_example_maps_to_zero3_with_params_offloaded_in_deepspeeds_bf16_mode():
    read = read_deepspeed(HF_ZERO3)
    assert read.settings == {
        "micro_batch": 2, "accumulation": 4,
        "gpus": 8,  # 64 = 2 x 4 x W  ->  W = 8
        "strategy": "zero3", "offload": "params",  # offload_param and offload_optimizer to the CPU
        "precision": "bf16",  # DeepSpeed's bf16 mode: bf16 weights, the fp32 master in the ZeRO optimizer
        "max_live_parameters": 10**9, "max_grad_norm": 1.0,
        "optimizer": "adamw-fused",  # FusedAdam in adam_w_mode
    }
    assert read.auto == ("reduce_bucket_size", "stage3_prefetch_bucket_size")
    assert any("stage3_param_persistence_threshold" in n and "not modelled" in n for n in read.notes)


def test_auto_bucket_sizes_come_from_the_hidden_size_as_the_hf_trainer_fills_them():
    job, _ = memcheck.deepspeed_job(HF_ZERO3, hidden_size=768, gpu="A100-80GB")
    assert job.reduce_bucket_size == 768 * 768 == 589_824
    assert job.prefetch_bucket_size == int(0.9 * 768 * 768) == 530_841  # 530,841.6 truncated
    with pytest.raises(UsageError, match=r"zero_optimization.reduce_bucket_size, "
                                         r"zero_optimization.stage3_prefetch_bucket_size is \"auto\""):
        memcheck.deepspeed_job(HF_ZERO3, gpu="A100-80GB")


@pytest.mark.parametrize("keys, gpus, micro, accumulation", [
    ({"train_micro_batch_size_per_gpu": 4}, 2, 4, 1),  # accumulation 1 by default
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, 4, 2),  # 32 / 4 / 4 = 2
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, 4, 2),  # 32 / 4 / 2 = 4
    ({"train_batch_size": 32}, 8, 4, 1),  # 32 / 8
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, 4, 2),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3}, 4, 4, 3),
])
def test_batch_keys_are_completed_as_deepspeed_does(keys, gpus, micro, accumulation):
    settings = read_deepspeed({**keys, "zero_optimization": {"stage": 1}}, gpus=gpus).settings
    assert (settings["micro_batch"], settings["accumulation"], settings["gpus"]) == (micro, accumulation, gpus)


def test_the_world_size_comes_from_the_three_batch_keys_or_is_noted():
    # 96 = 3 x 4 x W  ->  W = 8
    keys = {"train_batch_size": 96, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4,
            "zero_optimization": {"stage": 2}}
    assert read_deepspeed(keys).settings["gpus"] == 8
    read = read_deepspeed({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}})
    assert read.settings["gpus"] == 2 and any(n.startswith("world size: not given") for n in read.notes)


@pytest.mark.parametrize("config, gpus, message", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4,
     r"train_batch_size 16 is not train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x 4 GPU"),
    ({"train_batch_size": 15, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, None,
     r"not a multiple"),
    ({"gradient_accumulation_steps": 4}, 2, r"either train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_gpu": "auto"}, 2, r"train_micro_batch_size_per_gpu is \"auto\""),
    ({"train_micro_batch_size_per_gpu": 0}, 2, r"train_micro_batch_size_per_gpu must be a positive integer"),
    ({"train_micro_batch_size_per_gpu": "2"}, 2, r"train_micro_batch_size_per_gpu must be a positive integer"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "two"}}, 2,
     r"zero_optimization.stage must be 0, 1, 2 or 3, got 'two'"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}}, 2,
     r"zero_optimization has no key 'reduce_bucket_sise' \(did you mean 'reduce_bucket_size'\?\); DeepSpeed refuses"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}}, 2,
     r"reduce_bucket_size must be a positive integer"),
    ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True, "foo": 1}}, 2, r"bf16 has no key 'foo'"),
    ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": "auto"}}, 2, r"bf16.enabled is \"auto\""),
    ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, 2,
     r"bf16 and fp16 are both enabled"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto"}, 2, r"gradient_clipping is \"auto\""),
    ({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb"}}, 2,
     r"optimizer.type 'Lamb' has no memcheck equivalent"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme"}}}, 2, r"offload_optimizer.device \"nvme\" is not modelled"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "cpu"}}}, 2, r"offload_param without offload_optimizer is not modelled"),
])
def test_bad_configs_are_refused_naming_the_key(config, gpus, message):
    with pytest.raises(UsageError, match=message):
        read_deepspeed(config, gpus=gpus)


def test_bf16_at_stage_0_is_refused_since_no_memcheck_precision_matches():
    # DeepSpeed's BF16_Optimizer keeps bf16 weights with an fp32 master: ddp with precision bf16 has no
    # master, amp-bf16 keeps fp32 weights; neither is picked silently
    with pytest.raises(UsageError, match=r"bf16.enabled at zero_optimization.stage 0 is not modelled"):
        read_deepspeed({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}, gpus=4)


def test_stage_0_is_ddp_or_single_with_a_note_and_torch_autocast_is_amp():
    read = read_deepspeed({"train_micro_batch_size_per_gpu": 2, "torch_autocast": {"enabled": True}}, gpus=4)
    assert (read.settings["strategy"], read.settings["gpus"], read.settings["precision"]) == ("ddp", 4, "amp-bf16")
    assert any("not DDP's 25 MiB buckets" in n for n in read.notes)
    assert read_deepspeed({"train_micro_batch_size_per_gpu": 2}, gpus=1).settings["strategy"] == "single"


def test_keys_read_and_not_modelled_are_listed_and_unknown_top_level_keys_noted():
    read = read_deepspeed({
        "train_micro_batch_size_per_gpu": 2, "my_key": 1, "pipeline": {"stages": 2},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
        "zero_optimization": {"stage": 2, "allgather_bucket_size": 2e8, "overlap_comm": True,
                              "contiguous_gradients": False, "stage3_prefetch_bucket_size": 1000,
                              "reduce_bucket_size": 2e8}}, gpus=2)
    assert read.settings["reduce_bucket_size"] == 200_000_000 and "prefetch_bucket_size" not in read.settings
    text = "\n".join(read.notes)
    for key in ("allgather_bucket_size", "overlap_comm = true", "contiguous_gradients = false",
                "stage3_prefetch_bucket_size: read, not modelled (used at stage 3", "partition_activations",
                "cpu_checkpointing", "pipeline: read, not modelled", "'my_key': not a DeepSpeed key"):
        assert key in text, key


def test_zero_bucket_settings_are_validated_by_the_job():
    with pytest.raises(UsageError, match="prefetch_bucket_size applies to zero3 only"):
        Job(strategy="zero2", prefetch_bucket_size=10)
    with pytest.raises(UsageError, match="reduce_bucket_size applies to zero1-3 only"):
        Job(strategy="ddp", reduce_bucket_size=10)
    with pytest.raises(UsageError, match="reduce_bucket_size must be a positive integer"):
        Job(strategy="zero2", reduce_bucket_size=0)
    with pytest.raises(UsageError, match="max_live_parameters must be at most"):
        Job(strategy="zero3", max_live_parameters=2**41)


class Net(nn.Module):
    """tests/test_sharded.py's: 3 blocks Linear(10, 10) (110 elements each) and a head Linear(10, 3) (33): 363."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(10, 10), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_reduce_bucket_size_reaches_the_zero_emulation():
    job, _ = memcheck.deepspeed_job({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": 1000}}, gpus=2, device="cpu")
    with torch.device("meta"):
        model = Net()
    est = memcheck.estimate(model, torch.empty(2, 10, device="meta"), job)
    # as tests/test_sharded.py's zero2 all-reduce, with a 1000-element bucket instead of 5e8:
    # bucket 1000 x 4 B + the flattened copy of the 363 gradients in it, 363 x 4 B = 5452 B
    assert est.breakdown_at_peak.communication == 1000 * 4 + 363 * 4


# ---- the command line: bad input is one line and exit 2 (nothing is loaded or traced) -------------------


def _check(tmp_path, text: str, *args):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    model = tmp_path / "model.py"
    model.write_text("import torch\nmodel = torch.nn.Linear(4, 4)\n")
    return CliRunner().invoke(main, ["check", str(path), *args], catch_exceptions=False), str(path), str(model)


@pytest.mark.parametrize("text, extra, message", [
    ('{"train_micro_batch_size_per_gpu": 2,', [], "not valid JSON"),
    ('[1, 2]', [], "a DeepSpeed config is a JSON object, not a list"),
    ('{"train_micro_batch_size_per_gpu": true}', [], "train_micro_batch_size_per_gpu must be a positive integer"),
    ('{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}',
     ["--gpus", "4"], "train_batch_size 16 is not"),
    ('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}}',
     [], "stage3_prefetch_bucket_size must be an integer of at least 0"),
    ('{"train_micro_batch_size_per_gpu": 2}', ["--gpus", "0"], "gpus must be a positive integer"),
])
def test_bad_deepspeed_configs_exit_2_with_one_line(tmp_path, text, extra, message):
    result, path, model = _check(tmp_path, text)
    result = CliRunner().invoke(main, ["check", path, "--model", model, "--gpu", "A100-80GB", *extra],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and path in lines[0], result.stderr


def test_a_deepspeed_config_without_model_or_gpu_says_what_to_add(tmp_path):
    result, path, model = _check(tmp_path, '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}')
    assert result.exit_code == 2 and "--model MODEL --gpu GPU" in result.stderr, result.stderr
    result = CliRunner().invoke(main, ["check", path, "--model", model], catch_exceptions=False)
    assert result.exit_code == 2 and "give --gpu" in result.stderr, result.stderr
    result = CliRunner().invoke(main, ["check", path, "--gpu", "A100-80GB"], catch_exceptions=False)
    assert result.exit_code == 2 and "--gpu applies to DeepSpeed configs, with --model" in result.stderr
    result = CliRunner().invoke(main, ["check", path, "--model", str(tmp_path / "nope.py"), "--gpu", "T4"],
                                catch_exceptions=False)
    assert result.exit_code == 2 and "no such model file" in result.stderr, result.stderr
    assert json.loads((tmp_path / "ds_config.json").read_text())  # left as it was


_MLP = """import torch
from torch import nn


def build_model():
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def make_batch(batch_size, max_len=None):
    return torch.randn(batch_size, 256)
"""


def test_a_deepspeed_job_that_does_not_fit_gets_its_fix_in_deepspeeds_keys(tmp_path):
    import re

    (tmp_path / "model.py").write_text(_MLP)
    # no --gpus: 2 GPUs (noted); 32768 = 16384 x 1 x 2
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_batch_size": 32768, "train_micro_batch_size_per_gpu": 16384,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e5}, "optimizer": {"type": "AdamW"}}))
    result = CliRunner().invoke(main, ["check", str(tmp_path / "ds.json"), "--model", str(tmp_path / "model.py"),
                                       "--gpu-memory", "600MiB"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    text = " ".join(result.stdout.split())
    # the strategy's label names its GPUs once (the verdict's headroom follows it after a semicolon)
    assert re.search(r"zero2 x2[ ;]", text) and "x2 x2" not in text, text
    fix = re.search(r'"train_micro_batch_size_per_gpu": (\d+), "gradient_accumulation_steps": (\d+), '
                    r"--checkpointing none \(global batch 32768 kept", text)
    assert fix and int(fix[1]) < 16384 and int(fix[1]) * int(fix[2]) * 2 == 32768, text
    assert "note: world size: not given" in text
