"""CUDA SDPA: the kernel torch would pick, and the memory of that kernel traced on meta.

Expected kernels come from aten/src/ATen/native/transformers/cuda/sdp_utils.cpp;
expected bytes are worked out by hand from the kernels' allocations (flash_api.cpp,
attention_backward.cu, kernel_backward.h), never taken from memcheck's output.
"""

import pytest
import torch
import torch.nn.functional as F

import memcheck
from memcheck.rules.cuda_attention import CUDNN, EFFICIENT, FLASH, MATH, cuda_sdpa_backend, flash_forward_scratch
from memcheck.enums import Category, Device
from memcheck.trace.tracer import ALLOC, FREE, RECAT, MemoryTracer

A100, A10G, L4, T4, H100, RTX5090 = (8, 0), (8, 6), (8, 9), (7, 5), (9, 0), (12, 0)


def qkv(b=2, h=4, lq=128, d=64, dtype=torch.float16, lk=None, hk=None, grad=True):
    q = torch.empty(b, h, lq, d, device="meta", dtype=dtype, requires_grad=grad)
    k = torch.empty(b, hk or h, lk or lq, d, device="meta", dtype=dtype, requires_grad=grad)
    v = torch.empty(b, hk or h, lk or lq, d, device="meta", dtype=dtype, requires_grad=grad)
    return q, k, v


def pick(q, k, v, arch, mask=None, dropout=0.0, causal=False, gqa=False, **versions):
    return cuda_sdpa_backend(q, k, v, mask, dropout, causal, None, gqa, arch, **versions)


# ---- the backend choice ------------------------------------------------------------------


def test_fp16_head_dim_64_runs_flash_on_ampere():
    assert pick(*qkv(), A100) == FLASH
    assert pick(*qkv(), A100, dropout=0.1, causal=True) == FLASH


def test_hopper_prefers_cudnn_with_a_recent_cudnn():
    # check_prefer_cudnn_attention: cuDNN > 9.15.0 on sm9x/sm10x puts cuDNN first.
    assert pick(*qkv(), H100) == CUDNN
    assert pick(*qkv(), (10, 0)) == CUDNN
    # An older cuDNN (CUDA <= 12.9 wheels) leaves the default order: flash first.
    assert pick(*qkv(), H100, cudnn_version=91002) == FLASH
    # Below CUDA 13, only minor versions 0 and 3 prefer cuDNN (sm100, sm103; not sm101).
    assert pick(*qkv(), (10, 1), cuda_version=(12, 9)) == FLASH
    assert pick(*qkv(), RTX5090) == FLASH  # sm120 is not sm9x/sm10x


def test_cudnn_dropout_must_be_a_multiple_of_one_sixteenth():
    # check_cudnn_dropout: 0.1 * 16 = 1.6 is not an integer, 0.125 * 16 = 2 is.
    assert pick(*qkv(), H100, dropout=0.1) == FLASH
    assert pick(*qkv(), H100, dropout=0.125) == CUDNN


def test_fp32_runs_the_memory_efficient_kernel():
    # Flash and cuDNN take fp16/bf16 only; mem-efficient takes fp32 (sm50+).
    assert pick(*qkv(dtype=torch.float32), A100) == EFFICIENT
    assert pick(*qkv(dtype=torch.float32), H100) == EFFICIENT
    assert pick(*qkv(dtype=torch.float32), T4) == EFFICIENT


def test_turing_has_no_flash_and_no_bf16_efficient():
    # Flash needs sm80+ (check_flash_attention_hardware_support).
    assert pick(*qkv(), T4) == EFFICIENT
    # Mem-efficient below sm80 takes fp16/fp32 only, so bf16 on a T4 falls to math.
    assert pick(*qkv(dtype=torch.bfloat16), T4) == MATH
    assert pick(*qkv(dtype=torch.bfloat16), A100) == FLASH


def test_an_arbitrary_mask_rules_out_flash():
    q, k, v = qkv()
    float_mask = torch.empty(128, 128, device="meta", dtype=torch.float16)
    bool_mask = torch.empty(2, 1, 128, 128, device="meta", dtype=torch.bool)
    assert pick(q, k, v, A100, mask=float_mask) == EFFICIENT
    assert pick(q, k, v, A100, mask=bool_mask) == EFFICIENT
    assert pick(q, k, v, H100, mask=bool_mask) == CUDNN  # cuDNN takes (B|1, H|1, L, S) masks


