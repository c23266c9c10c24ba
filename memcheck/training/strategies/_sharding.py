"""What ``fsdp`` (``fsdp.py``) and ``zero1``/``zero2``/``zero3`` (``zero.py``) share: sharded data
parallelism, emulated on one rank.

Every rank runs the same step on its own micro-batch, so rank 0 is traced and its
figures hold for all (under fsdp and zero3 rank 0 holds the largest shard; under
zero1/2 ranks differ by the parameters straddling partition boundaries). The model's full
parameters stay on meta for the forward and backward compute, but the tracer stops
counting them (``MemoryTracer.ignore``): what a rank really holds, its shards,
gathered copies and communication buffers, is allocated explicitly as meta tensors
at the moment the real wrapper allocates it and dropped when it frees it. The
optimizer runs on stand-ins of the rank's shard, so its state has the shard's size.
Sources: torch 2.13 ``torch/distributed/fsdp/_fully_shard/`` and DeepSpeed 0.19.8
``deepspeed/runtime/zero/`` (the files and lines cited in ``fsdp.py`` and ``zero.py`` are
theirs). Checked: fsdp on CPU ranks (``memcheck.measure.distributed``, gloo) matches
FSDP2's own allocations to the byte, up to gloo's reduce-scatter clone (which NCCL does
not make).

Known limitations:
    The real wrappers allocate their buffers on several CUDA streams, each with its
    own allocator pool; here they share one, so reserved memory comes out lower. The
    optimizer is the one memcheck is given, run on the rank's stand-ins (DeepSpeed's
    default FusedAdam and CPUAdam allocate no step temporaries). A block's (fsdp),
    module's (zero3) and frozen unit's (fsdp1) post-backward hangs on the gradients of its
    forward inputs, as the real hooks do (``_AfterInputGradients``), so frozen modules are
    released in backward too; fsdp1's trainable units still reduce when their last
    gradient is accumulated (FSDP1 hooks the FlatParameter's AccumulateGrad). Only
    DeepSpeed's defaults are modelled. Each of these is also stated as an assumption in
    the report.
"""

from __future__ import annotations

from typing import Callable

import torch

from memcheck import compat
from memcheck.compat import disable_current_modes as _disable_current_modes
from memcheck.enums import Category, Device, Phase
from memcheck.training.strategies.base import Emulation, Run
from memcheck.training.strategies.single import train_one_rank


def train_sharded(run: Run, emulate: Callable[[], "_Emulation"], *, built_on_meta: bool) -> list[int]:
    """Trace rank 0 of ``run.config.strategy`` over ``run.config.gpus`` ranks, with ``emulate()``'s emulation.

    ``built_on_meta`` (fsdp, zero3): the model's full parameters never count, not even before the loop.
    """
    tracer, strategy = run.tracer, run.config.strategy
    if built_on_meta:
        # The full model never sits on the device: it is built on meta and only the shards are
        # materialised (FSDP2: fully_shard, then to_empty; DeepSpeed: zero.Init, which the HF
        # Trainer uses under ZeRO-3), the only way a model larger than one GPU can start. Were the
        # full parameters counted first, the simulated allocator would keep their segments cached.
        tracer.assume(f"{strategy.value}: the model is built on the meta device and only its shards are "
                      "materialised (fully_shard then to_empty; deepspeed.zero.Init)")
        for p in run.model.parameters():
            tracer.ignore(p)

    def emulation() -> _Emulation:
        built = emulate()
        tracer.assume(f"{strategy.value}: rank 0 is traced and stands for every rank")
        if tracer.device is Device.CUDA:
            tracer.assume(f"{strategy.value}: communication buffers share the compute stream's allocator pool (the "
                          "real wrapper allocates them on its own streams, so it reserves more)")
        return built

    return train_one_rank(run, emulation)


def _empty(tracer, numel: int, dtype: torch.dtype, category: Category, label: str) -> torch.Tensor:
    """A device buffer of ``numel`` elements, counted in ``category`` from its allocation on."""
    with _disable_current_modes():  # one ALLOC event, already in its category (no TEMPORARY first)
        t = torch.empty(int(numel), dtype=dtype, device="meta")
    tracer.register(t, category, label)
    return t


