"""Rules for CPU kernels that allocate inside the op what their meta kernels do not.

Convolutions (oneDNN's blocked reorders and scratchpads, the slow path's im2col columns, a
1-d convolution's contiguous copy) and the oneDNN LSTM's workspace are *probed*: the rule runs
the real op once per distinct shape on this process's CPU and reads the allocator's events
inside it (``memcheck.rules.probe``), because the implementation oneDNN runs depends on the
instruction set, the shape and the thread count (see "Convolutions on the CPU target" below).
The CPU batch norm's temporaries and the CPU layer norm's contiguous copies are written from
ATen's source, which is the same on every instruction set. Each rule emits its buffers right
after the op's outputs (``ctx.scratch``), so that the peak inside the op is what the CPU
allocator sees.

Checked on: an AVX2 host (AMD EPYC, torch 2.13.0+cpu, oneDNN 3.12), natively, against real
training steps under the profiler (tests/test_cpu_kernels.py, tests/test_conv_models.py, the
coverage census) and over the grid of ``benchmarks/cpu_rules.py``. The probe measures whatever
the running process runs, so the same code holds on AVX-512 and AArch64; those were not run here.
"""

from __future__ import annotations

import functools
import math

import torch

from memcheck import compat
from memcheck.rules import cuda_conv
from memcheck.enums import Device
from memcheck.rules.probe import cpu_memory_events, profile_memory, running_peak
from memcheck.rules.registry import register_op_rule
from memcheck.units import nbytes, round_up

aten = torch.ops.aten


# --------------------------------------------------------------------------------------
# Convolutions on the CPU target: probed, not transcribed.
#
# Which implementation a CPU convolution runs is chosen at run time: ATen picks the backend
# (``ConvParams::use_mkldnn`` and ``select_conv_backend``, aten/src/ATen/native/Convolution.cpp,
# ConvUtils.h), and oneDNN then picks among its implementations by instruction set, shape and
# thread count (``cpu/cpu_convolution_list.cpp``: brgconv and jit_avx512_core kernels on AVX-512,
# jit_avx2 ones with 8-channel blocks on AVX2, gemm fallbacks elsewhere, ACL on AArch64). Each one
# reorders into its own blocked layouts and sizes its own scratchpad. A transcription of those
# buffers for one machine (the first version of this module was fitted on AVX-512) is a guess on
# every other: on an AVX2 host it read ConvNeXt +122% and one convolution 20x its real run.
#
# So the rule asks the running library. For each distinct convolution (shapes, strides, layout,
# dtype, output mask, thread count and the CPU capability the process reports) it runs the real
# op once on zero-filled CPU tensors of the same shape and strides, reads the CPU allocator's
# events inside the op from the profiler, and keeps (bytes live inside the op beyond its outputs,
# the outputs' strides). The trace then emits those bytes as scratch right after the op's outputs
# and gives the outputs the CPU's layout (a channels-last input gives a channels-last output
# there; the meta kernel's is contiguous), so the next op takes the same path as on the CPU.
# A probe whose tensors would take more than ``CONV_PROBE_LIMIT`` runs at two smaller batches and
# is extrapolated linearly in the batch (reorder buffers and outputs scale with it; weights and
# scratchpads do not), which the report lists as an assumption.

CONV_PROBE_LIMIT = 64 * 2**20  # bytes of real CPU memory one convolution probe may use
_CONV_OP = "aten::convolution"
_CONV_BWD_OP = "aten::convolution_backward"


def conv_uses_mkldnn(input_shape, weight_shape, stride, dilation, groups, dtype) -> bool:
    """``ConvParams::use_mkldnn`` (aten/src/ATen/native/ConvUtils.h) for a CPU NCHW input."""
    if not (torch.backends.mkldnn.is_available() and compat.mkldnn_enabled()):
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


def _spec(t) -> tuple | None:
    """What a probe needs of a tensor argument: (shape, strides, dtype), or None."""
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)


def _real(spec, batch: int | None = None):
    """A zero-filled CPU tensor of ``spec``, its batch dimension (the first) ``batch`` long if given.
    A batch-outermost layout keeps its strides at any batch; any other is laid out densely in the
    same order of dimensions."""
    shape, stride, dtype = spec
    if batch is not None and batch != shape[0]:
        shape = (batch, *shape[1:])
        order = sorted(range(len(shape)), key=lambda d: (stride[d], shape[d]), reverse=True)
        if order[0] != 0:
            new, size = [0] * len(shape), 1
            for d in reversed(order):
                new[d], size = size, size * shape[d]
            stride = tuple(new)
    t = torch.empty_strided(shape, stride, dtype=dtype)
    return t.zero_() if t.numel() else t


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _storage_bytes(t) -> int:
    return t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0


