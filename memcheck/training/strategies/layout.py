"""A multi-dimensional layout of ranks (``--layout dp=8,tp=4,pp=2``) and the distinct rank roles it has.

The degrees follow torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``):
the world is ``dp_replicate * dp * cp * tp * pp`` ranks; ``dp`` is the data-parallel
degree the ``strategy`` runs over (``fsdp``: parameters sharded over ``dp * cp`` ranks, as
torchtitan's ``dp_shard_cp`` mesh; ``ddp``: gradients all-reduced over them);
``dp_replicate`` replicates that group (HSDP when the strategy is ``fsdp``); ``ep`` borrows its
ranks from ``dp * cp`` (it divides them, it does not multiply the world), as torchtitan's
expert parallelism does. ``schedule`` is the pipeline schedule of ``pp`` (torch's
``torch.distributed.pipelining``) and ``virtual`` the stages a rank holds under the
interleaved schedules; ``sp`` turns on sequence parallelism with ``tp``.

Every rank of a ``dp``/``tp``/``cp``/``ep`` group holds the same shapes, so one rank is traced
for all of them; pipeline stages differ (the first holds the embedding, the last the head and
the loss, and the schedules keep different numbers of micro-batches alive per stage): a role
is one pipeline rank, traced on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from memcheck.enums import Schedule
from memcheck.errors import UsageError, closest


# The degrees a layout names, in the order its label writes them (torchtitan's mesh order).
DEGREES = ("dp_replicate", "dp", "cp", "tp", "pp", "ep")
_KEYS = (*DEGREES, "schedule", "virtual", "sp", "loss_parallel")
MAX_DEGREE = 65536  # as memcheck.job.MAX_GPUS


@dataclass(frozen=True)
class Layout:
    """The degrees of each kind of parallelism, validated; 1 is "not used"."""

    dp_replicate: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual: int = 1  # pipeline stages per rank (interleaved-1f1b, zero-bubble)
    sp: bool = False  # sequence parallelism with tp
    # torchtitan's loss parallelism with tp (``parallelism.disable_loss_parallel = false``, its default):
    # the LM head's logits stay sharded by vocabulary, the cross-entropy runs on the shards
    loss_parallel: bool = False

    def __post_init__(self):
        for name in (*DEGREES, "virtual"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEGREE:
                raise UsageError(f"layout: {name} must be an integer from 1 to {MAX_DEGREE:,}, got {value!r}")
        object.__setattr__(self, "schedule", Schedule.parse(self.schedule, what="pipeline schedule"))
        for flag in ("sp", "loss_parallel"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"layout: {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.world > MAX_DEGREE:
            raise UsageError(f"layout {self.label} is {self.world:,} GPUs; at most {MAX_DEGREE:,}")
        if (self.dp * self.cp) % self.ep:
            raise UsageError(f"layout: ep={self.ep} must divide dp*cp={self.dp * self.cp} (expert parallelism "
                             "borrows its ranks from the data- and context-parallel ones, as torchtitan's does)")
        if self.sp and self.tp == 1:
            raise UsageError("layout: sp (sequence parallelism) needs tp > 1")
        if self.loss_parallel and self.tp == 1:
            raise UsageError("layout: loss_parallel shards the logits over the tensor-parallel ranks and needs tp > 1")
        interleaved = self.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)
        if self.pp == 1 and (self.virtual != 1 or self.schedule is not Schedule.ONE_F_ONE_B):
            raise UsageError("layout: schedule and virtual apply to pipeline parallelism; give pp > 1")
        if self.virtual != 1 and not interleaved:
            raise UsageError(f"layout: virtual={self.virtual} stages per rank need an interleaved schedule "
                             f"(interleaved-1f1b or zero-bubble), not {self.schedule.value}")

    @classmethod
    def parse(cls, text) -> "Layout":
        """``"dp=8,tp=4,pp=2"`` (any order; ``schedule=``, ``virtual=``, ``sp=true`` too), a mapping, or a Layout."""
        if isinstance(text, Layout):
            return text
        if isinstance(text, dict):
            items = list(text.items())
        elif isinstance(text, str):
            items = []
            for part in filter(None, (p.strip() for p in text.split(","))):
                key, eq, value = part.partition("=")
                if not eq:
                    raise UsageError(f"layout: {part!r} is not KEY=VALUE (write e.g. 'dp=8,tp=4,pp=2')")
                items.append((key.strip().lower(), value.strip()))
            if not items:
                raise UsageError("layout is empty; write e.g. 'dp=8,tp=4,pp=2'")
        else:
            raise UsageError(f"layout must be a string such as 'dp=8,tp=4,pp=2' or a table, got {text!r}")
        values: dict = {}
        for key, value in items:
            key = str(key).lower().replace("-", "_")
            if key not in _KEYS:
                raise UsageError(f"layout: unknown key {key!r}{closest(key, _KEYS)}; allowed: {', '.join(_KEYS)}")
            if key in values:
                raise UsageError(f"layout: {key} is given twice")
            values[key] = _value(key, value)
        return cls(**values)

    @property
    def world(self) -> int:
        """GPUs in all."""
        return self.dp_replicate * self.dp * self.cp * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """Data-parallel replicas of the model: how many micro-batches one step of all GPUs takes in."""
        return self.dp_replicate * self.dp

    @property
    def sharded_over(self) -> int:
        """The ranks the strategy (fsdp, ddp, zero) runs over: ``dp * cp``."""
        return self.dp * self.cp

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp * virtual``)."""
        return self.pp * self.virtual

    @property
    def is_trivial(self) -> bool:
        return self.world == 1 and self.ep == 1

    @property
    def label(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in DEGREES if getattr(self, name) != 1] or ["dp=1"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule.value}")
        if self.virtual > 1:
            parts.append(f"virtual={self.virtual}")
        if self.sp:
            parts.append("sp=true")
        if self.loss_parallel:
            parts.append("loss_parallel=true")
        return ",".join(parts)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["schedule"] = self.schedule.value
        return out

    def __str__(self) -> str:
        return self.label


