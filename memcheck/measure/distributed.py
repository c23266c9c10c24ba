"""Measure what DDP, FSDP2, FSDP1, DeepSpeed ZeRO-3, tensor, pipeline, context and expert parallelism really
allocate per process, on CPU with gloo.

Each rank is a fresh process (``torch.multiprocessing``, start method ``spawn``)
that joins a gloo process group over a file store, wraps the model, trains
``steps`` steps with ``memcheck.training.loop.run_steps``, and measures the
allocator the way ``memcheck.measure.local.measure_cpu`` does: the profiler's
allocation events (``profile_memory=True``), the steady-state peak taken from the
start of step 2. The results are the oracle for the ``ddp``, ``fsdp``, ``fsdp1`` and ``tp``
strategies' estimates; nothing here uses the tracer.

One difference from ``measure_cpu``, because gloo runs collectives on worker
threads: the live-byte count is the CPU allocator's own process-wide running
total (``total_allocated`` of each profiler allocation event, with the c10 flag
``caffe2_report_cpu_memory_usage`` set; see ``_process_wide_cpu_accounting``),
not the sum of the recorded events. gloo drops the last reference to some
collective temporaries on its worker thread after the profiler's thread-local
state is gone (the flat buffer of DDP's initial broadcast, the clone gloo's
reduce-scatter makes of its input), so their frees are never recorded and a
plain sum would keep them live for the rest of the run, on some ranks and not
others. Where the flag cannot be set, allocations and frees are paired by
address instead (an upper bound).

Not measured: gloo's own scratch memory is ``new``/``malloc``, outside the c10
allocator. Its ring allreduce holds two segments of at most 1 MiB each
(``gloo/allreduce.h`` ``kMaxSegmentSize``, ``gloo/allreduce.cc`` ``ring``), and a
gloo process group runs at most two collectives at once (two worker threads),
so at most about 4 MiB per rank is missing.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.autograd.profiler import profile

from memcheck import compat
from memcheck.enums import Phase
from memcheck.errors import MemcheckError, UsageError, require_torch
from memcheck.measure.local import STEP_MARK, Measured, mark_step
from memcheck.training.loop import LossFn, default_loss, run_steps

DEFAULT_TIMEOUT_S = 300.0  # seconds for the whole run, and for any one collective (gloo's timeout)
_POLL_S = 0.2  # seconds between checks that the ranks are still alive
_EXIT_GRACE_S = 10.0  # seconds a rank that has reported gets to tear down its process group and exit
_RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one thread per rank: ranks share the cores


class DistributedMeasureError(MemcheckError):
    """A distributed measurement failed: a rank could not start, raised, died or timed out."""


def measure_ddp_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn | None = None,
    world_size: int = 2,
    steps: int = 2,
    bucket_cap_mb: float | None = 25,
    gradient_as_bucket_view: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Measured]:
    """Train under ``DistributedDataParallel`` on ``world_size`` CPU ranks and measure each.

    Every rank calls ``build()`` (so every rank holds the same micro-batch shape:
    the per-rank batch is the micro-batch), then wraps the model in
    ``DistributedDataParallel(model, bucket_cap_mb=..., gradient_as_bucket_view=...)``,
    then calls ``make_optimizer(ddp.parameters())``, all inside the profiled
    region, so the broadcast of rank 0's weights and the Reducer's bucket
    buffers are measured.

    ``build``, ``make_optimizer`` and ``loss_fn`` are sent to spawned processes,
    so they must be picklable: module-level functions of an importable module
    (no lambdas, closures or functions defined under ``if __name__ == "__main__"``).
    ``loss_fn(model, batch)`` receives the DDP wrapper; it defaults to
    ``memcheck.training.loop.default_loss``.

    Returns:
        One ``Measured`` per rank, in rank order.

    Raises:
        UsageError: a bad argument, or a callable that cannot be pickled.
        DistributedMeasureError: a rank could not start, raised, died or ran past
            ``timeout_s``; the message carries the rank's traceback.

    Example:
        >>> # mymodels.py defines build() -> (model, batch) and adamw(params) at module level
        >>> ranks = measure_ddp_cpu(mymodels.build, mymodels.adamw, world_size=2)
        >>> max(r.steady_peak_bytes for r in ranks)

    Known limitations:
        gloo's internal scratch (at most about 2 MiB per allreduce in flight) is
        allocated outside the c10 allocator and is not counted. ``bucket_cap_mb``
        passed explicitly also sets the first bucket's cap (DDP keeps its 1 MiB
        first bucket only when ``bucket_cap_mb`` is ``None``).
    """
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise UsageError(f"bucket_cap_mb must be a positive number or None, got {bucket_cap_mb!r}")
    options = {"bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": bool(gradient_as_bucket_view)}
    return _run_ranks("ddp", build, make_optimizer, loss_fn, world_size, steps, options, timeout_s)


def measure_launched(script: Sequence[str], nproc: int, *, timeout_s: float = 600.0) -> list[Measured]:
    """Run a training script for real under torchrun, ``nproc`` ranks on this machine's CPU
    (``torchrun --standalone --nproc-per-node nproc``, each rank measured by
    ``memcheck.measure.script_rank``): the oracle of ``memcheck run -- torchrun ...``. The
    script picks its backend (gloo without CUDA). Returns each rank's ``Measured``, by rank."""
    import json
    import subprocess

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "memcheck.measure.script_rank", out, *script]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise DistributedMeasureError(f"torchrun of {script[0]} failed ({done.returncode}): "
                                          f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
        return [Measured(**json.loads(open(os.path.join(out, f"rank{r}.json")).read())) for r in range(nproc)]


def measure_fsdp_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn | None = None,
    world_size: int = 2,
    steps: int = 2,
    wrap: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] | None = None,
    in_place: bool = False,
    mp_policy: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Measured]:
    """Train under FSDP2 (``fully_shard``) on ``world_size`` CPU ranks and measure each.

    Every rank calls ``build()``, then ``fully_shard(m, mesh=mesh, mp_policy=mp_policy)`` for each
    module ``wrap(model)`` returns (in that order), then ``fully_shard(model)``
    on the root, then ``make_optimizer(model.parameters())``, all inside the
    profiled region. ``wrap`` defaults to the root's direct children that own
    parameters. The mesh is ``init_device_mesh("cpu", (world_size,))``. ``mp_policy``: a
    ``MixedPrecisionPolicy`` given to every ``fully_shard`` call (None: FSDP2's default, no casts).

    ``build``, ``make_optimizer``, ``loss_fn`` and ``wrap`` must be picklable
    module-level functions, as for ``measure_ddp_cpu``.

    ``in_place=True`` runs all-gather and reduce-scatter as in-place broadcasts and reduces
    (``_InPlaceCollectives``), so gloo's staging copies, which NCCL does not make, are not measured.

    Returns:
        One ``Measured`` per rank, in rank order.

    Raises:
        UsageError: a bad argument, or a callable that cannot be pickled.
        TorchVersionError: this torch has no FSDP2 ``fully_shard`` (torch 2.4+).
        DistributedMeasureError: a rank
            could not start, raised, died or timed out.

    Known limitations:
        On gloo, reduce-scatter is emulated by cloning the whole (padded)
        unsharded gradient and allreducing the clone (``ProcessGroupGloo.cpp``
        ``reduce_scatter_tensor_coalesced``), and all-gather goes through a flat
        temporary on the worker thread; NCCL does neither, so these CPU peaks
        are higher than a GPU run's. Which thread frees gloo's temporaries
        is a race, so a rank's peak can differ from run to run by about one
        activation (2 MiB for the 256 x 2048 float MLP).
    """
    require_torch("fully_shard", "measure_fsdp_cpu (a real FSDP2 run)")
    options = {"wrap": wrap, "in_place": bool(in_place)}
    if mp_policy is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise UsageError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp_policy!r}")
        options["mp_policy"] = mp_policy
    return _run_ranks("fsdp", build, make_optimizer, loss_fn, world_size, steps, options, timeout_s)


