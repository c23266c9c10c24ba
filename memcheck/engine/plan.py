"""``plan()``: the micro-batch, accumulation, checkpointing and precision to run so a job fits.

The planner searches by tracing, never by extrapolating a figure it reports:

1. **Options.** Each (checkpointing, precision, optimizer) triple is an option:
   checkpointing ``none``, ``half`` (every second repeated block wrapped in
   ``torch.utils.checkpoint``) and ``full`` (every block, through transformers' own
   switch where the model has one). What the user does not pin is searched in tiers
   (``_Tier``): the target GPU's best precision (amp-bf16, then pure bf16, on sm80 and
   later; amp-fp16 before), AdamW's fused implementation; then, only when nothing of
   those fits, 8-bit optimizer state; then DeepSpeed's ZeRO-Offload on the one GPU. A
   tier whose weights, gradients and optimizer state alone pass the limit is not
   traced, and once one fits, later tiers of the same FLOP rate are tried only for
   lighter checkpointing, skipped when the same checkpointing traced in another tier,
   its persistent state swapped for this tier's, already passes the limit by more than
   ``SWAP_SLACK`` (``Plan.not_traced`` says so). Precisions are tried low first.
2. **The boundary, in at most 5 traces an option.** At a fixed shape, memory is
   close to affine in the micro-batch. The planner traces micro-batches 1 and 4,
   predicts from the line through them the largest micro-batch whose device total
   stays under the limit, traces it, and then traces one more on the other side;
   each further guess is the secant through the two traced points nearest the
   boundary (regula falsi), kept strictly between the largest size known to fit and
   the smallest known not to. The largest traced size that fits is the option's
   maximum; every figure reported for it comes from its own trace.
3. **The choice.** With ``global_batch`` G over N GPUs, the micro-batches tried are
   the divisors m of G / N, each with ``G / (m * N)`` accumulation steps (so the
   global batch is exactly G), and each option's largest fitting one is its
   cheapest. The option with the lowest cost per optimizer step wins; without G,
   each option runs its largest micro-batch and the lowest cost per sample wins.
   Each option's figures come from the trace at exactly its micro-batch and
   accumulation.
4. **The limit.** The recommended configuration's own traced device total (the
   peak, on the CPU target) is at most ``capacity * (1 - margin)``.
5. **Nothing fits.** At micro-batch 1 with the most checkpointing and the lowest
   precision allowed, the plan names the smallest GPU in the table that holds the job
   and the fewest GPUs of this size that hold one rank of fsdp (zero3 for a DeepSpeed
   stage): per-rank memory is close to ``R + S / N``, so a few traces find N, and N is
   reported only once traced to fit, with N - 1 traced not to (``Plan.sharded``).

The cost proxy (relative; it ranks configurations, it does not predict seconds):

    cost per micro-step = FLOPs_fp32 / fp32 rate + FLOPs_bf16/fp16 / tensor rate + kernels * 10e-6
    cost per optimizer step = accumulation * cost per micro-step + optimizer kernels * 10e-6
                              + (3 * weights + 2 * optimizer state) bytes / bandwidth
                              [+ offloaded: 2 * weights / 25e9 + 16 B * parameters / 50e9]

The rates are the target GPU's datasheet figures (``memcheck.cuda.gpus.RATES``: FP32 on
the CUDA cores, BF16/FP16 on the tensor cores with FP32 accumulation, memory bandwidth;
an A100's for a GPU outside the table and on the CPU target). FLOPs are counted in the
trace by torch.utils.flop_counter's formulas (matmuls, convolutions, attention), so
checkpointing's recomputation is included; matmuls in fp32 do not use TF32 by default in
PyTorch. The 10 us per kernel is eager PyTorch's per-op overhead (Python, dispatch and
launch), the penalty that makes small micro-batches slow. The optimizer step is memory
bound: its weights, gradients and state cross the memory bus. Offloaded, the gradients go
down and the weights come back over PCIe (25 GB/s, an estimate) and the CPU's Adam moves
16 B a parameter (50 GB/s, an estimate). Memory-bound elementwise work elsewhere is not
counted. Among the fitting options within 10% of the cheapest, the one with the least
checkpointing (then the earliest tier) is recommended.

Known limitations:
    The sharded GPU count's "fewest" is checked against N - 1 only: the caching
    allocator's cached segments can make a rank's device total rise by a few GiB
    from one count to the next, so a count further below could, rarely, fit.
    The proxy ranks; it is not a measured throughput. The default margin comes
    from the CUDA target's accuracy targets (device total within 5%); the one GPU run
    committed (benchmarks/results/) has convolutional nets far outside it. Paged
    optimizers are not searched, and offload is searched only as zero2 on one GPU.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from memcheck.choices import ANSWERS
from memcheck.cuda.gpus import GPUS, GpuSpec, Rates, rates_for
from memcheck.cuda.overhead import context_bytes
from memcheck.engine.estimate import estimate, target_gpu
from memcheck.enums import Device, Offload, Precision, Strategy, WeightsDtype
from memcheck.errors import UsageError, closest, require_int
from memcheck.job import MIXED_PRECISION_FIELDS, Job, as_job, limit_bytes
from memcheck.report.results import (
    Estimate,
    LargerGpu,
    LengthPoint,
    Plan,
    PlanOption,
    ShardedFit,
    Suggestion,
    Work,
)
from memcheck.training.checkpointing import FULL, HALF, NONE, repeated_blocks
from memcheck.trace.device_redirect import tracing_globals
from memcheck.units import GiB

TRACES_PER_OPTION = 5
MAX_MICRO_BATCH = 65536  # the search's ceiling without a global batch
MAX_GPUS = 65536  # the sharded GPU count's ceiling when nothing fits on one GPU
SHARDED_TRACES = 10  # traces the sharded GPU count may take
CHECKPOINTING_OPTIONS = (NONE, HALF, FULL)

# The cost proxy's constants (see the module docstring); the FLOP and bandwidth rates are the
# target GPU's datasheet figures (memcheck.cuda.gpus.RATES).
SECONDS_PER_KERNEL = 10e-6  # eager PyTorch's per-op overhead, order of magnitude
HOST_LINK_BYTES_PER_SECOND = 25e9  # PCIe 4.0 x16, effective; estimate (offload moves gradients and weights)
HOST_ADAM_BYTES_PER_SECOND = 50e9  # a CPU Adam step's memory traffic; estimate (DeepSpeedCPUAdam)
SIMPLER_WITHIN = 0.10  # a simpler option within 10% of the cheapest is recommended instead
# An option predicted from another tier's trace (its persistent state swapped) is skipped only
# when the prediction passes the limit by more than this: what autocast holds besides the state
# also differs between precisions (Llama-3-8B, full checkpointing: amp-bf16 over bf16 weights
# 69.8 GiB, pure bf16 63.0 GiB, traced).
SWAP_SLACK = 0.05
LENGTH_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
LENGTH_STEP = 8  # the longest fitting length is searched in multiples of 8 (pad_to_multiple_of=8)


def _flop_seconds(work: Work, rates: Rates) -> float:
    """The proxy's FLOP terms for one micro-step."""
    high = work.flops_per_micro_step - work.low_precision_flops_per_micro_step
    return high / rates.fp32_flops + work.low_precision_flops_per_micro_step / rates.tensor_flops


