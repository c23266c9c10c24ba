"""CUDA's ``scaled_dot_product_attention``: which kernel runs, and what it allocates.

On meta, SDPA always decomposes into the math path. For the CUDA target this
module picks the kernel torch 2.11-2.13 would pick on a GPU of a given compute
capability (``cuda_sdpa_backend``), traces that kernel's aten op on meta
(``trace_cuda_sdpa``), and adds, through DISPATCH rules, the buffers the CUDA
kernels allocate inside the op that the meta kernels do not show (``ctx.scratch``).
When the math backend is chosen with dropout, its C++ ``at::dropout`` would run the
meta path's noise tensor; ``math_attention_native_dropout`` replays the math path with
the ``native_dropout`` (a bool mask) that a CUDA tensor takes.

Sources (pytorch/pytorch, read through the code search; the CUTLASS headers are
the ones shipped in the installed torch 2.13 wheel, ``torch/include``):

* ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` - the backend choice.
  The stored copy is newer than 2.13: it calls
  ``check_batch_size_and_num_heads_dense<gqa, same_heads, mqa>`` with three template
  arguments, while 2.13's ``sdp_utils_cpp.h`` declares two. Where it differs from an
  older copy that matches 2.13's header (a vendor fork, same checks otherwise), the
  newest is followed, except for grouped-query attention in the efficient kernel:
  the newest allows it, the older does not, and the efficient kernels' own
  ``TORCH_CHECK(query.size(2) == key.size(2))`` (attention_backward.cu) needs equal
  heads, so GQA is left to flash/cuDNN/math here.
* ``aten/src/ATen/native/transformers/attention.cpp`` - what the composite does
  around each kernel (bool-mask conversion, mask padding, head-dim padding).
* ``.../cuda/flash_attn/flash_api.cpp`` (``mha_fwd``, ``mha_bwd``),
  ``.../cuda/attention_backward.cu`` (``_flash_attention_backward``,
  ``_efficient_attention_backward``), ``.../cuda/attention.cu``
  (``_efficient_attention_forward``), ``aten/src/ATen/native/cudnn/MHA.cpp``.
* ``torch/include/ATen/native/transformers/cuda/mem_eff_attention/kernel_backward.h``,
  ``kernel_forward.h``, ``kernels/cutlassB.h``, ``kernels/cutlassF.h`` (torch 2.13).

Not emulated:

* cuDNN's own workspace (``mha_graph->get_workspace_size()``, MHA.cpp) is not visible
  in PyTorch's source; the backward's is approximated as an fp32 dQ accumulator plus
  fp32 softmax sums (as flash's ``mha_bwd`` allocates), the forward's as none.
* The memory-efficient backward skips kernels whose shared memory exceeds the card's
  (``sizeof(SharedStorage) > sharedMemPerBlockOptin``); that size is not computed:
  the 128x128 kernels are assumed to fit on cards with >= 160 KiB (sm80, sm90, sm100)
  and not on sm86/sm89/sm120.
* Flash's split-KV forward depends on the SM count, taken from one representative
  card per compute capability (``SM_COUNT``).
* Nested (jagged) tensors, FlashAttention-3 (off by default), deterministic mode,
  user-changed backend flags or priority order, ROCm, and the 16-byte ``rng_state``
  that ``mha_fwd`` allocates twice with dropout.
* The runtime versions: cuDNN's is assumed to be ``DEFAULT_CUDNN_VERSION`` and the
  CUDA toolkit ``DEFAULT_CUDA_VERSION`` (the cu130 wheels); both are arguments of
  ``cuda_sdpa_backend`` and can be set on the tracer (``cudnn_version``,
  ``cuda_version`` attributes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memcheck.enums import Device
from memcheck.rules.registry import bind, register_op_rule
from memcheck.units import ceil_div, nbytes, round_up

aten = torch.ops.aten

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
BACKENDS = (FLASH, EFFICIENT, CUDNN, MATH)

# Runtime versions assumed for the target. cuDNN encodes 9.15.1 as 91501
# (versionRuntimeCuDNN: major*10000 + minor*100 + patch). sdp_utils.cpp
# check_prefer_cudnn_attention: "cuDNN 9.15.1 required for seq_len not divisible by
# 128 fix, CUDA <= 12.9 wheels ship with older cuDNN see #169849" - so the cu130
# wheels are taken to ship >= 9.15.1. An assumption, not read from a wheel.
DEFAULT_CUDNN_VERSION = 91501
DEFAULT_CUDA_VERSION = (13, 0)

# multiProcessorCount of one representative card per compute capability, for flash's
# split-KV heuristic (flash_api.cpp num_splits_heuristic). Vendor spec sheets.
SM_COUNT = {
    (7, 0): 80,  # V100
    (7, 5): 40,  # T4
    (8, 0): 108,  # A100
    (8, 6): 84,  # A40 / RTX A6000
    (8, 9): 142,  # L40S
    (9, 0): 132,  # H100 SXM
    (10, 0): 148,  # B200
    (12, 0): 170,  # RTX 5090
}
_DEFAULT_SM_COUNT = 108

_HALF = (torch.float16, torch.bfloat16)
_F32 = 4  # bytes of an fp32 accumulator


def _parse_arch(arch) -> tuple[int, int]:
    arch = tuple(arch)
    if len(arch) != 2 or not all(isinstance(v, int) and v >= 0 for v in arch):
        raise ValueError(f"arch must be a compute capability such as (8, 0), got {arch!r}")
    return arch


# --------------------------------------------------------------------------------------
# The backend choice: sdp_utils.cpp select_sdp_backend and its can_use_* filters.


def _in_sm(arch, lo, hi) -> bool:
    """``check_sm_version<lo, hi>``: lo <= arch <= hi, both inclusive."""
    return lo <= arch <= hi


def _input_requires_grad(q, k, v) -> bool:
    """sdp_utils_cpp.h ``input_requires_grad``: any input needs grad and grad mode is on."""
    return (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()


def _dense_common(q, k, v, mask, *, ignore_singleton_dim: bool) -> bool:
    """sdp_utils_cpp.h ``check_nonzero_sequence_lengths_dense`` and
    ``check_last_dim_stride_equals_1_dense`` (the mask's last stride too, on GPU)."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return False
    strides_ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_singleton_dim:
        strides_ok = strides_ok or q.shape[-1] == 1
    mask_ok = mask is None or mask.stride(-1) == 1
    return strides_ok and mask_ok


def _batch_and_heads(q, k, v, enable_gqa: bool, supports_gqa: bool, same_kv_heads: bool = True) -> bool:
    """sdp_utils_cpp.h ``check_batch_size_and_num_heads_dense`` / ``check_grouped_query_attention``."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa and supports_gqa:
        if same_kv_heads and hk != hv:
            return False
        return hq % hk == 0 and (same_kv_heads or hq % hv == 0)
    return hq == hk == hv


def _mask_shape_ok(q, k, mask) -> bool:
    """sdp_utils_cpp.h ``check_attn_mask_shape`` (cuDNN): 2-D or 4-D, each dim equal or 1."""
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    if mask.shape[-2] not in (q.shape[2], 1) or mask.shape[-1] not in (k.shape[2], 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.shape[0] in (q.shape[0], 1) and mask.shape[1] in (q.shape[1], 1)


def _can_use_flash(q, k, v, mask, dropout_p, is_causal, enable_gqa, arch) -> bool:
    """``can_use_flash_attention``: no mask, equal head dims <= 256, sm80-sm121, fp16/bf16."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:  # check_tensor_shapes
        return False
    if mask is not None:  # check_for_attn_mask
        return False
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1] and d <= 256):  # check_head_dim_size_flash (pads to 8 itself)
        return False
    if not _in_sm(arch, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: the backward
    # kernels for head dim in (192, 224], or > 224 with dropout, need sm80/sm90's smem.
    if _input_requires_grad(q, k, v) and (_in_sm(arch, (8, 6), (8, 9)) or _in_sm(arch, (12, 0), (12, 1))):
        if not (d <= 192 or (dropout_p == 0.0 and d > 224)):
            return False
    if is_causal and q.shape[-2] != k.shape[-2]:  # check_flash_causal_non_square_seqlens
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _HALF):  # check_dtypes_flash_attention
        return False
    if not _batch_and_heads(q, k, v, enable_gqa, supports_gqa=True):
        return False
    return _dense_common(q, k, v, mask, ignore_singleton_dim=True)