def test_head_dim_limits():
    # Flash: <= 256 (non-multiples of 8 are padded by the composite).
    assert pick(*qkv(d=60), A100) == FLASH
    assert pick(*qkv(d=256), A100) == FLASH
    # Above 256 flash is out; mem-efficient has no upper limit on CUDA (kMaxK 65536
    # kernels) but needs a multiple of 8 for fp16 (minimum_gemm_alignment).
    assert pick(*qkv(d=512), A100) == EFFICIENT
    assert pick(*qkv(d=260), A100) == MATH
    # Training with head dim in (192, 224] has no flash backward on sm86/sm89.
    assert pick(*qkv(d=200), A10G) == EFFICIENT
    assert pick(*qkv(d=200, grad=False), A10G) == FLASH
    assert pick(*qkv(d=200), A100) == FLASH


def test_causal_with_unequal_lengths_is_not_flash():
    # check_flash_causal_non_square_seqlens
    assert pick(*qkv(lq=64, lk=128), A100, causal=True) == EFFICIENT
    assert pick(*qkv(lq=64, lk=128), A100, causal=False) == FLASH


def test_grouped_query_attention():
    q, k, v = qkv(h=8, hk=2)
    assert pick(q, k, v, A100, gqa=True) == FLASH  # flash takes fewer K/V heads natively
    assert pick(q, k, v, A100, gqa=False) == MATH  # unequal heads need enable_gqa
    q, k, v = qkv(h=8, hk=2, dtype=torch.float32)
    assert pick(q, k, v, A100, gqa=True) == MATH  # mem-efficient needs equal heads


def test_three_dimensional_inputs_take_the_math_path():
    q = torch.empty(4, 128, 64, device="meta", dtype=torch.float16)
    assert pick(q, q, q, A100) == MATH


def test_arch_is_validated():
    with pytest.raises(ValueError, match="compute capability"):
        pick(*qkv(), (8,))


# ---- the traced memory -------------------------------------------------------------------


def trace_attention(arch, dtype, b=2, h=4, length=200, d=64, dropout=0.0, sum_output=True):
    """One causal self-attention forward and backward, q/k/v cut from one (B, L, 3, H, D)
    projection as transformers do, so that q.transpose(1, 2) is not dense."""
    x = torch.empty(b, length, 3, h, d, device="meta", dtype=dtype, requires_grad=True)
    tracer = MemoryTracer(Device.CUDA, arch=arch)
    with tracer:
        tracer.watch(batch=x)
        q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        saved = {cat: n for cat, n in saved_by_category(tracer).items()}
        loss = out.sum()
        loss.backward()
        del out, loss
    return tracer, saved


def saved_by_category(tracer):
    totals = {}
    for sid, n in tracer._sizes.items():
        totals[tracer._cats[sid]] = totals.get(tracer._cats[sid], 0) + n
    return totals


def scratch_sizes(tracer):
    return [e[2] for e in tracer.log.events if e[0] == ALLOC and e[1] < 0]


def peak_inside_kernels(tracer):
    """The most bytes live at any scratch allocation, i.e. inside an attention op."""
    live, peak = 0, 0
    for kind, sid, n, *_ in tracer.log.events:
        if kind == ALLOC:
            live += n
            if sid < 0:
                peak = max(peak, live)
        elif kind == FREE:
            live -= n
    return peak


def test_flash_forward_and_backward_bytes():
    # B=2, H=4, L=200, D=64, fp16 on an A100 (flash: fp16, sm80, no mask).
    tracer, saved = trace_attention(A100, torch.float16)
    assert "SDPA on CUDA: flash kernel (sm80)" in tracer.log.assumptions
    bhld = 2 * 4 * 200 * 64 * 2  # 204,800 B: one (B, H, L, D) fp16 tensor
    # Forward: the batch x (B, L, 3, H, D) = 3 * 204,800 = 614,400 B is the input. Flash
    # saves out (B·H·L·D·2 B = 204,800) and logsumexp (B·H·L·4 B = 6,400), plus its
    # rng_state (2 uint64 = 16 B) and the unused offset (8 B). No split-KV scratch: with
    # 2*108 SMs the grid 2*4*ceil(200/64) = 32 blocks has one key block (200 <= 256).
    assert saved == {Category.INPUT: 614_400, Category.ACTIVATION: 204_800 + 6_400 + 16 + 8}
    # Backward: dq, dk, dv (3 * 204,800) are the op's outputs. Inside the op:
    #   grad_out.contiguous(): out.sum()'s gradient is an expanded scalar     204,800
    #   softmax_d:  B·H·round128(L)·4 = 2*4*256*4                               8,192
    #   dq_accum:   B·round128(L)·H·round32(D)·4 = 2*256*4*64*4               524,288
    # out.contiguous() copies nothing: out is (B, L, H, D)-contiguous, as mha_fwd made it.
    assert scratch_sizes(tracer) == [bhld, 8_192, 524_288]
    # Live at that moment: x 614,400 + out 204,800 + lse 6,400 + rng 24 + loss 2 +
    # its gradient 2 + dq/dk/dv 614,400 + scratch 737,280 = 2,177,308 B.
    assert peak_inside_kernels(tracer) == 2_177_308


