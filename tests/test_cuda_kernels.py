"""CUDA kernel rules other than attention, with their bytes worked out by hand."""

import torch
import torch.nn.functional as F

from memcheck.enums import Device
from memcheck.trace.tracer import ALLOC, MemoryTracer

MiB = 2**20


def _allocs(tracer):
    return [e[2] for e in tracer.log.events if e[0] == ALLOC]


def test_cudnn_convolution_gets_its_workspace_allowance_and_says_so(monkeypatch):
    # Conv2d(16 -> 32, 3x3) weight: 32*16*3*3*4 B = 18,432 B. With cudnn.benchmark off the
    # allowance is 2 x weight + 1 MiB = 36,864 + 1,048,576 = 1,085,440 B, once per call.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    x = torch.empty(4, 16, 32, 32, device="meta")
    w = torch.empty(32, 16, 3, 3, device="meta")
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        F.conv2d(x, w)
    assert _allocs(tracer).count(1_085_440) == 1
    assert any("cuDNN workspace" in a for a in tracer.log.assumptions)


def test_cudnn_benchmark_mode_takes_the_larger_allowance_and_warns(monkeypatch):
    # benchmark on: input + weight + output = 4*16*32*32*4 + 18,432 + 4*32*30*30*4
    #             = 262,144 + 18,432 + 460,800 = 741,376 B.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    x = torch.empty(4, 16, 32, 32, device="meta")
    w = torch.empty(32, 16, 3, 3, device="meta")
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        F.conv2d(x, w)
    assert _allocs(tracer).count(741_376) == 1
    assert any("benchmark=True" in a for a in tracer.log.assumptions)


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
