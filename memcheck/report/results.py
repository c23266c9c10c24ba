"""Result objects: frozen dataclasses of integer bytes. ``str()`` renders, ``to_dict()`` is the JSON."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from memcheck.cuda.gpus import GpuSpec
from memcheck.enums import Category, Device, Phase, Precision
from memcheck.job import SCHEMA_VERSION, Job, limit_bytes
from memcheck.training.checkpointing import half_of
from memcheck.training.optimizers import optimizer_name

if TYPE_CHECKING:
    from memcheck.report.timeline import Timeline


@dataclass(frozen=True)
class Judgement:
    """The one verdict rule: a job's total against its capacity less the margin.

    estimate, check, plan, preflight and the callbacks judge with it, so the same job gets
    the same verdict everywhere; the reports say the headroom it leaves and the margin kept
    (``memcheck.report.text.headroom_words``).
    """

    total_bytes: int  # the device total on CUDA, the peak on the CPU target
    capacity_bytes: int  # the budget: the job's, else the GPU's capacity
    margin: float  # the fraction of the capacity held back

    @property
    def limit_bytes(self) -> int:
        return limit_bytes(self.capacity_bytes, self.margin)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.limit_bytes

    @property
    def headroom(self) -> float:
        """The fraction of the capacity the job leaves free (negative: over the capacity)."""
        return (self.capacity_bytes - self.total_bytes) / self.capacity_bytes if self.capacity_bytes else 0.0

    def to_dict(self) -> dict:
        return {"fits": self.fits, "total_bytes": self.total_bytes, "capacity_bytes": self.capacity_bytes,
                "margin": self.margin, "limit_bytes": self.limit_bytes, "headroom": self.headroom}


@dataclass(frozen=True)
class Breakdown:
    """Bytes live at one instant, by category. ``total`` is their sum."""

    params: int = 0
    buffers: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    temporaries: int = 0
    outputs: int = 0
    inputs: int = 0
    workspaces: int = 0
    communication: int = 0
    other: int = 0

    @classmethod
    def from_categories(cls, by_category: dict[Category, int]) -> "Breakdown":
        return cls(**{c.value: n for c, n in by_category.items()})

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


_BLOCK_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a repeated block's index: model.layers.[3].mlp


@dataclass(frozen=True)
class ModuleMemory:
    """Memory live at the peak that belongs to one module (by its qualified name)."""

    name: str
    state_bytes: int  # parameters, buffers, gradients, optimizer state and communication buffers it owns
    activation_bytes: int  # activations, temporaries and outputs allocated inside it
    saved_bytes: int = 0  # of activation_bytes, what autograd saved for backward (Category.ACTIVATION)

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes

    @property
    def repeat_key(self) -> tuple:
        """The name with its first block index as ``#`` (``model.layers.#.mlp``) and the bytes:
        rows with equal keys are identical copies of one repeated block."""
        return _BLOCK_INDEX.sub("#", self.name, count=1), self.state_bytes, self.activation_bytes, self.saved_bytes


@dataclass(frozen=True)
class InputSpec:
    """One tensor of the traced batch."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class BatchInfo:
    """The worst-case batch that was traced."""

    batch_size: int
    max_len: int | None
    target_len: int | None
    inputs: tuple[InputSpec, ...]


