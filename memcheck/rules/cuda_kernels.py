"""Rules for kernels whose memory on CUDA differs from what their meta kernels show.

Attention has its own module (``memcheck.rules.cuda_attention``) and cuDNN convolutions theirs
(``memcheck.rules.cuda_conv``); these are the rest.
Each rule is active only when the tracer's target is CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memcheck.enums import Device
from memcheck.rules.registry import bind, register_op_rule

aten = torch.ops.aten


_F_SOFTMAX = ("input", "dim", "_stacklevel", "dtype")  # F.softmax / F.log_softmax
_SOFTMAX = ("input", "dim", "dtype")  # torch.softmax, Tensor.softmax (self first) and the log_ ones


def _softmax_rule(log: bool):
    """aten/src/ATen/native/SoftMax.cpp ``softmax``/``log_softmax``: on CUDA a Half input
    with ``dtype=float32`` runs the ``half_to_float`` kernel, reading fp16 and writing
    fp32 with no float32 copy of the input; elsewhere (bf16, CPU) the input is converted
    first. HF's eager attention and autocast's fp32_set_opt_dtype both take this path."""
    kernel = aten._log_softmax.default if log else aten._softmax.default

    def rule(ctx, func, args, kwargs):
        b = bind(func, args, kwargs, names=_F_SOFTMAX if func in (F.softmax, F.log_softmax) else _SOFTMAX)
        x, dim, dtype = b["input"], b["dim"], b["dtype"]
        if (
            ctx.device is Device.CUDA and isinstance(x, torch.Tensor) and x.device.type == "meta"
            and x.dtype == torch.float16 and dtype == torch.float32 and dim is not None
        ):
            return kernel(x, dim, True)
        return func(*args, **kwargs)

    return rule


for _fn in (F.softmax, torch.softmax, torch.Tensor.softmax):
    register_op_rule(_fn, _softmax_rule(log=False))
for _fn in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax):
    register_op_rule(_fn, _softmax_rule(log=True))
