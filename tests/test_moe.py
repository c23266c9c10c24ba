"""Mixture-of-experts models (issue 18): the experts' grouped GEMM (memcheck.rules.grouped_mm),
the routing stand-ins (memcheck.rules.data_dependent) and the engine's in-place gradient
accumulation (memcheck.rules.autograd), against real CPU runs.

Each family is the real transformers architecture built from its config class at a tiny
size (hidden 64, 2 layers, 4 experts, top-2, vocabulary 128), one batch of 2 x 64 tokens,
AdamW; the oracle is ``measure_cpu``'s allocator peak over a real two-step run, as in
tests/test_accuracy_cpu.py. transformers' default experts implementation, ``grouped_mm``,
has no data-dependent shape: those estimates match to the byte whatever the routing.

The ``eager`` experts implementation (a loop over the experts) depends on the routing
split, which memcheck assumes (``ROUTING_ASSUMPTION``). Against a real run whose random
router spreads the tokens over the experts, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 still
match to the byte (their peak is elsewhere), but Mixtral is 6.1% and gpt-oss 3.9% high:
the assumed split is the worst one, not the router's. They are tested where a real run
routes as memcheck assumes (``test_eager_experts_loop_matches_a_real_run_routed_as_assumed``).
"""

import pytest
import torch

import memcheck
from memcheck.enums import Task
from memcheck.measure.local import measure_cpu
from memcheck.rules.data_dependent import ROUTING_ASSUMPTION
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


def jamba():
    """An attention layer, then a Mamba layer with experts (the PyTorch scan: no mamba-ssm kernels)."""
    from transformers import JambaConfig

    return _causal(JambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0, mamba_d_state=8, mamba_expand=2,
        max_position_embeddings=256,
    ))


def switch_transformers():
    """Top-1 routing through a loop over expert modules: the routing stand-ins, not grouped_mm."""
    from transformers import SwitchTransformersConfig

    config = SwitchTransformersConfig(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=64, decoder_start_token_id=0, encoder_sparse_step=1, decoder_sparse_step=1,
    )
    device = torch.get_default_device()
    model = hf.build_model(config, Task.SEQ2SEQ, device=device)
    return model, hf.make_batch(model, config, Task.SEQ2SEQ, 2, 64, 16, device=device)


GROUPED_MM_FAMILIES = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss, "jamba": jamba,
}


def eager(builder):
    """``builder``'s model with transformers' ``eager`` experts implementation: a loop over the experts."""

    def build():
        model, batch = builder()
        model.set_experts_implementation("eager")
        return model, batch

    return build


EAGER_FAMILIES = {"qwen2_moe": eager(qwen2_moe), "qwen3_moe": eager(qwen3_moe), "deepseek_v3": eager(deepseek_v3)}


def _measure(builder, precision="fp32"):
    """A real CPU run: ``precision`` "bf16" casts the weights, "amp-bf16" runs under CPU autocast."""

    def build():
        torch.manual_seed(0)
        model, batch = builder()
        return (model.to(torch.bfloat16) if precision == "bf16" else model), batch

    autocast = torch.bfloat16 if precision == "amp-bf16" else None
    return measure_cpu(build, lambda p: torch.optim.AdamW(p), loss_fn=default_loss, steps=2, autocast_dtype=autocast)


def _estimate(builder, **options):
    with torch.device("meta"):
        model, batch = builder()
    return memcheck.estimate(model, batch, device="cpu", optimizer="adamw", **options)


def _error(builder, precision="fp32"):
    measured = _measure(builder, precision).steady_peak_bytes
    est = _estimate(builder, precision=precision)
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


@pytest.mark.slow
def test_an_hf_moe_config_is_estimated_from_the_command_line(tmp_path):
    # hf:DIR builds the model from config.json alone: Mixtral's experts run grouped_mm.
    from click.testing import CliRunner
    from transformers import MixtralConfig

    from memcheck.cli import main

    MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2,
                  architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    result = CliRunner().invoke(main, ["estimate", f"hf:{tmp_path}", "--device", "cpu", "--batch-size", "2",
                                       "--max-len", "64"])
    assert result.exit_code == 0, result.output
    assert "MixtralForCausalLM" in result.output and "mlp.experts" in result.output


# ---- routing -----------------------------------------------------------------------------


def _route(tokens, experts, k):
    """The routing of transformers' eager experts loop (MixtralExperts.forward): each expert's
    (top-k slot, token) pairs from a one-hot mask of the top-k indices."""
    logits = torch.randn(tokens, experts)
    _, index = torch.topk(logits.softmax(-1), k, dim=-1)
    mask = torch.nn.functional.one_hot(index, num_classes=experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    return [(int(e[0]), torch.where(mask[e[0]])[1].shape[0]) for e in hit]


def test_routing_sends_tokens_times_top_k_rows_to_the_experts_each_at_most_every_token():
    # 100 tokens, top-2 of 8 experts: 200 (slot, token) pairs in all, at most 100 per expert
    # (each token picks an expert once); memcheck gives them to the first experts looped over.
    tracer = MemoryTracer("cpu")
    with tracer, torch.device("meta"):
        routed = _route(100, 8, 2)
    assert routed == [(0, 100), (1, 100), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0)]
    assert ROUTING_ASSUMPTION in tracer.log.assumptions
    # A real run of the same code: the same total, split by the router.
    real = _route(100, 8, 2)
    assert sum(n for _, n in real) == 200 and all(n <= 100 for _, n in real)


