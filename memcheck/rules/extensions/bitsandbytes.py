"""bitsandbytes: 4-bit and 8-bit quantized linear layers (the 8-bit optimizers are in
``memcheck.training.optimizers``, as a state layout).

Sources: bitsandbytes 0.50.2 as installed from PyPI (read in site-packages):
``nn/modules.py`` (Params4bit, Int8Params, Linear4bit, Linear8bitLt), ``functional.py``
(``quantize_4bit``, ``quantize_blockwise``, QuantState), ``_ops.py`` (the op schemas and
their fake kernels), ``backends/default/ops.py``, ``backends/cpu/ops.py`` and
``backends/cuda/ops.py`` (what each kernel allocates), ``autograd/_functions.py``
(MatMul4Bit, MatMul8bitLt, MatMul8bitFp).

Weights. ``memcheck.engine.setup.meta_twin`` keeps bitsandbytes' parameter classes
(``twin_memo``): the quantized weight and its statistics become meta tensors of the sizes
quantization gives. A layer not yet quantized (built on meta, or on the CPU before
``.cuda()``) is taken as quantized, as moving it to a device does. For n = out*in weights:

* ``Params4bit``: the packed weight ((n+1)//2, 1) uint8; absmax, one per ``blocksize``
  (64) weights: fp32, or with ``compress_statistics`` (the default) uint8 plus a nested
  fp32 absmax per 256 blocks, a 256-entry fp32 code and an fp32 offset; the 16-entry
  fp32 4-bit code (``quantize_4bit``).
* ``Int8Params`` (``has_fp16_weights=False``): the (out, in) int8 weight and ``SCB``, one
  fp32 scale per row (``int8_vectorwise_quant``).

The statistics are neither parameters nor buffers; the tracer counts them with the
weights (``weight_side_tensors``), and ``.to(dtype)`` leaves them, as bitsandbytes does.

Forward and backward run bitsandbytes' own Python on meta; the ops' fakes give their
outputs, and the rules below add what a kernel allocates inside (``ctx.scratch``):

* ``gemm_4bit`` (``Linear4bit`` forward): the CPU kernel (``_gemm_4bit_default_impl``)
  dequantizes the nested absmax (fp32, one per block) and the whole weight into the
  input's dtype, then runs ``F.linear``. The CUDA kernel does the same unless its
  heuristic takes the fused kernel: always above 1,536 rows (M, tokens) or when K is
  not a multiple of the block size, never at 4 rows or fewer; in between the choice
  depends on the GPU (``_gemm_4bit_use_custom_cuda``) and memcheck assumes the
  dequantizing path, the costlier, and says so.
* The backward (``MatMul4Bit``) dequantizes with ``dequantize_blockwise`` and
  ``dequantize_4bit`` from Python: traced as they are.
* ``Linear8bitLt`` on a CPU tensor in training runs ``MatMul8bitFp`` (the int8 weight
  dequantized to the input's dtype, then ``F.linear``; the same in backward), elsewhere
  ``MatMul8bitLt`` (int8 activations, ``int8_scaled_mm``). ``bitsandbytes.matmul``
  chooses by the tensor's device, which is meta in a trace, so the twin's layers choose
  by the target (``_TargetPath8bit``).
* ``int8_scaled_mm`` on CUDA: an int32 (M, N) product and, unless the output is fp16,
  an fp16 (M, N) dequantized copy (``int8_linear_matmul`` and ``int8_mm_dequant``).
* ``int8_vectorwise_quant``, ``int8_double_quant`` and ``int8_mixed_scaled_mm`` with an
  outlier threshold (LLM.int8(), transformers' default 6.0): their fakes need a dynamic
  size and fail on meta; the rules give the outputs with no outlier column (data
  dependent: each outlier column adds about (M + N) * 4 B) and the CUDA temporaries.

Measured on CPU (tests/test_extensions_bitsandbytes.py): a model with ``Linear4bit``
(nf4, nested statistics) or ``Linear8bitLt`` layers and trainable ``Linear`` layers,
trained with SGD or ``bitsandbytes.optim.AdamW8bit``: the estimate matches the profiler's
steady-state peak.

Known limitations:
    * On the CPU target the int8 kernels (``int8_vectorwise_quant``, ``int8_scaled_mm``:
      ``Linear8bitLt`` in eval, and the per-step quantization of ``has_fp16_weights=True``
      weights) count only their outputs, not the default kernels' temporaries; the report
      says so. (Training with int8 weights on CPU takes ``MatMul8bitFp``, which is exact.)
    * ``Linear4bit`` in eval on a CPU with AVX512-BF16 repacks its weight for
      ``gemv_4bit`` (``_convert_weight_packed_for_cpu``); not emulated.
    * The CPU ``dequantize_4bit`` kernel's fallback (block size >= 2048 on AVX-512, or
      an odd input dimension) runs a torch.compile'd function whose temporaries differ.
    * CUDA paths are not measured here (no GPU); their bytes follow the source.
"""

