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
