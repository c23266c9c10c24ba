"""The autograd engine's gradient accumulation, where a traced backward differs from a real one.

When several gradients flow into one input of a backward node, the engine sums them in
its ``InputBuffer`` (torch/csrc/autograd/input_buffer.cpp ``accumulate``): in place,
``old.add_(new)``, when the buffer it holds is a plain dense tensor that nothing else
references (``can_accumulate_inplace``), else ``old + new``, a new tensor. Meta tensors,
and any tensor while a ``TorchDispatchMode`` is active, count as "tensor-subclass-like"
(``at::isTensorSubclassLike``), so under memcheck's tracer the engine always takes the
out-of-place ``old + new``: one more buffer of the gradient's size for each contribution.

The rule below applies the real choice where a real run is sure to take the in-place
path: ``old`` is the whole fresh buffer of a ``select_backward`` or ``slice_backward``
(the gradient of ``w[i]`` or ``x[:, :, t]``, a zeros buffer of the full input that only
the engine holds). That is where it matters: a loop over the slices of one tensor sends
one full-size gradient per slice (transformers' eager experts loop indexes
``gate_up_proj[expert]`` per expert; the PyTorch path of Mamba's selective scan indexes
``discrete_A[:, :, t]`` per time step). Other accumulations keep the engine's
out-of-place sum, as before. Measured on CPU (torch 2.13, profiler allocation events):
``w[0] * 2 + w[1] * 3`` accumulates ``w``'s two select gradients in place in a real run.
"""

from __future__ import annotations

import torch

from memcheck import compat
from memcheck.rules.registry import bind, register_op_rule
from memcheck.rules.tags import StorageTags

aten = torch.ops.aten

_FRESH = StorageTags()  # a select_backward / slice_backward output: a buffer only the engine holds


def _in_backward() -> bool:
    return compat.current_graph_task_id() != -1 and not torch.is_grad_enabled()


def _fresh(ctx, func, args, kwargs):
    """``select_backward`` / ``slice_backward``: as torch runs them; in backward, the output is
    remembered as a fresh gradient buffer."""
    out = func(*args, **kwargs)
    if _in_backward():
        _FRESH.put(out, True)
    return out


for _op in (aten.select_backward.default, aten.slice_backward.default):
    register_op_rule(_op, _fresh)


def _whole(t: torch.Tensor) -> bool:
    """``t`` is its storage, all of it, laid out densely: what ``can_accumulate_inplace`` needs."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


@register_op_rule(aten.add.Tensor)
def add(ctx, func, args, kwargs):
    """``old + new`` in backward, where ``old`` is a fresh gradient buffer: the engine's
    in-place accumulation of a real run, ``old.add_(new)`` (module docstring)."""
    b = bind(func, args, kwargs)
    old, new = b["self"], b["other"]
    if (
        isinstance(new, torch.Tensor) and _in_backward() and b["alpha"] == 1 and _FRESH.get(old)
        and new.shape == old.shape and new.dtype == old.dtype and _whole(old)
    ):
        return old.add_(new)
    return func(*args, **kwargs)