def measure_tp_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn | None = None,
    world_size: int = 2,
    steps: int = 2,
    plan: dict[str, str] | None = None,
    sequence_parallel: bool = False,
    after: Callable[[torch.nn.Module, Any], torch.nn.Module] | None = None,
    engine: str = "torch",
    loss_parallel: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Measured]:
    """Train under tensor parallelism (DTensor ``parallelize_module``) on ``world_size`` CPU ranks and measure each.

    Every rank calls ``build()`` (the whole model, and the same batch on every
    rank: tensor-parallel ranks see the same tokens), then
    ``parallelize_module(model, init_device_mesh("cpu", (world_size,)), styles)``
    with ``styles`` the plan's transformers styles translated to torch's ``ColwiseParallel()`` and
    ``RowwiseParallel()`` (their defaults: ``use_local_output=True``, the
    row-wise output all-reduced to ``Replicate``; ``"colwise_gather_output"`` is
    ``ColwiseParallel(output_layouts=Replicate())``, ``"embedding_rowwise"``
    ``RowwiseParallel(input_layouts=Replicate())`` on the embedding; the styles that keep a module
    whole get none; see ``_tp_setup``), then
    ``make_optimizer(model.parameters())``, all inside the profiled region.
    ``sequence_parallel=True`` adds torchtitan's sequence-parallel styles for a transformers
    decoder (``_sequence_parallel_styles``): row-wise outputs ``Shard(1)``, ``SequenceParallel``
    norms, ``PrepareModuleInput`` cutting the first layer's input and gathering the attention
    (``hidden_states=`` keyword, ``input_kwarg_layouts``), MLP and LM head inputs.
    ``plan`` is ``{glob: style}`` with transformers' style names; by default the one
    ``memcheck.training.strategies.tp.resolve_plan`` reads from the model (the model's
    ``tp_plan`` as transformers applies it), the plan ``tp.shard`` emulates. ``after(model, mesh)``, if given, returns the model to train from the sharded one
    (LoRA put over it as PEFT does over a tensor-parallel model).

    ``engine="transformers"`` shards a transformers model with transformers' own code instead, as
    ``from_pretrained(tp_plan="auto")`` does after building the model
    (transformers/distributed/mixin.py ``maybe_distribute_model``): ``_resolve_parallel_plans``
    (the model's ``tp_plan``: ``_tp_plan`` of the class, the config's ``base_model_tp_plan`` and
    ``embed_tokens: embedding_rowwise``; or ``plan`` in its place), then
    ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``: every style of
    ``ALL_PARALLEL_STYLES``, not only the three torch ones.

    ``loss_parallel=True`` (``engine="torch"``): torchtitan's loss parallelism. The LM head
    (``get_output_embeddings()``) is ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``,
    its logits a vocabulary-sharded DTensor, and every step runs inside
    ``torch.distributed.tensor.parallel.loss_parallel()``, so the model's own cross-entropy runs on the shards.

    ``build``, ``make_optimizer``, ``loss_fn`` and ``after`` must be picklable module-level
    functions, as for ``measure_ddp_cpu``.

    Returns:
        One ``Measured`` per rank, in rank order.

    Raises:
        UsageError: a bad argument or plan, or a callable that cannot be pickled.
        DistributedMeasureError: this torch has no DTensor tensor parallelism, or
            a rank could not start, raised, died or timed out.

    Known limitations:
        The whole model is built on every rank before it is sharded (as in
        torch's tutorials), so the first step's peak holds the full weights
        for a moment; the steady peak, from step 2, does not. gloo's scratch
        (``malloc``, at most 2 MiB per all-reduce in flight) is not counted.
    """
    if plan is not None:
        from memcheck.training.strategies.tp import check_plan

        check_plan(plan)
    if not isinstance(sequence_parallel, bool):
        raise UsageError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    if engine not in ("torch", "transformers"):
        raise UsageError(f"engine must be 'torch' or 'transformers', got {engine!r}")
    if not isinstance(loss_parallel, bool):
        raise UsageError(f"loss_parallel must be True or False, got {loss_parallel!r}")
    if engine == "transformers" and loss_parallel:
        raise UsageError("loss_parallel=True is torchtitan's, measured with engine='torch'")
    if engine == "transformers" and sequence_parallel:
        raise UsageError("engine='transformers' measures transformers' own plan styles; sequence_parallel=True "
                         "is torchtitan's, measured with engine='torch'")
    return _run_ranks("tp", build, make_optimizer, loss_fn, world_size, steps,
                      {"plan": plan, "sequence_parallel": sequence_parallel, "after": after, "engine": engine,
                       "loss_parallel": loss_parallel},
                      timeout_s)


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # the schedules measure_pp_cpu runs


