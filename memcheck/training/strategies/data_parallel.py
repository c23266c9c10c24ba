"""``dp`` and ``dp-balanced``: ``torch.nn.DataParallel`` emulated on meta tensors.

Meta tensors have no device index, so the tracer keeps one per storage
(``MemoryTracer.on_gpu``) and each op allocates where its first input lives.
The emulation follows torch 2.13's ``torch/nn/parallel``: every forward

1. scatters the batch along dim 0 (``comm.scatter``: GPU 0's chunk is a view of
   the batch, the others are copies);
2. replicates the module (``Broadcast``: GPU 0's replica *is* the module;
   ``broadcast_coalesced`` flattens 10 MiB chunks on GPU 0 and copies them to
   each other GPU, whose parameters are views into those chunks);
3. runs each replica on its chunk (one after another here; each GPU's events
   are its own, so the order between GPUs does not change any GPU's peak);
4. ``dp``: gathers the outputs onto GPU 0 (``comm.gather``: one new tensor for
   every output, 0-dim losses become a vector), where the loss is computed;
   ``dp-balanced``: each replica computes its loss on its own GPU and only the
   losses are gathered (the DataParallelModel/DataParallelCriterion pattern).

In backward, gather's gradient is scattered back (GPU 0's chunk a view), and
``Broadcast``'s backward is ``reduce_add_coalesced``: per 10 MiB chunk of
gradients, every GPU flattens its replica's gradients, NCCL reduces them into a
new flat buffer on GPU 0, and the master gradients are views of those buffers.
The optimizer steps on GPU 0 only.

Every GPU is traced (``tracer.multi_gpu``), so ``train`` maps real GPU k to traced GPU k.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from memcheck.compat import flatten_dense_tensors as _flatten_dense_tensors
from memcheck.compat import take_tensors as _take_tensors
from memcheck.compat import tree_flatten, tree_map_only
from memcheck.compat import unflatten_dense_tensors as _unflatten_dense_tensors
from memcheck.enums import Category, Strategy
from memcheck.errors import UsageError
from memcheck.training.strategies.base import Run

BUFFER_SIZE = 10485760  # bytes: comm.broadcast_coalesced / reduce_add_coalesced's default


def _chunk_sizes(n_rows: int, gpus: int) -> list[int]:
    """``Tensor.chunk``'s sizes, as ``comm.scatter`` uses them (ceil, the last smaller)."""
    size = -(-n_rows // gpus)
    sizes = [min(size, n_rows - i * size) for i in range(gpus)]
    return [s for s in sizes if s > 0]


def scatter(tracer, batch: Any, gpus: int) -> list[Any]:
    """The batch split along dim 0: one piece per GPU that gets rows."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim()]
    if not leaves:
        raise UsageError("dp needs a batch with a batch dimension to scatter")
    rows = leaves[0].shape[0]
    sizes = _chunk_sizes(rows, gpus)
    if len(sizes) < gpus:
        if rows < gpus:
            raise UsageError(f"a batch of {rows} rows cannot be split over {gpus} GPUs; use a batch of at least {gpus}")
        # torch.chunk can cut fewer pieces than asked (6 rows in 4: pieces of 2, so 3 of them),
        # and DataParallel then replicates to that many GPUs only.
        idle = gpus - len(sizes)
        raise UsageError(
            f"a batch of {rows} rows cannot be split over {gpus} GPUs: torch.chunk cuts it into {len(sizes)} "
            f"pieces of at most {sizes[0]} rows, so DataParallel would leave {idle} GPU{'s' if idle > 1 else ''} "
            f"idle, which memcheck does not model; use a multiple of {gpus} rows, such as "
            f"{rows // gpus * gpus} or {-(-rows // gpus) * gpus}"
        )
    return [tree_map_only(torch.Tensor, lambda t, i=i: _ScatterChunk.apply(tracer, t, sizes, i), batch)
            for i in range(len(sizes))]


class _ScatterChunk(torch.autograd.Function):
    """One GPU's rows of a tensor on GPU 0: a view there, a copy elsewhere."""

    @staticmethod
    def forward(ctx, tracer, t, sizes, index):
        ctx.tracer, ctx.index, ctx.sizes, ctx.src = tracer, index, sizes, tracer.gpu_of(t)
        if t.dim() == 0 or t.shape[0] != sum(sizes):
            piece = t.view_as(t)  # replicated as it is (no batch dimension)
        else:
            piece = t.split(sizes)[index]
        if index == ctx.src:
            return piece.view_as(piece)
        with tracer.on_gpu(index):
            return piece.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.index == ctx.src:
            return None, grad, None, None
        with ctx.tracer.on_gpu(ctx.src):
            return None, grad.clone(), None, None


class _Broadcast(torch.autograd.Function):
    """``replicate``'s parameter broadcast and its backward, ``reduce_add_coalesced``."""

    @staticmethod
    def forward(ctx, tracer, gpus, *params):
        ctx.tracer, ctx.gpus, ctx.n = tracer, gpus, len(params)
        copies = [[p.view_as(p) for p in params]]
        for k in range(1, gpus):
            copies.append([None] * len(params))
        index = {id(p): i for i, p in enumerate(params)}
        for chunk in _take_tensors(list(params), BUFFER_SIZE):
            flat = _flatten_dense_tensors(chunk)  # a temporary on GPU 0
            for k in range(1, gpus):
                with tracer.on_gpu(k):
                    flat_k = flat.clone()
                for p, view in zip(chunk, _unflatten_dense_tensors(flat_k, chunk)):
                    copies[k][index[id(p)]] = view
                    tracer.register(view, Category.PARAMETER)
            del flat
        return tuple(t for replica in copies for t in replica)

    @staticmethod
    def backward(ctx, *grads):
        tracer, n = ctx.tracer, ctx.n
        per_gpu = [list(grads[k * n:(k + 1) * n]) for k in range(ctx.gpus)]
        present = [i for i in range(n) if all(g[i] is not None for g in per_gpu)]
        for g in per_gpu:
            for i in present:
                tracer.register(g[i], Category.GRADIENT)
        out: list[Any] = [None] * n
        streams = [_take_tensors([g[i] for i in present], BUFFER_SIZE) for g in per_gpu]
        order = iter(present)
        for chunks in zip(*streams):
            flats = [_flatten_dense_tensors(c) for c in chunks]  # each on its own GPU
            with tracer.on_gpu(0):
                result = torch.empty_like(flats[0])  # nccl.reduce's output on GPU 0
            del flats
            for t in _unflatten_dense_tensors(result, chunks[0]):
                out[next(order)] = t.detach()
        return (None, None, *out)


class _ReplicaModule(torch.nn.Module):
    """A replica for a loss function: calls the model with one GPU's parameters."""

    def __init__(self, model, params):
        super().__init__()
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_params", params)

    def forward(self, *args, **kwargs):
        return functional_call(self._model, self._params, args, kwargs, strict=False)


def replicate(tracer, model: torch.nn.Module, gpus: int) -> list[dict[str, torch.Tensor]]:
    """Each GPU's parameters and buffers by name; GPU 0's are the model's own."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen = [(n, t) for n, t in model.named_parameters() if not t.requires_grad] + list(model.named_buffers())
    copies = _Broadcast.apply(tracer, gpus, *[p for _, p in named])
    replicas = []
    for k in range(gpus):
        params = dict(zip((n for n, _ in named), copies[k * len(named):(k + 1) * len(named)]))
        for name, t in frozen:  # broadcast detached
            if k == 0:
                params[name] = t
            else:
                with tracer.on_gpu(k):
                    params[name] = t.detach().clone()
        replicas.append(params)
    return replicas


def gather(tracer, outputs: list[Any]) -> Any:
    """``comm.gather`` onto GPU 0: one new tensor per output; 0-dim tensors become a vector."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return _Gather.apply(tracer, *outputs)
    if isinstance(first, dict):
        return type(first)((k, gather(tracer, [o[k] for o in outputs])) for k in first)
    if isinstance(first, (tuple, list)):
        return type(first)(gather(tracer, list(parts)) for parts in zip(*outputs))
    return first


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tracer, *outputs):
        ctx.tracer = tracer
        ctx.sizes = [o.shape[0] if o.dim() else 1 for o in outputs]
        ctx.gpus = [tracer.gpu_of(o) for o in outputs]
        ctx.scalar = outputs[0].dim() == 0
        with tracer.on_gpu(0):
            return torch.cat([o.reshape(1) if o.dim() == 0 else o for o in outputs])

    @staticmethod
    def backward(ctx, grad):
        pieces = []
        for piece, gpu in zip(grad.split(ctx.sizes), ctx.gpus):
            if gpu != 0:
                with ctx.tracer.on_gpu(gpu):
                    piece = piece.clone()
            pieces.append(piece.reshape(()) if ctx.scalar else piece)
        return (None, *pieces)


