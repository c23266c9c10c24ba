"""RMSNorm on the CUDA target takes ATen's fused kernel (memcheck.rules.cuda_norms), with the bytes
worked out by hand from aten/src/ATen/native/cuda/layer_norm_kernel.cu (``_fused_rms_norm_cuda``,
``_fused_rms_norm_backward_cuda``) and derivatives.yaml:1284-1285; the CPU target keeps the
composite (layer_norm.cpp ``rms_norm_composite``)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from memcheck.enums import ALLOC, FREE, RECAT, Category, Device
from memcheck.rules import cuda_norms, registry
from memcheck.rules.autocast import MetaAutocast
from memcheck.trace.tracer import MemoryTracer

# x (32, 64): M = 32 rows of N = 64; 2,048 elements.
M, N = 32, 64
ELEMS = M * N
RSTD = M * 4  # rstd: one fp32 per row = 32 x 4 B = 128 B (acc type of fp32, bf16 and fp16 on CUDA)


def _trace(device, dtype=torch.float32, weight_dtype=None, affine=True, x=None, autocast=None):
    """The tracer after ``nn.RMSNorm(64)(x).sum().backward()``, and the event index where backward starts."""
    norm = torch.nn.RMSNorm(N, eps=1e-6, elementwise_affine=affine, device="meta", dtype=weight_dtype or dtype)
    x = torch.empty(M, N, device="meta", dtype=dtype, requires_grad=True) if x is None else x
    tracer = MemoryTracer(device)
    tracer.autocast = autocast
    with tracer, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rms_norm's "Mismatch dtype" warning (layer_norm.cpp:346)
        tracer.watch(norm)
        if autocast is not None:
            with autocast.region():
                y = norm(x)
        else:
            y = norm(x)
        backward_at = len(tracer.log.events)
        (y.sum() if y.dtype == torch.float32 else y.float().sum()).backward()
    return tracer, backward_at


def _allocs(events):
    return [e[2] for e in events if e[0] == ALLOC]


@pytest.mark.parametrize("dtype,itemsize", [(torch.float32, 4), (torch.bfloat16, 2)], ids=["fp32", "bf16"])
def test_rms_norm_on_cuda_allocates_the_fused_kernels_output_and_an_fp32_rstd(dtype, itemsize):
    tracer, backward_at = _trace(Device.CUDA, dtype)
    forward = tracer.log.events[:backward_at]
    # the weight (64 x itemsize B), registered by watch; the input x (2,048 x itemsize B: 8,192 fp32,
    # 4,096 bf16), first seen inside the module; then _fused_rms_norm_cuda's Y = empty_like(X) (same
    # bytes) and rstd (M) fp32 = 128 B
    assert _allocs(forward) == [N * itemsize, ELEMS * itemsize, ELEMS * itemsize, RSTD]
    # derivatives.yaml:1284-1285 keeps input, weight and rstd: x and rstd become activations, nothing else
    ids = {e[1]: e[2] for e in forward if e[0] == ALLOC}
    saved = sorted(ids[e[1]] for e in forward if e[0] == RECAT and e[3] is Category.ACTIVATION)
    assert saved == sorted([ELEMS * itemsize, RSTD])


@pytest.mark.parametrize("call", [lambda x, w: F.rms_norm(x, [N], w, 1e-6), lambda x, w: torch.rms_norm(x, (N,), w)],
                         ids=["F.rms_norm", "torch.rms_norm"])
def test_functional_rms_norm_takes_the_same_kernel(call):
    x = torch.empty(M, N, device="meta", requires_grad=True)
    w = torch.empty(N, device="meta", requires_grad=True)
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        y = call(x, w)  # noqa: F841
    # Y (8,192 B) and rstd (128 B); x (8,192 B) and w (64 x 4 = 256 B), first seen when autograd
    # saves them, are activations, and rstd becomes one.
    assert [(e[0], e[2], e[3]) for e in tracer.log.events] == [
        (ALLOC, 8_192, Category.TEMPORARY), (ALLOC, RSTD, Category.TEMPORARY),
        (ALLOC, 8_192, Category.ACTIVATION), (ALLOC, 256, Category.ACTIVATION), (RECAT, 0, Category.ACTIVATION)]


def test_rms_norm_backward_on_cuda_allocates_dx_dgamma_and_a_contiguous_grad():
    tracer, backward_at = _trace(Device.CUDA)
    backward = tracer.log.events[backward_at:]
    # y.sum() (4 B) and its ones_like grad (4 B), which SumBackward expands (stride 0): the kernel's
    # dY.contiguous() copies it, 2,048 x 4 B = 8,192 B; then dX (8,192 B) and dgamma 64 x 4 B = 256 B.
    assert _allocs(backward) == [4, 4, 8_192, 8_192, 256]


def test_rms_norm_without_a_weight_has_no_dgamma():
    tracer, backward_at = _trace(Device.CUDA, affine=False)
    # forward as above with no weight to register; backward: sum, its grad, the contiguous grad and dX only
    assert _allocs(tracer.log.events[:backward_at]) == [8_192, 8_192, RSTD]
    assert _allocs(tracer.log.events[backward_at:]) == [4, 4, 8_192, 8_192]


@pytest.mark.parametrize("dtype,extra", [(torch.float32, ELEMS * 4), (torch.bfloat16, ELEMS * (4 + 4))],
                         ids=["fp32", "bf16"])
def test_the_composite_kept_fp32_copies_that_cuda_does_not(dtype, extra):
    # After forward the composite (rms_norm_composite on meta, and the CPU target) still holds
    # x * rstd in fp32, which .mul(weight) keeps for backward (2,048 x 4 B = 8,192 B), and for bf16
    # also the fp32 copy input.to(float) that pow and mul keep (another 8,192 B): 16,384 B.
    def live_after_forward(device):
        norm = torch.nn.RMSNorm(N, eps=1e-6, device="meta", dtype=dtype)
        x = torch.empty(M, N, device="meta", dtype=dtype, requires_grad=True)
        tracer = MemoryTracer(device)
        with tracer:
            tracer.watch(norm)
            y = norm(x)  # noqa: F841  (kept alive, with its graph)
            return tracer.live_bytes

    assert live_after_forward(Device.CPU) - live_after_forward(Device.CUDA) == extra


def test_rms_norm_on_cpu_is_the_composite_and_the_rule_is_inert_there():
    # rms_norm_composite, fp32: the weight (64 x 4 = 256 B), x (8,192 B, first seen), pow (8,192),
    # mean (M x 4 = 128), add_ in place, rsqrt (128), x * rstd (8,192), * weight (8,192); nothing else.
    tracer, backward_at = _trace(Device.CPU)
    assert _allocs(tracer.log.events[:backward_at]) == [256, 8_192, 8_192, 128, 128, 8_192, 8_192]
    with_rule, without = _without_the_rule(lambda: _trace(Device.CPU)[0])
    assert with_rule == without


def _without_the_rule(trace):
    """``trace()``'s events, and the same with the rms_norm rules removed (storage ids left out)."""
    def strip(tracer):
        return [(e[0], e[2], e[3]) for e in tracer.log.events]

    with_rule = strip(trace())
    rules = {f: registry.FUNCTION_RULES.pop(f) for f in (F.rms_norm, torch.rms_norm)}
    try:
        without = strip(trace())
    finally:
        registry.FUNCTION_RULES.update(rules)
    return with_rule, without


