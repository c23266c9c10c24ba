"""ViT-L/16 built from nn.MultiheadAttention (torchvision's layout, examples/vit_l16.py) on the
CUDA target: every block's attention takes a fused kernel and every dropout keeps a one-byte
mask, as a GPU run does (issue 16). Bytes worked out by hand from the model's shapes."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memcheck.enums import ALLOC, FREE, Category, Device
from memcheck.rules import registry
from memcheck.trace.tracer import MemoryTracer

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import vit_l16

B, H, T, D, MLP, LAYERS = 2, 16, 197, 1024, 4096, 24  # ViT-L/16 at 224 x 224: 14 x 14 patches + 1 class token
SCORES_FP32 = B * H * T * T * 4  # the math path's (B, H, T, T) fp32 scores: 2 x 16 x 197 x 197 x 4 = 4,967,552 B
SCORE_MASK = B * H * T * T * 1  # a bool dropout mask over them: 1,241,888 B
MASK_HIDDEN = B * T * D * 1  # a bool mask over (B, T, 1024): 2 x 197 x 1024 = 403,456 B


def _trace(dropout, without=()):
    """ALLOC sizes and assumptions of one ViT-L/16 training step traced for CUDA (A100 by default,
    sm80), fp32, with the function rules in ``without`` removed for the trace."""
    with torch.device("meta"):
        model = vit_l16.VisionTransformer(dropout=dropout, attention_dropout=dropout)
        images, labels = torch.empty(B, 3, 224, 224), torch.zeros(B, dtype=torch.long)
    rules = {f: registry.FUNCTION_RULES.pop(f) for f in without}
    try:
        tracer = MemoryTracer(Device.CUDA)
        with tracer:
            F.cross_entropy(model(images), labels).backward()
    finally:
        registry.FUNCTION_RULES.update(rules)
    return [e[2] for e in tracer.log.events if e[0] == ALLOC], tracer.log.assumptions


@pytest.mark.slow
def test_vit_l16_attention_never_allocates_the_score_matrices_on_cuda():
    fused, assumed = _trace(0.0)
    math, _ = _trace(0.0, without=(F.multi_head_attention_forward,))
    assert SCORES_FP32 not in fused
    # the math path (traced before the MHA rule) allocated at least the scores and softmax per layer
    assert math.count(SCORES_FP32) >= 2 * LAYERS
    # fp32 inputs on sm80: flash needs fp16/bf16, so the memory-efficient kernel runs
    # (memcheck.rules.cuda_attention's priority list, sdp_utils.cpp)
    assert "SDPA on CUDA: efficient kernel (sm80)" in assumed


@pytest.mark.slow
def test_vit_l16_dropout_keeps_one_byte_masks_on_cuda():
    fused, _ = _trace(0.1)
    # native_dropout's bool masks (Dropout.cpp:139) over (B, T, 1024): the embedding dropout and,
    # per block, the attention output's and the MLP's second dropout: 1 + 2 x 24 = 49. (The MLP's
    # first dropout, over (B, T, 4096), has a mask of 1,613,824 B, the size of an fp32 (B, T, 1024)
    # tensor, so it is counted in the next test's bytes instead.)
    assert fused.count(MASK_HIDDEN) == 1 + 2 * LAYERS
    # attention dropout runs inside the efficient kernel from a Philox seed and offset: no mask
    # over the scores and no scores at all
    assert SCORE_MASK not in fused and SCORES_FP32 not in fused


def _saved_after_forward(without=()):
    """Bytes of tensors saved for backward (category ACTIVATION) live when ViT-L/16's forward and
    loss end, with dropout 0.1 everywhere, traced for CUDA with the rules in ``without`` removed."""
    with torch.device("meta"):
        model = vit_l16.VisionTransformer(dropout=0.1, attention_dropout=0.1)
        images, labels = torch.empty(B, 3, 224, 224), torch.zeros(B, dtype=torch.long)
    rules = {f: registry.FUNCTION_RULES.pop(f) for f in without}
    try:
        tracer = MemoryTracer(Device.CUDA)
        with tracer:
            loss = F.cross_entropy(model(images), labels)
            live = {}
            for kind, sid, n, category, *_ in tracer.log.events:
                if kind == ALLOC:
                    live[sid] = [n, category]
                elif kind == FREE:
                    live.pop(sid, None)
                elif sid in live:  # RECAT
                    live[sid][1] = category
            loss.backward()
    finally:
        registry.FUNCTION_RULES.update(rules)
    return sum(n for n, category in live.values() if category is Category.ACTIVATION)


@pytest.mark.slow
def test_vit_l16_dropout_saves_three_bytes_an_element_less_than_the_cpu_path():
    # The CPU decomposition keeps fp32 noise (4 B an element) for backward where CUDA keeps a bool
    # mask (1 B): 3 B an element less per dropout, all saved when the forward ends:
    #   49 dropouts over (2, 197, 1024) = 403,456 elements: 49 x 403,456 x 3 = 59,308,032 B
    #   24 dropouts over (2, 197, 4096) = 1,613,824 elements: 24 x 1,613,824 x 3 = 116,195,328 B
    #   total 175,503,360 B
    assert _saved_after_forward(without=(F.dropout, torch.dropout)) - _saved_after_forward() == 175_503_360
