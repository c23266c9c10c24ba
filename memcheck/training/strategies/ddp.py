"""``ddp``: ``DistributedDataParallel``'s gradient buckets, emulated on one rank.

Every rank runs the same step on its own micro-batch, so one rank is traced and
its figures hold for all. What DDP adds, following torch 2.13's
``torch/nn/parallel/distributed.py`` and the C++ ``Reducer``:

- at construction, ``_sync_module_states`` broadcasts parameters and buffers
  from rank 0 in 250 MiB flat chunks (temporaries: they count for the reserved
  memory, not the steady state);
- the ``Reducer``'s buckets: one flat tensor per bucket. Before the first
  backward there is a single bucket (``find_unused_parameters=False`` turns
  initial bucketing off); the first step's forward of step 2 rebuilds them in
  the order gradients became ready in step 1, the first capped at
  ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) when ``bucket_cap_mb`` is the
  default, the rest at ``bucket_cap_mb`` (25 MiB);
- in backward, each gradient is copied into its bucket's view and the bucket is
  all-reduced in place. Without ``gradient_as_bucket_view`` the ``.grad`` tensors
  stay as they are and the buckets are a second copy of the gradients; with it,
  each new ``.grad`` is replaced by its bucket view, so the buckets *are* the
  gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from memcheck.compat import flatten_dense_tensors as _flatten_dense_tensors
from memcheck.compat import take_tensors as _take_tensors
from memcheck.enums import Category, Phase
from memcheck.training.strategies.base import Emulation, Run
from memcheck.training.strategies.single import train_one_rank

SYNC_BUFFER_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size (_DEFAULT_BUCKET_CAP... 250 MiB)
DEFAULT_BUCKET_CAP_MB = 25


class MetaDDP(Emulation):
    """The buckets of one DDP rank, allocated and used as the Reducer does.

    Call ``on_phase`` from the training loop's phase callback.
    """

    def __init__(self, tracer, model: torch.nn.Module, *, bucket_cap_mb: float | None = None,
                 bucket_view: bool = False):
        self.tracer = tracer
        self.model = model
        self.bucket_view = bucket_view
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.cap_bytes = int(cap * 1024 * 1024)
        self.first_cap = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else self.cap_bytes
        seen: set[int] = set()
        self.params = []
        for module in model.modules():  # DDP's _build_params_for_reducer order, tied weights once
            for p in module.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        self.ready_order: list[torch.Tensor] = []
        self.rebuilt = False
        self._sync_module_states(model)
        self._build([list(range(len(self.params)))] if self.params else [])
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _sync_module_states(self, model):
        states = list(model.parameters()) + list(model.buffers())
        for chunk in _take_tensors(states, SYNC_BUFFER_BYTES):
            flat = _flatten_dense_tensors(chunk)
            del flat

    def _build(self, buckets: list[list[int]]) -> None:
        self.views: dict[int, torch.Tensor] = {}
        self.buckets = []
        category = Category.GRADIENT if self.bucket_view else Category.COMMUNICATION
        for indices in buckets:
            members = [self.params[i] for i in indices]
            flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
            self.tracer.register(flat, category, "(DDP buckets)")
            self.buckets.append(flat)
            offset = 0
            for p in members:
                self.views[id(p)] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()

    def _rebuild(self) -> None:
        """Reducer::rebuild_buckets: the old buckets go, new ones follow the ready order of step 1."""
        self.buckets = []
        self.views = {}
        index = {id(p): i for i, p in enumerate(self.params)}
        order = [p for p in self.ready_order] + [p for p in self.params if all(p is not q for q in self.ready_order)]
        limits = [self.first_cap, self.cap_bytes] if self.first_cap < self.cap_bytes else [self.cap_bytes]
        assignment, _ = dist._compute_bucket_assignment_by_size(order, limits, [False] * len(order))
        self._build([[index[id(order[i])] for i in bucket] for bucket in assignment])
        self.rebuilt = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.rebuilt and all(p is not q for q in self.ready_order):
            self.ready_order.append(p)
        view = self.views.get(id(p))
        if view is None or p.grad is None:
            return
        view.copy_(p.grad)  # mark_variable_ready_dense: the gradient (divided by world size) into its bucket
        if self.bucket_view and p.grad.untyped_storage()._cdata != view.untyped_storage()._cdata:
            p.grad = view  # the gradient becomes the bucket view; autograd's tensor is freed

    def make_optimizer(self, make_optimizer):
        return make_optimizer(self.model.parameters())

    def on_phase(self, step: int, phase: Phase) -> None:
        if phase is Phase.FORWARD and step == 1 and not self.rebuilt:
            self._rebuild()

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def train(run: Run) -> list[int]:
    """The plain loop on one rank, with its DDP buckets."""
    config = run.config
    return train_one_rank(run, lambda: MetaDDP(run.tracer, run.model, bucket_cap_mb=config.bucket_cap_mb,
                                               bucket_view=config.bucket_view))
