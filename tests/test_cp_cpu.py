"""Context parallelism (issue 21): ``memcheck.training.strategies.cp`` against real two-rank gloo runs.

The real run is torch's own ``context_parallel`` (buffers sharded and load-balanced in place,
SDPA patched, torch's ring attention and its backward over gloo), with one addition it needs on
CPU: torch 2.13's CP knows only the CUDA attention kernels, so the ranks register the CPU
flash kernel with it (``memcheck.measure.distributed._register_cpu_flash_with_cp``). The model
is a real transformers Llama (hidden 64, 2 layers, 4 heads, no grouped-query heads,
vocabulary 128), batch 2 x 64 tokens, 32 per rank; the oracle is each rank's allocator. The
estimate traces that rank's batch with ``cp_attention`` (torch's ring mirrored on meta).
"""

import pytest
import torch

import memcheck
from memcheck.enums import Task
from memcheck.errors import UsageError
from memcheck.measure.distributed import measure_cp_cpu
from memcheck.enums import ALLOC, FREE
from memcheck.trace.tracer import MemoryTracer
from memcheck.training.loop import default_loss
from memcheck.training.strategies.cp import cp_attention, load_balanced, shard_sequence
from memcheck.workloads import hf

TOLERANCE = 0.02
SEQ, CP = 64, 2


def build():  # module level: the spawned ranks unpickle it
    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = hf.build_model(config, Task.CAUSAL_LM, device=torch.get_default_device())
    ids = torch.randint(0, 128, (2, SEQ))
    return model, {"input_ids": ids, "labels": ids.clone()}


def adamw(params):
    return torch.optim.AdamW(params)


def _estimate(rank):
    # The ranks run one thread each (measure.distributed): the CPU flash kernels' per-thread buffers
    # follow torch.get_num_threads(), so the estimate is made with one too.
    with torch.device("meta"):
        model, batch = build()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with cp_attention(CP, seq_len=SEQ, rank=rank):
            return memcheck.estimate(model, shard_sequence(batch, CP), device="cpu", optimizer="adamw",
                                     loss_fn=default_loss)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_cp_estimate_matches_each_measured_rank():
    ranks = measure_cp_cpu(build, adamw, loss_fn=default_loss, world_size=CP, steps=2)
    for rank, measured in enumerate(ranks):
        est = _estimate(rank)
        error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
        assert abs(error) <= TOLERANCE, (
            f"rank {rank}: estimated {est.peak_bytes} B, measured {measured.steady_peak_bytes} B ({error:+.2%})")


def test_shard_sequence_cuts_the_sequence_and_names_both_values():
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "labels": torch.zeros(2, 64, dtype=torch.long),
             "pixel": torch.zeros(2, 3)}
    local = shard_sequence(batch, 4)
    assert local["input_ids"].shape == (2, 16) and local["labels"].shape == (2, 16) and local["pixel"].shape == (2, 3)
    with pytest.raises(UsageError, match=r"cp=3 does not divide the sequence length 64"):
        shard_sequence(batch, 3)
    with pytest.raises(UsageError, match=r"cp must be a positive integer, got 0"):
        shard_sequence(batch, 0)
    # torch load-balances only when 2C divides S (_create_default_load_balancer)
    assert load_balanced(64, 4) and not load_balanced(36, 4)


def _forward_allocations(rank, degree, rotate, seq=64):
    """The sizes allocated by one causal CP attention forward, in order."""
    q, k, v = (torch.empty(1, 2, seq // degree, 8, device="meta", requires_grad=True) for _ in range(3))
    tracer = MemoryTracer("cpu")
    with tracer, cp_attention(degree, seq_len=seq, rank=rank, rotate=rotate):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return [event[2] for event in tracer.log.events if event[0] == ALLOC]


def test_all_gather_holds_every_ranks_keys_and_values_by_hand():
    # One rank's k and v: 1 x 2 heads x 16 tokens x 8 x 4 B = 1 KiB each; their cat, 2 KiB. With 4
    # ranks the all-gather (torch's default rotate method) receives 4 x 2 KiB = 8 KiB at once; the
    # all-to-all ring receives one 2 KiB chunk per step (3 steps) and never allocates 8 KiB.
    gather = _forward_allocations(0, 4, "allgather")
    ring = _forward_allocations(0, 4, "alltoall")
    assert gather.count(8 * 1024) == 1 and 8 * 1024 not in ring
    assert ring.count(2 * 1024) >= 3 + 3  # 3 cats sent (steps 0-2) and 3 chunks received


def test_cp_refuses_a_mask_and_a_bad_rank():
    q = torch.empty(1, 2, 16, 8, device="meta")
    with cp_attention(2, seq_len=32), pytest.raises(UsageError, match="no mask"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16, device="meta"))
    with pytest.raises(UsageError, match=r"rank must be an integer from 0 to cp - 1 = 1, got 2"):
        with cp_attention(2, seq_len=32, rank=2):
            pass


def test_cpu_flash_backward_copies_grad_out_only_when_its_transpose_is_not_contiguous():
    # Found through CP (the ring passes transformers' grad_out on as it is): the CPU kernel works on
    # grad_out.transpose(1, 2) and copies it only when that is not contiguous. (2, 4, 32, 16) float32:
    # dq, dk, dv 16,384 B each; the copy 16,384 B; the per-thread buffer 2 x 32 x 32 x 4 = 8,192 B;
    # dsum 32 x 4 = 128 B. Real allocations from the profiler, traced ones from the tracer.
    from torch.profiler import ProfilerActivity, profile

    from memcheck.rules.probe import cpu_memory_events

    aten = torch.ops.aten
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        layouts = {"bhsd": (torch.randn(2, 4, 32, 16), 4), "bshd": (torch.randn(2, 32, 4, 16).transpose(1, 2), 3)}
        for name, (grad, sixteen_kib) in layouts.items():
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)
            real = [n for _, n in cpu_memory_events(prof.profiler.kineto_results.events()) if n > 0]
            assert sorted(real) == sorted([16384] * sixteen_kib + [8192, 128]), name
            meta = [t.to("meta") for t in (grad, q, k, v, out, lse)]
            meta[0] = torch.empty_strided(grad.shape, grad.stride(), device="meta")
            tracer = MemoryTracer("cpu")
            with tracer:
                aten._scaled_dot_product_flash_attention_for_cpu_backward(*meta, 0.0, True)
            traced = [e[2] for e in tracer.log.events if e[0] == ALLOC]
            assert sorted(traced) == sorted(real), name
    finally:
        torch.set_num_threads(threads)