@dataclass(frozen=True)
class Work:
    """The compute one GPU runs per micro-step and per optimizer step, counted in the trace.

    FLOPs are torch.utils.flop_counter's formulas (matmuls, convolutions, attention;
    elementwise ops count 0) and include checkpointing's recomputation; kernels are
    the ops that launch one (views and bare allocations excluded). The planner's
    cost proxy (memcheck.engine.plan) reads them.
    """

    flops_per_micro_step: int  # forward, loss and backward of one micro-batch
    low_precision_flops_per_micro_step: int  # of those, in bf16/fp16 (autocast or pure low precision)
    kernels_per_micro_step: int
    optimizer_kernels: int  # optimizer.step() and zero_grad(), once per optimizer step


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's (or the CPU's) steady-state peak under a strategy, and what was live at it."""

    index: int
    peak_bytes: int
    breakdown_at_peak: Breakdown
    peak_phase: Phase
    peak_module: str
    peak_step: int  # 1-based
    modules: tuple[ModuleMemory, ...]
    train_peak_bytes: int  # the training steps' steady-state peak
    eval_peak_bytes: int | None = None  # the evaluation pass's peak, when one was traced
    reserved_bytes: int | None = None
    fragmentation_bytes: int | None = None
    context_bytes: int | None = None
    device_total_bytes: int | None = None
    # CUDA: the caching allocator over the process's life (memcheck.cuda.allocator.simulate)
    reserved_peak_phase: Phase | None = None  # Phase.SETUP: loading the weights and batch set it
    reserved_peak_step: int | None = None  # 1-based; steps after the traced ones are replays
    steady_step: int | None = None  # after this step every step leaves the allocator as it found it
    released_cached: bool = False  # near capacity, cached segments went back to the driver to fit
    role: str | None = None  # a layout's rank (memcheck.training.strategies.layout.Role.label): "GPU 0-31\nstage 0"

    @property
    def total_bytes(self) -> int:
        return self.device_total_bytes if self.device_total_bytes is not None else self.peak_bytes

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "breakdown_at_peak": self.breakdown_at_peak.to_dict(),
            "peak_phase": self.peak_phase.value,
            "train_peak_bytes": self.train_peak_bytes,
            "eval_peak_bytes": self.eval_peak_bytes,
            **({"ranks": self.role.replace("\n", ", ")} if self.role is not None else {}),
        }


@dataclass(frozen=True)
class Branch:
    """One trace of the step with one set of answers at the data-dependent choice points."""

    answers: tuple[str, ...]  # the answers at the points that mattered ("no-padding", "routing=balanced")
    total_bytes: int | None  # the busiest GPU's device total (the peak on the CPU target); None when bounded
    peak_bytes: int | None  # its allocated peak; None when bounded
    only_here: tuple[str, ...] = ()  # what this trace assumed and the taken one did not (the kernel it ran)
    # traced to the end of the first forward only: the same kernels, a subset of the reported trace's
    # allocations and no more live bytes, so bounded by it (memcheck.engine.branches._bounded_by)
    bounded: bool = False

    def to_dict(self) -> dict:
        return {"answers": list(self.answers), "total_bytes": self.total_bytes, "peak_bytes": self.peak_bytes,
                "only_here": list(self.only_here), "bounded": self.bounded}


@dataclass(frozen=True)
class Branches:
    """The data-dependent branches traced (``memcheck.choices``): the answers whose trace is
    reported (the larger peak) and every trace, that one first."""

    taken: tuple[str, ...]
    traces: tuple[Branch, ...]
    seconds: float  # tracing the alternatives (after the first trace)

    @property
    def alternatives(self) -> int:
        return len(self.traces) - 1

    def to_dict(self) -> dict:
        return {"taken": list(self.taken), "alternatives_traced": self.alternatives,
                "alternatives_seconds": self.seconds, "traces": [t.to_dict() for t in self.traces]}


@dataclass(frozen=True)
class Estimate:
    """What one training step needs at its steady-state peak, on the target device.

    ``job`` is the job traced (every setting); ``devices`` is what tracing it found on each
    GPU (one entry on the CPU or a single GPU), and the figures below read the busiest
    one; the rest is what the trace resolved: the GPU, the budget, the optimizer
    implementation, the modules checkpointing wrapped.
    """

    model: str
    job: Job
    optimizer: str  # the optimizer implementation traced ("AdamW (foreach)", ...)
    batch: BatchInfo
    devices: tuple[DeviceMemory, ...]  # every GPU, in order (one entry for one GPU or the CPU)
    busiest_gpu: int  # the index in ``devices`` of the GPU whose figures the estimate reports
    assumptions: tuple[str, ...]
    budget_bytes: int | None = None  # the job's budget, else the GPU's capacity; None: no budget
    gpu: GpuSpec | None = None  # the CUDA target, resolved (the local GPU when the job names none)
    checkpointing: tuple[str, ...] = ()  # the modules wrapped in torch.utils.checkpoint
    work: Work | None = None  # the busiest GPU's compute per micro-step, for the planner
    weights_dtype: str = "float32"  # the traced weights' floating dtype (most bytes): "float32", "bfloat16", ...
    module_loading: str | None = None  # CUDA: "lazy" or "eager" module loading, which the context figure assumes
    context_source: str | None = None  # CUDA: where the context figure comes from ("published: ..." / "estimated: ...")
    # estimate(timeline=True): the busiest GPU's memory event by event (--snapshot, --plot); not in to_dict
    timeline: Timeline | None = field(default=None, repr=False, compare=False)
    # the data-dependent branches traced (memcheck.choices); None when no choice point mattered or all were pinned
    branches: Branches | None = None

    @property
    def busiest(self) -> DeviceMemory:
        return self.devices[self.busiest_gpu]

    @property
    def per_device(self) -> tuple[DeviceMemory, ...]:
        """Every GPU's figures under a multi-GPU strategy; () for one GPU or the CPU."""
        return self.devices if self.job.strategy_config.strategy.multi_gpu or self.job.layout else ()

    peak_bytes = property(lambda self: self.busiest.peak_bytes, doc="The steady-state peak (CUDA: allocated).")
    breakdown_at_peak = property(lambda self: self.busiest.breakdown_at_peak, doc="What was live at the peak.")
    peak_phase = property(lambda self: self.busiest.peak_phase)
    peak_module = property(lambda self: self.busiest.peak_module)
    peak_step = property(lambda self: self.busiest.peak_step, doc="1-based.")
    modules = property(lambda self: self.busiest.modules)
    train_peak_bytes = property(lambda self: self.busiest.train_peak_bytes)
    eval_peak_bytes = property(lambda self: self.busiest.eval_peak_bytes, doc="None without an evaluation pass.")
    # CUDA target only (None on the CPU):
    reserved_bytes = property(lambda self: self.busiest.reserved_bytes, doc="max_memory_reserved.")
    fragmentation_bytes = property(lambda self: self.busiest.fragmentation_bytes,
                                   doc="Reserved beyond the allocated peak: cached but unusable.")
    context_bytes = property(lambda self: self.busiest.context_bytes, doc="CUDA context and libraries.")
    device_total_bytes = property(lambda self: self.busiest.device_total_bytes,
                                  doc="Reserved + context: what nvidia-smi shows as used.")
    reserved_peak_phase = property(lambda self: self.busiest.reserved_peak_phase,
                                   doc="Where reserved peaked: Phase.SETUP is loading the weights and batch.")
    reserved_peak_step = property(lambda self: self.busiest.reserved_peak_step, doc="1-based.")
    steady_step = property(lambda self: self.busiest.steady_step,
                           doc="After this step every step leaves the allocator as it found it (None: not seen).")
    released_cached = property(lambda self: self.busiest.released_cached,
                               doc="Near capacity, cached segments went back to the driver so the job fit.")

    @property
    def device(self) -> Device:
        return self.job.device

    @property
    def precision(self) -> Precision:
        return self.job.precision

    @property
    def steps(self) -> int:
        return self.job.steps

    @property
    def accumulate(self) -> int:
        return self.job.accumulate

    @property
    def strategy(self) -> str:
        """The strategy as the report names it: ``single``, ``ddp x4, bucket view``, ``fsdp x8 in dp=8,tp=4``..."""
        label = self.job.strategy_config.label
        return label if self.job.layout is None else f"{label} in {self.job.layout.label}"

    @property
    def gpus(self) -> int:
        return self.job.world

    @property
    def peak_in(self) -> str:
        """``"train"`` or ``"eval"``: which pass sets the peak."""
        if self.eval_peak_bytes is not None and self.eval_peak_bytes > (self.train_peak_bytes or 0):
            return "eval"
        return "train"

    @property
    def total_bytes(self) -> int:
        """The figure judged against the budget: device total on CUDA, the peak on CPU."""
        return self.device_total_bytes if self.device_total_bytes is not None else self.peak_bytes

    @property
    def judgement(self) -> Judgement | None:
        """The job's total against the budget less the job's margin (the one verdict rule);
        None without a budget."""
        if self.budget_bytes is None:
            return None
        return Judgement(self.total_bytes, self.budget_bytes, self.job.effective_margin)

    @property
    def fits(self) -> bool | None:
        """True/False against the budget less the margin, as check and plan judge; None
        when no budget was given."""
        j = self.judgement
        return None if j is None else j.fits

    def to_dict(self) -> dict:
        """The JSON object ``memcheck --json`` prints (README, "JSON")."""
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "job": {**self.job.to_dict(), "gpus": self.gpus},
            "optimizer_implementation": self.optimizer,
            "weights_dtype": self.weights_dtype,
            "gpu": None if self.gpu is None else {
                "name": self.gpu.name,
                "capacity_bytes": self.gpu.capacity_bytes,
                "arch": f"sm{self.gpu.arch[0]}{self.gpu.arch[1]}",
            },
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "margin": None if self.budget_bytes is None else self.job.effective_margin,
            "limit_bytes": None if self.judgement is None else self.judgement.limit_bytes,
            "headroom": None if self.judgement is None else self.judgement.headroom,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "context_bytes": self.context_bytes,
            "cuda_module_loading": self.module_loading,
            "cuda_context_source": self.context_source,
            "device_total_bytes": self.device_total_bytes,
            "reserved_peak": None if self.reserved_peak_phase is None else {
                "phase": self.reserved_peak_phase.value, "step": self.reserved_peak_step},
            "allocator_steady_step": self.steady_step,
            "released_cached": self.released_cached if self.reserved_bytes is not None else None,
            "breakdown_at_peak": self.breakdown_at_peak.to_dict(),
            "peak_phase": self.peak_phase.value,
            "peak_in": self.peak_in,
            "train_peak_bytes": self.train_peak_bytes,
            "eval_peak_bytes": self.eval_peak_bytes,
            "peak_module": self.peak_module,
            "peak_step": self.peak_step,
            "batch": {
                "micro_batch_size": self.batch.batch_size,
                "max_len": self.batch.max_len,
                "target_len": self.batch.target_len,
                "input_shapes": {i.name: list(i.shape) for i in self.batch.inputs},
                "input_dtypes": {i.name: i.dtype for i in self.batch.inputs},
            },
            "strategy_label": self.strategy,
            "busiest_gpu": self.busiest_gpu,
            "per_device": [d.to_dict() for d in self.per_device],
            "checkpointed_modules": list(self.checkpointing),
            "work": None if self.work is None else asdict(self.work),
            "modules": [
                {"name": m.name, "state_bytes": m.state_bytes, "activation_bytes": m.activation_bytes,
                 "saved_bytes": m.saved_bytes}
                for m in self.modules
            ],
            "assumptions": list(self.assumptions),
            "branches": None if self.branches is None else self.branches.to_dict(),
        }

    def __str__(self) -> str:
        from memcheck.report.text import render_estimate

        return render_estimate(self)


