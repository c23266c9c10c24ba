"""MemcheckCallback in a real Lightning Trainer on the CPU: jobs that fit train, jobs that do
not are stopped before step 1 with the fix in Trainer and DataLoader terms.

Budgets come from real runs (the profiler's steady-state peak of the same step, as
tests/test_plan.py measures) or from hand arithmetic, never from memcheck's output.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from types import SimpleNamespace

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch
from torch.utils.data import DataLoader, TensorDataset

import memcheck
from memcheck.enums import StepOrder
from memcheck.errors import UsageError
from memcheck.engine.setup import meta_twin
from memcheck.integrations.lightning import LIGHTNING_PRECISION, MemcheckCallback, _precision
from memcheck.measure.local import measure_cpu

TOLERANCE = 0.02  # the CPU target's accuracy tests use the same bound (tests/test_accuracy_cpu.py)
IN = 64
# Linear(64, 256): 64*256 + 256 = 16,640; Linear(256, 256): 256*256 + 256 = 65,792;
# Linear(256, 1): 256 + 1 = 257; 16,640 + 65,792 + 257 = 82,689 parameters
PARAMS = 82_689


class _MLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                       torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


LOGGER = "lightning.pytorch.callbacks.memcheck"  # memcheck.integrations.lightning.logger

def _rows(n: int, device=None):
    generator = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, IN, generator=generator), torch.randn(n, 1, generator=generator)
    return (x.to(device), y.to(device)) if device is not None else (x, y)


def _make_batch(n: int):
    """The worst-case batch as meta tensors: nothing is allocated to describe it."""
    return _rows(n, "meta")


def _loader(batch_size: int, rows: int = 64) -> DataLoader:
    return DataLoader(TensorDataset(*_rows(rows)), batch_size=batch_size)


def _trainer(callback, max_steps: int = 2) -> "pl.Trainer":
    return pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])


def _measured(batch_size: int, accumulate: int = 1) -> int:
    """The real steady-state peak of 2 AdamW steps of the same module on the CPU (weights and batch included),
    in Lightning's order (zero_grad between the forward and the backward; tests/test_step_order.py runs the
    Trainer itself)."""
    return measure_cpu(lambda: (_MLP(), _rows(batch_size)), lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2,
                       loss_fn=lambda module, batch: module.loss(batch), accumulate=accumulate,
                       order=StepOrder.LIGHTNING).steady_peak_bytes


def _weights(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_the_parameter_count_is_the_hand_count():
    assert sum(p.numel() for p in _MLP().parameters()) == PARAMS


def test_a_job_that_fits_trains_and_its_logging_is_left_alone(caplog):
    measured = _measured(32)
    callback = MemcheckCallback(_make_batch, batch_size=32, budget_bytes=2 * measured)
    trainer = _trainer(callback)
    # memcheck logs through a child of Lightning's own logger, which shows INFO by default and
    # does not propagate to the root logger (lightning/pytorch/__init__.py): listen on it directly
    ours = logging.getLogger(LOGGER)
    direct = not logging.getLogger("lightning.pytorch").propagate  # else the record reaches caplog at the root
    if direct:
        ours.addHandler(caplog.handler)
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger=LOGGER):
            warnings.simplefilter("always")
            trainer.fit(_MLP(), _loader(32), _loader(32))
    finally:
        ours.removeHandler(caplog.handler)
    assert ours.getEffectiveLevel() <= logging.INFO  # shown at Lightning's default level
    assert trainer.global_step == 2
    verdict = callback.verdict
    assert verdict.fits and verdict.estimate.batch.batch_size == 32 and verdict.estimate.optimizer == "AdamW (for-loop)"  # the CPU target: torch picks foreach on CUDA only
    error = (verdict.estimate.total_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, f"predicted {verdict.estimate.total_bytes} B, measured {measured} B"
    # training_step's self.log ran on the traced twin without a warning, and what the real
    # Trainer logged is a real number, untouched by the trace's meta tensors
    assert not [w for w in caught if "self.log" in str(w.message)]
    assert trainer.callback_metrics["train_loss"].device.type == "cpu"
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].startswith("memcheck: fits: _MLP needs")


class _MLPWithDeviceTensors(_MLP):
    """A training_step that makes tensors on self.device (the real device, not the trace's meta)."""

    def loss(self, batch):
        x, y = batch
        noise = torch.zeros(x.shape, device=self.device)
        return torch.nn.functional.mse_loss(self.net(x + noise), y)


def test_a_training_step_that_makes_tensors_on_self_device_is_traced():
    # Such tensors used to be real CPU tensors mixed with the trace's meta ones (a failed
    # trace); the trace now moves them to meta, as the target device would hold them.
    measured = measure_cpu(lambda: (_MLPWithDeviceTensors(), _rows(32)), lambda p: torch.optim.AdamW(p, lr=1e-3),
                           steps=2, loss_fn=lambda module, batch: module.loss(batch),
                           order=StepOrder.LIGHTNING).steady_peak_bytes
    callback = MemcheckCallback(_make_batch, batch_size=32, budget_bytes=2 * measured)
    trainer = _trainer(callback)
    trainer.fit(_MLPWithDeviceTensors(), _loader(32))
    assert trainer.global_step == 2
    error = (callback.verdict.estimate.total_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, f"predicted {callback.verdict.estimate.total_bytes} B, measured {measured} B"


def test_a_job_below_its_own_training_state_is_stopped_before_step_1():
    # parameters + gradients + AdamW's two states: 82,689 params * 4 B * 4 = 1,323,024 B,
    # live together at the optimizer step; the limit is 95% of that.
    budget = PARAMS * 4 * 4
    module = _MLP()
    before = _weights(module)
    trainer = _trainer(MemcheckCallback(_make_batch, batch_size=32, budget_bytes=budget, fix=False))
    with pytest.raises(memcheck.WillNotFit) as info:
        trainer.fit(module, _loader(32))
    assert trainer.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert str(info.value).startswith("will not fit: _MLP needs")


def test_a_refused_job_gets_its_fix_in_trainer_and_dataloader_terms_and_the_fix_really_fits():
    # micro-batch 256 measured for real; its own figure as the budget leaves it over the 95% limit
    measured = _measured(256)
    trainer = _trainer(MemcheckCallback(_make_batch, batch_size=256, budget_bytes=measured))
    with pytest.raises(memcheck.WillNotFit) as info:
        trainer.fit(_MLP(), _loader(256, rows=512))
    assert trainer.global_step == 0
    r = info.value.verdict.fix.recommended
    assert r.micro_batch_size * r.accumulation_steps == 256
    fix_line = str(info.value).splitlines()[1]
    assert fix_line.startswith(f"fix: batch_size={r.micro_batch_size} in the DataLoader, "
                               f"Trainer(accumulate_grad_batches={r.accumulation_steps})")
    assert "global batch 256 kept" in fix_line
    real = _measured(r.micro_batch_size, accumulate=r.accumulation_steps)  # the fix, run for real
    assert real <= info.value.verdict.limit_bytes, f"the fix really used {real} B"


def test_without_a_batch_the_first_training_batch_is_checked_with_a_warning(caplog):
    callback = MemcheckCallback(budget_bytes=2**30)
    direct = not logging.getLogger("lightning.pytorch").propagate
    if direct:
        logging.getLogger(LOGGER).addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            _trainer(callback, max_steps=1).fit(_MLP(), _loader(16))
    finally:
        logging.getLogger(LOGGER).removeHandler(caplog.handler)
    assert callback.verdict.estimate.batch.batch_size == 16
    assert any("not necessarily the worst case" in r.getMessage() for r in caplog.records)


def _eval_peak(val_batch_size: int, **kwargs) -> int:
    callback = MemcheckCallback(_make_batch, batch_size=8, budget_bytes=2**30, **kwargs)
    _trainer(callback, max_steps=1).fit(_MLP(), _loader(8), _loader(val_batch_size))
    return callback.verdict.estimate.eval_peak_bytes


def test_the_validation_pass_is_checked_at_the_validation_loaders_batch_size():
    # the validation DataLoader's batch size is read (64 rows hold more than 8), and
    # eval_batch_size= overrides it
    assert _eval_peak(64) > _eval_peak(8) == _eval_peak(64, eval_batch_size=8)


def test_the_meta_twin_leaves_the_trainer_behind():
    module = _MLP()
    _trainer(MemcheckCallback(_make_batch, batch_size=8, budget_bytes=2**30), max_steps=1).fit(module, _loader(8))
    assert module._trainer is not None
    twin = meta_twin(module)  # LightningModule.__getstate__ drops _trainer, so deepcopy does not copy it
    assert twin._trainer is None and all(p.device.type == "meta" for p in twin.parameters())


class _Manual(_MLP):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_refused():
    with pytest.raises(UsageError, match="manual optimization"):
        _trainer(MemcheckCallback(_make_batch, batch_size=8, budget_bytes=2**30)).fit(_Manual(), _loader(8))


@pytest.mark.parametrize("precision, ours", [("32-true", "fp32"), ("bf16-mixed", "amp-bf16"), ("bf16-true", "bf16")])
def test_lightning_precision_maps_to_memchecks(precision, ours):
    trainer = pl.Trainer(accelerator="cpu", precision=precision, logger=False, enable_checkpointing=False)
    assert _precision(trainer) == LIGHTNING_PRECISION[precision] == ours


def test_a_precision_memcheck_does_not_trace_is_named():
    trainer = pl.Trainer(accelerator="cpu", precision="64-true", logger=False, enable_checkpointing=False)
    with pytest.raises(UsageError, match="precision '64-true' is not one memcheck traces"):
        _precision(trainer)


@pytest.mark.parametrize("kwargs, message", [
    ({"make_batch": _make_batch, "batch": _rows(2)}, "not both"),
    ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
    ({"gpu": "A100-80GBX"}, "A100-80GBX"),
])
def test_bad_settings_fail_when_the_callback_is_built(kwargs, message):
    with pytest.raises(UsageError, match=message):
        MemcheckCallback(**kwargs)


def test_without_lightning_the_import_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "memcheck.integrations.lightning")
    with pytest.raises(ImportError) as info:
        importlib.import_module("memcheck.integrations.lightning")
    assert str(info.value) == ("memcheck.integrations.lightning needs Lightning: "
                               "pip install 'memcheck[lightning]'")


def _strategy_named(name: str, world_size: int, **attrs):
    """A Trainer with a strategy of that class name (a real multi-process launch needs GPUs)."""
    from types import SimpleNamespace

    return SimpleNamespace(world_size=world_size, strategy=type(name, (), attrs)())


@pytest.mark.parametrize("trainer, expected", [
    (_strategy_named("SingleDeviceStrategy", 1), ("single", None, {})),
    (_strategy_named("DDPStrategy", 4), ("ddp", 4, {})),
    # Lightning's FSDPStrategy runs FSDP1's FullyShardedDataParallel (FULL_SHARD by default)
    (_strategy_named("FSDPStrategy", 8), ("fsdp1", 8, {"fsdp_sharding": "full_shard"})),
    (_strategy_named("FSDPStrategy", 8, sharding_strategy="SHARD_GRAD_OP"), ("fsdp1", 8,
                                                                              {"fsdp_sharding": "shard_grad_op"})),
    # precision="bf16-mixed": FSDPPrecision's MixedPrecision(bf16, bf16, bf16), read from the strategy
    (_strategy_named("FSDPStrategy", 8, mixed_precision_config=SimpleNamespace(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)),
     ("fsdp1", 8, {"fsdp_sharding": "full_shard", "param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16})),
    (_strategy_named("DeepSpeedStrategy", 4, config={"zero_optimization": {"stage": 3}}), ("zero3", 4, {})),
    # FSDP2: ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1), what memcheck plan suggests
    (_strategy_named("ModelParallelStrategy", 8, _data_parallel_size=8, _tensor_parallel_size=1), ("fsdp", 8, {})),
])
def test_the_strategy_maps_to_memchecks(trainer, expected):
    from memcheck.integrations.lightning import _strategy

    assert _strategy(trainer) == expected


@pytest.mark.parametrize("name, order", [("SingleDeviceStrategy", "lightning"), ("DDPStrategy", "lightning"),
                                         ("FSDPStrategy", "lightning"), ("DeepSpeedStrategy", "hf")])
def test_the_step_order_is_lightnings_outside_deepspeed(name, order):
    from memcheck.integrations.lightning import _step_order

    assert _step_order(_strategy_named(name, 2)) == order


def test_a_strategy_memcheck_does_not_emulate_is_named():
    from memcheck.integrations.lightning import _strategy

    with pytest.raises(UsageError, match="strategy XLAStrategy is not one memcheck emulates"):
        _strategy(_strategy_named("XLAStrategy", 4))


def test_model_parallel_with_tensor_parallelism_points_to_a_layout():
    from memcheck.integrations.lightning import _strategy

    # "auto" tensor parallelism is the GPUs of one node (Lightning's setup_environment): 4 of 8 here
    trainer = _strategy_named("ModelParallelStrategy", 8, _tensor_parallel_size="auto")
    trainer.num_devices = 4
    with pytest.raises(UsageError, match="--layout dp=2,tp=4"):
        _strategy(trainer)


def test_the_trainers_cudnn_benchmark_is_the_jobs():
    """Trainer(benchmark=True) sets torch.backends.cudnn.benchmark for the process (Lightning's
    _set_torch_flags); the callback's job takes it (the cuDNN search workspaces on the cuda target)."""
    was = torch.backends.cudnn.benchmark
    try:
        callback = MemcheckCallback(_make_batch, batch_size=4, budget_bytes=2**30)
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], benchmark=True)
        trainer.fit(_MLP(), _loader(4))
        assert callback.verdict.estimate.job.cudnn_benchmark is True
    finally:
        torch.backends.cudnn.benchmark = was
