"""Expert parallelism (issue 21): ``memcheck.training.strategies.ep`` against real two-rank gloo runs.

torch has no expert-parallel module, so the real run is memcheck's own small EP layer
(``ep.ExpertParallelDispatch``, written after torchtitan's ``ExpertParallel``) with real
``all_to_all_single`` exchanges, on a real transformers Mixtral (hidden 64, 2 layers, 4 experts,
top-2, vocabulary 128), batch 2 x 32 per rank, AdamW; the oracle is each rank's allocator
(``measure_ep_cpu``: profiler allocation events, process-wide). The estimate traces the same
model on meta with ``shard_experts`` applied. The router is pinned for real to the split the
estimate assumes, as in tests/test_moe.py.
"""

import pytest
import torch

import memcheck
from memcheck.enums import Task
from memcheck.errors import UsageError
from memcheck.measure.distributed import measure_ep_cpu
from memcheck.rules.expert_parallel import EP_BALANCED, EP_WORST, assumed_splits
from memcheck.training.loop import default_loss
from memcheck.training.strategies.ep import shard_experts
from memcheck.workloads import hf

TOLERANCE = 0.02
EXPERTS, TOP_K, BATCH, SEQ = 4, 2, 2, 32


def _mixtral(layers=2):
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    device = torch.get_default_device()
    model = hf.build_model(config, Task.CAUSAL_LM, device=device)
    return model, hf.make_batch(model, config, Task.CAUSAL_LM, BATCH, SEQ, None, device=device)


class _BalancedRouter:
    """Token i to experts i mod 4 and i+1 mod 4: 16 of each rank's 64 x 2 picks per expert."""

    def __init__(self, router):
        self.router = router

    def __call__(self, hidden):
        logits, scores, index = self.router(hidden)
        tokens = torch.arange(index.shape[0])
        return logits, scores, torch.stack([tokens % EXPERTS, (tokens + 1) % EXPERTS], dim=-1)


def build_balanced():  # module level: the spawned ranks unpickle it
    torch.manual_seed(0)
    model, batch = _mixtral()
    for layer in model.model.layers:
        layer.mlp.gate.forward = _BalancedRouter(layer.mlp.gate.forward)
    return model, batch


def adamw(params):
    return torch.optim.AdamW(params)


def _estimate(assume):
    # with the ranks' one thread (measure.distributed): CPU kernels' per-thread buffers follow it
    with torch.device("meta"):
        model, batch = _mixtral()
    shard_experts(model, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return memcheck.estimate(model, batch, device="cpu", optimizer="adamw", loss_fn=default_loss, assume=assume)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_ep_balanced_estimate_matches_each_measured_rank():
    ranks = measure_ep_cpu(build_balanced, adamw, loss_fn=default_loss, world_size=2, steps=2)
    est = _estimate("routing=balanced")
    assert EP_BALANCED in est.assumptions
    for rank, measured in enumerate(ranks):
        error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
        assert abs(error) <= TOLERANCE, (
            f"rank {rank}: estimated {est.peak_bytes} B, measured {measured.steady_peak_bytes} B ({error:+.2%})")


def test_assumed_splits_by_hand():
    # 64 tokens x top-2 on a rank, 4 experts on 2 ranks (2 each).
    # balanced: 128 / 4 = 32 picks per expert, so 64 to each rank, and 64 from each rank.
    assert assumed_splits(64, 2, 4, 2, balanced=True) == ([64, 64], [64, 64])
    # worst: experts 0 and 1 (both on rank 0) take every token: rank 0 sends 2 x 64 to itself,
    # and receives 64 x min(2, 2) = 128 from each of the 2 ranks, 256 rows in all.
    assert assumed_splits(64, 2, 4, 2, balanced=False) == ([128, 0], [128, 128])
    # top-2 of 8 experts on 4 ranks (2 each): 10 tokens; worst: experts 0, 1 on rank 0.
    assert assumed_splits(10, 2, 8, 4, balanced=False) == ([20, 0, 0, 0], [20, 20, 20, 20])
    # top-4 of 8 on 4 ranks: experts 0-3 span ranks 0 and 1; rank 0 receives min(4, 2) x 10 from each.
    assert assumed_splits(10, 4, 8, 4, balanced=False) == ([20, 20, 0, 0], [20, 20, 20, 20])
    # balanced with a remainder: 5 tokens x 2 = 10 picks over 4 experts: 3, 3, 2, 2.
    assert assumed_splits(5, 2, 4, 2, balanced=True) == ([6, 4], [6, 6])


def test_shard_experts_keeps_a_quarter_of_the_expert_weights_by_hand():
    # Mixtral experts: gate_up_proj (4, 2 x 128, 64) and down_proj (4, 64, 128) per layer;
    # ep=4 keeps one expert: (1, 256, 64) and (1, 64, 128). The router keeps all 4 rows.
    with torch.device("meta"):
        model, _ = _mixtral()
    shard_experts(model, 4, rank=3)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (1, 256, 64) and experts.down_proj.shape == (1, 64, 128)
    assert experts.num_experts == 1 and model.model.layers[0].mlp.gate.weight.shape == (4, 64)


def test_ep_worst_routing_adds_the_received_rows_by_hand():
    # The worst split sends rank 0 256 received rows where the balanced one sends 128.
    # Each of those rows is 64 float32 (256 B): the received buffer alone grows by 128 x 256 B
    # = 32 KiB per layer; the estimate under routing=worst must exceed the balanced one by at least that.
    worst, balanced = _estimate("routing=worst"), _estimate("routing=balanced")
    assert EP_WORST in worst.assumptions
    assert worst.peak_bytes - balanced.peak_bytes >= 128 * 64 * 4


def test_ep_errors_name_the_value():
    with torch.device("meta"):
        model, _ = _mixtral(layers=1)
    with pytest.raises(UsageError, match=r"ep=3 does not divide the 4 experts"):
        shard_experts(model, 3)
    with pytest.raises(UsageError, match=r"ep must be a positive integer, got 0"):
        shard_experts(model, 0)
    with torch.device("meta"):
        dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(UsageError, match=r"ep=2 needs a mixture-of-experts model; Sequential has no experts"):
        shard_experts(dense, 2)


def test_shard_experts_on_qwen3_moe_and_olmoe_by_hand():
    # 8 experts over ep=4: 2 per rank; Qwen3-MoE gate_up_proj (8, 2 x 32, 64) -> (2, 64, 64),
    # OLMoE (8, 2 x 32, 64) -> (2, 64, 64); rank 1 keeps experts 2 and 3.
    from transformers import OlmoeConfig, Qwen3MoeConfig

    configs = (Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, head_dim=16),
               OlmoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                           eos_token_id=1, pad_token_id=0))
    for config in configs:
        model = hf.build_model(config, Task.CAUSAL_LM, device=torch.device("cpu"))
        experts = model.model.layers[0].mlp.experts
        full = experts.gate_up_proj.detach().clone()
        shard_experts(model, 4, rank=1)
        assert experts.gate_up_proj.shape == (2, 64, 64) and experts.down_proj.shape == (2, 64, 32)
        assert torch.equal(experts.gate_up_proj, full[2:4]) and experts.num_experts == 2
