"""Autocast emulation on meta tensors, checked against torch's own autocast on CPU.

The CPU policy table is checked op by op against ``torch.autocast("cpu")`` on real
tensors: same output dtype. The CUDA table cannot run here; it is transcribed
from aten/src/ATen/autocast_mode.h and checked by hand below.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import memcheck
from memcheck.rules.autocast import POLICIES, CastPolicy, MetaAutocast
from memcheck.enums import Device
from memcheck.trace.tracer import ALLOC, MemoryTracer


def _pair(shape=(4, 4)):
    return torch.randn(*shape), torch.randn(*shape)


# (name, function of real-or-meta tensors): ops a training step meets.
CASES = [
    ("linear", lambda a, b: F.linear(a, b)),
    ("matmul", lambda a, b: a @ b),
    ("mm", lambda a, b: torch.mm(a, b)),
    ("bmm", lambda a, b: torch.bmm(a[None], b[None])),
    ("addmm", lambda a, b: torch.addmm(a, a, b)),
    ("baddbmm", lambda a, b: torch.baddbmm(a[None], a[None], b[None])),
    ("conv2d", lambda a, b: F.conv2d(a[None, None], b[None, None])),
    ("softmax", lambda a, b: F.softmax(a, -1)),
    ("layer_norm", lambda a, b: F.layer_norm(a, (4,))),
    ("cross_entropy", lambda a, b: F.cross_entropy(a, torch.zeros(4, dtype=torch.long, device=a.device))),
    ("mse_loss", lambda a, b: F.mse_loss(a, b)),
    ("cat_mixed", lambda a, b: torch.cat([a @ b, b])),
    ("gelu", lambda a, b: F.gelu(a @ b)),
    ("sdpa", lambda a, b: F.scaled_dot_product_attention(a[None, None], b[None, None], b[None, None])),
    ("sum_of_lowp", lambda a, b: (a @ b).sum()),
    ("pow_of_lowp", lambda a, b: (a @ b).pow(2)),
]


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
def test_cpu_policy_gives_the_dtype_real_cpu_autocast_gives(name, fn):
    a, b = _pair()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = fn(a, b)
    ac = MetaAutocast(Device.CPU, torch.bfloat16)
    tracer = MemoryTracer(Device.CPU)
    tracer.autocast = ac
    with tracer, ac.region():
        traced = fn(a.to("meta"), b.to("meta"))
    assert traced.dtype == real.dtype, f"{name}: traced {traced.dtype}, real autocast {real.dtype}"


def test_cuda_table_follows_autocast_mode_h():
    cuda = POLICIES[Device.CUDA]
    # AT_FORALL_LOWER_PRECISION_FP: linear, matmul, bmm, conv2d, scaled_dot_product_attention
    for fn in (F.linear, torch.matmul, torch.Tensor.__matmul__, torch.bmm, F.conv2d, F.scaled_dot_product_attention):
        assert cuda[fn] is CastPolicy.LOWER
    # AT_FORALL_FP32: layer_norm, pow, exp, mse_loss; AT_FORALL_FP32_SET_OPT_DTYPE: softmax, sum
    for fn in (F.layer_norm, torch.Tensor.pow, torch.exp, F.mse_loss):
        assert cuda[fn] is CastPolicy.FP32
    for fn in (F.softmax, torch.Tensor.softmax, torch.sum, torch.Tensor.sum):
        assert cuda[fn] is CastPolicy.FP32_SET_OPT_DTYPE
    # Not listed for CUDA: cat and gelu run in whatever dtype they are given.
    assert torch.cat not in cuda and F.gelu not in cuda


def _alloc_bytes(tracer):
    return [e[2] for e in tracer.log.events if e[0] == ALLOC]


def test_a_weight_used_twice_is_cast_once_per_region():
    # Linear(64, 64) without bias, applied twice: the fp32 weight (64*64*4 = 16384 B) is
    # cast to bf16 once (64*64*2 = 8192 B); the input (8*64*4 B) is cast at each call,
    # since it is not a leaf that requires grad (8*64*2 = 1024 B each time).
    with torch.device("meta"):
        lin = torch.nn.Linear(64, 64, bias=False)
        x = torch.empty(8, 64)
    ac = MetaAutocast(Device.CUDA, torch.bfloat16)
    tracer = MemoryTracer(Device.CUDA)
    tracer.autocast = ac
    with tracer:
        tracer.watch(model=lin, batch=x)
        with ac.region():
            y = lin(lin(x))
    sizes = _alloc_bytes(tracer)
    assert sizes.count(8192) == 1  # one bf16 weight copy
    assert y.dtype == torch.bfloat16
    assert not ac._cache  # the cache empties when the region ends


def test_cuda_cross_entropy_on_fp16_logits_makes_no_fp32_copy_of_them():
    # Logits (16, 1000) fp16 = 32000 B. CUDA's log_softmax(dtype=float32) on Half writes a
    # float32 result (16*1000*4 = 64000 B) straight from fp16 (half_to_float): no 64000 B copy
    # of the input before it. nll_loss then returns a scalar (4 B).
    logits = torch.empty(16, 1000, dtype=torch.float16, device="meta", requires_grad=True)
    target = torch.zeros(16, dtype=torch.long, device="meta")
    ac = MetaAutocast(Device.CUDA, torch.float16)
    tracer = MemoryTracer(Device.CUDA)
    tracer.autocast = ac
    with tracer, ac.region():
        loss = F.cross_entropy(logits, target)
    sizes = _alloc_bytes(tracer)
    assert loss.dtype == torch.float32
    assert sizes.count(64000) == 1


def test_amp_fp16_on_cuda_traces_a_grad_scaler():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        x = torch.empty(8, 32)
    est = memcheck.estimate(model, x, device="cuda", precision="amp-fp16")
    assert any("GradScaler" in a for a in est.assumptions)
    assert est.precision.value == "amp-fp16"


@pytest.mark.parametrize("precision", ["amp-bf16", "amp-fp16"])
def test_amp_saves_low_precision_activations_so_the_peak_drops(precision):
    # Activation-dominated MLP: 8 Linear(2048, 2048) on a 4096-row batch. Each linear saves
    # its input: fp32 4096*2048*4 = 32 MiB; under autocast the saved input is the 16 MiB copy.
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
        x = torch.empty(4096, 2048)
    fp32 = memcheck.estimate(model, x, device="cuda", precision="fp32")
    amp = memcheck.estimate(model, x, device="cuda", precision=precision)
    assert amp.breakdown_at_peak.activations < fp32.breakdown_at_peak.activations


def test_autocast_queries_about_the_meta_device_answer_for_the_emulated_region():
    # torch rejects "meta" ("unknown device type for autocast"); code that asks about its
    # tensors' own device (TRL's fused LM head) gets the emulated region's answer
    from types import SimpleNamespace

    from memcheck.rules.autocast import meta_autocast_queries

    region = MetaAutocast(Device.CUDA, torch.bfloat16)
    tracer = SimpleNamespace(autocast=region)
    before = (torch.is_autocast_enabled, torch.get_autocast_dtype)
    with meta_autocast_queries(tracer, Device.CUDA):
        assert torch.is_autocast_enabled("meta") is False
        with region:
            assert torch.is_autocast_enabled("meta") is True
            assert torch.get_autocast_dtype(device_type="meta") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu") is False  # other devices: torch's own answer
        tracer.autocast = None
        assert torch.get_autocast_dtype("meta") == torch.float16  # torch's CUDA default
    assert (torch.is_autocast_enabled, torch.get_autocast_dtype) == before


class _FoldBlock(torch.nn.Module):
    """Opens ``torch.autocast(device_type=<its tensor's device>, enabled=False)`` around an fp32 matmul, as
    PEFT's LoRA on a parameter does around its fold (peft/tuners/lora/layer.py, ``_LoraFactorsProxy``):
    "meta" in a trace, which torch refuses as an autocast device."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        with torch.autocast(device_type=h.device.type, enabled=False):
            out = h.float() @ self.lin.weight.t()
        assert out.dtype == torch.float32, out.dtype  # the region really is off, the recomputation included
        return out.relu()


def _fold_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(_FoldBlock(), _FoldBlock()), torch.randn(8, 64)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_an_autocast_region_on_the_meta_device_is_the_targets_and_pauses_the_emulation(checkpointing):
    # issue 38's matrix: Mixtral with LoRA on its fused experts failed "unsupported autocast device_type
    # 'meta'", then, checkpointed under amp-bf16, cast the fold's matmul in the recomputation anyway
    from memcheck.measure.local import measure_cpu
    from memcheck.training.checkpointing import apply_checkpointing

    def real():
        model, x = _fold_model()
        apply_checkpointing(model, checkpointing)
        return model, x

    with torch.device("meta"):
        model, x = _fold_model()
    est = memcheck.estimate(model, x, device="cpu", precision="amp-bf16", checkpointing=checkpointing,
                            optimizer="adamw", loss_fn=lambda m, b: m(b).sum())
    measured = measure_cpu(real, lambda p: torch.optim.AdamW(p), loss_fn=lambda m, b: m(b).sum(),
                           autocast_dtype=torch.bfloat16).steady_peak_bytes
    assert abs(est.peak_bytes - measured) <= 0.02 * measured, (est.peak_bytes, measured)


class _CastTwice(torch.nn.Module):
    """One weight that autocast casts twice in a block, as PEFT's DoRA casts lora_A's and lora_B's
    (its weight norm's lora_B(lora_A(eye)), then lora_B(lora_A(x)))."""

    def __init__(self, width=256):
        super().__init__()
        self.lin = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        return self.lin(self.lin(x).relu())


def _cast_twice_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(_CastTwice(), _CastTwice()), torch.randn(64, 256)


def test_a_recomputation_casts_each_weight_once_as_the_forward_does():
    # torch.utils.checkpoint recomputes a block under one autocast region, entered with the state it read
    # in the forward (checkpoint.py: _get_autocast_kwargs(device_type) then torch.amp.autocast(device_type,
    # ...) around the whole recomputation), and autocast keeps a weight's cast to its outermost region's exit
    # (autocast_mode.cpp, cached_cast). For meta inputs checkpoint asks about device "meta", which torch says
    # has no autocast: the emulation ran each recomputed op in a region of its own, and cast the weight again.
    from torch.utils.checkpoint import checkpoint

    from memcheck.rules.autocast import meta_autocast_queries

    with torch.device("meta"):
        block, x = _CastTwice(), torch.randn(64, 256, requires_grad=True)
    tracer = MemoryTracer(Device.CUDA)
    tracer.autocast = MetaAutocast(Device.CUDA, torch.bfloat16)
    casts = []

    class _Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0] is block.lin.weight:
                casts.append(kwargs["dtype"])
            return func(*args, **(kwargs or {}))

    with tracer, meta_autocast_queries(tracer, Device.CUDA), _Casts():
        with tracer.autocast:
            y = checkpoint(block, x, use_reentrant=False)
        y.float().sum().backward()
    # the weight's bf16 copy: once in the forward, once in the recomputation (three times before: each of
    # the recomputation's two linears cast it)
    assert casts == [torch.bfloat16, torch.bfloat16]


