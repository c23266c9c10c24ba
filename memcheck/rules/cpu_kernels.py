"""Rules for CPU kernels that allocate inside the op what their meta kernels do not.

oneDNN (mkldnn) convolutions reorder inputs and weights into blocked layouts and
own an internal destination (1-d ones run as 2-d, on a contiguous copy of their input);
the CPU batch norm keeps small temporaries; the CPU layer norm copies a non-contiguous
input; the oneDNN LSTM keeps a workspace for backward that the meta kernel reports as empty.
Each rule emits those buffers right after the op's outputs (``ctx.scratch``), so
that the peak inside the op is what the CPU allocator sees.

Where the numbers come from: profiler allocation events of real CPU ops, swept
over 2,352 convolution configurations (C_in 1-64, C_out 8-64, kernel 1/3/5,
stride 1/2, groups 1 and depthwise, batch 1-32, 1 and 2 threads) on torch 2.13
with oneDNN 3.12 on an AVX-512 CPU (channel block 16). Forward peaks matched in
every groups=1 and depthwise configuration; backward matched in most and is low
by the oneDNN scratchpad otherwise (mean 0.6% at batch 32, 32x32 images). The
block size follows ``torch.backends.cpu.get_cpu_capability()``: 8 on AVX2
machines, which is not verified.

Channels-last inputs (ConvNext, SegFormer, PvtV2 permute their activations) take
oneDNN's NHWC primitives instead, with their own buffers (``_nhwc_plan``), and their
output is channels-last where the meta kernel's is contiguous; the rule returns the
CPU's layout so that the next convolution takes the same path as on the CPU.
"""

from __future__ import annotations

import functools
import math

import torch

from memcheck.rules.cuda_kernels import cudnn_convolution_scratch
from memcheck.enums import Device
from memcheck.rules.probe import cpu_memory_events, running_peak
from memcheck.rules.registry import register_op_rule
from memcheck.units import nbytes, round_up

aten = torch.ops.aten


def _block() -> int:
    return 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8


def conv_uses_mkldnn(input_shape, weight_shape, stride, dilation, groups, dtype) -> bool:
    """``ConvParams::use_mkldnn`` (aten/src/ATen/native/ConvUtils.h) for a CPU NCHW input."""
    if not (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()):
        return False
    if dtype in (torch.bfloat16, torch.float16):
        return True
    if dtype != torch.float32:
        return False
    n = input_shape[0]
    kh, kw = weight_shape[-2], weight_shape[-1]
    strided = any(s != 1 for s in stride)
    dilated = any(d != 1 for d in dilation)
    cond1 = strided or dilated or n >= 16 or kw != 1 or kh != 1 or torch.get_num_threads() > 1
    cond2 = groups > 1 or (kw > 3 and kh > 3) or n > 1 or math.prod(input_shape) > 20480
    return cond1 and cond2


# Backward-weights of a groups=1 NCHW convolution with a kernel side of 15 or more (ViT and
# SigLIP patch embeddings) runs oneDNN's gemm-based implementation: it reads the plain
# tensors and keeps an im2col scratchpad instead of blocked copies. Profiled kernel sides 10-14
# take the jit kernels above; 15 and 16 the gemm one, for C_in 1, 3, 8 and 16 and 1 or 2 threads.
GEMM_BWD_WEIGHTS_MIN_KERNEL = 15


