"""TRL's ``SFTTrainer`` under memcheck: the transformers callback and ``memcheck run``.

``SFTTrainer`` (trl 1.16) computes more per step than ``model(**batch).loss``: its
``compute_loss`` calls the model's fused LM head (trl/trainer/utils.py ``add_fused_lm_head``),
which projects the hidden states through the LM head in vocabulary tiles and returns per-token
log-probabilities, entropy and top-1 hits, the last two for the ``entropy`` and
``mean_token_accuracy`` it logs (trl/trainer/sft_trainer.py:1639-1644). On the CPU those tiles
are folded by torch ops, whose temporaries are most of the step's peak (about 94% here).

The oracle is examples/scripts/train_sft.py run for real on the CPU under the profiler
(``memcheck.measure.local.measure_script``), every sample ``max_len`` tokens long, so its
batches are the worst case memcheck builds; both front-ends are compared with that one
measurement. The tests share one file for that reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("trl")

from transformers import TrainerCallback  # noqa: E402

from memcheck import Job, run_script  # noqa: E402
from memcheck.integrations.transformers import MemcheckCallback  # noqa: E402
from memcheck.measure.local import measure_script  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "scripts"
# width 64 keeps the real run short; 4 x 128 tokens over a vocabulary of 8,000 makes each
# (4 * 127) x 8,000 fp32 tile 16.3 MB, the size of what the fused head folds at once
ARGS = ["--max-len", "128", "--min-len", "128", "--batch-size", "4", "--width", "64"]
TOLERANCE = 0.02  # as tests/test_accuracy_cpu.py


def _within(estimate: int, measured: int) -> None:
    assert abs(estimate - measured) <= TOLERANCE * measured, (estimate, measured, estimate / measured - 1)


@pytest.fixture(scope="module")
def measured() -> int:
    """The steady-state peak (from the end of step 1 on) of the real SFTTrainer run, 2 steps."""
    return measure_script([str(SCRIPTS / "train_sft.py"), *ARGS, "--max-steps", "2"]).steady_peak_bytes


class _Stopped(Exception):
    pass


class _StopBeforeStep1(TrainerCallback):
    """Ends ``train()`` right after MemcheckCallback's check (callbacks run in order): the
    check is what is tested, and the real run is the fixture's."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise _Stopped


@pytest.mark.slow
def test_the_callback_under_sft_trainer_traces_its_fused_loss_and_metrics_within_2_percent(measured):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import train_sft
    finally:
        sys.path.remove(str(SCRIPTS))
    callback = MemcheckCallback(budget_bytes=2**30)
    trainer = train_sft.trainer([*ARGS, "--max-steps", "2"], callbacks=[callback, _StopBeforeStep1()])
    tokens_before = trainer._total_train_tokens
    with pytest.raises(_Stopped):
        trainer.train()
    estimate = callback.verdict.estimate
    _within(estimate.total_bytes, measured)
    # SFTConfig's own defaults, read from the trainer: max_length 128, bf16 autocast, checkpointing
    assert estimate.batch.max_len == 128 and estimate.precision.value == "amp-bf16"
    assert estimate.checkpointing == ("(transformers' own checkpointing)",)
    # the trainer's own compute_loss ran on the twin: its metrics read .item() on meta tensors,
    # and what it counted there is put back
    assert "a data-dependent float (.item()) was taken as 1.0" in estimate.assumptions
    assert trainer._total_train_tokens == tokens_before and not trainer._metrics["train"]


@pytest.mark.slow
def test_memcheck_run_on_an_sft_trainer_script_matches_the_real_run(measured):
    est = run_script([sys.executable, str(SCRIPTS / "train_sft.py"), *ARGS, "--max-steps", "5"],
                     Job(device="cpu", max_len=128))
    _within(est.peak_bytes, measured)
    assert est.peak_step == 2