from __future__ import annotations

import copy
import functools
import math
import sys

import torch

from memcheck.enums import Device
from memcheck.rules.registry import bind, register_op_rule
from memcheck.units import nbytes

_F32 = 4
_I32 = 4
_F16 = 2
NESTED_BLOCKSIZE = 256  # quantize_4bit: quantize_blockwise(_absmax - offset, blocksize=256)
DYNAMIC_CODE_ENTRIES = 256  # create_dynamic_map(): 2**8 fp32 values
CODE_4BIT_ENTRIES = 16  # get_4bit_type(): 16 fp32 values
# backends/cuda/ops.py: gemm_4bit's fused kernel always at M <= 4 rows, never above 1,536.
CUDA_GEMM_4BIT_CUSTOM_FLOOR_M = 4
CUDA_GEMM_4BIT_CUSTOM_MAX_M = 1536


def _loaded() -> bool:
    return "bitsandbytes" in sys.modules


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.empty_like(t, device="meta")


# --------------------------------------------------------------------------------------
# Weights: the meta twin.


def _meta_quant_state(qs, memo: dict):
    """A QuantState whose tensors are meta copies of ``qs``'s (one per original, via ``memo``)."""
    from bitsandbytes.functional import QuantState

    if id(qs) in memo:
        return memo[id(qs)]

    def m(t):
        if t is None:
            return None
        if id(t) not in memo:
            memo[id(t)] = _meta(t)
        return memo[id(t)]

    state2 = _meta_quant_state(qs.state2, memo) if qs.state2 is not None else None
    twin = QuantState(absmax=m(qs.absmax), shape=qs.shape, code=m(qs.code), blocksize=qs.blocksize,
                      quant_type=qs.quant_type, dtype=qs.dtype, offset=m(qs.offset), state2=state2)
    memo[id(qs)] = twin
    return twin