def _conv_plan(inp, wt, stride, padding, dilation, groups, es=4):
    """Buffer sizes of the oneDNN primitives, by implementation (see module docstring)."""
    blk = _block()
    n, ci, h, w = inp
    co, cig, kh, kw = wt
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    strided = stride[0] > 1 or stride[1] > 1
    one_by_one = kh == 1 and kw == 1 and padding[0] == 0 and padding[1] == 0
    depthwise = groups > 1 and groups == ci and co == ci
    p = {"geom": (n, ci, co, cig, h, w, kh, kw, oh, ow)}
    small = 192 if co % blk else 0  # seen whenever the output channels are padded
    if groups == 1:
        if one_by_one:
            p["f_src"] = es * n * round_up(ci, blk) * h * w
            p["f_wei"] = es * round_up(co, blk) * round_up(ci, blk)
            p["f_scr"] = (es * torch.get_num_threads() * round_up(ci, blk) * oh * ow + 128) if strided else 0
        elif ci < blk:  # the "first conv" kernel reads the plain input in place
            p["f_src"], p["f_wei"], p["f_scr"] = 0, es * round_up(co, blk) * ci * kh * kw, 0
        else:
            p["f_src"] = es * n * round_up(ci, blk) * h * w
            p["f_wei"] = es * round_up(co, blk) * round_up(ci, blk) * kh * kw
            p["f_scr"] = 0
        p["f_dst"], p["f_small"] = es * n * round_up(co, blk) * oh * ow, small
        if strided:  # brgconv_strided works in NHWC; to_dense ends with a .contiguous() clone
            p["d_ddst"] = es * n * co * oh * ow
            p["d_wei"] = es * co * round_up(ci, blk) * kh * kw
            p["d_dsrc"] = es * n * ci * h * w
            p["d_nhwc"] = ci > 1 and h * w > 1
            p["d_scr"] = 61488  # the smallest scratchpad seen; larger ones are not modelled
        else:
            p["d_ddst"] = es * n * round_up(co, blk) * oh * ow
            p["d_wei"] = es * round_up(co, blk) * round_up(ci, blk) * kh * kw
            p["d_dsrc"] = es * n * round_up(ci, blk) * h * w
            p["d_nhwc"], p["d_scr"] = False, 0
        if one_by_one or ci >= blk:
            b = blk
            p["w_src"] = es * n * round_up(ci, b) * h * w
            p["w_dwei"] = es * round_up(co, b) * round_up(ci, b) * (1 if one_by_one else kh * kw)
        elif ci < 4:
            b = blk
            p["w_src"], p["w_dwei"] = 0, es * round_up(co, b) * ci * kh * kw
        else:  # 4 <= C_in < block: an AVX2 kernel with 8-channel blocks
            b = 8
            p["w_src"] = es * n * round_up(ci, b) * h * w
            p["w_dwei"] = es * round_up(co, b) * round_up(ci, b) * kh * kw
        p["w_ddst"] = es * n * round_up(co, b) * oh * ow
        if max(kh, kw) >= GEMM_BWD_WEIGHTS_MIN_KERNEL:
            # im2col columns per thread and four weight-sized reduction buffers per thread (+ 64 floats):
            # 2,777,344 B for SigLIP's Conv2d(3, 64, 16, stride=16) on (4, 3, 224, 224) with 2 threads.
            nthr = torch.get_num_threads()
            p.update(w_ddst=0, w_src=0, w_dwei=es * co * ci * kh * kw,
                     w_scr=es * (nthr * (ci * kh * kw * oh * ow + 4 * co * ci * kh * kw) + 64))
    elif depthwise:
        c = ci
        p.update(
            f_src=es * n * round_up(c, blk) * h * w, f_wei=es * round_up(c, blk) * kh * kw,
            f_dst=es * n * round_up(c, blk) * oh * ow, f_scr=0, f_small=small,
            d_ddst=es * n * round_up(c, blk) * oh * ow, d_nhwc=False, d_scr=0,
        )
        p["d_wei"], p["d_dsrc"] = p["f_wei"], p["f_src"]
        if (not strided and kh in (1, 3)) or (strided and kh == 3):
            p.update(w_ddst=p["d_ddst"], w_src=p["f_src"], w_dwei=p["f_wei"])
        else:
            p.update(w_ddst=0, w_src=0, w_dwei=es * co * cig * kh * kw)
    else:  # grouped with a channel multiplier: gemm in plain layouts (im2col scratch not modelled)
        p.update(
            f_src=0, f_wei=0, f_dst=es * n * co * oh * ow, f_scr=0, f_small=0,
            d_ddst=0, d_wei=0, d_dsrc=es * n * ci * h * w, d_nhwc=False, d_scr=0,
            w_ddst=0, w_src=0, w_dwei=es * co * cig * kh * kw,
        )
    return p