def micro_step_cost(work: Work, rates: Rates) -> float:
    """The proxy's cost of one micro-step (relative seconds)."""
    return _flop_seconds(work, rates) + work.kernels_per_micro_step * SECONDS_PER_KERNEL


def step_cost(work: Work, accumulation: int, rates: Rates, optimizer_seconds: float = 0.0) -> float:
    """The proxy's cost of one optimizer step of ``accumulation`` micro-steps; ``optimizer_seconds``
    is the step's memory traffic over the bandwidth (``_Search.optimizer_seconds``)."""
    return (accumulation * micro_step_cost(work, rates) + work.optimizer_kernels * SECONDS_PER_KERNEL
            + optimizer_seconds)


@tracing_globals()
def plan(
    model: torch.nn.Module,
    make_batch: Callable[..., Any],
    job: Job | None = None,
    *,
    precision_options=None,
    optimizer_options=None,
    checkpointing_options=CHECKPOINTING_OPTIONS,
    max_len_limit: int | None = None,
    loss_fn=None,
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    length_profile: bool = True,
    suggest: bool = True,
    **settings,
) -> Plan:
    """Find the configuration that fits ``gpu`` and reaches ``global_batch`` fastest.

    Args:
        model: the model (meta or real; its weights are never touched).
        make_batch: ``make_batch(batch_size)`` or ``make_batch(batch_size, max_len)``
            returning the worst-case batch (every sequence padded to the length); with
            a length parameter the plan includes a sequence-length profile.
        job: the job to plan (``memcheck.Job``), or its settings as keywords (``settings``,
            as in ``estimate``). The plan reads: ``gpu`` (its capacity is the budget unless
            ``budget_bytes`` is given, which ``device="cpu"`` needs), ``global_batch``
            (samples per optimizer step over all GPUs; without it the micro-batch is
            maximised), ``strategy`` and ``gpus`` (the micro-batch is per GPU; under ``dp``
            the traced batch is the micro-batch times ``gpus``), ``margin`` (the fraction
            of the capacity held back, default ``DEFAULT_MARGIN``), ``max_len`` and
            ``target_len`` (the traced lengths), and passes the rest (optimizer, steps,
            use_reentrant, buckets, offload) to every trace.
        precision_options: precisions the user accepts (``fp32``, ``amp-bf16``, ...);
            default: the job's precision. ``"auto"``: the target GPU's best, ``amp-bf16`` then
            pure ``bf16`` on sm80 and later, ``amp-fp16`` before (the job's on the CPU target).
        optimizer_options: optimizer names to try (``memcheck.training.optimizers``); default:
            the job's. ``"auto"`` (for AdamW on the CUDA target): ``adamw-fused`` then
            ``adamw-8bit``, and last DeepSpeed's ZeRO-Offload on this one GPU (zero2, the
            optimizer on the CPU) when the strategy is single.
        checkpointing_options: among ``none``, ``half``, ``full``.
        max_len_limit: the model's position limit; the longest fitting length is
            searched up to it.
        loss_fn, model_name: as in ``estimate``.
        progress: called with a short line before each trace (the CLI's stderr progress).
        length_profile: trace the length profile (needs a ``make_batch`` that takes a length).
        suggest: when nothing fits, trace what would (a larger GPU, a sharded GPU count);
            False leaves ``suggestion`` None (``check``'s fix search widens its options first).

    Returns:
        A ``Plan``: ``recommended`` (None when nothing fits, with ``suggestion``
        saying what would), ``job`` (the recommended job, exactly as traced: re-trace it
        with ``estimate(model, batch, plan.job)``), ``alternatives``, ``length_profile``,
        ``traces``.

    Example:
        >>> p = memcheck.plan(model, lambda b, n: make(b, n), gpu="RTX-4090", global_batch=64,
        ...                   max_len=1024, precision_options=("fp32", "amp-bf16"))
        >>> p.recommended.micro_batch_size, p.recommended.accumulation_steps
    """
    job = as_job(job, settings, caller="plan()")
    if job.layout is not None:
        raise UsageError("plan() searches one strategy; a layout is planned by memcheck.plan_layout(model, "
                         "make_batch, job) (memcheck plan --layout on the command line)")
    space = _validate(model, make_batch, job, precision_options, optimizer_options, checkpointing_options,
                      max_len_limit)
    search = _Search(model, make_batch, _arity(make_batch), job, gpu=space.target, budget=space.budget,
                     blocks=space.blocks, name=model_name or type(model).__name__, progress=progress, loss_fn=loss_fn)
    recommended, alternatives = _choose(search, space)
    return _result(search, space, job, recommended, alternatives, length_profile, max_len_limit, suggest)


