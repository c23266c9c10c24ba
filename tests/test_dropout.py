"""Dropout on the CUDA target takes ATen's fused kernel (memcheck.rules.dropout), with the
bytes worked out by hand from aten/src/ATen/native/Dropout.cpp; the CPU target is unchanged."""

import pytest
import torch
import torch.nn.functional as F

import memcheck
from memcheck.enums import ALLOC, RECAT, Category, Device
from memcheck.rules import registry
from memcheck.trace.tracer import MemoryTracer

# x (32, 64) fp32: 2,048 elements x 4 B = 8,192 B.
ROWS, COLS, X_BYTES, MASK_BYTES = 32, 64, 8_192, 2_048  # the bool mask: 2,048 x 1 B


def _events(device, fn):
    """``(kind, nbytes, category)`` of every event of ``fn(x)`` traced for ``device``."""
    x = torch.empty(ROWS, COLS, device="meta", requires_grad=True)
    tracer = MemoryTracer(device)
    with tracer:
        fn(x)
    return [(e[0], e[2], e[3], e[1]) for e in tracer.log.events]


def _allocs(device, fn):
    return [n for kind, n, _, _ in _events(device, fn) if kind == ALLOC]


@pytest.mark.parametrize("call", [lambda x: F.dropout(x, 0.1, True), lambda x: torch.dropout(x, 0.1, True)],
                         ids=["F.dropout", "torch.dropout"])
def test_training_dropout_on_cuda_is_native_dropout_an_output_and_a_bool_mask(call):
    # Dropout.cpp:139: native_dropout returns the output (8,192 B) and a bool mask (2,048 B) ...
    events = _events(Device.CUDA, call)
    assert [n for kind, n, _, _ in events if kind == ALLOC] == [X_BYTES, MASK_BYTES]
    # ... and autograd saves the mask alone for NativeDropoutBackward: it becomes an activation
    mask_id = next(sid for kind, n, _, sid in events if kind == ALLOC and n == MASK_BYTES)
    assert [(sid, cat) for kind, _, cat, sid in events if kind == RECAT] == [(mask_id, Category.ACTIVATION)]


def test_nn_dropout_takes_the_same_kernel():
    # the input (8,192 B) is first seen inside the Dropout module, then output and mask as above
    assert _allocs(Device.CUDA, lambda x: torch.nn.Dropout(0.1)(x)) == [X_BYTES, X_BYTES, MASK_BYTES]


def test_training_dropout_on_cpu_keeps_the_noise_tensor_as_before():
    # Dropout.cpp:73-74,85: noise = empty_like(input) (8,192 B), then input.mul(noise) (8,192 B); no mask
    assert _allocs(Device.CPU, lambda x: F.dropout(x, 0.1, True)) == [X_BYTES, X_BYTES]


@pytest.mark.parametrize("call", [lambda x: F.dropout(x, 0.1, False), lambda x: F.dropout(x, 0.0, True),
                                  lambda x: F.dropout(x.clone(), 0.1, True, inplace=True)],
                         ids=["eval", "p=0", "inplace"])
def test_dropout_without_the_fused_path_is_traced_as_aten_runs_it(call):
    # eval and p=0 return the input (Dropout.cpp:64-65); dropout_ always runs _dropout<true> (line 147)
    assert _allocs(Device.CUDA, call) == _allocs(Device.CPU, call)


def test_gpt2_saves_a_one_byte_mask_per_dropout_on_cuda():
    # GPT-2, 2 layers, width 64, batch 4 x 128, fp32: dropouts on (4, 128, 64) = 32,768 elements each:
    # the embeddings' (1) and, per layer, the attention output's and the MLP's (2 x 2) = 5.
    # The CPU path keeps 4 B an element for backward where CUDA keeps 1 B:
    # 5 x 32,768 x (4 - 1) = 491,520 B less at the peak (the start of backward, where all are live).
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=128, vocab_size=256, bos_token_id=0,
                     eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(4, 128, dtype=torch.long, device="meta")
    job = memcheck.Job(gpu="A100-80GB")
    fused = memcheck.estimate(model, {"input_ids": ids, "labels": ids}, job)
    rules = {f: registry.FUNCTION_RULES.pop(f) for f in (F.dropout, torch.dropout)}
    try:
        decomposed = memcheck.estimate(model, {"input_ids": ids, "labels": ids}, job)
    finally:
        registry.FUNCTION_RULES.update(rules)
    assert fused.peak_phase.value == decomposed.peak_phase.value == "backward"
    assert decomposed.breakdown_at_peak.activations - fused.breakdown_at_peak.activations == 491_520
    assert decomposed.peak_bytes - fused.peak_bytes == 491_520


def test_multihead_attention_weights_dropout_is_fused_on_cuda():
    # nn.MultiheadAttention(64, 4, dropout=0.1), need_weights=True, batch 2 x 128: the attention
    # weights (B, H, L, S) = 2 x 4 x 128 x 128 = 131,072 elements, 524,288 B in fp32. On CUDA the
    # dropout of the weights (functional.py: dropout(attn_output_weights, p=dropout_p)) keeps a
    # 131,072 B bool mask where the CPU path allocates a 524,288 B noise tensor; both return the
    # head-averaged weights (B, L, S) = 2 x 128 x 128 x 4 B = 131,072 B.
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.1, device="meta")
    q = torch.empty(2, 128, 64, device="meta", requires_grad=True)

    def allocs(device):
        tracer = MemoryTracer(device)
        with tracer:
            mha(q, q, q, need_weights=True)[0].sum().backward()
        return [e[2] for e in tracer.log.events if e[0] == ALLOC]

    cuda, cpu = allocs(Device.CUDA), allocs(Device.CPU)
    assert cpu.count(524_288) - cuda.count(524_288) == 1  # the noise tensor, gone
    assert cuda.count(131_072) - cpu.count(131_072) == 1  # the mask, instead
    assert F.dropout.__name__ == "dropout"  # the functional name is restored