def _extra_over_outputs(seq: list[int], outputs: int) -> int:
    return max(0, running_peak(seq) - outputs)


def conv_forward_extra(inp, wt, stride, padding, dilation, groups) -> int:
    """Bytes live inside ``mkldnn_convolution`` beyond its output, at the op's own peak."""
    p = _conv_plan(inp, wt, stride, padding, dilation, groups)
    n, ci, co, cig, h, w, kh, kw, oh, ow = p["geom"]
    out = 4 * n * co * oh * ow
    seq = [x for x in (p["f_small"], p["f_src"], p["f_wei"]) if x] + [p["f_dst"]]
    if p["f_scr"]:
        seq += [p["f_scr"], -p["f_scr"]]
    seq += [-x for x in (p["f_wei"], p["f_src"], p["f_small"]) if x] + [out, -p["f_dst"]]
    return _extra_over_outputs(seq, out)


def conv_backward_extra(inp, wt, stride, padding, dilation, groups, mask) -> int:
    """Bytes live inside ``mkldnn_convolution_backward`` beyond its outputs."""
    p = _conv_plan(inp, wt, stride, padding, dilation, groups)
    n, ci, co, cig, h, w, kh, kw, oh, ow = p["geom"]
    gin, gw, gb = 4 * n * ci * h * w, 4 * co * cig * kh * kw, 4 * co
    seq, outs = [], 0
    if mask[0]:
        pre = [x for x in (p["d_ddst"], p["d_wei"]) if x]
        seq += pre + [p["d_dsrc"]]
        if p["d_scr"]:
            seq += [p["d_scr"], -p["d_scr"]]
        seq += [-x for x in reversed(pre)] + [gin]
        outs += gin
        if p["d_nhwc"]:
            seq += [gin, -gin]
        seq.append(-p["d_dsrc"])
    if mask[1] or mask[2]:
        pre = [x for x in (p["w_ddst"], p["w_src"]) if x]
        scr = p.get("w_scr", 0)
        seq += pre + [p["w_dwei"], scr] + ([gb] if mask[2] else []) + [-scr] + [-x for x in reversed(pre)]
        if mask[2]:
            seq.append(gb)
            outs += gb
        seq += [gw, -p["w_dwei"]] + ([-gb] if mask[2] else [])
        outs += gw
        if not mask[1]:  # grad_weight is always computed, then dropped
            seq.append(-gw)
            outs -= gw
    return _extra_over_outputs(seq, outs)


# --------------------------------------------------------------------------------------
# Channels-last (NHWC) convolutions. ``mkldnn_conv_use_channels_last`` (ATen/native/ConvUtils.h)
# is true when the input or the weight suggests channels-last; Conv.cpp then runs oneDNN on
# the NHWC tensors directly (no input or output reorder), after ``weight.contiguous(channels_last)``.
# The sizes below are the allocation sequences of real ops under the profiler (torch 2.13,
# oneDNN 3.12, AVX-512), e.g. Conv2d(16, 32, 2, stride=2) on a (4, 16, 16, 16) input:
#   forward  [W_cl 8192, out 32768, scratch 12336, W_blocked 8192, -W_blocked, -scratch, -W_cl]
#   backward [W_cl, grad_in 65536, W_blocked 8192, scratch 61488, -scratch, -W_blocked,
#             diff_W 8192, grad_b tmp 128, grad_b 128, grad_W 8192, copy 8192, -copy, -diff_W, -tmp, -W_cl]
# and depthwise Conv2d(16, 16, 7, padding=3, groups=16) on a (4, 16, 16, 16) input:
#   forward  [out 65536, W_blocked 3136, -W_blocked]
#   backward [grad_in 65536, W_blocked 3136, -W_blocked, reduction 802816, scratch 1152, grad_b tmp 64,
#             -scratch, grad_b 64, grad_W 3136, copy 3136, -copy, -reduction, -tmp]
# (the backward-weights scratchpad, 64*C + 128 B there, is freed before the gradients and never
# sets the peak, so it is left out).