def _min_gemm_alignment(dtype, arch) -> int:
    """sdp_utils.cpp ``minimum_gemm_alignment``: elements per 128-bit tensor-core access."""
    is_half = dtype in _HALF
    use_tc = arch[0] >= 8 or (arch[0] >= 7 and is_half)  # use_tensor_cores
    align = 4 if arch[0] >= 8 else 1
    if use_tc:
        align = max(align, 128 // (16 if is_half else 32))
    return align


def _can_use_efficient(q, k, v, mask, dropout_p, is_causal, enable_gqa, arch) -> bool:
    """``can_use_mem_efficient_attention``: sm50-sm121, aligned head dims, fp32/fp16 (+bf16 on sm80+)."""
    if not _in_sm(arch, (5, 0), (12, 1)):  # check_mem_efficient_hardware_support
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    align = _min_gemm_alignment(q.dtype, arch)  # check_head_dim_size_mem_efficient
    dq, dv = q.shape[-1], v.shape[-1]
    if not (dq == k.shape[-1] and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    # check_data_ptr_alignment_mem_efficient (newest source only): on sm80+ the storage
    # offsets must be multiples of the alignment (the allocator's bases are 256-B aligned).
    if arch[0] >= 8:
        for t in (q, k, v):
            if t.numel() and t.storage_offset() % align:
                return False
    if not _dense_common(q, k, v, mask, ignore_singleton_dim=False):
        return False
    if not _batch_and_heads(q, k, v, enable_gqa, supports_gqa=False):  # see module docstring
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if arch[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype == k.dtype == v.dtype and q.dtype in allowed


def _cudnn_supports_d256(arch, cudnn_version: int) -> bool:
    """sdp_utils.cpp: d <= 256 on sm90/sm10x with cuDNN > 9.22 (and a frontend >= 1.24,
    assumed to be bundled with such a cuDNN); not on sm107 with cuDNN <= 9.25."""
    sm90_or_10x = arch == (9, 0) or arch[0] == 10
    sm107_old = arch == (10, 7) and cudnn_version <= 92500
    return sm90_or_10x and not sm107_old and cudnn_version > 92200


def _can_use_cudnn(q, k, v, mask, dropout_p, is_causal, enable_gqa, arch, cudnn_version) -> bool:
    """``can_use_cudnn_attention`` with ``check_cudnn_tensor_shapes`` (newest source)."""
    if cudnn_version < 90000:
        return False
    if dropout_p > 0.0 and 91100 < cudnn_version < 91400:  # no dropout in cuDNN 9.11-9.13
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (_HALF if arch[0] >= 8 else (torch.float16,))):
        return False
    if not _mask_shape_ok(q, k, mask):
        return False
    if not _in_sm(arch, (8, 0), (12, 1)):  # check_cudnn_hardware_support
        return False
    if dropout_p * 16.0 != math.floor(dropout_p * 16.0):  # check_cudnn_dropout: steps of 1/16
        return False
    if not _dense_common(q, k, v, mask, ignore_singleton_dim=True):
        return False
    if not _batch_and_heads(q, k, v, enable_gqa, supports_gqa=True, same_kv_heads=False):
        return False
    # check_cudnn_tensor_shapes
    b, h, s_q, d_qk = q.shape
    s_k, d_v = k.shape[2], v.shape[3]
    if b > 65535 or h > 65535:
        return False
    limit = 128
    sm90_or_10x = arch == (9, 0) or arch[0] == 10
    if _cudnn_supports_d256(arch, cudnn_version):
        limit = 256
    elif sm90_or_10x and cudnn_version >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if s_k == 1 or (dropout_p != 0.0 and s_q == 1):
        return False
    # check_cudnn_d256_bprop_head_dim: with d256 support, backward takes only these dims
    if _input_requires_grad(q, k, v) and _cudnn_supports_d256(arch, cudnn_version):
        if not ((d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))):
            return False
    return True


def _prefer_cudnn(arch, cudnn_version: int, cuda_version) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN first on sm9x/sm10x with cuDNN > 9.15.0
    (below CUDA 13 only on minor version 0 or 3, i.e. sm90, sm100, sm103)."""
    if cudnn_version <= 91500 or arch[0] not in (9, 10):
        return False
    return tuple(cuda_version) >= (13, 0) or arch[1] in (0, 3)


def cuda_sdpa_backend(
    q,
    k,
    v,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    arch,
    *,
    cudnn_version: int = DEFAULT_CUDNN_VERSION,
    cuda_version=DEFAULT_CUDA_VERSION,
) -> str:
    """The kernel ``scaled_dot_product_attention`` would run on a CUDA GPU.

    Follows ``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)
    with default backend flags: the priority order is flash, efficient, math (cuDNN
    last, never reached because math is enabled), or cuDNN, flash, efficient, math
    where ``check_prefer_cudnn_attention`` holds; the first backend whose filters all
    pass is used. Only metadata is read, so meta tensors work.

    Args:
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa: as given to SDPA.
        arch: compute capability of the target GPU, e.g. ``(9, 0)``.
        cudnn_version: runtime cuDNN as ``versionRuntimeCuDNN`` reports it (91501 = 9.15.1).
        cuda_version: CUDA toolkit torch was built with, e.g. ``(13, 0)``.

    Returns:
        ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``.
    """
    arch = _parse_arch(arch)
    if _prefer_cudnn(arch, cudnn_version, cuda_version):
        if _can_use_cudnn(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, arch, cudnn_version):
            return CUDNN
    if _can_use_flash(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, arch):
        return FLASH
    if _can_use_efficient(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, arch):
        return EFFICIENT
    return MATH


# --------------------------------------------------------------------------------------
# Tracing the chosen kernel: what attention.cpp scaled_dot_product_attention does around it.


def _bool_to_additive(mask, dtype, fill):
    """``convert_boolean_attn_mask`` (fill -inf) / ``..._cudnn`` (fill -65504): a new
    additive mask in ``dtype`` for a bool mask; any other mask passes through."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)  # at::scalar_tensor(0.0, dtype)
    return torch.where(mask.logical_not(), fill, zero)


