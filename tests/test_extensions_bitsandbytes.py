"""bitsandbytes layers and optimizers: real CPU runs as the oracle, hand arithmetic for CUDA.

bitsandbytes 0.50 runs on CPU, so the CPU estimates are checked against
``memcheck.measure.local.measure_cpu`` (the allocator's own events under the profiler) running
the real layers and optimizers. Two differences are expected, both a few bytes and
neither a per-layer or per-element cost memcheck leaves out:

* ``BNB_PROCESS_CACHES``: bitsandbytes' first 4-bit quantization in a process fills
  module-level caches that live as long as the process: the 256-entry fp32 dynamic map
  (``functional.name2qmap["dynamic"]``, 1,024 B), the CPU 4-bit code (16 fp32, 64 B) and
  the quantization bounds (15 fp32 midpoints + 16 int64 indices, 188 B). A measured
  build pays them only if no earlier test quantized, so the difference is 0 or 1,276 B.
* ``WRAPPED_SCALARS``: Python numbers in tensor arithmetic (``g.float() * gnorm_scale``,
  ``.mul(1.0 / 127.0)``) become 0-dim CPU tensors (an 8 B double, sometimes a 4 B float
  copy) that the CPU allocator sees and a meta trace does not; a few live at once.

The CUDA paths cannot be run here (no GPU): their bytes are checked against hand
arithmetic from bitsandbytes' backends/cuda/ops.py.
"""

import logging
import sys

import pytest
import torch
from torch import nn

class _Bitsandbytes:
    """bitsandbytes, imported at the first test that uses it, not at collection: its import runs
    torch.compile decorators (bitsandbytes/backends/default/ops.py), which import torch._dynamo,
    seconds that every pytest-xdist worker would pay while collecting."""

    def __getattr__(self, name):
        return getattr(pytest.importorskip("bitsandbytes"), name)


bnb = _Bitsandbytes()

import memcheck  # noqa: E402
from memcheck.enums import Device  # noqa: E402
from memcheck.measure.local import measure_cpu  # noqa: E402
from memcheck.training.optimizers import _AdamW8bitLayout, resolve_optimizer  # noqa: E402
from memcheck.trace.tracer import ALLOC, MemoryTracer  # noqa: E402

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16"

BNB_PROCESS_CACHES = 1_024 + 64 + 15 * 4 + 16 * 8
assert BNB_PROCESS_CACHES == 1_276
WRAPPED_SCALARS = 64


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def quantized_mlp(kind):
    """Linear(64, 512) -> a quantized (512, 512) layer -> Linear(512, 8); its build quantizes."""

    def build():
        torch.manual_seed(0)
        if kind == "4bit":
            layer = bnb.nn.Linear4bit(512, 512, compute_dtype=torch.float32, quant_type="nf4")
        else:
            layer = bnb.nn.Linear8bitLt(512, 512, has_fp16_weights=False)
        model = nn.Sequential(nn.Linear(64, 512), layer, nn.Linear(512, 8)).to("cpu")  # .to() quantizes
        return model, torch.randn(64, 64)

    return build


# Parameters by hand. Linear(64, 512): (64*512 + 512) * 4 B = 133,120; Linear(512, 8):
# (512*8 + 8) * 4 B = 16,416; the quantized layer's fp32 bias 512 * 4 B = 2,048.
#   4-bit (nf4, compress_statistics): packed weight 512*512 / 2 = 131,072 B; absmax for
#   512*512 / 64 = 4,096 blocks as uint8 = 4,096 B; nested absmax ceil(4,096 / 256) = 16
#   fp32 = 64 B; nested code 256 fp32 = 1,024 B; offset 4 B; nf4 code 16 fp32 = 64 B.
#   8-bit: int8 weight 512*512 = 262,144 B; SCB 512 fp32 = 2,048 B.
PARAMS_4BIT = 133_120 + 131_072 + 4_096 + 64 + 1_024 + 4 + 64 + 2_048 + 16_416
PARAMS_8BIT = 133_120 + 262_144 + 2_048 + 2_048 + 16_416
assert (PARAMS_4BIT, PARAMS_8BIT) == (287_908, 415_776)


