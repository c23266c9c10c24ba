"""``pp``: one pipeline-parallel rank of ``torch.distributed.pipelining``, emulated on meta tensors.

A pipeline of P ranks cuts a model's repeated blocks into P contiguous stages (``virtual``
chunks per rank for interleaved schedules). Each rank holds its stage's parameters, runs
forwards and backwards of M micro-batches in its schedule's order, and keeps a micro-batch's
activations from its forward to its backward: the schedule decides how many are alive at
once. This module gives, following torch 2.13 (``torch/distributed/pipelining/schedules.py``
and ``stage.py``, cited by line):

- ``actions(schedule, rank, stages, microbatches, virtual=1)``: the ordered forwards and
  backwards (and, for zero bubble, input-gradient and weight-gradient halves) one rank runs
  in one step; ``live_microbatches(...)``: the most micro-batch activations it holds at once;
- ``make_stage(model, rank, stages, virtual=1)``: turns (in place) a meta model into what one
  rank holds: its slice of the blocks (one per chunk), the embedding only on the first stage
  (the others receive an activation instead), final norm, head and loss only on the last
  (the others end at their last block and send its output);
- ``train_step(schedule, rank, stages, microbatches, virtual=1)``: a ``train_step(model, batch,
  optimizer)`` for ``memcheck.estimate`` that runs the rank's step on such a stage model
  the way the schedule's ``_step_microbatches`` does, including what torch's stage and
  schedule keep referenced: the per-micro-batch receive buffers, the forward cache, the
  input gradients waiting to be sent, and the sends a gloo ``Work`` still holds.

Schedules: ``gpipe`` (``ScheduleGPipe``), ``1f1b`` (``Schedule1F1B``), ``interleaved-1f1b``
(``ScheduleInterleaved1F1B``) and ``zero-bubble`` (``ScheduleInterleavedZeroBubble``: it
shares the interleaved schedule's placement, rank r holding stages r, r + P, ...; torch's
``ScheduleZBVZeroBubble`` places them in a V and is not modelled). ``train_step`` runs
``gpipe``, ``1f1b`` and ``interleaved-1f1b``, each measured against real gloo ranks
(``memcheck.measure.distributed.measure_pp_cpu``; benchmarks/pp_accuracy.py,
tests/test_pp_cpu.py); ``zero-bubble`` has its actions and live micro-batches only (see
``PipelineTrainStep``). docs/pp.md says what is and is not modelled.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import torch

from memcheck.errors import UsageError, closest
from memcheck.training.checkpointing import repeated_blocks
from memcheck.enums import Schedule

# the names --layout's schedule= takes (memcheck.enums.Schedule)
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = (s.value for s in Schedule)
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE)
RUNNABLE = (GPIPE, ONE_F_ONE_B, INTERLEAVED)  # what train_step runs

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"


class Action(NamedTuple):
    """One computation of one rank: ``kind`` (F forward, B full backward, I input-gradient half,
    W weight-gradient half of a backward) of micro-batch ``microbatch`` on local chunk ``chunk``
    (0 for one stage per rank; chunk c of rank r is global stage ``c * stages + r``)."""

    kind: str
    microbatch: int
    chunk: int = 0


def _check(schedule: str, rank: int, stages: int, microbatches: int, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise UsageError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
                         f"{closest(str(schedule), SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"pipeline {name} must be a whole number of at least 1, got {value!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < stages:
        raise UsageError(f"pipeline rank must be a whole number from 0 to {stages - 1}, got {rank!r}")
    if schedule in (GPIPE, ONE_F_ONE_B) and virtual != 1:
        raise UsageError(f"schedule {schedule!r} runs one stage per rank (virtual=1), got virtual={virtual}; "
                         f"use {INTERLEAVED!r} or {ZERO_BUBBLE!r}")
    if schedule == ONE_F_ONE_B and microbatches < stages:
        # schedules.py:1018-1022 (Schedule1F1B.__init__)
        raise UsageError(f"schedule '1f1b' needs at least as many micro-batches as stages: "
                         f"microbatches={microbatches} < stages={stages}")
    if schedule in (INTERLEAVED, ZERO_BUBBLE):
        rounds = max(1, microbatches // stages)  # schedules.py:2935-2942 (and 3045-3052 for zero bubble)
        if microbatches % rounds:
            raise UsageError(f"schedule {schedule!r} needs microbatches to be a multiple of the number of rounds "
                             f"max(1, microbatches // stages) = {rounds}, got microbatches={microbatches}")


def actions(schedule: str, rank: int, stages: int, microbatches: int, virtual: int = 1) -> list[Action]:
    """The computations ``rank`` runs in one step, in order (idle slots left out).

    - ``gpipe``: every forward, then every backward (``ScheduleGPipe._step_microbatches``,
      schedules.py:902-952);
    - ``1f1b``: ``min(M, P - rank)`` warm-up forwards, then one backward and one forward
      until the forwards run out, then the remaining backwards
      (``Schedule1F1B._step_microbatches``, schedules.py:1048-1175);
    - ``interleaved-1f1b`` and ``zero-bubble``: torch's own per-rank order,
      ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (schedules.py:2954) and
      ``ScheduleInterleavedZeroBubble._calculate_single_rank_operations`` (schedules.py:3072),
      called on a stand-in that carries only the numbers they read (no process group).
    """
    _check(schedule, rank, stages, microbatches, virtual)
    m = microbatches
    if schedule == GPIPE:
        return [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)]
    if schedule == ONE_F_ONE_B:
        warmup = min(m, stages - rank)  # schedules.py:1050-1055
        order = [Action(FORWARD, i) for i in range(warmup)]
        fwd, bwd = warmup, 0
        while True:  # 1B1F: the backward first (schedules.py:1092-1136)
            order.append(Action(BACKWARD, bwd))
            bwd += 1
            if fwd == m:
                break
            order.append(Action(FORWARD, fwd))
            fwd += 1
        order += [Action(BACKWARD, i) for i in range(bwd, m)]  # cooldown (schedules.py:1141-1160)
        return order
    from torch.distributed.pipelining import schedules as torch_schedules

    kind = (torch_schedules.ScheduleInterleaved1F1B if schedule == INTERLEAVED
            else torch_schedules.ScheduleInterleavedZeroBubble)
    rounds = max(1, m // stages)
    stand_in = types.SimpleNamespace(pp_group_size=stages, n_local_stages=virtual, _n_microbatches=m,
                                     number_of_rounds=rounds, microbatches_per_round=m // rounds)
    names = {"FORWARD": FORWARD, "FULL_BACKWARD": BACKWARD, "BACKWARD_INPUT": BACKWARD_INPUT,
             "BACKWARD_WEIGHT": BACKWARD_WEIGHT}
    order = []
    for action in kind._calculate_single_rank_operations(stand_in, rank):
        if action is None:
            continue
        order.append(Action(names[action.computation_type.name], action.microbatch_index,
                            action.stage_index // stages))
    return order


def live_microbatches(schedule: str, rank: int, stages: int, microbatches: int, virtual: int = 1) -> int:
    """The most (micro-batch, chunk) activations ``rank`` holds at once in one step.

    A forward's activations live until its full backward; under zero bubble, until the
    weight-gradient half (the input-gradient half keeps the graph for it: ``_backward.py``
    ``stage_backward_input`` retains it). GPipe holds all M; 1F1B ``min(M, P - rank)``.
    """
    live = most = 0
    for action in actions(schedule, rank, stages, microbatches, virtual):
        if action.kind == FORWARD:
            live += 1
            most = max(most, live)
        elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
            live -= 1
    return most


def stage_span(blocks: int, stages: int, index: int) -> tuple[int, int]:
    """``(first block, number of blocks)`` of global stage ``index``: contiguous slices, the first
    ``blocks % stages`` stages one block more (an even split when ``stages`` divides ``blocks``)."""
    base, extra = divmod(blocks, stages)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


class PassThrough(torch.nn.Module):
    """A parameter-free stand-in for a module another stage holds: returns its first input."""

    memcheck_stand_in = True  # memcheck.training.checkpointing.repeated_blocks skips it

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


class Receive(torch.nn.Module):
    """Replaces the input embedding on a non-first stage: returns the activation this rank
    received for the current micro-batch (``PipelineStage`` allocates one receive buffer per
    micro-batch once, stage.py:2243-2274, and sets ``requires_grad`` on it at every forward,
    stage.py:685)."""

    def __init__(self, state: "StageState"):
        super().__init__()
        self.state = state

    def forward(self, *args, **kwargs):
        return self.state.received()


class Entry(torch.nn.Module):
    """The input embedding of rank 0 holding several chunks: the embedding for chunk 0 (the
    first stage), the received activation for its later chunks."""

    def __init__(self, inner: torch.nn.Module, state: "StageState"):
        super().__init__()
        self.inner, self.state = inner, state

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) if self.state.chunk == 0 else self.state.received()


class Exit(torch.nn.Module):
    """A module after the blocks (final norm, head) on the last rank holding several chunks:
    itself for the last chunk (the last stage), a pass-through for the earlier ones."""

    def __init__(self, inner: torch.nn.Module, state: "StageState"):
        super().__init__()
        self.inner, self.state = inner, state

    def forward(self, *args, **kwargs):
        if self.state.chunk == self.state.virtual - 1:
            return self.inner(*args, **kwargs)
        return args[0] if args else next(iter(kwargs.values()))


class _Gate:
    """A block's ``forward`` that runs only while its chunk is the one being run (a pass-through
    otherwise); an object, not a closure, so a deep copy of the model follows it."""

    def __init__(self, forward, state: "StageState", chunk: int):
        self.forward, self.state, self.chunk = forward, state, chunk

    def __call__(self, *args, **kwargs):
        if self.state.chunk == self.chunk:
            return self.forward(*args, **kwargs)
        return args[0] if args else next(iter(kwargs.values()))


class _GatedHook:
    """A block's forward pre-hook (sequence parallelism's cut of the first block's input) that runs
    only while the block's chunk is the one being run: a gated block passes its input through."""

    def __init__(self, hook, state: "StageState", chunk: int):
        self.hook, self.state, self.chunk = hook, state, chunk

    def __call__(self, *args, **kwargs):
        if self.state.chunk == self.chunk:
            return self.hook(*args, **kwargs)
        return None