class MetaDataParallel(torch.nn.Module):
    """``DataParallel(model)`` over ``gpus`` emulated GPUs: forward gathers on GPU 0."""

    def __init__(self, tracer, model: torch.nn.Module, gpus: int):
        super().__init__()
        self.module = model
        object.__setattr__(self, "tracer", tracer)
        self.gpus = gpus

    def forward(self, *args, **kwargs):
        chunks = scatter(self.tracer, (args, kwargs), self.gpus)
        replicas = replicate(self.tracer, self.module, len(chunks))
        outputs = []
        for k, ((a, kw), params) in enumerate(zip(chunks, replicas)):
            with self.tracer.on_gpu(k, force=False):
                outputs.append(functional_call(self.module, params, a, kw, strict=False))
        del chunks, replicas
        return gather(self.tracer, outputs)


def balanced_loss(tracer, model, batch, loss_fn, gpus: int) -> torch.Tensor:
    """``dp-balanced``: each replica computes its own loss on its GPU; the mean is taken on GPU 0."""
    chunks = scatter(tracer, batch, gpus)
    replicas = replicate(tracer, model, len(chunks))
    losses = []
    for k, (chunk, params) in enumerate(zip(chunks, replicas)):
        with tracer.on_gpu(k, force=False):
            losses.append(loss_fn(_ReplicaModule(model, params), chunk))
    del chunks, replicas
    return gather(tracer, losses).mean()