@dataclass(frozen=True)
class Comparison:
    """One job under every strategy that applies to ``gpus`` GPUs (``memcheck --compare``)."""

    gpus: int
    rows: tuple[Estimate, ...]

    @property
    def fits(self) -> bool | None:
        """True when some strategy fits its budget; None without a budget."""
        verdicts = [r.fits for r in self.rows if r.fits is not None]
        return any(verdicts) if verdicts else None

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "fits": self.fits, "rows": [r.to_dict() for r in self.rows]}

    def __str__(self) -> str:
        from memcheck.report.text import render_comparison

        return render_comparison(self)


@dataclass(frozen=True)
class PlanOption:
    """One (checkpointing, precision) option the planner traced, at its best micro-batch."""

    micro_batch_size: int
    accumulation_steps: int
    checkpointing: str  # "none", "half" (every second repeated block) or "full"
    precision: str
    predicted_device_total_bytes: int  # the traced device total (the peak on the CPU target)
    fits: bool
    relative_cost: float  # the cost proxy: per optimizer step with a global batch, else per sample
    traces: int  # traces this option took
    largest_fitting_micro_batch: int  # 0 when micro-batch 1 does not fit
    boundary_confirmed: bool  # the size above the largest fitting one was traced and does not fit
    note: str = ""  # why the search stopped early, when it did
    optimizer: str = "adamw"  # the optimizer traced (memcheck.training.optimizers name)
    offload: str = "none"  # "optimizer": DeepSpeed ZeRO-Offload on this one GPU (zero2, optimizer on the CPU)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["relative_cost"] = None if self.relative_cost == float("inf") else self.relative_cost
        out["optimizer"] = optimizer_name(self.optimizer)  # a model file's make_optimizer: its name
        return out