@dataclass(frozen=True)
class _Space:
    """What a plan searches, checked: the options, the target and its limit."""

    tiers: list["_Tier"]  # (precision, optimizer, offload) in the order they are tried
    checkpoints: list[str]
    target: GpuSpec | None
    budget: int  # the capacity: the job's budget, else the GPU's
    limit: int  # budget * (1 - margin)
    blocks: list[str]  # the repeated blocks "full" checkpoints
    cap: int  # the largest micro-batch per GPU worth trying

    @property
    def precisions(self) -> list[Precision]:
        return _unique(t.precision for t in self.tiers)


@dataclass(frozen=True)
class _Tier:
    """A precision and optimizer to search checkpointing and micro-batches under."""

    precision: Precision
    optimizer: str
    offload: bool = False  # DeepSpeed ZeRO-Offload on one GPU: zero2, the optimizer on the CPU
    fallback: int = 0  # tried only when no tier of a lower fallback fits (8-bit state, then offload)

    def describe(self) -> str:
        return f"{self.precision.value}, {self.optimizer}" + (", optimizer offloaded (zero2)" if self.offload else "")


AUTO = "auto"
ADAMW = ("adamw", "adamw-foreach", "adamw-fused")  # what the default search widens to fused, 8-bit and offload


def _validate(model, make_batch, job: Job, precision_options, optimizer_options, checkpointing_options,
              max_len_limit) -> _Space:
    """Check what the job alone cannot (the model, the factory, the options) and lay out the search."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(make_batch) or isinstance(make_batch, torch.Tensor):
        raise UsageError("make_batch must be a function make_batch(batch_size[, max_len]) returning the worst-case "
                         f"batch, got {type(make_batch).__name__}")
    if max_len_limit is not None:
        require_int(max_len_limit, "max_len_limit")
    target = target_gpu(job)
    budget = job.budget_bytes
    if budget is None:
        if target is None:
            raise UsageError("a plan needs a capacity: name the GPU (--gpu H100-80GB or --gpu 24GiB) "
                             "or give --gpu-memory")
        budget = target.capacity_bytes
    cuda = job.device is Device.CUDA
    auto_precision = precision_options == AUTO
    if precision_options is None or (auto_precision and not cuda):
        precision_options = (job.precision,)
    elif auto_precision:
        arch = target.arch if target is not None else (8, 0)
        precision_options = ("amp-bf16", "bf16") if arch >= (8, 0) else ("amp-fp16",)
    precisions = _unique(Precision.parse(p, what="precision")
                         for p in _as_list(precision_options, "precision_options"))
    if auto_precision and job.weights_dtype is not WeightsDtype.AUTO:  # pure bf16 names its own weights' dtype
        precisions = [p for p in precisions if _weights_agree(job, p)] or precisions
    for p in precisions:  # a precision the weights dtype contradicts is refused before anything is traced
        job.replace(precision=p)
    precisions.sort(key=lambda p: p is Precision.FP32)  # likely winners first, so that later options drop early
    auto_optimizer = optimizer_options == AUTO and cuda and job.optimizer in ADAMW  # the HF Trainer's is fused
    if optimizer_options is None or optimizer_options == AUTO and not auto_optimizer:
        optimizers = [job.optimizer]
    elif auto_optimizer:
        optimizers = ["adamw-fused", "adamw-8bit"]
    else:
        optimizers = _unique(_optimizer_option(o) for o in _as_list(optimizer_options, "optimizer_options"))
    checkpoints = _unique(_parse_option(c) for c in _as_list(checkpointing_options, "checkpointing_options"))
    if not precisions or not optimizers or not checkpoints:
        raise UsageError("a plan needs at least one precision, one optimizer and one checkpointing option")
    tiers = [_Tier(p, o, fallback=int(auto_optimizer and o == "adamw-8bit")) for o in optimizers for p in precisions]
    config = job.strategy_config
    if auto_optimizer and config.strategy is Strategy.SINGLE:
        tiers.append(_Tier(precisions[0], "adamw", offload=True, fallback=2))
    blocks = repeated_blocks(model)
    if not blocks:
        checkpoints = [c for c in checkpoints if c == NONE] or [NONE]
    cap = job.global_batch // config.gpus if job.global_batch is not None else MAX_MICRO_BATCH
    return _Space(tiers, checkpoints, target, budget, limit_bytes(budget, job.effective_margin), blocks, cap)


def _weights_agree(job: Job, precision: Precision) -> bool:
    try:
        job.replace(precision=precision)
    except UsageError:
        return False
    return True


def _optimizer_option(value) -> str:
    from memcheck.training.optimizers import OPTIMIZERS

    if not isinstance(value, str) or value.strip().lower() not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {value!r} in optimizer_options{closest(str(value), OPTIMIZERS)}; "
                         f"allowed: {', '.join(OPTIMIZERS)}")
    return value.strip().lower()


def _choose(search: "_Search", space: _Space) -> tuple[PlanOption | None, tuple[PlanOption, ...]]:
    """Each option's best micro-batch, by tracing; the cheapest that fits (or a simpler one
    within ``SIMPLER_WITHIN`` of it), and the others.

    Tiers (precision, optimizer, offload) are tried in order; the fallbacks (8-bit optimizer
    state, then ZeRO-Offload) only when no earlier tier fits. A tier whose weights, gradients
    and optimizer state alone exceed the limit (``_Search.floor``) is not traced. Once one
    fits, later tiers of the same FLOP rate (both fp32, or both low precision) are searched
    only for lighter checkpointing than the best's, and an
    option there is not traced when the same checkpointing traced in an earlier tier, with
    its persistent state swapped for this tier's, exceeds the limit by more than SWAP_SLACK.
    """
    options: list[PlanOption] = []
    best: tuple[float, PlanOption] | None = None
    best_tier = None
    for tier in space.tiers:
        if best_tier is not None and tier.fallback > best_tier.fallback:
            break  # 8-bit state and offload only when nothing before them fits
        floor = search.floor(tier)
        if floor > space.limit:
            search.skipped.append(f"{tier.describe()}: not traced: its weights, gradients and optimizer state "
                                  f"alone take {floor / GiB:.2f} GiB")
            continue
        for ck in space.checkpoints:
            if best is not None and _dominated(best[1], ck, tier, space.cap):
                continue
            if best is not None and best_tier is not tier and _same_speed(tier, best[1]):
                if not _heavier(best[1].checkpointing, ck):  # later tiers only for lighter checkpointing
                    continue
                predicted = search.predicted_from_earlier(tier, ck)
                if predicted is not None and predicted > space.limit * (1 + SWAP_SLACK):
                    search.skipped.append(f"{tier.describe()}, checkpointing {ck}: not traced: "
                                          f"{predicted / GiB:.2f} GiB at micro-batch 1, from the same checkpointing "
                                          "traced with another optimizer or precision")
                    continue
            option = search.option(tier, ck, space.limit, space.cap, best[0] if best else None)
            options.append(option)
            if option.fits and (best is None or option.relative_cost < best[0]):
                best, best_tier = (option.relative_cost, option), tier
    recommended = _simplest_close(options, best)
    return recommended, tuple(o for o in options if o is not recommended)


def _simplest_close(options: list[PlanOption], best: tuple[float, PlanOption] | None) -> PlanOption | None:
    """Among the fitting options within SIMPLER_WITHIN of the cheapest, the one with the least
    checkpointing (then the earliest tier, then the cheapest)."""
    if best is None:
        return None
    close = [o for o in options if o.fits and o.relative_cost <= best[0] * (1 + SIMPLER_WITHIN)]
    return min(close, key=lambda o: (CHECKPOINTING_OPTIONS.index(o.checkpointing), options.index(o),
                                     o.relative_cost))


def _same_speed(tier: _Tier, option: PlanOption) -> bool:
    """Both fp32, or both low precision: the FLOP rate is the same, so a later tier can win only
    by checkpointing less. Otherwise it is searched in full (its FLOPs bound prunes it)."""
    return (tier.precision is Precision.FP32) == (option.precision == Precision.FP32.value)


def _heavier(checkpointing: str, than: str) -> bool:
    return CHECKPOINTING_OPTIONS.index(checkpointing) > CHECKPOINTING_OPTIONS.index(than)


def _result(search: "_Search", space: _Space, job: Job, recommended: PlanOption | None,
            alternatives: tuple[PlanOption, ...], length_profile: bool, max_len_limit: int | None,
            suggest: bool = True) -> Plan:
    """The recommendation's own trace and length profile, or, when nothing fits, what would."""
    profile: tuple[LengthPoint, ...] = ()
    longest = chosen = suggestion = None
    if recommended is not None:
        chosen = search.estimate_at(recommended.micro_batch_size, recommended.precision,
                                    recommended.checkpointing, recommended.accumulation_steps,
                                    optimizer=recommended.optimizer, offload=recommended.offload == "optimizer")
        if length_profile and search.takes_length and job.max_len:
            profile, longest = search.length_profile(recommended, space.limit, max_len_limit)
    elif suggest:
        suggestion = search.what_would_fit(space.precisions, space.checkpoints, job.effective_margin)
    config = job.strategy_config
    return Plan(
        model=search.name, device=job.device, gpu=space.target, capacity_bytes=space.budget,
        margin=job.effective_margin, limit_bytes=space.limit, strategy=config.strategy.value, gpus=config.gpus,
        global_batch=job.global_batch, recommended=recommended, alternatives=alternatives, length_profile=profile,
        longest_fitting_length=longest, max_len=job.max_len, traces=search.traces, estimate=chosen,
        suggestion=suggestion, sharded=None if suggestion is None else suggestion.sharded,
        blocks=tuple(space.blocks), position_limit=max_len_limit, branches_note=search.branches_note,
        not_traced=tuple(search.skipped),
        job=None if chosen is None else chosen.job.replace(global_batch=job.global_batch, margin=job.margin),
    )


