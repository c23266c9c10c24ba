"""``zero1``/``zero2``/``zero3``: DeepSpeed ZeRO, emulated on one rank (what ``_sharding.py``
says of every sharded strategy holds here); sources: DeepSpeed 0.19.8 ``deepspeed/runtime/zero/``.

**zero1/zero2** (``stage_1_and_2.py``): the trainable parameters become one flat
buffer per dtype, padded to ``2W`` elements (387, 441-446); the rank's partition is
cloned to an fp32 master (560) on which the optimizer steps; the first gradient hook
of a backward allocates the IPG bucket (``setup_buckets``, 3256), freed at the
epilogue. Stage 2 copies each gradient into the bucket as it arrives, and a full
bucket is all-reduced through a flattened copy (``allreduce_bucket``, 2367); the
gradients of the parameters in the rank's partition are copied to
``grads_in_partition`` (2184), kept until the step. Stage 1 keeps autograd's full
gradients until the end of backward, then runs the same reduction (958-978). At the
step the partition's gradients are flattened and cast to fp32 (3114-3118).

**zero3** (``stage3.py``, ``partition_parameters.py``, ``partitioned_param_coordinator.py``):
each parameter is split into ``ceil(numel/W)``-element partitions (1690-1817), the
trainable ones in one buffer per dtype; the fp32 master is a copy, also when the model is
fp32: the branch meant to reuse the partition (1162-1163) compares the partition's
``torch.device`` with ``self.device``, the accelerator's device name as a string
(``current_device_name()``, 333), which is never equal, so the copy of 1169-1172 runs
(seen on CPU ranks: a clone of the trainable partition); the IPG bucket and the gradient
partition buffer are allocated once (780, 791). Each module's parameters are
gathered at its pre-forward and pre-backward: one flat buffer, then a full copy per
parameter (``AllGatherCoalescedHandle.wait``), ~2x while both live; one parameter
alone is a padded buffer. After the module's forward, and in backward once the gradients
of its grad-requiring forward inputs are computed (``PostBackwardFunctionModule`` on each
input, ``parameter_offload.py:437-442``, ``493-528``: whether or not its own parameters
are trainable; a module whose inputs need no gradient is released at the end of
backward, ``release_backward_leftovers``, ``partitioned_param_coordinator.py:554-566``),
they are released unless they are
persistent (at most 1e5 elements) or, once step 1 has recorded the module trace,
used again within ``max_reuse_distance`` elements of the trace; later modules are
prefetched up to ``prefetch_bucket_size`` elements. Gradients are copied into the
bucket, reduce-scattered through a concatenated copy (``coalesced_collectives.py:81``)
and added into the gradient partitions. The step releases every gathered
parameter, flattens and casts each sub-group's gradients and re-gathers the
persistent ones. ``offload="optimizer"`` puts the master, the optimizer state and the
gradient partitions in host memory; ``offload="params"`` (``offload_param`` with
``offload_optimizer``) also the parameter partitions, except persistent ones.

DeepSpeed's bf16/fp16 modes (low-precision weights, fp32 master) are
``precision="bf16"``/``"fp16"``; ``amp-*`` keeps fp32 weights under autocast, as
DeepSpeed's ``torch_autocast`` does.
"""

from __future__ import annotations

import collections

import torch

from memcheck.enums import Category, Offload, Phase, Strategy
from memcheck.errors import UsageError
from memcheck.training.strategies._sharding import _empty, _Emulation, _tensors, after_input_gradients, train_sharded
from memcheck.training.strategies.base import Run

# DeepSpeed 0.19.8 defaults, deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig), all in elements:
REDUCE_BUCKET_SIZE = int(5e8)  # reduce_bucket_size (line 113)
PREFETCH_BUCKET_SIZE = int(5e7)  # stage3_prefetch_bucket_size (222)
PARAM_PERSISTENCE_THRESHOLD = int(1e5)  # stage3_param_persistence_threshold (228)
MAX_LIVE_PARAMETERS = int(1e9)  # stage3_max_live_parameters (245)
MAX_REUSE_DISTANCE = int(1e9)  # stage3_max_reuse_distance (251)
SUB_GROUP_SIZE = int(1e9)  # sub_group_size (182)
NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py:387: flat buffer padded to a multiple of 2*W elements