def measure_pp_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    world_size: int = 2,
    schedule: str = "1f1b",
    microbatches: int = 4,
    virtual: int = 1,
    steps: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Measured]:
    """Train pipeline stages on CPU ranks with ``torch.distributed.pipelining`` and measure each rank.

    ``build()`` returns a transformers causal LM whose decoder has ``embed_tokens``,
    ``layers`` and ``norm`` (LlamaForCausalLM and its kind) and one micro-batch
    ``{"input_ids": [mb, S], "labels": [mb, S]}``. Every rank builds the whole model and
    cuts its stage the way torchtitan does (its contiguous slice of the layers; the
    embedding on the first stage, the final norm and head on the last; the rest dropped),
    wraps it in a real ``PipelineStage`` and runs the real schedule (``ScheduleGPipe``,
    ``Schedule1F1B``, or ``ScheduleInterleaved1F1B`` with ``virtual`` stages per rank: rank r
    holds global stages ``c * world_size + r``, each cut from its own copy of the model and
    wrapped in its own ``PipelineStage``) for ``steps`` steps of ``microbatches`` micro-batches:
    ``schedule.step(..., return_outputs=False)`` (as torchtitan calls it), then
    ``optimizer.step()`` and ``zero_grad(set_to_none=True)``. The step's batch is the
    micro-batch repeated ``microbatches`` times, split by the schedule. The loss is the
    model's own (``model.loss_function``, a mean over tokens; the schedule's
    ``scale_grads`` divides the gradients by ``microbatches``). Build, cut and
    optimizer are inside the profiled region, as in ``measure_ddp_cpu``.

    Returns:
        One ``Measured`` per rank (= stage), in rank order.

    Raises:
        UsageError: a bad argument, a schedule other than ``PP_SCHEDULES``, more stages than
            layers, or a model without ``model.embed_tokens/layers/norm`` and ``lm_head``.
        DistributedMeasureError: a rank could not start, raised, died or timed out.

    Known limitations:
        gloo's send/recv work on the tensors themselves (no scratch); a gloo send ``Work``
        holds its tensor until the schedule drops the ``Work`` (NCCL's differ).
    """
    if schedule not in PP_SCHEDULES:
        raise UsageError(f"schedule must be one of {', '.join(PP_SCHEDULES)} for measure_pp_cpu, got {schedule!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise UsageError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if not isinstance(virtual, int) or virtual < 1 or (virtual > 1 and schedule != "interleaved-1f1b"):
        raise UsageError(f"virtual must be 1, or an integer >= 1 with schedule 'interleaved-1f1b', got {virtual!r}")
    options = {"schedule": schedule, "microbatches": microbatches, "virtual": virtual}
    return _run_ranks("pp", build, make_optimizer, None, world_size, steps, options, timeout_s)


def measure_ep_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn | None = None,
    world_size: int = 2,
    steps: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Measured]:
    """Train a mixture-of-experts model under expert parallelism on ``world_size`` CPU ranks and measure each.

    Every rank calls ``build()``, then ``memcheck.training.strategies.ep.shard_experts(model,
    world_size, rank=rank)`` over the default group, then ``make_optimizer(model.parameters())``,
    all inside the profiled region. torch has no expert-parallel module: the layer is memcheck's
    own (``ep.ExpertParallelDispatch``, written after torchtitan's ``ExpertParallel``), run with
    real all-to-all exchanges over a one-thread gloo group (``_FencedGlooGroup``: so that gloo's
    worker thread never holds the last reference to an exchanged tensor). No gradient is synchronised across ranks (no DDP or
    FSDP over the dense parameters): what is measured is the experts' sharding and the dispatch.

    ``build``, ``make_optimizer`` and ``loss_fn`` must be picklable module-level functions, as
    for ``measure_ddp_cpu``. Returns one ``Measured`` per rank, in rank order.
    """
    return _run_ranks("ep", build, make_optimizer, loss_fn, world_size, steps, {}, timeout_s)


def measure_cp_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn | None = None,
    world_size: int = 2,
    steps: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Measured]:
    """Train under torch's ``context_parallel`` on ``world_size`` CPU ranks and measure each.

    Every rank calls ``build()`` (a dict batch whose ``input_ids`` and ``labels`` are sharded
    along dimension 1, in place, with ``no_restore_buffers``, as torchtitan passes them), then
    ``make_optimizer``, then runs the steps inside ``context_parallel(mesh, buffers=...)``.

    torch 2.13's context parallelism has no CPU kernel: its SDPA handler and sharding rules
    cover the CUDA flash, efficient and cuDNN ops only, so on CPU it raises
    ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
    does not have a sharding strategy registered``. The ranks register the CPU flash kernel
    with it (``_register_cpu_flash_with_cp``): its sharding rules (the sequence dimension
    sharded, as for flash) and a handler that calls torch's own ``_templated_ring_attention``
    and ``_templated_ring_attention_backward`` with the CPU kernel, as
    ``_scaled_dot_product_ring_flash_attention`` does with CUDA flash. Everything else (the
    sharding and load balancing of the buffers, the ring, the merge, the rotations over gloo)
    is torch's code.
    """
    for name in ("context_parallel", "cp_attention", "cp_sharding_rules", "register_op_strategy",
                 "expand_to_full_mesh_op_strategy"):
        require_torch(name, "measure_cp_cpu (a real context-parallel run on CPU)")
    return _run_ranks("cp", build, make_optimizer, loss_fn, world_size, steps, {}, timeout_s)


FSDP1_SHARDING = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def measure_fsdp1_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn | None = None,
    world_size: int = 2,
    steps: int = 2,
    shardings: Sequence[str] = ("full_shard",),
    gpus_per_node: int | None = None,
    wrap: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] | None = None,
    in_place: bool = False,
    mixed_precision: Any = None,
    use_orig_params: bool = False,
    offload_params: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, list[Measured]]:
    """Train under FSDP1 (``FullyShardedDataParallel``) on ``world_size`` CPU ranks, once per sharding
    strategy in ``shardings``, and measure each rank each time.

    The ranks are started once; for each strategy every rank calls ``build()``, then wraps it in
    ``FullyShardedDataParallel(model, auto_wrap_policy=..., sharding_strategy=..., device_id=
    torch.device("cpu"))`` with one unit per module ``wrap(model)`` returns (by default the root's
    direct children that own parameters) and the root with the rest, then calls
    ``make_optimizer(fsdp.parameters())``, all inside that strategy's own profiled region. Every
    other FSDP1 setting is torch's default (``use_orig_params=False``, ``BACKWARD_PRE`` prefetch,
    ``limit_all_gathers=True``; ``use_orig_params=True`` as Lightning's and Accelerate's FSDP set it, for a
    unit mixing frozen and trainable parameters; ``mixed_precision``: a ``torch.distributed.fsdp.MixedPrecision``, None
    for none). ``hybrid_shard`` shards over groups of ``gpus_per_node`` ranks
    (default ``world_size``) through ``init_device_mesh("cpu", (world_size // gpus_per_node,
    gpus_per_node))``: without a mesh FSDP1 asks CUDA for the node size. ``build``,
    ``make_optimizer``, ``loss_fn`` and ``wrap`` must be picklable module-level functions, as for
    ``measure_ddp_cpu``.

    ``in_place=True`` runs all-gather and reduce-scatter as in-place broadcasts and reduces
    (``_InPlaceCollectives``), so gloo's staging copies, which NCCL does not make, are not measured.

    Returns:
        ``{sharding: [Measured of rank 0, rank 1, ...]}``, in the order of ``shardings``.

    Raises:
        UsageError: a bad argument, or a callable that cannot be pickled.
        DistributedMeasureError: a rank could not start, raised, died or timed out.

    Known limitations:
        ``offload_params=True`` (``CPUOffload(offload_params=True)``) does not run on a CPU as it is:
        FSDP1 pins the host shard and gradient (``_flat_param.py`` ``init_flat_param_attributes``:
        ``pin_memory()``), which needs an accelerator ("Cannot access accelerator device when none
        is available"), and its final callback synchronizes the device's stream, which a CPU
        ``Stream`` cannot; ``build`` must stub both in the rank (``tests/test_fsdp1_cpu.py`` does).
        The "device" is then the host: no host-to-device copy is made, and the host shards,
        ``_cpu_grad`` and the optimizer state are measured with the rest. On gloo, FSDP1 all-gathers a CPU flat parameter into a list of
        chunks (``_flat_param.py`` ``_all_gather_flat_param``, "HACK"), which gloo stages
        through a flat temporary of the whole padded unsharded size, and reduce-scatter
        clones its whole input (as for ``measure_fsdp_cpu``); NCCL makes neither copy.
    """
    shardings = (shardings,) if isinstance(shardings, str) else tuple(shardings)
    bad = [s for s in shardings if s not in FSDP1_SHARDING]
    if not shardings or bad:
        raise UsageError(f"shardings must name some of {', '.join(FSDP1_SHARDING)}, got {bad or shardings!r}")
    if gpus_per_node is not None:
        if "hybrid_shard" not in shardings:
            raise UsageError(f"gpus_per_node={gpus_per_node!r} applies to 'hybrid_shard', which shardings "
                             f"{shardings!r} leaves out")
        if (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1
                or not isinstance(world_size, int) or world_size % gpus_per_node):
            raise UsageError(f"gpus_per_node must be a positive integer dividing world_size={world_size!r}, "
                             f"got {gpus_per_node!r}")
    options = {"wrap": wrap, "shardings": shardings, "gpus_per_node": gpus_per_node, "in_place": bool(in_place)}
    if use_orig_params:
        options["use_orig_params"] = True
    if offload_params:
        options["offload_params"] = True
    if mixed_precision is not None:
        from torch.distributed.fsdp import MixedPrecision

        if not isinstance(mixed_precision, MixedPrecision):
            raise UsageError(f"mixed_precision must be a torch.distributed.fsdp.MixedPrecision, got {mixed_precision!r}")
        options["mixed_precision"] = mixed_precision
    ranks = _run_ranks("fsdp1", build, make_optimizer, loss_fn, world_size, steps, options, timeout_s)
    return {name: [rank[name] for rank in ranks] for name in shardings}