@pytest.mark.slow
def test_selective_op_checkpointing_under_amp_traces_a_weight_cast_twice_and_matches_a_real_run():
    # issue 38's matrix (c17-vit; BART, T5 and Mamba with DoRA the same): selective-op checkpointing stores
    # each op of the forward by its call count and replays them in the recomputation
    # (checkpoint.py, _CachingTorchDispatchMode / _CachedTorchDispatchMode); a weight cast again in the
    # recomputation was an aten._to_copy call the forward never made: "invocation index ... not found in storage"
    from memcheck.measure.local import measure_cpu
    from memcheck.training.checkpointing import apply_checkpointing

    def real():
        model, x = _cast_twice_model()
        apply_checkpointing(model, "selective-op")
        return model, x

    def loss_fn(m, b):
        return m(b).float().pow(2).mean()

    with torch.device("meta"):
        model, x = _cast_twice_model()
    assert memcheck.estimate(model, x, device="cuda", gpu="H100-80GB", precision="amp-bf16",
                             checkpointing="selective-op", optimizer="sgd", loss_fn=loss_fn).peak_bytes > 0
    with torch.device("meta"):
        model, x = _cast_twice_model()
    est = memcheck.estimate(model, x, device="cpu", precision="amp-bf16", checkpointing="selective-op",
                            optimizer="sgd", loss_fn=loss_fn).peak_bytes
    measured = measure_cpu(real, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn,
                           autocast_dtype=torch.bfloat16).steady_peak_bytes
    # measured 1,250,248 B, estimated 1,245,192 B: 5,056 B under, the CPU generator state checkpoint keeps
    # for the recomputation (torch.get_rng_state(), 5,056 B, a host tensor the trace does not see)
    assert abs(est - measured) <= 0.005 * measured, (est, measured)
