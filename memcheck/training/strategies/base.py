"""The strategy contract: a validated ``StrategyConfig``, what ``train`` hands a family
(``Run``), and what a one-rank family's emulation gives the traced loop (``Emulation``).

``memcheck.training.strategies.train`` picks the family module for
``config.strategy`` and calls its ``train(run)``, which returns, for each real GPU, the
index of the traced GPU whose figures hold for it:

- ``data_parallel`` (``dp``, ``dp-balanced``) traces every GPU: it sets
  ``tracer.multi_gpu``, watches the model and batch itself with ``root_outputs=False``
  (the DataParallel wrapper's outputs are the model's outputs) and runs its own loop
  around the wrapper, so it needs no ``Emulation``. It returns ``[0, 1, ..., gpus - 1]``.
- ``single``, ``ddp``, ``fsdp``, ``fsdp1`` and ``zero`` (``zero1``-``zero3``) trace one rank, whose
  figures hold for every rank, and return ``[0] * gpus``. They run the loop of
  ``single.train_one_rank``: it calls ``tracer.watch(model=..., batch=...)``, then builds
  the family's ``Emulation`` (none for ``single``), so the emulation's hooks run after
  the tracer's; it watches the optimizer the emulation makes
  (``tracer.watch(optimizer=...)``), calls ``on_phase`` after ``tracer.set_phase`` at
  every phase, runs the evaluation with the bare model, and calls ``close`` last, also
  when a step fails. An emulation never calls ``tracer.watch``: it allocates what its
  rank holds itself (``tracer.register``) and stops counting what the rank does not
  hold (``tracer.ignore``). ``fsdp``, ``fsdp1`` and ``zero3`` build the model on meta: they ignore
  its parameters before the model is watched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from memcheck.enums import Dtype, FsdpSharding, Offload, Phase, Strategy
from memcheck.errors import UsageError, require_int, require_positive_number
from memcheck.training.loop import LossFn, run_steps, run_train_steps


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP's own mixed precision: FSDP2's ``MixedPrecisionPolicy`` (torch 2.13
    ``torch/distributed/fsdp/_fully_shard/_fsdp_api.py:10-54``) and FSDP1's ``MixedPrecision``
    (``torch/distributed/fsdp/api.py``). None: no cast (the wrapper's default)."""

    param_dtype: Dtype | None = None  # the unsharded parameters, so the forward and backward compute
    reduce_dtype: Dtype | None = None  # the gradient reduce-scatter (None: param_dtype's)
    output_dtype: Dtype | None = None  # FSDP2 only: each fully_shard module's floating outputs
    # each wrapped module's floating inputs to param_dtype; None: the wrapper's default, FSDP2's True, FSDP1's
    # False (FSDP1 casts the root's inputs all the same: cast_root_forward_inputs=True)
    cast_forward_inputs: bool | None = None

    @property
    def is_default(self) -> bool:
        return self == MixedPrecision()

    @property
    def label(self) -> str:
        """``param bf16, reduce fp32``: the fields that differ from the default."""
        parts = [f"{name.removesuffix('_dtype')} {value.value}"
                 for name, value in (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype),
                                     ("output_dtype", self.output_dtype)) if value is not None]
        if self.cast_forward_inputs is not None:
            parts.append("inputs cast" if self.cast_forward_inputs else "inputs not cast")
        return ", ".join(parts)


