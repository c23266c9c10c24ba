"""Normalization on the CUDA target: ``rms_norm``'s fused kernel, which ATen picks by device.

``F.rms_norm`` (``nn.RMSNorm``) calls ``aten::rms_norm``, a CompositeImplicitAutograd op
(``native_functions.yaml:3250-3252``, torch 2.13). Its ``rms_norm_symint``
(aten/src/ATen/native/layer_norm.cpp) calls ``at::_fused_rms_norm`` unless the input is
channels-last, complex, or the weight's dtype differs from the input's (then it warns, at
layer_norm.cpp:346 in 2.13, and runs ``rms_norm_composite``). ``_fused_rms_norm``
(``native_functions.yaml:3254-3259``) has kernels for CUDA, MPS and XPU and a CIA
``rms_norm_composite`` for every other backend, meta included; it has no Meta kernel. So a
meta trace runs the composite: ``input.to(float32)`` (a copy for bf16/fp16), ``pow``,
``mean``, ``rsqrt``, ``upcasted_input.mul(rstd)`` and ``.mul(weight)``, whose autograd
keeps the fp32 input and the normalised ``x * rstd`` for backward.

On CUDA it runs ``_fused_rms_norm_cuda`` (aten/src/ATen/native/cuda/layer_norm_kernel.cu,
lines 1812-1862 of a line-numbered copy of a recent main; torch 2.13's own
``torch/_native/ops/norm/rmsnorm_impl.py:102`` cites the eps choice in it at 1841-1847, so
2.13's line numbers are about 14 higher)::

    auto X = input.expect_contiguous();                                   // 1824
    auto gamma = weight.expect_contiguous();                              // 1825
    Tensor Y = at::native::empty_like(*X, ..., LEGACY_CONTIGUOUS_MEMORY_FORMAT);  // 1835
    Tensor rstd = at::empty({M}, X->options().dtype(acc_type));           // 1842
    ...
    rstd = rstd.view(stat_shape);                                         // 1859

and autograd (``derivatives.yaml:1284-1285``) keeps ``input``, ``weight`` and ``result1``
(rstd) for ``_fused_rms_norm_backward(grads[0], input, normalized_shape, result1, weight,
grad_input_mask)``, whose CUDA kernel (``_fused_rms_norm_backward_cuda``, lines 1865-1916
there) allocates ``dX = empty_like(*X)`` and ``dgamma = empty_like(*gamma)``; its
``RMSNormBackwardKernelImpl`` (1660-1678) passes ``dY.contiguous()``, and
``LaunchGammaBetaBackwardCUDAKernel`` (941-1020) adds partial sums ``dgamma_blocks``
(blocks.y x N, the weight's dtype) and their ``sum(0)`` when ``M > 64 * 1024`` and
``N / 32 < sm_count / 2`` (lines 958, 972-980, 992).

The rule traces that: an ``autograd.Function`` whose forward allocates Y and rstd as the
kernel does and saves input, weight and rstd, and whose backward calls
``aten._fused_rms_norm_backward``, which has a Meta kernel in 2.13 (its decomposition,
torch/_decomp/decompositions.py:2001, registered for Meta by torch/_meta_registrations.py):
dX in the input's dtype, dgamma in the weight's; the decomposition's own intermediates are
not traced (the tracer's mode is off while an op runs).

Not emulated: the CuTe DSL ("quack") override of ``_fused_rms_norm`` that torch 2.13
registers for sm90/sm100 only when the optional ``nvidia-cutlass-dsl`` and
``apache-tvm-ffi`` packages are installed (torch/_native/cutedsl_utils.py:37-77,
torch/_native/ops/norm/rmsnorm_impl.py:16-24); its forward allocates the same Y and rstd
(torch/_native/ops/norm/norms.py:54-55), its backward an fp32 ``dw_partial`` (sm_count x N,
norms.py:120). Double backward (``create_graph=True``), which derivatives.yaml sends to
``infinitely_differentiable_native_rms_norm_backward``, is not supported by the rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memcheck import compat
from memcheck.compat import suggest_memory_format
from memcheck.enums import Device
from memcheck.rules.cuda_attention import sm_count
from memcheck.rules.registry import bind, register_op_rule

aten = torch.ops.aten

_RMS_NORM = {"names": ("input", "normalized_shape", "weight", "eps"), "defaults": {}}
# AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16) in RmsNormKernelImpl (layer_norm_kernel.cu:1152-1172)
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# LaunchGammaBetaBackwardCUDAKernel (layer_norm_kernel.cu:955-973): block_dim_x 32 on CUDA,
# the partial-sum path for M > 64 * 1024, rows_per_block_y 32, grid capped at 64 * 1024 / 2 blocks.
_GAMMA_BLOCK_X = 32
_GAMMA_PARTIAL_MIN_M = 64 * 1024
_GAMMA_ROWS_PER_BLOCK = 32
_GAMMA_MAX_GRID = 64 * 1024 // 2


def _shape(normalized_shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _takes_fused_kernel(ctx, x, normalized_shape, weight) -> bool:
    """Whether ``rms_norm_symint`` on a CUDA tensor like ``x`` would call ``_fused_rms_norm``.

    Inputs torch would reject (shapes that ``_check_rms_norm_inputs`` refuses, non-floating
    dtypes) are left to torch, so its own error is raised."""
    if not (ctx.device is Device.CUDA and isinstance(x, torch.Tensor) and x.device.type == "meta"):
        return False
    if not compat.FUSED_RMS_NORM_CUDA:  # torch 2.6-2.8: the composite on CUDA (memcheck.compat)
        return False
    if x.is_nested or x.dtype not in _KERNEL_DTYPES:
        return False
    if suggest_memory_format(x) in (torch.channels_last, torch.channels_last_3d):
        return False  # "composite fallback for channels last"
    shape = _shape(normalized_shape)
    if not shape or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return False
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
            return False
        if weight.dtype != x.dtype:  # layer_norm.cpp:346 (2.13): "Cannot dispatch to fused implementation"
            return False
    return True


def rms_norm_backward_scratch(m: int, n: int, weight_last_dim: int, itemsize: int, sms: int) -> list[int]:
    """Bytes ``LaunchGammaBetaBackwardCUDAKernel`` (layer_norm_kernel.cu:958-992) allocates and
    frees for the weight's gradient: with many rows and a narrow weight, per-block partial sums
    ``dgamma_blocks`` (blocks.y x weight.size(-1), the weight's dtype) and their ``sum(0)``,
    which replaces dgamma; otherwise nothing."""
    if not (m > _GAMMA_PARTIAL_MIN_M and n // _GAMMA_BLOCK_X < sms // 2):
        return []
    blocks_x = math.ceil(n / _GAMMA_BLOCK_X)
    blocks_y = min(_GAMMA_MAX_GRID // blocks_x, math.ceil(m / _GAMMA_ROWS_PER_BLOCK))
    return [blocks_y * weight_last_dim * itemsize, n * itemsize]


class _FusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` on meta tensors: what ``_fused_rms_norm_cuda`` allocates and what its
    autograd node (derivatives.yaml:1284-1285) keeps."""

    @staticmethod
    def forward(fctx, tracer, x, normalized_shape, weight, eps):
        n = math.prod(normalized_shape)
        m = x.numel() // n if n else 0
        x_contig = x.contiguous()  # input.expect_contiguous(): a copy while the kernel runs
        w_contig = weight.contiguous() if weight is not None else None
        y = torch.empty_like(x_contig, memory_format=torch.contiguous_format)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # toAccumulateType(..., is_cuda)
        stat_shape = tuple(x.shape[: x.dim() - len(normalized_shape)]) + (1,) * len(normalized_shape)
        rstd = torch.empty(m, dtype=acc, device=x.device).view(stat_shape)
        del x_contig, w_contig
        fctx.tracer, fctx.normalized_shape = tracer, list(normalized_shape)
        fctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(fctx, grad_out):
        x, weight, rstd = fctx.saved_tensors
        mask = [fctx.needs_input_grad[1], weight is not None and fctx.needs_input_grad[3]]
        if not any(mask):
            return None, None, None, None, None
        x_contig = x.contiguous()  # _fused_rms_norm_backward_cuda: input.expect_contiguous()
        w_contig = weight.contiguous() if weight is not None else None
        grad_contig = grad_out.contiguous()  # RMSNormBackwardKernelImpl: dY.contiguous()
        dx, dw = aten._fused_rms_norm_backward(grad_contig, x_contig, fctx.normalized_shape, rstd, w_contig, mask)
        tracer = fctx.tracer
        tracer.track((dx, dw))
        if dw is not None:
            n = math.prod(fctx.normalized_shape)
            m = x.numel() // n if n else 0
            tracer.scratch(*rms_norm_backward_scratch(m, n, weight.shape[-1], x.element_size(), sm_count(tracer)))
        return None, dx, None, dw, None


def _rms_norm(ctx, func, args, kwargs):
    """``F.rms_norm`` / ``torch.rms_norm`` (``nn.RMSNorm``) on the CUDA target: ``_fused_rms_norm``'s
    output, rstd and saved tensors (layer_norm_kernel.cu ``_fused_rms_norm_cuda``) instead of
    the composite's fp32 copies; see the module docstring."""
    b = bind(func, args, kwargs, **_RMS_NORM)
    x, weight = b["input"], b["weight"]
    if not _takes_fused_kernel(ctx, x, b["normalized_shape"], weight):
        return func(*args, **kwargs)
    return _FusedRMSNorm.apply(ctx, x, _shape(b["normalized_shape"]), weight, b["eps"])


for _fn in (F.rms_norm, torch.rms_norm):
    register_op_rule(_fn, _rms_norm)


# --- clip_grad_norm_ --------------------------------------------------------------------------
# On CUDA, torch/nn/utils/clip_grad.py (``_get_total_norm``) takes ``torch._foreach_norm`` of each
# (device, dtype) group of gradients (``_has_foreach_support`` is true there, false for meta).
# Its CUDA kernel (ForeachReduceOp.cu:449-465, ``foreach_tensor_norm_cuda``, a line-numbered copy of
# a recent main) allocates ``output_per_tensor``: zeros of ntensors x max chunks per tensor
# (chunks of kChunkSize = 65,536 elements, MultiTensorApply.cuh) in the opmath dtype, fp32 for
# fp32/bf16/fp16, freed once the per-tensor norms are reduced. Meta runs the per-tensor loop,
# whose 0-dim results CUDA makes too; this rule adds the partial-sum buffer.
CHUNK = 65_536  # kChunkSize


def foreach_norm_scratch(numels_by_group: list[list[int]]) -> list[int]:
    """``output_per_tensor``'s bytes for each (device, dtype) group of tensors of these sizes."""
    return [len(numels) * max(math.ceil(n / CHUNK) for n in numels) * 4 for numels in numels_by_group if numels]


@register_op_rule(torch.nn.utils.clip_grad_norm_)
def clip_grad_norm(ctx, func, args, kwargs):
    """``clip_grad_norm_`` on the CUDA target: the ``_foreach_norm`` partial sums, then the call.
    memcheck's loop calls it through ``MemoryTracer.route`` (a Python function the tracer's
    function mode does not otherwise see)."""
    if ctx.device is Device.CUDA:
        b = bind(func, args, kwargs, names=("parameters", "max_norm"))
        params = [b["parameters"]] if isinstance(b["parameters"], torch.Tensor) else list(b["parameters"])
        groups: dict = {}
        for p in params:
            if p.grad is not None:
                groups.setdefault(p.grad.dtype, []).append(p.grad.numel())
        ctx.scratch(*foreach_norm_scratch(list(groups.values())))
    return func(*args, **kwargs)