def test_linear4bit_estimate_matches_a_real_cpu_run():
    build = quantized_mlp("4bit")
    measured = measure_cpu(build, sgd).steady_peak_bytes
    model, x = build()
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd")
    assert est.breakdown_at_peak.params == PARAMS_4BIT
    assert -WRAPPED_SCALARS <= measured - est.peak_bytes <= BNB_PROCESS_CACHES + WRAPPED_SCALARS, (
        est.peak_bytes, measured)


def test_linear8bit_estimate_matches_a_real_cpu_run():
    # On CPU in training, bitsandbytes takes MatMul8bitFp: the int8 weight dequantized to
    # fp32 (512*512*4 = 1,048,576 B) in forward and again in backward.
    build = quantized_mlp("8bit")
    measured = measure_cpu(build, sgd).steady_peak_bytes
    model, x = build()
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd")
    assert est.breakdown_at_peak.params == PARAMS_8BIT
    assert abs(measured - est.peak_bytes) <= WRAPPED_SCALARS, (est.peak_bytes, measured)


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_a_layer_built_on_meta_is_estimated_as_quantized(kind):
    # Not quantized yet (quantization happens on .to(device)); the twin takes the sizes
    # quantization gives, so the estimate is that of the quantized model.
    real, x = quantized_mlp(kind)()
    with torch.device("meta"):
        layer = (bnb.nn.Linear4bit(512, 512, compute_dtype=torch.float32, quant_type="nf4") if kind == "4bit"
                 else bnb.nn.Linear8bitLt(512, 512, has_fp16_weights=False))
        unquantized = nn.Sequential(nn.Linear(64, 512), layer, nn.Linear(512, 8))
    a = memcheck.estimate(real, x, device="cpu", optimizer="sgd")
    b = memcheck.estimate(unquantized, x, device="cpu", optimizer="sgd")
    assert b.peak_bytes == a.peak_bytes
    assert b.breakdown_at_peak.params == (PARAMS_4BIT if kind == "4bit" else PARAMS_8BIT)


def test_estimating_leaves_the_model_and_its_quantization_state_alone():
    model, x = quantized_mlp("4bit")()
    weight, state = model[1].weight, model[1].weight.quant_state
    memcheck.estimate(model, x, device="cpu", optimizer="sgd")
    assert model[1].weight is weight and weight.quant_state is state
    assert weight.device.type == "cpu" and state.absmax.device.type == "cpu"


# --------------------------------------------------------------------------------------
# Optimizers.


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.Linear(256, 8)), torch.randn(32, 64)


# AdamW8bit on mlp() by hand (Optimizer2State.init_state: 8-bit from 4,096 elements, blocks of 256):
#   W1 32,768: uint8 states 2*32,768 + fp32 absmax 2*128*4       =  66,560
#   W2 131,072: 2*131,072 + 2*512*4                               = 266,240
#   fp32 states 2*n*4 for b1 (512), b2 (256), W3 (2,048), b3 (8)  =  4,096 + 2,048 + 16,384 + 64
#   qmap1 + qmap2, one pair per optimizer: 2*256*4                =   2,048
ADAMW8BIT_STATE = 66_560 + 266_240 + 4_096 + 2_048 + 16_384 + 64 + 2_048
assert ADAMW8BIT_STATE == 357_440
MLP_PARAMS = (32_768 + 512 + 131_072 + 256 + 2_048 + 8) * 4
assert MLP_PARAMS == 666_656


@pytest.mark.parametrize("as_class", [False, True])
def test_adamw8bit_estimate_matches_a_real_cpu_run(as_class):
    measured = measure_cpu(mlp, lambda p: bnb.optim.AdamW8bit(p)).steady_peak_bytes
    model, x = mlp()
    optimizer = bnb.optim.AdamW8bit if as_class else bnb.optim.AdamW8bit(model.parameters())
    est = memcheck.estimate(model, x, device="cpu", optimizer=optimizer)
    assert est.optimizer == "AdamW8bit (bitsandbytes layout)"
    assert est.breakdown_at_peak.optimizer == ADAMW8BIT_STATE
    # The peak is W2's update on the CPU kernel (_optimizer_update_8bit_blockwise_cpu):
    # both states dequantized, the fp32 gradient, sqrt(s2) and its quotient, 5 * 131,072
    # * 4 B = 20 * 131,072 B, over params, grads, state and the batch (32*64*4 = 8,192).
    assert est.peak_bytes == 2 * MLP_PARAMS + ADAMW8BIT_STATE + 8_192 + 20 * 131_072
    assert abs(measured - est.peak_bytes) <= WRAPPED_SCALARS, (est.peak_bytes, measured)