def test_a_weight_of_another_dtype_takes_the_composite_as_aten_does():
    # layer_norm.cpp:346 (2.13): "Mismatch dtype between input and weight ... Cannot dispatch to fused implementation"
    with_rule, without = _without_the_rule(
        lambda: _trace(Device.CUDA, dtype=torch.bfloat16, weight_dtype=torch.float32)[0])
    assert with_rule == without


def test_a_channels_last_input_takes_the_composite_as_aten_does():
    # rms_norm_symint: "composite fallback for channels last"; x (2, 64, 4, 4) channels-last, normalized over W=4
    def trace():
        x = torch.empty(2, 64, 4, 4, device="meta").to(memory_format=torch.channels_last).requires_grad_()
        norm = torch.nn.RMSNorm(4, device="meta")
        tracer = MemoryTracer(Device.CUDA)
        with tracer:
            norm(x).sum().backward()
        return tracer

    with_rule, without = _without_the_rule(trace)
    assert with_rule == without


def test_under_cuda_autocast_rms_norm_runs_fused_in_fp32():
    # autocast_mode.h:876 lists rms_norm as fp32: the fp32 weight (256 B) is kept, the bf16 x
    # (4,096 B) is cast to fp32 (8,192 B), and the fused kernel writes Y in fp32 (8,192 B) and rstd
    # (128 B). Without rms_norm in the table the dtypes would differ and the composite would run.
    ac = MetaAutocast(Device.CUDA, torch.bfloat16)
    tracer, backward_at = _trace(Device.CUDA, dtype=torch.bfloat16, weight_dtype=torch.float32, autocast=ac)
    assert _allocs(tracer.log.events[:backward_at]) == [256, 4_096, 8_192, 8_192, RSTD]


@pytest.mark.parametrize("rows,scratch", [(65_600, [2_050 * 64 * 4, 64 * 4]), (65_536, [])],
                         ids=["M>64Ki", "M=64Ki"])
def test_many_rows_add_partial_weight_gradients_in_backward(rows, scratch):
    # LaunchGammaBetaBackwardCUDAKernel (layer_norm_kernel.cu:958): M > 64 * 1024 and N / 32 = 2 <
    # sm_count / 2 = 54 (A100, 108 SMs): blocks.x = ceil(64 / 32) = 2, blocks.y = min(32768 / 2,
    # ceil(65,600 / 32) = 2,050) = 2,050: dgamma_blocks 2,050 x 64 x 4 B = 524,800 B, then its
    # sum(0), 64 x 4 B = 256 B. At M = 65,536 the condition fails: no partial sums.
    x = torch.empty(rows, N, device="meta", requires_grad=True)
    tracer, backward_at = _trace(Device.CUDA, x=x)
    backward = tracer.log.events[backward_at:]
    # the scratch buffers are the ones freed right after their allocation, with negative ids
    assert [e[2] for e in backward if e[0] == ALLOC and e[1] < 0] == scratch
    assert cuda_norms.rms_norm_backward_scratch(rows, N, N, 4, 108) == scratch


def test_free_events_balance_their_allocations():
    tracer, _ = _trace(Device.CUDA)
    freed = {e[1] for e in tracer.log.events if e[0] == FREE}
    assert all(e[1] in freed for e in tracer.log.events if e[0] == ALLOC and e[1] < 0)
