"""Op rules: the target's kernel choices, and rules users register (data-dependent
stand-ins: tests/test_data_dependent.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memcheck
from memcheck.measure.local import measure_cpu
from memcheck.rules.registry import bind
from memcheck.rules.sdpa import SDP_FLASH, SDP_MATH, cpu_sdpa_backend


class Attention(nn.Module):
    def __init__(self, dim=64, heads=4, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)


def test_cpu_sdpa_choice_follows_torch():
    q = torch.empty(2, 4, 512, 16, device="meta")
    assert cpu_sdpa_backend(q, q, q, None, 0.0, True, None, False) == SDP_FLASH
    # The CPU flash kernel takes no dropout (sdp_utils_cpp.cpp check_for_dropout).
    assert cpu_sdpa_backend(q, q, q, None, 0.1, True, None, False) == SDP_MATH


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sdpa_estimate_matches_real_cpu_run(dropout):
    # batch 2, 512 tokens, 4 heads: one (s x s) fp32 score matrix is
    # 2 * 4 * 512 * 512 * 4 B = 8 MiB; the flash path never allocates it.
    def build():
        torch.manual_seed(0)
        return Attention(dropout=dropout), torch.randn(2, 512, 64)

    measured = measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1)).steady_peak_bytes
    with torch.device("meta"):
        model, x = build()
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd")
    assert abs(est.peak_bytes - measured) / measured <= 0.02
    if dropout == 0.0:
        assert est.peak_bytes < 8 * 2**20
    else:
        assert est.peak_bytes > 8 * 2**20


def test_bind_fills_an_ops_schema_defaults():
    x, idx = torch.empty(4, device="meta"), torch.empty(1, dtype=torch.long, device="meta")
    # index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False)
    assert bind(torch.ops.aten.index_put.default, (x, [idx], x), {}) == {
        "self": x, "indices": [idx], "values": x, "accumulate": False}
    # repeat_interleave.Tensor(Tensor repeats, *, SymInt? output_size=None): keyword-only,
    # so a second positional argument does not fill it
    op = torch.ops.aten.repeat_interleave.Tensor
    assert bind(op, (idx, 7), {})["output_size"] is None
    assert bind(op, (idx,), {"output_size": 7})["output_size"] == 7


def test_bind_by_names_for_a_python_function():
    names = ("input", "dim", "_stacklevel", "dtype")  # F.softmax's parameters
    b = bind(F.softmax, ("x", -1), {"dtype": torch.float32, "other": 1}, names=names, defaults={"_stacklevel": 3})
    # positional, then keywords, then defaults, else None; keywords not named are left out
    assert b == {"input": "x", "dim": -1, "_stacklevel": 3, "dtype": torch.float32}
    assert bind(F.softmax, (), {"input": "x"}, names=names[:2]) == {"input": "x", "dim": None}


def test_register_op_rule_for_a_custom_op():
    lib = torch.library.Library("memcheck_test", "DEF")
    lib.define("double_it(Tensor x) -> Tensor")

    @memcheck.register_op_rule(torch.ops.memcheck_test.double_it.default)
    def rule(ctx, func, args, kwargs):
        return torch.empty_like(args[0])

    with torch.device("meta"):
        model = nn.Linear(4, 4)
        x = torch.empty(5, 4)
    est = memcheck.estimate(
        model, x, device="cpu",
        loss_fn=lambda m, b: (m(b) + torch.ops.memcheck_test.double_it(b)).sum(),
    )
    assert est.peak_bytes > 0


def _encoder(dropout):
    def build():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=dropout, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.randn(4, 256, 64)
    return build


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_multihead_attention_takes_the_kernel_a_real_cpu_run_takes(dropout):
    # nn.MultiheadAttention calls SDPA from inside F.multi_head_attention_forward, which the
    # tracer's function mode handles itself; the rule routes that inner call. Measured on this
    # CPU: without dropout torch runs the CPU flash kernel (6,912,264 B peak; the math path
    # memcheck traced before the rule, with its (4, 4, 256, 256) fp32 scores of 4 MiB a layer,
    # gave 21,863,944 B); with dropout 0.1 it runs the math path, as before.
    def loss(m, x):
        return m(x).sum()

    build = _encoder(dropout)
    measured = measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss).steady_peak_bytes
    with torch.device("meta"):
        model, x = build()
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd", loss_fn=loss)
    assert est.peak_bytes == measured


def test_multihead_attention_on_cuda_takes_a_fused_kernel_not_the_scores():
    # (B, H, T, T) fp32 scores of the math path: 2 x 4 x 256 x 256 x 4 B = 2,097,152 B; a fused
    # kernel never allocates them. Without the rule the CUDA target traced the math path.
    from memcheck.enums import ALLOC, Device
    from memcheck.rules import registry
    from memcheck.trace.tracer import MemoryTracer

    mha = nn.MultiheadAttention(64, 4, batch_first=True, device="meta")
    q = torch.empty(2, 256, 64, device="meta", requires_grad=True)

    def allocs():
        tracer = MemoryTracer(Device.CUDA)
        with tracer:
            mha(q, q, q, need_weights=False)[0].sum().backward()
        return [e[2] for e in tracer.log.events if e[0] == ALLOC], tracer.log.assumptions

    fused, assumed = allocs()
    rule = registry.FUNCTION_RULES.pop(F.multi_head_attention_forward)
    try:
        math, _ = allocs()
    finally:
        registry.FUNCTION_RULES[F.multi_head_attention_forward] = rule
    assert 2_097_152 not in fused and 2_097_152 in math
    assert "SDPA on CUDA: efficient kernel (sm80)" in assumed
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # the global is restored
