"""MemcheckCallback in a real transformers Trainer on the CPU: jobs that fit train, jobs that
do not are stopped before step 1 with the fix in TrainingArguments terms.

Budgets come from real runs (the profiler's steady-state peak of the same step, as
tests/test_plan.py measures) or from hand arithmetic, never from memcheck's output.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import logging as hf_logging

import memcheck
from memcheck.workloads import hf
from memcheck.enums import Task
from memcheck.errors import UsageError
from memcheck.integrations.transformers import MemcheckCallback
from memcheck.training.optimizers import HF_OPTIMIZERS, hf_optimizer
from memcheck.measure.local import measure_cpu
from memcheck.training.optimizers import OPTIMIZERS

hf_logging.set_verbosity_error()
TOLERANCE = 0.02  # the CPU target's accuracy tests use the same bound (tests/test_accuracy_cpu.py)
VOCAB, POSITIONS = 1000, 128
CONFIG = dict(n_layer=2, n_embd=64, n_head=2, n_positions=POSITIONS, vocab_size=VOCAB)
# GPT2(n_layer=2, n_embd=64, vocab 1000, 128 positions), lm_head tied to wte:
#   wte 1000*64 + wpe 128*64 = 72,192; per block 2 LayerNorms 2*128 + c_attn 64*192+192
#   + c_proj 64*64+64 + c_fc 64*256+256 + mlp c_proj 256*64+64 = 49,984; ln_f 128
#   72,192 + 2*49,984 + 128 = 172,288 parameters
PARAMS = 172_288


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


class _Tokens(torch.utils.data.Dataset):
    """``rows`` sequences of POSITIONS random token ids, labelled with themselves."""

    def __init__(self, rows: int):
        generator = torch.Generator().manual_seed(rows)
        self.ids = torch.randint(0, VOCAB, (rows, POSITIONS), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _measured(batch_size: int) -> int:
    """The real steady-state peak of 2 fused-AdamW steps on the CPU at the worst-case batch
    (every sequence 128 tokens, as the callback builds it), weights and batch included."""
    def build():
        model = _gpt2()
        return model, hf.make_batch(model, model.config, Task.CAUSAL_LM, batch_size, POSITIONS, None, device="cpu")

    return measure_cpu(build, lambda p: torch.optim.AdamW(p, fused=True), steps=2).steady_peak_bytes


@pytest.fixture(scope="module")
def measured_b2() -> int:
    return _measured(2)


def _args(tmp_path, **kwargs) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, save_strategy="no",
                per_device_train_batch_size=2, optim="adamw_torch_fused", logging_strategy="no")
    return TrainingArguments(**{**base, **kwargs})


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_parameter_count_is_the_hand_count():
    assert sum(p.numel() for p in _gpt2().parameters()) == PARAMS


def test_a_job_that_fits_trains_and_keeps_its_verdict(tmp_path, measured_b2, caplog):
    callback = MemcheckCallback(budget_bytes=2 * measured_b2)
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path), train_dataset=_Tokens(16), callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="memcheck.integrations.transformers"):
        trainer.train()
    assert trainer.state.global_step == 2
    verdict = callback.verdict
    assert verdict.fits and verdict.capacity_bytes == 2 * measured_b2
    # the callback traced the step the Trainer runs: micro-batch 2 at 128 tokens, fused AdamW
    assert verdict.estimate.batch.batch_size == 2 and verdict.estimate.batch.max_len == POSITIONS
    assert verdict.estimate.optimizer == "AdamW (fused)"
    error = (verdict.estimate.total_bytes - measured_b2) / measured_b2
    assert abs(error) <= TOLERANCE, f"predicted {verdict.estimate.total_bytes} B, measured {measured_b2} B"
    lines = [r.getMessage() for r in caplog.records if r.name == "memcheck.integrations.transformers"]
    assert len(lines) == 1 and lines[0].startswith("memcheck: fits: GPT2LMHeadModel")


def test_a_job_below_its_own_training_state_is_stopped_before_step_1(tmp_path):
    # parameters + gradients + AdamW's two states: 172,288 params * 4 B * 4 = 2,756,608 B,
    # live together at the optimizer step; the limit is 95% of that.
    budget = PARAMS * 4 * 4
    model = _gpt2()
    before = _weights(model)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Tokens(16),
                      callbacks=[MemcheckCallback(budget_bytes=budget, fix=False)])
    with pytest.raises(memcheck.WillNotFit) as info:
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert str(info.value).startswith("will not fit: GPT2LMHeadModel needs")
    assert info.value.verdict.capacity_bytes == budget


@pytest.fixture(scope="module")
def refused_b8(tmp_path_factory, measured_b2):
    """Micro-batch 8 measured for real, and the job at micro-batch 8 with that figure as its
    budget: over the 95% limit, while micro-batch 2 (measured above) is far below it."""
    measured_b8 = _measured(8)
    assert measured_b2 < 0.95 * measured_b8 < measured_b8
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path_factory.mktemp("b8"), per_device_train_batch_size=8),
                      train_dataset=_Tokens(16), callbacks=[MemcheckCallback(budget_bytes=measured_b8)])
    with pytest.raises(memcheck.WillNotFit) as info:
        trainer.train()
    assert trainer.state.global_step == 0
    return measured_b8, info.value


# How each checkpointing choice is applied through TrainingArguments (render._flags' words).
_CHECKPOINTING_ARGS = {
    "none": {},
    "full": {"activation_checkpointing": True},  # transformers 5's name; gradient_checkpointing is deprecated
    "half": {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}},
}


def test_a_refused_job_gets_its_fix_in_training_arguments_terms(refused_b8):
    _, error = refused_b8
    r = error.verdict.fix.recommended
    fix_line = str(error).splitlines()[1]
    assert fix_line.startswith(f"fix: per_device_train_batch_size={r.micro_batch_size}, "
                               f"gradient_accumulation_steps={r.accumulation_steps}")
    assert "global batch 8 kept" in fix_line and r.micro_batch_size * r.accumulation_steps == 8
    for key, value in _CHECKPOINTING_ARGS[r.checkpointing].items():
        assert f"{key}={value}" in fix_line


def test_the_fix_applied_as_worded_trains_and_really_fits(tmp_path, refused_b8):
    measured_b8, error = refused_b8
    r, limit = error.verdict.fix.recommended, error.verdict.limit_bytes
    checkpointing = _CHECKPOINTING_ARGS[r.checkpointing]
    callback = MemcheckCallback(budget_bytes=measured_b8)
    args = _args(tmp_path, per_device_train_batch_size=r.micro_batch_size,
                 gradient_accumulation_steps=r.accumulation_steps, **checkpointing)
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=_Tokens(16), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 2 and callback.verdict.fits
    # the callback read the checkpointing back from the model the Trainer set up
    traced = {"none": (), "full": ("(transformers' own checkpointing)",),
              "half": error.verdict.fix.checkpointed_modules}[r.checkpointing]
    assert callback.verdict.estimate.checkpointing == traced

    def build():  # the same settings, run for real under the profiler
        model = _gpt2()
        if checkpointing:
            model.activation_checkpointing_enable(
                every_n_layers=checkpointing.get("activation_checkpointing_kwargs", {}).get("every_n_layers", 1))
        return model, hf.make_batch(model, model.config, Task.CAUSAL_LM, r.micro_batch_size, POSITIONS, None,
                                    device="cpu")

    real = measure_cpu(build, lambda p: torch.optim.AdamW(p, fused=True), steps=2,
                       accumulate=r.accumulation_steps).steady_peak_bytes
    assert real <= limit, f"the fix really used {real} B over the {limit} B limit"


def _eval_trainer(tmp_path, budget, compute_metrics):
    args = _args(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    return Trainer(model=_gpt2(), args=args, train_dataset=_Tokens(16), eval_dataset=_Tokens(64),
                   compute_metrics=compute_metrics, callbacks=[MemcheckCallback(budget_bytes=budget)])


def test_evaluation_that_keeps_every_prediction_is_refused_with_an_eval_fix(tmp_path, measured_b2):
    # Training fits in 2x its measured peak. Evaluation over 64 rows at batch 8 keeps 8
    # batches of logits on the device (no eval_accumulation_steps): 8 * (8 * 128 * 1000 * 4 B)
    # = 32,768,000 B, more than the whole budget of 2 * measured_b2 (about 21.7 MB).
    budget = 2 * measured_b2
    assert 8 * 8 * POSITIONS * VOCAB * 4 > budget
    trainer = _eval_trainer(tmp_path, budget, compute_metrics=lambda prediction: {})
    with pytest.raises(memcheck.WillNotFit) as info:
        trainer.train()
    assert trainer.state.global_step == 0
    verdict = info.value.verdict
    assert verdict.estimate.peak_in == "eval" and verdict.eval_fix is not None
    fix_line = str(info.value).splitlines()[1]
    assert "evaluate with per_device_eval_batch_size=" in fix_line and "eval_accumulation_steps=1" in fix_line


def test_without_compute_metrics_evaluation_keeps_no_predictions_and_the_job_trains(tmp_path, measured_b2):
    # Trainer.evaluate passes prediction_loss_only=True when there is no compute_metrics:
    # only the loss is kept, so the same job as above fits, trains and evaluates.
    trainer = _eval_trainer(tmp_path, 2 * measured_b2, compute_metrics=None)
    trainer.train()
    assert trainer.state.global_step == 2
    assert any("eval_loss" in entry for entry in trainer.state.log_history)


def test_an_optimizer_from_trainer_arguments_is_traced_as_memchecks_own(tmp_path, measured_b2):
    callback = MemcheckCallback(budget_bytes=2 * measured_b2)
    # The Trainer builds transformers' Adafactor (wrapped by accelerate); memcheck traces its own.
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path, optim="adafactor", max_steps=1),
                      train_dataset=_Tokens(16), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 1 and callback.verdict.estimate.optimizer == "adafactor"


@pytest.mark.parametrize("hf_name, ours", [
    ("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw-fused"), ("adafactor", "adafactor"),
    ("sgd", "sgd"), ("adamw_bnb_8bit", "adamw-8bit"), ("adamw_8bit", "adamw-8bit"),
])
def test_hf_optimizer_names_map_to_memchecks(hf_name, ours):
    assert hf_optimizer(hf_name) == ours and ours in OPTIMIZERS
    assert set(HF_OPTIMIZERS.values()) <= set(OPTIMIZERS)


def test_sgd_with_momentum_in_optim_args_is_sgd_momentum():
    assert hf_optimizer("sgd", "momentum=0.9,nesterov=True") == "sgd-momentum"


def test_an_optimizer_memcheck_does_not_know_is_named_in_the_error():
    with pytest.raises(UsageError, match=r"optim='lomo' has no memcheck equivalent; memcheck knows adamw_torch"):
        hf_optimizer("lomo")


class _Tokenizer:
    """What the callback reads of a tokenizer (a real one would need a download)."""

    def __init__(self, model_max_length: int):
        self.model_max_length = model_max_length


def _begin(tmp_path, callback, **kwargs):
    callback.on_train_begin(_args(tmp_path), TrainerState(), TrainerControl(), model=_gpt2(), **kwargs)
    return callback.verdict


@pytest.mark.parametrize("told, traced", [(64, 64), (int(1e30), POSITIONS), (4096, POSITIONS)])
def test_the_length_comes_from_the_tokenizer_within_the_position_limit(tmp_path, told, traced):
    # int(1e30) is transformers' VERY_LARGE_INTEGER, a tokenizer that names no limit;
    # 4096 is past the model's 128 positions, which no real batch can exceed.
    verdict = _begin(tmp_path, MemcheckCallback(budget_bytes=2**30), processing_class=_Tokenizer(told))
    assert verdict.estimate.batch.max_len == traced
    assert verdict.estimate.optimizer == "adamw-fused"  # args.optim, with no optimizer built yet


def test_an_explicit_max_length_wins_and_is_checked_against_the_model(tmp_path):
    verdict = _begin(tmp_path, MemcheckCallback(budget_bytes=2**30, max_length=32), processing_class=_Tokenizer(64))
    assert verdict.estimate.batch.max_len == 32
    with pytest.raises(UsageError, match=r"max_length=256 exceeds the model's position limit of 128 "
                                         r"\(config.max_position_embeddings\)"):
        _begin(tmp_path, MemcheckCallback(budget_bytes=2**30, max_length=256))


def test_a_cpu_job_needs_a_budget(tmp_path):
    with pytest.raises(UsageError, match=r"budget_bytes"):
        _begin(tmp_path, MemcheckCallback())


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu": "A100-80GBX"}, "A100-80GBX"),
    ({"margin": 1.5}, r"margin must be a fraction in \[0, 1\), such as 0.05; got 1.5"),
    ({"budget_bytes": -1}, "budget_bytes must be a positive integer, got -1"),
    ({"max_length": 0}, "max_length must be a positive integer, got 0"),
])
def test_bad_settings_fail_when_the_callback_is_built(kwargs, message):
    with pytest.raises(UsageError, match=message):
        MemcheckCallback(**kwargs)


def _launch(world_size=1, n_gpu=1, deepspeed=None, fsdp=None, fsdp_config=None, ddp_bucket_cap_mb=None, bf16=False):
    """What _strategy reads of TrainingArguments (a real multi-process launch needs GPUs)."""
    from types import SimpleNamespace

    ds = SimpleNamespace(config=deepspeed) if deepspeed else None
    return SimpleNamespace(world_size=world_size, n_gpu=n_gpu, deepspeed=deepspeed, hf_deepspeed_config=ds,
                           fsdp=fsdp, fsdp_config=fsdp_config, ddp_bucket_cap_mb=ddp_bucket_cap_mb, bf16=bf16)


@pytest.mark.parametrize("launch, expected", [
    (_launch(), ("single", None, {})),
    (_launch(n_gpu=4), ("dp", 4, {})),
    (_launch(world_size=8), ("ddp", 8, {})),
    (_launch(world_size=8, ddp_bucket_cap_mb=50), ("ddp", 8, {"bucket_cap_mb": 50})),
    (_launch(world_size=8, fsdp=True, fsdp_config={"cpu_offload": True}), ("fsdp", 8, {"offload": "params"})),
    # bf16=True: the Trainer's Accelerator gives FSDP its MixedPrecisionPolicy (accelerate's set_mixed_precision)
    (_launch(world_size=8, fsdp=True, bf16=True),
     ("fsdp", 8, {"param_dtype": "bf16", "reduce_dtype": "bf16", "output_dtype": "bf16"})),
    (_launch(world_size=8, fsdp=True, fsdp_config={"version": 1}, bf16=True),
     ("fsdp1", 8, {"fsdp_sharding": "full_shard", "param_dtype": "bf16", "reduce_dtype": "bf16"})),
    # fsdp_config version 1 is FSDP1: reshard_after_forward names its sharding strategy (training_args.py)
    (_launch(world_size=8, fsdp=True, fsdp_config={"version": 1}), ("fsdp1", 8, {"fsdp_sharding": "full_shard"})),
    (_launch(world_size=8, fsdp="shard_grad_op offload", fsdp_config={"version": 1, "cpu_offload": True}),
     ("fsdp1", 8, {"fsdp_sharding": "shard_grad_op", "offload": "params"})),
    (_launch(world_size=8, fsdp=True, fsdp_config={"version": 1, "reshard_after_forward": "no_shard"}),
     ("fsdp1", 8, {"fsdp_sharding": "no_shard"})),
    (_launch(world_size=4, deepspeed={"zero_optimization": {"stage": 2}}), ("zero2", 4, {})),
    (_launch(world_size=4, deepspeed={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
     ("zero3", 4, {"offload": "params"})),
    (_launch(world_size=4, deepspeed={"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}),
     ("zero1", 4, {"offload": "optimizer"})),
])
def test_the_launch_maps_to_a_memcheck_strategy(launch, expected):
    from memcheck.integrations.transformers import _strategy

    assert _strategy(launch) == expected


def test_fsdp1_hybrid_shard_shards_over_the_launchers_local_world(monkeypatch):
    from memcheck.integrations.transformers import _strategy

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun on 2 nodes of 4 GPUs
    launch = _launch(world_size=8, fsdp=True, fsdp_config={"version": 1, "reshard_after_forward": "hybrid_shard"})
    assert _strategy(launch) == ("fsdp1", 8, {"fsdp_sharding": "hybrid_shard", "gpus_per_node": 4})


def test_an_fsdp1_strategy_memcheck_does_not_model_is_named():
    from memcheck.integrations.transformers import _strategy

    with pytest.raises(UsageError, match="'hybrid_shard_zero2'"):
        _strategy(_launch(world_size=8, fsdp=True, fsdp_config={"version": 1,
                                                                "reshard_after_forward": "hybrid_shard_zero2"}))


def test_a_gpu_named_is_the_target_though_the_trainer_runs_on_the_cpu(tmp_path, caplog):
    # a laptop or CI dry-runs the GPU job: gpu= is the target whatever device the Trainer has
    callback = MemcheckCallback(gpu="A100-80GB")
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path), train_dataset=_Tokens(16), callbacks=[callback])
    assert trainer.args.device.type == "cpu"
    with caplog.at_level(logging.INFO, logger="memcheck.integrations.transformers"):
        trainer.train()
    estimate = callback.verdict.estimate
    assert estimate.device.value == "cuda" and estimate.gpu.name == "A100-80GB"
    # the fitting job says so at WARNING, the level transformers' log shows by default
    (record,) = [r for r in caplog.records if r.name == "memcheck.integrations.transformers"]
    assert record.levelno == logging.WARNING and record.getMessage().startswith("memcheck: fits:")


@pytest.mark.parametrize("settings, packed", [
    ({}, False),  # TrainingArguments: no packing
    ({"packing": True, "packing_strategy": "bfd"}, True),  # TRL's default strategy turns padding_free on
    ({"packing": True, "packing_strategy": "bfd_split"}, True),
    ({"packing": True, "packing_strategy": "wrapped"}, False),  # rows of max_length with a mask: padded's worst case
    ({"packing": False, "padding_free": True}, True),
])
def test_trls_packing_arguments_make_the_packed_job_as_sfttrainer_decides(settings, packed):
    from types import SimpleNamespace

    from memcheck.integrations.transformers import _packing

    # trl/trainer/sft_trainer.py: padding_free = args.padding_free or (args.packing and strategy in {bfd, bfd_split})
    assert _packing(SimpleNamespace(**settings)) is packed