def _window_peak(prof, op_name: str) -> int:
    """The running peak of the CPU allocator's events inside the (only) call of ``op_name``."""
    raw = prof.kineto_results.events()
    ev = min((e for e in raw if e.name() == op_name), key=lambda e: e.start_ns())
    mem = cpu_memory_events(raw)
    return running_peak(nb for ts, nb in mem if ev.start_ns() <= ts <= ev.end_ns())


def _probe_once(backward: bool, specs: tuple, params: tuple, batch: int | None) -> tuple[int, tuple]:
    """Run one real convolution (or its backward) on CPU; (bytes beyond its outputs, their strides)."""
    with compat.disable_current_modes(), compat.DisableTorchFunction(), torch.no_grad():
        tensors = [None if s is None else _real(s, batch if _batched(backward, i) else None)
                   for i, s in enumerate(specs)]
        if backward:
            op, name = (lambda: aten.convolution_backward(*tensors[:3], *params)), _CONV_BWD_OP
        else:
            op, name = (lambda: aten.convolution(*tensors, *params)), _CONV_OP
        op()  # warm-up: oneDNN creates and caches its primitives on the first call
        with profile_memory() as prof:
            out = op()
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))]
        peak = _window_peak(prof, name)
        strides = tuple(None if o is None else tuple(o.stride()) for o in outs)
        return max(0, peak - sum(_storage_bytes(o) for o in outs)), strides


def _batched(backward: bool, i: int) -> bool:
    """Whether a probe's ``i``-th tensor has the batch first: the input (and, in backward, the
    output gradient before it); never the weight or the bias."""
    return i == 0 or (backward and i == 1)


def _probe_bytes(specs, batch, backward: bool) -> int:
    """Roughly what a probe's tensors take: its inputs and outputs twice over."""
    total = 0
    for i, s in enumerate(specs):
        if s is not None:
            shape = (batch, *s[0][1:]) if _batched(backward, i) else s[0]
            total += math.prod(shape) * s[2].itemsize
    return 3 * total