def _value(key: str, value):
    if key == "schedule":
        return value
    if key in ("sp", "loss_parallel"):
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"layout: {key} must be true or false, got {value!r}")
    if isinstance(value, str):
        text = value.replace("_", "")
        if not text.isdigit():
            raise UsageError(f"layout: {key} must be a positive integer, got {value!r}")
        return int(text)
    return value


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Role:
    """One distinct kind of rank in a layout: a pipeline rank (every rank, without ``pp``).

    ``view`` cuts a meta model and batch to what this rank holds and computes, in this order:
    its experts (``ep``), its tensor-parallel shards (``tp``), its pipeline stage (``pp``)
    and its share of the sequence (``cp``); ``train_step`` is its pipeline schedule.
    """

    layout: Layout
    stage: int = 0  # the pipeline rank
    through: int | None = None  # the last pipeline rank this one's figures stand for (module docstring)
    tp_plan: tuple[tuple[str, str], ...] | None = None  # the job's tensor-parallel plan; None: the model's

    @property
    def ranks(self) -> tuple[int, int]:
        """The first and last global rank of this role (pp is the outermost mesh dimension, as in torchtitan)."""
        per_stage = self.layout.world // self.layout.pp
        last = self.stage if self.through is None else self.through
        return self.stage * per_stage, (last + 1) * per_stage - 1

    @property
    def label(self) -> str:
        first, last = self.ranks
        gpus = f"GPU {first}" if first == last else f"GPU {first}-{last}"
        if self.layout.pp == 1:
            return gpus
        if self.through is not None:
            return f"{gpus}\nstages {self.stage}-{self.through}"
        return f"{gpus}\nstage {self.stage}"

    def view(self, model, batch, device: str = "cuda") -> tuple[object, object, list[str], object]:
        """``model`` (on meta, changed in place) and ``batch`` as this rank holds them, notes for the
        report, and a factory of the context the rank's steps run in (``cp``'s ring attention) or None."""
        layout, notes = self.layout, []
        context = None
        if layout.ep > 1:
            from memcheck.training.strategies import ep

            ep.shard_experts(model, layout.ep)
            model.memcheck_expert_parallel = layout.ep  # fsdp shards the experts over dp*cp / ep ranks
        if layout.tp > 1:
            from memcheck.training.strategies import tp

            plan, experts = (dict(self.tp_plan) if self.tp_plan else tp.default_plan(model)), []
            if plan is not None:  # MoE experts: sharded by ep, not by tp (torchtitan's default, no ETP)
                experts = [k for k in plan if ".experts" in k]
                plan = {k: v for k, v in plan.items() if k not in experts} or None
            rank = tp.shard(model, layout.tp, plan=plan, sequence_parallel=layout.sp,
                            backend="gloo" if device == "cpu" else "nccl",  # CPU ranks talk through gloo
                            loss_parallel=layout.loss_parallel)
            embeddings = "".join(f", {name} {style}" for name, style in rank.embeddings)
            notes.append(f"tp={layout.tp}: {len(rank.colwise)} linear layers column-wise, {len(rank.rowwise)} "
                         f"row-wise{embeddings} (transformers' plan styles on DTensor); the rest replicated"
                         + ("; the vocabulary-parallel embedding's gradient is the whole vocabulary's on every "
                            "rank (DTensor's embedding backward)" if any(
                                style == tp.EMBEDDING_ROWWISE for _, style in rank.embeddings) else "")
                         + ("; sequence parallel: norms and residual at S/tp tokens, block inputs all-gathered, "
                            "row-wise outputs reduce-scattered" if layout.sp else "")
                         + ("; MoE experts are not tensor-parallel (ep shards them)" if experts else "")
                         + ("; loss parallel: the LM head's logits stay sharded by vocabulary and the "
                            "cross-entropy runs on the shards (torch's loss_parallel)" if layout.loss_parallel else ""))
            if layout.loss_parallel:
                context = tp.loss_parallel_context(model)
        if layout.pp > 1:
            from memcheck.training.strategies import pp

            pp.make_stage(model, self.stage, layout.pp, virtual=layout.virtual,
                          sequence_shards=layout.tp if layout.sp else 1)
            notes.append(f"pp={layout.pp}: stage {self.stage} of {layout.pp}, schedule {layout.schedule.value}; "
                         "accumulate is the pipeline's micro-batches per step")
            if self.through is not None:
                notes.append(f"pp={layout.pp}: stages {self.stage + 1}-{self.through} are not traced: they hold no "
                             f"more blocks and, under 1F1B, fewer micro-batches at once than stage {self.stage}, "
                             "whose figures stand for them")
        if layout.cp > 1:
            from memcheck.training.strategies import cp

            length = cp.sequence_length(batch, 1)
            batch = cp.shard_sequence(batch, layout.cp, seq_len=length)
            kernel = "cuda-flash" if device == "cuda" else "cpu-flash"
            if context is not None:
                raise UsageError("layout: loss_parallel with cp is not modelled; drop one of them")
            context = lambda: cp.cp_attention(layout.cp, seq_len=length, rank=0, kernel=kernel)  # noqa: E731
            notes.append(f"cp={layout.cp}: {length // layout.cp} of the {length} tokens a rank "
                         f"({'load-balanced head and tail chunks' if cp.load_balanced(length, layout.cp) else 'one chunk'}"
                         f"), ring attention as torch's context_parallel runs it (keys and values all-gathered, "
                         f"{kernel.replace('-', ' ')} kernel), causal attention with no mask")
        return model, batch, notes, context

    def train_step(self, job):
        """The pipeline schedule's step for this rank; None without ``pp`` (memcheck's own loop).

        Under 1F1B the step is traced with ``min(M, 2 * pp)`` micro-batches: rank r holds at most
        ``pp - r`` at once (its warm-up), and by the second round of forwards every reference the
        schedule keeps (the sends it still waits on) is as it will be for the rest of the step, so
        later micro-batches repeat traced ones (checked against the whole step at pp=4, M=12: equal
        but for the 4-byte losses); the receive buffers are still one per micro-batch of the real
        step (``M``). GPipe and the interleaved schedules are traced with all ``M``."""
        if self.layout.pp == 1:
            return None
        from memcheck.training.strategies import pp

        m = job.accumulate
        traced = min(m, 2 * self.layout.pp) if self.layout.schedule is Schedule.ONE_F_ONE_B else m
        dtype = job.precision.autocast_dtype
        autocast = None
        if dtype is not None:
            import torch

            device = job.device.value

            def autocast():
                return torch.autocast(device, dtype=dtype)
        return pp.train_step(self.layout.schedule.value, self.stage, self.layout.pp, traced, buffers=m,
                             autocast=autocast)


def roles(layout: Layout, tp_plan=None) -> list[Role]:
    """The ranks of ``layout`` traced: one per pipeline rank up to 3 stages; beyond that the first,
    the second (standing for every middle stage) and the last.

    The middle stages hold the same blocks as the second or one fewer (the first stages take the
    blocks that do not divide evenly), the same receive buffers, and under 1F1B fewer micro-batches
    at once (``pp - s``; under GPipe all ``M`` on every stage): the second stage's figures bound
    theirs."""
    p = layout.pp
    if p <= 3:
        return [Role(layout, stage, tp_plan=tp_plan) for stage in range(p)]
    return [Role(layout, 0, tp_plan=tp_plan), Role(layout, 1, through=p - 2, tp_plan=tp_plan),
            Role(layout, p - 1, tp_plan=tp_plan)]
