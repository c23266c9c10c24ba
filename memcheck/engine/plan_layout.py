"""``plan_layout()``: the layout of N GPUs (data, tensor, pipeline and context parallel degrees),
micro-batch and checkpointing that fits every rank and runs fastest.

The search, for ``gpus`` GPUs in nodes of ``gpus_per_node``:

1. **Candidates.** Every ``tp`` dividing ``gpus_per_node`` (tensor parallelism stays inside a
   node, on NVLink) that the model's tensor-parallel plan takes, every ``pp`` up to the number
   of repeated blocks, ``cp`` of 1, 2, 4 and 8 where the length allows it, and ``dp`` the rest;
   FSDP2 over ``dp * cp`` (torchtitan's composition); each micro-batch ``m`` dividing the
   data-parallel share of the global batch, the pipeline taking ``M = G / (dp * m)``
   micro-batches a step (at least ``pp`` of them); checkpointing ``none`` or ``full``;
   schedule 1F1B.
2. **Ranked by a cost proxy** (relative seconds per optimizer step on one rank, every rank in
   lock-step): the step's FLOPs over all GPUs' tensor-core rate (checkpointing recomputes one
   forward: x4/3), times the pipeline bubble ``(M + pp - 1) / M``, plus the tensor-parallel
   all-reduces (4 a block and micro-batch, 6 with recomputation, of ``m * S/cp * hidden``
   activations, ring: ``2 (tp - 1) / tp`` of them over NVLink), plus the context-parallel
   key/value all-gathers, plus FSDP's all-gathers and reduce-scatter where they exceed the
   compute they overlap. The link rates are estimates (``NVLINK_BYTES_PER_SECOND``,
   ``NETWORK_BYTES_PER_SECOND``); the proxy ranks layouts, it does not predict seconds.
3. **Pruned without tracing** when the rank's weights, gradients and optimizer state alone
   (parameters counted exactly per stage and shard) pass the limit, or when a prediction from
   two one-block probe traces (the first and last stage of a one-block pipeline at the
   candidate's ``tp``, ``cp``, micro-batch and checkpointing, each block's own saved
   activations and state scaled to the stage's blocks and live micro-batches) passes it by
   more than ``PREDICTION_SLACK``.
4. **Traced in cost order**: the first candidate whose every pipeline rank, traced
   (``estimate`` with the layout), stays under ``capacity * (1 - margin)`` is recommended;
   every figure reported comes from that trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from memcheck.engine.estimate import _estimate_rank, estimate, target_gpu
from memcheck.enums import Precision, Schedule
from memcheck.errors import UsageError, require_int
from memcheck.job import Job, as_job, limit_bytes
from memcheck.report.results import LayoutCandidate, LayoutPlan
from memcheck.cuda.gpus import rates_for
from memcheck.trace.device_redirect import tracing_globals
from memcheck.training.checkpointing import FULL, NONE, repeated_blocks
from memcheck.training.strategies.layout import Layout, Role, divisors

NVLINK_BYTES_PER_SECOND = 450e9  # NVLink 4 (H100 SXM), one direction per GPU; an estimate for others
NETWORK_BYTES_PER_SECOND = 50e9  # 400 Gb/s InfiniBand per GPU; estimate
# A candidate predicted above limit * 1.25 is not traced: the probes' prediction is a screen (on
# Llama-3-70B at 8192 tokens on 64 H100s: +3.2% and +4.3% of the traced device total for the two
# candidates the search traced); what is reported is traced.
PREDICTION_SLACK = 0.25
MAX_FULL_TRACES = 8  # candidates traced in full before the search gives up
CP_DEGREES = (1, 2, 4, 8)
MIN_CP_TOKENS = 4096  # context parallelism is searched only where each rank keeps at least this many tokens
PROBE_BLOCKS = 3  # the probes' model keeps three blocks: a first, a middle and a last stage of one block each


@tracing_globals()
def plan_layout(
    model: torch.nn.Module,
    make_batch: Callable[[int], Any],
    job: Job | None = None,
    *,
    gpus: int | None = None,
    gpus_per_node: int | None = None,
    layout: Layout | str | None = None,
    checkpointing_options=(NONE, FULL),
    loss_fn=None,
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    **settings,
) -> LayoutPlan:
    """The layout of ``gpus`` GPUs that fits every rank and has the lowest cost proxy; with ``layout``
    (or the job's), that layout's micro-batch and checkpointing.

    ``job`` needs ``global_batch``, ``max_len`` and the GPU; its precision and optimizer are
    used as they are; its strategy is FSDP2 over each layout's ``dp * cp`` ranks.
    ``make_batch(m)`` is one micro-batch of ``m`` rows padded to ``max_len``.
    """
    job = as_job(job, settings, caller="plan_layout()")
    start = time.perf_counter()
    fixed = Layout.parse(layout) if layout is not None else job.layout
    job = job.replace(layout=None, gpus=None)
    if fixed is not None:
        if gpus is not None and gpus != fixed.world:
            raise UsageError(f"gpus={gpus} differs from layout {fixed.label}, which is {fixed.world:,} GPUs")
        gpus = fixed.world
    world = gpus
    if not isinstance(world, int) or isinstance(world, bool) or world < 2:
        raise UsageError("a layout plan needs the GPUs to spread over: give gpus (--gpus N, at least 2)")
    node = gpus_per_node if gpus_per_node is not None else min(world, 8)
    require_int(node, "gpus_per_node")
    if world % node and node < world:
        raise UsageError(f"gpus={world} is not a whole number of nodes of gpus_per_node={node}")
    if job.global_batch is None:
        raise UsageError("a layout plan needs the global batch (--global-batch): the samples every optimizer "
                         "step takes in over all GPUs")
    if job.max_len is None:
        raise UsageError("a layout plan needs the sequence length (--max-len)")
    target = target_gpu(job)
    capacity = job.budget_bytes if job.budget_bytes is not None else (target.capacity_bytes if target else None)
    if capacity is None:
        raise UsageError("a layout plan needs a capacity: name the GPU (--gpu H100-80GB) or give --gpu-memory")
    limit = limit_bytes(capacity, job.effective_margin)
    name = model_name or type(model).__name__
    blocks = repeated_blocks(model)
    if not blocks:
        raise UsageError(f"{name} has no repeated blocks, so it has no pipeline stages or tensor-parallel blocks "
                         "to lay out; plan it with a strategy (--strategy fsdp --gpus N)")
    shape = _Shape.of(model, blocks, job)
    base = job.replace(strategy="single", global_batch=None)
    search = _Search(model, make_batch, base, shape, target, limit, name, loss_fn, progress, world, node)
    candidates = search.candidates(checkpointing_options, fixed)
    if not candidates:
        raise UsageError(f"no layout of {world} GPUs applies to {name} with global batch {job.global_batch}: the "
                         "data-parallel degree must divide the global batch, a pipeline needs at least as many "
                         "micro-batches as stages, and tensor parallelism needs the model's plan"
                         + (f" ({search.tp_refusal})" if search.tp_refusal else ""))
    chosen, considered, est = search.run(candidates)
    recommended = considered[-1] if chosen is not None else None
    return LayoutPlan(
        model=name, gpu=target, capacity_bytes=capacity, margin=job.effective_margin, limit_bytes=limit,
        gpus=world, gpus_per_node=node, global_batch=job.global_batch, max_len=job.max_len,
        recommended=recommended, considered=tuple(considered), traces=search.traces, estimate=est,
        job=None if chosen is None else search.job_for(chosen),
        seconds=round(time.perf_counter() - start, 2), candidates=len(candidates), refusals=tuple(search.refusals),
    )


@dataclass(frozen=True)
class _Shape:
    """What the cost proxy and the state bound read of the model."""

    blocks: int
    block_params: int  # one repeated block's parameters
    other_params: int  # the rest (embeddings, final norm, head)
    hidden: int
    kv_hidden: int  # key/value width (grouped-query attention)
    layers_flops_per_token: float  # 6 x parameters in blocks and head (forward and backward), per token
    attention_flops_per_token: float  # causal attention's score and value matmuls, forward and backward
    global_batch: int  # samples per optimizer step
    length: int
    first_block: str  # the first repeated block's qualified name

    @classmethod
    def of(cls, model, blocks: list[str], job: Job) -> "_Shape":
        modules = dict(model.named_modules())
        block = modules[blocks[0]]
        block_params = sum(p.numel() for p in block.parameters())
        total = sum(p.numel() for p in model.parameters())
        config = getattr(model, "config", None)
        hidden = getattr(config, "hidden_size", None) or _widest_linear(block)
        heads = getattr(config, "num_attention_heads", None) or 1
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        length = job.max_len
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        embed_params = embed.weight.numel() if embed is not None and hasattr(embed, "weight") else 0
        dense = total - embed_params  # lookups are not matmuls
        attention = 6 * len(blocks) * heads * head_dim * length  # QK^T and AV, fwd+bwd (x3), causal half of 2*2*S
        return cls(len(blocks), block_params, total - block_params * len(blocks), hidden, kv_heads * head_dim,
                   6.0 * dense, float(attention), job.global_batch, length, blocks[0])

    @property
    def tokens(self) -> int:
        """The global batch's tokens per step."""
        return self.global_batch * self.length


def _widest_linear(module) -> int:
    return max((m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear)), default=1)