def test_efficient_forward_and_backward_bytes():
    # B=2, H=4, L=200, D=64, fp32 on an H100: only mem-efficient takes fp32.
    tracer, saved = trace_attention(H100, torch.float32)
    assert "SDPA on CUDA: efficient kernel (sm90)" in tracer.log.assumptions
    bhld = 2 * 4 * 200 * 64 * 4  # 409,600 B
    # Forward saves out (409,600), logsumexp padded to 32 queries (B·H·224·4 = 7,168),
    # seed and offset (int64, 8 B each); the 64x64 kMaxK=64 kernel keeps its output in
    # registers, so no fp32 accumulator.
    assert saved == {Category.INPUT: 3 * bhld, Category.ACTIVATION: bhld + 7_168 + 16}
    # Backward (cutlassB f32/sm80 list, first kernel with kMaxK >= 64: 64x64, kMaxK 64;
    # fp32, so the kernel does not compute delta itself):
    #   phase 1: grad_out.contiguous() 409,600; (grad_out * out) 409,600;
    #            .sum(-1) B·M·H·4 = 6,400; .transpose().contiguous() delta 6,400
    #   phase 2: the copy 409,600 and delta 6,400, plus the workspace: grad_q's
    #            accumulator only (split keys on sm70+; no dK/dV staging for fp32):
    #            ceil(200/64)=4 row blocks * ceil(64/64)=1 column * (16 B + 64*64*4 B)
    #            = 65,600 B per (batch, head), * 8 = 524,800 B.
    assert scratch_sizes(tracer) == [bhld, bhld, 6_400, 6_400, bhld, 6_400, 524_800]
    # At the workspace: x 1,228,800 + out 409,600 + lse 7,168 + seeds 16 + loss 4 +
    # its gradient 4 + grads 1,228,800 + 409,600 + 6,400 + 524,800 = 3,815,192 B.
    assert peak_inside_kernels(tracer) == 3_815_192


def test_flash_pads_head_dims_to_a_multiple_of_eight():
    # D=60: attention.cpp pads q, k and v to 64 before flash (pad_last_dim<8>): three
    # (2, 4, 200, 64) fp16 copies of 204,800 B, and the output is 64 wide.
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        q, k, v = qkv(lq=200, d=60)
        start = len(tracer.log.events)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        sizes = [e[2] for e in tracer.log.events[start:] if e[0] == ALLOC]
    assert out.shape == (2, 4, 200, 60)
    # 3 pads, then out 204,800, logsumexp 6,400, rng_state 16, unused 8, debug mask 0.
    assert sizes == [204_800] * 3 + [204_800, 6_400, 16, 8, 0]


def test_flash_splits_long_keys_when_the_grid_is_small():
    # B=1, H=4, L=2048, D=128 on an A100 (108 SMs, heuristic over 2*108 = 216):
    # 4 heads * 32 query blocks = 128 < 0.8*216; 16 key blocks of 128. Split
    # efficiencies (waves/ceil(waves), waves = 128*n/216): n=3 -> 0.889, best 0.948 at
    # n=8 and 16; the first eligible n >= 0.85*0.948 is 3. Scratch: lse_accum
    # 3*1*4*2048*4 = 98,304 B and out_accum 3*1*4*2048*128*4 = 12,582,912 B.
    assert flash_forward_scratch(1, 4, 2048, 2048, 128, 0.0, A100) == [98_304, 12_582_912]
    assert flash_forward_scratch(1, 4, 2048, 2048, 128, 0.1, A100) == []  # no split with dropout


def test_efficient_pads_and_converts_a_bool_mask():
    # A bool (L, S) = (64, 100) mask for fp16 q (2, 4, 64, 64) on an A100:
    # convert_boolean_attn_mask: a 0-dim fp16 zero (2 B), logical_not (6,400 B bool),
    # where()'s -inf as a 0-dim fp16 tensor (2 B, at::where's Scalar overload), the
    # additive mask 64*100*2 = 12,800 B; preprocess_mask: stride 100 is not a multiple
    # of 8, so pad_bias pads to 104 columns: 64*104*2 = 13,312 B, then expands (a view).
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        q, k, v = qkv(lq=64, lk=100)
        mask = torch.empty(64, 100, device="meta", dtype=torch.bool)
        start = len(tracer.log.events)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        sizes = [e[2] for e in tracer.log.events[start:] if e[0] == ALLOC]
    assert "SDPA on CUDA: efficient kernel (sm80)" in tracer.log.assumptions
    # then out (2*4*64*64*2 = 65,536), logsumexp (2*4*64*4 = 2,048), seed and offset.
    assert sizes[:5] == [2, 6_400, 2, 12_800, 13_312]
    assert sizes[5:] == [65_536, 2_048, 8, 8]


