"""``fsdp``: FSDP2's ``fully_shard``, emulated on one rank (what ``_sharding.py`` says of every
sharded strategy holds here); sources: torch 2.13 ``torch/distributed/fsdp/_fully_shard/``.

``fully_shard`` on each repeated block, then on the root, defaults:

- per parameter of shape ``(d0, *rest)`` the rank keeps a padded shard of
  ``ceil(d0/W) * prod(rest)`` elements (``_fsdp_param.py:304-316``); the optimizer
  sees the unpadded local rows (a view of it), so Adam's state is unpadded;
- forward: a group's pre-forward allocates the all-gather output (``W`` padded
  shards, ``_fsdp_collectives.py:351``), frees the previous group's one, then the
  unsharded parameters (another ``W`` padded shards); blocks free the unsharded
  parameters at post-forward, the root keeps them to the end of backward
  (``_fsdp_state.py:205``); the last all-gather output goes at the root's post-forward;
- backward: a block's pre-backward re-gathers it (the all-gather output freed at
  once) and prefetches the block before it (``_backward_prefetch``); its post-backward
  runs once the gradients of its forward inputs are computed (``RegisterPostBackwardFunction``
  on the grad-requiring inputs, ``_fsdp_param_group.py:891-904``, ``1110-1127``), whether or
  not its parameters are trainable, or, for a group whose inputs need no gradient, in the
  root's final callback (``_fsdp_state.py:395-420``, the root first, then the blocks in
  module order). It frees the unsharded parameters and the previous reduce-scatter input
  (also when the group has no gradient, ``_fsdp_param_group.py:637-657``); a group with
  gradients then allocates its reduce-scatter input (``W`` padded shards), frees autograd's
  gradients and allocates the reduce-scatter output, whose views are the sharded gradients
  (``_fsdp_collectives.py:592-754``);
- ``offload="params"`` (``CPUOffloadPolicy``): shards, sharded gradients and the
  optimizer live in host memory; each all-gather copies the shards to the device first.
- a ``MixedPrecisionPolicy`` (``StrategyConfig.mixed_precision``, the same on every ``fully_shard``
  call, as torchtitan's ``apply_fsdp`` passes it): a parameter's ``param_dtype`` is dropped when it
  is its own dtype or not floating, ``reduce_dtype`` when it equals ``param_dtype``
  (``_fsdp_param.py:586-600``). The all-gather input is one flat copy of the group's shards cast
  to ``param_dtype`` (``_fsdp_collectives.py:381-426``; with offload each device copy is cast,
  ``_fsdp_param.py:896-901``), freed once the all-gather is issued; the all-gather output and the
  unsharded parameters are ``param_dtype`` (``_fsdp_param.py:636-665``), so the forward and
  backward compute, and autograd's gradients, are in it. The reduce-scatter input and output are
  ``reduce_dtype`` (else the gradients' dtype), the output cast to the shards' dtype when it differs,
  the ``reduce_dtype`` one freed then (``_fsdp_collectives.py:559-614``, ``696``). Each module's
  floating inputs are cast to ``param_dtype`` (``cast_forward_inputs``) and its outputs to
  ``output_dtype`` (``_fsdp_state.py:290-362``, ``_fsdp_common.py:181-188``).
"""

from __future__ import annotations

import math

import torch

from memcheck.enums import Category, Offload
from memcheck.training.checkpointing import repeated_blocks
from memcheck.training.strategies._sharding import (_empty, _Emulation, _tensors, after_input_gradients, cast_floating,
                                                    train_sharded)
from memcheck.training.strategies.base import MixedPrecision, Run


def train(run: Run) -> list[int]:
    """Rank 0 of ``fsdp``: the model is built on meta, only the shards are materialised."""
    offload = run.config.offload is Offload.PARAMS
    return train_sharded(run, lambda: _MetaFSDP(run.tracer, run.model, run.config.gpus, offload,
                                                run.config.mixed_precision), built_on_meta=True)


