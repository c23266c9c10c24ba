"""Dropout on the CUDA target: the fused kernel that ATen picks by device.

``F.dropout`` calls ``aten::dropout``, a CompositeImplicitAutograd op that chooses its
implementation from the input's device (aten/src/ATen/native/Dropout.cpp)::

    bool is_fused_kernel_acceptable(const Tensor& input, double p) {          // line 43
      return (input.is_cuda() || ...) && p > 0 && p < 1 && input.sym_numel() > 0;
    }
    Tensor dropout(const Tensor& input, double p, bool train) {                // line 132
      if (input.is_nested() || (train && is_fused_kernel_acceptable(input, p)))
        return std::get<0>(at::native_dropout(input, p, train));               // line 139
      return _dropout<false>(input, p, train);                                 // line 141
    }

So on a CUDA tensor a training dropout is ``native_dropout``: an output in the input's dtype
and a bool mask (one byte an element), and autograd saves only the mask (derivatives.yaml:
``native_dropout: input: ... native_dropout_backward(grad, result1, scale)``). A meta tensor
is not CUDA: without this rule memcheck traces ``_dropout_impl`` (Dropout.cpp lines 61-89),
whose ``noise = empty_like(input); noise.bernoulli_(1 - p)`` (lines 73-74) is kept for
backward by ``input.mul(noise)``: the input's element size an element (4 B in fp32) where
CUDA keeps 1 B. ``native_dropout`` has a meta kernel and the same autograd formula on every
device, so tracing it on meta allocates and saves what the CUDA kernel does.

Left as traced, because CUDA runs them as the CPU does: the in-place ``dropout_`` (line 147:
always ``_dropout<true>``), ``feature_dropout`` (``dropout1d/2d/3d``) and ``alpha_dropout``,
which have no fused path (lines 151-173). Dropout inside attention is the attention
kernel's (``memcheck.rules.cuda_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memcheck.enums import Device
from memcheck.rules.registry import bind, register_op_rule

_FUNCTIONAL = dict(names=("input", "p", "training", "inplace"), defaults=dict(p=0.5, training=True, inplace=False))
_ATEN = dict(names=("input", "p", "train"), defaults={})


def _fused(ctx, x, p, train: bool, inplace: bool = False) -> bool:
    """Whether a CUDA tensor like ``x`` takes ``native_dropout`` (``is_fused_kernel_acceptable``)."""
    return (ctx.device is Device.CUDA and isinstance(x, torch.Tensor) and x.device.type == "meta"
            and bool(train) and not inplace and 0 < p < 1 and x.numel() > 0)


@register_op_rule(F.dropout)
def dropout(ctx, func, args, kwargs):
    """``F.dropout`` (``nn.Dropout``) on the CUDA target: ``native_dropout``'s output."""
    b = bind(func, args, kwargs, **_FUNCTIONAL)
    if not _fused(ctx, b["input"], b["p"], b["training"], b["inplace"]):
        return func(*args, **kwargs)
    return torch.ops.aten.native_dropout(b["input"], b["p"], True)[0]


@register_op_rule(torch.dropout)
def torch_dropout(ctx, func, args, kwargs):
    """``torch.dropout(input, p, train)``, which some models call directly: as ``F.dropout``."""
    b = bind(func, args, kwargs, **_ATEN)
    if not _fused(ctx, b["input"], b["p"], b["train"]):
        return func(*args, **kwargs)
    return torch.ops.aten.native_dropout(b["input"], b["p"], True)[0]