@dataclass(frozen=True)
class ShardedFit:
    """When nothing fits on one GPU: the fewest GPUs of the same size that hold one rank of a
    sharded strategy at micro-batch 1, found by tracing (``memcheck.engine.plan``)."""

    strategy: str  # "fsdp", or "zero3" when a DeepSpeed stage was asked for
    gpus: int | None  # the fewest that fit; None when none up to the search's ceiling did
    device_total_bytes: int | None  # the traced device total of one rank at ``gpus``
    precision: str
    checkpointing: str
    fewer_do_not_fit: bool  # gpus - 1 was traced (or is one GPU) and does not fit
    traced: tuple[tuple[int, int], ...]  # (gpus, traced device total per GPU), for every count traced
    limit_bytes: int = 0  # the per-GPU limit judged against
    most_not_fitting: int = 1  # the most GPUs known not to fit
    unsharded_bytes: int = 0  # the search's last reading of what does not shard (per GPU)
    stopped_after_traces: int = 0  # when no count fitted before the search ran out of its traces: how many

    def to_dict(self) -> dict:
        out = asdict(self)
        out["micro_batch_size"] = 1
        out["traced"] = [{"gpus": n, "device_total_bytes": b} for n, b in self.traced]
        return out


@dataclass(frozen=True)
class LargerGpu:
    """The smallest GPU in the table that holds the job's most frugal option, as traced on it."""

    name: str
    capacity_bytes: int
    device_total_bytes: int