def train(run: Run) -> list[int]:
    """Rank 0 of ``zero1``-``zero3``; under zero3 the model is built on meta (``deepspeed.zero.Init``)."""
    config, tracer, model = run.config, run.tracer, run.model
    reduce_bucket = REDUCE_BUCKET_SIZE if config.reduce_bucket_size is None else config.reduce_bucket_size
    if config.strategy is Strategy.ZERO3:
        prefetch = PREFETCH_BUCKET_SIZE if config.prefetch_bucket_size is None else config.prefetch_bucket_size
        live = MAX_LIVE_PARAMETERS if config.max_live_parameters is None else config.max_live_parameters
        return train_sharded(run, lambda: _MetaZero3(tracer, model, config.gpus, config.offload, reduce_bucket,
                                                     prefetch, live), built_on_meta=True)
    stage = 1 if config.strategy is Strategy.ZERO1 else 2
    offload = config.offload is Offload.OPTIMIZER
    return train_sharded(run, lambda: _MetaZero12(tracer, model, config.gpus, stage, offload, run.accumulate,
                                                  reduce_bucket), built_on_meta=False)


def _e(n: int) -> str:
    """``5e8`` for 500000000: DeepSpeed's config values as its docs write them (``589,824`` when not round)."""
    text = f"{n:.0e}"
    if n < 1000 or float(text) != n:
        return f"{n:,}"
    return text.replace("e+0", "e").replace("e+", "e")