def _preprocess_mask(mask, q, k):
    """``preprocess_mask``: pad the bias's last dim (to a multiple of 8, plus 8 when it
    already is one: ``pad_bias`` always pads) unless every stride but the last is a
    multiple of 8, then expand it to (B, H, L, S)."""
    aligned = all(s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _compute_logsumexp(q, k, v) -> bool:
    """attention.cpp ``should_compute_logsumexp``: only when backward will need it."""
    return _input_requires_grad(q, k, v)


def _math_dropout_is_fused(q, k, v, attn_mask, dropout_p, enable_gqa) -> bool:
    """Whether the math backend's ``at::dropout(attn, dropout_p, true)`` takes ``native_dropout``
    on a CUDA tensor (Dropout.cpp ``is_fused_kernel_acceptable``: 0 < p < 1, a non-empty
    input), for inputs ``math_attention_native_dropout`` reproduces; anything else (nested
    tensors, mixed dtypes, heads that do not divide) is left to torch and its own checks."""
    if not 0.0 < dropout_p < 1.0:
        return False
    if any(t.is_nested for t in (q, k, v)) or q.dim() < 2 or not (q.dtype == k.dtype == v.dtype):
        return False
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        return False
    if enable_gqa and q.dim() >= 3 and (q.shape[-3] % k.shape[-3] or q.shape[-3] % v.shape[-3]):
        return False
    return q.numel() > 0 and k.numel() > 0 and q.shape[-2] > 0 and k.shape[-2] > 0


def _additive_mask(mask, dtype):
    """``convert_boolean_attn_mask`` as torch 2.13 runs it: two scalars and a ``where``
    (traced on meta: ``scalar_tensor`` x 2, ``where.self``), in the query's dtype."""
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    neg_inf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg_inf)