@dataclass(frozen=True)
class Suggestion:
    """When nothing fits: what would, each answer traced (``str()`` is the sentence the plan prints)."""

    precision: str  # the most frugal option tried, at micro-batch 1
    checkpointing: str
    searched: bool  # GPUs were searched (the CUDA target); on the CPU there is nothing to suggest
    strategy: str  # the job's strategy and GPUs, which a larger GPU keeps
    gpus: int
    larger_gpu: LargerGpu | None = None  # None: no single GPU in the table holds it
    sharded: ShardedFit | None = None
    global_batch: int | None = None

    def __str__(self) -> str:
        from memcheck.report.text import render_suggestion

        return render_suggestion(self)


@dataclass(frozen=True)
class LengthPoint:
    """The traced device total at one padded length (the length profile)."""

    length: int
    predicted_device_total_bytes: int
    fits: bool


@dataclass(frozen=True)
class Plan:
    """What to run so the job fits: ``memcheck plan``'s result."""

    model: str
    device: Device
    gpu: GpuSpec | None
    capacity_bytes: int
    margin: float  # the fraction of the capacity held back
    limit_bytes: int  # capacity * (1 - margin): the recommended device total stays at or below it
    strategy: str
    gpus: int
    global_batch: int | None
    recommended: PlanOption | None  # None when nothing fits
    alternatives: tuple[PlanOption, ...]
    length_profile: tuple[LengthPoint, ...]
    longest_fitting_length: int | None  # at the recommended micro-batch
    max_len: int | None
    traces: int  # every trace the plan took
    estimate: Estimate | None  # the recommended configuration's own trace
    suggestion: Suggestion | None = None  # when nothing fits: what would
    sharded: ShardedFit | None = None  # when nothing fits on the CUDA target: how many GPUs fsdp/zero3 need
    blocks: tuple[str, ...] = ()  # the repeated blocks "full" checkpoints ("half": every second)
    position_limit: int | None = None  # the longest length the model's position embeddings take
    verification: "Verification | None" = None  # --measure: the recommendation run for real
    job: Job | None = None  # the recommended job, exactly as traced (estimate(model, batch, plan.job))
    branches_note: str = ""  # the data-dependent answers the search pinned after its first trace with a choice
    not_traced: tuple[str, ...] = ()  # options the search skipped without tracing, and why

    @property
    def fits(self) -> bool:
        return self.recommended is not None

    @property
    def margin_bytes(self) -> int:
        return self.capacity_bytes - self.limit_bytes

    def judgement_of(self, total_bytes: int) -> Judgement:
        """A total judged by the one verdict rule against this plan's capacity and margin."""
        return Judgement(total_bytes, self.capacity_bytes, self.margin)

    @property
    def effective_global_batch(self) -> int | None:
        r = self.recommended
        return None if r is None else r.micro_batch_size * r.accumulation_steps * self.gpus

    def to_dict(self) -> dict:
        r = self.recommended
        plan = {
            "micro_batch_size": r.micro_batch_size if r else None,
            "accumulation_steps": r.accumulation_steps if r else None,
            "checkpointing": r.checkpointing if r else None,
            "checkpointed_modules": list(self.checkpointed_modules),
            "precision": r.precision if r else None,
            "optimizer": optimizer_name(r.optimizer) if r else None,
            "offload": r.offload if r else None,
            "predicted_device_total_bytes": r.predicted_device_total_bytes if r else None,
            "capacity_bytes": self.capacity_bytes,
            "margin": self.margin,
            "margin_bytes": self.margin_bytes,
            "limit_bytes": self.limit_bytes,
            "global_batch": self.global_batch,
            "effective_global_batch": self.effective_global_batch,
            "strategy": self.strategy,
            "gpus": self.gpus,
            "traces": self.traces,
            "fits": self.fits,
            "suggestion": None if self.suggestion is None else str(self.suggestion),
            "sharded": None if self.sharded is None else self.sharded.to_dict(),
            "alternatives": [o.to_dict() for o in self.alternatives],
            "length_profile": [asdict(p) for p in self.length_profile],
            "longest_fitting_length": self.longest_fitting_length,
            "verification": None if self.verification is None else self.verification.to_dict(),
            "branches_note": self.branches_note or None,
            "not_traced": list(self.not_traced),
        }
        return {"schema_version": SCHEMA_VERSION, "plan": plan,
                "job": None if self.job is None else {**self.job.to_dict(), "gpus": self.gpus},
                "estimate": None if self.estimate is None else self.estimate.to_dict()}

    @property
    def checkpointed_modules(self) -> tuple[str, ...]:
        r = self.recommended
        if r is None or r.checkpointing == "none":
            return ()
        return self.blocks if r.checkpointing == "full" else half_of(self.blocks)

    def __str__(self) -> str:
        from memcheck.report.text import render_plan

        return render_plan(self)