@dataclass(frozen=True)
class _Candidate:
    layout: Layout
    micro: int
    microbatches: int  # per optimizer step and data-parallel replica
    checkpointing: str
    cost: float


class _Search:
    def __init__(self, model, make_batch, base: Job, shape: _Shape, target, limit: int, name: str, loss_fn,
                 progress, world: int, node: int):
        self.model, self.make_batch, self.base, self.shape = model, make_batch, base, shape
        self.target, self.limit, self.name, self.loss_fn, self.progress = target, limit, name, loss_fn, progress
        self.world, self.node = world, node
        self.rates = rates_for(target)
        self.traces = 0
        self._tp_ok: dict[int, str | None] = {}
        self._probes: dict[tuple, tuple[int, int, int, int] | None] = {}
        self.assume: tuple[str, ...] = tuple(base.assume)
        self.refusals: list[str] = []  # layouts the model cannot be cut into, and why
        self._probe_model: torch.nn.Module | None = None
        self._batches: dict[int, Any] = {}

    # ---- candidates and their cost -------------------------------------------------------------
    def candidates(self, checkpointing_options, fixed: Layout | None = None) -> list[_Candidate]:
        """Every layout the module docstring names (or only ``fixed``'s degrees), each micro-batch and
        checkpointing, cheapest first."""
        layouts = [fixed] if fixed is not None else self._layouts()
        out = []
        for layout in layouts:
            if self.shape.global_batch % layout.data_parallel:
                continue
            share = self.shape.global_batch // layout.data_parallel
            for micro in divisors(share):
                m_count = share // micro
                if layout.pp > 1 and m_count < layout.pp:
                    continue
                for ckpt in checkpointing_options:
                    out.append(_Candidate(layout, micro, m_count, ckpt, self.cost(layout, micro, m_count, ckpt)))
        out.sort(key=lambda c: (c.cost, c.layout.tp, c.layout.pp, c.layout.cp, -c.micro))
        return out

    def _layouts(self) -> list[Layout]:
        s, world, node = self.shape, self.world, self.node
        out = []
        for tp in divisors(min(node, world)):
            if world % tp or self._tp_refused(tp):
                continue
            for pp in divisors(world // tp):
                if pp > s.blocks:
                    continue
                for cp in CP_DEGREES:
                    rest = world // tp // pp
                    if rest % cp or s.length % (2 * cp) or (cp > 1 and s.length // cp < MIN_CP_TOKENS):
                        continue
                    out.append(Layout(dp=rest // cp, cp=cp, tp=tp, pp=pp))
        return out

    def cost(self, layout: Layout, micro: int, microbatches: int, ckpt: str) -> float:
        """The cost proxy of one optimizer step (module docstring), relative seconds."""
        s, r = self.shape, self.rates
        recompute = 4 / 3 if ckpt == FULL else 1.0
        flops = s.tokens * (s.layers_flops_per_token + s.attention_flops_per_token) * recompute
        compute = flops / (self.world * r.tensor_flops)
        if layout.pp > 1:
            compute *= (microbatches + layout.pp - 1) / microbatches
        tokens = micro * s.length // layout.cp  # a micro-batch's tokens on one rank
        blocks = -(-s.blocks // layout.pp)
        comm = 0.0
        if layout.tp > 1:
            per = 2 * (layout.tp - 1) / layout.tp * tokens * s.hidden * 2  # ring all-reduce of bf16 activations
            comm += blocks * microbatches * (6 if ckpt == FULL else 4) * per / NVLINK_BYTES_PER_SECOND
        if layout.cp > 1:
            link = NVLINK_BYTES_PER_SECOND if layout.tp * layout.cp <= self.node else NETWORK_BYTES_PER_SECOND
            per = (layout.cp - 1) * tokens * s.kv_hidden * 2 * 2  # keys and values gathered, bf16
            comm += blocks * microbatches * (3 if ckpt == FULL else 2) * per / link
        if layout.pp > 1:
            link = NETWORK_BYTES_PER_SECOND if self.world // layout.pp >= self.node else NVLINK_BYTES_PER_SECOND
            comm += 2 * microbatches * tokens * s.hidden * 2 / link
        group = layout.sharded_over
        if group > 1:
            params = (s.block_params * blocks + s.other_params) / layout.tp
            link = NETWORK_BYTES_PER_SECOND if self.world > self.node else NVLINK_BYTES_PER_SECOND
            fsdp = 3 * params * 4 * (group - 1) / group / link  # all-gather twice, reduce-scatter once, fp32
            comm += max(0.0, fsdp - compute)  # overlapped with compute where it can be
        return compute + comm

    @property
    def tp_refusal(self) -> str | None:
        return next((why for why in self._tp_ok.values() if why), None)

    def _tp_refused(self, tp: int) -> str | None:
        if tp == 1:
            return None
        if tp not in self._tp_ok:
            from memcheck.engine.setup import meta_twin
            from memcheck.training.strategies import tp as tensor_parallel

            try:
                tensor_parallel.shard(meta_twin(self.model), tp)
                self._tp_ok[tp] = None
            except UsageError as exc:
                self._tp_ok[tp] = str(exc)
        return self._tp_ok[tp]

    # ---- tracing -----------------------------------------------------------------------------
    def job_for(self, c: _Candidate) -> Job:
        return self.base.replace(layout=c.layout, batch_size=c.micro, accumulate=c.microbatches,
                                 checkpointing=c.checkpointing, gpus=c.layout.world, assume=self._answers(c.layout),
                                 global_batch=c.micro * c.microbatches * c.layout.data_parallel)

    @property
    def probe_model(self) -> torch.nn.Module:
        """A meta copy of the model with its first ``PROBE_BLOCKS`` repeated blocks only (and, for a
        transformers model, ``num_hidden_layers`` set to match on the copy's own config): every probe
        copies three blocks, not all of them."""
        if self._probe_model is None:
            from memcheck.engine.setup import meta_twin

            twin = meta_twin(self.model)
            container, _, _ = self.shape.first_block.rpartition(".")
            blocks = twin.get_submodule(container)
            kept = type(blocks)(list(blocks)[:PROBE_BLOCKS])
            parent, _, name = container.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, name, kept)
            config = getattr(twin, "config", None)
            if config is not None and getattr(config, "num_hidden_layers", None) is not None:
                if config is getattr(self.model, "config", None):  # never the user's own config
                    import copy

                    config = copy.deepcopy(config)
                    for module in twin.modules():
                        if getattr(module, "config", None) is getattr(self.model, "config", None):
                            module.config = config
                config.num_hidden_layers = PROBE_BLOCKS
            self._probe_model = twin
        return self._probe_model

    def _answers(self, layout: Layout) -> tuple[str, ...]:
        """The data-dependent answers pinned after the first probe; under cp, no attention mask."""
        return tuple(a for a in self.assume if a != "padding") if layout.cp > 1 else self.assume

    def batch(self, micro: int):
        if micro not in self._batches:
            self._batches[micro] = self.make_batch(micro)
        return self._batches[micro]

    def run(self, candidates: list[_Candidate]):
        considered: list[LayoutCandidate] = []
        full = 0
        refused: dict[tuple, str] = {}  # a kind of rank the model cannot be cut into, and why
        for c in candidates:
            kind = (c.layout.tp, c.layout.pp > 1, c.layout.cp)
            if kind in refused:
                continue
            try:
                outcome = self._consider(c, considered, full)
            except UsageError as exc:  # e.g. a model whose pipeline stages cannot be cut
                refused[kind] = str(exc)
                self.refusals.append(f"{c.layout.label}: {exc}")
                considered.append(self._row(c, "not possible (below)"))
                continue
            if outcome is None:
                continue
            full, est, fits = outcome
            if fits:
                return c, considered, est
            if full > MAX_FULL_TRACES:
                break
        return None, considered, None

    def _consider(self, c: _Candidate, considered: list, full: int):
        """One candidate: skipped (None, a row added), or traced: (full traces so far, estimate, fits)."""
        bound = self.state_bound(c)
        if bound > self.limit:
            considered.append(self._row(c, f"skipped, state {_gib(bound)}"))
            return None
        bound = self.at_least(c)
        if bound is not None and bound > self.limit * (1 + PREDICTION_SLACK):
            considered.append(self._row(c, f"skipped, >= {_gib(bound)}", predicted=bound))
            return None
        predicted = self.predict(c)
        if predicted is not None and predicted > self.limit * (1 + PREDICTION_SLACK):
            considered.append(self._row(c, f"skipped, ~{_gib(predicted)}", predicted=predicted))
            return None
        if full >= MAX_FULL_TRACES:
            considered.append(self._row(c, "skipped, no traces left"))
            return full + 1, None, False
        full += 1
        job = self.job_for(c)
        self._say(f"tracing {c.layout.label}, micro-batch {c.micro} x {c.microbatches}, "
                  f"checkpointing {c.checkpointing}")
        est = estimate(self.model, self.batch(c.micro), job, loss_fn=self.loss_fn, model_name=self.name,
                       top_modules=4)
        self.traces += len(est.devices)
        busiest = est.busiest.total_bytes
        fits = busiest <= self.limit
        row = self._row(c, f"{_gib(busiest)}, " + ("fits" if fits else "too big"), traced=busiest, fits=fits,
                        predicted=predicted)
        considered.append(row)
        return full, est, fits

    def state_bound(self, c: _Candidate) -> int:
        """Weights, gradients and AdamW state of the busiest rank's parameters, sharded over dp*cp
        (a lower bound: no gathered copies, no activations)."""
        s, layout = self.shape, c.layout
        blocks = -(-s.blocks // layout.pp)
        params = blocks * s.block_params / layout.tp + (s.other_params if layout.pp == 1 else s.other_params / 2)
        per_param = _state_bytes_per_param(self.base)
        return int(params * per_param / layout.sharded_over)

    def predict(self, c: _Candidate, probe=None) -> int | None:
        """The busiest rank's device total predicted from one-block probes (module docstring, 3): the
        state bound and the CUDA context, plus the probe's activations times the micro-batch, plus one
        block's micro-batch in flight for every further block and live micro-batch, plus the pipeline's
        receive buffers (two of micro x S/cp x hidden for each of the step's micro-batches)."""
        probe = probe or self._probe(c.layout.tp, c.layout.cp, c.checkpointing)
        if probe is None:
            return None
        first, last, saved, fixed = probe
        s, layout = self.shape, c.layout
        blocks = -(-s.blocks // layout.pp)
        live = min(layout.pp, c.microbatches)  # 1F1B: the first stage holds pp micro-batches, the last one
        activations = c.micro * max(first + (blocks * live - 1) * saved, last + (blocks - 1) * saved)
        buffers = 0
        if layout.pp > 1:
            buffers = 2 * c.microbatches * c.micro * (s.length // layout.cp) * s.hidden * _activation_bytes(self.base)
        return self.state_bound(c) + fixed + activations + buffers

    def at_least(self, c: _Candidate) -> int | None:
        """Before probing a candidate's tp and cp: the prediction with the unsharded probe's activations
        divided by tp * cp (sharding divides no activation by more than its degree), or None."""
        if (c.layout.tp, c.layout.cp) == (1, 1) or (c.layout.tp, c.layout.cp, c.checkpointing) in self._probes:
            return None
        probe = self._probe(1, 1, c.checkpointing)
        if probe is None:
            return None
        first, last, saved, fixed = probe
        k = c.layout.tp * c.layout.cp
        return self.predict(c, (first // k, last // k, saved // k, fixed))

    def _probe(self, tp: int, cp: int, ckpt: str):
        key = (tp, cp, ckpt)
        if key not in self._probes:
            try:
                self._probes[key] = self._run_probe(tp, cp, ckpt)
            except UsageError:  # a model the probes' pipeline cannot cut: no screen, candidates are traced
                self._probes[key] = None
        return self._probes[key]

    def _run_probe(self, tp: int, cp: int, ckpt: str):
        """A one-block-a-stage pipeline (GPipe, micro-batches of one row, no data parallelism): the
        first and last stage with one micro-batch, each one's activations (device total less its
        state and the CUDA context); a middle stage with one and with two micro-batches, whose
        difference in what they hold besides the state (``_held``), less one more pair of receive
        buffers and the stage output kept for backward, is what one block keeps for a micro-batch in
        flight; and the context."""
        s = self.shape
        if s.blocks < PROBE_BLOCKS:
            return None
        layout = Layout(cp=cp, tp=tp, pp=PROBE_BLOCKS, schedule=Schedule.GPIPE)
        # SGD without state: the probe's peak is where activations live (forward or backward), not in an
        # optimizer step over one block's state, so two probes' difference is what a micro-batch adds
        job = self.base.replace(layout=layout, batch_size=1, accumulate=1, checkpointing=ckpt, gpus=layout.world,
                                assume=self._answers(layout), optimizer="sgd")
        self._say(f"probing one block at tp={tp}, cp={cp}, checkpointing {ckpt}")

        def trace(stage: int, microbatches: int):
            est = _estimate_rank(self.probe_model, self.batch(1), job.replace(accumulate=microbatches), self.target,
                                 self.name, Role(layout, stage), loss_fn=self.loss_fn, eval_batch=None,
                                 top_modules=0, progress=None, timeline=False, train_step=None)
            self.traces += 1
            if est.branches is not None and not self.assume and cp == 1:  # later traces take the same answers
                self.assume = tuple(est.branches.taken)
            return est

        first, last = trace(0, 1), trace(PROBE_BLOCKS - 1, 1)
        one, two = trace(1, 1), trace(1, 2)
        fixed = first.busiest.context_bytes or 0
        # the second micro-batch also brings a receive and a gradient buffer, and the stage output the
        # schedule keeps for its backward: one hidden state each
        hidden = (s.length // cp) * s.hidden * _activation_bytes(self.base)
        saved = max(0, _held(two) - _held(one) - 3 * hidden)

        def activations(est) -> int:
            b = est.busiest.breakdown_at_peak
            return est.busiest.total_bytes - fixed - (b.params + b.buffers + b.grads + b.optimizer)

        return activations(first), activations(last), saved, fixed

    def _row(self, c: _Candidate, status: str, *, traced: int | None = None, predicted: int | None = None,
             fits: bool = False) -> LayoutCandidate:
        return LayoutCandidate(layout=c.layout.label, micro_batch_size=c.micro, microbatches=c.microbatches,
                               checkpointing=c.checkpointing, relative_cost=c.cost, fits=fits,
                               device_total_bytes=traced, predicted_bytes=predicted, status=status)

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)


def _state_bytes_per_param(job: Job) -> int:
    """Weights, gradient and AdamW state bytes a parameter: fp32 master weights under amp and fp32,
    half under pure bf16/fp16; 8-bit state 2 bytes, else 8."""
    weights = 2 if job.precision in (Precision.BF16, Precision.FP16) else 4
    state = 2 if "8bit" in str(job.optimizer) else 8
    return 2 * weights + state


def _held(est) -> int:
    """What a step holds at its peak besides the state: activations, temporaries and outputs (the
    gradients are left out: with two micro-batches they are whole at the peak, with one not yet)."""
    b = est.busiest.breakdown_at_peak
    return b.activations + b.temporaries + b.outputs


def _activation_bytes(job: Job) -> int:
    """Bytes of an activation element: 2 under bf16/fp16 (autocast or pure), 4 in fp32."""
    return 4 if job.precision is Precision.FP32 else 2


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