@dataclass(frozen=True)
class StrategyConfig:
    """A strategy and its settings, validated."""

    strategy: Strategy = Strategy.SINGLE
    gpus: int = 1
    bucket_view: bool = False  # ddp: gradient_as_bucket_view=True
    bucket_cap_mb: float | None = None  # ddp: None is DDP's default (25, first bucket 1 MiB)
    offload: Offload = Offload.NONE  # fsdp / fsdp1 / zero*
    # DeepSpeed's ZeRO buffers in elements (None: its defaults, memcheck.training.strategies.zero)
    reduce_bucket_size: int | None = None  # zero1-3: the IPG bucket
    prefetch_bucket_size: int | None = None  # zero3: stage3_prefetch_bucket_size
    max_live_parameters: int | None = None  # zero3: stage3_max_live_parameters
    fsdp_sharding: FsdpSharding | None = None  # fsdp1: its ShardingStrategy (None: FULL_SHARD, torch's default)
    gpus_per_node: int | None = None  # fsdp1 hybrid_shard: the shard group (None: every GPU on one node)
    mixed_precision: MixedPrecision = MixedPrecision()  # fsdp: MixedPrecisionPolicy

    @classmethod
    def parse(cls, strategy="single", gpus=None, *, bucket_view=False, bucket_cap_mb=None, offload=None,
              reduce_bucket_size=None, prefetch_bucket_size=None, max_live_parameters=None, fsdp_sharding=None,
              gpus_per_node=None, mixed_precision=None):
        strategy = Strategy.parse(strategy, what="strategy")
        offload = Offload.parse(offload or "none", what="offload")
        if fsdp_sharding is not None:
            fsdp_sharding = FsdpSharding.parse(fsdp_sharding, what="fsdp_sharding")
        if gpus is None:
            gpus = 1 if strategy is Strategy.SINGLE else 2
        require_int(gpus, "gpus")
        if strategy is Strategy.SINGLE and gpus != 1:
            raise UsageError(
                f"strategy 'single' runs on one GPU, got gpus={gpus}; choose dp, dp-balanced, ddp, fsdp, fsdp1 or zero1-3"
            )
        # One GPU is allowed for zero1-3 with an offload: DeepSpeed's ZeRO-Offload runs on one GPU
        # (deepspeed --num_gpus 1 with offload_optimizer), moving the optimizer to the CPU.
        one_gpu_offload = strategy in SHARDED and strategy not in FSDPS and offload is not Offload.NONE
        if strategy.multi_gpu and gpus < 2 and not (one_gpu_offload and gpus == 1):
            extra = "; zero1-3 run on one GPU with an offload (--offload optimizer)" if strategy in SHARDED else ""
            raise UsageError(f"strategy {strategy.value!r} needs at least 2 GPUs, got gpus={gpus}{extra}")
        if strategy in DATA_PARALLEL and gpus > MAX_DP_GPUS:
            raise UsageError(f"strategy {strategy.value!r} (DataParallel) drives the GPUs of one machine from one "
                             f"process, at most {MAX_DP_GPUS}, got gpus={gpus}; for more use ddp, fsdp or zero1-3")
        if offload is not Offload.NONE and strategy not in SHARDED:
            raise UsageError(f"offload={offload.value!r} applies to fsdp, fsdp1 and zero1-3, not {strategy.value!r}")
        if strategy is Strategy.FSDP and offload is Offload.OPTIMIZER:
            raise UsageError("fsdp has no optimizer-only offload (FSDP2's CPUOffloadPolicy moves the parameters, "
                             "gradients and optimizer state together); use offload='params', or zero1-3")
        if strategy is Strategy.FSDP1 and offload is Offload.OPTIMIZER:
            raise UsageError("fsdp1 has no optimizer-only offload (FSDP1's CPUOffload(offload_params=True) moves the "
                             "parameters, gradients and optimizer step together); use offload='params', or zero1-3")
        fsdp_sharding, gpus_per_node = _fsdp1_settings(strategy, gpus, offload, fsdp_sharding, gpus_per_node)
        if strategy in (Strategy.ZERO1, Strategy.ZERO2) and offload is Offload.PARAMS:
            raise UsageError(f"offload='params' needs zero3 (DeepSpeed offloads parameters in ZeRO-3 only), "
                             f"not {strategy.value}; use offload='optimizer'")
        if strategy is not Strategy.DDP and (bucket_view or bucket_cap_mb is not None):
            raise UsageError(f"bucket settings apply to ddp only, not {strategy.value!r}")
        if bucket_cap_mb is not None:
            require_positive_number(bucket_cap_mb, "bucket_cap_mb")
        zero = {Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3}
        for name, value, applies, minimum in (("reduce_bucket_size", reduce_bucket_size, zero, 1),
                                              ("prefetch_bucket_size", prefetch_bucket_size, {Strategy.ZERO3}, 0),
                                              ("max_live_parameters", max_live_parameters, {Strategy.ZERO3}, 0)):
            if value is None:
                continue
            if strategy not in applies:
                which = "zero1-3" if len(applies) > 1 else "zero3"
                raise UsageError(f"{name} applies to {which} only (a DeepSpeed ZeRO setting), not {strategy.value!r}")
            require_int(value, name, minimum=minimum,
                        message=f"{name} must be an integer of at least {minimum} (elements), got {value!r}")
        mixed_precision = _mixed_precision(strategy, mixed_precision, fsdp_sharding)
        return cls(strategy, gpus, bool(bucket_view), bucket_cap_mb, offload, reduce_bucket_size,
                   prefetch_bucket_size, max_live_parameters, fsdp_sharding, gpus_per_node, mixed_precision)

    @property
    def label(self) -> str:
        if self.strategy is Strategy.SINGLE:
            return "single"
        extra = ""
        if self.strategy is Strategy.DDP and self.bucket_view:
            extra = ", bucket view"
        if self.fsdp_sharding is not None:
            extra = f", {self.fsdp_sharding.value}"
            if self.gpus_per_node is not None:
                extra += f" ({self.gpus_per_node} per node)"
        if self.offload is not Offload.NONE:
            extra += f", offload {self.offload.value}"
        if not self.mixed_precision.is_default:
            extra += f", {self.mixed_precision.label}"
        return f"{self.strategy.value} x{self.gpus}{extra}"