def quantized_4bit_state(shape, dtype, blocksize: int, quant_type: str, compress_statistics: bool,
                         quant_storage=torch.uint8):
    """The packed weight and QuantState ``quantize_4bit`` makes for a ``shape`` weight, on meta.

    ``_ops.py`` fake of ``quantize_4bit``: packed ((n + 1) // (2 * itemsize), 1) of
    ``quant_storage``, absmax (ceil(n / blocksize),) fp32; ``functional.quantize_4bit`` with
    ``compress_statistics``: offset = absmax.mean() (0-dim fp32), the absmax quantized
    blockwise by 256 (uint8, same length) with a nested fp32 absmax (ceil(blocks / 256),)
    and a copy of the 256-entry dynamic code; ``get_4bit_type``: the 16-entry code.
    """
    from bitsandbytes.functional import QuantState

    n = math.prod(shape)
    meta = dict(device="meta")
    packed = torch.empty(((n + 1) // (quant_storage.itemsize * 2), 1), dtype=quant_storage, **meta)
    blocks = -(-n // blocksize)
    code = torch.empty(CODE_4BIT_ENTRIES, dtype=torch.float32, **meta)
    if compress_statistics:
        state2 = QuantState(absmax=torch.empty(-(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32, **meta),
                            code=torch.empty(DYNAMIC_CODE_ENTRIES, dtype=torch.float32, **meta),
                            blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        qs = QuantState(absmax=torch.empty(blocks, dtype=torch.uint8, **meta), shape=torch.Size(shape), code=code,
                        blocksize=blocksize, quant_type=quant_type, dtype=dtype,
                        offset=torch.empty((), dtype=torch.float32, **meta), state2=state2)
    else:
        qs = QuantState(absmax=torch.empty(blocks, dtype=torch.float32, **meta), shape=torch.Size(shape), code=code,
                        blocksize=blocksize, quant_type=quant_type, dtype=dtype)
    return packed, qs


def _twin_params4bit(p, module, memo: dict):
    from bitsandbytes.nn import Params4bit

    qs = p.quant_state if p.quant_state is not None else getattr(module, "quant_state", None)
    if p.bnb_quantized and qs is not None:
        data, qs = torch.empty_like(p.data, device="meta"), _meta_quant_state(qs, memo)
    else:  # quantized when moved to a device (Params4bit.to -> _quantize)
        data, qs = quantized_4bit_state(p.shape, p.dtype, p.blocksize, p.quant_type, bool(p.compress_statistics),
                                        p.quant_storage)
        if getattr(module, "quant_state", None) is not None:
            memo[id(module.quant_state)] = qs
    return Params4bit(data, requires_grad=p.requires_grad, quant_state=qs, blocksize=p.blocksize,
                      compress_statistics=p.compress_statistics, quant_type=p.quant_type,
                      quant_storage=p.quant_storage, module=None, bnb_quantized=True)


def _twin_int8params(p, module, memo: dict):
    from bitsandbytes.nn import Int8Params

    if p.has_fp16_weights:  # quantized at every forward, not stored
        return Int8Params(torch.empty_like(p.data, device="meta"), requires_grad=p.requires_grad,
                          has_fp16_weights=True)
    state = getattr(module, "state", None)
    scb = p.SCB if p.SCB is not None else getattr(state, "SCB", None)
    if p.data.dtype == torch.int8 and scb is not None:
        data, scb_twin = torch.empty_like(p.data, device="meta"), memo.setdefault(id(scb), _meta(scb))
    else:  # Int8Params._quantize: int8_vectorwise_quant(weight.half()) -> (out, in) int8, (out,) fp32
        data = torch.empty(p.shape, dtype=torch.int8, device="meta")
        scb_twin = torch.empty(p.numel() // p.shape[-1], dtype=torch.float32, device="meta")
    if state is not None:  # after a forward the statistics live in the layer's MatmulLtState
        if getattr(state, "CB", None) is not None:
            memo[id(state.CB)] = data
        if getattr(state, "SCB", None) is not None:
            memo[id(state.SCB)] = scb_twin
    moved = p.CB is None and getattr(state, "CB", None) is not None  # init_8bit_state ran
    return Int8Params(data, requires_grad=p.requires_grad, has_fp16_weights=False,
                      CB=None if moved else data, SCB=None if moved else scb_twin)


def twin_memo(model, memo: dict) -> None:
    """Put meta twins of bitsandbytes' quantized parameters (and of their statistics,
    and of ``Linear8bitLt`` layers, which choose their path by the target) in ``memo``."""
    if not _loaded():
        return
    from bitsandbytes.nn import Int8Params, Linear8bitLt, Params4bit

    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(memo.get(id(p)), (Params4bit, Int8Params)):
                continue  # a weight shared by two layers
            if isinstance(p, Params4bit):
                memo[id(p)] = _twin_params4bit(p, module, memo)
            elif isinstance(p, Int8Params):
                memo[id(p)] = _twin_int8params(p, module, memo)
    for module in model.modules():
        if isinstance(module, Linear8bitLt) and id(module) not in memo:
            twin = copy.deepcopy(module, memo)  # stored in memo: the model's deepcopy reuses it
            twin.__class__ = _target_path_class(type(module))


def weight_side_tensors(module) -> tuple:
    """The quantization statistics of ``module``'s bitsandbytes weights."""
    if not _loaded():
        return ()
    from bitsandbytes.nn import Int8Params, Linear8bitLt, Params4bit

    found = []
    for p in module.parameters(recurse=False):
        if isinstance(p, Params4bit) and p.quant_state is not None:
            for qs in (p.quant_state, p.quant_state.state2):
                if qs is not None:
                    found += [qs.absmax, qs.code, qs.offset]
        elif isinstance(p, Int8Params):
            found.append(p.SCB)
    if isinstance(module, Linear8bitLt):
        found += [module.state.CB, module.state.SCB]
    return tuple(t for t in found if isinstance(t, torch.Tensor))


# --------------------------------------------------------------------------------------
# Linear8bitLt: the target's path.


def _traced_device() -> Device | None:
    """The target of the memcheck trace running now (the innermost MemoryTracer's)."""
    from memcheck.compat import current_dispatch_modes

    for mode in reversed(current_dispatch_modes()):
        if isinstance(getattr(mode, "device", None), Device):
            return mode.device
    return None


@functools.cache
def _target_path_class(cls: type) -> type:
    """``cls`` (a Linear8bitLt) whose forward takes the path bitsandbytes takes on the target."""

    def forward(self, x):
        from bitsandbytes.autograd import _functions

        cpu_path = getattr(_functions, "MatMul8bitFp", None)  # absent from older releases
        if not (self.training and cpu_path is not None and _traced_device() is Device.CPU):
            return cls.forward(self, x)
        # Linear8bitLt.forward with bitsandbytes.matmul's choice for a CPU tensor in training.
        self.state.is_training = True
        if self.weight.CB is not None:
            self.init_8bit_state()
        if self.bias is not None and self.bias.dtype != x.dtype:
            self.bias.data = self.bias.data.to(x.dtype)
        out = cpu_path.apply(x, self.weight, None, self.bias, self.state)
        if not self.state.has_fp16_weights and self.state.CB is not None:
            self.weight.data = self.state.CB
        return out

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


# --------------------------------------------------------------------------------------
# Kernel rules.


def _rows(a: torch.Tensor) -> int:
    return a.numel() // a.shape[-1] if a.dim() else 1


def _on_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


@register_op_rule("bitsandbytes::gemm_4bit")
def gemm_4bit(ctx, func, args, kwargs):
    """The output, then the dequantized absmax (nested statistics) and weight."""
    out = func(*args, **kwargs)
    a = bind(func, args, kwargs)
    A = a["A"]
    if not _on_meta(A):
        return out
    n_out, k = a["shapeB"]
    weight = n_out * k * A.element_size()  # dequantize_4bit(..., shapeB, A.dtype)
    absmax = a["absmax_8bit"].numel() * _F32 if a.get("absmax_8bit") is not None else 0
    if ctx.device is Device.CPU:
        # _gemm_4bit_default_impl: absmax = dequantize_blockwise(...) + offset (the first
        # freed by the addition), B_dq = dequantize_4bit(...), F.linear(A, B_dq, bias).
        scratch = [absmax, weight]
    else:
        m = _rows(A)
        fused = m <= CUDA_GEMM_4BIT_CUSTOM_FLOOR_M and k % a["blocksize"] == 0
        if not fused and m <= CUDA_GEMM_4BIT_CUSTOM_MAX_M and k % a["blocksize"] == 0:
            ctx.assume(f"bitsandbytes gemm_4bit on CUDA with {m} rows: assumed to dequantize the weight "
                       "(bitsandbytes picks its fused kernel by GPU and shape between 5 and 1,536 rows)")
        # _dequant_linear_fallback: absmax_dq (kept) + offset, then B_dq, then F.linear.
        scratch = [] if fused else [absmax, absmax, weight]
    ctx.track(out)
    ctx.scratch(*scratch)
    return out


def _cuda_scaled_mm_scratch(a_int8: torch.Tensor, n_out: int, dtype) -> list[int]:
    """``int8_scaled_mm`` on CUDA: ``int8_linear_matmul`` (an int32 (M, N)) then
    ``int8_mm_dequant`` (an fp16 (M, N), cast to ``dtype`` unless that is fp16). With an
    inner dim not a multiple of 4, cuBLASLt is skipped for an fp32 matmul of fp32 copies."""
    m, k = _rows(a_int8), a_int8.shape[-1]
    scratch = [m * n_out * _I32]
    if k % 4:
        scratch.append(max(m * k * _F32 + n_out * k * _F32 + m * n_out * _F32, 2 * m * n_out * _F32))
    if dtype not in (None, torch.float16):
        scratch.append(m * n_out * _F16)
    return scratch


def _cpu_int8_note(ctx) -> None:
    ctx.assume("bitsandbytes int8 kernels on CPU (int8_vectorwise_quant, int8_scaled_mm): only their outputs "
               "are counted, not the default kernels' temporaries")


@register_op_rule("bitsandbytes::int8_scaled_mm")
def int8_scaled_mm(ctx, func, args, kwargs):
    """The output, and on CUDA the int32 product and fp16 copy (``_cuda_scaled_mm_scratch``)."""
    out = func(*args, **kwargs)
    a = bind(func, args, kwargs)
    if not _on_meta(a["A"]):
        return out
    if ctx.device is Device.CPU:
        _cpu_int8_note(ctx)
        return out
    ctx.track(out)
    ctx.scratch(*_cuda_scaled_mm_scratch(a["A"], a["B"].shape[0], a.get("dtype")))
    return out


@register_op_rule("bitsandbytes::int8_mixed_scaled_mm")
def int8_mixed_scaled_mm(ctx, func, args, kwargs):
    """LLM.int8() with a threshold, no outlier column: ``int8_scaled_mm`` plus an empty ``subA``."""
    a = bind(func, args, kwargs)
    A, CA, CB = a["A"], a["CA"], a["CB"]
    if not _on_meta(A):
        return func(*args, **kwargs)
    ctx.assume("bitsandbytes LLM.int8() threshold: no outlier columns assumed (data dependent)")
    out = torch.empty((*CA.shape[:-1], CB.shape[0]), dtype=A.dtype, device=A.device)
    sub_a = torch.empty(0, dtype=A.dtype, device=A.device)
    ctx.track((out, sub_a))
    if ctx.device is Device.CPU:
        _cpu_int8_note(ctx)
    else:
        ctx.scratch(*_cuda_scaled_mm_scratch(CA, CB.shape[0], A.dtype))
    return out, sub_a


@register_op_rule("bitsandbytes::int8_vectorwise_quant")
def int8_vectorwise_quant(ctx, func, args, kwargs):
    """Row-wise int8 activations and their fp32 scales; with a threshold, CUDA's
    ``A.abs() >= threshold`` (an A-sized copy and a bool mask) and no outlier column."""
    a = bind(func, args, kwargs)
    A, threshold = a["A"], float(a.get("threshold") or 0.0)
    if not _on_meta(A):
        return func(*args, **kwargs)
    if ctx.device is Device.CPU:
        _cpu_int8_note(ctx)
    if threshold == 0.0:
        return func(*args, **kwargs)
    ctx.assume("bitsandbytes LLM.int8() threshold: no outlier columns assumed (data dependent)")
    out = (torch.empty(A.shape, dtype=torch.int8, device=A.device),
           torch.empty(_rows(A), dtype=torch.float32, device=A.device),
           torch.empty(0, dtype=torch.int64, device=A.device))
    ctx.track(out)
    if ctx.device is Device.CUDA:
        ctx.scratch(nbytes(A), A.numel())
    return out


@register_op_rule("bitsandbytes::int8_double_quant")
def int8_double_quant(ctx, func, args, kwargs):
    """Row- and column-wise int8 copies and scales (an int8 weight trained with
    ``has_fp16_weights=True``, and the gradient in backward). On CUDA the column-wise
    half is computed in torch: ``round(A * 127 / col_stats)`` holds two fp32 (M, K)
    temporaries before its int8 result exists."""
    a = bind(func, args, kwargs)
    A, threshold = a["A"], float(a.get("threshold") or 0.0)
    if not _on_meta(A):
        return func(*args, **kwargs)
    if threshold:
        ctx.assume("bitsandbytes LLM.int8() threshold: no outlier columns assumed (data dependent)")
    if ctx.device is Device.CPU:
        _cpu_int8_note(ctx)
    meta = dict(device=A.device)
    row, col = (torch.empty(A.shape, dtype=torch.int8, **meta) for _ in range(2))
    row_stats = torch.empty(_rows(A), dtype=torch.float32, **meta)
    col_stats = torch.empty(A.shape[-1], dtype=torch.float32, **meta)
    outliers = torch.empty(0, dtype=torch.int64, **meta) if threshold else None
    ctx.track((row, row_stats, col_stats, outliers))
    if ctx.device is Device.CUDA:
        masked = [nbytes(A)] if threshold else []  # A.masked_fill(outlier_mask, 0.0)
        ctx.scratch(*masked, A.numel() * _F32, A.numel() * _F32)
    ctx.track(col)
    return row, col, row_stats, col_stats, outliers


# --------------------------------------------------------------------------------------
# Optimizer steps on the CPU target (optimizers run as themselves; see memcheck.training.optimizers).
#
# backends/cpu/ops.py ``_optimizer_update_8bit_blockwise_cpu`` and ``_optimizer_update_32bit_cpu``
# are torch code: per parameter of n elements (f = 4n bytes of fp32) they hold, until they
# return, the fp32 gradient ``g.float() * gnorm_scale`` (f), the parameter in fp32 (f unless
# it is fp32 already) and, for 8-bit state, both states dequantized (f each; AdEMAMix's
# first state is two halves and their stack, 4f); on top of which each optimizer's formula
# holds, at its busiest, the temporaries below. Re-quantizing a state makes a uint8 copy
# and an fp32 absmax (n + 4 * blocks bytes), one state at a time. The CUDA kernels update
# in place and allocate nothing, as the ops' fakes do.


def _cpu_formula_8bit(name: str, f: int, requant: int) -> int:
    """The most bytes one 8-bit step's formula holds beyond the dequantized states and gradient."""
    if name in ("adam", "lamb"):  # denom = (s2.sqrt() / c2).add_(eps): sqrt and quotient, then denom
        return max(2 * f, f + requant)
    if name == "lion":  # sign(s1.mul(b1) + grad.mul(1 - b1)): two products and their sum
        return max(3 * f, f + requant)
    if name in ("rmsprop", "adagrad"):  # addcdiv_(grad, s1.sqrt().add_(eps))
        return max(f, requant)
    if name == "ademamix":  # three at once in the update's formula; then the update and a new stack
        return 3 * f + requant
    return requant  # momentum, lars: in place


def _cpu_formula_32bit(name: str, f: int, weight_decay: float) -> int:
    """The most bytes one 32-bit step's formula holds beyond the fp32 gradient."""
    decayed = f if weight_decay > 0.0 else 0  # g_wd = g_float.add(p_float, alpha=weight_decay)
    if name in ("adam", "lamb", "lion"):  # sqrt and sum (adam); product and sum (lion)
        return 2 * f
    if name == "ademamix":
        return 3 * f
    if name in ("rmsprop", "adagrad"):
        return decayed + 2 * f
    return decayed  # momentum, lars


def _fp32_copy(t: torch.Tensor) -> int:
    return 0 if t.dtype == torch.float32 else t.numel() * _F32


@register_op_rule("bitsandbytes::optimizer_update_8bit_blockwise")
def optimizer_update_8bit_blockwise(ctx, func, args, kwargs):
    """On the CPU target: the fp32 temporaries of ``_optimizer_update_8bit_blockwise_cpu``."""
    out = func(*args, **kwargs)
    a = bind(func, args, kwargs)
    p = a["p"]
    if ctx.device is not Device.CPU or not _on_meta(p):
        return out
    name, n = a["optimizer_name"], p.numel()
    f = n * _F32
    halves = name == "ademamix" and a["absmax1"].dim() == 2
    held = [4 * f if halves else f]
    if all(a.get(k) is not None for k in ("state2", "qmap2", "absmax2")):
        held.append(f)
    held += [f, _fp32_copy(p)]
    requant = n + a["absmax1"].shape[-1] * _F32
    ctx.scratch(*held, _cpu_formula_8bit(name, f, requant))
    return out


@register_op_rule("bitsandbytes::optimizer_update_32bit")
def optimizer_update_32bit(ctx, func, args, kwargs):
    """On the CPU target: the fp32 temporaries of ``_optimizer_update_32bit_cpu``."""
    out = func(*args, **kwargs)
    a = bind(func, args, kwargs)
    p = a["p"]
    if ctx.device is not Device.CPU or not _on_meta(p):
        return out
    f = p.numel() * _F32
    ctx.scratch(f, _fp32_copy(p), _cpu_formula_32bit(a["optimizer_name"], f, float(a.get("weight_decay") or 0.0)))
    return out