def measure_zero3_cpu(
    build: Callable[[], tuple[torch.nn.Module, Any]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    loss_fn: LossFn | None = None,
    world_size: int = 2,
    steps: int = 2,
    zero_optimization: dict | None = None,
    in_place: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Measured]:
    """Train under DeepSpeed ZeRO stage 3 on ``world_size`` CPU ranks (DeepSpeed's CPU accelerator, gloo) and
    measure each.

    Every rank calls ``build()`` inside ``deepspeed.zero.Init`` (so only the partitions are ever
    materialised, as the HF Trainer builds a model under ZeRO-3), makes the optimizer with
    ``make_optimizer`` on the trainable parameters, and calls ``deepspeed.initialize`` with
    ``{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zero_optimization},
    "zero_allow_untested_optimizer": true}`` (fp32, DeepSpeed's defaults otherwise), all inside the
    profiled region; each step is ``loss_fn(engine, batch)``, ``engine.backward(loss)``,
    ``engine.step()``, as DeepSpeed's own loop. ``build``, ``make_optimizer`` and ``loss_fn`` must be
    picklable module-level functions, as for ``measure_ddp_cpu``.

    ``in_place=True`` runs all-gather and reduce-scatter as in-place broadcasts and reduces
    (``_InPlaceCollectives``), so gloo's staging copies, which NCCL does not make, are not measured.

    Returns:
        One ``Measured`` per rank, in rank order.

    Raises:
        UsageError: a bad argument, or a callable that cannot be pickled.
        DistributedMeasureError: DeepSpeed is not installed, or a rank could not start, raised, died or
            timed out.

    Known limitations:
        DeepSpeed's communication backend builds a shared-memory all-reduce op for inference at start-up
        (a C++ extension compiled on first use, minutes); the ranks replace its builder with one that
        returns None (``deepspeed.comm.torch.build_shm_op``): training's collectives do not use it. The
        default ``reduce_bucket_size`` (5e8 elements, 2 GB in fp32) is allocated on every rank: pass a
        smaller one in ``zero_optimization``.
    """
    if zero_optimization is not None and not isinstance(zero_optimization, dict):
        raise UsageError(f"zero_optimization must be a dict of DeepSpeed ZeRO keys, got {zero_optimization!r}")
    if zero_optimization and zero_optimization.get("stage", 3) != 3:
        raise UsageError(f"measure_zero3_cpu runs stage 3, got stage={zero_optimization['stage']!r}")
    options = {"zero_optimization": dict(zero_optimization or {}), "in_place": bool(in_place)}
    return _run_ranks("zero3", build, make_optimizer, loss_fn, world_size, steps, options, timeout_s)


def _measure_zero3_rank(build, make_optimizer, loss_fn, steps, rank, world_size, *, zero_optimization) -> Measured:
    """One DeepSpeed ZeRO-3 rank over the process group ``_rank_main`` made."""
    try:
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401  (the module; the package's attribute ``torch`` is torch itself)
    except ImportError as e:
        raise DistributedMeasureError("measure_zero3_cpu needs DeepSpeed (pip install deepspeed)") from e
    # the inference all-reduce op, JIT-compiled otherwise (see the docstring)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # joins the existing group
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {**zero_optimization, "stage": 3}}
    loss_fn = loss_fn or default_loss

    def train():
        with deepspeed.zero.Init(config_dict_or_path=config):
            model, batch = build()
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        engine.train()
        for step in range(steps):
            mark_step(step, Phase.FORWARD)
            loss = loss_fn(engine, batch)
            engine.backward(loss)
            del loss
            engine.step()

    return _measured(train)


def _run_ranks(strategy, build, make_optimizer, loss_fn, world_size, steps, options, timeout_s) -> list[Measured]:
    """Validate, spawn one process per rank, and collect their ``Measured`` in rank order."""
    if not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be an integer >= 1, got {steps!r}")
    if not timeout_s > 0:
        raise UsageError(f"timeout_s must be positive, got {timeout_s!r}")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        raise DistributedMeasureError("this torch build has no torch.distributed gloo backend")
    callables = {"build": build, "make_optimizer": make_optimizer, "loss_fn": loss_fn, **options}
    for name, fn in callables.items():
        if callable(fn):
            try:
                pickle.dumps(fn)
            except Exception as e:  # pickling raises PicklingError, AttributeError or TypeError
                raise UsageError(
                    f"{name}={fn!r} cannot be sent to a spawned rank ({type(e).__name__}: {e}); "
                    "pass a module-level function of an importable module, not a lambda or closure"
                ) from None

    ctx = torch.multiprocessing.get_context("spawn")
    results: queue_module.Queue = ctx.Queue()
    processes = []
    grace_s = 0.0  # on any failure the ranks are stopped at once: a surviving rank waits in a collective
    with tempfile.TemporaryDirectory(prefix="memcheck-dist-") as tmp, _environ(_RANK_ENV):
        init_method = "file://" + os.path.join(tmp, "store")  # FileStore: no TCP port to collide on
        try:
            for rank in range(world_size):
                args = (rank, world_size, init_method, results, strategy, build, make_optimizer, loss_fn, steps,
                        options, timeout_s)
                process = ctx.Process(target=_rank_main, args=args, name=f"memcheck-{strategy}-rank{rank}", daemon=True)
                try:
                    process.start()
                except Exception as e:
                    raise DistributedMeasureError(
                        f"could not spawn rank {rank} of {world_size}: {type(e).__name__}: {e}"
                    ) from e
                processes.append(process)
            measured = _collect(results, processes, world_size, timeout_s)
            grace_s = _EXIT_GRACE_S
            return measured
        finally:
            _stop(processes, grace_s)


def _collect(results, processes, world_size, timeout_s) -> list[Measured]:
    """Wait for every rank's message; raise on the first error, death or the deadline."""
    deadline = time.monotonic() + timeout_s
    measured: dict[int, Measured] = {}
    while len(measured) < world_size:
        try:
            rank, ok, payload = results.get(timeout=_POLL_S)
        except queue_module.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(measured))
                raise DistributedMeasureError(f"ranks {missing} did not finish within {timeout_s:g} s") from None
            for rank, process in enumerate(processes):
                # A rank that exits 0 has already flushed its message; one that died did not send it.
                if rank not in measured and process.exitcode not in (None, 0):
                    raise DistributedMeasureError(
                        f"rank {rank} died with exit code {process.exitcode} before reporting "
                        "(killed for memory, or crashed while importing the model's module?)"
                    ) from None
            continue
        if not ok:
            raise DistributedMeasureError(f"rank {rank} failed:\n{payload}")
        measured[rank] = payload
    return [measured[rank] for rank in range(world_size)]