class _Capture:
    """A forward hook on a chunk's last block: keeps its output while that chunk runs."""

    def __init__(self, state: "StageState", chunk: int):
        self.state, self.chunk = state, chunk

    def __call__(self, module, args, output):
        if self.state.chunk == self.chunk:
            self.state.output = output[0] if isinstance(output, (tuple, list)) else output


class StageState:
    """What one rank's pipeline stage keeps between calls: its place (rank of ``stages``,
    ``virtual`` chunks, the blocks of each), and the receive buffers of each chunk (allocated
    on the first step, kept for the run as ``PipelineStage`` keeps them)."""

    def __init__(self, rank: int, stages: int, virtual: int, hidden: int, chunks: tuple[tuple[str, ...], ...],
                 sequence_shards: int = 1):
        self.rank, self.stages, self.virtual, self.hidden, self.chunks = rank, stages, virtual, hidden, chunks
        # sequence parallelism: the residual stream between blocks holds S / tp tokens a rank, and so does
        # what a stage sends and receives (torchtitan's blocks take and return Shard(1) local tensors)
        self.sequence_shards = sequence_shards
        self.recv: dict[int, list[torch.Tensor]] = {}  # chunk -> activations received, one per micro-batch
        self.grad_recv: dict[int, list[torch.Tensor]] = {}  # chunk -> gradients received, one per micro-batch
        self.chunk = 0  # the chunk and micro-batch being run
        self.current = 0
        self.output: torch.Tensor | None = None  # the chunk's last block's output of the forward just run

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(b for chunk in self.chunks for b in chunk)

    def is_first(self, chunk: int) -> bool:
        """Whether ``chunk`` of this rank is the pipeline's first stage (global stage 0)."""
        return self.rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        """Whether ``chunk`` of this rank is the pipeline's last stage."""
        return self.rank == self.stages - 1 and chunk == self.virtual - 1

    def received(self) -> torch.Tensor:
        return self.recv[self.chunk][self.current].requires_grad_(True)

    def capture(self, module, args, output):
        self.output = output[0] if isinstance(output, (tuple, list)) else output


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _owns_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _around(model: torch.nn.Module, container: str) -> tuple[list[str], list[str]]:
    """The modules with parameters registered before and after the blocks' container, at every
    level from the container up to the root (an HF causal LM: ``model.embed_tokens`` before;
    ``model.norm`` and ``lm_head`` after)."""
    before, after = [], []
    path = container.split(".")
    for depth in range(len(path)):
        parent = ".".join(path[:depth])
        module = model.get_submodule(parent) if parent else model
        names = [n for n, _ in module.named_children()]
        here = names.index(path[depth])
        for i, name in enumerate(names):
            if i == here or not _owns_parameters(getattr(module, name)):
                continue
            (before if i < here else after).append(f"{parent}.{name}" if parent else name)
    return before, after


