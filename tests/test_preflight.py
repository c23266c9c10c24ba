"""memcheck.check / memcheck.engine.preflight, checked against real CPU runs measured by the profiler.

A job is refused when it would not fit, and the fix it names is then run for
real at exactly its settings: its measured peak must stay within the budget. The
meta twin is checked by measuring host memory while a model with large weights
is checked: neither the allocator nor the process's resident memory may grow by
anything near the weights' size.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

import memcheck
from memcheck.errors import UsageError
from memcheck.measure.local import measure_cpu
from memcheck.rules.probe import cpu_memory_events
from memcheck.engine.preflight import resizer
from memcheck.report.text import fix_line
from memcheck.units import MiB

logging.set_verbosity_error()
TOLERANCE = 0.02  # the CPU target's accuracy bound (tests/test_accuracy_cpu.py)
VOCAB, POSITIONS, LENGTH = 1000, 256, 128


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def _batch(batch_size: int, length: int = LENGTH) -> dict:
    ids = torch.randint(0, VOCAB, (batch_size, length))
    return {"input_ids": ids, "labels": ids}


# Parameters of _gpt2(), by hand: wte 1000*64 = 64,000; wpe 256*64 = 16,384; per block
# ln_1 128 + c_attn 64*192+192 = 12,480 + attn c_proj 64*64+64 = 4,160 + ln_2 128
# + c_fc 64*256+256 = 16,640 + mlp c_proj 256*64+64 = 16,448 -> 49,984, two blocks 99,968;
# ln_f 128; lm_head is tied to wte. Total 64,000 + 16,384 + 99,968 + 128 = 180,480.
PARAMS = 180_480
# fp32 weights + gradients + AdamW's exp_avg and exp_avg_sq: 180,480 * 4 B * 4 = 2,887,680 B.
STATE_BYTES = PARAMS * 4 * 4


def test_parameter_count_matches_the_hand_arithmetic():
    assert sum(p.numel() for p in _gpt2().parameters()) == PARAMS


@pytest.fixture(scope="module")
def measured_16x2() -> int:
    """The real steady-state peak of micro-batch 16 x 2 accumulation steps, AdamW, on CPU."""
    return measure_cpu(lambda: (_gpt2(), _batch(16)), lambda p: torch.optim.AdamW(p), steps=2,
                       accumulate=2).steady_peak_bytes


def test_a_job_under_the_limit_passes_and_returns_the_estimate(measured_16x2):
    budget = 2 * measured_16x2  # twice the measured peak: within any margin
    est = memcheck.preflight(_gpt2(), _batch(16), device="cpu", budget_bytes=budget, accumulate=2)
    assert isinstance(est, memcheck.Estimate)
    assert abs(est.peak_bytes - measured_16x2) <= TOLERANCE * measured_16x2


@pytest.mark.slow
def test_a_job_over_the_limit_is_refused_and_its_fix_fits_for_real(measured_16x2):
    budget = int(0.6 * measured_16x2)  # the real run needs 1/0.6 = 1.67x this budget
    with pytest.raises(memcheck.WillNotFit) as caught:
        memcheck.preflight(_gpt2(), _batch(16), device="cpu", budget_bytes=budget, accumulate=2)
    err = caught.value
    assert err.exit_code == 1
    verdict_text, fix_text = str(err).split("\n")
    assert verdict_text.startswith("will not fit: GPT2LMHeadModel")
    assert fix_text.startswith("fix: ") and "global batch 32 kept" in fix_text
    v = err.verdict
    assert isinstance(err, memcheck.MemcheckError) and not v.fits
    assert v.limit_bytes == int(budget * (1 - 0.05))
    r = v.fix.recommended
    assert r is not None and r.micro_batch_size * r.accumulation_steps == 32  # the job's global batch, kept
    assert r.precision == "fp32"  # the fix never changes the job's numerics

    # Run the fix for real, set up with transformers' own switch rather than memcheck's.
    def build():
        model = _gpt2()
        if r.checkpointing == "full":
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif r.checkpointing != "none":
            pytest.skip(f"the fix checkpoints {r.checkpointing}; this test sets up none or full only")
        return model, _batch(r.micro_batch_size)

    real = measure_cpu(build, lambda p: torch.optim.AdamW(p), steps=2,
                       accumulate=r.accumulation_steps).steady_peak_bytes
    assert real <= budget
    assert abs(r.predicted_device_total_bytes - real) <= TOLERANCE * real


def test_nothing_fits_below_the_training_state():
    budget = 2 * MiB  # less than the 2,887,680 B of weights, gradients and AdamW state alone
    assert budget < STATE_BYTES
    v = memcheck.check(_gpt2(), _batch(4), device="cpu", budget_bytes=budget)
    assert not v.fits and v.fix is not None and v.fix.recommended is None
    assert "no micro-batch" in fix_line(v)


def test_fix_false_traces_once_and_names_no_fix():
    v = memcheck.check(_gpt2(), _batch(4), device="cpu", budget_bytes=2 * MiB, fix=False)
    assert not v.fits and v.fix is None and v.eval_fix is None


def test_training_fits_and_evaluation_does_not_gives_an_evaluation_fix():
    train, evaluation = _batch(2), _batch(16)
    # Evaluation keeping 8 batches of 16 x 128 x 1000 fp32 logits holds 8 * 16 * 128 * 1000 * 4 B
    # = 65,536,000 B = 62.5 MiB of predictions; the budget is under half of that.
    budget = 30 * MiB
    v = memcheck.check(_gpt2(), train, device="cpu", budget_bytes=budget, eval_batch=evaluation,
                       eval_accumulate_predictions=8)
    assert not v.fits and v.estimate.peak_in == "eval"
    assert v.fix is None and v.eval_fix is not None
    assert v.eval_fix.eval_accumulate_predictions == 1
    assert v.eval_fix.predicted_device_total_bytes <= v.limit_bytes
    assert "per_device_eval_batch_size=" in fix_line(v, "trainer")
    assert "eval_accumulation_steps=1" in fix_line(v, "trainer")


def test_a_batch_factory_with_a_length():
    seen = []

    def make(batch_size, max_len):
        seen.append((batch_size, max_len))
        with torch.device("meta"):
            return _batch(batch_size, max_len)

    v = memcheck.check(_gpt2(), make, batch_size=4, max_len=64, device="cpu", budget_bytes=1 << 30)
    assert v.fits and seen[0] == (4, 64)
    assert v.estimate.batch.batch_size == 4 and v.estimate.batch.max_len == 64


def test_resizer_changes_only_the_batch_dimension():
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "table": torch.zeros(7, 3)}
    bigger = resizer(batch)(9)
    assert bigger["input_ids"].shape == (9, 16) and bigger["input_ids"].dtype == torch.long
    assert bigger["table"].shape == (7, 3)  # its first dimension is not the batch's
    assert bigger["input_ids"].device.type == "meta"


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="cpu"), "needs a capacity"),
    (dict(device="cpu", budget_bytes=1 << 30, margin=1.5), "margin must be a fraction"),
    (dict(device="cpu", budget_bytes=1 << 30, colour="red"), "unknown argument(s) colour"),
    (dict(device="cpu", budget_bytes=-5), "budget_bytes must be a positive integer"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        memcheck.check(_gpt2(), _batch(2), **kwargs)


def test_a_factory_needs_a_batch_size():
    with pytest.raises(UsageError, match="batch factory needs batch_size"):
        memcheck.check(_gpt2(), lambda n: _batch(n), device="cpu", budget_bytes=1 << 30)


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_the_check_copies_no_weights_on_the_host():
    # 8 layers of 2048 x 2048 fp32 weights: 8 * 2048 * 2048 * 4 B = 128 MiB (plus 64 KiB of biases).
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights == 8 * (2048 * 2048 + 2048) * 4
    batch = torch.randn(4, 2048)
    memcheck.check(model, batch, device="cpu", budget_bytes=1 << 40)  # warm up imports and caches
    gc.collect()

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one
    before = _vm_kib("VmRSS") * 1024
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v = memcheck.check(model, batch, device="cpu", budget_bytes=1 << 40)
    rss_growth = _vm_kib("VmHWM") * 1024 - before

    live = peak = 0
    for _, n in cpu_memory_events(prof.profiler.kineto_results.events()):
        live += n
        peak = max(peak, live)
    # The estimate counts the weights (plus gradients and AdamW state: 4x), yet neither torch's
    # CPU allocator nor the process grew by a tenth of one copy of them.
    assert v.estimate.breakdown_at_peak.params == weights
    assert peak < weights / 10, f"the CPU allocator peaked {peak} B above the start"
    assert rss_growth < weights / 10, f"resident memory grew {rss_growth} B"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_check_takes_no_gpu_memory():  # pragma: no cover - no GPU in CI
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    batch = torch.randn(4, 2048, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    memcheck.check(model, batch, device="cuda", gpu="H100-80GB")
    assert torch.cuda.max_memory_allocated() == before
    assert torch.cuda.memory_allocated() == before