@pytest.mark.parametrize("dtype,head_dim,arch", [(torch.float32, 6, (8, 0)), (torch.bfloat16, 16, (7, 0))],
                         ids=["fp32-d6-sm80", "bf16-sm70"])
def test_sdpa_math_backend_dropout_on_cuda_keeps_a_bool_mask(dtype, head_dim, arch):
    # SDPA's math backend is chosen on CUDA for fp32 with a head dim the efficient kernel cannot
    # align (6 % 4 != 0 on sm80) and for bf16 below sm80. Its at::dropout(attn, p, true)
    # (attention.cpp _scaled_dot_product_attention_math) is native_dropout on a CUDA tensor.
    # The attention (B, H, L, S) = 2 x 4 x 128 x 128 = 131,072 elements is fp32 in both cases (the
    # math path upcasts bf16 q, k, v): the meta path's noise tensor is 131,072 x 4 B = 524,288 B,
    # the CUDA mask 131,072 x 1 B = 131,072 B; after forward 131,072 x (4 - 1) = 393,216 B less is live.
    def trace(device):
        q = torch.empty(2, 4, 128, head_dim, device="meta", dtype=dtype, requires_grad=True)
        tracer = MemoryTracer(device, arch=arch)
        with tracer:
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)  # noqa: F841
            return tracer, tracer.live_bytes

    (cuda, cuda_live), (cpu, cpu_live) = trace(Device.CUDA), trace(Device.CPU)
    assert f"SDPA on CUDA: math kernel (sm{arch[0]}{arch[1]})" in cuda.log.assumptions
    assert cpu_live - cuda_live == 393_216
    cuda_allocs = [(e[1], e[2]) for e in cuda.log.events if e[0] == ALLOC]
    mask_ids = [sid for sid, n in cuda_allocs if n == 131_072]
    assert len(mask_ids) == 1  # the mask, saved for NativeDropoutBackward
    assert (RECAT, mask_ids[0], Category.ACTIVATION) in [(e[0], e[1], e[3]) for e in cuda.log.events]
    assert 131_072 not in [e[2] for e in cpu.log.events if e[0] == ALLOC]  # the CPU target keeps the noise
    # four fp32 (B, H, L, S) tensors on the CPU path (scores, softmax, noise, scores * noise), three on CUDA
    assert [e[2] for e in cpu.log.events if e[0] == ALLOC].count(524_288) == 4
    assert [n for _, n in cuda_allocs].count(524_288) == 3


class _NoDropout:
    """Stands in for ``torch.ops.aten`` in cuda_attention with dropout left out, so the Python math
    path can be compared with torch's own at dropout_p=0."""

    _safe_softmax = torch.ops.aten._safe_softmax
    mul = torch.ops.aten.mul

    @staticmethod
    def native_dropout(x, p, train):
        return x, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", ["plain", "causal", "float-mask", "bool-mask", "negative-scale", "gqa"])
def test_sdpa_math_path_in_python_runs_the_ops_torch_runs(monkeypatch, dtype, case):
    # memcheck.rules.cuda_attention.math_attention_native_dropout replays attention.cpp's math path to
    # swap its dropout; without the dropout, every op (name, output shapes, dtypes, strides) of its
    # forward and backward is the one F.scaled_dot_product_attention(dropout_p=0) runs on meta.
    from torch.utils._python_dispatch import TorchDispatchMode

    from memcheck.rules import cuda_attention

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.seen.append((func, [(t.shape, t.dtype, t.stride()) for t in outs if isinstance(t, torch.Tensor)]))
            return out

    heads_kv = 2 if case == "gqa" else 4
    mask = {"float-mask": torch.zeros(8, 8, dtype=dtype, device="meta"),
            "bool-mask": torch.ones(2, 1, 8, 8, dtype=torch.bool, device="meta")}.get(case)
    kw = {"attn_mask": mask, "is_causal": case == "causal", "scale": -0.3 if case == "negative-scale" else None,
          "enable_gqa": case == "gqa"}

    def ops(attention):
        q = torch.empty(2, 4, 8, 16, device="meta", dtype=dtype, requires_grad=True)
        k, v = (torch.empty(2, heads_kv, 8, 16, device="meta", dtype=dtype, requires_grad=True) for _ in "kv")
        mode = Ops()
        mode.seen = []
        with mode:
            attention(q, k, v).float().sum().backward()
        return mode.seen

    torch_ops = ops(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, **kw))
    monkeypatch.setattr(cuda_attention, "aten", _NoDropout)
    mine = ops(lambda q, k, v: cuda_attention.math_attention_native_dropout(
        q, k, v, kw["attn_mask"], 0.5, kw["is_causal"], kw["scale"], kw["enable_gqa"]))
    assert mine == torch_ops