def make_stage(model: torch.nn.Module, rank: int, stages: int, virtual: int = 1,
               sequence_shards: int = 1) -> torch.nn.Module:
    """Turn ``model`` (parameters on the meta device; pass a copy) in place into pipeline rank
    ``rank`` of ``stages``, and return it.

    The model's repeated blocks (``memcheck.training.checkpointing.repeated_blocks``) are cut
    into ``stages * virtual`` contiguous global stages (``stage_span``); rank r holds global
    stages ``c * stages + r`` for its chunks c (torch's interleaved placement; one stage when
    ``virtual`` is 1). The other blocks become ``PassThrough``. A non-first stage's input
    embedding becomes ``Receive`` (the activation it receives); a non-last stage's modules after
    the blocks (final norm, head) become ``PassThrough`` and its output is its last block's
    output (``train_step`` sends it and receives its gradient). With several chunks, rank 0's
    embedding becomes ``Entry`` and the last rank's norm and head ``Exit``, and each block runs
    only for its own chunk. A transformers model's KV cache is turned off (training;
    torchtitan's models have none). ``sequence_shards`` is the tensor-parallel degree under
    sequence parallelism (the model already cut by ``tp.shard``): the activations a stage sends
    and receives, and their gradients, hold ``S / sequence_shards`` tokens.

    Raises:
        UsageError: no repeated blocks, more global stages than blocks, or a non-first stage of
            a model with several parameterised modules before its blocks.
    """
    _check(INTERLEAVED if virtual > 1 else GPIPE, rank, stages, stages, virtual)
    blocks = repeated_blocks(model)
    name = type(model).__name__
    if not blocks:
        raise UsageError(f"pipeline parallelism cuts a model's repeated blocks, and {name} has none "
                         "(no ModuleList or Sequential of two or more blocks of one class)")
    total = stages * virtual
    if total > len(blocks):
        what = f"{stages} pipeline stages" if virtual == 1 else f"{stages} pipeline ranks x {virtual} chunks"
        raise UsageError(f"{what} for the {len(blocks)} repeated blocks of {name}: at most one stage per block")
    container = blocks[0].rpartition(".")[0]
    before, after = _around(model, container)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if (rank > 0 or virtual > 1) and before and (len(before) > 1 or model.get_submodule(before[0]) is not embedding):
        raise UsageError(f"a non-first pipeline stage of {name} replaces its input embedding with the received "
                         f"activation; {name} has {', '.join(before)} before its blocks, which is not modelled")
    chunks = []
    for chunk in range(virtual):
        first, count = stage_span(len(blocks), total, chunk * stages + rank)
        chunks.append(tuple(blocks[first:first + count]))
    kept = tuple(b for chunk in chunks for b in chunk)
    if embedding is not None and getattr(embedding, "weight", None) is not None:
        hidden = embedding.weight.shape[-1]
    else:
        hidden = next(model.get_submodule(kept[0]).parameters()).shape[-1]
    state = StageState(rank, stages, virtual, hidden, tuple(chunks), sequence_shards)
    for block in blocks:
        if block not in kept:
            _set(model, block, PassThrough())
    for mod_name in before:
        if rank > 0:
            _set(model, mod_name, Receive(state))
        elif virtual > 1:
            _set(model, mod_name, Entry(model.get_submodule(mod_name), state))
    for mod_name in after:
        if rank < stages - 1:
            _set(model, mod_name, PassThrough())
        elif virtual > 1:
            _set(model, mod_name, Exit(model.get_submodule(mod_name), state))
    for chunk, names in enumerate(chunks):
        if virtual > 1:
            for block in names:
                module = model.get_submodule(block)
                module.forward = _Gate(module.forward, state, chunk)
                for key, hook in list(module._forward_pre_hooks.items()):  # SP's cut of layers.0's input
                    module._forward_pre_hooks[key] = _GatedHook(hook, state, chunk)
        if not state.is_last(chunk):
            hook = state.capture if virtual == 1 else _Capture(state, chunk)
            model.get_submodule(names[-1]).register_forward_hook(hook)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    model.memcheck_pp_stage = state
    return model


