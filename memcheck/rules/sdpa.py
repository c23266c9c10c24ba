"""Attention on the CPU and CUDA targets: ``scaled_dot_product_attention`` takes the kernel the
target device would pick (attention.cpp), and the CPU flash-attention kernels' own buffers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memcheck import compat
from memcheck.enums import Device
from memcheck.rules import cuda_attention
from memcheck.rules.registry import bind, register_op_rule
from memcheck.units import nbytes

aten = torch.ops.aten

def _cpu_stand_in(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor with ``t``'s shape, dtype and innermost stride, backed by one row.

    torch's own CPU kernel choice (``torch._fused_sdp_choice``) only inspects
    metadata, so a stride-0 view of ``t.shape[-1]`` elements answers exactly as
    the full tensor would, without allocating it.
    """
    last = t.shape[-1] if t.dim() else 1
    base = torch.empty(max(last, 1), dtype=t.dtype)
    strides = [0] * t.dim()
    if t.dim():
        strides[-1] = t.stride(-1) if t.shape[-1] > 1 else 1
    out = base.as_strided(t.shape, strides)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


# Values of sdp::SDPBackend (aten/src/ATen/native/transformers/sdp_utils_cpp.h).
SDP_MATH, SDP_FLASH = 0, 1


def cpu_sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """Ask torch which kernel ``scaled_dot_product_attention`` would run on CPU."""
    mask = None if attn_mask is None else _cpu_stand_in(attn_mask)
    return int(
        compat.fused_sdp_choice(
            _cpu_stand_in(q), _cpu_stand_in(k), _cpu_stand_in(v), mask,
            dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
        )
    )