def test_saved_flash_output_keeps_activation_category():
    tracer, _ = trace_attention(A100, torch.float16)
    recats = [e for e in tracer.log.events if e[0] == RECAT and e[3] is Category.ACTIVATION]
    assert len(recats) == 4  # out, logsumexp, rng_state, unused


def test_sdpa_lowers_the_peak_of_a_gpt2_at_fp16():
    from transformers import GPT2Config, GPT2LMHeadModel

    peaks = {}
    for impl in ("sdpa", "eager"):
        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config(n_layer=2, attn_implementation=impl))
        ids = torch.zeros(4, 512, dtype=torch.long)
        est = memcheck.estimate(model, {"input_ids": ids, "labels": ids}, device="cuda", precision="fp16")
        peaks[impl] = est.peak_bytes
        if impl == "sdpa":
            assert any("SDPA on CUDA: flash kernel" in a for a in est.assumptions)
    # Eager attention keeps, per layer, at least the fp16 probabilities that `probs @ v`
    # saves for backward: B·H·L·L·2 = 4*12*512*512*2 = 25,165,824 B; flash keeps instead
    # a logsumexp, B·H·L·4 = 98,304 B (its output replaces eager's matmul output).
    # Both are live at the peak (in backward), so over 2 layers:
    assert peaks["eager"] - peaks["sdpa"] >= 2 * (25_165_824 - 98_304)


def test_cudnn_backward_approximates_its_workspace():
    # fp16 on an H100 with the assumed cuDNN 9.15.1: cuDNN runs. B=2, H=4, L=200, D=64.
    tracer, saved = trace_attention(H100, torch.float16)
    assert "SDPA on CUDA: cudnn kernel (sm90)" in tracer.log.assumptions
    # Forward saves out (204,800), logsumexp (B, H, L, 1) fp32 = 6,400, seed and offset 16.
    assert saved[Category.ACTIVATION] == 204_800 + 6_400 + 16
    # Backward: out.sum()'s gradient has last stride 0, so MHA.cpp re-lays it out (204,800);
    # the workspace stand-in: dQ accumulator 2*4*200*64*4 = 409,600 and sums 2*4*200*4 = 6,400.
    assert scratch_sizes(tracer) == [204_800, 409_600, 6_400]
    assert any("cuDNN SDPA backward workspace" in a for a in tracer.log.assumptions)


def test_flash_backward_with_grouped_query_attention():
    # q (2, 8, 128, 64), k/v (2, 2, 128, 64) fp16 leaves on an A100, enable_gqa=True.
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        q, k, v = qkv(h=8, hk=2)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        out.sum().backward()
    assert "SDPA on CUDA: flash kernel (sm80)" in tracer.log.assumptions
    assert k.grad.shape == (2, 2, 128, 64)
    bhld = 2 * 8 * 128 * 64 * 2  # 262,144 B
    # grad_out.contiguous() (an expanded scalar) 262,144; out.contiguous(): q is a
    # contiguous (B, H, L, D) leaf, so mha_fwd's out kept that layout and its (B, L, H, D)
    # view is not contiguous: 262,144; softmax_d 2*8*128*4 = 8,192; dq_accum
    # 2*128*8*64*4 = 524,288; dk_expanded and dv_expanded (B, L_k, H, D) fp16, 262,144 each.
    assert scratch_sizes(tracer) == [bhld, bhld, 8_192, 524_288, bhld, bhld]


def test_efficient_forward_accumulates_wide_heads_in_fp32():
    # fp16, head dim 264 (> 256: no flash; a multiple of 8: mem-efficient). Above 128 the
    # forward kernel is 32x128 kMaxK=65536, which keeps an fp32 output_accum (B, M, H, Kv):
    # 1*64*2*264*4 = 135,168 B.
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        q, k, v = qkv(b=1, h=2, lq=64, d=264)
        F.scaled_dot_product_attention(q, k, v)
    assert "SDPA on CUDA: efficient kernel (sm80)" in tracer.log.assumptions
    assert scratch_sizes(tracer) == [135_168]