class _Stage:
    """The part of ``PipelineStage`` (stage.py) one step uses, for each chunk of the stage model:
    a forward cache from each forward to its backward (stage.py:913, 966) and a backward cache of
    input gradients until they are sent (stage.py:1044, 552)."""

    autocast = None  # a factory of the context each forward runs in (torch.autocast), or None

    def __init__(self, model: torch.nn.Module, batch: Any, microbatches: int, whole_batch: bool = False,
                 buffers: int | None = None):
        state = getattr(model, "memcheck_pp_stage", None)
        if not isinstance(state, StageState):
            raise UsageError("pp.train_step runs on a model cut by pp.make_stage(model, rank, stages)")
        self.model, self.state, self.microbatches = model, state, microbatches
        self.buffers = buffers or microbatches  # receive buffers: one per micro-batch of the real step
        self.fwd_cache: dict[tuple[int, int], tuple] = {}
        self.bwd_cache: dict[tuple[int, int], torch.Tensor | None] = {}
        self.losses: dict[int, torch.Tensor] = {}  # the schedule's _internal_losses (schedules.py:305-308)
        has_last = state.is_last(state.virtual - 1)
        if isinstance(batch, dict) and not has_last:
            batch = {k: v for k, v in batch.items() if k != "labels"}  # only the last stage has the target
        if whole_batch:  # step() splits the batch into views (schedules.py:775-782, microbatch.py:239)
            self.batches = _split(batch, microbatches)
        else:
            self.batches = [batch] * microbatches
        if state.sequence_shards > 1:
            self.batches = [_with_positions(b) for b in self.batches]
        if not state.recv and not state.grad_recv:
            self._allocate(self.batches[0])

    def _allocate(self, batch) -> None:
        """The receive buffers of each chunk, one per micro-batch, made when the stage is first
        initialised (``_setup_forward_recv_info`` stage.py:2243-2274; ``_create_grad_recv_info``
        stage.py:2286-2320)."""
        state = self.state
        ids = batch["input_ids"] if isinstance(batch, dict) else (batch[0] if isinstance(batch, (tuple, list))
                                                                   else batch)
        if ids.shape[1] % state.sequence_shards:
            raise UsageError(f"sequence parallelism cuts the {ids.shape[1]} tokens of a sequence over "
                             f"{state.sequence_shards} ranks: use a length divisible by {state.sequence_shards}")
        shape = (ids.shape[0], ids.shape[1] // state.sequence_shards, state.hidden)
        for chunk, names in enumerate(state.chunks):
            # the activations' dtype is the blocks' dtype when the step runs (memcheck casts the twin for
            # bf16/fp16 after make_stage): the first floating parameter of the chunk's first block
            dtype = next(p.dtype for p in self.model.get_submodule(names[0]).parameters() if p.is_floating_point())
            if not state.is_first(chunk):
                state.recv[chunk] = [torch.empty(shape, dtype=dtype, device=ids.device)
                                     for _ in range(self.buffers)]
            if not state.is_last(chunk):
                state.grad_recv[chunk] = [torch.empty(shape, dtype=dtype, device=ids.device)
                                          for _ in range(self.buffers)]

    def forward(self, m: int, chunk: int = 0):
        """``forward_one_chunk`` (stage.py:857-935) and, on the last stage, the schedule's loss
        (under ``autocast()`` when there is one)."""
        if self.autocast is not None:
            with self.autocast():
                return self._forward(m, chunk)
        return self._forward(m, chunk)

    def _forward(self, m: int, chunk: int):
        state = self.state
        state.chunk, state.current = chunk, m
        inputs = state.recv[chunk][m] if not state.is_first(chunk) else None
        batch = self.batches[m]
        if state.is_last(chunk):
            out = self.model(**batch) if isinstance(batch, dict) else self.model(batch)
            self.losses[m] = _loss_of(out)
            output = _outputs(out)
            del out
        else:
            if isinstance(batch, dict):
                self.model(**{k: v for k, v in batch.items() if k != "labels"})
            else:
                self.model(batch)
            output = (state.output,)
            state.output = None
        self.fwd_cache[(chunk, m)] = (output, inputs)
        return output

    def fwd_send(self, m: int, chunk: int = 0) -> list[torch.Tensor]:
        """``get_fwd_send_ops`` (stage.py:483-510): the outputs to send; none on the last stage."""
        return [] if self.state.is_last(chunk) else list(self.fwd_cache[(chunk, m)][0])

    def backward(self, m: int, chunk: int = 0) -> None:
        """``backward_one_chunk`` (stage.py:937-1062) with ``stage_backward`` (_backward.py:346-452)."""
        output, inputs = self.fwd_cache.pop((chunk, m))
        if self.state.is_last(chunk):
            self.losses[m].backward()
        else:
            output[0].backward(self.state.grad_recv[chunk][m])
        if inputs is not None:
            self.bwd_cache[(chunk, m)] = inputs.grad  # _backward.py:443-450: the input's gradient, then .grad = None
            inputs.grad = None
        else:
            self.bwd_cache[(chunk, m)] = None

    def bwd_send(self, m: int, chunk: int = 0) -> list[torch.Tensor]:
        """``get_bwd_send_ops`` (stage.py:529-602): the input gradient leaves the backward cache; none
        on the first stage."""
        if self.state.is_first(chunk):
            return []
        grad = self.bwd_cache.pop((chunk, m))
        return [grad] if grad is not None else []

    def finish(self) -> None:
        """``_update_losses`` (schedules.py:310-333) and ``perform_reduce_grad``'s ``scale_grads``
        (stage.py:1164-1196, 765-779: the gradients divided by M in place)."""
        self.losses.clear()
        if self.microbatches != 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(self.microbatches)


def _with_positions(batch: Any) -> Any:
    """``batch`` with the whole sequence's ``position_ids`` (when it has none): a non-first stage under
    sequence parallelism receives S / tp tokens, from which a transformers decoder would derive S / tp
    positions (its ``cache_position``), while its attention runs on the gathered S (torchtitan's stages
    slice their precomputed ``freqs_cis`` to the whole sequence)."""
    if not isinstance(batch, dict) or "position_ids" in batch or "input_ids" not in batch:
        return batch
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    return {**batch, "position_ids": positions}


def _split(batch: Any, microbatches: int) -> list:
    """The step's batch as ``microbatches`` views along dimension 0 (``torch.tensor_split``)."""
    from memcheck.compat import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] % microbatches:
            raise UsageError(f"the step's batch of {leaf.shape[0]} rows does not split into {microbatches} "
                             "micro-batches of one size")
    parts = [torch.tensor_split(t, microbatches) if isinstance(t, torch.Tensor) and t.dim() else [t] * microbatches
             for t in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(microbatches)]