def _stop(processes, grace_s: float) -> None:
    """Give the ranks ``grace_s`` seconds to exit, then terminate and if need be kill them (ours, by handle)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


class _InPlaceCollectives:
    """All-gather and reduce-scatter as ``W`` in-place gloo broadcasts and reduces, for ``in_place=True``.

    gloo stages ``all_gather_single`` through a flat copy of the whole output and runs
    ``reduce_scatter_single`` on a clone of the whole input (``ProcessGroupGloo.cpp``,
    ``AsyncAllgatherWork`` / ``reduce_scatter_tensor_coalesced``); NCCL writes into the caller's
    output and reads the caller's input. A gloo broadcast and reduce work on the tensor itself, so
    a collective built from them allocates nothing in the c10 allocator, as NCCL's: rank ``r``'s
    chunk of the output is broadcast from ``r`` (all-gather); chunk ``r`` of the input is reduced
    onto ``r`` and copied to the output (reduce-scatter; the input, a scratch buffer of the caller,
    is overwritten on the other ranks). ``torch.distributed``'s functions (and the
    ``distributed_c10d`` globals its deprecated aliases call) are replaced for the life of the
    rank; the values of the results are the same, the speed is not.

    A synchronous collective returns only after a short pause for gloo's worker thread (``_settle``, at
    most ``SETTLE_S``, while the storage holds more references than on entry): the worker drops its
    references after marking the work complete, so a buffer the caller frees right after the
    collective could be freed later, on that thread, while the caller allocates the next one, a
    CPU-only overlap that made a rank's peak differ from run to run (FSDP1 with a MixedPrecision: one
    run in three, rank 1 +11%). One reference outlives the pause on every reduce-scatter input (held
    outside Python's reach), so the pause is a bound, not a proof."""

    SETTLE_S = 0.02  # seconds: far above the worker's hand-off, small beside a step

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_gather")

    def __enter__(self):
        dist, c10d = torch.distributed, torch.distributed.distributed_c10d
        self.saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d) for name in self.NAMES
                      if hasattr(mod, name)]
        self.broadcast, self.reduce = c10d.broadcast, c10d.reduce
        for mod, name, _ in self.saved:
            setattr(mod, name, getattr(self, name))
        return self

    def __exit__(self, *exc):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)

    @staticmethod
    def _finish(works, async_op):
        for work in works[:-1]:
            work.wait()
        if not async_op:
            works[-1].wait()
            return None
        return works[-1]

    @staticmethod
    def _uses(tensor: torch.Tensor) -> int:
        """How many references the tensor's storage has (views and gloo's pending work hold one each)."""
        return compat.storage_use_count(tensor.untyped_storage()._cdata)

    @classmethod
    def _settle(cls, tensor: torch.Tensor, uses: int) -> None:
        """Wait (at most ``SETTLE_S``) until ``tensor``'s storage is back to the ``uses`` it had before the
        collective, gloo's worker thread having dropped its references."""
        deadline = time.monotonic() + cls.SETTLE_S
        while cls._uses(tensor) > uses and time.monotonic() < deadline:
            time.sleep(0.0002)

    def all_gather_single(self, output_tensor, input_tensor, group=None, async_op=False):
        world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        uses = self._uses(output_tensor)
        chunks = output_tensor.view(-1).chunk(world)
        chunks[rank].copy_(input_tensor.reshape(-1))
        works = [self.broadcast(chunk, group=group, group_src=r, async_op=True) for r, chunk in enumerate(chunks)]
        result = self._finish(works, async_op)
        if not async_op:
            del chunks, works
            self._settle(output_tensor, uses)
        return result

    all_gather_into_tensor = all_gather_single

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        rank = torch.distributed.get_rank(group)
        tensor_list[rank].copy_(tensor)
        works = [self.broadcast(t, group=group, group_src=r, async_op=True) for r, t in enumerate(tensor_list)]
        return self._finish(works, async_op)

    def reduce_scatter_single(self, output, input, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        uses = self._uses(input)
        chunks = input.view(-1).chunk(world)
        works = [self.reduce(chunk, group=group, group_dst=r, op=op, async_op=True) for r, chunk in enumerate(chunks)]
        for work in works:
            work.wait()
        output.view(-1).copy_(chunks[rank])
        result = self._finish(works, async_op)
        if not async_op:
            del chunks, works
            self._settle(input, uses)
        return result

    reduce_scatter_tensor = reduce_scatter_single


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for the spawned ranks, restoring the parent's afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rank_main(rank, world_size, init_method, results, strategy, build, make_optimizer, loss_fn, steps, options,
               timeout_s) -> None:
    """Entry point of one spawned rank: join the group, measure, report ``(rank, ok, payload)``."""
    dist = torch.distributed
    options = dict(options)
    in_place = options.pop("in_place", False)
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        if in_place:
            _InPlaceCollectives().__enter__()  # for the life of this spawned rank
        if strategy == "zero3":
            report = (rank, True, _measure_zero3_rank(build, make_optimizer, loss_fn, steps, rank, world_size,
                                                      **options))
        elif strategy == "pp":
            report = (rank, True, _measure_pp_rank(build, make_optimizer, loss_fn, steps, rank, world_size,
                                                   **options))
        elif strategy == "fsdp1":  # each sharding strategy in turn, each measured on its own
            shardings, rest = options["shardings"], {k: v for k, v in options.items() if k != "shardings"}
            report = (rank, True, {name: _measure_rank(_fsdp1_setup(build, world_size, sharding=name, **rest),
                                                       make_optimizer, loss_fn or default_loss, steps)
                                   for name in shardings})
        else:
            if strategy == "ddp":
                setup = _ddp_setup(build, **options)
            elif strategy == "cp":
                setup = _cp_setup(build, world_size)
            elif strategy == "ep":
                setup = _ep_setup(build, rank, world_size, timeout_s)
            elif strategy == "tp":
                setup = _tp_setup(build, world_size, **options)
            else:
                setup = _fsdp_setup(build, world_size, **options)
            report = (rank, True, _measure_rank(setup, make_optimizer, loss_fn or default_loss, steps))
    except BaseException:  # report everything, KeyboardInterrupt included: the parent is waiting
        report = (rank, False, traceback.format_exc())
    results.put(report)  # before the teardown, which can block while a peer is stuck in a collective
    if dist.is_initialized():
        dist.destroy_process_group()


