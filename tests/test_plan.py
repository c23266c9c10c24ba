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
    p = plan(model, make, gpu="2GiB", max_len=1024, checkpointing_options=("none", "full"))
    assert not p.fits and p.recommended is None
    assert [o.fits for o in p.alternatives] == [False, False]
    assert "one T4" in str(p.suggestion)  # the smallest GPU in the table (15,102 MiB)
    assert "fsdp over" in str(p.suggestion)


def test_quadratic_root_solves_a_known_parabola():
    # y = 2x^2 + 3x + 5 through x = 1, 2, 3 (y = 10, 19, 32); y = 59 at x = 4.5: 2*20.25 + 13.5 + 5 = 59
    assert _quadratic_root({1: 10, 2: 19, 3: 32}, 59) == pytest.approx(4.5)