def test_a_one_hot_mask_selects_one_element_per_index_even_without_top_k():
    # Switch Transformers' top-1: one_hot(argmax) of 2 x 64 tokens, 4 experts: 128 rows in all.
    with MemoryTracer("cpu"), torch.device("meta"):
        mask = torch.nn.functional.one_hot(torch.randn(2, 64, 4).argmax(-1), num_classes=4)
        mask = (mask * (torch.cumsum(mask, dim=-2) <= 64)).view(-1, 1, 4).permute(2, 1, 0)
        rows = [torch.where(mask[e].squeeze(0))[0].shape[0] for e in range(4)]
    assert rows == [128, 0, 0, 0]


def test_indices_read_from_nonzero_are_the_positions_of_every_element():
    # `for i in hit.nonzero(): experts[f"expert_{i[0]}"]` visits every expert once, and
    # `if i == num_experts: continue` skips the padding class, as in a real run where all are hit.
    with MemoryTracer("cpu"), torch.device("meta"):
        hit = torch.greater(torch.ones(5, 3).sum(-1), 0).nonzero()
        read = [int(i[0]) for i in hit]
        skipped = [bool(i[0] == 4) for i in hit]
        grid = [tuple(int(v) for v in row) for row in torch.ones(2, 3).nonzero()]
    assert read == [0, 1, 2, 3, 4]
    assert skipped == [False, False, False, False, True]
    assert grid == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


# ---- whole models against real CPU runs -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(GROUPED_MM_FAMILIES))
def test_moe_family_matches_a_real_cpu_run_within_2_percent(family):
    est, measured, error = _error(GROUPED_MM_FAMILIES[family])
    assert abs(error) <= TOLERANCE, f"{family}: estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"


@pytest.mark.slow
def test_switch_transformers_matches_a_real_cpu_run_and_says_how_it_routed():
    # The real run's router (random weights) hits every expert; memcheck assumes every
    # expert hit and the tokens sent to the first ones (ROUTING_ASSUMPTION). Before the
    # routing stand-ins every token went to every expert: +5.9% here.
    est, measured, error = _error(switch_transformers)
    assert abs(error) <= TOLERANCE, f"estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
    assert ROUTING_ASSUMPTION in est.assumptions


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
@pytest.mark.parametrize("family", sorted(GROUPED_MM_FAMILIES))
def test_moe_family_in_bf16_matches_a_real_cpu_run(family, precision):
    # bf16 weights run the grouped GEMM in bf16 (its meta kernel's only dtype, and oneDNN's
    # per-group packing buffers on CPU, not modelled and not at these peaks); under autocast
    # transformers casts the input to the float32 weights first.
    est, measured, error = _error(GROUPED_MM_FAMILIES[family], precision)
    assert abs(error) <= TOLERANCE, (
        f"{family} {precision}: estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(EAGER_FAMILIES))
def test_eager_experts_implementation_matches_a_real_cpu_run(family):
    est, measured, error = _error(EAGER_FAMILIES[family])
    assert abs(error) <= TOLERANCE, f"{family}: estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
    assert ROUTING_ASSUMPTION in est.assumptions


def _mixtral_block(tokens_to_first_experts: bool):
    """Mixtral's sparse MoE block, eager loop, 4 experts, top-2, 128 tokens. With
    ``tokens_to_first_experts`` (a real run only) the router's choice is replaced by what
    memcheck assumes: every expert hit, all tokens but one on experts 0 and 1."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    if tokens_to_first_experts:
        router = block.gate.forward

        def routed(hidden):
            logits, scores, index = router(hidden)
            index = torch.tensor([0, 1]).expand_as(index).contiguous()
            index[-1] = torch.tensor([2, 3])
            return logits, scores, index

        block.gate.forward = routed
    return block, torch.randn(2, 64, 64)


@pytest.mark.slow
def test_eager_experts_loop_matches_a_real_run_routed_as_assumed():
    # The real block: 127 tokens on experts 0 and 1, one on 2 and 3 (all four hit); memcheck:
    # 128 on 0 and 1, none on 2 and 3. Every expert's gradient is a full (4, 256, 64) buffer
    # summed in place (memcheck.rules.autograd).
    loss = lambda block, x: block(x).pow(2).sum()  # noqa: E731
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    measured = measure_cpu(lambda: _mixtral_block(True), sgd, loss_fn=loss, steps=2).steady_peak_bytes
    with torch.device("meta"):
        block, x = _mixtral_block(False)
    est = memcheck.estimate(block, x, device="cpu", optimizer="sgd", loss_fn=loss)
    error = (est.peak_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, f"estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