NHWC_FWD_SCRATCH = 12336  # bytes: oneDNN's forward scratchpad, the same in every groups=1 NHWC probe
NHWC_BWD_DATA_SCRATCH = 12464  # bytes: backward-data scratchpad, stride 1
NHWC_BWD_DATA_SCRATCH_STRIDED = 61488  # bytes: backward-data scratchpad, strided (as ``d_scr`` above)
# The NHWC depthwise backward-weights kernel (jit_uni_dw) takes kernels up to 3x3 that fit in
# the input; every other depthwise shape falls back to an implementation whose reduction
# buffer is 256 fp32 copies of the weight gradient: 6,422,528 B for ConvNext's (128, 1, 7, 7).
DW_FALLBACK_REDUCTION = 256


def conv_channels_last(inp, wt) -> bool:
    """``mkldnn_conv_use_channels_last`` (aten/src/ATen/native/ConvUtils.h) for fp32 tensors."""
    from torch._prims_common import suggest_memory_format

    return torch.channels_last in (suggest_memory_format(inp), suggest_memory_format(wt))


def _nhwc_plan(inp, wt, stride, groups, weight_channels_last, es=4):
    """Buffer sizes of the NHWC oneDNN primitives (see the comment above), or None where not modelled."""
    blk = _block()
    n, ci, h, w = inp
    co, cig, kh, kw = wt
    if groups == 1:
        wb = es * round_up(co, blk) * (round_up(ci, blk) if ci >= blk else ci) * kh * kw
        return {
            "w_cl": 0 if weight_channels_last else es * co * cig * kh * kw,
            "f_scr": NHWC_FWD_SCRATCH, "f_wei": wb,
            "d_wei": es * round_up(co, blk) * round_up(ci, blk) * kh * kw,
            "d_scr": NHWC_BWD_DATA_SCRATCH_STRIDED if any(s > 1 for s in stride) else NHWC_BWD_DATA_SCRATCH,
            "w_dwei": wb,
        }
    if groups == ci == co:  # depthwise
        wb = es * round_up(ci, blk) * kh * kw
        jit = kh <= 3 and kw <= 3 and h >= kh and w >= kw
        return {
            "w_cl": 0, "f_scr": 0, "f_wei": wb, "d_wei": wb, "d_scr": 0,
            "w_dwei": wb if jit else DW_FALLBACK_REDUCTION * es * ci * kh * kw,
        }
    return None


def nhwc_conv_forward_extra(inp, wt, stride, groups, weight_channels_last, out_bytes) -> int:
    """Bytes live inside a channels-last ``mkldnn_convolution`` beyond its output."""
    p = _nhwc_plan(inp, wt, stride, groups, weight_channels_last)
    if p is None:
        return 0
    seq = [p["w_cl"], out_bytes, p["f_scr"], p["f_wei"], -p["f_wei"], -p["f_scr"], -p["w_cl"]]
    return _extra_over_outputs(seq, out_bytes)


def nhwc_conv_backward_extra(inp, wt, stride, groups, weight_channels_last, mask) -> int:
    """Bytes live inside a channels-last ``mkldnn_convolution_backward`` beyond its outputs."""
    p = _nhwc_plan(inp, wt, stride, groups, weight_channels_last)
    if p is None:
        return 0
    n, ci, h, w = inp
    co, cig, kh, kw = wt
    gin, gw, gb = 4 * n * ci * h * w, 4 * co * cig * kh * kw, 4 * co
    seq, outs = [p["w_cl"]], 0
    if mask[0]:
        seq += [gin, p["d_wei"], p["d_scr"], -p["d_scr"], -p["d_wei"]]
        outs += gin
    if mask[1] or mask[2]:
        seq.append(p["w_dwei"])
        if mask[2]:  # a temporary, then the gradient itself
            seq += [gb, gb]
            outs += gb
        seq += [gw, gw, -gw, -p["w_dwei"]] + ([-gb] if mask[2] else [])
        outs += gw
        if not mask[1]:
            seq.append(-gw)
            outs -= gw
    seq.append(-p["w_cl"])
    return _extra_over_outputs(seq, outs)


