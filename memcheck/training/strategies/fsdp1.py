"""``fsdp1``: FSDP1's ``FullyShardedDataParallel``, emulated on one rank (what ``_sharding.py`` says of
every sharded strategy holds here); sources: torch 2.13 ``torch/distributed/fsdp/`` (``_flat_param.py``,
``_runtime_utils.py``, ``fully_sharded_data_parallel.py``; the lines cited are theirs).

Wrapping: one FSDP unit per repeated block (what transformers' / accelerate's
``transformer_layer_cls_to_wrap`` auto wrap and ``ModuleWrapPolicy`` make), then the root
with the rest. Defaults (``fully_sharded_data_parallel.py:397-412``): ``backward_prefetch
=BACKWARD_PRE``, ``forward_prefetch=False``, ``limit_all_gathers=True``,
``use_orig_params=False``, no mixed-precision policy. Each unit is one ``FlatParameter``:

- its parameters flattened into ``N`` elements; a sharded strategy over ``W`` ranks keeps
  ``S = ceil(N / W)`` of them per rank, the last chunk zero-padded (``_flat_param.py:1088-1139``,
  ``_get_unpadded_shard`` / ``_get_shard``); the optimizer steps the flat shard, padding
  included, so Adam's state is ``S`` elements (one step counter) per unit;
- unshard: the padded unsharded flat parameter of ``W * S`` elements is allocated and
  all-gathered into (``_flat_param.py:1285-1292``, ``1395-1409``, ``1440-1475``), with no
  separate all-gather output (FSDP2 has one); the parameters are views of it;
- forward: a unit unshards at its pre-forward; FULL_SHARD and HYBRID_SHARD free it at
  post-forward, the root excepted; SHARD_GRAD_OP keeps every unit unsharded from its
  forward to its post-backward (``_runtime_utils.py:486-500``; ``_flat_param.py:112-119``);
- backward: a unit's pre-backward re-gathers it if freed and prefetches the unit before it
  in post-forward order (``BACKWARD_PRE``: ``_runtime_utils.py:688-693``, ``1239-1290``);
  autograd concatenates the unit's parameter gradients into one flat gradient of ``N``
  elements (the views' ``split`` backward; the per-parameter gradients are freed after it);
  autograd's ready queue runs the node created last in forward first (``ReadyQueue``'s
  ``CompareNodeTaskTime``, by sequence number: torch/csrc/autograd/engine.h:91-105), so a block's split runs once its gradients exist, but the root's, made at
  the root's pre-forward before every block, runs only when the rest of backward is done:
  the root's parameter gradients and unsharded parameter stay to the end of backward;
  the post-backward hook on the flat parameter's ``AccumulateGrad`` frees the unsharded
  parameter, pads the flat gradient to ``W * S`` (a copy, only when ``N % W != 0``), allocates
  the ``S``-element sharded gradient and reduce-scatters (``_runtime_utils.py:701-774``,
  ``811-903``); the sharded gradient becomes ``.grad`` at the end of backward
  (``_finalize_params``, ``1168-1205``);
- ``no_shard``: the flat parameter is the whole unit on every rank, its flat gradient is
  all-reduced in place and kept, like DDP with one bucket per unit (``_runtime_utils.py:932-950``);
- ``hybrid_shard``: as ``full_shard`` over the ``gpus_per_node`` ranks of a node; the sharded
  gradient is then all-reduced in place across nodes (``_runtime_utils.py:858-882``);
- a unit whose parameters are all frozen (its ``FlatParameter`` does not require a gradient) has
  no post-backward hook on a gradient; at its pre-forward FSDP1 hangs a multi-gradient hook on its
  grad-requiring inputs (``_register_post_backward_reshard_only_hook``, ``_runtime_utils.py:406``,
  ``1473-1517``), which frees its unsharded flat parameter once their gradients are computed
  (``_post_backward_reshard_only_hook``, ``777-790``); with no such input, the catch-all reshard at
  the end of backward does (``1130-1165``). A unit whose outputs need no gradient is never
  prefetched in backward (``_needs_pre_backward_unshard``, ``1393-1410``, checked in ``1265-1272``);
- with bitsandbytes 4-bit weights (QLoRA), or where a block's trainable parameters differ in dtype
  from its frozen ones (PEFT's fp32 adapters on bf16 weights, which one flat parameter cannot hold),
  the FSDP-QLoRA recipes' wrapping: PEFT's
  ``fsdp_auto_wrap_policy`` (peft 0.21.2 ``peft/utils/other.py:1271-1306``; its ``lambda_policy_fn``
  wraps every leaf module whose ``weight`` requires a gradient, the LoRA adapters) with
  ``use_orig_params=False`` (PEFT's FSDP guide and alignment-handbook's ``fsdp_qlora.yaml`` set
  ``fsdp_use_orig_params: false``): each adapter is its own unit nested in its block's, whose own
  flat parameter is then all frozen;
- a unit mixing frozen and trainable parameters (``use_orig_params=True``, as under LoRA) keeps
  a gradient of its whole flat parameter; the optimizer's share is taken as
  ``ceil(trainable / W)`` elements (the real split follows where each parameter falls);
- ``offload="params"`` (``CPUOffload(offload_params=True)``): the shards, the sharded
  gradients' host copies (``_cpu_grad``) and the optimizer step are host memory; each
  unshard copies the shard to the device first (``_flat_param.py:1335-1337``), and the
  device's sharded gradients stay until the end of backward: ``_accumulate_sharded_grad`` keeps
  each as ``_saved_grad_shard`` (``_runtime_utils.py:906-928``), ``_offload_grad`` only copies it
  into the pinned ``_cpu_grad`` (``969-992``), and ``_post_backward_final_callback`` (``1084-1127``)
  deletes it in ``_finalize_params`` -> ``prepare_gradient_for_optim`` (``_flat_param.py:1679-1716``),
  state by state, only after every post-backward hook has run, the root's included (its split
  backward runs last, see above): so every unit's device sharded gradient is alive through the
  root's post-backward (its per-parameter gradients, its flat gradient of ``N`` elements, the
  padded copy and its sharded gradient).
"""