@functools.lru_cache(maxsize=None)
def conv_probe(backward: bool, specs: tuple, params: tuple, threads: int, capability: str):
    """(bytes live inside the op beyond its outputs, the outputs' strides, extrapolated?) of a real
    CPU convolution (``backward=False``: ``aten.convolution(input, weight, bias, *params)``) or its
    backward (``aten.convolution_backward(grad_output, input, weight, *params)``). ``threads`` and
    ``capability`` are part of the key: the implementation oneDNN picks depends on both."""
    n = specs[0][0][0]
    if n <= 2 or _probe_bytes(specs, n, backward) <= CONV_PROBE_LIMIT:
        extra, strides = _probe_once(backward, specs, params, None)
        return extra, strides, False
    # the two largest batches that fit: past oneDNN's small-batch implementations (below)
    n1 = max(1, min(n // 2, int(n * CONV_PROBE_LIMIT / _probe_bytes(specs, n, backward)) // 2))
    (a, strides), (b, _) = _probe_once(backward, specs, params, n1), _probe_once(backward, specs, params, 2 * n1)
    # The larger of the line through both probes and the larger probe scaled with the batch: at small
    # batches some implementations keep a per-thread buffer that does not grow with it (SSE4.1's
    # backward of Conv2d(32, 64, 3, stride=2) on 32x32 images: 1,179,904 B at batches 2, 4 and 8,
    # then 2,023,168 B at 16 and 4,120,320 B at 32), which flattens the line; the reorders that
    # grow with the batch dominate past it (scaling 16 to 32 reads 4,046,336 B, -1.8%).
    return max(0, int(a + (b - a) * (n - n1) / n1), int(b * n / (2 * n1))), strides, True


def _probed(ctx, backward, args, out, specs, params):
    """Emit a probed convolution's scratch after its outputs, in the CPU's layouts; return them."""
    extra, strides, extrapolated = conv_probe(backward, specs, params, torch.get_num_threads(),
                                              torch.backends.cpu.get_cpu_capability())
    if extrapolated:
        ctx.assume("CPU target: large convolutions' oneDNN buffers were probed at smaller batches and "
                   "extrapolated linearly in the batch")
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for i, (o, s) in enumerate(zip(outs, strides)):
        if o is not None and s is not None and tuple(o.stride()) != s and o.dim() == len(s):
            outs[i] = torch.empty_strided(o.shape, s, dtype=o.dtype, device=o.device)
    out = type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]
    ctx.track(out)
    ctx.scratch(extra)
    return out


def _cpu_probe_applies(ctx, inp) -> bool:
    return ctx.device is Device.CPU and inp.device.type == "meta" and inp.numel() > 0


@register_op_rule(aten.convolution.default)
def convolution(ctx, func, args, kwargs):
    out = func(*args, **kwargs)
    inp, wt, bias = args[:3]
    if _cpu_probe_applies(ctx, inp):
        return _probed(ctx, False, args, out, (_spec(inp), _spec(wt), _spec(bias)),
                       tuple(map(_hashable, args[3:])))
    if ctx.device is Device.CUDA and inp.device.type == "meta" and not cuda_conv.is_depthwise(inp, wt, args[8]):
        # cuDNN's workspace (memcheck.rules.cuda_conv); a transposed convolution's forward is
        # cuDNN's backward-data call
        ctx.track(out)
        kind = cuda_conv.BACKWARD_DATA if args[6] else cuda_conv.FORWARD
        cuda_conv.cudnn_convolution_scratch(ctx, [(kind, inp, wt, out)])
    return out


@register_op_rule(aten.convolution_backward.default)
def convolution_backward(ctx, func, args, kwargs):
    out = func(*args, **kwargs)
    grad, inp, wt = args[:3]
    if _cpu_probe_applies(ctx, inp):
        return _probed(ctx, True, args, out, (_spec(grad), _spec(inp), _spec(wt)),
                       tuple(map(_hashable, args[3:])))
    if ctx.device is Device.CUDA and inp.device.type == "meta" and not cuda_conv.is_depthwise(inp, wt, args[9]):
        # cudnn_convolution_backward (ConvShared.cpp): grad_input's call, then grad_weight's
        ctx.track(out)
        data, filt = ((cuda_conv.FORWARD, cuda_conv.BACKWARD_FILTER) if args[7]
                      else (cuda_conv.BACKWARD_DATA, cuda_conv.BACKWARD_FILTER))
        calls = []
        if out[0] is not None:
            calls.append((data, inp, wt, grad))
        if out[1] is not None:
            calls.append((filt, inp, wt, grad))
        cuda_conv.cudnn_convolution_scratch(ctx, calls)
    return out


# Batch norm on CPU (aten/src/ATen/native/Normalization.cpp ``batch_norm_cpu`` and
# ``batch_norm_backward_cpu_template``; kernels in native/cpu/batch_norm_kernel.cpp). Profiled
# allocation sequences of the training ops, fp32, 2 threads (the same on the AVX2 and SSE4.1 caps):
#   forward, (4, 16, 8, 8) contiguous:      [out, mean 64, invstd 64, tmp 64, tmp 64, -tmp, -tmp, ...]
#   forward, (2, 64, 16, 16) channels-last: [out, mean, invstd, tmp 256, tmp 256, buffer 512, -buffer, -tmp, -tmp, ...]
#   backward, grad_input wanted:            [grad_in, grad_w, grad_b, input-sized tmp, -tmp]
#   backward, no grad_input:                [grad_w, grad_b]  (+ [buffer 1024, -buffer] channels-last)
# The channels-last stats kernels keep a (threads, C) buffer of floats in forward
# (``batch_norm_cpu_collect_stats_channels_last_impl``) and two of them in backward
# (``batch_norm_cpu_backward_channels_last_impl``): 2 threads * 64 * 4 B = 512 B and 1,024 B above.


def _channels_last_4d(t) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


@register_op_rule(aten.native_batch_norm.default)
def batch_norm(ctx, func, args, kwargs):
    """Training batch norm on CPU keeps two C-sized temporaries beyond its outputs (and, on a
    channels-last input, a per-thread float buffer after them)."""
    out = func(*args, **kwargs)
    inp = args[0]
    if ctx.device is Device.CPU and inp.dim() >= 2:
        c = inp.shape[1]
        ctx.track(out)
        per_thread = torch.get_num_threads() * c * 4 if _channels_last_4d(inp) else 0
        ctx.scratch(2 * c * inp.element_size(), per_thread)
    return out


@register_op_rule(aten.native_batch_norm_backward.default)
def batch_norm_backward(ctx, func, args, kwargs):
    """CPU batch norm backward allocates one input-sized temporary after its outputs when it
    computes the input's gradient (``output_mask[0]``); without it, only the channels-last
    kernel's per-thread buffers."""
    out = func(*args, **kwargs)
    inp, mask = args[1], args[9]
    if ctx.device is Device.CPU:
        ctx.track(out)
        per_thread = 2 * torch.get_num_threads() * inp.shape[1] * 4 if _channels_last_4d(inp) else 0
        ctx.scratch(max(nbytes(inp) if mask[0] else 0, per_thread))
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
    with compat.disable_current_modes(), compat.DisableTorchFunction():
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
        with profile_memory() as prof:
            ws = run()
    raw = prof.kineto_results.events()
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
    if not (torch.backends.mkldnn.is_available() and compat.mkldnn_enabled()):
        return False
    return inp.dtype == torch.float32 and inp.numel() != 0 and hx[0].size(2) == hx[1].size(2)


@register_op_rule(compat.VariableFunctions.lstm)
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