def _weight_channels_last(wt) -> bool:
    """Whether ``weight.contiguous(channels_last)`` in Conv.cpp is free (1x1 and depthwise weights are)."""
    return wt.is_contiguous(memory_format=torch.channels_last)


def _onednn_conv(ctx, inp, wt, stride, dilation, transposed, groups) -> str | None:
    """The layout (``"nchw"`` or ``"nhwc"``) of a convolution whose CPU run takes the oneDNN path
    these rules describe, else None: CPU target, a 4-d fp32 input, not transposed, ``use_mkldnn``."""
    if ctx.device is Device.CPU and inp.dtype in (torch.bfloat16, torch.float16):
        ctx.assume("CPU target: oneDNN's low-precision convolution buffers are not modelled (fp32 only)")
    if not (
        ctx.device is Device.CPU and inp.dim() == 4 and not transposed and inp.dtype == torch.float32
        and conv_uses_mkldnn(inp.shape, wt.shape, tuple(stride), tuple(dilation), groups, inp.dtype)
    ):
        return None
    if conv_channels_last(inp, wt):
        if groups > 1 and not groups == inp.shape[1] == wt.shape[0]:
            ctx.assume("CPU target: a channels-last grouped convolution's oneDNN buffers are not modelled")
            return None
        return "nhwc"
    return "nchw" if inp.is_contiguous() else None


def _per_dim(values, inp) -> list[int]:
    """One value a spatial dimension: ATen's convolution takes a one-element list for all of them
    (``expand_param_if_needed`` in aten/src/ATen/native/Convolution.cpp), as ``padding="valid"``
    gives (SigLIP's patch embedding)."""
    values = list(values)
    return values * (inp.dim() - 2) if len(values) == 1 else values


def _as_2d(inp, wt, stride, padding, dilation):
    """A 1-d convolution as ATen runs it on CPU, a 2-d one of height 1 on a contiguous input
    (``_convolution`` and ``convolution_backward`` in Convolution.cpp: ``input.contiguous()``
    "avoid accidentally going through NHWC for permuted 3d input", ``params.view1d_as_2d()``,
    ``view4d``), and the bytes of that copy (0 for a contiguous input); others as given."""
    if inp.dim() != 3:
        return inp, wt, stride, padding, dilation, 0
    copy = 0 if inp.is_contiguous() else nbytes(inp)
    n, c, w = inp.shape
    inp = torch.empty(n, c, 1, w, dtype=inp.dtype, device="meta")
    return inp, wt.unsqueeze(2), [1, *stride], [0, *padding], [1, *dilation], copy


def _conv_setup(ctx, inp, wt, stride, padding, dilation, transposed, groups):
    """What both convolution rules start from: the oneDNN layout taken (``_onednn_conv``), the
    (input, weight, stride) shapes as 2-d, padding and dilation per spatial dimension, the bytes of a
    1-d input's contiguous copy (``_as_2d``), and the weight as 2-d."""
    stride, padding, dilation = (_per_dim(v, inp) for v in (stride, padding, dilation))
    inp, wt, stride, padding, dilation, copy = _as_2d(inp, wt, stride, padding, dilation)
    layout = _onednn_conv(ctx, inp, wt, stride, dilation, transposed, groups)
    return layout, (tuple(inp.shape), tuple(wt.shape), tuple(stride)), tuple(padding), tuple(dilation), copy, wt