def _loss_of(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        raise UsageError(f"the last pipeline stage's output has no .loss ({type(out).__name__}); "
                         "give the batch labels")
    return loss


def _outputs(out) -> tuple:
    """The model output's tensors other than the loss: what the stage's forward cache holds."""
    from memcheck.training.loop import outputs_of

    return tuple(outputs_of(out))


def _gpipe(stage: _Stage, m: int) -> None:
    """``ScheduleGPipe._step_microbatches`` (schedules.py:878-960): a gloo send ``Work`` holds its
    tensor, and the schedule keeps every forward and backward send's ``Work`` until the step ends
    (``fwd_sends_to_wait``, ``bwd_sends_to_wait``)."""
    fwd_sends_to_wait, bwd_sends_to_wait = [], []
    output = None
    for i in range(m):
        output = stage.forward(i)  # schedules.py:910 (the last one stays referenced by `output`)
        fwd_sends_to_wait.extend(stage.fwd_send(i))
    for i in range(m):
        stage.backward(i)
        bwd_sends_to_wait.extend(stage.bwd_send(i))
    stage.finish()
    del output, fwd_sends_to_wait, bwd_sends_to_wait


def _one_f_one_b(stage: _Stage, m: int, stages: int, rank: int) -> None:
    """``Schedule1F1B._step_microbatches`` (schedules.py:1025-1177), with the references it keeps:
    ``output`` (the latest forward's output), ``fwd_sends`` (the latest forward send), ``send_work``
    (the second-to-last warm-up send, until the 1B1F loop ends), ``bwd_sends`` (the latest backward
    send, through the next backward)."""
    warmup = min(m, stages - rank)
    fwd = bwd = 0
    send_work: list = []
    fwd_sends: list = []
    output = None
    for _ in range(warmup):
        output = stage.forward(fwd)
        fwd_sends = stage.fwd_send(fwd)
        if fwd != warmup - 1:
            send_work = fwd_sends  # schedules.py:1084-1088
        fwd += 1
    bwd_sends: list = []
    while True:
        stage.backward(bwd)
        bwd_sends = stage.bwd_send(bwd)  # schedules.py:1111
        bwd += 1
        if fwd == m:
            break
        output = stage.forward(fwd)
        fwd_sends = stage.fwd_send(fwd)  # schedules.py:1134
        fwd += 1
    send_work = bwd_sends  # schedules.py:1138
    while bwd < m:  # cooldown
        stage.backward(bwd)
        bwd_sends = stage.bwd_send(bwd)
        send_work = bwd_sends  # schedules.py:1157-1158
        bwd += 1
    stage.finish()
    del output, fwd_sends, send_work, bwd_sends


def _runtime(stage: _Stage, order: list[Action]) -> None:
    """``_PipelineScheduleRuntime._step_microbatches`` (schedules.py:2407-2662), which runs
    ``interleaved-1f1b``: the rank's actions in order, each forward's and backward's send
    appended to ``send_ops`` (schedules.py:2469-2472) and waited only when the step ends
    (schedules.py:2654-2655), so a gloo ``Work`` holds every sent tensor until then."""
    send_ops: list = []
    for action in order:
        if action.kind == FORWARD:
            stage.forward(action.microbatch, action.chunk)
            send_ops.extend(stage.fwd_send(action.microbatch, action.chunk))
        else:
            stage.backward(action.microbatch, action.chunk)
            send_ops.extend(stage.bwd_send(action.microbatch, action.chunk))
    send_ops.clear()
    stage.finish()


class PipelineTrainStep:
    """``train_step(model, batch, optimizer)`` for one pipeline rank: the schedule's step on the
    stage model (``make_stage``), then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.
    ``batch`` is one micro-batch, and every micro-batch of the step is that batch; with
    ``whole_batch=True`` it is the step's whole batch, split into ``microbatches`` views as
    ``schedule.step`` splits it (the caller then holds all M micro-batches' inputs, as in a real run)."""

    def __init__(self, schedule: str, rank: int, stages: int, microbatches: int, whole_batch: bool = False,
                 virtual: int | None = None, *, buffers: int | None = None, autocast=None):
        _check(schedule, rank, stages, microbatches, virtual or 1)
        if schedule not in RUNNABLE:
            # zero bubble's input-gradient half is torch.autograd.grad on the received activation, a leaf, and
            # memcheck's tracer counts a module's gradients with torch._C._will_engine_execute_node, which
            # torch refuses on a leaf under autograd.grad (memcheck/trace/tracer.py, _all_grads_hook)
            raise UsageError(f"pp.train_step runs {', '.join(RUNNABLE)} for now, not {schedule!r} "
                             "(its actions and live micro-batches are modelled: pp.actions, pp.live_microbatches)")
        self.schedule, self.rank, self.stages, self.microbatches = schedule, rank, stages, microbatches
        self.virtual = virtual  # None: the stage model's own (make_stage's virtual)
        self.whole_batch = bool(whole_batch)
        self.buffers = buffers  # the real step's micro-batches, when fewer are traced (receive buffers)
        self.autocast = autocast  # a context manager factory for each forward (torch.autocast), or None
        self.__name__ = f"pp_{schedule.replace('-', '_')}_step"

    def __call__(self, model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer) -> None:
        state = getattr(model, "memcheck_pp_stage", None)
        virtual = self.virtual
        if isinstance(state, StageState):
            virtual = state.virtual if virtual is None else virtual
            if (state.rank, state.stages, state.virtual) != (self.rank, self.stages, virtual):
                raise UsageError(f"the stage model is rank {state.rank} of {state.stages} with {state.virtual} "
                                 f"chunk(s), the train_step is for rank {self.rank} of {self.stages} with {virtual}")
        virtual = virtual or 1
        if virtual > 1 and self.schedule in (GPIPE, ONE_F_ONE_B):
            raise UsageError(f"schedule {self.schedule!r} runs one stage per rank, and the stage model holds "
                             f"{virtual} chunks; use {INTERLEAVED!r}")
        stage = _Stage(model, batch, self.microbatches, self.whole_batch, self.buffers)
        stage.autocast = self.autocast
        if self.schedule == GPIPE:
            _gpipe(stage, self.microbatches)
        elif self.schedule == ONE_F_ONE_B:
            _one_f_one_b(stage, self.microbatches, self.stages, self.rank)
        else:
            _runtime(stage, actions(self.schedule, self.rank, self.stages, self.microbatches, virtual))
        del stage
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_step(schedule: str, rank: int, stages: int, microbatches: int, *, whole_batch: bool = False,
               virtual: int | None = None, buffers: int | None = None, autocast=None) -> PipelineTrainStep:
    """The ``train_step(model, batch, optimizer)`` of pipeline rank ``rank`` of ``stages`` under
    ``schedule`` with ``microbatches`` micro-batches per optimizer step (``gpipe``, ``1f1b``, or
    ``interleaved-1f1b`` with the stage model's ``virtual`` chunks per rank, as ``make_stage`` cut
    it); ``whole_batch``: see ``PipelineTrainStep``; ``buffers``: the real step's micro-batches
    when fewer are traced (one receive buffer each); ``autocast``: a factory of the context each
    forward runs in (``torch.autocast``)."""
    return PipelineTrainStep(schedule, rank, stages, microbatches, whole_batch, virtual, buffers=buffers,
                             autocast=autocast)