def train(run: Run) -> list[int]:
    """Trace the steps through the wrapper: ``dp`` computes the loss on GPU 0, ``dp-balanced`` on each GPU.

    ``run.evaluate`` gets the DataParallel wrapper, the module a trainer would evaluate.
    """
    tracer, model, loss_fn, gpus = run.tracer, run.model, run.loss_fn, run.config.gpus
    tracer.multi_gpu = True
    tracer.watch(model=model, batch=run.batch, root_outputs=False)
    if run.config.strategy is Strategy.DP:
        wrapper = MetaDataParallel(tracer, model, gpus)
        tracer.watch_outputs(wrapper)
        def step_loss(_, b):
            loss = loss_fn(wrapper, b)
            # A loss computed inside the model comes back one per GPU; the HF Trainer averages it.
            return loss.mean() if isinstance(loss, torch.Tensor) and loss.dim() == 1 else loss
    else:
        step_loss = lambda m, b: balanced_loss(tracer, m, b, loss_fn, gpus)  # noqa: E731
    opt = run.make_optimizer(model.parameters())
    tracer.watch(optimizer=opt)
    run.run_steps(step_loss, opt, tracer.set_phase)
    if run.evaluate is not None:
        run.evaluate(MetaDataParallel(tracer, model, gpus))
    return list(range(gpus))