def _ddp_setup(build, *, bucket_cap_mb, gradient_as_bucket_view):
    def setup():
        model, batch = build()
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view
        )
        return ddp, batch

    return setup


def _cp_setup(build, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    context_parallel = require_torch("context_parallel", "measure_cp_cpu (a real context-parallel run on CPU)")

    _register_cpu_flash_with_cp()
    mesh = init_device_mesh("cpu", (world_size,))

    def setup():
        model, batch = build()
        buffers = [batch["input_ids"], batch["labels"]]
        sharded = context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1], no_restore_buffers=set(buffers))
        return model, batch, sharded

    return setup


def _register_cpu_flash_with_cp() -> None:
    """Let torch's context parallelism run the CPU flash kernel (``measure_cp_cpu``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    setting = "measure_cp_cpu (a real context-parallel run on CPU)"
    cp, rules = require_torch("cp_attention", setting), require_torch("cp_sharding_rules", setting)
    register_op_strategy = require_torch("register_op_strategy", setting)
    expand_to_full_mesh_op_strategy = require_torch("expand_to_full_mesh_op_strategy", setting)

    aten = torch.ops.aten
    forward, backward = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if forward in cp.custom_ops:
        return

    def forward_strategy(op_schema):  # outputs (output, logsumexp), inputs q, k, v
        strategies = [[Replicate()] * 5, [Shard(rules.SEQ_DIM)] * 5]
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, strategies, input_index=2)

    def backward_strategy(op_schema):  # outputs dq, dk, dv; inputs grad_out, q, k, v, out, logsumexp
        strategies = [[Replicate()] * 9, [Shard(rules.SEQ_DIM)] * 9]
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                               strategies, input_index=3)

    def ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        if attn_mask is not None:
            raise NotImplementedError("context parallel attention takes no mask")
        return cp._templated_ring_attention(mesh.get_group(), rules.SEQ_DIM, forward, query=query, key=key,
                                            value=value, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                      scale=None):
        return cp._templated_ring_attention_backward(
            mesh.get_group(), rules.SEQ_DIM, backward, grad_out=grad_out, grad_out_name="grad_out", query=query,
            key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
            scale=scale)

    def handler(op_call, args, kwargs):  # cp._sdpa_handler, with the CPU kernel
        op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
        output_sharding = op_info.output_sharding
        ring = ring_forward if op_call is forward else ring_backward
        results = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
        return DTensor._op_dispatcher.wrap(results, output_sharding.output_spec)

    for op, strategy in ((forward, forward_strategy), (backward, backward_strategy)):
        register_op_strategy(op)(strategy)  # for the life of the rank
        cp.custom_ops[op] = handler


def _ep_setup(build, rank, world_size, timeout_s):
    from memcheck.training.strategies.ep import shard_experts

    group = _FencedGlooGroup(rank, world_size, timeout_s)

    def setup():
        model, batch = build()
        return shard_experts(model, world_size, rank=rank, group=group), batch

    return setup


class _FencedGlooGroup:
    """A gloo group with one worker thread whose all-to-all returns once gloo has let go of its tensors.

    ``ProcessGroupGloo``'s worker thread holds its own reference to a collective's work, and
    through it to the input and output tensors, until it has finished the work and moved on
    (``ProcessGroupGloo.cpp``, ``runLoop``), which can be after the caller's ``wait`` has
    returned and the caller has dropped its references. The last reference to the exchange's
    input then dies on the worker thread, at a moment that races the caller's next
    allocations (seen: +64 KiB on one rank of a 2.9 MB EP run, in one run of four). With one
    worker thread, a one-element allreduce queued after the exchange starts only once the
    worker has let go of the exchange, so every free happens on the caller's thread, where a
    GPU run's happen. The fence's tensor is allocated once, before the steps.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        dist = torch.distributed
        store = dist.PrefixStore("memcheck-ep/", dist.distributed_c10d._get_default_store())
        options = dist.ProcessGroupGloo._Options()
        options._threads = 1
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        self.backend = dist.ProcessGroupGloo(store, rank, world_size, options)
        self.fence = torch.zeros(1)

    def all_to_all_single(self, out, x, output_splits, input_splits) -> None:
        dist = torch.distributed
        self.backend.alltoall_base(out, x, list(output_splits or []), list(input_splits or []),
                                   dist.AllToAllOptions()).wait()
        self.backend.allreduce([self.fence]).wait()


def _fsdp_setup(build, world_size, *, wrap, mp_policy=None):
    fully_shard = require_torch("fully_shard", "measure_fsdp_cpu (a real FSDP2 run)")
    from torch.distributed.device_mesh import init_device_mesh

    def setup():
        model, batch = build()
        mesh = init_device_mesh("cpu", (world_size,))
        blocks = wrap(model) if wrap is not None else _children_with_parameters(model)
        extra = {} if mp_policy is None else {"mp_policy": mp_policy}
        for block in blocks:
            fully_shard(block, mesh=mesh, **extra)
        fully_shard(model, mesh=mesh, **extra)
        return model, batch

    return setup


def _tp_setup(build, world_size, *, plan, sequence_parallel=False, after=None, engine="torch", loss_parallel=False):
    if engine == "transformers":
        return _transformers_tp_setup(build, world_size, plan=plan, after=after)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)
    except ImportError as e:
        raise DistributedMeasureError(f"this torch ({torch.__version__}) has no DTensor tensor parallelism") from e
    from torch.distributed.tensor import Replicate, Shard

    from memcheck.training.strategies.tp import STYLE_KINDS, resolve_plan

    def torch_style(key, style):
        # transformers' styles (transformers/distributed/tensor_parallel.py:599-622) as torch's own: the same
        # placements and redistributions (torch/distributed/tensor/parallel/style.py), or None for the styles
        # that leave the parameters whole and allocate nothing.
        kind = STYLE_KINDS[style]
        if kind == "linear_colwise":
            return ColwiseParallel()
        if kind == "linear_gather":  # colwise_gather_output / colwise_rep; under SP its input is Shard(1)
            return ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                   output_layouts=Replicate())
        if kind == "linear_rowwise":
            return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        if kind == "linear_rowwise_replicated_input":
            return RowwiseParallel(input_layouts=Replicate())
        if kind == "embedding_rowwise":  # RowwiseParallel on nn.Embedding: weight Shard(0), ids Replicate
            return RowwiseParallel(input_layouts=Replicate())
        if kind == "embedding_colwise":  # ColwiseParallel on nn.Embedding: weight Shard(1), output gathered
            return ColwiseParallel(output_layouts=Replicate())
        if kind == "whole":
            return None
        raise UsageError(f"tensor-parallel style {style!r} ({key!r}) has no torch equivalent; measure it with "
                         "engine='transformers'")

    def setup():
        model, batch = build()
        mesh = init_device_mesh("cpu", (world_size,))
        resolved = resolve_plan(model, plan)
        styles = {key: torch_style(key, style) for key, style in resolved.items()}
        styles = {key: style for key, style in styles.items() if style is not None}
        if sequence_parallel:
            sp_styles = _sequence_parallel_styles(model, Replicate, Shard, PrepareModuleInput, SequenceParallel)
            styles.update({key: style for key, style in sp_styles.items() if key not in styles})
        if loss_parallel:  # torchtitan's apply_tp: the output layer keeps its logits sharded as a DTensor
            from memcheck.training.strategies.tp import _head_name

            styles[_head_name(model)] = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                                        output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, mesh, styles)
        if after is not None:
            model = after(model, mesh)
        if loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

            return model, batch, parallel_loss()
        return model, batch

    return setup