def _additive_mask(mask: torch.Tensor, dtype) -> torch.Tensor:
    """What ``convert_boolean_attn_mask`` (attention.cpp) allocates for a bool mask."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)


@register_op_rule(F.scaled_dot_product_attention)
def scaled_dot_product_attention(ctx, func, args, kwargs):
    """Trace the kernel the target device would pick (attention.cpp ``scaled_dot_product_attention``)."""
    bound = bind(func, args, kwargs, names=_SDPA_NAMES, defaults=_SDPA_DEFAULTS)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if ctx.device is Device.CPU and q.device.type == "meta":
        backend = cpu_sdpa_backend(
            q, k, v, bound["attn_mask"], bound["dropout_p"], bound["is_causal"],
            bound["scale"], bound["enable_gqa"],
        )
        if backend == SDP_FLASH:
            mask = bound["attn_mask"]
            mask = None if mask is None else _additive_mask(mask, q.dtype)
            out = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, bound["dropout_p"], bound["is_causal"], attn_mask=mask, scale=bound["scale"]
            )
            return out[0]
    if ctx.device is Device.CUDA and q.device.type == "meta":
        arch = tuple(getattr(ctx, "arch", (8, 0)))
        versions = {
            name: getattr(ctx, name)
            for name in ("cudnn_version", "cuda_version")
            if getattr(ctx, name, None) is not None
        }
        backend = cuda_attention.cuda_sdpa_backend(
            q, k, v, bound["attn_mask"], bound["dropout_p"], bound["is_causal"],
            bound["scale"], bound["enable_gqa"], arch, **versions,
        )
        ctx.assume(f"SDPA on CUDA: {backend} kernel (sm{arch[0]}{arch[1]})")
        return cuda_attention.trace_cuda_sdpa(
            backend, func, args, kwargs, q, k, v, bound["attn_mask"], bound["dropout_p"],
            bound["is_causal"], bound["scale"], bound["enable_gqa"],
        )
    return func(*args, **kwargs)


# The functional names F.multi_head_attention_forward calls from inside itself
# (torch/nn/functional.py: ``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p,
# is_causal)`` when need_weights=False; ``dropout(attn_output_weights, p=dropout_p)`` when
# need_weights=True), routed through the tracer while it runs.
_MHA_INNER = ("scaled_dot_product_attention", "dropout")


@register_op_rule(F.multi_head_attention_forward)
def multi_head_attention_forward(ctx, func, args, kwargs):
    """``nn.MultiheadAttention`` (and ``nn.Transformer*``, torchvision's ViTs): its attention is
    the SDPA call inside ``F.multi_head_attention_forward`` (``need_weights=False``), or the
    explicit softmax and ``dropout`` of the attention weights (``need_weights=True``). The
    tracer's function mode handles ``multi_head_attention_forward`` itself, and torch pops a
    mode while its handler runs, so those inner calls would reach neither autocast's
    emulation nor their rules: the trace would keep the math path's (B, H, T, T) scores that
    the target's fused kernels never allocate, and the CPU path's dropout noise where CUDA
    keeps a 1-byte mask (``memcheck.rules.dropout``). The module's global names are routed
    through the tracer for this call and restored after it."""
    originals = {name: getattr(F, name) for name in _MHA_INNER}

    def routed(original):
        return lambda *a, **k: ctx.route(original, a, k)

    for name, original in originals.items():
        setattr(F, name, routed(original))  # the names multi_head_attention_forward calls
    try:
        return func(*args, **kwargs)
    finally:
        for name, original in originals.items():
            setattr(F, name, original)


def _cpu_flash_splits(q_len: int, kv_len: int) -> tuple[int, int]:
    """Block sizes of the CPU flash kernels (FlashAttentionKernel.cpp, ``flash_attention_kernel_impl``)."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _accum_size(dtype) -> int:
    return 8 if dtype == torch.float64 else 4  # at::opmath_type: float for fp32/bf16/fp16


@register_op_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def cpu_flash_attention(ctx, func, args, kwargs):
    """Forward: one per-thread buffer of ``qSplit*kvSplit + 2*qSplit + qSplit*headSize``
    accumulators (``cpu_flash_attention``; no packing for fp32), plus the same
    ``qSplit*kvSplit`` block in the input dtype for bf16/fp16 (``buf_reduced``)."""
    out = func(*args, **kwargs)
    if ctx.device is Device.CPU:
        q, v = args[0], args[2]
        b, h, q_len, d = q.shape
        q_split, kv_split = _cpu_flash_splits(q_len, v.shape[2])
        threads = torch.get_num_threads()
        per_thread = q_split * kv_split + 2 * q_split + q_split * d
        reduced = 0
        if q.dtype in (torch.bfloat16, torch.float16):
            reduced = threads * q_split * kv_split * q.element_size()
        ctx.track(out)
        ctx.scratch(threads * per_thread * _accum_size(q.dtype), reduced)
    return out


@register_op_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def cpu_flash_attention_backward(ctx, func, args, kwargs):
    """Backward: a grad_out-sized copy, a per-thread buffer of ``2*qSplit*kvSplit``
    accumulators (``cpu_flash_attention_backward``) and, from the calling thread,
    a ``qSplit`` accumulator ``dsum``; all freed before it returns. Measured
    with the profiler on 5 shapes, 1 and 2 threads: exact. The kernel works on
    ``grad_out.transpose(1, 2)`` (attention.cpp, ``_scaled_dot_product_flash_attention_cpu_backward``)
    and copies it only when that is not contiguous: a grad_out that is itself the transpose of a
    contiguous (batch, sequence, heads, dim) tensor, as transformers' ``attn_output.transpose(1, 2)``
    gives it, is not copied (measured: (2, 4, 32, 16) float32, 16,384 B less)."""
    out = func(*args, **kwargs)
    if ctx.device is Device.CPU:
        grad_out, q, v = args[0], args[1], args[3]
        q_len = q.shape[2]
        q_split, kv_split = _cpu_flash_splits(q_len, v.shape[2])
        threads = torch.get_num_threads()
        acc = _accum_size(q.dtype)
        reduced = 0
        if q.dtype in (torch.bfloat16, torch.float16):
            reduced = threads * 2 * q_split * kv_split * q.element_size()
        ctx.track(out)
        copy = 0 if grad_out.transpose(1, 2).is_contiguous() else nbytes(grad_out)
        ctx.scratch(
            copy,
            threads * 2 * q_split * kv_split * acc,
            reduced,
            q_split * acc,
        )
    return out

