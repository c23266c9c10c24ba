"""The trainer's step order (``--step-order``, ``memcheck.enums.StepOrder``) against REAL CPU runs
of each trainer's own loop: the HF Trainer, Lightning's automatic optimization (with and without
gradient accumulation), Accelerate's ``accumulate`` loop and a plain PyTorch loop. Each run is
measured with the profiler's allocator events (``profile_memory=True``) from the start of the
second optimizer step, as ``memcheck.measure.local`` measures, and compared with memcheck's
estimate in the matching order; the Lightning and HF estimates are the callbacks' own, which pick
the order themselves.

The model makes the order visible: a frozen featurizer whose large output is reduced at once
under ``no_grad`` (a transient, not saved for backward) feeds a trainable head, so every order's
peak is in the forward, and the only difference between orders is whether the head's gradients
are still alive there.

    backbone Linear(64, 8192), frozen: 64*8192 + 8192          =   532,480 params = 2,129,920 B
    head Linear(64, 512): 64*512 + 512 = 33,280; Linear(512, 512): 512*512 + 512 = 262,656;
         Linear(512, 8): 512*8 + 8 = 4,104                      =   300,040 params = 1,200,160 B
    AdamW state: exp_avg + exp_avg_sq of the head             = 2 * 1,200,160   = 2,400,320 B
    the forward's transient: the backbone's output 128 x 8192 x 4 B               = 4,194,304 B
    the head's gradients G                                                         = 1,200,160 B
"""

from __future__ import annotations

import functools
import gc
import logging
import warnings

import pytest
import torch
from torch.autograd.profiler import profile, record_function
from torch.utils.data import DataLoader, Dataset

import memcheck
from memcheck.measure.local import STEP_MARK, _peaks

TOLERANCE = 0.02  # the CPU target's accuracy bound (tests/test_accuracy_cpu.py); never loosened
BATCH, IN, FEAT, HID, OUT = 128, 64, 8192, 512, 8
HEAD_PARAMS = (IN * HID + HID) + (HID * HID + HID) + (HID * OUT + OUT)  # 33,280 + 262,656 + 4,104
GRADS = HEAD_PARAMS * 4  # fp32: 1,200,160 B
assert (HEAD_PARAMS, GRADS) == (300_040, 1_200_160)
BUDGET = 2**30  # the callbacks' CPU budget: far above the job (about 12 MB)