def _transformers_tp_setup(build, world_size, *, plan, after=None):
    """transformers' own tensor parallelism (transformers/distributed/mixin.py ``maybe_distribute_model``,
    the ``tp_size > 1`` branch) on a model built whole on every rank: the plan resolved and expanded
    by ``_resolve_parallel_plans``, then ``apply_tensor_parallelism`` (distributed/tensor_parallel.py),
    which shards each named parameter with its style's ``shard_param`` (``distribute_tensor(...,
    src_data_rank=None)``: each rank keeps its own chunk, no communication) and installs the style's
    forward on each named module."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.configuration_utils import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError as e:
        raise DistributedMeasureError(f"this transformers has no DTensor tensor parallelism ({e})") from e

    def setup():
        model, batch = build()
        mesh = init_device_mesh("cpu", (world_size,))
        if not hasattr(model, "_resolve_parallel_plans"):  # a plain nn.Module: the plan expanded as transformers
            from memcheck.training.strategies.tp import match_plan  # expands it (mixin.py _expand_parallel_plan):

            tp_plan = {}  # each matched module's own parameters (to shard), then the module (to hook)
            for name, style in match_plan(model, plan or {}).items():
                for param in model.get_submodule(name)._parameters:
                    tp_plan[f"{name}.{param}"] = style
                tp_plan[name] = style
        else:
            if plan is not None:
                model.tp_plan = dict(plan)  # the job's plan replaces the model's, as memcheck's tp_plan does
            tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=world_size))
        apply_tensor_parallelism(model, mesh, tp_plan)
        if after is not None:
            model = after(model, mesh)
        return model, batch

    return setup


def _sequence_parallel_styles(model, Replicate, Shard, PrepareModuleInput, SequenceParallel) -> dict:
    """torchtitan's sequence-parallel styles (llama3/infra/parallelize.py ``apply_tp``) for a transformers decoder.

    transformers' ``LlamaModel.forward`` builds positions and the causal mask from the
    embedding's whole sequence, so the cut comes at the first decoder layer's input
    (Replicate -> Shard(1)); the norms run on ``[B, S/T, H]`` (``SequenceParallel``); the
    attention (``hidden_states=`` keyword) and MLP inputs are gathered (Shard(1) -> Replicate);
    the final norm's output is gathered before the LM head, which stays whole.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    head = f"{prefix}." if isinstance(base, torch.nn.Module) and base is not model else ""
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    styles = {
        f"{head}layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True),
        f"{head}layers.*.input_layernorm": SequenceParallel(),
        f"{head}layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                        use_local_output=True),
        f"{head}layers.*.post_attention_layernorm": SequenceParallel(),
        f"{head}layers.*.mlp": PrepareModuleInput(**gather),
        f"{head}norm": SequenceParallel(),
    }
    if head:
        styles["lm_head"] = PrepareModuleInput(**gather)
    return styles


class HFCausalLMStage(torch.nn.Module):
    """One pipeline stage of a transformers causal LM, cut the way torchtitan cuts its models
    (``torchtitan/distributed/pipeline_parallel.py``: a copy of the model with the other stages'
    layers deleted and the embedding / norm / output set to None where the stage does not hold them).

    transformers' decoder (``LlamaModel.forward``) cannot skip a missing embedding or norm, so
    the decoder keeps its own ``forward`` on the kept ``layers`` only: the first stage feeds it
    ``input_ids``, the others ``inputs_embeds`` (the received activation); the norm of a non-last
    stage is an ``Identity`` and its output is the last kept layer's output. The last stage runs
    the head on ``hidden_states[:, slice(0, None), :]`` exactly as ``LlamaForCausalLM.forward``
    does (``logits_to_keep=0``), and the schedule's loss is the model's own ``loss_function``.
    """

    def __init__(self, causal_lm: torch.nn.Module, first: bool, last: bool, layers: range):
        super().__init__()
        decoder = causal_lm.model
        decoder.layers = torch.nn.ModuleList(decoder.layers[i] for i in layers)
        decoder.config.use_cache = False  # training: no KV cache, as torchtitan's models have none
        if not first:
            decoder.embed_tokens = None
        if not last:
            decoder.norm = torch.nn.Identity()
        self.decoder = decoder
        self.first = first
        self.lm_head = causal_lm.lm_head if last else None

    def forward(self, x):
        out = self.decoder(input_ids=x) if self.first else self.decoder(inputs_embeds=x)
        hidden = out.last_hidden_state
        if self.lm_head is None:
            return hidden
        return self.lm_head(hidden[:, slice(0, None), :])


def _hf_stage(model: torch.nn.Module, index: int, stages: int) -> tuple[torch.nn.Module, Callable]:
    """``(stage module, loss_fn(logits, target))`` of global stage ``index`` of ``stages`` for a
    transformers causal LM (the model is cut in place)."""
    decoder = getattr(model, "model", None)
    if not all(hasattr(decoder, n) for n in ("embed_tokens", "layers", "norm")) or not hasattr(model, "lm_head"):
        raise UsageError(f"measure_pp_cpu cuts transformers causal LMs with model.embed_tokens/layers/norm and "
                         f"lm_head (LlamaForCausalLM and its kind), not {type(model).__name__}")
    blocks = len(decoder.layers)
    if stages > blocks:
        raise UsageError(f"{stages} pipeline stages for {blocks} layers of {type(model).__name__}: "
                         "at most one stage per layer")
    first, count = _stage_span(blocks, stages, index)
    vocab = model.config.vocab_size
    loss_function = model.loss_function

    def loss_fn(logits, target):
        return loss_function(logits=logits, labels=target, vocab_size=vocab)

    return HFCausalLMStage(model, index == 0, index == stages - 1, range(first, first + count)), loss_fn


