"""flash-attn (the ``flash_attn`` package, FlashAttention-2): what its CUDA kernels allocate.

From flash-attn 2.7 on (Dao-AILab/flash-attention PR #1139, merged August 2024),
``flash_attn_func``, ``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` and the
``varlen`` variants call four torch custom ops, registered with ``torch.library.custom_op``
and a fake kernel each: ``flashattn::_flash_attn_forward``, ``_flash_attn_backward``,
``_flash_attn_varlen_forward`` and ``_flash_attn_varlen_backward``. On meta tensors the
fakes return the outputs; the rules below return the same outputs, as ``mha_fwd`` lays
them out, and add the buffers the kernels allocate and free inside the op.

Sources (read through the code search): ``flash_attn/flash_attn_interface.py`` at
v2.8.3 (commit 005300258a22e5fc6be621063c3d5704e82b89d9) and ``csrc/flash_attn/flash_api.cpp``
at commit 00979f57acf503b0b080ff08ada0007080074649 (``mha_fwd``, ``mha_varlen_fwd``,
``mha_bwd``, ``mha_varlen_bwd``, ``set_params_splitkv``, ``num_splits_heuristic``). That
copy takes a value head dim apart from the query's; with equal head dims, as every
release up to 2.8.3 requires, its allocations are those of the releases.

Forward (``mha_fwd``): ``out`` (B, L_q, H, D_v) in the input dtype, ``softmax_lse`` (B, H, L_q)
fp32, ``rng_state`` 2 int64, the probabilities ``p`` (B, H, round128(L_q), round128(L_k))
only with ``return_softmax`` (dropout > 0); without dropout, when B*H*ceil(L_q/64) blocks
fill less than 80% of 2*SMs, the split-KV scratch ``softmax_lse_accum`` (splits, B, H, L_q)
and ``out_accum`` (splits, B, H, L_q, round(D_v)) fp32 (``set_params_splitkv``).
Backward (``mha_bwd``; dq/dk/dv are allocated by the Python caller, traced as they are):
``softmax_d`` (B, H, round128(L_q)) fp32 as the op's output; ``dq_accum`` (B,
round128(L_q), H, round(D)) fp32, or with ``deterministic`` ceil(SMs/(B*H)) of them;
``dk_expanded``/``dv_expanded`` (B, L_k, H, D) for MQA/GQA. ``round`` is to 32 up to 192,
else 256. Both copy inputs whose last stride is not 1 (``maybe_contiguous``) for the
kernel's duration. The SM count is one representative card per compute capability
(``memcheck.rules.cuda_attention.SM_COUNT``) unless the tracer has ``sm_count``.

Not covered:
    * flash-attn before 2.7 calls its CUDA extension (``flash_attn_2_cuda.fwd``) directly
      from Python, and ``flash_attn_with_kvcache`` does in every version: meta tensors
      cannot reach a kernel that way, so tracing fails; ``explain_failure`` turns the
      failure into a message naming flash_attn.
    * FlashAttention-3 (``flash_attn_interface`` of the ``hopper`` build) and the CuTe
      FlashAttention-4 ops, which have other names.
    * flash-attn runs on CUDA only: on the CPU target these ops are a usage error.
    * Not measured: no GPU was available; the byte counts follow the source, and the
      tests check them against hand arithmetic.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from memcheck.enums import Device
from memcheck.errors import UsageError
from memcheck.rules.cuda_attention import _DEFAULT_SM_COUNT, _F32, SM_COUNT, _num_splits_heuristic
from memcheck.rules.registry import bind, register_op_rule
from memcheck.units import ceil_div, nbytes, round_up

_I64 = 8


def _head_rounded(d: int) -> int:
    """``head_size_rounded``: the head dim rounded to 8, then to 32 up to 192, else 256."""
    d = round_up(d, 8)
    return round_up(d, 32) if d <= 192 else 256


def _sm_count(ctx) -> int:
    return getattr(ctx, "sm_count", None) or SM_COUNT.get(tuple(getattr(ctx, "arch", (8, 0))), _DEFAULT_SM_COUNT)


def _check_target(ctx, name: str) -> None:
    if ctx.device is not Device.CUDA:
        raise UsageError(f"flash_attn ({name}) runs on CUDA GPUs only; estimate this model with device='cuda'")


def _copies(*tensors) -> list[int]:
    """``maybe_contiguous``: a copy of each input whose last dimension is not contiguous."""
    return [nbytes(t) for t in tensors if t is not None and t.stride(-1) != 1]


def _padded(t, d: int) -> int:
    """Bytes of ``t`` with its head dim ``d`` padded to a multiple of 8 (``pad`` to ``8 - d % 8``)."""
    return t.numel() // d * round_up(d, 8) * t.element_size()


def split_kv_scratch(ctx, b: int, h: int, lq: int, lk: int, d: int, dv: int, dropout_p: float) -> list[int]:
    """``set_params_splitkv``: ``softmax_lse_accum`` and ``out_accum`` when the key length is split."""
    if dropout_p != 0.0:  # "SplitKV is not implemented for dropout"
        return []
    head = max(round_up(d, 8), round_up(dv, 8))
    block_n = 256 if head <= 64 else 128 if head <= 128 else 64
    splits = _num_splits_heuristic(b * h * ceil_div(lq, 64), _sm_count(ctx) * 2, ceil_div(lk, block_n), 128)
    if splits <= 1:
        return []
    return [splits * b * h * lq * _F32, splits * b * h * lq * _head_rounded(dv) * _F32]


def _ngroups_swapped(lq: int, lk: int, h: int, hk: int, d: int, a: dict) -> bool:
    """``seqlenq_ngroups_swapped``: one query row with grouped heads is laid out as ngroups rows
    (windows of at least the key length count as none, as ``mha_fwd`` resets them)."""
    left, right = (a.get(name) for name in ("window_size_left", "window_size_right"))
    windowed = any(w is not None and 0 <= w < lk for w in (left, right))
    return (lq == 1 and h > hk and not windowed and not a.get("dropout_p") and d % 8 == 0
            and a.get("alibi_slopes") is None)


@register_op_rule("flashattn::_flash_attn_forward")
def flash_attn_forward(ctx, func, args, kwargs):
    """``mha_fwd``: (out_padded, softmax_lse, S_dmask, rng_state), then the split-KV scratch."""
    a = bind(func, args, kwargs)
    q, k, v = a["q"], a["k"], a["v"]
    if q.device.type != "meta":
        return func(*args, **kwargs)
    _check_target(ctx, "flash_attn_func")
    b, lq, h, d = q.shape
    lk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    scratch = _copies(q, k, v)
    if d % 8:  # the Python wrappers pad to 8 first; a direct call is padded inside
        scratch += [_padded(q, d), _padded(k, d)]
    if dv % 8:
        scratch.append(_padded(v, dv))
    rows, heads = lq, h
    if _ngroups_swapped(lq, lk, h, hk, d, a):
        rows, heads = h // hk, hk
    dropout_p = float(a.get("dropout_p") or 0.0)
    out = torch.empty((b, lq, h, round_up(dv, 8)), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    if a.get("return_softmax"):
        p = torch.empty((b, heads, round_up(rows, 128), round_up(lk, 128)), dtype=q.dtype, device=q.device)
    else:
        p = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    result = (out, lse, p, rng_state)
    ctx.track(result)
    ctx.scratch(*scratch, *split_kv_scratch(ctx, b, heads, rows, lk, d, dv, dropout_p))
    return result


@register_op_rule("flashattn::_flash_attn_varlen_forward")
def flash_attn_varlen_forward(ctx, func, args, kwargs):
    """``mha_varlen_fwd``: out (total_q, H, D_v), softmax_lse (H, total_q) fp32; split-KV
    only for single-query grouped-head decoding (``seqlenq_ngroups_swapped``)."""
    a = bind(func, args, kwargs)
    q, k, v = a["q"], a["k"], a["v"]
    if q.device.type != "meta":
        return func(*args, **kwargs)
    _check_target(ctx, "flash_attn_varlen_func")
    total_q, h, d = q.shape
    b = a["cu_seqlens_q"].numel() - 1
    paged = a.get("block_table") is not None
    hk = k.shape[2] if paged else k.shape[1]
    dv = v.shape[-1]
    max_q, max_k = int(a["max_seqlen_q"]), int(a["max_seqlen_k"])
    scratch = _copies(q, k, v)
    if d % 8:
        scratch += [_padded(q, d), _padded(k, d)]
    if dv % 8:
        scratch.append(_padded(v, dv))
    out = torch.empty((total_q, h, round_up(dv, 8)), dtype=q.dtype, device=q.device)
    lse = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    if a.get("return_softmax"):
        p = torch.empty((b, h, round_up(max_q, 128), round_up(max_k, 128)), dtype=q.dtype, device=q.device)
    else:
        p = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    result = (out, lse, p, rng_state)
    ctx.track(result)
    if _ngroups_swapped(max_q, max_k, h, hk, d, a):
        scratch += split_kv_scratch(ctx, b, hk, h // hk, max_k, d, dv, 0.0)
    ctx.scratch(*scratch)
    return result


def _backward_scratch(ctx, a, rows_accum: int, b: int, h: int, hk: int, expanded_dk: int,
                      expanded_dv: int) -> list[int]:
    """The buffers ``mha_bwd``/``mha_varlen_bwd`` allocate and free.

    ``rows_accum`` is dq_accum's row count (B*round128(L_q), or total_q + 128*B for varlen).
    """
    q, dout = a["q"], a["dout"]
    d = q.shape[-1]
    scratch = _copies(dout, q, a["k"], a["v"], a["out"])
    for name, like in (("dq", q), ("dk", a["k"]), ("dv", a["v"])):
        if a.get(name) is None:  # the C++ side allocates it; the Python op discards it
            scratch.append(nbytes(like))
    accum = rows_accum * h * _head_rounded(d) * _F32
    if a.get("deterministic"):
        accum *= ceil_div(_sm_count(ctx), b * h)  # torch::zeros({nsplits, ...})
    scratch.append(accum)
    if hk != h:  # MQA/GQA: dK and dV for every query head, summed into dk/dv at the end
        scratch += [expanded_dk, expanded_dv]
    if dout.shape[-1] % 8:
        scratch.append(_padded(dout, dout.shape[-1]))
    return scratch


@register_op_rule("flashattn::_flash_attn_backward")
def flash_attn_backward(ctx, func, args, kwargs):
    """``mha_bwd``: returns ``softmax_d``; dq/dk/dv are written in place."""
    a = bind(func, args, kwargs)
    q, k, v = a["q"], a["k"], a["v"]
    if q.device.type != "meta":
        return func(*args, **kwargs)
    _check_target(ctx, "flash_attn_func backward")
    b, lq, h, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    esize = q.element_size()
    scratch = _backward_scratch(ctx, a, b * round_up(lq, 128), b, h, hk,
                                b * lk * h * d * esize, b * lk * h * v.shape[3] * esize)
    softmax_d = torch.empty((b, h, round_up(lq, 128)), dtype=torch.float32, device=q.device)
    ctx.track(softmax_d)
    ctx.scratch(*scratch)
    return softmax_d


@register_op_rule("flashattn::_flash_attn_varlen_backward")
def flash_attn_varlen_backward(ctx, func, args, kwargs):
    """``mha_varlen_bwd``: softmax_d (H, total_q + 128*B); dq_accum (total_q + 128*B, H, round(D))."""
    a = bind(func, args, kwargs)
    q, k, v = a["q"], a["k"], a["v"]
    if q.device.type != "meta":
        return func(*args, **kwargs)
    _check_target(ctx, "flash_attn_varlen_func backward")
    total_q, h, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    b = a["cu_seqlens_q"].numel() - 1
    esize = q.element_size()
    scratch = _backward_scratch(ctx, a, total_q + 128 * b, b, h, hk,
                                total_k * h * d * esize, total_k * h * v.shape[-1] * esize)
    softmax_d = torch.empty((h, total_q + 128 * b), dtype=torch.float32, device=q.device)
    ctx.track(softmax_d)
    ctx.scratch(*scratch)
    return softmax_d


# --------------------------------------------------------------------------------------
# Before 2.7: the CUDA extension is called directly.

_DIRECT_CALLS = {"_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                 "_flash_attn_varlen_backward", "flash_attn_with_kvcache"}


def explain_failure(exc: BaseException) -> str | None:
    """Name flash_attn when tracing failed in a flash_attn function that calls
    ``flash_attn_2_cuda`` itself rather than a ``torch.ops.flashattn`` op."""
    tb, last, package = exc.__traceback__, None, None
    while tb is not None:  # the innermost frame in the flash_attn package
        frame = tb.tb_frame
        if "flash_attn" in Path(frame.f_code.co_filename).parts:
            last, package = frame.f_code.co_name, frame.f_globals.get("__name__", "").split(".")[0]
        tb = tb.tb_next
    if last not in _DIRECT_CALLS:
        return None
    if last == "flash_attn_with_kvcache":
        return ("flash_attn.flash_attn_with_kvcache calls its CUDA extension (flash_attn_2_cuda) directly, "
                "which meta tensors cannot run, in every flash-attn version; memcheck cannot trace it")
    version = getattr(sys.modules.get(package), "__version__", None)
    return (f"flash_attn{' ' + version if version else ''} calls its CUDA extension (flash_attn_2_cuda) directly, "
            "which meta tensors cannot run; memcheck traces flash-attn >= 2.7, whose functions call "
            "torch.ops.flashattn ops")