@dataclass(frozen=True)
class Verification:
    """The recommended configuration run for real (``--measure``)."""

    device: str  # "cuda" or "cpu"
    steps: int  # optimizer steps run (fewer when it ran out of memory)
    predicted_bytes: int  # the plan's device total (the peak on CPU)
    measured_bytes: int | None  # the driver's used memory on CUDA, the profiler's peak on CPU
    peak_allocated_bytes: int | None  # max_memory_allocated (CUDA)
    peak_reserved_bytes: int | None  # max_memory_reserved (CUDA)
    out_of_memory: bool
    error: str | None = None  # the OOM's first line

    @property
    def error_fraction(self) -> float | None:
        if not self.measured_bytes:
            return None
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "error_fraction": self.error_fraction}


@dataclass(frozen=True)
class EvalFix:
    """When training fits and the evaluation pass does not: an evaluation that fits."""

    eval_batch_size: int
    eval_accumulate_predictions: int  # evaluation batches whose predictions stay on the device
    predicted_device_total_bytes: int  # traced at exactly these settings (the peak on CPU)


@dataclass(frozen=True)
class Verdict:
    """``memcheck.check``'s result: the job's estimate judged against the capacity minus the margin."""

    estimate: Estimate
    capacity_bytes: int
    margin: float  # the fraction of the capacity held back
    limit_bytes: int  # capacity * (1 - margin)
    fix: "Plan | None" = None  # for a job over the limit: the plan at the job's own global batch
    eval_fix: EvalFix | None = None  # for a job whose evaluation pass alone is over the limit

    @property
    def judgement(self) -> Judgement:
        """The one verdict rule, as estimate applies it (``Judgement``)."""
        return Judgement(self.estimate.total_bytes, self.capacity_bytes, self.margin)

    @property
    def fits(self) -> bool:
        return self.judgement.fits

    @property
    def margin_bytes(self) -> int:
        return self.capacity_bytes - self.limit_bytes

    def __str__(self) -> str:
        from memcheck.report.text import render_verdict

        return render_verdict(self)

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "total_bytes": self.estimate.total_bytes,
            "capacity_bytes": self.capacity_bytes,
            "margin": self.margin,
            "limit_bytes": self.limit_bytes,
            "headroom": self.judgement.headroom,
            "fix": None if self.fix is None else self.fix.to_dict()["plan"],
            "eval_fix": None if self.eval_fix is None else asdict(self.eval_fix),
            "estimate": self.estimate.to_dict(),
        }