class Probe(torch.nn.Module):
    """A frozen featurizer, its ``BATCH x FEAT`` output reduced to ``BATCH x IN`` at once under
    ``no_grad``, under a trainable MLP head; ``forward(x, labels)`` returns ``{"loss": mse}``, as
    the HF Trainer wants it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Linear(IN, FEAT).requires_grad_(False)
        self.head = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, HID),
                                        torch.nn.ReLU(), torch.nn.Linear(HID, OUT))

    def forward(self, x, labels):
        with torch.no_grad():
            features = self.backbone(x).view(x.shape[0], FEAT // IN, IN).amax(1)
        return {"loss": torch.nn.functional.mse_loss(self.head(features), labels)}


class Rows(Dataset):
    """``4 * BATCH`` rows of ``{"x": IN floats, "labels": OUT floats}``, made once at import, outside
    every profiled region (the loaders' collated batches are what the runs allocate)."""

    generator = torch.Generator().manual_seed(0)
    x, labels = torch.randn(4 * BATCH, IN, generator=generator), torch.randn(4 * BATCH, OUT, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


def _batch() -> dict:
    return next(iter(DataLoader(Rows(), batch_size=BATCH)))


def _loss(model, batch):
    return model(**batch)["loss"]


def _adamw(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3)


def _mark(step: int) -> None:
    """The profiler event that starts optimizer step ``step`` (memcheck.measure.local's STEP_MARK)."""
    with record_function(f"{STEP_MARK}.{step}"):
        pass


def _measured(run) -> int:
    """The steady-state peak (from optimizer step 2 on) of ``run()``, which builds the model, the
    optimizer and the trainer itself, inside the profiled region, and calls ``_mark`` as each
    optimizer step begins. Every object older than the run is frozen out of the garbage collector
    meanwhile: earlier runs leave reference cycles (a trainer and its callbacks) whose tensors, freed
    by a collection inside the region (the HF Trainer's ``accelerator.free_memory`` calls
    ``gc.collect()``), would count against this run's live bytes; and a collection over the whole
    test process takes seconds."""
    gc.freeze()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with profile(use_cpu=True, profile_memory=True) as prof:
                run()
    finally:
        gc.unfreeze()
    return _peaks(prof.kineto_results.events()).steady_peak_bytes


@functools.lru_cache(maxsize=None)
def _estimate(order: str, accumulate: int = 1, max_grad_norm: float | None = None) -> int:
    job = memcheck.Job(device="cpu", optimizer=_adamw, step_order=order, accumulate=accumulate,
                       max_grad_norm=max_grad_norm)
    return memcheck.estimate(Probe(), _batch(), job, loss_fn=_loss).total_bytes


def _close(predicted: int, measured: int, what: str) -> None:
    error = (predicted - measured) / measured
    assert abs(error) <= TOLERANCE, f"{what}: predicted {predicted:,} B, measured {measured:,} B ({error:+.2%})"


# --- a plain loop and Accelerate ---------------------------------------------------------------

def _plain_loop(steps: int = 2) -> None:
    """The textbook loop: zero_grad, forward, backward, step."""
    model = Probe()
    optimizer = _adamw(model.parameters())
    for step, batch in zip(range(steps), DataLoader(Rows(), batch_size=BATCH)):
        _mark(step)
        optimizer.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        optimizer.step()


def _accelerate_loop(accumulate: int, steps: int = 2) -> None:
    """Accelerate's loop as its ``accumulate`` docstring writes it (accelerator.py:1256): forward,
    ``accelerator.backward``, step, zero_grad, the last two skipped until a window's last batch."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = Probe()
    optimizer = _adamw(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(Rows(), batch_size=BATCH))
    for i, batch in zip(range(steps * accumulate), loader):
        if i % accumulate == 0:
            _mark(i // accumulate)
        with accelerator.accumulate(model):
            loss = _loss(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def test_a_plain_loop_matches_the_plain_order():
    # zero_grad first frees the gradients at the same point as after the step: the peak is the
    # forward's with no gradient alive, weights + AdamW state + the 4,194,304 B transient
    real = _measured(_plain_loop)
    plain, hf = _estimate("plain"), _estimate("hf")
    _close(plain, real, "plain loop")
    assert plain == hf  # the same frees between the same allocations: 0 B apart


@pytest.mark.parametrize("accumulate", [1, 2])
def test_accelerates_accumulate_loop_matches_the_accelerate_order(accumulate):
    pytest.importorskip("accelerate")
    real = _measured(lambda: _accelerate_loop(accumulate))
    _close(_estimate("accelerate", accumulate), real, f"accelerate, accumulate={accumulate}")


# --- the HF Trainer ------------------------------------------------------------------------------

def _hf_run(accumulate: int, found: dict) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from memcheck.integrations.transformers import MemcheckCallback

    hf_logging.set_verbosity_error()

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # each window's start (trainer.py:1893)
            _mark(state.global_step)

    check = MemcheckCallback(budget_bytes=BUDGET, check_eval=False, fix=False)
    args = TrainingArguments(output_dir=found["dir"], use_cpu=True, report_to=[], max_steps=2, save_strategy="no",
                             logging_strategy="no", per_device_train_batch_size=BATCH, disable_tqdm=True,
                             gradient_accumulation_steps=accumulate, dataloader_pin_memory=False)
    model = Probe()
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), optimizers=(_adamw(model.parameters()), None),
                      callbacks=[Marks(), check])
    trainer.train()
    found["verdict"] = check.verdict


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_hf_trainer_matches_its_callbacks_estimate(tmp_path, accumulate, caplog):
    # transformers 5.23's loop: training_step (forward :2081, backward :2118), clip :1928-1931
    # (max_grad_norm 1.0 by default), optimizer.step() :1935, model.zero_grad() :1946: the gradients
    # are freed before the next forward, as in memcheck's default order
    pytest.importorskip("transformers")
    found = {"dir": str(tmp_path)}
    with caplog.at_level(logging.ERROR):
        real = _measured(lambda: _hf_run(accumulate, found))
    verdict = found["verdict"]
    assert verdict.estimate.job.step_order.value == "hf" and verdict.estimate.job.max_grad_norm == 1.0
    _close(verdict.estimate.total_bytes, real, f"HF Trainer, accumulate={accumulate}")


# --- Lightning -----------------------------------------------------------------------------------

def _lightning_run(accumulate: int, found: dict) -> None:
    import lightning.pytorch as pl

    from memcheck.integrations.lightning import MemcheckCallback

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Probe()

        def training_step(self, batch, batch_idx):
            return _loss(self.model, batch)

        def configure_optimizers(self):
            return _adamw(self.parameters())

    class Marks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % accumulate == 0:
                _mark(batch_idx // accumulate)

    check = MemcheckCallback(batch=_batch(), budget_bytes=BUDGET, check_eval=False, fix=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=accumulate, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Marks(), check])
    trainer.fit(Lit(), DataLoader(Rows(), batch_size=BATCH))
    found["verdict"] = check.verdict


def test_lightning_keeps_the_last_steps_gradients_through_the_forward(caplog):
    # lightning 2.6.6, loops/optimization/automatic.py: Closure.closure runs training_step (:131), then
    # zero_grad (:137), then backward (:140), inside optimizer.step(closure) (plugins/precision/precision.py:123).
    # So the head's gradients G = 1,200,160 B are alive at the forward's peak, where hf has none:
    #   lightning's estimate - hf's estimate = G = 1,200,160 B, exactly
    pl = pytest.importorskip("lightning.pytorch")  # noqa: F841
    found: dict = {}
    with caplog.at_level(logging.ERROR):
        real = _measured(lambda: _lightning_run(1, found))
    estimate = found["verdict"].estimate
    assert estimate.job.step_order.value == "lightning"  # the callback chose it
    _close(estimate.total_bytes, real, "Lightning")
    assert estimate.total_bytes - _estimate("hf") == GRADS
    # memcheck's own order would be G short of the real run: 1,200,160 B of about 12.3 MB, beyond 2%
    assert abs(_estimate("hf") - real) / real > TOLERANCE


def test_lightning_with_accumulation_frees_nothing_earlier_than_the_others(caplog):
    # accumulate_grad_batches=2: zero_grad runs on a window's first micro-batch only (automatic.py:220-222),
    # after its forward; the window's second forward runs beside the first's gradients in every order, so
    # both forwards peak at the same bytes: lightning's estimate - hf's = 0 B
    pytest.importorskip("lightning.pytorch")
    found: dict = {}
    with caplog.at_level(logging.ERROR):
        real = _measured(lambda: _lightning_run(2, found))
    estimate = found["verdict"].estimate
    assert estimate.job.step_order.value == "lightning" and estimate.job.accumulate == 2
    _close(estimate.total_bytes, real, "Lightning, accumulate_grad_batches=2")
    assert estimate.total_bytes == _estimate("hf", accumulate=2)


# --- the setting ---------------------------------------------------------------------------------

def test_a_bad_step_order_is_one_line_naming_it_exit_2(tmp_path):
    from click.testing import CliRunner

    from memcheck.cli import main

    model = tmp_path / "model.py"
    model.write_text("import torch\nmodel = torch.nn.Linear(4, 4)\n")
    result = CliRunner().invoke(main, ["estimate", str(model), "--device", "cpu", "--step-order", "lightnin"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "step_order" in lines[0] and "'lightnin'" in lines[0] and "lightning" in lines[0]


def test_a_bad_step_order_in_a_config_is_one_line_naming_it_exit_2(tmp_path):
    from click.testing import CliRunner

    from memcheck.cli import main

    (tmp_path / "model.py").write_text("import torch\nmodel = torch.nn.Linear(4, 4)\n")
    config = tmp_path / "job.toml"
    config.write_text('model = "model.py"\ndevice = "cpu"\ngpu_memory = "1GiB"\nstep_order = "lightnin"\n')
    result = CliRunner().invoke(main, ["check", str(config)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "step_order 'lightnin'" in lines[0] and "lightning" in lines[0]


def test_the_step_order_is_a_config_key_and_a_json_key():
    job = memcheck.Job.from_settings({"step_order": "lightning"}, vocabulary="config")
    assert job.step_order.value == "lightning" and job.to_dict()["step_order"] == "lightning"
    assert memcheck.Job().step_order.value == "hf"  # memcheck's own loop
    with pytest.raises(memcheck.errors.UsageError, match="step_order"):
        memcheck.Job.from_settings({"step_order": 3}, vocabulary="config")


def test_a_train_step_refuses_a_step_order():
    def train_step(model, batch, optimizer):
        _loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(memcheck.errors.UsageError, match="step_order lightning .* train_step"):
        memcheck.estimate(Probe(), _batch(), memcheck.Job(device="cpu", step_order="lightning"),
                          train_step=train_step)