@register_op_rule(aten.convolution.default)
def convolution(ctx, func, args, kwargs):
    out = func(*args, **kwargs)
    inp, wt, _, stride, padding, dilation, transposed, _, groups = args
    layout, shapes, padding, dilation, copy, wt = _conv_setup(ctx, inp, wt, stride, padding, dilation, transposed,
                                                              groups)
    if layout == "nchw":
        ctx.track(out)
        ctx.scratch(copy, conv_forward_extra(*shapes, padding, dilation, groups))
    elif layout == "nhwc":
        # The CPU kernel's output is channels-last (Conv.cpp allocates it in the input's suggested
        # format); the meta kernel's is contiguous, which would send the next layers down the NCHW path.
        out = torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=torch.channels_last)
        ctx.track(out)
        ctx.scratch(nhwc_conv_forward_extra(*shapes, groups, _weight_channels_last(wt), nbytes(out)))
    elif ctx.device is Device.CUDA and inp.device.type == "meta":
        cudnn_convolution_scratch(ctx, out, inp, wt, nbytes(out))
    return out


@register_op_rule(aten.convolution_backward.default)
def convolution_backward(ctx, func, args, kwargs):
    out = func(*args, **kwargs)
    grad, inp, wt, _, stride, padding, dilation, transposed, _, groups, mask = args
    layout, shapes, padding, dilation, copy, wt = _conv_setup(ctx, inp, wt, stride, padding, dilation, transposed,
                                                              groups)
    if layout == "nchw":
        ctx.track(out)
        # mkldnn_convolution_backward: grad_output.contiguous(memory_format), a copy when it is not
        copy += 0 if grad.is_contiguous() else nbytes(grad)
        ctx.scratch(copy, conv_backward_extra(*shapes, padding, dilation, groups, mask))
    elif layout == "nhwc":
        ctx.track(out)
        ctx.scratch(nhwc_conv_backward_extra(*shapes, groups, _weight_channels_last(wt), mask))
    elif ctx.device is Device.CUDA and inp.device.type == "meta":
        cudnn_convolution_scratch(ctx, out, inp, wt, nbytes(grad))
    return out


@register_op_rule(aten.native_batch_norm.default)
def batch_norm(ctx, func, args, kwargs):
    """Training batch norm on CPU keeps two C-sized temporaries beyond its outputs."""
    out = func(*args, **kwargs)
    if ctx.device is Device.CPU and args[0].dim() >= 2:
        ctx.track(out)
        ctx.scratch(2 * args[0].shape[1] * args[0].element_size())
    return out


@register_op_rule(aten.native_batch_norm_backward.default)
def batch_norm_backward(ctx, func, args, kwargs):
    """CPU batch norm backward allocates one input-sized temporary after its outputs."""
    out = func(*args, **kwargs)
    if ctx.device is Device.CPU:
        ctx.track(out)
        ctx.scratch(nbytes(args[1]))
    return out


@register_op_rule(aten.native_layer_norm.default)
def layer_norm(ctx, func, args, kwargs):
    """CPU layer norm of a non-contiguous input (a transposed conv output: Wav2Vec2's layer-norm
    feature encoder) normalises a contiguous copy, freed on return, into a contiguous output
    (``layer_norm_cpu``, aten/src/ATen/native/layer_norm.cpp: ``X = input.expect_contiguous()``,
    ``Y = empty_like(*X)``); the meta kernel's output keeps the input's strides instead."""
    out = func(*args, **kwargs)
    inp = args[0]
    if ctx.device is Device.CPU and not inp.is_contiguous():
        out = (torch.empty(inp.shape, dtype=out[0].dtype, device=out[0].device), *out[1:])
        ctx.track(out)
        ctx.scratch(nbytes(inp))
    return out


