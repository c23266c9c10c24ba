"""``MemcheckCallback`` for the Lightning ``Trainer``: the job checked before step 1.

Example:
    >>> from memcheck.integrations.lightning import MemcheckCallback
    >>> check = MemcheckCallback(make_batch=lambda n: (torch.zeros(n, 3, 224, 224), torch.zeros(n, dtype=torch.long)),
    ...                          batch_size=64, gpu="A100-80GB")
    >>> trainer = L.Trainer(accelerator="gpu", precision="bf16-mixed", callbacks=[check])
    >>> trainer.fit(model, datamodule)   # raises memcheck.WillNotFit before step 1 if the job will not fit

At ``on_fit_start`` (before the sanity check and step 1) the callback reads the job from
the Trainer and the LightningModule and runs ``memcheck.check`` on a meta twin of the
module (no weights are copied; the copy leaves the Trainer behind, as
``LightningModule.__getstate__`` does). The loss is the module's own
``training_step(batch, 0)``; its ``self.log`` calls are ignored while tracing.

Lightning cannot know the worst-case batch: a DataLoader yields whatever its collate
function builds, and padding to the longest sequence in each batch makes the first
batch say nothing about the largest. Give it: ``make_batch(batch_size)`` (a factory of
the worst-case batch, every sequence padded to the longest length) or ``batch=``.
Without either, the first batch of the training DataLoader is checked, with a logged
warning that it is not necessarily the worst case.

The ``Verdict`` is kept as ``callback.verdict``. A job that fits is logged in one line
(logger ``memcheck.integrations.lightning``, level INFO); one that does not raises
``memcheck.WillNotFit``, its fix worded as Trainer and DataLoader arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable

try:
    import lightning.pytorch as pl
except ImportError:
    raise ImportError("memcheck.integrations.lightning needs Lightning: pip install 'memcheck[lightning]'") from None

import torch

from memcheck.engine.setup import meta_twin
from memcheck.engine.preflight import check, leading_size, resizer
from memcheck.errors import TraceError, UsageError, require_int
from memcheck.integrations._common import (
    CallbackSettings,
    act_on,
    first_batch,
    target,
)
from memcheck.job import Job
from memcheck.workloads.trainer_files import deepspeed_mode, fsdp1_sharding, zero_strategy
from memcheck.report.results import Verdict

# A child of Lightning's own logger, which shows INFO by default (lightning/pytorch/__init__.py)
logger = logging.getLogger("lightning.pytorch.callbacks.memcheck")

# Trainer(precision=...) as ``trainer.precision`` reports it -> memcheck's precision.
LIGHTNING_PRECISION = {
    "32-true": "fp32",
    "32": "fp32",
    "16-mixed": "amp-fp16",
    "bf16-mixed": "amp-bf16",
    "16-true": "fp16",
    "bf16-true": "bf16",
}


class MemcheckCallback(pl.Callback):
    """Checks the job's peak memory at ``on_fit_start`` and stops it before step 1 if it will not fit.

    Args:
        make_batch: ``make_batch(n)``, the worst-case batch of ``n`` samples as the
            training DataLoader would yield it (tensors on any device, or meta).
        batch: the worst-case batch itself (instead of ``make_batch``).
        batch_size: the DataLoader's batch size; by default the training DataLoader's
            ``batch_size`` (with ``make_batch``) or the batch's first dimension.
        eval_batch_size: the validation DataLoader's batch size, for the validation pass
            (by default the validation DataLoader's, else ``batch_size``).
        gpu: the GPU the job runs on, a name (``"A100-80GB"``) or a size (``"24GiB"``); by
            default the local GPU. Only for a job on CUDA.
        budget_bytes: the capacity in bytes: required on the CPU; on CUDA it overrides the GPU's.
        margin: the fraction of the capacity held back (default memcheck's 5%).
        check_eval: also check the validation pass, when the module has a ``validation_step``.
        fix: look for a fix when the job will not fit (a few more traces).

    What it reads:
        ``trainer.precision`` (``LIGHTNING_PRECISION``), ``accumulate_grad_batches``, its step order
        (``step_order="lightning"``: ``zero_grad`` between the forward and the backward), the
        strategy (single device, DDP, FSDP, DeepSpeed with its ZeRO stage and offload)
        over ``trainer.world_size`` processes, the device, the optimizer the Trainer built
        from ``configure_optimizers`` (its class and settings; if none is built yet,
        ``configure_optimizers`` is called on the meta twin), and the loss from
        ``training_step`` (a tensor or a dict with ``"loss"``).

    Known limitations:
        Manual optimization (``automatic_optimization = False``) is refused: memcheck's
        loop steps the optimizer itself. Only the first optimizer is used. Tensors a
        ``training_step`` makes on ``self.device`` are moved to meta for the trace, but
        torchmetrics state updated in ``training_step`` is untested.
        Under FSDP or DeepSpeed ZeRO-3 the module is already sharded at ``on_fit_start``
        and cannot be twinned.
    """

    def __init__(self, make_batch: Callable[[int], Any] | None = None, *, batch: Any = None,
                 batch_size: int | None = None, eval_batch_size: int | None = None, gpu: str | None = None,
                 budget_bytes: int | None = None, margin: float | None = None, check_eval: bool = True,
                 fix: bool = True):
        self.settings = CallbackSettings(gpu=gpu, budget_bytes=budget_bytes, margin=margin, check_eval=check_eval,
                                         fix=fix)
        if make_batch is not None and batch is not None:
            raise UsageError("give make_batch= or batch=, not both")
        if make_batch is not None and not callable(make_batch):
            raise UsageError(f"make_batch must be a function n -> batch, got {type(make_batch).__name__}")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if value is not None:
                require_int(value, name)
        self.make_batch, self.batch = make_batch, batch
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.verdict: Verdict | None = None

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not pl_module.automatic_optimization:
            raise UsageError(f"{type(pl_module).__name__} uses manual optimization (automatic_optimization=False); "
                             "memcheck traces the optimizer step itself and cannot follow a manual one")
        strategy, gpus, extra = _strategy(trainer)
        batch, batch_size = self._train_batch(trainer)
        job = Job(  # the Trainer's own settings, in memcheck's words
            batch_size=batch_size, accumulate=trainer.accumulate_grad_batches,
            precision=_precision(trainer, strategy),
            strategy=strategy, gpus=gpus, optimizer=_optimizer(trainer, pl_module), margin=self.settings.margin,
            max_grad_norm=float(trainer.gradient_clip_val or 0)
            if trainer.gradient_clip_algorithm in (None, "norm") else 0.0,  # "value" clipping allocates nothing
            step_order=_step_order(trainer), **target(trainer.strategy.root_device, self.settings), **extra,
            # Trainer(benchmark=...) sets torch.backends.cudnn.benchmark for the process
            # (lightning/pytorch/trainer/connectors/accelerator_connector.py, _set_torch_flags)
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        )
        eval_batch = None
        if self.settings.check_eval and _validates(trainer, pl_module):
            rows = self.eval_batch_size or _loader_batch_size(trainer.fit_loop.epoch_loop.val_loop) or batch_size
            eval_batch = self.make_batch(rows) if self.make_batch is not None else resizer(batch)(rows)
        verdict = check(pl_module, batch, job, eval_batch=eval_batch, loss_fn=_StepLoss(trainer),
                        fix=self.settings.fix, model_name=type(pl_module).__name__)
        self.verdict = verdict  # kept for a caller that catches WillNotFit too
        act_on(verdict, "lightning", logger, announce=trainer.is_global_zero)

    def _train_batch(self, trainer) -> tuple[Any, int]:
        """The worst-case batch (or the factory) and the micro-batch size."""
        if self.make_batch is not None:
            size = self.batch_size or _loader_batch_size(trainer.fit_loop)
            if size is None:
                raise UsageError("give MemcheckCallback(batch_size=...): the training DataLoader's batch size "
                                 "cannot be read (a batch sampler sets it)")
            return self.make_batch, size
        if self.batch is not None:
            return self.batch, self.batch_size or leading_size(self.batch)
        loader = _loader(trainer.fit_loop)
        if loader is None:
            raise UsageError("MemcheckCallback needs the worst-case batch: give make_batch= or batch= "
                             "(there is no training DataLoader to take a batch from)")
        logger.warning("memcheck: no make_batch= or batch= given; checking the first training batch, which is "
                       "not necessarily the worst case (Lightning cannot know the longest batch)")
        batch = first_batch(loader)
        return batch, leading_size(batch)


class _StepLoss:
    """``loss_fn(module, batch)``: the module's ``training_step`` (``validation_step`` in the
    evaluation pass), on the traced twin. The Trainer is attached so that a step reading
    ``self.trainer`` or ``self.global_step`` behaves as at step 1; ``self.log`` and
    ``self.log_dict`` are replaced by no-ops on the twin, so nothing reaches the real
    Trainer's logged metrics."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __call__(self, module, batch):
        if isinstance(module, pl.LightningModule):
            module._trainer = self.trainer
            module.log = module.log_dict = _no_log
        if not module.training:
            step = module.validation_step if _overrides(module, "validation_step") else module.training_step
            return step(batch, 0)
        out = module.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise TraceError(f"{type(module).__name__}.training_step returned {type(out).__name__}, not a loss "
                             "tensor or a dict with 'loss'")
        return loss


def _no_log(*args, **kwargs) -> None:
    return None


def _overrides(module, name: str) -> bool:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden(name, module)


def _step_order(trainer) -> str:
    """Lightning's own order of automatic optimization (``memcheck.enums.StepOrder.LIGHTNING``):
    ``training_step``, then ``zero_grad`` on a window's first micro-batch, then backward, all in the
    closure that ``optimizer.step`` runs (lightning 2.6.6, loops/optimization/automatic.py:131, :137,
    :140, :220; plugins/precision/precision.py:123), so the last step's gradients are alive through the
    forward. Under DeepSpeed the engine's own step handles the gradients, and memcheck's ZeRO emulation
    keeps memcheck's order (not measured)."""
    if "DeepSpeedStrategy" in {c.__name__ for c in type(trainer.strategy).__mro__}:
        return "hf"
    return "lightning"


def _precision(trainer, strategy: str = "single") -> str:
    """The Trainer's precision in memcheck's words; under DeepSpeed, bf16-mixed is DeepSpeed's
    bf16 mode (the strategy's config gets ``bf16.enabled``: bf16 weights with an fp32 master,
    pure ``bf16``), as ``trainer_files.deepspeed_mode`` reads it on every path."""
    value = str(trainer.precision)
    if value not in LIGHTNING_PRECISION:
        raise UsageError(f"precision {value!r} is not one memcheck traces; it knows {', '.join(LIGHTNING_PRECISION)}")
    precision = LIGHTNING_PRECISION[value]
    if strategy != "single" and "DeepSpeedStrategy" in {c.__name__ for c in type(trainer.strategy).__mro__}:
        precision = deepspeed_mode(precision, getattr(trainer.strategy, "config", None), strategy) or "fp32"
    return precision


def _strategy(trainer) -> tuple[str, int | None, dict]:
    """memcheck's strategy, GPU count and settings for the Trainer's strategy (by class, so
    that DeepSpeed need not be importable)."""
    world = max(int(trainer.world_size), 1)
    classes = {c.__name__ for c in type(trainer.strategy).__mro__}
    if world < 2:
        return "single", None, {}
    if "DeepSpeedStrategy" in classes:
        return zero_strategy(getattr(trainer.strategy, "config", None), world)
    if "FSDPStrategy" in classes:  # FSDP1's FullyShardedDataParallel (ModelParallelStrategy is FSDP2)
        offloaded = bool(getattr(getattr(trainer.strategy, "cpu_offload", None), "offload_params", False))
        sharding = fsdp1_sharding(getattr(trainer.strategy, "sharding_strategy", None) or "full_shard",
                                  where="FSDPStrategy sharding_strategy")
        extra = {"fsdp_sharding": sharding, **({"offload": "params"} if offloaded else {})}
        # FSDPStrategy.mixed_precision_config: the user's MixedPrecision, else its precision plugin's (FSDPPrecision:
        # param, reduce and buffer dtype all bf16 under bf16-mixed, beside autocast; lightning/pytorch/plugins/
        # precision/fsdp.py, mixed_precision_config). buffer_dtype is not modelled.
        policy = getattr(trainer.strategy, "mixed_precision_config", None)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(policy, name, None) is not None:
                extra[name] = getattr(policy, name)
        per_node = getattr(trainer, "num_devices", None)  # the devices of one node
        if sharding == "hybrid_shard" and isinstance(per_node, int) and 0 < per_node < world and world % per_node == 0:
            extra["gpus_per_node"] = per_node
        return "fsdp1", world, extra
    if "ModelParallelStrategy" in classes:  # FSDP2 (fully_shard in configure_model), with DTensor TP
        tp = getattr(trainer.strategy, "_tensor_parallel_size", "auto")
        if tp == "auto":  # setup_environment's default: the GPUs of one node
            tp = getattr(trainer, "num_devices", world)
        if tp == 1:
            return "fsdp", world, {}
        raise UsageError(f"ModelParallelStrategy with tensor_parallel_size={tp} is not read from the Trainer; "
                         f"estimate it with memcheck MODEL --layout dp={max(world // tp, 1)},tp={tp}")
    if "DDPStrategy" in classes:
        return "ddp", world, {}
    raise UsageError(f"strategy {type(trainer.strategy).__name__} is not one memcheck emulates; it knows "
                     "single-device, DDP, FSDP and DeepSpeed strategies")


def _optimizer(trainer, pl_module) -> Any:
    """The optimizer the Trainer built (memcheck reuses its class and settings), else
    ``configure_optimizers`` called on a meta twin, so that the real weights are not touched."""
    for opt in trainer.optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            return opt
    twin = meta_twin(pl_module)
    twin._trainer = trainer  # a schedule may read trainer.estimated_stepping_batches
    found = _first_optimizer(twin.configure_optimizers())
    if found is None:
        raise UsageError(f"{type(pl_module).__name__}.configure_optimizers() returned no torch optimizer")
    return found


def _first_optimizer(value) -> torch.optim.Optimizer | None:
    """The first optimizer in what ``configure_optimizers`` may return: an optimizer, a
    list or tuple of them (or of dicts), a dict with ``"optimizer"``, or ``(optimizers, schedulers)``."""
    if isinstance(value, torch.optim.Optimizer):
        return value
    if isinstance(value, Mapping):
        return _first_optimizer(value.get("optimizer"))
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_optimizer(item)
            if found is not None:
                return found
    return None


def _validates(trainer, pl_module) -> bool:
    """Whether fit runs a validation pass: a validation_step, a validation DataLoader, batches to run."""
    source = getattr(trainer.fit_loop.epoch_loop.val_loop, "_data_source", None)
    has_loader = source is not None and source.instance is not None and source.is_defined()
    return has_loader and bool(trainer.limit_val_batches) and _overrides(pl_module, "validation_step")


def _loader(loop) -> Any:
    """A fit or validation loop's DataLoader (the source Lightning loads it from at the loop's start)."""
    source = getattr(loop, "_data_source", None)
    if source is None or source.instance is None or not source.is_defined():
        return None
    loader = source.dataloader()
    if isinstance(loader, (list, tuple)) and loader:
        loader = loader[0]
    return loader


def _loader_batch_size(loop) -> int | None:
    try:
        loader = _loader(loop)
    except Exception:  # a *_dataloader() hook that needs setup() the Trainer has not run yet
        return None
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None
