"""The planner (memcheck.engine.plan), checked against real CPU runs measured by the profiler.

The CPU target is the one CI can run for real: a plan made for a CPU memory
budget is run at its recommended micro-batch (it must stay within the limit)
and one candidate above it (it must not), and the length profile is compared
with real runs at each length. FLOP counts, the cost proxy's input, are
compared with torch's FlopCounterMode on a real step.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

import memcheck
from memcheck.errors import UsageError
from memcheck.measure.local import measure_cpu
from memcheck.engine.plan import TRACES_PER_OPTION, _quadratic_root, plan
from memcheck.job import DEFAULT_MARGIN
from memcheck.units import MiB

logging.set_verbosity_error()
TOLERANCE = 0.02  # the CPU target's accuracy tests use the same bound (tests/test_accuracy_cpu.py)
VOCAB, POSITIONS = 1000, 256


def _gpt2(attn: str = "sdpa") -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS)
    config._attn_implementation = attn
    return GPT2LMHeadModel(config)


def _batch(batch_size: int, length: int = 128) -> dict:
    ids = torch.randint(0, VOCAB, (batch_size, length))
    return {"input_ids": ids, "labels": ids}


def _meta_model(attn: str = "sdpa"):
    with torch.device("meta"):
        return _gpt2(attn)


def _make(batch_size, length=128, target=None):
    with torch.device("meta"):
        return _batch(batch_size, length)


def _measured(batch_size: int, length: int = 128, attn: str = "sdpa") -> int:
    """The real steady-state peak of 2 AdamW steps on CPU (weights and batch included)."""
    def build():
        return _gpt2(attn), _batch(batch_size, length)

    return measure_cpu(build, lambda p: torch.optim.AdamW(p), steps=2).steady_peak_bytes


BUDGET = 160 * MiB  # small enough that the boundary is a two-digit micro-batch at 128 tokens


@pytest.fixture(scope="module")
def cpu_plan():
    return plan(_meta_model(), _make, device="cpu", budget_bytes=BUDGET, checkpointing_options=("none",),
                max_len=128, max_len_limit=POSITIONS)


def test_plan_never_exceeds_budget_when_run_for_real(cpu_plan):
    rec = cpu_plan.recommended
    measured = _measured(rec.micro_batch_size)
    # limit = 160 MiB * (1 - 0.05) = 152 MiB = 159,383,552 B
    assert cpu_plan.limit_bytes == int(BUDGET * (1 - DEFAULT_MARGIN)) == 159_383_552
    assert measured <= cpu_plan.limit_bytes, f"micro-batch {rec.micro_batch_size} really used {measured} B"
    assert abs(rec.predicted_device_total_bytes - measured) / measured <= TOLERANCE


def test_plan_is_the_largest_micro_batch_that_fits_when_run_for_real(cpu_plan):
    rec = cpu_plan.recommended
    assert rec.boundary_confirmed
    measured_above = _measured(rec.micro_batch_size + 1)
    assert measured_above > cpu_plan.limit_bytes, (
        f"micro-batch {rec.micro_batch_size + 1} really used {measured_above} B, within the limit")


def test_each_option_takes_at_most_five_traces(cpu_plan):
    assert all(o.traces <= TRACES_PER_OPTION for o in (cpu_plan.recommended, *cpu_plan.alternatives))
    assert cpu_plan.recommended.traces <= 5


def test_the_recommendation_is_its_own_trace(cpu_plan):
    est = cpu_plan.estimate
    assert est.batch.batch_size == cpu_plan.recommended.micro_batch_size
    assert est.total_bytes == cpu_plan.recommended.predicted_device_total_bytes


def test_length_profile_matches_real_runs_at_each_length(cpu_plan):
    rec = cpu_plan.recommended
    # 25%, 50%, 75% and 100% of 128 tokens
    assert [p.length for p in cpu_plan.length_profile] == [32, 64, 96, 128]
    for point in cpu_plan.length_profile:
        measured = _measured(rec.micro_batch_size, point.length)
        error = (point.predicted_device_total_bytes - measured) / measured
        assert abs(error) <= TOLERANCE, f"length {point.length}: {error:+.2%}"


def test_longest_fitting_length_fits_and_the_next_multiple_of_8_does_not(cpu_plan):
    rec, longest = cpu_plan.recommended, cpu_plan.longest_fitting_length
    assert longest is not None and longest >= 128 and longest % 8 == 0
    assert _measured(rec.micro_batch_size, longest) <= cpu_plan.limit_bytes
    if longest + 8 <= POSITIONS:
        assert _measured(rec.micro_batch_size, longest + 8) > cpu_plan.limit_bytes


def test_global_batch_is_reached_exactly():
    p = plan(_meta_model(), _make, device="cpu", budget_bytes=BUDGET, global_batch=48,
             checkpointing_options=("none",), max_len=128)
    rec = p.recommended
    # micro-batches are divisors of 48: 1, 2, 3, 4, 6, 8, 12, 16, 24, 48
    assert 48 % rec.micro_batch_size == 0
    assert rec.micro_batch_size * rec.accumulation_steps == 48
    assert p.estimate.accumulate == rec.accumulation_steps
    measured = _measured_accumulating(rec.micro_batch_size, rec.accumulation_steps)
    assert measured <= p.limit_bytes


def _measured_accumulating(batch_size: int, accumulate: int) -> int:
    def build():
        return _gpt2(), _batch(batch_size)

    return measure_cpu(build, lambda p: torch.optim.AdamW(p), steps=2,
                       accumulate=min(accumulate, 2)).steady_peak_bytes


def test_global_batch_not_divisible_by_the_gpus_is_refused():
    with pytest.raises(UsageError, match="global batch 30 is not divisible by 4 GPUs.*28 or 32"):
        plan(_meta_model(), _make, gpu="H100-80GB", global_batch=30, gpus=4, strategy="ddp", max_len=128)


def test_checkpointing_lets_a_larger_micro_batch_fit():
    p = plan(_meta_model(), _make, device="cpu", budget_bytes=BUDGET, checkpointing_options=("none", "full"),
             max_len=128)
    by = {o.checkpointing: o for o in (p.recommended, *p.alternatives)}
    assert by["full"].largest_fitting_micro_batch > by["none"].largest_fitting_micro_batch


def test_flops_counted_in_the_trace_match_flop_counter_mode_on_a_real_step():
    # eager attention: FlopCounterMode has no formula for the CPU flash kernel (memcheck adds one)
    model = _gpt2("eager")
    batch = _batch(4)
    counter = FlopCounterMode(display=False)
    with counter:
        model(**batch).loss.backward()
    est = memcheck.estimate(_meta_model("eager"), _make(4), device="cpu")
    assert est.work.flops_per_micro_step == counter.get_total_flops()


def test_checkpointing_recomputation_is_counted_as_on_a_real_step():
    model = _gpt2("eager")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
    batch = _batch(4)
    counter = FlopCounterMode(display=False)
    with counter:
        model(**batch).loss.backward()
    est = memcheck.estimate(_meta_model("eager"), _make(4), device="cpu", checkpointing="full")
    assert est.work.flops_per_micro_step == counter.get_total_flops()


@pytest.mark.slow
def test_nothing_fits_says_what_would():
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())

    def make(b, n):
        ids = torch.zeros(b, n, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids}

    # GPT-2 small with AdamW: 124.4M params x (4 weights + 4 grads + 8 Adam) B = 1.99 GB of
    # state alone, so a 2 GiB GPU (limit 1.9 GiB) cannot hold micro-batch 1 however it checkpoints.
    # That floor (plus the unnamed GPU's 512 MiB context) is known before tracing: no option is traced.
    p = plan(model, make, gpu="2GiB", max_len=1024, checkpointing_options=("none", "full"))
    assert not p.fits and p.recommended is None
    assert p.alternatives == () and len(p.not_traced) == 1
    assert "weights, gradients and optimizer state alone take" in p.not_traced[0]
    assert "one T4" in str(p.suggestion)  # the smallest GPU in the table (15,102 MiB)
    assert "fsdp over" in str(p.suggestion)


def test_quadratic_root_solves_a_known_parabola():
    # y = 2x^2 + 3x + 5 through x = 1, 2, 3 (y = 10, 19, 32); y = 59 at x = 4.5: 2*20.25 + 13.5 + 5 = 59
    assert _quadratic_root({1: 10, 2: 19, 3: 32}, 59) == pytest.approx(4.5)


# ---- the default search (issue 19) -----------------------------------------------------------


def _space(gpu, device="cuda", **kwargs):
    from memcheck.engine.plan import AUTO, _validate
    from memcheck.job import Job

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64))
    job = Job(device=device, gpu=gpu, max_len=32, budget_bytes=None if gpu else 2**30)
    return _validate(model, lambda b: None, job, kwargs.get("precision", AUTO), kwargs.get("optimizer", AUTO),
                     ("none", "full"), None)


def test_the_default_search_takes_the_gpus_best_precision_and_adamw_fused_then_8bit_then_offload():
    tiers = [(t.precision.value, t.optimizer, t.offload) for t in _space("H100-80GB").tiers]
    assert tiers == [("amp-bf16", "adamw-fused", False), ("bf16", "adamw-fused", False),
                     ("amp-bf16", "adamw-8bit", False), ("bf16", "adamw-8bit", False),
                     ("amp-bf16", "adamw", True)]
    # 8-bit state only when no fused tier fits, offload only when no 8-bit one does
    assert [t.fallback for t in _space("H100-80GB").tiers] == [0, 0, 1, 1, 2]
    # before sm80 (a T4 is sm75) there is no bf16: amp-fp16
    assert {t.precision.value for t in _space("T4").tiers} == {"amp-fp16"}
    # on the CPU target, and for what the user pins, nothing is widened
    assert [(t.precision.value, t.optimizer) for t in _space(None, device="cpu").tiers] == [("fp32", "adamw")]
    pinned = _space("H100-80GB", precision=("fp32",), optimizer=None).tiers
    assert [(t.precision.value, t.optimizer, t.offload) for t in pinned] == [("fp32", "adamw", False)]


def test_the_floor_is_weights_gradients_and_state_by_hand():
    from memcheck.engine.plan import _Search, _Tier
    from memcheck.enums import Precision
    from memcheck.job import Job

    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, all trainable, fp32
    search = _Search(model, lambda b: None, 1, Job(device="cpu", budget_bytes=2**30), gpu=None, budget=2**30,
                     blocks=[], name="m", progress=None, loss_fn=None)
    n = 1_001_000
    assert search.floor(_Tier(Precision.FP32, "adamw")) == n * (4 + 4 + 8)  # weight, grad, two fp32 moments
    assert search.floor(_Tier(Precision.BF16, "adamw-fused")) == n * (2 + 2 + 4)  # all in bf16
    assert search.floor(_Tier(Precision.BF16, "adamw-8bit")) == n * (2 + 2 + 2)  # two 1-byte moments
    assert search.floor(_Tier(Precision.BF16, "adamw", offload=True)) == n * (2 + 2)  # state on the CPU


def test_the_cost_proxy_uses_the_target_gpus_rates():
    from memcheck.cuda.gpus import GPUS, rates_for
    from memcheck.engine.plan import micro_step_cost
    from memcheck.report.results import Work

    fp32 = Work(flops_per_micro_step=10**15, low_precision_flops_per_micro_step=0, kernels_per_micro_step=0,
                optimizer_kernels=0)
    bf16 = Work(flops_per_micro_step=10**15, low_precision_flops_per_micro_step=10**15, kernels_per_micro_step=0,
                optimizer_kernels=0)
    t4, a100 = rates_for(GPUS["T4"]), rates_for(GPUS["A100-80GB"])
    # T4 datasheet: 8.1 TFLOP/s fp32, 65 fp16 tensor: 1e15 FLOPs take 123.5 s and 15.4 s, 8.0x apart
    assert micro_step_cost(fp32, t4) / micro_step_cost(bf16, t4) == pytest.approx(65 / 8.1)
    # A100: 19.5 and 312: 16x apart (the old proxy used these for every GPU, 17x on a T4's fp32)
    assert micro_step_cost(fp32, a100) / micro_step_cost(bf16, a100) == pytest.approx(312 / 19.5)


def test_a_simpler_option_within_ten_percent_is_recommended():
    from memcheck.engine.plan import _simplest_close
    from memcheck.report.results import PlanOption

    def option(ck, micro, cost):
        return PlanOption(micro_batch_size=micro, accumulation_steps=1, checkpointing=ck, precision="amp-bf16",
                          predicted_device_total_bytes=1, fits=True, relative_cost=cost, traces=1,
                          largest_fitting_micro_batch=micro, boundary_confirmed=True)

    none8, half16 = option("none", 8, 1.07), option("half", 16, 1.00)
    assert _simplest_close([none8, half16], (1.00, half16)) is none8  # 7% dearer, no recomputation
    none4 = option("none", 4, 1.20)
    assert _simplest_close([none4, half16], (1.00, half16)) is half16  # 20% dearer: the cheapest wins
