"""The grouped GEMM of mixture-of-experts layers: ``aten._grouped_mm``.

transformers runs its experts through ``torch.nn.functional.grouped_mm`` (the
``grouped_mm`` experts implementation, its default; ``transformers/integrations/moe.py``
``_grouped_mm``), which is ``aten._grouped_mm``, for the forward and, through its
derivative, for both gradients of the backward. The op's meta kernel
(``torch/_meta_registrations.py`` ``_meta_grouped_mm_common``) applies the checks of the
CUDA fast path, bf16 inputs only, so a float32 model cannot be traced at all; and on a
CPU build it leaves out the padded output stride that the real kernels allocate. The
rule below stands in for it on every target, following the real kernels instead:

* ``_grouped_mm_cuda`` (aten/src/ATen/native/cuda/GroupedBlas.cpp) and the CPU kernel
  both validate with ``_grouped_mm_validate_inputs`` (aten/src/ATen/native/
  GroupedMMUtils.h): float32, bfloat16 or float16 operands, 2-D or 3-D, strides 16-byte
  aligned, ``offs`` (int32, 1-D) exactly when an operand is 2-D, no bias; and the output
  dtype is ``mat_a``'s (``_resolve_grouped_mm_out_dtype``).
* The output comes from ``create_grouped_gemm_output_tensor`` (same header): its shape
  follows the operands' layouts, and on every build but ROCm its last dimension's
  stride is padded to a multiple of 16 bytes (for TMA transfers), so a row of ``N``
  elements takes ``round_up(N, 16 / itemsize)`` of them in the storage.
* The kernels then write that output in place (``_grouped_mm_fallback``: ``mm_out``
  into a slice per group; the CUDA bf16 fast path writes it directly). Measured on CPU
  (torch 2.13, profiler allocation events; 2-D x 3-D forward, the 2-D x 2-D weight
  gradient and the 2-D x 3-D input gradient, 256 to 2,048 rows): float32 and float16
  allocate the output only, exactly. bfloat16 ``mm`` on CPU goes through oneDNN, which
  also takes and frees a packing buffer for each group's GEMM (tens of KiB to ~1 MiB,
  depending on the group's rows); like bf16 ``mm`` elsewhere in memcheck, that
  transient is not modelled.

The output's size does not depend on how the rows split across groups (the values of
``offs``): the tokens routed to the experts, ``tokens * top_k`` rows, all go through
one call. So this rule needs no routing assumption.
"""

from __future__ import annotations

import torch

from memcheck import compat
from memcheck.rules.registry import bind, register_op_rule
from memcheck.units import round_up

aten = torch.ops.aten

TMA_ALIGNMENT = 16  # bytes: create_grouped_gemm_output_tensor pads the output's row stride to this
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # _grouped_mm_validate_inputs


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """``check_valid_strides_and_return_transposed``: row- or column-major in the last two
    dimensions, with the leading stride a multiple of 16 bytes (the real kernels raise
    otherwise, so the trace does too)."""
    stride, size, alignment = mat.stride(), mat.shape, TMA_ALIGNMENT // mat.element_size()
    if stride[-2] == 1 and stride[-1] >= max(1, size[-2]):
        _check(stride[-1] % alignment == 0, f"{name}: strides should be multiple of 16 bytes")
    elif stride[-1] == 1 and stride[-2] >= max(1, size[-1]):
        _check(stride[-2] % alignment == 0, f"{name}: strides should be multiple of 16 bytes")
    else:
        _check(False, f"{name}: invalid strides/sizes, got {tuple(stride)} for strides and {tuple(size)} for sizes")


def grouped_mm_output_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The output's shape (``create_grouped_gemm_output_tensor``): 2-D x 3-D (the MoE
    forward and input gradient) gives ``(rows, N)``; 2-D x 2-D (the weight gradient) one
    ``(M, N)`` matrix per group; 3-D x 2-D ``(M, N)``; 3-D x 3-D is ``bmm``."""
    if a.dim() == 2:
        if b.dim() == 2:
            return (offs.shape[0], a.shape[0], b.shape[1])
        _check(offs.shape[0] == b.shape[0], "matrix batch sizes have to match")
        return (a.shape[0], b.shape[-1])
    if b.dim() == 2:
        _check(offs.shape[0] == a.shape[0], "matrix batch sizes have to match")
        return (a.shape[1], b.shape[1])
    _check(a.shape[0] == b.shape[0], "batched dimension has to match")
    return (a.shape[0], a.shape[1], b.shape[-1])


def grouped_mm_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor laid out as the real output: the last dimension's stride padded to
    ``TMA_ALIGNMENT`` bytes, so its storage (and memcheck's count) is what the kernel allocates."""
    padded = round_up(shape[-1], TMA_ALIGNMENT // dtype.itemsize)
    stride = (padded, 1) if len(shape) == 2 else (shape[1] * padded, padded, 1)
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def grouped_mm(ctx, func, args, kwargs):
    """``torch._grouped_mm`` / ``F.grouped_mm`` on meta: the real kernels' checks and their
    padded output, for float32, bfloat16 and float16 on every target (module docstring)."""
    b = bind(func, args, kwargs)
    a, m, offs, bias, out_dtype = b["self"], b["mat2"], b["offs"], b["bias"], b["out_dtype"]
    if not any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in (a, m)):
        return func(*args, **kwargs)
    for name, t in (("mat_a", a), ("mat_b", m)):
        _check(t.dtype in _DTYPES, f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {t.dtype}")
        _check(t.dim() in (2, 3), f"{name} has to be 2 or 3d")
    _check(a.dtype == m.dtype, f"expected mat_a and mat_b to have the same dtype, got {a.dtype} and {m.dtype}")
    if a.dim() == 3 or m.dim() == 3:
        _check(a.shape[-1] == m.shape[-2], "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", a)
    _check_strides("mat_b", m)
    needs_offs = a.dim() == 2 or m.dim() == 2
    _check((offs is not None) == needs_offs,
           "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        _check(offs.dim() == 1 and offs.dtype == torch.int32, "offs has to be a 1D int32 tensor")
    _check(bias is None, "Bias not supported yet")
    dtype = out_dtype or a.dtype
    _check(dtype == a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
    return grouped_mm_output(grouped_mm_output_shape(a, m, offs), dtype)


if compat.GROUPED_MM is not None:  # torch 2.8+ (memcheck.compat.GROUPED_MM)
    register_op_rule(compat.GROUPED_MM.default, grouped_mm)
