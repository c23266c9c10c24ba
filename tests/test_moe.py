"""Mixture-of-experts models (issue 18): the experts' grouped GEMM (memcheck.rules.grouped_mm)
and the routing stand-ins (memcheck.rules.data_dependent), against real CPU runs.

Each family is the real transformers architecture built from its config class at a tiny
size (hidden 64, 2 layers, 4 experts, top-2, vocabulary 128), one batch of 2 x 64 tokens,
AdamW; the oracle is ``measure_cpu``'s allocator peak over a real two-step run, as in
tests/test_accuracy_cpu.py.

Families not tested here, and why:

* Jamba: its MoE layers trace exactly (``test_jamba_moe_layers_match_a_real_cpu_run``
  builds it with attention in every layer), but its Mamba layers' PyTorch path (used
  without the mamba-ssm kernels) is estimated 8.5% high with or without experts: not a
  MoE cause, left to its own issue.
"""

import pytest
import torch

import memcheck
from memcheck.enums import Task
from memcheck.measure.local import measure_cpu
from memcheck.rules.grouped_mm import grouped_mm_output
from memcheck.rules.probe import cpu_memory_events
from memcheck.trace.tracer import MemoryTracer
from memcheck.training.loop import default_loss
from memcheck.workloads import hf

TOLERANCE = 0.02  # as tests/test_accuracy_cpu.py
LLAMA_LIKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _causal(config):
    device = torch.get_default_device()
    model = hf.build_model(config, Task.CAUSAL_LM, device=device)
    return model, hf.make_batch(model, config, Task.CAUSAL_LM, 2, 64, None, device=device)


def mixtral():
    from transformers import MixtralConfig

    return _causal(MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2))


def qwen2_moe():
    from transformers import Qwen2MoeConfig

    return _causal(Qwen2MoeConfig(**LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64))


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    return _causal(Qwen3MoeConfig(**LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  head_dim=16))


def deepseek_v3():
    from transformers import DeepseekV3Config

    return _causal(DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
    ))


def gpt_oss():
    from transformers import GptOssConfig

    return _causal(GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"],
    ))


def jamba_all_attention():
    """Jamba's MoE block with attention in every layer (``attn_layer_period=1``): no Mamba layer."""
    from transformers import JambaConfig

    return _causal(JambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=1, attn_layer_offset=0, max_position_embeddings=256,
    ))


GROUPED_MM_FAMILIES = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}


def _measure(builder):
    def build():
        torch.manual_seed(0)
        return builder()

    return measure_cpu(build, lambda p: torch.optim.AdamW(p), loss_fn=default_loss, steps=2)


def _estimate(builder, **options):
    with torch.device("meta"):
        model, batch = builder()
    return memcheck.estimate(model, batch, device="cpu", optimizer="adamw", **options)


def _error(builder):
    measured = _measure(builder).steady_peak_bytes
    est = _estimate(builder)
    return est, measured, (est.peak_bytes - measured) / measured


# ---- the grouped GEMM -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 40, 36])
def test_grouped_mm_traces_the_real_kernels_output_in_every_dtype(dtype, n):
    # The forward (2-D x 3-D), the weight gradient (2-D x 2-D) and the input gradient: the
    # meta output has the real CPU output's shape, strides (a row padded to 16 B) and dtype,
    # and where the real kernel refuses the strides (a 36-element bf16 row is 72 B), so does the trace.
    rows, k, experts = 48, 32, 4
    cpu = {"x": torch.randn(rows, k, dtype=dtype), "w": torch.randn(experts, n, k, dtype=dtype).transpose(-2, -1),
           "g": torch.randn(rows, n, dtype=dtype), "offs": torch.tensor([8, 8, 30, rows], dtype=torch.int32)}
    meta = {name: t.to("meta") for name, t in cpu.items()}
    calls = {
        "forward": lambda d: torch._grouped_mm(d["x"], d["w"], offs=d["offs"]),
        "weight gradient": lambda d: torch._grouped_mm(d["g"].t(), d["x"], offs=d["offs"]),
        "input gradient": lambda d: torch._grouped_mm(d["g"], d["w"].transpose(-2, -1), offs=d["offs"]),
    }
    for name, call in calls.items():
        try:
            real = call(cpu)
        except RuntimeError:
            with MemoryTracer("cpu"), pytest.raises(RuntimeError):
                call(meta)
            continue
        with MemoryTracer("cpu"):
            traced = call(meta)
        assert (traced.shape, traced.stride(), traced.dtype) == (real.shape, real.stride(), real.dtype), name
        assert traced.untyped_storage().nbytes() == real.untyped_storage().nbytes(), name


def test_grouped_mm_output_is_what_the_cpu_allocator_allocates():
    # float32, N = 36: a row of 144 B, a multiple of 16, is not padded: (48, 36) * 4 B = 6,912 B;
    # N = 34 pads the row to 36 elements: (47 * 36 + 34) * 4 B = 6,904 B.
    for n, expected in ((36, 48 * 36 * 4), (34, (47 * 36 + 34) * 4)):
        x, w = torch.randn(48, 32), torch.randn(4, n, 32).transpose(-2, -1)  # as transformers passes it
        offs = torch.tensor([8, 8, 30, 48], dtype=torch.int32)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            out = torch._grouped_mm(x, w, offs=offs)
            del out
        allocated = [n for _, n in cpu_memory_events(prof.profiler.kineto_results.events()) if n > 0]
        assert allocated == [expected]
        assert grouped_mm_output((48, n), torch.float32).untyped_storage().nbytes() == expected


def test_grouped_mm_refuses_what_the_real_kernel_refuses():
    x = torch.empty(48, 30, device="meta")  # a row of 120 B: not 16-byte aligned
    w = torch.empty(4, 30, 64, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    with MemoryTracer("cpu"), pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(x, w, offs=offs)
    with MemoryTracer("cpu"), pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        torch._grouped_mm(x.double()[:, :16], w.double()[:, :16], offs=offs)


# ---- whole models against real CPU runs -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(GROUPED_MM_FAMILIES))
def test_moe_family_matches_a_real_cpu_run_within_2_percent(family):
    est, measured, error = _error(GROUPED_MM_FAMILIES[family])
    assert abs(error) <= TOLERANCE, f"{family}: estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"


@pytest.mark.slow
def test_jamba_moe_layers_match_a_real_cpu_run():
    est, measured, error = _error(jamba_all_attention)
    assert abs(error) <= TOLERANCE, f"estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