class _FsdpGroup:
    """One ``fully_shard`` call's parameters (an FSDPParamGroup)."""

    def __init__(self, name: str, module: torch.nn.Module, params: list, world: int,
                 policy: MixedPrecision = MixedPrecision()):
        self.name, self.module, self.params, self.world = name, module, params, world
        self.rows = []  # per parameter: (padded shard elements, local unpadded shape of rank 0)
        for p in params:
            shape = tuple(p.shape) or (1,)
            rest = math.prod(shape[1:])
            chunk = -(-shape[0] // world)  # torch.chunk's size: rank 0's chunk is the padded size
            self.rows.append((chunk * rest, (min(chunk, shape[0]), *shape[1:])))
        # FSDPParam.init_dtype_attrs (_fsdp_param.py:586-600): reduce_dtype is dropped when it equals the
        # policy's param_dtype, param_dtype when it equals the parameter's own dtype or that is not floating
        param_dtype = policy.param_dtype.torch_dtype if policy.param_dtype is not None else None
        reduce_dtype = policy.reduce_dtype.torch_dtype if policy.reduce_dtype is not None else None
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        self.orig_dtypes = [p.dtype for p in params]
        self.param_dtypes = [None if param_dtype == p.dtype or not p.dtype.is_floating_point else param_dtype
                             for p in params]
        self.reduce_dtype = reduce_dtype
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.unsharded: list[torch.Tensor] | None = None
        self.prefetched: torch.Tensor | None = None  # an all-gather output issued ahead (backward prefetch)
        self.in_backward = False
        self.post_backward_done = False  # TrainingState.POST_BACKWARD, reset at the end of backward

    def gathered_dtype(self, i: int) -> torch.dtype:
        """The dtype parameter ``i`` is all-gathered and unsharded in: param_dtype, else its own."""
        return self.param_dtypes[i] or self.orig_dtypes[i]

    def gathered_bytes(self) -> int:
        return sum(n * self.world * _itemsize(self.gathered_dtype(i)) for i, (n, _) in enumerate(self.rows))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class _MetaFSDP(_Emulation):
    """FSDP2 on one rank: shards, all-gather and reduce-scatter buffers, per group."""

    def __init__(self, tracer, model: torch.nn.Module, world: int, offload: bool,
                 policy: MixedPrecision = MixedPrecision()):
        super().__init__(tracer, model, world)
        self.offload, self.policy = offload, policy
        self._group_parameters()
        self._assume()
        self._allocate_shards()
        # the modules point at the unsharded parameters, the all-gather outputs in param_dtype
        # (_fsdp_param.py:636-665): the compute and autograd's gradients are in it
        self.compute_in({id(p): g.gathered_dtype(i) for g in self.blocks + [self.root] for i, p in enumerate(g.params)})
        self.host_grads: dict[int, torch.Tensor] = {}
        self.kept_all_gather: torch.Tensor | None = None  # forward: freed by the next group's unshard
        self.kept_reduce_scatter: torch.Tensor | None = None  # freed by the next group's post-backward
        self.order: list[_FsdpGroup] = []  # post-forward order, for backward prefetch
        self._register_hooks()

    def _group_parameters(self) -> None:
        """One group per repeated block (its parameters not already in one), then the root with the rest.

        Under a layout's expert parallelism (``memcheck_expert_parallel`` on the model, set by
        ``layout.Role.view``), each block's experts are a group of their own first, sharded over
        ``world / ep`` ranks: torchtitan's ``fully_shard(block.moe.experts, mesh=dp_mod_ep_mesh)``
        (``torchtitan/models/llama4/infra/parallelize.py``, ``apply_fsdp``), the ep ranks already
        holding different experts."""
        modules = dict(self.model.named_modules())
        seen: set[int] = set()
        self.blocks = []
        ep = getattr(self.model, "memcheck_expert_parallel", 1)
        if ep > 1:
            from memcheck.training.strategies.ep import experts_modules

            for name, module in experts_modules(self.model):
                params = [p for p in module.parameters() if id(p) not in seen]
                seen.update(id(p) for p in params)
                self.blocks.append(_FsdpGroup(name, module, params, max(1, self.world // ep), self.policy))
        for name in repeated_blocks(self.model):
            params = [p for p in modules[name].parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            self.blocks.append(_FsdpGroup(name, modules[name], params, self.world, self.policy))
        self.root = _FsdpGroup("(root)", self.model, [p for p in self.full if id(p) not in seen], self.world,
                               self.policy)
        self.group_of = {id(p): g for g in self.blocks + [self.root] for p in g.params}

    def _assume(self) -> None:
        """State the wrapping, the defaults and the offload in the report."""
        tracer = self.tracer
        experts = sum(1 for g in self.blocks if g.world != self.world)
        policy = "no mixed-precision policy; " if self.policy.is_default else ""
        tracer.assume(f"fsdp: fully_shard on each of the {len(self.blocks) - experts} repeated blocks, then on the "
                      f"root; FSDP2 defaults ({policy}blocks resharded after forward, the root not)")
        if experts:
            tracer.assume(f"fsdp with ep: each block's experts sharded apart over {self.blocks[0].world} rank(s), "
                          "dp*cp / ep, as torchtitan's apply_fsdp does")
        if any(not p.requires_grad for p in self.full):
            tracer.assume("fsdp with frozen parameters: a block's unsharded parameters are freed once the gradients "
                          "of its inputs are computed, trainable or not (FSDP2's RegisterPostBackwardFunction)")
        if self.offload:
            tracer.assume("fsdp offload: shards, sharded gradients and the optimizer step are host memory; "
                          "the optimizer's temporaries are not on the GPU")
        if not self.policy.is_default:
            tracer.assume(f"fsdp: MixedPrecisionPolicy({self.policy.label}) on every fully_shard call: parameters "
                          "all-gathered and computed in param_dtype, gradients reduce-scattered in reduce_dtype, "
                          "shards and optimizer state in the weights' own dtype")

    def _allocate_shards(self) -> None:
        """Each parameter's padded shard (device or host), and the optimizer's stand-in on its local rows."""
        self.shards: dict[int, torch.Tensor] = {}
        self.stand_ins: dict[int, torch.nn.Parameter] = {}
        for g in self.blocks + [self.root]:
            for p, (n, local) in zip(g.params, g.rows):
                shard = (self.host(n, p.dtype) if self.offload
                         else _empty(self.tracer, n, p.dtype, Category.PARAMETER, "(FSDP shards)"))
                self.shards[id(p)] = shard
                if p.requires_grad:
                    self.stand_ins[id(p)] = torch.nn.Parameter(shard[: math.prod(local)].view(local))
                    self.owner(self.stand_ins[id(p)], self.tracer._owner.get(id(p)))

    def _register_hooks(self) -> None:
        """Each group's pre- and post-forward, then every trainable parameter's gradient hook."""
        for g in self.blocks + [self.root]:
            self.handles.append(g.module.register_forward_pre_hook(
                lambda m, a, k, g=g: self._pre_forward(g, a, k), with_kwargs=True))
            self.handles.append(g.module.register_forward_hook(lambda m, a, o, g=g: self._post_forward(g, o)))
        # (the casts of inputs and outputs are the hooks' own: _fsdp_state.py:346-362)
        self.hook_gradients(lambda p: self.queue_end_of_backward())

    def make_optimizer(self, make_optimizer):
        opt = make_optimizer(list(self.stand_ins.values()))
        return self.wrap_step(opt, lambda inner, *a, **k: inner(*a, **k), host=self.offload)

    # all-gather
    def _all_gather(self, g: _FsdpGroup) -> torch.Tensor:
        """``foreach_all_gather`` (``_fsdp_collectives.py:324-378``): the all-gather inputs, then the output.

        Without offload a parameter's input is its shard itself, or, with a param_dtype, its slice of one
        flat cast copy of the group's shards (``_get_param_all_gather_inputs``, 381-426); with offload each
        shard is copied to the device (``all_gather_inputs``, ``_fsdp_param.py:896-901``) and then cast
        (the device copy freed once cast). The inputs are freed when ``foreach_all_gather`` returns."""
        inputs = []
        if self.offload:
            for i, (n, _) in enumerate(g.rows):
                copy = _empty(self.tracer, n, g.orig_dtypes[i], Category.COMMUNICATION, "(FSDP host-to-device)")
                if g.param_dtypes[i] is not None:
                    copy = _empty(self.tracer, n, g.param_dtypes[i], Category.COMMUNICATION, "(FSDP cast input)")
                inputs.append(copy)
                del copy
        else:
            cast = [(n, g.param_dtypes[i]) for i, (n, _) in enumerate(g.rows) if g.param_dtypes[i] is not None]
            if cast:  # one flat buffer in the first cast parameter's param_dtype (all the same: one policy)
                inputs.append(_empty(self.tracer, sum(n for n, _ in cast), cast[0][1], Category.COMMUNICATION,
                                     "(FSDP cast input)"))
        out = _empty(self.tracer, g.gathered_bytes(), torch.uint8, Category.COMMUNICATION,
                     "(FSDP all-gather)")
        del inputs  # the all-gather inputs, freed after the copy-in
        return out

    def _unshard(self, g: _FsdpGroup, forward: bool) -> None:
        gathered = g.prefetched if g.prefetched is not None else self._all_gather(g)
        g.prefetched = None
        g.unsharded = [_empty(self.tracer, n * g.world, g.gathered_dtype(i), Category.PARAMETER,
                              "(FSDP unsharded params)") for i, (n, _) in enumerate(g.rows)]
        if forward:
            # kept in all_gather_state until the next group's unshard; the previous group's output goes only
            # after this copy-out: wait_for_unshard clears all_gather_state before it, but its walrus local
            # prev_all_gather_state holds the result to the function's return (_fsdp_param_group.py:429-432)
            self.kept_all_gather = gathered
        del gathered  # backward: freed right after the copy-out

    def _cast_inputs(self, args, kwargs):
        """``FSDPState._cast_forward_inputs`` (``_fsdp_state.py:346-353``): to param_dtype, when it is set."""
        if self.policy.cast_forward_inputs is False or self.policy.param_dtype is None:  # None: FSDP2's True
            return args, kwargs
        return cast_floating(self.policy.param_dtype.torch_dtype, (args, kwargs))

    def _pre_forward(self, g: _FsdpGroup, args, kwargs):
        # FSDPState._pre_forward casts the inputs before the group's pre_forward hooks them (_fsdp_state.py:290-320),
        # in a checkpointed block's recomputation too
        args, kwargs = self._cast_inputs(args, kwargs)
        if g.in_backward:
            return args, kwargs  # a checkpointed block recomputed inside its backward: already unsharded
        if g.params and g.unsharded is None:  # a root without parameters has no group to gather
            self._unshard(g, forward=True)
        if not g.params or not torch.is_grad_enabled():
            return args, kwargs
        # FSDPParamGroup.pre_forward -> _register_post_backward_hook (_fsdp_param_group.py:541-555, 891-904)
        return after_input_gradients(args, kwargs, lambda g=g: self._post_backward(g))

    def _post_forward(self, g: _FsdpGroup, output):
        """The group's post-forward, then ``output_dtype``'s cast of the output (``_fsdp_state.py:322-344``)."""
        if not g.in_backward:  # a checkpointed block recomputed inside its backward: stays unsharded
            self._reshard_after_forward(g, output)
        if self.policy.output_dtype is None:
            return None
        return cast_floating(self.policy.output_dtype.torch_dtype, output)

    def _reshard_after_forward(self, g: _FsdpGroup, output) -> None:
        if g is self.root:
            self.kept_all_gather = None  # the root's _post_forward flushes the last all-gather
        else:
            g.unsharded = None  # reshard_after_forward: blocks only
        if g.params:
            self.order.append(g)
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, g=g: self._pre_backward(g))

    # backward
    def _pre_backward(self, g: _FsdpGroup) -> None:
        if g.in_backward:
            return
        g.in_backward = True
        self.queue_end_of_backward()
        if g.params and g.unsharded is None:
            self._unshard(g, forward=False)
        index = max((i for i, h in enumerate(self.order) if h is g), default=0)
        if index > 0:  # _backward_prefetch: one group ahead in reverse post-forward order
            target = self.order[index - 1]
            if target.unsharded is None and target.prefetched is None:
                target.prefetched = self._all_gather(target)

    def _post_backward(self, g: _FsdpGroup) -> None:
        """``FSDPParamGroup.post_backward`` (``_fsdp_param_group.py:588-720``), trainable and frozen groups alike."""
        g.post_backward_done = True
        present = [i for i in g.trainable if g.params[i].grad is not None]
        # foreach_reduce (_fsdp_collectives.py:521-700): the reduce-scatter in reduce_dtype, else the gradients'
        # own (param_dtype's); its output cast to the parameters' own dtype when that differs (696)
        dtype = (g.reduce_dtype or g.params[present[0]].grad.dtype) if present else None
        orig = g.orig_dtypes[present[0]] if present else None
        grads = [g.params[i].grad for i in present]
        for i in present:
            g.params[i].grad = None
        g.unsharded = None  # reshard before reducing
        g.in_backward = False
        # reduce_scatter_max_input_buffers=1: the previous input goes, before the no-gradient return (637-657)
        self.kept_reduce_scatter = None
        if not present:
            del grads
            return
        padded = sum(g.rows[i][0] for i in present)
        rs_in = _empty(self.tracer, padded * g.world, dtype, Category.COMMUNICATION, "(FSDP reduce-scatter)")
        del grads  # chunk_cat copied them; autograd's unsharded gradients are freed
        if dtype == orig:
            rs_out = _empty(self.tracer, padded, dtype, Category.GRADIENT, "(FSDP sharded grads)")
        else:
            reduced = _empty(self.tracer, padded, dtype, Category.COMMUNICATION, "(FSDP reduce-scatter output)")
            rs_out = _empty(self.tracer, padded, orig, Category.GRADIENT, "(FSDP sharded grads)")
            del reduced  # rebound to the cast copy, the reduce_dtype output freed
        offset = 0
        for i in present:
            n, local = g.rows[i]
            stand_in = self.stand_ins[id(g.params[i])]
            if self.offload:
                if stand_in.grad is None:  # copied to host memory; the device output is dropped
                    if id(stand_in) not in self.host_grads:
                        self.host_grads[id(stand_in)] = self.host(local, orig)
                    stand_in.grad = self.host_grads[id(stand_in)]
            elif stand_in.grad is None:
                stand_in.grad = rs_out[offset: offset + math.prod(local)].view(local)
            else:
                stand_in.grad.add_(rs_out[offset: offset + math.prod(local)].view(local))  # accumulate in place
            offset += n
        del rs_out
        self.kept_reduce_scatter = rs_in

    def end_of_backward(self) -> None:
        """``_root_post_backward_final_callback`` (``_fsdp_state.py:395-432``): the post-backward of every group
        whose inputs needed no gradient (so no hook ran), the root first and then the blocks in module order
        (``all_states``, ``_fsdp_state.py:185-201``); then the retained reduce-scatter input goes."""
        for g in [self.root] + self.blocks:
            if not g.post_backward_done:
                self._post_backward(g)
            g.post_backward_done = False
        self.kept_reduce_scatter = None
        for g in self.blocks + [self.root]:
            g.prefetched = None
        self.order.clear()