from __future__ import annotations

import math

import torch

from memcheck import compat
from memcheck.enums import Category, FsdpSharding, Offload
from memcheck.errors import UsageError
from memcheck.training.checkpointing import repeated_blocks
from memcheck.training.strategies._sharding import _empty, _Emulation, _tensors, cast_floating, train_sharded
from memcheck.training.strategies.base import MixedPrecision, Run


def train(run: Run) -> list[int]:
    """Rank 0 of ``fsdp1``: the model's full parameters never count, only the flat parameters."""
    config = run.config
    sharding = config.fsdp_sharding or FsdpSharding.FULL_SHARD
    group = config.gpus_per_node if sharding is FsdpSharding.HYBRID_SHARD and config.gpus_per_node else config.gpus
    offload = config.offload is Offload.PARAMS
    return train_sharded(run, lambda: _MetaFSDP1(run.tracer, run.model, group, sharding, offload,
                                                 config.mixed_precision), built_on_meta=True)


def shard_numel(numel: int, world: int) -> int:
    """A FlatParameter's elements per rank: ``ceil(numel / world)``, rank 0's chunk of
    ``torch.flatten(flat).chunk(world)``, every other rank padded to it (``_flat_param.py:1088-1139``)."""
    return -(-numel // world)


def _check_flattenable(name: str, params: list) -> None:
    """What ``FlatParamHandle._validate_tensors_to_flatten`` refuses (``_flat_param.py:798-830``): an integer
    tensor first ("Cannot flatten integer dtype tensors", as bitsandbytes' uint8 4-bit storage) or two dtypes
    in one unit ("Must flatten tensors with uniform dtype", as a bf16 base beside fp32 LoRA adapters)."""
    dtypes = list(dict.fromkeys(p.dtype for p in params))
    if not dtypes or (len(dtypes) == 1 and dtypes[0].is_floating_point):
        return
    shown = " and ".join(str(d).removeprefix("torch.") for d in dtypes[:3])
    where = "the root" if name == "(root)" else name
    raise UsageError(f"strategy fsdp1: FSDP unit {where} would hold {shown} parameters, and FullyShardedDataParallel "
                     "flattens a unit into one floating dtype (\"Must flatten tensors with uniform dtype\"); give "
                     "every parameter one dtype (PEFT keeps LoRA adapters in fp32: fp32 weights, --weights-dtype fp32) "
                     "or use strategy fsdp (FSDP2 shards each parameter on its own)")


class _Unit:
    """One FSDP unit's FlatParameter (a FlatParamHandle)."""

    def __init__(self, name: str, module: torch.nn.Module, params: list, world: int, sharded: bool,
                 policy: MixedPrecision = MixedPrecision()):
        self.name, self.module, self.params = name, module, params
        _check_flattenable(name, params)
        self.numel = sum(p.numel() for p in params)
        self.shard = shard_numel(self.numel, world) if sharded else self.numel
        self.padded = self.shard * world if sharded else self.numel  # the padded unsharded flat parameter
        self.dtype = params[0].dtype if params else torch.float32
        # FlatParamHandle._init_param_reduce_dtypes (_flat_param.py:904-939): a param_dtype without a reduce_dtype
        # reduces in param_dtype; otherwise each is the policy's or the flat parameter's own
        param_dtype = policy.param_dtype.torch_dtype if policy.param_dtype is not None else None
        reduce_dtype = policy.reduce_dtype.torch_dtype if policy.reduce_dtype is not None else None
        if not self.dtype.is_floating_point:
            param_dtype = reduce_dtype = None
        if param_dtype is not None and reduce_dtype is None:
            self.compute_dtype = self.reduce_dtype = param_dtype
        else:
            self.compute_dtype, self.reduce_dtype = param_dtype or self.dtype, reduce_dtype or self.dtype
        self.trainable = [p for p in params if p.requires_grad]
        # what the optimizer steps on this rank: the whole flat shard, or for a unit mixing frozen and
        # trainable parameters (use_orig_params=True, as under LoRA) the trainable elements' even share
        trainable = sum(p.numel() for p in self.trainable)
        self.stepped = (self.shard if trainable == self.numel
                        else shard_numel(trainable, world) if sharded else trainable)
        self.flat: torch.Tensor | None = None  # this rank's flat parameter (its shard, or the whole unit)
        self.unsharded: torch.Tensor | None = None
        self.in_backward = False
        self.needs_pre_backward = False  # FlatParamHandle._needs_pre_backward_unshard
        self.ready: set[int] = set()
        self.device_grad: torch.Tensor | None = None  # offload: _saved_grad_shard, on the device to the end of backward


class _MetaFSDP1(_Emulation):
    """FSDP1 on one rank: flat parameter shards, unsharded flat parameters and gradient buffers, per unit."""

    def __init__(self, tracer, model: torch.nn.Module, world: int, sharding: FsdpSharding, offload: bool,
                 policy: MixedPrecision = MixedPrecision()):
        super().__init__(tracer, model, world)
        self.sharding, self.offload, self.policy = sharding, offload, policy
        self.sharded = sharding is not FsdpSharding.NO_SHARD
        self.reshard_after_forward = sharding in (FsdpSharding.FULL_SHARD, FsdpSharding.HYBRID_SHARD)
        self._units()
        self._assume()
        self._allocate_flat_params()
        # the unsharded flat parameter is in param_dtype (_flat_param.py:1277-1292) and the parameters are its views
        self.compute_in({id(p): u.compute_dtype for u in self.units for p in u.params})
        self.order: list[_Unit] = []  # post-forward order, for backward prefetch
        for u in self.units:
            self.handles.append(u.module.register_forward_pre_hook(
                lambda m, a, k, u=u: self._pre_forward(u, a, k), with_kwargs=True))
            self.handles.append(u.module.register_forward_hook(lambda m, a, o, u=u: self._post_forward(u, o)))
        self.hook_gradients(self._on_grad)

    def _units(self) -> None:
        """One unit per repeated block (its parameters not already in one), then the root with the rest;
        first one per trainable leaf module (``adapter_units``) with 4-bit weights, or where a block's trainable
        and frozen parameters differ in dtype (PEFT's fp32 adapters on bf16 weights), which FSDP1 runs only so."""
        modules = dict(self.model.named_modules())
        seen: set[int] = set()
        units = []
        self.adapter_units = any(type(p).__name__ == "Params4bit" for p in self.full) or any(
            len({p.dtype for p in modules[name].parameters()}) > 1
            and any(p.requires_grad for p in modules[name].parameters()) for name in repeated_blocks(self.model))
        if self.adapter_units:  # PEFT's fsdp_auto_wrap_policy's lambda_policy_fn (peft 0.21.2 peft/utils/other.py:1294-1299)
            for name, module in modules.items():
                weight = getattr(module, "weight", None)
                if (name and next(module.children(), None) is None and isinstance(weight, torch.Tensor)
                        and weight.requires_grad):
                    params = [p for p in module.parameters() if id(p) not in seen]
                    seen.update(id(p) for p in params)
                    units.append(_Unit(name, module, params, self.world, self.sharded, self.policy))
        for name in repeated_blocks(self.model):
            params = [p for p in modules[name].parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            units.append(_Unit(name, modules[name], params, self.world, self.sharded, self.policy))
        self.root = _Unit("(root)", self.model, [p for p in self.full if id(p) not in seen], self.world, self.sharded,
                          self.policy)
        self.units = [u for u in units if u.params] + [self.root]
        self.unit_of = {id(p): u for u in self.units for p in u.params}

    def _assume(self) -> None:
        tracer, n = self.tracer, len(self.units) - 1
        tracer.assume(f"fsdp1 {self.sharding.value}: FullyShardedDataParallel units on each of the {n} repeated "
                      "blocks, then the root; torch's defaults (use_orig_params=False: one FlatParameter per unit, "
                      "BACKWARD_PRE prefetch, no forward prefetch"
                      + (", no MixedPrecision policy)" if self.policy.is_default else ")"))
        if not self.policy.is_default:
            tracer.assume(f"fsdp1: MixedPrecision({self.policy.label}) on every unit: flat parameters all-gathered "
                          "from a param_dtype copy of the shard and computed in param_dtype, gradients cast to "
                          "reduce_dtype (param_dtype's when not given) for the reduce-scatter, sharded gradients "
                          "cast back; buffers not cast (no buffer_dtype)")
        if self.sharding is FsdpSharding.HYBRID_SHARD:
            tracer.assume(f"fsdp1 hybrid_shard: each rank shards over the {self.world} GPUs of its node and "
                          "replicates across nodes")
        if self.offload:
            tracer.assume("fsdp1 offload: flat parameter shards, their gradients' host copies and the optimizer "
                          "step are host memory; the optimizer's temporaries are not on the GPU")
        if self.adapter_units:
            tracer.assume("fsdp1 with 4-bit weights or adapters of another dtype than their block: PEFT's "
                          "fsdp_auto_wrap_policy with use_orig_params=False, the FSDP-QLoRA recipe's wrapping (PEFT's "
                          "FSDP guide, alignment-handbook's fsdp_qlora.yaml, Answer.AI's fsdp_qlora) and the only one "
                          "FSDP1 flattens then: each trainable leaf module (the adapters) its own unit inside its "
                          "block's, so the frozen blocks get no gradient")
        if any(u.trainable and len(u.trainable) < len(u.params) for u in self.units):
            tracer.assume("fsdp1: a unit mixing frozen and trainable parameters (use_orig_params=True, as under "
                          "LoRA) gets a gradient of its whole flat parameter; its optimizer state is taken as the "
                          "trainable elements' even share of the ranks (the real split follows where each parameter "
                          "falls in the flat parameter)")

    def _allocate_flat_params(self) -> None:
        """Each unit's flat parameter on this rank (its shard, or the whole unit under no_shard), and
        the optimizer's stand-in for it."""
        self.stand_ins: dict[int, torch.nn.Parameter] = {}
        for u in self.units:
            if not u.params:
                continue
            flat = (self.host(u.shard, u.dtype) if self.offload
                    else _empty(self.tracer, u.shard, u.dtype, Category.PARAMETER,
                                "(FSDP1 flat param shards)" if self.sharded else "(FSDP1 flat params)"))
            u.flat = flat  # kept for the whole run, a frozen unit's too (no optimizer stand-in holds it)
            if not self.sharded:
                u.unsharded = flat  # no_shard: the parameters are views of it all along
            if u.trainable:
                self.stand_ins[id(u)] = torch.nn.Parameter(flat[: u.stepped])
                self.owner(self.stand_ins[id(u)], u.name if u is not self.root else None)

    def make_optimizer(self, make_optimizer):
        opt = make_optimizer(list(self.stand_ins.values()))
        return self.wrap_step(opt, lambda inner, *a, **k: inner(*a, **k), host=self.offload)

    # unshard / reshard
    def _unshard(self, u: _Unit) -> None:
        """``_unshard`` (``_runtime_utils.py:277-307``): the padded unsharded flat parameter, all-gathered into."""
        if not self.sharded or u.unsharded is not None or not u.params:
            return
        # param_dtype: pre_unshard's _use_low_precision_shard allocates _mp_shard and copies the shard into it
        # (through a device copy under offload, freed after the copy), the all-gather's input; unshard frees it
        # once gathered (_flat_param.py:1316-1358, 1522-1547). Offload without it: the device copy is the input.
        low = (_empty(self.tracer, u.shard, u.compute_dtype, Category.COMMUNICATION, "(FSDP1 low-precision shard)")
               if u.compute_dtype != u.dtype else None)
        copy = (_empty(self.tracer, u.shard, u.dtype, Category.COMMUNICATION, "(FSDP1 host-to-device)")
                if self.offload else None)
        if low is not None:
            copy = None  # cast into the low-precision shard, then freed
        u.unsharded = _empty(self.tracer, u.padded, u.compute_dtype, Category.PARAMETER,
                             "(FSDP1 unsharded flat params)")
        del copy, low

    def _reshard(self, u: _Unit) -> None:
        if self.sharded:
            u.unsharded = None

    def _pre_forward(self, u: _Unit, args, kwargs):
        """``_root_pre_forward`` (``_runtime_utils.py:504-626``: the root's inputs cast to param_dtype,
        ``cast_root_forward_inputs``) and ``_pre_forward`` (``348-406``: unshard, then a unit's inputs cast when
        ``cast_forward_inputs``, FSDP1's default False, then the reshard-only hook on them)."""
        dtype = self.policy.param_dtype.torch_dtype if self.policy.param_dtype is not None else None
        if u is self.root:
            args, kwargs = cast_floating(dtype, (args, kwargs))
        if u.in_backward:
            return args, kwargs  # a checkpointed block recomputed inside its backward: stays unsharded
        self._unshard(u)
        if self.policy.cast_forward_inputs:
            args, kwargs = cast_floating(dtype, (args, kwargs))
        if u.params and not u.trainable and torch.is_grad_enabled():  # _register_post_backward_reshard_only_hook
            inputs = [t for t in compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                self.handles.append(torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda grads, u=u: self._post_backward_reshard_only(u)))
        return args, kwargs

    def _post_backward_reshard_only(self, u: _Unit) -> None:
        """``_post_backward_reshard_only_hook`` (``_runtime_utils.py:777-790``): a frozen unit's reshard."""
        u.in_backward = False
        self._reshard(u)

    def _post_forward(self, u: _Unit, output) -> None:
        if u.in_backward:
            return
        if self.reshard_after_forward and u is not self.root:  # _post_forward_reshard
            self._reshard(u)
        if u.params:
            self.order.append(u)
        u.needs_pre_backward = False
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))
                    u.needs_pre_backward = True

    # backward
    def _pre_backward(self, u: _Unit) -> None:
        if u.in_backward:
            return
        u.in_backward = True
        self.queue_end_of_backward()
        self._unshard(u)
        u.needs_pre_backward = False
        index = max((i for i, h in enumerate(self.order) if h is u), default=0)
        if index > 0 and self.order[index - 1].needs_pre_backward:  # BACKWARD_PRE: the unit before it
            self._unshard(self.order[index - 1])

    def _on_grad(self, p: torch.Tensor) -> None:
        self.queue_end_of_backward()
        u = self.unit_of[id(p)]
        if u is self.root:
            return  # its split backward runs last (see end_of_backward)
        u.ready.add(id(p))
        if len(u.ready) == len(u.trainable):
            self._post_backward(u)

    def _post_backward(self, u: _Unit) -> None:
        """The views' split backward, then ``_post_backward_hook`` (``_runtime_utils.py:701-774``)."""
        present = [p for p in u.trainable if p.grad is not None]
        u.ready.clear()
        u.in_backward = False
        if not present:
            self._reshard(u)
            return
        # autograd's split backward: one flat gradient of N elements from the per-parameter ones
        flat_grad = _empty(self.tracer, u.numel, present[0].grad.dtype, Category.GRADIENT, "(FSDP1 flat grads)")
        for p in present:
            p.grad = None
        self._reshard(u)  # _post_backward_reshard, before the reduction
        # cast to reduce_dtype (_runtime_utils.py:756-764); autograd's gradient stays referenced by the hook's local
        # autograd_computed_grad until the hook returns, after the reduction (766-774)
        autograd = flat_grad
        if flat_grad.dtype != u.reduce_dtype:
            flat_grad = _empty(self.tracer, u.numel, u.reduce_dtype, Category.GRADIENT, "(FSDP1 flat grads)")
        stand_in = self.stand_ins[id(u)]
        if not self.sharded:  # _reduce_grad_no_shard: all-reduced in place, kept as .grad
            if stand_in.grad is None:
                stand_in.grad = flat_grad[: u.stepped]
            else:
                stand_in.grad.add_(flat_grad[: u.stepped])  # AccumulateGrad adds the new gradient to the kept one
            return
        # _get_reduce_scatter_tensors (_runtime_utils.py:890-903): F.pad copies only when N % W != 0
        padded = (_empty(self.tracer, u.padded, flat_grad.dtype, Category.COMMUNICATION, "(FSDP1 reduce-scatter)")
                  if u.padded != u.numel else flat_grad)
        sharded = _empty(self.tracer, u.shard, flat_grad.dtype, Category.GRADIENT, "(FSDP1 sharded grads)")
        if sharded.dtype != u.dtype:  # _cast_grad_to_param_dtype (1030-1054): the reduce_dtype one freed once cast
            low, sharded = sharded, _empty(self.tracer, u.shard, u.dtype, Category.GRADIENT, "(FSDP1 sharded grads)")
            del low
        if self.offload:  # _offload_grad: copied to _cpu_grad; the device one stays as _saved_grad_shard
            if u.device_grad is None:
                u.device_grad = sharded
            else:
                u.device_grad.add_(sharded)
            if stand_in.grad is None:
                stand_in.grad = self.host(u.stepped, u.dtype)
        elif stand_in.grad is None:
            stand_in.grad = sharded[: u.stepped]
        else:
            stand_in.grad.add_(sharded[: u.stepped])  # _accumulate_sharded_grad
        del sharded, padded, flat_grad, autograd  # the hook's locals: the unsharded gradients and the padded copy go

    def end_of_backward(self) -> None:
        """``_post_backward_final_callback`` (``_runtime_utils.py:1084-1127``): units whose hook did not run,
        the catch-all reshard, and (offload) the device's sharded gradients dropped."""
        # the post-backward hooks still to run (the root's: its split backward runs last) all run before
        # the final callback, which waits for them (current_stream.wait_stream(_post_backward_stream), 1098-1110)
        for u in self.units:
            if u.ready or u.in_backward or u is self.root:
                self._post_backward(u)
        # then, state by state, _catch_all_reshard and _finalize_params (1114-1116): prepare_gradient_for_optim
        # drops the device's _saved_grad_shard (_flat_param.py:1714-1716), so under offload every unit's
        # device sharded gradient is alive through the root's post-backward
        for u in self.units:
            self._reshard(u)
            u.device_grad = None
        self.order.clear()