@register_op_rule(aten.native_layer_norm_backward.default)
def layer_norm_backward(ctx, func, args, kwargs):
    """CPU layer norm backward copies a non-contiguous input and gradient after its outputs, and
    its input gradient is contiguous (``layer_norm_backward_cpu``: ``input.expect_contiguous()``,
    ``dY.contiguous()``, ``dX = empty_like(*X)``)."""
    out = func(*args, **kwargs)
    grad_out, inp = args[0], args[1]
    if ctx.device is Device.CPU:
        copies = [nbytes(t) for t in (inp, grad_out) if not t.is_contiguous()]
        if copies:
            if out[0] is not None and not out[0].is_contiguous():
                out = (torch.empty(out[0].shape, dtype=out[0].dtype, device=out[0].device), *out[1:])
            ctx.track(out)
            ctx.scratch(*copies)
    return out


# --------------------------------------------------------------------------------------
# LSTM: at::lstm takes the oneDNN path on CPU (RNN.cpp use_mkldnn); on meta it decomposes
# into per-step cell ops that save different tensors. The rule below runs the oneDNN
# path's own aten ops (mkldnn_rnn_layer has a meta kernel), and the layer rules give the
# workspace and scratch sizes, probed from one real CPU layer per shape.

_LSTM_MODE = 2  # ideep::rnn_kind::LSTM
_PROBE_LIMIT = 64 * 2**20  # bytes of real CPU memory one probe may use