def _mixed_precision(strategy: Strategy, policy, sharding: FsdpSharding | None) -> MixedPrecision:
    """The wrapper's mixed precision, checked against the strategy: FSDP's own casts, which no other
    wrapper has (DDP, DeepSpeed and DataParallel train in the model's dtype or under autocast)."""
    if policy is None:
        return MixedPrecision()
    if not isinstance(policy, MixedPrecision):
        raise UsageError(f"mixed_precision must be a memcheck MixedPrecision, got {type(policy).__name__}")
    if policy.is_default or strategy is Strategy.FSDP:
        return policy
    if strategy is not Strategy.FSDP1:
        raise UsageError(f"mixed precision ({policy.label}) applies to strategies fsdp and fsdp1 (FSDP's own "
                         f"policies), not {strategy.value!r}; use autocast or pure bf16/fp16 weights")
    if policy.output_dtype is not None:
        raise UsageError(f"output_dtype is FSDP2's (MixedPrecisionPolicy); FSDP1's MixedPrecision has none: use "
                         f"strategy fsdp, or drop output_dtype")
    if sharding is FsdpSharding.NO_SHARD and (policy.param_dtype or policy.reduce_dtype):
        raise UsageError("fsdp1 no_shard with a param_dtype or reduce_dtype is not modelled (FSDP1 keeps the "
                         "low-precision flat parameter from unshard to reshard there); use full_shard, "
                         "shard_grad_op or hybrid_shard")
    return policy


def _fsdp1_settings(strategy: Strategy, gpus: int, offload: Offload, sharding, per_node):
    """fsdp1's sharding strategy (FULL_SHARD by default) and shard group, checked."""
    if strategy is not Strategy.FSDP1:
        if sharding is not None:
            raise UsageError(f"fsdp_sharding={sharding.value!r} applies to strategy fsdp1, not {strategy.value!r}")
        if per_node is not None:
            raise UsageError(f"gpus_per_node={per_node!r} applies to strategy fsdp1 with fsdp_sharding hybrid_shard, "
                             f"not {strategy.value!r}")
        return None, None
    sharding = sharding or FsdpSharding.FULL_SHARD
    if per_node is not None:
        require_int(per_node, "gpus_per_node")
        if sharding is not FsdpSharding.HYBRID_SHARD:
            raise UsageError(f"gpus_per_node={per_node} applies to fsdp_sharding hybrid_shard, not {sharding.value!r} "
                             "(the other strategies shard or replicate over every GPU)")
        if per_node < 1 or per_node > gpus or gpus % per_node:
            raise UsageError(f"gpus_per_node={per_node} must divide gpus={gpus} (hybrid_shard shards within a node "
                             "and replicates across nodes of the same size)")
    if offload is Offload.PARAMS and sharding is FsdpSharding.NO_SHARD:
        raise UsageError("offload='params' with fsdp_sharding 'no_shard' is not modelled (FSDP1 moves the whole flat "
                         "parameter to the device around each unit's use); use full_shard, shard_grad_op or "
                         "hybrid_shard")
    return sharding, per_node


