"""CUDA kernel rules other than attention, with their bytes worked out by hand."""

import torch
import torch.nn.functional as F

from memcheck.enums import Device
from memcheck.trace.tracer import ALLOC, MemoryTracer

MiB = 2**20


def _allocs(tracer):
    return [e[2] for e in tracer.log.events if e[0] == ALLOC]


def test_fp16_softmax_to_float_on_cuda_reads_fp16_without_a_float_copy():
    # Scores (2, 4, 128, 128) fp16 = 262,144 B. softmax(dtype=float32) on CUDA writes the
    # 524,288 B float32 result directly (half_to_float); on CPU the input is first converted,
    # a second 524,288 B tensor.
    def run(device):
        s = torch.empty(2, 4, 128, 128, dtype=torch.float16, device="meta")
        tracer = MemoryTracer(device)
        with tracer:
            out = F.softmax(s, dim=-1, dtype=torch.float32)
        assert out.dtype == torch.float32
        return _allocs(tracer).count(524_288)

    assert run(Device.CUDA) == 1
    assert run(Device.CPU) == 2