OPTIMIZERS = {
    "PagedAdamW8bit": lambda p: bnb.optim.PagedAdamW8bit(p),  # not paged on CPU
    "AdamW 32-bit": lambda p: bnb.optim.AdamW(p),
    "Lion8bit": lambda p: bnb.optim.Lion8bit(p),
    "SGD8bit": lambda p: bnb.optim.SGD8bit(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "RMSprop 32-bit": lambda p: bnb.optim.RMSprop(p, weight_decay=0.01),
    "AdEMAMix8bit": lambda p: bnb.optim.AdEMAMix8bit(p),
}


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bitsandbytes_optimizers_match_real_cpu_runs(name):
    make = OPTIMIZERS[name]
    measured = measure_cpu(mlp, make).steady_peak_bytes
    model, x = mlp()
    est = memcheck.estimate(model, x, device="cpu", optimizer=make(model.parameters()))
    assert abs(measured - est.peak_bytes) <= WRAPPED_SCALARS, (name, est.peak_bytes, measured)


def test_bitsandbytes_adam_maps_to_the_layout_with_its_settings():
    params = [nn.Parameter(torch.zeros(8))]
    label, factory = resolve_optimizer(bnb.optim.PagedAdamW8bit(params, lr=3e-4, min_8bit_size=16_384), Device.CUDA)
    assert label == "PagedAdamW8bit (bitsandbytes layout; paged state counted as resident)"
    opt = factory([torch.zeros(8, device="meta", requires_grad=True)])
    assert isinstance(opt, _AdamW8bitLayout)
    assert (opt.min_8bit_size, opt.optim_bits, opt.target) == (16_384, 8, Device.CUDA)
    assert opt.defaults["lr"] == 3e-4
    _, factory = resolve_optimizer(bnb.optim.AdamW, Device.CPU)  # the 32-bit class
    opt = factory([torch.zeros(8, device="meta", requires_grad=True)])
    assert (opt.optim_bits, opt.target) == (32, Device.CPU)


def test_a_factory_that_makes_a_paged_optimizer_is_traced_as_its_layout():
    # A model file's make_optimizer. Run as itself on meta, PagedAdamW8bit would ask CUDA for
    # unified memory for W2's state (>= 1e5 elements); the layout counts it as resident.
    model, x = mlp()
    est = memcheck.estimate(model, x, device="cuda", optimizer=lambda p: bnb.optim.PagedAdamW8bit(p))
    assert est.breakdown_at_peak.optimizer >= ADAMW8BIT_STATE  # plus the CUDA allocator's rounding


def test_other_bitsandbytes_optimizers_allocate_nothing_in_a_cuda_step(monkeypatch):
    # Lion8bit runs as itself: its init_state makes the state; the fused CUDA kernel (the
    # op's fake) allocates nothing, so the step adds no temporaries to the trace.
    model, x = mlp()
    scratches = []

    class Recording(MemoryTracer):
        def scratch(self, *nbytes):
            scratches.append(nbytes)
            return super().scratch(*nbytes)

    monkeypatch.setattr(sys.modules["memcheck.engine.setup"], "MemoryTracer", Recording)
    est = memcheck.estimate(model, x, device="cuda", optimizer=bnb.optim.Lion8bit(model.parameters()))
    assert est.optimizer == "Lion8bit (bitsandbytes)"
    assert scratches == []


def test_a_bitsandbytes_class_that_needs_arguments_is_a_usage_error():
    with pytest.raises(memcheck.UsageError, match="SGD8bit cannot be built with its defaults"):
        resolve_optimizer(bnb.optim.SGD8bit, Device.CPU)


# --------------------------------------------------------------------------------------
# The CUDA target: hand arithmetic from backends/cuda/ops.py (not measured: no GPU).


def scratch(tracer, start=0):
    return [e[2] for e in tracer.log.events[start:] if e[0] == ALLOC and e[1] < 0]


def gemm_4bit(rows, device):
    """torch.ops.bitsandbytes.gemm_4bit of a (rows, 512) fp16 input by a nested nf4 (512, 512)
    weight: 4,096 blocks of 64 (uint8 absmax), 16 nested fp32 absmax, under a tracer."""
    meta = dict(device="meta")
    a = torch.empty(rows, 512, dtype=torch.float16, **meta)
    packed = torch.empty(131_072, 1, dtype=torch.uint8, **meta)
    tracer = MemoryTracer(device)
    with tracer:
        torch.ops.bitsandbytes.gemm_4bit.default(
            a, packed, [512, 512], torch.empty(16, **meta), 64, "nf4",
            absmax_8bit=torch.empty(4_096, dtype=torch.uint8, **meta), absmax_code=torch.empty(256, **meta),
            absmax_offset=torch.empty((), **meta))
    return tracer


def test_gemm_4bit_dequantizes_the_weight_unless_bitsandbytes_takes_its_fused_kernel():
    # Dequantized: the nested absmax 4,096 fp32 = 16,384 B and the weight 512*512 fp16 = 524,288 B.
    # CPU (_gemm_4bit_default_impl): absmax + offset (the first copy freed by the sum), weight.
    assert scratch(gemm_4bit(64, Device.CPU)) == [16_384, 524_288]
    # CUDA above 1,536 rows (_dequant_linear_fallback): absmax_dq kept while + offset, weight.
    assert scratch(gemm_4bit(2_048, Device.CUDA)) == [16_384, 16_384, 524_288]
    # CUDA at 4 rows or fewer: the fused cgemm_4bit kernel, nothing allocated but the output.
    assert scratch(gemm_4bit(4, Device.CUDA)) == []
    # In between bitsandbytes decides by GPU and shape: memcheck assumes the fallback, and says so.
    tracer = gemm_4bit(64, Device.CUDA)
    assert scratch(tracer) == [16_384, 16_384, 524_288]
    assert any("gemm_4bit on CUDA with 64 rows" in a for a in tracer.log.assumptions)


@pytest.mark.parametrize("dtype, expected", [(torch.float32, [65_536, 32_768]), (torch.float16, [65_536])])
def test_int8_scaled_mm_on_cuda_holds_an_int32_product_and_an_fp16_copy(dtype, expected):
    # (64, 512) int8 activations by a (256, 512) int8 weight: int8_linear_matmul's int32
    # (64, 256) = 65,536 B, int8_mm_dequant's fp16 (64, 256) = 32,768 B cast to fp32.
    meta = dict(device="meta")
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        out = torch.ops.bitsandbytes.int8_scaled_mm.default(
            torch.empty(64, 512, dtype=torch.int8, **meta), torch.empty(256, 512, dtype=torch.int8, **meta),
            torch.empty(64, **meta), torch.empty(256, **meta), dtype=dtype)
    assert out.shape == (64, 256) and out.dtype == dtype
    assert scratch(tracer) == expected


@pytest.mark.parametrize("device", [Device.CPU, Device.CUDA])
def test_linear8bit_takes_the_path_bitsandbytes_takes_on_the_target(device, monkeypatch):
    # CPU training: MatMul8bitFp dequantizes the weight to fp32, 512*512*4 = 1,048,576 B.
    # CUDA: MatMul8bitLt quantizes the (64, 512) fp32 input: an fp16 copy (65,536 B), int8
    # rows (32,768 B) and fp32 row scales (256 B), then int8_scaled_mm.
    model, x = quantized_mlp("8bit")()
    seen = []

    class Recording(MemoryTracer):
        def _alloc(self, sid, st, category, module):
            seen.append(st.nbytes())
            return super()._alloc(sid, st, category, module)

    monkeypatch.setattr(sys.modules["memcheck.engine.setup"], "MemoryTracer", Recording)
    est = memcheck.estimate(model, x, device=device, optimizer="sgd")
    if device is Device.CPU:
        assert 1_048_576 in seen and 32_768 not in seen
    else:
        assert {65_536, 32_768, 256} <= set(seen) and 1_048_576 in seen  # backward dequantizes too
    assert est.peak_bytes > 0


def test_llm_int8_threshold_traces_with_no_outlier_columns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), bnb.nn.Linear8bitLt(512, 512, has_fp16_weights=False, threshold=6.0))
    model = model.to("cpu")
    est = memcheck.estimate(model, torch.randn(64, 64), device="cuda", optimizer="sgd")
    assert any("no outlier columns assumed" in a for a in est.assumptions)