def _stage_span(blocks: int, stages: int, index: int) -> tuple[int, int]:
    """(first block, number of blocks) of stage ``index``: contiguous, the first ``blocks % stages`` stages one
    more (torchtitan's even split when ``stages`` divides ``blocks``)."""
    base, extra = divmod(blocks, stages)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def _measure_pp_rank(build, make_optimizer, loss_fn, steps, rank, world_size, *, schedule, microbatches,
                     virtual) -> Measured:
    """One pipeline rank: build, cut its stage(s), wrap each in ``PipelineStage``, run the schedule ``steps`` times."""
    import copy

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def train():
        model, batch = build()
        total = world_size * virtual
        modules, stages = [], []
        for chunk in range(virtual):  # torchtitan: one deep copy of the model per stage, the rest deleted
            index = chunk * world_size + rank
            module, stage_loss = _hf_stage(copy.deepcopy(model) if virtual > 1 else model, index, total)
            modules.append(module)
            stages.append(PipelineStage(module, index, total, torch.device("cpu")))
        del model
        step_batch = {k: torch.cat([v] * microbatches) for k, v in batch.items()}
        del batch
        if schedule == "interleaved-1f1b":
            pipe = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=stage_loss)
        else:
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            pipe = kind(stages[0], n_microbatches=microbatches, loss_fn=stage_loss)
        optimizer = make_optimizer([p for module in modules for p in module.parameters()])
        first, last = rank == 0, rank == world_size - 1
        for step in range(steps):
            mark_step(step, Phase.FORWARD)
            target = step_batch["labels"] if last else None
            losses = [] if last else None
            if first:
                pipe.step(step_batch["input_ids"], target=target, losses=losses, return_outputs=False)
            else:
                pipe.step(target=target, losses=losses, return_outputs=False)
            del losses
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return _measured(train)

def _fsdp1_setup(build, world_size, *, wrap, sharding, gpus_per_node, mixed_precision=None, use_orig_params=False,
                 offload_params=False):
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    def setup():
        model, batch = build()
        units = {id(m) for m in (wrap(model) if wrap is not None else _children_with_parameters(model))}
        extra = {} if mixed_precision is None else {"mixed_precision": mixed_precision}
        if use_orig_params:
            extra["use_orig_params"] = True
        if offload_params:
            from torch.distributed.fsdp import CPUOffload

            extra["cpu_offload"] = CPUOffload(offload_params=True)
        if sharding == "hybrid_shard":
            from torch.distributed.device_mesh import init_device_mesh

            per_node = gpus_per_node or world_size
            extra["device_mesh"] = init_device_mesh("cpu", (world_size // per_node, per_node))
        fsdp = FullyShardedDataParallel(
            model, auto_wrap_policy=CustomPolicy(lambda m: id(m) in units),
            sharding_strategy=ShardingStrategy[sharding.upper()], device_id=torch.device("cpu"), **extra,
        )
        return fsdp, batch

    return setup


def _children_with_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [child for child in model.children() if any(True for _ in child.parameters())]


def _measure_rank(setup, make_optimizer, loss_fn, steps) -> Measured:
    """``measure_cpu``'s measurement, with ``setup()`` (build and wrap) inside the profiled region."""

    def train():
        model, batch, *around = setup()  # a context to run the steps in (cp), or none
        optimizer = make_optimizer(model.parameters())
        with around[0] if around else contextlib.nullcontext():
            run_steps(model, batch, loss_fn, optimizer, steps, mark_step)

    return _measured(train)


def _measured(train: Callable[[], None]) -> Measured:
    """Run ``train()`` under the profiler with process-wide accounting; its peaks from the allocator's events
    (the steady peak from the ``STEP_MARK.1`` marker on)."""
    with _process_wide_cpu_accounting() as process_wide:
        with profile(use_cpu=True, profile_memory=True) as prof:
            train()
    events, step_start = allocator_events(prof.kineto_results.experimental_event_tree())
    live = live_bytes_process_wide(events) if process_wide else live_bytes_paired(events)
    steady_from = step_start.get(1, step_start.get(0, 0))
    peak = max((n for _, n in live), default=0)
    steady = max((n for t, n in live if t >= steady_from), default=0)
    return Measured(peak_bytes=max(peak, 0), steady_peak_bytes=max(steady, 0))


@contextlib.contextmanager
def _process_wide_cpu_accounting():
    """Make the CPU allocator count every thread's allocations while profiling; yields whether it could.

    ``c10::ProfiledCPUMemoryReporter`` (``c10/core/CPUAllocator.cpp``) updates its
    running total only on threads where the profiler is active, unless the flag
    ``caffe2_report_cpu_memory_usage`` is set. gloo frees some tensors on its
    worker threads outside the profiler's thread-local state (the last
    reference to a collective's temporary is dropped there), so without the
    flag those frees vanish. With it, each recorded event's ``total_allocated``
    is the process's live bytes, whichever thread last changed them. The flag
    is a global of libc10, reached through ctypes; it is set only in a spawned
    rank and restored on exit.
    """
    flag = None
    try:
        import ctypes

        libc10 = next((torch.__path__[0] + "/lib/" + name for name in ("libc10.so", "libc10.dylib")
                       if os.path.exists(torch.__path__[0] + "/lib/" + name)), None)
        if libc10 is not None:
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(libc10), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):  # no such library or symbol in this build
        flag = None
    if flag is None:
        yield False
        return
    saved = flag.value
    flag.value = True
    try:
        yield True
    finally:
        flag.value = saved


def allocator_events(event_tree) -> tuple[list[tuple[int, int, int, int]], dict[int, int]]:
    """The CPU allocator's events in time order, and ``{step: start_ns}`` from the ``STEP_MARK`` markers.

    ``event_tree`` is ``prof.kineto_results.experimental_event_tree()``;
    each event is ``(start_ns, signed nbytes, total_allocated, ptr)``. The sort
    is stable, so events with the same timestamp keep the tree's order.
    """
    allocation = compat.ExtraFieldsAllocation
    events = []
    step_start: dict[int, int] = {}
    stack = list(reversed(event_tree))
    while stack:
        node = stack.pop()
        extra = node.extra_fields
        if isinstance(extra, allocation):
            if extra.device.type == "cpu" and extra.alloc_size != 0:
                events.append((node.start_time_ns, extra.alloc_size, extra.total_allocated, extra.ptr))
            continue
        if node.name.startswith(STEP_MARK + "."):
            step_start[int(node.name.rsplit(".", 1)[1])] = node.start_time_ns
        stack.extend(reversed(node.children))
    events.sort(key=lambda e: e[0])
    return events, step_start


def live_bytes_process_wide(events) -> list[tuple[int, int]]:
    """``(start_ns, live bytes)`` after each event, from the allocator's process-wide running total.

    The baseline is the total just before the first event, so bytes live
    before profiling began are not counted, as in ``measure_cpu``.
    """
    if not events:
        return []
    base = events[0][2] - events[0][1]
    return [(t, total - base) for t, _, total, _ in events]


def live_bytes_paired(events) -> list[tuple[int, int]]:
    """``(start_ns, live bytes)`` after each event, pairing allocations and frees by address.

    The fallback when the allocator cannot count every thread: a free of a block
    allocated before profiling began is dropped, and a block whose free was
    never recorded is taken as freed just before its address is allocated again
    (or never, if it is not), so the result is an upper bound.
    """
    live_blocks: dict[int, int] = {}
    live = 0
    out = []
    for t, n, _, ptr in events:
        if n > 0:
            live -= live_blocks.pop(ptr, 0)  # a free that was not recorded
            live_blocks[ptr] = n
            live += n
        elif live_blocks.get(ptr) == -n:
            del live_blocks[ptr]
            live += n
        out.append((t, live))
    return out