class _AfterInputGradients(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls ``callback`` once their gradients are
    computed: FSDP2's ``RegisterPostBackwardFunction`` (torch 2.13
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:1110-1127``, applied to all the
    grad-requiring inputs at once, 891-904) and, one tensor at a time, DeepSpeed's
    ``PostBackwardFunctionModule`` (``deepspeed/runtime/zero/parameter_offload.py:497-526``).
    The wrapper's post-backward hangs on the inputs, not on the parameters' gradients, so it
    runs for a module whose parameters are all frozen too; autograd's AccumulateGrad nodes run
    before it (their sequence number is the largest), so the module's own gradients are in."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _AfterInputGradientDetached(_AfterInputGradients):
    """DeepSpeed's ``PostBackwardFunctionModule``, which returns ``output.detach()`` (DeepSpeed 0.19.8
    ``deepspeed/runtime/zero/parameter_offload.py``, ``forward``: "output = output.detach()"): no copy,
    and not a view of the input in autograd's sense, so the module may write into it in place (Wav2Vec2's
    ``_mask_hidden_states``), which autograd forbids on an input a custom Function returns as it is."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return tuple(t.detach() for t in inputs)


def after_input_gradients(args, kwargs, callback, *, each: bool = False):
    """``(args, kwargs)`` with their grad-requiring tensors passed through ``_AfterInputGradients``.

    ``each=False`` (FSDP2): one node over all of them, ``callback()`` once it runs. ``each=True``
    (DeepSpeed): one node per tensor, ``callback()`` when the last of them has run. Returns the
    inputs unchanged when none requires a gradient: then no backward hook runs at all (the wrapper's
    end-of-backward catches the module)."""
    leaves, spec = compat.tree_flatten((args, kwargs))
    wanted = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:
        return args, kwargs
    if each:
        remaining = [len(wanted)]

        def one_done():
            remaining[0] -= 1
            if remaining[0] == 0:
                callback()

        for i in wanted:
            (leaves[i],) = _AfterInputGradientDetached.apply(one_done, leaves[i])
    else:
        outs = _AfterInputGradients.apply(callback, *(leaves[i] for i in wanted))
        for i, t in zip(wanted, outs):
            leaves[i] = t
    return compat.tree_unflatten(leaves, spec)


def cast_floating(dtype: torch.dtype | None, tree):
    """Every floating tensor of ``tree`` of another dtype as ``x.to(dtype)`` (traced as any op); None: ``tree``.
    FSDP2's ``_cast_fp_tensor`` (torch 2.13 ``torch/distributed/fsdp/_fully_shard/_fsdp_common.py:181-188``)
    and FSDP1's ``_cast_forward_inputs`` (``torch/distributed/utils.py:46-65``) alike."""
    if dtype is None:
        return tree
    leaves, spec = compat.tree_flatten(tree)
    leaves = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t
              for t in leaves]
    return compat.tree_unflatten(leaves, spec)


def _tensors(out) -> list[torch.Tensor]:
    """The tensors in a module's output (tuples, lists, dicts and transformers' ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


class _Emulation(Emulation):
    """What every sharded emulation shares: hooks to remove, an end-of-backward callback,
    an optimizer step wrapper and the ignored full parameters kept alive."""

    def __init__(self, tracer, model: torch.nn.Module, world: int, *, frozen_sharded: bool = True):
        self.tracer, self.model, self.world = tracer, model, world
        self.handles: list = []
        self.kept: list[torch.Tensor] = []  # host buffers
        self.queued = False
        # What the rank holds of these is allocated explicitly. The tracer keys storages by
        # address, so an ignored one must outlive the trace (the model keeps them).
        self.full = list(model.parameters())  # tied parameters once, in registration order
        self._swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # compute_in's, put back by close
        for p in self.full:
            if frozen_sharded or p.requires_grad:
                tracer.ignore(p)

    def compute_in(self, dtypes: dict[int, torch.dtype]) -> None:
        """Point each parameter whose id is in ``dtypes`` at meta data of that dtype, uncounted, for the
        forward and backward: the wrapper's mixed precision gathers the parameters in its ``param_dtype``
        and points the modules at them, so the compute and autograd's gradients are in it. ``close``
        puts the user's data back."""
        for p in self.full:
            dtype = dtypes.get(id(p))
            if dtype is None or dtype == p.dtype:
                continue
            with _disable_current_modes():
                data = torch.empty_like(p.data, dtype=dtype, device="meta")
            self._swapped.append((p, p.data))
            p.data = data
            self.tracer.ignore(p)

    def hook_gradients(self, hook) -> None:
        """Run ``hook(p)`` once each trainable parameter's gradient is accumulated."""
        for p in self.full:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A buffer in host memory: never counted, even when a later op touches it. Kept to the
        end of the trace, since the tracer keys storages by address."""
        with _disable_current_modes():
            t = torch.zeros(shape, dtype=dtype, device="meta")
        self.tracer.ignore(t)
        self.kept.append(t)
        return t

    def queue_end_of_backward(self) -> None:
        if not self.queued:
            self.queued = True
            compat.queue_engine_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.queued = False
        self.end_of_backward()

    def end_of_backward(self) -> None:
        pass

    def on_phase(self, step: int, phase: Phase) -> None:
        pass

    def make_optimizer(self, make_optimizer) -> torch.optim.Optimizer:
        raise NotImplementedError

    def wrap_step(self, opt: torch.optim.Optimizer, step, host: bool) -> torch.optim.Optimizer:
        """Make ``opt.step()`` run ``step(inner)``; ``host``: on the CPU, unseen, its state not counted."""
        inner = opt.step
        tracer = self.tracer

        def run_inner(*args, **kwargs):
            if not host:
                return inner(*args, **kwargs)
            with _disable_current_modes():
                out = inner(*args, **kwargs)
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        tracer.ignore(value)
            return out

        opt.step = lambda *args, **kwargs: step(run_inner, *args, **kwargs)
        return opt

    def owner(self, stand_in: torch.Tensor, name: str | None) -> None:
        """Report a stand-in's optimizer state under ``name`` (the tracer's module attribution)."""
        if name is not None:
            self.tracer._owner[id(stand_in)] = name

    def close(self) -> None:
        for p, data in reversed(self._swapped):
            p.data = data
        self._swapped.clear()
        for h in self.handles:
            h.remove()
        self.handles.clear()

