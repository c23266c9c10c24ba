"""Pipeline parallelism (memcheck.training.strategies.pp) against real torch.distributed.pipelining
runs on CPU gloo ranks, per rank, and the schedules' live micro-batches by hand (issue 21)."""

import pytest
import torch

SEQ, MICRO = 32, 2  # sequence length and micro-batch size


def build_llama():
    """A tiny fp32 LlamaForCausalLM (hidden 64, 4 heads, 4 layers, vocab 128) and one micro-batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=4, vocab_size=128, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (MICRO, SEQ))
    return model, {"input_ids": ids, "labels": ids.clone()}


def adamw(params):
    return torch.optim.AdamW(params)


def _estimate_rank(schedule, rank, stages, microbatches, whole_batch):
    import memcheck
    from memcheck.training.strategies import pp

    with torch.device("meta"):
        model, batch = build_llama()
    pp.make_stage(model, rank, stages)
    if whole_batch:  # the step's batch, as measure_pp_cpu hands it to schedule.step: M micro-batches
        batch = {k: torch.cat([v] * microbatches) for k, v in batch.items()}
    step = pp.train_step(schedule, rank, stages, microbatches, whole_batch=whole_batch)
    return memcheck.estimate(model, batch, device="cpu", optimizer="adamw", train_step=step)


@pytest.mark.slow
def test_1f1b_two_stages_estimate_matches_each_measured_rank():
    from memcheck.measure.distributed import measure_pp_cpu

    M = 4
    ranks = measure_pp_cpu(build_llama, adamw, world_size=2, schedule="1f1b", microbatches=M, steps=2)
    estimates = [_estimate_rank("1f1b", rank, 2, M, whole_batch=True).peak_bytes for rank in range(2)]
    for rank, (measured, peak) in enumerate(zip(ranks, estimates)):
        error = (peak - measured.steady_peak_bytes) / measured.steady_peak_bytes
        assert abs(error) <= 0.02, (
            f"rank {rank}: estimated {peak} B, measured {measured.steady_peak_bytes} B ({error:+.2%})"
        )
    # Given one micro-batch instead (the Job's batch_size), the estimate lacks the other M - 1
    # micro-batches of the step's batch that the caller of schedule.step holds:
    # (4 - 1) x 2 x 32 x 8 B x (input_ids + labels) = 3,072 B, 0.07% of rank 0's peak here.
    micro = _estimate_rank("1f1b", 0, 2, M, whole_batch=False).peak_bytes
    assert estimates[0] - micro == 3 * 2 * 32 * 8 * 2
    # the user's way in: the whole model with --layout pp=2 --accumulate 4 (a column per stage), whose
    # step is traced with min(M, 2 x pp) = 4 micro-batches: the same 3,072 B short of each measured rank
    import memcheck

    with torch.device("meta"):
        model, batch = build_llama()
    layout = memcheck.estimate(model, batch, device="cpu", optimizer="adamw", layout="pp=2", accumulate=M)
    for rank, (measured, device) in enumerate(zip(ranks, layout.devices)):
        assert measured.steady_peak_bytes - device.peak_bytes == 3 * 2 * 32 * 8 * 2, (rank, device.peak_bytes)


# ---- the schedules' orders and live micro-batches, by hand ----

def test_gpipe_runs_every_forward_then_every_backward():
    from memcheck.training.strategies.pp import Action, actions

    assert actions("gpipe", 1, 2, 3) == [Action("F", 0), Action("F", 1), Action("F", 2),
                                         Action("B", 0), Action("B", 1), Action("B", 2)]


def test_1f1b_order_warms_up_p_minus_s_forwards_then_backward_first():
    from memcheck.training.strategies.pp import actions

    # P = 4, M = 6. Stage 0: min(6, 4 - 0) = 4 warm-up forwards, then B0 F4 B1 F5, then B2..B5.
    kinds = [f"{a.kind}{a.microbatch}" for a in actions("1f1b", 0, 4, 6)]
    assert kinds == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    # Stage 3 (the last): min(6, 4 - 3) = 1 warm-up forward, then strictly one backward, one forward.
    kinds = [f"{a.kind}{a.microbatch}" for a in actions("1f1b", 3, 4, 6)]
    assert kinds == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


def test_live_microbatches_by_hand():
    from memcheck.training.strategies.pp import live_microbatches as live

    # GPipe: every forward before any backward, so all M on every stage.
    assert [live("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    # 1F1B: min(M, P - s) warm-up forwards, then a backward before each further forward.
    assert [live("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [live("1f1b", s, 2, 2) for s in range(2)] == [2, 1]
    # Interleaved 1F1B, P = 4, M = 8, v = 2 chunks per rank: rounds = max(1, 8 // 4) = 2, 4 micro-batches
    # per round; warm-up = (v - 1) x 4 + 2 x (P - 1 - r) = 10, 8, 6, 4 (capped at M x v = 16), and the
    # 1F1B phase runs its forward before its backward: one more, 11, 9, 7, 5 (chunk-micro-batches,
    # each holding half of the rank's blocks).
    assert [live("interleaved-1f1b", r, 4, 8, 2) for r in range(4)] == [11, 9, 7, 5]
    # Zero bubble (ScheduleInterleavedZeroBubble), same placement: warm-up = 4 + 1 x (3 - r) = 7, 6, 5, 4;
    # rank r then runs r forward + input-gradient pairs before its first weight gradient, which frees
    # a micro-batch: 7 + 0 + 1, 6 + 1 + 1, 5 + 2 + 1, 4 + 3 + 1 = 8 on every rank.
    assert [live("zero-bubble", r, 4, 8, 2) for r in range(4)] == [8, 8, 8, 8]


def test_zero_bubble_splits_each_backward_into_input_and_weight_halves():
    from memcheck.training.strategies.pp import actions

    order = actions("zero-bubble", 3, 4, 8, 2)
    # 8 micro-batches x 2 chunks, each with F, I and W: 48 actions; rank 3 starts with its 4 warm-up forwards.
    assert len(order) == 48 and "".join(a.kind for a in order[:6]) == "FFFFFI"
    assert sorted((a.kind, a.microbatch, a.chunk) for a in order if a.kind == "W") == \
        sorted(("W", m, c) for m in range(8) for c in range(2))


def test_schedule_arguments_are_checked():
    from memcheck.errors import UsageError
    from memcheck.training.strategies.pp import actions

    with pytest.raises(UsageError, match="did you mean '1f1b'"):
        actions("1fb1", 0, 2, 4)
    with pytest.raises(UsageError, match="microbatches=2 < stages=4"):
        actions("1f1b", 0, 4, 2)
    with pytest.raises(UsageError, match="rank must be .* 0 to 1, got 2"):
        actions("gpipe", 2, 2, 4)
    with pytest.raises(UsageError, match="virtual=2"):
        actions("gpipe", 0, 2, 4, 2)


# ---- the stage a rank holds ----

# Parameters of build_llama's model, by hand: a layer is q, k, v, o (4 x 64 x 64 = 16,384), gate, up,
# down (3 x 64 x 256 = 49,152) and two RMSNorms (2 x 64): 65,664. Embedding and head 128 x 64 = 8,192 each;
# the final norm 64.
LAYER, EMBED, HEAD, NORM = 65_664, 8_192, 8_192, 64


def _stage(rank, stages):
    from memcheck.training.strategies import pp

    with torch.device("meta"):
        model, _ = build_llama()
    return pp.make_stage(model, rank, stages)


def test_stage_keeps_its_slice_embedding_first_head_last():
    from memcheck.training.strategies import pp

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    first, last = _stage(0, 2), _stage(1, 2)
    assert count(first) == EMBED + 2 * LAYER
    assert count(last) == 2 * LAYER + NORM + HEAD
    assert isinstance(last.model.embed_tokens, pp.Receive)
    assert isinstance(first.lm_head, pp.PassThrough) and isinstance(first.model.norm, pp.PassThrough)
    assert [type(b) is pp.PassThrough for b in first.model.layers] == [False, False, True, True]
    middle = _stage(1, 4)
    assert count(middle) == LAYER
    assert middle.memcheck_pp_stage.blocks == ("model.layers.1",)


def test_stage_errors_name_the_model_and_the_numbers():
    from memcheck.errors import UsageError
    from memcheck.training.strategies import pp

    with pytest.raises(UsageError, match="5 pipeline stages for the 4 repeated blocks of LlamaForCausalLM"):
        _stage(0, 5)
    with torch.device("meta"):
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.raises(UsageError, match="Sequential has none"):
        pp.make_stage(mlp, 0, 2)


def test_received_activations_take_the_blocks_dtype_when_the_step_runs():
    # memcheck casts its twin to bf16 after make_stage: the receive buffers follow the blocks then
    # (a real bf16 run receives bf16 activations), one per micro-batch, [micro-batch, S, hidden].
    from memcheck.training.strategies import pp

    model = _stage(1, 2).to(torch.bfloat16)
    with torch.device("meta"):
        batch = {"input_ids": torch.zeros(MICRO, SEQ, dtype=torch.long)}
    stage = pp._Stage(model, batch, 3, whole_batch=False)
    assert [(t.dtype, tuple(t.shape)) for t in model.memcheck_pp_stage.recv[0]] == [(torch.bfloat16, (2, 32, 64))] * 3
    assert model.memcheck_pp_stage.grad_recv == {}  # the last stage receives no gradient
    del stage


def test_interleaved_stage_holds_every_chunk_and_runs_for_real():
    # 2 ranks x 2 chunks of 4 layers: global stage g holds layer g; rank r holds stages r and r + 2.
    from memcheck.training.strategies import pp

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        first, _ = build_llama()
    pp.make_stage(first, 0, 2, virtual=2)
    assert first.memcheck_pp_stage.chunks == (("model.layers.0",), ("model.layers.2",))
    assert count(first) == EMBED + 2 * LAYER and isinstance(first.model.embed_tokens, pp.Entry)
    # The same step on real CPU tensors (no tracer): every chunk's parameters get a gradient.
    model, batch = build_llama()
    pp.make_stage(model, 1, 2, virtual=2)
    assert count(model) == 2 * LAYER + NORM + HEAD
    whole = {k: torch.cat([v] * 4) for k, v in batch.items()}
    grads = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.step = lambda: grads.update({n: p.grad is not None for n, p in model.named_parameters()})
    pp.train_step("interleaved-1f1b", 1, 2, 4, whole_batch=True, virtual=2)(model, whole, optimizer)
    assert grads and all(grads.values())


def test_measure_pp_cpu_checks_its_arguments_before_spawning():
    from memcheck.errors import UsageError
    from memcheck.measure.distributed import measure_pp_cpu

    with pytest.raises(UsageError, match="schedule must be one of .* got 'zero-bubble'"):
        measure_pp_cpu(build_llama, adamw, schedule="zero-bubble")
    with pytest.raises(UsageError, match="virtual must be 1, .* got 2"):
        measure_pp_cpu(build_llama, adamw, schedule="1f1b", virtual=2)
    with pytest.raises(UsageError, match="microbatches must be an integer >= 1, got 0"):
        measure_pp_cpu(build_llama, adamw, microbatches=0)


def _sequence_parallel_stage(rank, virtual=1):
    """The tiny Llama on meta cut by tp=2 with sequence parallelism (memcheck's emulated ranks), then
    into pipeline rank ``rank`` of 2, as Role.view cuts it for ``--layout tp=2,pp=2,sp=true``."""
    from memcheck.training.strategies import pp, tp

    with torch.device("meta"):
        model, batch = build_llama()
    tp.shard(model, 2, sequence_parallel=True, backend="gloo")
    pp.make_stage(model, rank, 2, virtual=virtual, sequence_shards=2)
    return model, batch


def test_sequence_parallel_stages_send_and_receive_s_over_tp_tokens():
    # Under SP the residual stream between blocks is S/tp tokens a rank (torchtitan's blocks take and
    # return Shard(1) local tensors), so a stage receives [micro-batch, S/2, hidden] = [2, 16, 64] fp32,
    # 2 x 16 x 64 x 4 B = 8 KiB a buffer, one per micro-batch, and rank 0 receives gradients of that shape.
    from memcheck.training.strategies import pp

    last, batch = _sequence_parallel_stage(1)
    pp._Stage(last, {"input_ids": batch["input_ids"]}, 3)
    assert [tuple(t.shape) for t in last.memcheck_pp_stage.recv[0]] == [(2, 16, 64)] * 3
    assert [t.numel() * t.element_size() for t in last.memcheck_pp_stage.recv[0]] == [8192] * 3
    first, batch = _sequence_parallel_stage(0)
    pp._Stage(first, {"input_ids": batch["input_ids"]}, 3)
    assert [tuple(t.shape) for t in first.memcheck_pp_stage.grad_recv[0]] == [(2, 16, 64)] * 3


@pytest.mark.parametrize("schedule", ["schedule=1f1b", "schedule=interleaved-1f1b,virtual=2"])
def test_a_sequence_parallel_pipeline_is_traced_per_stage(schedule):
    # tp=2,pp=2,sp=true used to fail in the backward (the received gradient [2, 32, 64] against the sent
    # activation [2, 16, 64]); with rank 0's later chunk the first block's cut must not apply again. Each
    # stage traced; SP cuts the norms' activations and the buffers, so each stage's peak is below tp=2's.
    import memcheck

    with torch.device("meta"):
        model, batch = build_llama()
    whole = {k: torch.cat([v] * 4) for k, v in batch.items()}
    sp = memcheck.estimate(model, whole, device="cpu", layout=f"tp=2,pp=2,{schedule},sp=true", accumulate=4)
    plain = memcheck.estimate(model, whole, device="cpu", layout=f"tp=2,pp=2,{schedule}", accumulate=4)
    assert len(sp.devices) == 2
    assert all(a.peak_bytes < b.peak_bytes for a, b in zip(sp.devices, plain.devices))