def _trainable_by_dtype(params: list) -> dict[torch.dtype, list]:
    """The trainable parameters, grouped by dtype in order of first appearance."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    return by_dtype


def _assume_zero_common(tracer, name: str) -> None:
    tracer.assume(f"{name}: the chosen optimizer steps on the flat fp32 partition (DeepSpeed's default "
                  "FusedAdam allocates no step temporaries); the fp32 master counts as optimizer state")
    if tracer.autocast is not None:
        tracer.assume(f"{name} with autocast: fp32 weights under torch.autocast (DeepSpeed's torch_autocast); "
                      "DeepSpeed's bf16/fp16 modes are precision='bf16'/'fp16'")


# ---- DeepSpeed ZeRO-1/2 ---------------------------------------------------------------------


class _ZeroGroup:
    """One dtype's trainable parameters: flat buffer, partition, fp32 master."""

    def __init__(self, zero: "_MetaZero12", params: list, world: int, offload: bool):
        tracer = zero.tracer
        self.params, self.dtype = params, params[0].dtype
        align = NCCL_START_ALIGNMENT_FACTOR * world
        total = sum(p.numel() for p in params)
        self.aligned = -(-total // align) * align
        self.partition = self.aligned // world
        self.flat = _empty(tracer, self.aligned, self.dtype, Category.PARAMETER, "(ZeRO flat params)")
        offset, self.in_partition = 0, set()
        for p in params:  # rank 0's partition [0, partition): the parameters that overlap it, whole
            if offset < self.partition and p.numel():
                self.in_partition.add(id(p))
            offset += p.numel()
        self.in_partition_numel = sum(p.numel() for p in params if id(p) in self.in_partition)
        self.master = (zero.host(self.partition, torch.float32) if offload else
                       _empty(tracer, self.partition, torch.float32, Category.OPTIMIZER, "(ZeRO fp32 master)"))
        self.master.requires_grad_(True)
        self.host_grad = zero.host(self.partition, torch.float32) if offload else None


class _MetaZero12(_Emulation):
    """DeepSpeed ZeRO stage 1 or 2 on one rank."""

    def __init__(self, tracer, model: torch.nn.Module, world: int, stage: int, offload: bool, accumulate: int,
                 reduce_bucket: int = REDUCE_BUCKET_SIZE):
        super().__init__(tracer, model, world, frozen_sharded=False)  # frozen parameters are not flattened
        self.stage, self.offload, self.accumulate = stage, offload, accumulate
        self.reduce_bucket = reduce_bucket  # reduce_bucket_size, elements
        self._flatten_parameters()
        self.buckets: dict[torch.dtype, torch.Tensor] = {}
        self.in_bucket: dict[torch.dtype, list] = collections.defaultdict(list)
        self.elements: dict[torch.dtype, int] = collections.defaultdict(int)
        self.grads_in_partition: torch.Tensor | None = None
        self.partition_offset = 0
        self.averaged: torch.Tensor | None = None  # grads_in_partition kept for the step (averaged_gradients)
        self.micro = 0
        self._assume()
        self.hook_gradients(self._on_grad)

    def _flatten_parameters(self) -> None:
        """One flat group per dtype of trainable parameters, and the offload gradient buffer."""
        by_dtype = _trainable_by_dtype(self.full)
        if not by_dtype:
            raise UsageError("zero needs trainable parameters")
        self.groups = [_ZeroGroup(self, ps, self.world, self.offload) for ps in by_dtype.values()]
        self.group_of = {id(p): g for g in self.groups for p in g.params}
        self.dtype = self.groups[0].dtype  # DeepSpeedZeroOptimizer.dtype: grads_in_partition's
        if self.offload:  # temp_grad_buffer_for_gpu_offload (stage_1_and_2.py:659)
            self.offload_buffer = _empty(self.tracer, max(p.numel() for p in self.full if p.requires_grad),
                                         self.dtype, Category.COMMUNICATION, "(ZeRO offload grad buffer)")

    def _assume(self) -> None:
        """State the offload and DeepSpeed's defaults in the report."""
        tracer, stage = self.tracer, self.stage
        if self.offload:
            tracer.assume(f"zero{stage} offload: the fp32 master, its gradient and the optimizer step are host "
                          "memory (DeepSpeedCPUAdam)")
        tracer.assume(f"zero{stage}: DeepSpeed 0.19.8 defaults: contiguous_gradients, no overlap_comm; "
                      f"reduce_bucket_size={_e(self.reduce_bucket)} elements (the IPG bucket)")
        tracer.assume(f"zero{stage}: rank 0's grads_in_partition (the whole parameters overlapping its partition); "
                      "other ranks' differ by the parameters straddling their boundaries")
        _assume_zero_common(tracer, f"zero{stage}")

    def make_optimizer(self, make_optimizer):
        opt = make_optimizer([g.master for g in self.groups])
        for g in self.groups:
            self.owner(g.master, "(ZeRO optimizer state)")
        return self.wrap_step(opt, self._step, host=self.offload)

    def on_phase(self, step: int, phase: Phase) -> None:
        if phase is Phase.BACKWARD:
            self.micro += 1
        elif phase is Phase.OPTIMIZER:
            self.micro = 0

    def _setup_buckets(self) -> None:
        if not self.buckets:  # one reduce_bucket_size-element buffer per communication dtype, each backward
            for dtype in dict.fromkeys(g.dtype for g in self.groups):
                self.buckets[dtype] = _empty(self.tracer, self.reduce_bucket, dtype, Category.COMMUNICATION,
                                             "(ZeRO IPG bucket)")

    def _on_grad(self, p: torch.Tensor) -> None:
        self.queue_end_of_backward()
        self._setup_buckets()
        if self.stage == 2:
            self._add(p)

    def _add(self, p: torch.Tensor) -> None:
        """``reduce_independent_p_g_buckets_and_remove_grads``: the gradient into the bucket."""
        n, dtype = p.numel(), self.group_of[id(p)].dtype
        if n == 0 or p.grad is None:
            return
        if self.elements[dtype] + n > self.reduce_bucket:
            self._reduce(dtype)
        if n <= self.reduce_bucket:  # larger ones bypass the bucket (extra_large_param_to_reduce)
            start = self.elements[dtype]
            p.grad = self.buckets[dtype][start: start + n].view_as(p)  # autograd's gradient is freed
        self.in_bucket[dtype].append(p)
        self.elements[dtype] += n

    def _reduce(self, dtype: torch.dtype) -> None:
        """``reduce_ipg_grads``: all-reduce through a flattened copy, keep this rank's partition."""
        params = self.in_bucket[dtype]
        if not params:
            return
        _empty(self.tracer, self.elements[dtype], dtype, Category.COMMUNICATION, "(ZeRO all-reduce)")  # freed at once
        for p in params:
            g = self.group_of[id(p)]
            if id(p) in g.in_partition:
                if not self.offload:  # copy_grads_in_partition (with offload: copied to host memory)
                    if self.grads_in_partition is None:
                        size = sum(h.in_partition_numel for h in self.groups)
                        self.grads_in_partition = _empty(self.tracer, size, self.dtype, Category.GRADIENT,
                                                         "(ZeRO grads in partition)")
                        self.partition_offset = 0
                    start = self.partition_offset
                    p.grad = self.grads_in_partition[start: start + p.numel()].view_as(p)
                    self.partition_offset += p.numel()
            elif self.stage == 2:
                p.grad = None  # another rank's gradient
        params.clear()
        self.elements[dtype] = 0

    def end_of_backward(self) -> None:
        """The engine's backward epilogue: stage 2 every micro-step, stage 1 at the accumulation boundary."""
        if self.stage == 1:
            if self.micro < self.accumulate:
                return
            self._setup_buckets()
            for g in self.groups:
                for p in g.params:
                    self._add(p)
        for dtype in list(self.buckets):
            self._reduce(dtype)
        if self.grads_in_partition is not None:
            if self.averaged is None:
                self.averaged = self.grads_in_partition
            # else: added into the first micro-step's (all_grad_tensors) and freed with the grads
            self.grads_in_partition = None
        self.buckets.clear()  # _release_ipg_buffers
        for p in self.full:
            p.grad = None  # _clear_param_grad_only

    def _step(self, inner, *args, **kwargs):
        out = None
        for i, g in enumerate(self.groups):
            if self.offload:
                g.master.grad = g.host_grad
            else:
                flat = _empty(self.tracer, g.partition, g.dtype, Category.GRADIENT, "(ZeRO flat grad)")
                fp32 = flat if g.dtype == torch.float32 else _empty(
                    self.tracer, g.partition, torch.float32, Category.GRADIENT, "(ZeRO fp32 grad)")
                del flat
                if i == len(self.groups) - 1:
                    self.averaged = None  # averaged_gradients = None frees grads_in_partition
                g.master.grad = fp32
                del fp32
            out = inner(*args, **kwargs)
            g.master.grad = None
        return out  # bit16 partitions copied back and all-gathered in place: nothing allocated


# ---- DeepSpeed ZeRO-3 -----------------------------------------------------------------------


class _Gather:
    """An all-gather in flight (``AllGatherCoalescedHandle``): its flat buffer lives with it."""

    def __init__(self, zero: "_MetaZero3", params: list):
        self.zero, self.params, self.done = zero, params, False
        tracer, world = zero.tracer, zero.world
        copies = ([_empty(tracer, zero.part[id(p)], p.dtype, Category.COMMUNICATION, "(ZeRO-3 host-to-device)")
                   for p in params if id(p) in zero.host_partition])
        if len(params) == 1:  # _all_gather_sequential: one padded buffer, the parameter a view of it
            p = params[0]
            self.buffer = _empty(tracer, zero.part[id(p)] * world, p.dtype, Category.PARAMETER,
                                 "(ZeRO-3 gathered params)")
        else:
            self.buffer = _empty(tracer, sum(zero.part[id(p)] * p.element_size() for p in params) * world,
                                 torch.uint8, Category.COMMUNICATION, "(ZeRO-3 all-gather)")
        del copies

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        for p in self.params:
            if len(self.params) == 1:
                self.zero.gathered[id(p)] = self.buffer
            else:  # torch.cat of the W slices: a full copy per parameter
                self.zero.gathered[id(p)] = _empty(self.zero.tracer, p.numel(), p.dtype, Category.PARAMETER,
                                                   "(ZeRO-3 gathered params)")


class _MetaZero3(_Emulation):
    """DeepSpeed ZeRO stage 3 on one rank, with the parameter coordinator's fetch and release."""

    def __init__(self, tracer, model: torch.nn.Module, world: int, offload: Offload,
                 reduce_bucket: int = REDUCE_BUCKET_SIZE, prefetch_bucket: int = PREFETCH_BUCKET_SIZE,
                 max_live: int = MAX_LIVE_PARAMETERS):
        super().__init__(tracer, model, world)
        # reduce_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters: elements
        self.reduce_bucket, self.prefetch_bucket, self.max_live = reduce_bucket, prefetch_bucket, max_live
        self.offload_optimizer = offload is not Offload.NONE
        self.offload_params = offload is Offload.PARAMS
        self._partition_parameters()
        self._assume()
        self._allocate_partitions()
        self._init_coordinator()
        self._index_modules()
        self._register_hooks()

    def _partition_parameters(self) -> None:
        """Each parameter's id, partition size, persistence and whether its partition is in host memory."""
        self.ds_id = {id(p): i for i, p in enumerate(self.full)}
        self.part = {id(p): -(-p.numel() // self.world) for p in self.full}
        self.persist = {id(p) for p in self.full if p.numel() <= PARAM_PERSISTENCE_THRESHOLD}
        self.host_partition = ({id(p) for p in self.full if id(p) not in self.persist}
                               if self.offload_params else set())

    def _assume(self) -> None:
        """State DeepSpeed's defaults, the release approximation and the offload in the report."""
        tracer = self.tracer
        tracer.assume(f"zero3: reduce_bucket_size={_e(self.reduce_bucket)}, prefetch_bucket_size="
                      f"{_e(self.prefetch_bucket)}, max_live_parameters={_e(self.max_live)} elements; DeepSpeed 0.19.8 "
                      f"defaults: param_persistence_threshold={_e(PARAM_PERSISTENCE_THRESHOLD)}, max_reuse_distance="
                      f"{_e(MAX_REUSE_DISTANCE)} elements; "
                      "step 1 records the module trace, so from step 2 parameters reused within max_reuse_distance "
                      "stay gathered")
        _assume_zero_common(tracer, "zero3")
        if self.offload_params:
            tracer.assume("zero3 offload='params': offload_param and offload_optimizer both to the CPU")
        if self.offload_optimizer:
            tracer.assume("zero3 offload: the fp32 master, optimizer state, gradient partitions and the step are "
                          "host memory (DeepSpeedCPUAdam)")

    def _allocate_partitions(self) -> None:
        """The frozen partitions, then per dtype the trainable ones in one buffer (lp_param_buffer), its
        sub-groups' fp32 masters, the gradient partitions and the IPG bucket."""
        self.partitions: list[torch.Tensor] = []
        for p in self.full:
            if not p.requires_grad and id(p) not in self.host_partition:
                self.partitions.append(_empty(self.tracer, self.part[id(p)], p.dtype, Category.PARAMETER,
                                              "(ZeRO-3 partitions)"))
        self.sub_groups = []  # (dtype, elements, master): _create_fp16_sub_groups closes a group at >= 1e9
        self.host_grads: list[torch.Tensor] = []
        self.grad_buffers: list[torch.Tensor] = []
        self.buckets: dict[torch.dtype, torch.Tensor] = {}
        for dtype, params in _trainable_by_dtype(self.full).items():
            device_numel = sum(self.part[id(p)] for p in params if id(p) not in self.host_partition)
            lp = _empty(self.tracer, device_numel, dtype, Category.PARAMETER, "(ZeRO-3 partitions)")
            self.partitions.append(lp)
            sizes = self._allocate_sub_groups(dtype, params, lp)
            if not self.offload_optimizer:
                self.grad_buffers.append(_empty(self.tracer, sum(sizes), dtype, Category.GRADIENT,
                                                "(ZeRO-3 grad partitions)"))
            self.buckets[dtype] = _empty(self.tracer, self.reduce_bucket, dtype, Category.COMMUNICATION,
                                         "(ZeRO IPG bucket)")

    def _allocate_sub_groups(self, dtype: torch.dtype, params: list, lp: torch.Tensor) -> list[int]:
        """Cut one dtype's partitions into sub-groups and give each its fp32 master; return their sizes."""
        sizes, size = [], 0
        for p in params:
            size += self.part[id(p)]
            if size >= SUB_GROUP_SIZE or p is params[-1]:
                sizes.append(size)
                size = 0
        start = 0
        for size in sizes:
            if self.offload_optimizer:
                master = self.host(size, torch.float32)
            else:  # a copy even in fp32: stage3.py:1162's torch.device == str test is never true (module docstring)
                master = _empty(self.tracer, size, torch.float32, Category.OPTIMIZER, "(ZeRO fp32 master)")
            master.requires_grad_(True)
            if self.offload_optimizer:
                self.host_grads.append(self.host(size, torch.float32))
            self.sub_groups.append((dtype, size, master))
            start += size
        return sizes

    def _init_coordinator(self) -> None:
        """The parameter coordinator's state: gathered and in-flight parameters, the module trace, the bucket."""
        self.gathered: dict[int, torch.Tensor] = {}
        self.inflight: dict[int, _Gather] = {}
        self.active: dict[int, set[int]] = collections.defaultdict(set)
        self.mode = "invalid"  # ZeRoTraceMode: INVALID -> RECORD (step 1) -> COMPLETE
        self.trace: list[torch.nn.Module] = []
        self.param_trace: list[tuple[torch.Tensor, int]] = []
        self.queue: collections.deque = collections.deque()
        self.last_fetched: dict[int, int] = collections.defaultdict(lambda: int(-1e10))
        self.release_cache: dict[tuple[int, int], set[int]] = {}
        self.step_id = 0
        self.n_available = 0
        self.pre_backward_pending: dict[int, int] = collections.defaultdict(int)
        self.backward_active: dict[int, torch.nn.Module] = {}
        self.in_bucket: dict[torch.dtype, list] = collections.defaultdict(list)
        self.elements: dict[torch.dtype, int] = collections.defaultdict(int)

    def _index_modules(self) -> None:
        """Every module (DeepSpeed hooks each one, ``_register_deepspeed_module``, ``parameter_offload.py:337-528``:
        a module without parameters of its own still enters the trace, advances the step and prefetches,
        so the root's fetch prefetches the first blocks), its own parameters, and each parameter's modules."""
        self.modules = list(self.model.modules())
        self.mparams = {id(m): list(m.parameters(recurse=False)) for m in self.modules}
        self.modules_of: dict[int, list] = collections.defaultdict(list)
        for m in self.modules:
            for p in self.mparams[id(m)]:
                self.modules_of[id(p)].append(m)

    def _register_hooks(self) -> None:
        """``reset_step`` before the model's forward, fetch and release around each module, the gradient hook."""
        self.handles.append(self.model.register_forward_pre_hook(lambda m, a: self._reset_step(), prepend=True))
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(lambda mod, a: self._fetch(mod, forward=True)))
            self.handles.append(m.register_forward_hook(lambda mod, a, o: self._post_forward(mod, o)))
            # _post_backward_module_hook, registered after the fetch (parameter_offload.py:437-442, 528):
            # the positional inputs only, as a forward pre-hook without kwargs sees them
            self.handles.append(m.register_forward_pre_hook(
                lambda mod, a: after_input_gradients(a, {}, lambda mod=mod: self._post_backward(mod), each=True)[0]
                if torch.is_grad_enabled() else None))
        self.hook_gradients(self._on_grad)

    def make_optimizer(self, make_optimizer):
        opt = make_optimizer([master for _, _, master in self.sub_groups])
        for _, _, master in self.sub_groups:
            self.owner(master, "(ZeRO optimizer state)")
        return self.wrap_step(opt, self._step, host=self.offload_optimizer)

    # the parameter coordinator (partitioned_param_coordinator.py)
    def _status(self, p) -> str:
        return "available" if id(p) in self.gathered else "inflight" if id(p) in self.inflight else "partitioned"

    def _all_gather(self, params) -> None:
        params = sorted((p for p in params if self._status(p) == "partitioned"), key=lambda p: self.ds_id[id(p)])
        if not params:
            return
        self.n_available += sum(p.numel() for p in params)
        by_dtype: dict[torch.dtype, list] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            handle = _Gather(self, group)
            for p in group:
                self.inflight[id(p)] = handle

    def _release(self, p) -> None:
        if id(p) in self.gathered and not self.active[id(p)]:
            del self.gathered[id(p)]
            self.n_available -= p.numel()

    def _clean_inflight(self) -> None:
        for pid, handle in list(self.inflight.items()):
            handle.wait()
        params = [p for p in self.full if id(p) in self.inflight]
        self.inflight.clear()
        for p in params:
            self._release(p)

    def _invalidate(self) -> None:
        self.mode = "invalid"
        self.trace, self.param_trace = [], []
        self.last_fetched.clear()
        self.release_cache.clear()
        self._clean_inflight()

    def _reset_step(self) -> None:
        """``reset_step``, at the start of every forward."""
        self._clean_inflight()
        if self.mode == "record":
            self.param_trace = [(p, i) for i, m in enumerate(self.trace)
                                for p in sorted(set(self.mparams[id(m)]), key=lambda p: self.ds_id[id(p)])]
            self.mode = "complete"
        elif self.mode == "invalid":
            self.mode = "record"
        self.queue = collections.deque(self.param_trace)
        self.last_fetched = collections.defaultdict(lambda: int(-1e10))
        self.step_id = 0
        self.n_available = 0

    def _fetch(self, m: torch.nn.Module, forward: bool) -> None:
        """``fetch_sub_module``: gather this module's parameters, then prefetch along the trace."""
        if self.mode == "complete" and (len(self.trace) <= self.step_id or self.trace[self.step_id] is not m):
            self._invalidate()
        if self.mode == "record":
            self.trace.append(m)
        params = self.mparams[id(m)]
        self._all_gather(params)
        for p in params:
            self.active[id(p)].add(id(m))
            handle = self.inflight.pop(id(p), None)
            if handle is not None:
                handle.wait()
        handle = None
        if self.mode == "complete":
            wanted = {id(p) for p in params if self.last_fetched[id(p)] < self.step_id}
            popped: set[int] = set()
            while self.queue and len(popped) < len(wanted):
                p, at = self.queue.popleft()
                self.last_fetched[id(p)] = at
                popped.add(id(p))
            limit = min(self.max_live - self.n_available, self.prefetch_bucket)
            prefetch, numel = {}, 0
            while self.queue and numel < limit:
                p, at = self.queue.popleft()
                if self._status(p) == "partitioned" and id(p) not in prefetch:
                    prefetch[id(p)] = p
                    numel += p.numel()
                self.last_fetched[id(p)] = max(self.last_fetched[id(p)], at)
            self._all_gather(prefetch.values())
        self.step_id += 1

    def _to_release(self, m: torch.nn.Module) -> set[int]:
        """``__params_to_release``: not persistent and not used again within max_reuse_distance."""
        key = (id(m), self.step_id)
        if key not in self.release_cache:  # functools.lru_cache in DeepSpeed
            params = self.mparams[id(m)]
            out = {id(p) for p in params if id(p) not in self.persist and self.last_fetched[id(p)] <= self.step_id}
            traversed = 0
            for later in self.trace[self.step_id:]:
                if traversed >= MAX_REUSE_DISTANCE:
                    break
                for p in self.mparams[id(later)]:
                    out.discard(id(p))
                    traversed += p.numel()
            self.release_cache[key] = out
        return self.release_cache[key]

    def _release_module(self, m: torch.nn.Module) -> None:
        """``release_sub_module``."""
        params = self.mparams[id(m)]
        release = self._to_release(m) if self.mode == "complete" else {id(p) for p in params}
        for p in params:
            self.active[id(p)].discard(id(m))
            if id(p) in release:
                self._release(p)

    def _post_forward(self, m: torch.nn.Module, output) -> None:
        self._release_module(m)
        if torch.is_grad_enabled():
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if outputs:
                self.pre_backward_pending[id(m)] += 1
                for t in outputs:
                    t.register_hook(lambda grad, m=m: self._pre_backward(m))

    def _pre_backward(self, m: torch.nn.Module) -> None:
        if self.pre_backward_pending[id(m)] <= 0:
            return
        self.pre_backward_pending[id(m)] -= 1
        self.queue_end_of_backward()
        self._fetch(m, forward=False)
        self.backward_active[id(m)] = m

    def _post_backward(self, m: torch.nn.Module) -> None:
        """``post_sub_module_backward_function`` -> ``release_sub_module(forward=False)``
        (``parameter_offload.py:594-605``, ``partitioned_param_coordinator.py:494-534``): also for frozen modules."""
        if self.backward_active.pop(id(m), None) is not None:
            self._release_module(m)

    def _on_grad(self, p: torch.Tensor) -> None:
        """The gradient hook: into the IPG bucket."""
        self.queue_end_of_backward()
        dtype, n = p.dtype, p.numel()
        if self.elements[dtype] and self.elements[dtype] + n > self.reduce_bucket:
            self._reduce_scatter(dtype)
        if p.grad is not None and self.elements[dtype] + n <= self.reduce_bucket:
            start = self.elements[dtype]
            p.grad = self.buckets[dtype][start: start + n].view_as(p)  # autograd's gradient is freed
        self.in_bucket[dtype].append(p)
        self.elements[dtype] += n

    def _reduce_scatter(self, dtype: torch.dtype) -> None:
        """``__reduce_and_partition_ipg_grads``: reduce_scatter_coalesced concatenates the W-padded chunks."""
        params = self.in_bucket[dtype]
        if not params:
            return
        if not (len(params) == 1 and params[0].numel() % self.world == 0):  # a temporary: freed at once
            _empty(self.tracer, self.world * sum(self.part[id(p)] for p in params), dtype,
                   Category.COMMUNICATION, "(ZeRO-3 reduce-scatter)")
        for p in params:  # partition_grads: added into the gradient partitions, the full gradient freed
            p.grad = None
        params.clear()
        self.elements[dtype] = 0

    def end_of_backward(self) -> None:
        for dtype in list(self.in_bucket):
            self._reduce_scatter(dtype)
        for mid, m in list(self.backward_active.items()):  # release_backward_leftovers
            for p in self.mparams[mid]:
                self.active[id(p)].discard(mid)
                if id(p) not in self.persist:
                    self._release(p)
        self.backward_active.clear()

    def _step(self, inner, *args, **kwargs):
        self._clean_inflight()  # _partition_all_parameters: every gathered parameter goes, persistent too
        for p in self.full:
            self.active[id(p)].clear()
            self._release(p)
        out = None
        for i, (dtype, size, master) in enumerate(self.sub_groups):
            if self.offload_optimizer:
                master.grad = self.host_grads[i]
            else:
                flat = _empty(self.tracer, size, dtype, Category.GRADIENT, "(ZeRO flat grad)")
                fp32 = flat if dtype == torch.float32 else _empty(self.tracer, size, torch.float32,
                                                                  Category.GRADIENT, "(ZeRO fp32 grad)")
                del flat
                master.grad = fp32
                del fp32
            out = inner(*args, **kwargs)
            master.grad = None
        for p in self.full:  # _post_step: _allgather_params_coalesced, one padded buffer per parameter
            if id(p) in self.persist:
                self.gathered[id(p)] = _empty(self.tracer, self.part[id(p)] * self.world, p.dtype,
                                              Category.PARAMETER, "(ZeRO-3 gathered params)")
                self.n_available += p.numel()
        return out