def _dominated(best: PlanOption, checkpointing: str, tier: _Tier, cap: int) -> bool:
    """An option with more checkpointing at the same precision cannot beat one that already
    reaches the micro-batch ceiling: it runs the same micro-batches and recomputes."""
    more = _heavier(checkpointing, best.checkpointing)
    return best.precision == tier.precision.value and best.micro_batch_size >= cap and more


class _Search:
    """Traces the job at chosen points and remembers every trace."""

    def __init__(self, model, make_batch, arity, job: Job, *, gpu, budget, blocks, name, progress, loss_fn):
        self.model, self.make_batch, self.arity = model, make_batch, arity
        self.takes_length = arity >= 2  # make_batch(batch_size, max_len[, target_len])
        config = job.strategy_config
        self.job, self.device, self.gpu, self.budget = job, job.device, gpu, budget
        self.strategy, self.gpus, self.global_batch = config.strategy, config.gpus, job.global_batch
        self.max_len, self.target_len, self.blocks = job.max_len, job.target_len, blocks
        self.name, self.progress, self.loss_fn = name, progress, loss_fn
        self.traces = 0
        self.rates = rates_for(gpu) if self.device is Device.CUDA else rates_for(None)
        self.skipped: list[str] = []  # options not traced, and why
        self._cache: dict[tuple, Estimate] = {}
        self.branches_note = ""  # set when the first trace with a data-dependent choice pins its answers

    def accumulation(self, micro: int) -> int:
        if self.global_batch is None:
            return 1
        return math.ceil(self.global_batch / (micro * self.gpus))

    def estimate_at(self, micro: int, precision: str | Precision, checkpointing: str, accumulate: int, *,
                    length: int | None = None, gpu: GpuSpec | None = None, strategy: Strategy | None = None,
                    gpus: int | None = None, optimizer: Any = None, offload: bool = False) -> Estimate:
        """One trace (or the remembered one for the same point). ``offload``: DeepSpeed's
        ZeRO-Offload on one GPU (zero2 x1, the optimizer on the CPU)."""
        precision = Precision.parse(precision)
        optimizer = self.job.optimizer if optimizer is None else optimizer
        if offload:
            strategy, gpus = Strategy.ZERO2, 1
        strategy = strategy or self.strategy
        gpus = gpus or self.gpus
        gpu = gpu or self.gpu
        key = (micro, precision, checkpointing, accumulate, length, gpu, strategy, gpus, optimizer, offload)
        if key in self._cache:
            return self._cache[key]
        if self.progress is not None:
            self.progress(f"tracing micro-batch {micro}, {precision.value}, {optimizer if isinstance(optimizer, str) else 'optimizer'}"
                          + (", optimizer offloaded" if offload else "") + f", checkpointing {checkpointing}"
                          + (f", length {length}" if length else "") + (f", {strategy.value} x{gpus}"
                                                                         if strategy.multi_gpu else ""))
        rows = micro * gpus if strategy in (Strategy.DP, Strategy.DP_BALANCED) else micro
        batch = self._batch(rows, length)
        # the evaluation pass the job asks for runs at its own batch size, at the same length
        eval_batch = self._batch(self.job.eval_batch_size, length) if self.job.eval_batch_size else None
        traced = self.job.replace(
            precision=precision, gpu=gpu if self.device is Device.CUDA else None, budget_bytes=self.budget,
            strategy=strategy, gpus=gpus if strategy.multi_gpu else None, accumulate=accumulate, optimizer=optimizer,
            offload=Offload.OPTIMIZER if offload else self.job.offload,
            # fsdp1's settings hold for the user's own strategy and GPU count only (the ZeRO-Offload
            # option and the sharded GPU-count search trace other strategies)
            fsdp_sharding=self.job.fsdp_sharding if strategy is Strategy.FSDP1 else None,
            gpus_per_node=self.job.gpus_per_node if strategy is Strategy.FSDP1 and gpus == self.gpus else None,
            # FSDP2's MixedPrecisionPolicy and FSDP1's MixedPrecision hold for fsdp and fsdp1 only (the
            # ZeRO-Offload option traces zero1-3)
            **({} if strategy in (Strategy.FSDP, Strategy.FSDP1) else MIXED_PRECISION_FIELDS),
            # "half" by name, not as the base model's module names: apply_checkpointing picks the blocks
            # after LoRA/QLoRA have wrapped the model (PEFT renames every module: base_model.model.…)
            checkpointing=checkpointing, batch_size=micro, max_len=length or self.max_len, global_batch=None)
        est = estimate(self.model, batch, traced, loss_fn=self.loss_fn, model_name=self.name, top_modules=0,
                       eval_batch=eval_batch)
        self.traces += 1
        self._cache[key] = est
        self._pin_branches(est, micro, precision, checkpointing)
        return est

    def _batch(self, rows: int, length: int | None):
        """The worst-case batch of ``rows`` at ``length`` (``max_len`` when None), the label length
        scaled with it."""
        if not self.takes_length:
            return self.make_batch(rows)
        length = length or self.max_len
        target = self.target_len
        if target and self.max_len and length != self.max_len:
            target = max(1, round(target * length / self.max_len))
        return self.make_batch(rows, length, target) if self.arity >= 3 else self.make_batch(rows, length)

    def _pin_branches(self, est: Estimate, micro: int, precision: Precision, checkpointing: str) -> None:
        """Pin the data-dependent answers of the first trace that had a choice (the worse
        branch there) for every later trace, so the search does not trace every branch at
        every candidate (``memcheck.choices``)."""
        if est.branches is None or self.branches_note:
            return
        b = est.branches
        self.job = self.job.replace(assume=tuple(sorted(set(self.job.assume) | set(b.taken), key=ANSWERS.index)))
        self.branches_note = (
            f"data-dependent branches: {len(b.traces)} traced at the first candidate (micro-batch {micro}, "
            f"{precision.value}, checkpointing {checkpointing}); the worse, {', '.join(b.taken)}, pinned for the "
            f"other traces (assume={','.join(self.job.assume)})")

    def option(self, tier: "_Tier", checkpointing: str, limit: int, cap: int,
               best_cost: float | None = None) -> PlanOption:
        """The largest micro-batch that fits under ``limit`` for one option.

        With a global batch the candidates are the divisors of its per-GPU share, so
        that micro-batch x accumulation x GPUs is exactly the global batch; without
        one, every size up to ``cap``. Within one option the largest fitting
        candidate is also the cheapest: FLOPs per sample do not change with the
        micro-batch, and fewer micro-steps launch fewer kernels.

        After the first trace, an option whose FLOPs alone (per sample, or for the global
        batch) already cost more than ``best_cost`` cannot win, and its search stops.
        """
        before = self.traces
        precision = tier.precision
        totals: dict[int, int] = {}
        work: dict[int, Work] = {}
        extra: dict[int, float] = {}
        candidates = _divisors(cap) if self.global_batch is not None else None

        def trace(m: int) -> bool:
            est = self.estimate_at(m, precision, checkpointing, self.accumulation(m), optimizer=tier.optimizer,
                                   offload=tier.offload)
            totals[m], work[m], extra[m] = est.total_bytes, est.work, self.optimizer_seconds(est, tier)
            return est.total_bytes <= limit

        def above(m: int) -> int | None:  # the next candidate after m
            if candidates is None:
                return m + 1 if m < cap else None
            return next((c for c in candidates if c > m), None)

        def at_or_below(m: int) -> int:
            if candidates is None:
                return m
            return max(c for c in candidates if c <= m)

        def result(micro: int, fits: bool, cost: float, confirmed: bool, note: str = "") -> PlanOption:
            return PlanOption(
                micro_batch_size=micro, accumulation_steps=self.accumulation(micro), checkpointing=checkpointing,
                precision=precision.value, predicted_device_total_bytes=totals[micro], fits=fits,
                relative_cost=cost, traces=self.traces - before, largest_fitting_micro_batch=lo,
                boundary_confirmed=confirmed, note=note, optimizer=tier.optimizer,
                offload="optimizer" if tier.offload else "none",
            )

        lo, hi = 0, None
        candidate = 1
        while self.traces - before < TRACES_PER_OPTION:
            if trace(candidate):
                lo = candidate
            else:
                hi = candidate
            if lo == 0 or above(lo) is None or above(lo) == hi:
                break
            if best_cost is not None and self._flops_bound(work[1]) >= best_cost:
                return result(1, True, step_cost(work[1], self.accumulation(1), self.rates, extra[1]), False,
                              "search stopped after 1 trace: its FLOPs alone cost more than a better option")
            guess = at_or_below(_next_guess(totals, limit, lo, hi, cap, self._per_sample_bytes(tier, checkpointing)))
            candidate = guess if guess > lo else above(lo)
        if lo == 0:
            return result(1, False, math.inf, True)
        cost = step_cost(work[lo], self.accumulation(lo), self.rates, extra[lo])
        if self.global_batch is None:
            cost = cost / lo  # per sample: the throughput's inverse
        return result(lo, True, cost, above(lo) is None or above(lo) == hi)

    def _per_sample_bytes(self, tier: "_Tier", checkpointing: str) -> int:
        """What grows with the batch, from the micro-batch-1 trace (remembered, not re-run):
        activations, temporaries, outputs and the batch itself at its peak."""
        b = self.estimate_at(1, tier.precision, checkpointing, self.accumulation(1), optimizer=tier.optimizer,
                             offload=tier.offload).breakdown_at_peak
        return b.activations + b.temporaries + b.outputs + b.inputs

    def _flops_bound(self, work: Work) -> float:
        """A lower bound on an option's cost from its micro-batch-1 trace: the FLOP terms only."""
        return _flop_seconds(work, self.rates) * (self.global_batch // self.gpus if self.global_batch is not None
                                                  else 1)

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.is_floating_point()]

    def floor(self, tier: "_Tier") -> int:
        """A lower bound on any trace of ``tier``'s device total: the weights in the tier's
        dtype, a gradient and the optimizer's state for each trainable one (AdamW: two moments
        in the weight's dtype, as torch keeps them; 8-bit: two bytes an element; offloaded: none),
        and the CUDA context; for a sharded strategy only the context. Under LoRA/QLoRA the base
        is frozen (PEFT sets requires_grad=False on it: no gradient, no state; the adapters' own
        are left out, as a lower bound may) and QLoRA's weights count half a byte an element (NF4,
        below any dtype's). Used only to skip tracing, never reported as a figure."""
        adapters = self.job.lora is not None or self.job.qlora
        dtype = tier.precision.weights_dtype or self.job.weights_dtype.torch_dtype
        if dtype is None and tier.precision is Precision.FP32:
            dtype = torch.float32
        moments = {"adamw": 2, "adam": 2, "adamw-fused": 2, "adam-fused": 2, "adamw-foreach": 2}.get(tier.optimizer, 0)
        total = context_bytes(self.gpu) if self.device is Device.CUDA and self.gpu is not None else 0
        if self.strategy not in (Strategy.SINGLE, Strategy.DP, Strategy.DP_BALANCED, Strategy.DDP):
            return total  # sharded: a rank holds a part; no floor is worked out for it
        for p in self._parameters():
            weight = p.numel() * (dtype.itemsize if dtype is not None else p.element_size())
            total += p.numel() // 2 if self.job.qlora else weight
            if p.requires_grad and not adapters:
                total += weight  # its gradient
                if not tier.offload:
                    total += moments * weight + (2 * p.numel() if tier.optimizer == "adamw-8bit" else 0)
        return total

    def predicted_from_earlier(self, tier: "_Tier", checkpointing: str) -> int | None:
        """Micro-batch 1 of ``tier`` at ``checkpointing`` from a trace already made at the same
        checkpointing with another tier: its device total less that tier's floor plus this
        one's (what the batch adds does not depend on the optimizer). None without one."""
        for key, est in self._cache.items():
            micro, precision, ck, _acc, length, gpu, _strategy, _gpus, optimizer, offload = key
            if micro == 1 and ck == checkpointing and length is None and gpu == self.gpu and not offload:
                other = _Tier(precision, optimizer)
                return est.total_bytes - self.floor(other) + self.floor(tier)
        return None

    def optimizer_seconds(self, est: Estimate, tier: "_Tier") -> float:
        """The proxy's time for an optimizer step's memory traffic: the weights and the
        optimizer state read and written and the gradients read, over the GPU's bandwidth;
        offloaded, the gradients down and the weights up the host link and the CPU's step."""
        b = est.breakdown_at_peak
        seconds = (3 * b.params + 2 * b.optimizer) / self.rates.bandwidth
        if tier.offload:
            trainable = [p for p in self._parameters() if p.requires_grad]
            moved = sum(p.numel() * p.element_size() for p in trainable)
            elements = sum(p.numel() for p in trainable)
            seconds += 2 * moved / HOST_LINK_BYTES_PER_SECOND + 16 * elements / HOST_ADAM_BYTES_PER_SECOND
        return seconds

    def length_profile(self, rec: PlanOption, limit: int, position_limit: int | None):
        """Peaks at 25-100% of max_len at the recommended point, and the longest length that fits."""
        points = []
        lengths = {}
        for fraction in LENGTH_FRACTIONS:
            length = max(1, round(self.max_len * fraction))
            est = self.estimate_at(rec.micro_batch_size, rec.precision, rec.checkpointing, rec.accumulation_steps,
                                   length=None if length == self.max_len else length, optimizer=rec.optimizer,
                                   offload=rec.offload == "optimizer")
            lengths[length] = est.total_bytes
            points.append(LengthPoint(length, est.total_bytes, est.total_bytes <= limit))
        # The recommendation fits at max_len, so the longest fitting length is at least that.
        ceiling = position_limit or self.max_len
        longest = self._longest(rec, lengths, limit, ceiling) if ceiling > self.max_len else self.max_len
        return tuple(points), longest

    def _longest(self, rec: PlanOption, lengths: dict[int, int], limit: int, ceiling: int) -> int:
        """The longest multiple of LENGTH_STEP up to ``ceiling`` that fits: a quadratic through
        the traced lengths predicts it, and traces confirm (at most 4)."""
        lo = max(n for n, b in lengths.items() if b <= limit)
        hi = min((n for n, b in lengths.items() if b > limit), default=None)
        for _ in range(4):
            top = (hi - 1) if hi is not None else ceiling
            guess = _quadratic_root(lengths, limit)
            guess = top if guess is None else min(top, int(guess))
            guess = max(guess // LENGTH_STEP * LENGTH_STEP, (lo // LENGTH_STEP + 1) * LENGTH_STEP)
            if guess > top:
                break
            est = self.estimate_at(rec.micro_batch_size, rec.precision, rec.checkpointing, rec.accumulation_steps,
                                   length=guess, optimizer=rec.optimizer, offload=rec.offload == "optimizer")
            lengths[guess] = est.total_bytes
            if est.total_bytes <= limit:
                lo = guess
            else:
                hi = guess
            if hi is not None and (lo // LENGTH_STEP + 1) * LENGTH_STEP >= hi:
                break  # confirmed from both sides
        return lo

    def what_would_fit(self, precisions, checkpoints, margin: float) -> Suggestion:
        """When nothing fits at micro-batch 1: the smallest GPU in the table that holds the
        most frugal option, and how many GPUs of this size a sharded strategy needs. Each
        answer is confirmed by its own trace."""
        precision = min(precisions, key=lambda p: 0 if p.weights_dtype is not None else
                        1 if p.autocast_dtype is not None else 2)
        checkpointing = FULL if FULL in checkpoints else checkpoints[-1]
        larger = sharded = None
        if self.device is Device.CUDA:
            base = self.estimate_at(1, precision, checkpointing, self.accumulation(1))
            candidates = [g for g in sorted(GPUS.values(), key=lambda g: g.capacity_bytes)
                          if g.capacity_bytes > self.budget]
            for spec in candidates:  # predicted from the trace on this GPU, then traced on that one
                if base.reserved_bytes + context_bytes(spec) > limit_bytes(spec.capacity_bytes, margin):
                    continue
                est = self.estimate_at(1, precision, checkpointing, self.accumulation(1), gpu=spec)
                if est.total_bytes <= limit_bytes(spec.capacity_bytes, margin):
                    larger = LargerGpu(spec.name, spec.capacity_bytes, est.total_bytes)  # the job as asked
                    break
            sharded = self._sharded_count(base, precision, checkpointing, margin)
        return Suggestion(precision=precision.value, checkpointing=checkpointing, searched=self.device is Device.CUDA,
                          strategy=self.strategy.value, gpus=self.gpus, larger_gpu=larger, sharded=sharded,
                          global_batch=self.global_batch)

    def _sharded_count(self, base: Estimate, precision: Precision, checkpointing: str,
                       margin: float) -> ShardedFit:
        """The fewest GPUs of this size that hold one rank of fsdp (zero3 when a DeepSpeed stage
        was asked for) at micro-batch 1, in at most SHARDED_TRACES traces.

        A rank holds close to ``R + S / N``: S is the state that shards (weights, gradients,
        optimizer state and the optimizer step's temporaries), R the rest (activations, the
        gathered block, communication buffers, fragmentation, the context). The first guess
        takes S from the failing trace's weights, gradients and optimizer state and R from what
        else it holds but temporaries; after one sharded trace R is re-read from it; after
        two, each guess is the secant in 1/N through the two traced counts nearest the limit.
        Guesses are kept strictly between the most GPUs known not to fit and the fewest known
        to fit (halving that bracket where the secant lands next to one of its ends or the last
        trace did not halve it, as on the flat stretches the allocator's segments make), and the
        search stops when the two are adjacent: N fits and N - 1 does not, both traced (or
        N - 1 is the failing job).
        """
        sharded = (Strategy.ZERO3 if self.strategy in (Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)
                   else Strategy.FSDP)
        limit = limit_bytes(self.budget, margin)
        own = self.strategy is sharded  # the failing trace is already one rank of it, at self.gpus
        seen: dict[int, int] = {self.gpus: base.total_bytes} if own else {}
        lo, hi = (self.gpus if own else 1), None  # the most GPUs known not to fit; the fewest known to
        b = base.breakdown_at_peak
        # Not the optimizer step's temporaries: they shard too, but a rank's peak moves out of the
        # step as N grows (measured: the first guess for LLaMA-70B lands further off with them).
        state = (b.params + b.grads + b.optimizer) * (self.gpus if own else 1)
        rest = base.total_bytes - (b.params + b.grads + b.optimizer + b.temporaries)
        guess = _gpus_for(state, rest, limit)
        width = None  # hi - lo after the previous trace, once both are known
        for _ in range(SHARDED_TRACES):
            if guess is None:  # no prediction: double, or halve the bracket
                guess = 2 * lo if hi is None else (lo + hi) // 2
            guess = max(lo + 1, min(guess, MAX_GPUS) if hi is None else min(guess, hi - 1))
            if guess > MAX_GPUS:  # MAX_GPUS itself was traced and does not fit
                break
            accumulate = math.ceil(self.global_batch / guess) if self.global_batch is not None else 1
            seen[guess] = self.estimate_at(1, precision, checkpointing, accumulate, strategy=sharded,
                                           gpus=guess).total_bytes
            if seen[guess] <= limit:
                hi = guess if hi is None else min(hi, guess)
            else:
                lo = max(lo, guess)
            if hi == lo + 1:
                break
            slow = width is not None and hi - lo > width // 2  # the last trace did not halve the bracket
            width = None if hi is None else hi - lo
            near = sorted(seen, key=lambda n: abs(seen[n] - limit))[:2]
            if len(near) == 2:
                n1, n2 = near
                slope = (seen[n1] - seen[n2]) / (1 / n1 - 1 / n2)
                if slope > 0:
                    state, rest = slope, seen[n1] - slope / n1
            else:
                rest = seen[guess] - state / guess
            guess = _gpus_for(state, rest, limit)
            if guess is None and hi is None and len(near) == 2:
                # what does not shard fills the GPU: confirmed by tracing the most GPUs searched
                guess = MAX_GPUS
            if hi is not None and (slow or hi - lo > 2 and guess is not None and not lo + 1 < guess < hi - 1):
                guess = (lo + hi) // 2  # the secant hugs an end of the bracket, or is slow (a flat stretch): halve it
        return ShardedFit(
            strategy=sharded.value, gpus=hi, device_total_bytes=None if hi is None else seen[hi],
            precision=precision.value, checkpointing=checkpointing,
            fewer_do_not_fit=hi is not None and hi == lo + 1, traced=tuple(sorted(seen.items())),
            limit_bytes=limit, most_not_fitting=lo, unsharded_bytes=max(0, int(rest)),
            stopped_after_traces=SHARDED_TRACES if hi is None and max(seen) < MAX_GPUS else 0,
        )


def _gpus_for(state: float, rest: float, limit: int) -> int | None:
    """The fewest N with ``rest + state / N <= limit``; None when ``rest`` alone reaches the limit."""
    if rest >= limit:
        return None
    return math.ceil(max(state, 0) / (limit - rest))


def _next_guess(totals: dict[int, int], limit: int, lo: int, hi: int | None, cap: int,
                first_slope: float = 0) -> int:
    """The next micro-batch to trace: the secant through the two traced points nearest the
    boundary, kept strictly between ``lo`` (fits) and ``hi`` (does not). After one trace
    the slope is ``first_slope``: the bytes at micro-batch 1's peak that scale with the
    batch (activations, temporaries, outputs, the batch itself)."""
    top = min(cap, hi - 1) if hi is not None else cap
    if len(totals) == 1:
        (a, total), = totals.items()
        if first_slope <= 0:
            return max(lo + 1, min(top, 4))
        return max(lo + 1, min(top, a + math.floor((limit - total) / first_slope)))
    if hi is not None:
        a, b = lo, hi
    else:
        a, b = sorted(totals)[-2:]
    slope = (totals[b] - totals[a]) / (b - a)
    if slope <= 0:
        guess = top
    else:
        guess = a + math.floor((limit - totals[a]) / slope)
    if guess <= lo:  # the prediction says lo is the boundary: confirm it from above
        guess = lo + 1
    return max(lo + 1, min(top, guess))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _quadratic_root(points: dict[int, int], limit: int) -> float | None:
    """The length where a quadratic through the three traced points nearest the limit
    reaches it (memory grows linearly in length with flash attention, quadratically
    with eager attention's score matrix)."""
    xs = sorted(points, key=lambda n: abs(points[n] - limit))[:3]
    if len(xs) < 3:
        return None
    xs.sort()
    (x0, x1, x2), (y0, y1, y2) = xs, [points[x] for x in xs]
    # Newton's divided differences: y = y0 + d1 (x - x0) + d2 (x - x0)(x - x1)
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    d2 = (d12 - d01) / (x2 - x0)
    a, b, c = d2, d01 - d2 * (x0 + x1), y0 - d01 * x0 + d2 * x0 * x1 - limit
    if abs(a) < 1e-12:
        return None if b <= 0 else -c / b
    disc = b * b - 4 * a * c
    if disc < 0:
        return None
    roots = [(-b + s * math.sqrt(disc)) / (2 * a) for s in (1, -1)]
    ahead = [r for r in roots if r >= x0]
    return min(ahead) if ahead else None


def _parse_option(value) -> str:
    text = str(value).strip().lower()
    if text not in CHECKPOINTING_OPTIONS:
        raise UsageError(f"checkpointing option {value!r} is not one of {', '.join(CHECKPOINTING_OPTIONS)}"
                         + closest(text, CHECKPOINTING_OPTIONS))
    return text


def _as_list(value, what: str) -> list:
    if isinstance(value, (str, Precision)):
        return [v for v in str(value.value if isinstance(value, Precision) else value).split(",") if v.strip()]
    try:
        return list(value)
    except TypeError:  # None, a number: not a list of names
        raise UsageError(f"{what} must be a comma-separated string or a list of names, got {value!r}") from None


def _unique(items) -> list:
    out = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def _arity(fn) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