def _probe_layer(t, n, i, h) -> dict:
    """Run one real oneDNN LSTM layer forward and backward on CPU; read its buffers from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        x = torch.zeros(t, n, i, requires_grad=True)
        w0 = torch.zeros(4 * h, i, requires_grad=True)
        w1 = torch.zeros(4 * h, h, requires_grad=True)
        b0 = torch.zeros(4 * h, requires_grad=True)
        b1 = torch.zeros(4 * h, requires_grad=True)
        h0, c0 = torch.zeros(n, h), torch.zeros(n, h)

        def run():
            out = aten.mkldnn_rnn_layer(x, w0, w1, b0, b1, h0, c0, False, [], _LSTM_MODE, h, 1, True, False, False, True)
            out[0].backward(torch.ones(t, n, h))
            return nbytes(out[3])

        run()  # warm-up: oneDNN caches its primitives
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            ws = run()
    raw = prof.profiler.kineto_results.events()
    mem = cpu_memory_events(raw)
    res = {"ws": ws}
    for key, name in (("fwd", "aten::mkldnn_rnn_layer"), ("bwd", "aten::mkldnn_rnn_layer_backward")):
        ev = next(e for e in raw if e.name() == name)
        res[key] = running_peak(nb for ts, nb in mem if ev.start_ns() <= ts <= ev.end_ns())
    return res


@functools.lru_cache(maxsize=None)
def lstm_layer_sizes(t, n, i, h) -> tuple[int, int, int, bool]:
    """(workspace bytes, forward peak over start, backward peak over start, extrapolated?).

    Shapes whose probe would take more than 64 MiB are probed at two shorter
    lengths and extrapolated linearly in the sequence length, so the cost of a
    trace does not grow with it.
    """
    per_step = 4 * n * (i + 24 * h)  # input, output, gates and workspace per time step, roughly
    if t * per_step <= _PROBE_LIMIT or t <= 4:
        r = _probe_layer(t, n, i, h)
        return r["ws"], r["fwd"], r["bwd"], False
    t1 = max(2, min(t // 2, _PROBE_LIMIT // (2 * per_step)))
    a, b = _probe_layer(t1, n, i, h), _probe_layer(2 * t1, n, i, h)

    def line(key):
        return int(a[key] + (b[key] - a[key]) * (t - t1) / t1)

    return line("ws"), line("fwd"), line("bwd"), True


def _lstm_uses_mkldnn(inp, hx) -> bool:
    if not (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()):
        return False
    return inp.dtype == torch.float32 and inp.numel() != 0 and hx[0].size(2) == hx[1].size(2)


@register_op_rule(torch._C._VariableFunctions.lstm)
def lstm(ctx, func, args, kwargs):
    """``at::native::mkldnn_rnn`` (aten/src/ATen/native/mkldnn/RNN.cpp) from aten ops with meta kernels."""
    if ctx.device is not Device.CPU or kwargs or len(args) != 9 or not isinstance(args[1], (list, tuple)):
        return func(*args, **kwargs)  # packed sequences and other targets: as traced
    inp, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if inp.device.type != "meta" or not _lstm_uses_mkldnn(inp, hx):
        return func(*args, **kwargs)
    if ctx.autocast is not None and ctx.autocast.active:
        ctx.assume("CPU target: an LSTM under autocast is traced in fp32 (oneDNN's bf16 layers are not modelled)")
    h0, c0 = hx
    hidden = h0.size(2)
    x = (inp.transpose(0, 1) if batch_first else inp).contiguous()
    stride = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    t, n = x.shape[0], x.shape[1]
    for layer in range(num_layers):  # probe now: above autograd, where a backward can run
        lstm_layer_sizes(t, n, x.shape[2] if layer == 0 else hidden * directions, hidden)
    hys, cys = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(directions):
            idx = layer * directions + d
            w = params[idx * stride:(idx + 1) * stride]
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape[0], dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape[0], dtype=w[1].dtype, device=w[1].device)
            o = aten.mkldnn_rnn_layer(x, w[0], w[1], b_ih, b_hh, h0[idx], c0[idx], d > 0, [], _LSTM_MODE,
                                      hidden, num_layers, has_biases, bidirectional, batch_first, train)
            outs.append(o[0])
            hys.append(o[1])
            cys.append(o[2])
        x = outs[0] if directions == 1 else torch.cat(outs, -1)
        if dropout and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    out = x.transpose(0, 1) if batch_first else x
    return out, torch.stack(hys, 0), torch.stack(cys, 0)


def _layer_dims(ctx, args, hidden_arg: int) -> tuple[int, int, int, int] | None:
    """(seq_len, batch, input_size, hidden) of a traced oneDNN LSTM layer op, or None off target."""
    if ctx.device is not Device.CPU or args[0].device.type != "meta":
        return None
    t, n, i = args[0].shape
    return t, n, i, args[hidden_arg]


@register_op_rule(aten.mkldnn_rnn_layer.default)
def mkldnn_rnn_layer(ctx, func, args, kwargs):
    """The meta kernel returns an empty workspace; the CPU's is kept for backward."""
    out = func(*args, **kwargs)
    dims = _layer_dims(ctx, args, hidden_arg=10)
    if dims is None:
        return out
    t, n, i, h = dims
    ws, fwd_peak, _, extrapolated = lstm_layer_sizes(t, n, i, h)
    if extrapolated:
        ctx.assume("oneDNN LSTM buffers were probed at shorter sequences and extrapolated linearly in length")
    out = (*out[:3], torch.empty(ws, dtype=torch.uint8, device="meta"))
    ctx.track(out)
    outputs = 4 * (t * n * h + 2 * n * h) + ws
    ctx.scratch(fwd_peak - outputs)
    return out


@register_op_rule(aten.mkldnn_rnn_layer_backward.default)
def mkldnn_rnn_layer_backward(ctx, func, args, kwargs):
    out = func(*args, **kwargs)
    dims = _layer_dims(ctx, args, hidden_arg=15)
    if dims is None:
        return out
    t, n, i, h = dims
    _, _, bwd_peak, _ = lstm_layer_sizes(t, n, i, h)
    grad_out, grad_hy, grad_cy = args[10], args[11], args[12]
    extra = 0
    if grad_out is not None and not grad_out.is_contiguous():
        extra += 4 * t * n * h  # grad_output.contiguous()
    extra -= 4 * n * h * ((grad_hy is not None) + (grad_cy is not None))  # the probe zero-filled both
    outputs = 4 * (t * n * i + 4 * h * i + 4 * h * h + 4 * h + 2 * n * h)
    ctx.track(out)
    ctx.scratch(bwd_peak + extra - outputs)
    return out