@dataclass(frozen=True)
class LayoutCandidate:
    """One layout the layout planner ranked (``memcheck.engine.plan_layout``), and what became of it."""

    layout: str  # "dp=8,tp=8", as --layout takes it
    micro_batch_size: int
    microbatches: int  # micro-batches per optimizer step and data-parallel replica (pipeline / accumulation)
    checkpointing: str
    relative_cost: float  # the cost proxy, relative seconds per optimizer step
    fits: bool
    device_total_bytes: int | None  # traced: the busiest rank's device total (the peak on the CPU target)
    predicted_bytes: int | None  # from one-block probes, when that is why it was not traced
    status: str  # "fits", "traced: does not fit", "not traced: ..."

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayoutPlan:
    """What layout of ``gpus`` GPUs to run so every rank fits: ``memcheck plan --gpus N``'s result."""

    model: str
    gpu: GpuSpec | None
    capacity_bytes: int
    margin: float
    limit_bytes: int
    gpus: int
    gpus_per_node: int
    global_batch: int
    max_len: int
    recommended: LayoutCandidate | None
    considered: tuple[LayoutCandidate, ...]  # in cost order, up to and including the recommendation
    traces: int
    estimate: Estimate | None  # the recommendation's own trace: one column per pipeline rank
    job: Job | None  # the recommended job, exactly as traced
    seconds: float
    candidates: int  # layouts ranked in all
    refusals: tuple[str, ...] = ()  # kinds of layout the model cannot be cut into, with the reason (skipped)

    @property
    def fits(self) -> bool:
        return self.recommended is not None

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "gpu": None if self.gpu is None else self.gpu.name,
            "capacity_bytes": self.capacity_bytes,
            "margin": self.margin,
            "limit_bytes": self.limit_bytes,
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "global_batch": self.global_batch,
            "max_len": self.max_len,
            "fits": self.fits,
            "recommended": None if self.recommended is None else self.recommended.to_dict(),
            "job": None if self.job is None else self.job.to_dict(),
            "per_rank": [d.to_dict() for d in self.estimate.devices] if self.estimate is not None else [],
            "considered": [c.to_dict() for c in self.considered],
            "candidates": self.candidates,
            "not_possible": list(self.refusals),
            "traces": self.traces,
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        from memcheck.report.text import render_layout_plan

        return render_layout_plan(self)