def math_attention_native_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA's math backend as a CUDA run takes it: attention.cpp ``_scaled_dot_product_attention_math``,
    op for op as torch 2.13 runs it on meta, except ``at::dropout(attn, dropout_p, true)``.

    On a CUDA tensor that call is ``native_dropout`` (Dropout.cpp:139, see ``memcheck.rules.dropout``):
    the (B, H, L, S) attention in its dtype and a bool mask, the mask alone saved for backward.
    On meta it is ``_dropout_impl``, whose noise tensor in the attention's dtype (fp32 for
    bf16/fp16 inputs: the math path upcasts them) is saved instead. The C++ math op is
    CompositeImplicitAutograd, so autograd records the ops below on CUDA too.

    The steps (attention.cpp ``scaled_dot_product_attention``, case math, then
    ``_scaled_dot_product_attention_math``; the TORCH_WARN_ONCE next to the dropout call is
    attention.cpp:906 in 2.13, as its warning reports): a bool mask made additive; q, k, v
    upcast to fp32 when half and ``allow_fp16_bf16_reduction_math_sdp`` is off; q and k^T each
    scaled by sqrt(scale); a causal mask built as ones(L, S).tril() made additive; grouped
    key/value heads repeated (``repeat_interleave``); ``matmul``, ``add`` of the mask,
    ``_safe_softmax``, the dropout; then the attention weights cast back to the input dtype
    (the second element of the returned tuple, which SDPA drops; traced before the last
    ``matmul``) and ``matmul(attn, v).to(dtype)``.
    """
    origin = q.dtype
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive_mask(attn_mask, origin)
    upcast = not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    q, k, v = (t.to(torch.float32) if upcast and t.dtype in _HALF else t for t in (q, k, v))
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))  # calculate_scale(..).sqrt()
    query = aten.mul.Scalar(q, -factor if negative else factor)
    if is_causal:
        causal = torch.ones(query.shape[-2], k.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn_mask = _additive_mask(causal, query.dtype)
    if enable_gqa and q.dim() >= 3 and not (q.shape[-3] == k.shape[-3] == v.shape[-3]):
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)  # pre_process_group_query_attention_input
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    attn = torch.matmul(query, aten.mul.Scalar(k.transpose(-2, -1), factor))
    if attn_mask is not None:
        attn = attn.add(attn_mask)
    attn = aten._safe_softmax(attn, -1)
    attn = aten.native_dropout(attn, dropout_p, True)[0]
    weights = attn.to(origin)  # make_tuple's second element: 2.13's trace evaluates it first (GCC: right to left)
    out = torch.matmul(attn, v).to(origin)
    del weights
    return out


def trace_cuda_sdpa(backend, func, args, kwargs, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Run ``backend``'s aten op on meta the way attention.cpp calls it; return SDPA's output.

    ``enable_gqa`` reaches only the math path (through ``func``): flash and cuDNN take
    fewer key/value heads natively, and the efficient kernel is not chosen for them.
    """
    if backend == FLASH:
        d = q.shape[-1]
        if d % 8:  # pad_last_dim<8, false>: FlashAttention-2 needs head dims in multiples of 8
            pad = 8 - d % 8
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        if scale is None:
            scale = 1.0 / math.sqrt(d)  # calculate_scale on the unpadded query
        out = aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, return_debug_mask=False, scale=scale
        )[0]
        return out[..., :d] if d % 8 else out  # post_process_flash_output
    if backend == EFFICIENT:
        mask = _bool_to_additive(attn_mask, q.dtype, -math.inf)
        if mask is not None:
            mask = _preprocess_mask(mask, q, k)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, _compute_logsumexp(q, k, v), dropout_p, is_causal, scale=scale
        )[0]
    if backend == CUDNN:
        mask = _bool_to_additive(attn_mask, q.dtype, -65504.0)
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, _compute_logsumexp(q, k, v), dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == MATH:
        if _math_dropout_is_fused(q, k, v, attn_mask, dropout_p, enable_gqa):
            return math_attention_native_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return func(*args, **kwargs)
    raise ValueError(f"unknown SDPA backend {backend!r}; allowed: {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------------------
# What the CUDA kernels allocate that their meta kernels do not show.


def _cuda_target(ctx, t) -> bool:
    return ctx.device is Device.CUDA and t.device.type == "meta"


def _arch(ctx) -> tuple[int, int]:
    return _parse_arch(getattr(ctx, "arch", (8, 0)))


def sm_count(ctx) -> int:
    """The target GPU's multiprocessor count: the tracer's ``sm_count`` when set, else that of
    the representative card of its compute capability (``SM_COUNT``)."""
    return getattr(ctx, "sm_count", None) or SM_COUNT.get(_arch(ctx), _DEFAULT_SM_COUNT)


def _num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """flash_api.cpp ``num_splits_heuristic``, line for line."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    efficiency, best = [], 0.0

    def eligible(n):
        return n == 1 or ceil_div(num_n_blocks, n) != ceil_div(num_n_blocks, n - 1)

    for n in range(1, max_splits + 1):
        if not eligible(n):
            efficiency.append(0.0)
            continue
        waves = batch_nheads_mblocks * n / num_sms
        eff = waves / math.ceil(waves)
        best = max(best, eff)
        efficiency.append(eff)
    for n in range(1, max_splits + 1):
        if eligible(n) and efficiency[n - 1] >= 0.85 * best:
            return n
    return 1


def flash_forward_scratch(b, h, seqlen_q, seqlen_k, head_size, dropout_p, arch, sm_count=None) -> list[int]:
    """Bytes ``mha_fwd`` allocates and frees inside the op (flash_api.cpp).

    ``set_params_splitkv``: without dropout, when batch*heads*ceil(L_q/64) blocks fill
    less than 80% of 2*SMs, the key length is split and each split writes fp32 partial
    results: ``softmax_lse_accum`` (splits, B, H, L_q) and ``out_accum`` (splits, B, H,
    L_q, d_rounded), with ``d_rounded`` the head dim rounded to 32 (to 64 above 128).
    """
    if dropout_p != 0.0:  # "SplitKV is not implemented for dropout"
        return []
    sms = sm_count or SM_COUNT.get(tuple(arch), _DEFAULT_SM_COUNT)
    block_n = 256 if head_size <= 64 else 128 if head_size <= 128 else 64
    splits = _num_splits_heuristic(b * h * ceil_div(seqlen_q, 64), sms * 2, ceil_div(seqlen_k, block_n), 128)
    if splits <= 1:
        return []
    d_rounded = round_up(head_size, 32 if head_size <= 128 else 64)
    return [splits * b * h * seqlen_q * _F32, splits * b * h * seqlen_q * d_rounded * _F32]


@register_op_rule(aten._scaled_dot_product_flash_attention.default)
def cuda_flash_attention(ctx, func, args, kwargs):
    """Forward: the outputs in the layout ``mha_fwd`` gives them, then its split-KV scratch.

    ``mha_fwd`` runs on ``q.transpose(1, 2)`` (B, L, H, D) and allocates ``out =
    empty_like(q_padded)``, which is contiguous (B, L, H, D) unless that view is dense;
    the meta kernel's ``empty_like(query)`` is (B, H, L, D). The bytes match, but the
    layout decides whether the model's ``transpose(1, 2).contiguous()`` and backward's
    ``out.contiguous()`` copy, so the real layout is built here.
    """
    q = args[0]
    if not _cuda_target(ctx, q):
        return func(*args, **kwargs)
    p = bind(func, args, kwargs)
    if p["return_debug_mask"]:
        return func(*args, **kwargs)
    k = p["key"]
    b, h, lq, d = q.shape
    lk = k.shape[2]
    attention = torch.empty_like(q.transpose(1, 2)).transpose(1, 2)
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    debug_mask = torch.empty(0, dtype=q.dtype, device=q.device)
    out = (attention, lse, None, None, lq, lk, rng_state, unused, debug_mask)
    ctx.track(out)
    sm_count = getattr(ctx, "sm_count", None)
    ctx.scratch(*flash_forward_scratch(b, h, lq, lk, d, p["dropout_p"], _arch(ctx), sm_count))
    return out


def flash_backward_scratch(grad_out, q, k, out) -> list[int]:
    """Bytes ``_flash_attention_backward`` + ``mha_bwd`` allocate and free (B, H, L, D args).

    * ``grad_out.contiguous()`` and ``out.contiguous()`` on the (B, L, H, D) views
      (attention_backward.cu), when those views are not contiguous;
    * ``softmax_d`` (B, H, round128(L_q)) fp32 and ``dq_accum`` (B, round128(L_q), H,
      round32(D)) fp32 (flash_api.cpp mha_bwd; D rounded to 64 above 128);
    * with grouped-query attention, ``dk_expanded``/``dv_expanded`` (B, L_k, H, D) in the
      input dtype, summed into dk/dv before returning.
    """
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    sizes = []
    if not grad_out.transpose(1, 2).is_contiguous():
        sizes.append(nbytes(grad_out))
    if not out.transpose(1, 2).is_contiguous():
        sizes.append(nbytes(out))
    lq_rounded = round_up(lq, 128)
    d_rounded = round_up(d, 32 if d <= 128 else 64)
    sizes += [b * h * lq_rounded * _F32, b * lq_rounded * h * d_rounded * _F32]
    if hk != h:
        sizes += [b * lk * h * d * q.element_size()] * 2
    return sizes


@register_op_rule(aten._scaled_dot_product_flash_attention_backward.default)
def cuda_flash_attention_backward(ctx, func, args, kwargs):
    """Backward: dq/dk/dv as ``empty_like`` of the (B, L, H, D) views, then the scratch."""
    grad_out, q, k, v, out = args[:5]
    if not _cuda_target(ctx, q):
        return func(*args, **kwargs)
    grads = tuple(torch.empty_like(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v))
    ctx.track(grads)
    ctx.scratch(*flash_backward_scratch(grad_out, q, k, out))
    return grads


def efficient_forward_scratch(q, v) -> list[int]:
    """``_efficient_attention_forward`` (attention.cu): an fp32 ``output_accum`` (B, M, H, Kv)
    when the kernel cannot keep the output in registers. cutlassF.h's kernels hold it for
    head dims <= 128 (kMaxK 64/128, kSingleValueIteration); above, the 32x128 kMaxK=65536
    kernel needs it unless the output is fp32 (kernel_forward.h kNeedsOutputAccumulatorBuffer)."""
    if q.dtype in _HALF and max(q.shape[-1], v.shape[-1]) > 128:
        b, h, m, _ = q.shape
        return [b * m * h * v.shape[-1] * _F32]
    return []


@register_op_rule(aten._scaled_dot_product_efficient_attention.default)
def cuda_efficient_attention(ctx, func, args, kwargs):
    """Forward: the meta kernel's outputs match ``_efficient_attention_forward`` (output
    (B, M, H, Kv) transposed, logsumexp padded to 32 queries); add its accumulator."""
    out = func(*args, **kwargs)
    if _cuda_target(ctx, args[0]):
        ctx.track(out)
        ctx.scratch(*efficient_forward_scratch(args[0], args[2]))
    return out


# cutlassB.h kernel lists, in dispatch order: (BlockSizeI, BlockSizeJ, kMaxK, preload,
# dropout, keys/queries aligned to the block). The "notaligned" kernels of sm50-sm75
# have the same sizes as the aligned ones and are left out.
def _b(i, j, kmax, preload=False, dropout=False, seq_aligned=False):
    return (i, j, kmax, preload, dropout, seq_aligned)


_SM75_SIZES = [(64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536)]
_SIMT_SIZES = [(64, 64, 32), (64, 64, 64), (64, 64, 128), (64, 64, 65536)]


def _plain(sizes):
    """A list of kernels without preload or seq-aligned variants, then their dropout twins."""
    return [_b(i, j, m) for i, j, m in sizes] + [_b(i, j, m, dropout=True) for i, j, m in sizes]


_B_F16_SM80 = [  # dispatch_cutlassB_f16_sm80; bf16_sm80 is the same list
    _b(64, 64, 32, True, seq_aligned=True), _b(64, 64, 32, True),
    _b(64, 64, 64, True, seq_aligned=True), _b(64, 64, 64, True),
    _b(128, 64, 96, True),  # only cc 86 and 89
    _b(128, 128, 128, True, seq_aligned=True), _b(128, 128, 128, True),
    _b(64, 64, 128, seq_aligned=True), _b(64, 64, 128),
    _b(128, 64, 65536), _b(64, 64, 65536),
    _b(64, 64, 32, True, True), _b(64, 64, 64, True, True), _b(128, 128, 128, True, True),
    _b(64, 64, 128, dropout=True), _b(128, 64, 65536, dropout=True), _b(64, 64, 65536, dropout=True),
]
_B_F32_SM80 = _plain(_SM75_SIZES)  # dispatch_cutlassB_f32_sm80
_B_F16_SM75 = _plain(_SM75_SIZES)  # dispatch_cutlassB_f16_sm75
_B_F16_SM70 = [  # dispatch_cutlassB_f16_sm70: seq-aligned twins for the four smaller kernels
    kernel
    for i, j, m in _SM75_SIZES[:4]
    for kernel in (_b(i, j, m, seq_aligned=True), _b(i, j, m))
] + [_b(128, 64, 65536), _b(64, 64, 65536)] + [_b(i, j, m, dropout=True) for i, j, m in _SM75_SIZES]
_B_SIMT = _plain(_SIMT_SIZES)  # f32 on sm50-sm79, f16 on sm50-sm69


def _cutlass_b_family(dtype, cc: int):
    """``dispatch_cutlassB``: (kernel list, ArchTag's kMinComputeCapability) for dtype and cc."""
    half = dtype in _HALF
    if 80 <= cc <= 121:
        return (_B_F16_SM80 if half else _B_F32_SM80), 80
    if 75 <= cc <= 79:
        return (_B_F16_SM75 if half else _B_SIMT), 75
    if 70 <= cc <= 74:
        return (_B_F16_SM70 if half else _B_SIMT), 70
    if 50 <= cc <= 69:
        return _B_SIMT, 50
    return None, 0


def _pick_backward_kernel(dtype, cc, max_k, m, n, dropout):
    """``launchKernel``'s filter in ``_efficient_attention_backward``: the first kernel with
    kMaxK >= max head dim, dropout support if needed, block-aligned sequences for the
    ``seqaligned`` ones, and (approximated) enough shared memory."""
    kernels, min_cc = _cutlass_b_family(dtype, cc)
    if kernels is None:
        return None, min_cc
    small_smem = cc in (86, 89, 120, 121)  # sharedMemPerBlockOptin ~99 KiB (module docstring)
    for i, j, kmax, preload, has_dropout, seq_aligned in kernels:
        if (i, j, kmax) == (128, 64, 96) and cc not in (86, 89):
            continue
        if kmax < max_k or (dropout and not has_dropout):
            continue
        if seq_aligned and (m % i or n % j):
            continue
        if small_smem and i * j >= 128 * 128:
            continue
        return (i, j, kmax), min_cc
    return None, min_cc


def efficient_backward_workspace(b, h, m, n, k, kv, dtype, cc, dropout) -> tuple[int, bool]:
    """``p.workspace_size()`` of the chosen backward kernel (kernel_backward.h), and
    whether the kernel computes ``delta`` itself (``kKernelComputesDelta``).

    Per (batch, head), in fp32 elements, aligned up to 4:
      gk = splits * J * align_up(K, I) if kNeedsAccumGradK, gv likewise with Kv,
      gq = ceil(M / I) * ceil(K / J) * sizeof(GradQTempStorage) / 4 if kNeedsAccumGradQ,
    with sizeof(GradQTempStorage) = 16 B of lock/counter/pad + I*J fp32 (one
    threadblock's accumulator tile, GmemTile::kElementsStored). kNeedsAccumGradQ holds
    on sm70+ (split keys) or for half outputs; gk/gv only for half outputs not kept in
    registers (kMaxK > I). ``splits`` follows the split-keys heuristic in
    attention_backward.cu.
    """
    kernel, min_cc = _pick_backward_kernel(dtype, cc, max(k, kv), m, n, dropout)
    half = dtype in _HALF
    if kernel is None:
        return 0, False
    i, j, kmax = kernel
    output_in_rf = half and kmax <= i
    computes_delta = half and (output_in_rf or min_cc != 70)
    split_keys = min_cc >= 70
    accum_q = split_keys or half
    accum_kv = (not output_in_rf) and half
    splits = ceil_div(n, j)
    if b * h >= 256 and n <= 2 * j:
        splits = 1
    if accum_kv:
        splits = min(splits, 200 // (b * h))
    if not split_keys or splits < 1:
        splits = 1
    gk = splits * j * round_up(k, i) if accum_kv else 0
    gv = splits * j * round_up(kv, i) if accum_kv else 0
    gq = ceil_div(m, i) * ceil_div(k, j) * (16 + 4 * i * j) // 4 if accum_q else 0
    return b * h * round_up(gk + gv + gq, 4) * _F32, computes_delta


@register_op_rule(aten._scaled_dot_product_efficient_attention_backward.default)
def cuda_efficient_attention_backward(ctx, func, args, kwargs):
    """Backward: the meta kernel's grads match (BMHK-contiguous; grad_bias padded to 16);
    ``_efficient_attention_backward`` (attention_backward.cu) adds, in two phases:

    1. ``grad_out.contiguous()`` of the (B, M, H, Kv) view; unless the kernel computes
       it, ``delta = (grad_out.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()``
       whose temporaries (casts for half inputs, the product, the sum) live until the
       statement ends;
    2. the copy and ``delta`` (B, H, M) fp32 still live, plus the kernel's workspace.
    """
    out = func(*args, **kwargs)
    grad_out, q, k, v, _bias, o = args[:6]
    if not _cuda_target(ctx, q):
        return out
    dropout_p = bind(func, args, kwargs)["dropout_p"]
    b, h, m, kdim = q.shape
    n, kv = k.shape[2], v.shape[3]
    arch = _arch(ctx)
    cc = arch[0] * 10 + arch[1]
    cc = 120 if cc == 121 else cc
    go_copy = 0 if grad_out.transpose(1, 2).is_contiguous() else nbytes(grad_out)
    workspace, computes_delta = efficient_backward_workspace(b, h, m, n, kdim, kv, q.dtype, cc, dropout_p != 0.0)
    delta = b * h * m * _F32
    ctx.track(out)
    if not computes_delta:
        casts = [grad_out.numel() * _F32, o.numel() * _F32] if q.dtype != torch.float32 else []
        ctx.scratch(go_copy, *casts, grad_out.numel() * _F32, b * m * h * _F32, delta)
    ctx.scratch(go_copy, delta, workspace)
    return out


@register_op_rule(aten._scaled_dot_product_cudnn_attention_backward.default)
def cuda_cudnn_attention_backward(ctx, func, args, kwargs):
    """Backward: dq/dk/dv are ``empty_like`` q/k/v as in the meta kernel. ``run_cudnn_SDP_bprop``
    (MHA.cpp) re-lays out dO when its last stride is not 1, then allocates cuDNN's
    workspace, whose size PyTorch does not compute: approximated as an fp32 dQ
    accumulator (B, H, L_q, D) and fp32 softmax sums (B, H, L_q), as flash's mha_bwd."""
    out = func(*args, **kwargs)
    grad_out, q = args[0], args[1]
    if not _cuda_target(ctx, q):
        return out
    ctx.assume("cuDNN SDPA backward workspace approximated as an fp32 dQ accumulator plus softmax sums")
    b, h, lq, d = q.shape
    relayout = nbytes(grad_out) if grad_out.stride(-1) != 1 else 0
    ctx.track(out)
    ctx.scratch(relayout, b * h * lq * d * _F32, b * h * lq * _F32)
    return out