SHARDED = (Strategy.FSDP, Strategy.FSDP1, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)
FSDPS = (Strategy.FSDP, Strategy.FSDP1)
DATA_PARALLEL = (Strategy.DP, Strategy.DP_BALANCED)
# DataParallel is one process driving the GPUs of one machine, 16 at most in any server (DGX-2,
# HGX-2), and memcheck traces every one of them (data_parallel.py): its GPU count stops there.
MAX_DP_GPUS = 16


def applicable(gpus: int) -> list[StrategyConfig]:
    """The strategies ``--compare`` lists for ``gpus`` GPUs (DataParallel up to ``MAX_DP_GPUS``).

    ``fsdp1`` is left out: its FULL_SHARD differs from ``fsdp`` (FSDP2) by the flat parameters'
    padding and gradient copies only, and each row is one more trace of the model."""
    if gpus <= 1:
        return [StrategyConfig()]
    return [StrategyConfig()] + [StrategyConfig(s, gpus) for s in Strategy
                                 if s.multi_gpu and s is not Strategy.FSDP1
                                 and (gpus <= MAX_DP_GPUS or s not in DATA_PARALLEL)]


@dataclass(frozen=True)
class Run:
    """The arguments of ``strategies.train``: one traced training run, handed to a family's ``train``."""

    config: StrategyConfig
    tracer: Any  # memcheck.trace.tracer.MemoryTracer
    model: torch.nn.Module
    batch: Any
    loss_fn: LossFn
    make_optimizer: Callable  # params -> torch.optim.Optimizer
    steps: int
    autocast: Any = None
    scaler: Any = None
    accumulate: int = 1
    evaluate: Callable[[torch.nn.Module], None] | None = None  # after training, on the module a trainer evaluates
    train_step: Callable | None = None  # the user's own train_step(model, batch, optimizer), run instead of the loop
    # the job's settings of memcheck's loop, as training.loop.run_steps's keywords (memcheck.job.Job.loop):
    # max_grad_norm (clip_grad_norm_ before each optimizer step), order (where zero_grad goes), ...
    loop: Mapping[str, Any] = field(default_factory=dict)

    def run_steps(self, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                  on_phase: Callable[[int, Phase], None]) -> None:
        """``memcheck.training.loop.run_steps`` on the model and batch, with this run's loop settings;
        the user's ``train_step`` instead, when there is one (``run_train_steps``)."""
        if self.train_step is not None:
            run_train_steps(self.model, self.batch, self.train_step, optimizer, self.steps, on_phase)
            return
        run_steps(self.model, self.batch, loss_fn, optimizer, self.steps, on_phase,
                  autocast=self.autocast, scaler=self.scaler, accumulate=self.accumulate,
                  clip=self._clip, **self.loop)

    def _clip(self, params: list, max_norm: float):
        """``clip_grad_norm_`` through the tracer, so its op rules see the call."""
        return self.tracer.route(torch.nn.utils.clip_grad_norm_, (params, max_norm), {})


class Emulation(Protocol):
    """What one rank's wrapper (DDP, FSDP2, DeepSpeed ZeRO) adds to the plain traced loop.

    Built by the family after the model and batch are watched (see the module docstring);
    its constructor allocates the rank's own buffers and hooks the model.
    """

    def make_optimizer(self, make_optimizer: Callable) -> torch.optim.Optimizer:
        """The optimizer the loop steps, made with the user's ``make_optimizer(params)``: on the model's
        parameters, or on the rank's stand-ins (shards, fp32 master) with its ``step`` wrapped."""
        ...

    def on_phase(self, step: int, phase: Phase) -> None:
        """Called at every phase of every step, right after ``tracer.set_phase(step, phase)``."""
        ...

    def close(self) -> None:
        """Remove the emulation's hooks; called once, after training and evaluation, also on failure."""
        ...
