"""Layouts (``--layout dp=8,tp=4,pp=2``): the value, its ranks, the CLI, and the layout search.

The real-rank comparisons of each kind are in test_tp_cpu, test_pp_cpu, test_cp_cpu and
test_ep_cpu (the first two also through ``layout=``); these tests check the arithmetic of the
layout itself by hand, the errors, and that the search's screen never skips a layout that fits.
"""

import os

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.engine import plan_layout as pl
from memcheck.errors import UsageError
from memcheck.training.strategies.layout import Layout, Role, roles

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_llama(layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                         intermediate_size=128, vocab_size=128, max_position_embeddings=64)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def batch(rows=2, length=32):
    ids = torch.zeros(rows, length, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


# ---- the value ---------------------------------------------------------------------------------

def test_a_layout_multiplies_its_degrees_into_the_world():
    layout = Layout.parse("dp=8,tp=4,pp=2")
    assert layout.world == 8 * 4 * 2 == 64
    assert layout.sharded_over == 8  # dp x cp
    both = Layout.parse("dp_replicate=2, dp=4, cp=2, tp=2, pp=2, ep=8")
    assert both.world == 2 * 4 * 2 * 2 * 2 == 64  # ep borrows from dp x cp = 8: not a factor
    assert both.data_parallel == 2 * 4 == 8
    assert Layout.parse({"tp": 2, "pp": 2}).label == "tp=2,pp=2,schedule=1f1b"


@pytest.mark.parametrize("text, words", [
    ("dp=8,tp=x", "tp must be a positive integer, got 'x'"),
    ("dp=2,foo=2", "unknown key 'foo'"),
    ("dp=3,ep=2", "ep=2 must divide dp*cp=3"),
    ("tp=1,sp=true", "sp (sequence parallelism) needs tp > 1"),
    ("pp=2,virtual=2", "interleaved schedule"),
    ("dp=8,dp=4", "dp is given twice"),
    ("dp=0", "from 1 to 65,536"),
    ("dp=65536,tp=2", "131,072 GPUs"),
])
def test_a_bad_layout_is_named(text, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        Layout.parse(text)


def test_the_job_runs_its_strategy_over_dp_times_cp_and_counts_the_world():
    job = memcheck.Job(layout="dp=4,cp=2,tp=2")
    assert job.strategy_config.strategy.value == "fsdp"  # torchtitan's default, over dp x cp
    assert job.strategy_config.gpus == 4 * 2
    assert job.world == 4 * 2 * 2 == 16
    assert memcheck.Job(layout="dp=4,tp=2", strategy="ddp").strategy_config.label == "ddp x4"
    with pytest.raises(UsageError, match="gpus=8 differs from layout dp=4,tp=4, which is 16 GPUs"):
        memcheck.Job(layout="dp=4,tp=4", gpus=8)
    with pytest.raises(UsageError, match="DataParallel"):
        memcheck.Job(layout="dp=4,tp=2", strategy="dp")
    # the global batch is shared by the data-parallel replicas only: 2 x 4 = 8 of the 32 GPUs
    memcheck.Job(layout="dp_replicate=2,dp=4,tp=4", global_batch=8)
    with pytest.raises(UsageError, match="not divisible by 8 GPUs"):
        memcheck.Job(layout="dp_replicate=2,dp=4,tp=4", global_batch=12)


def test_a_pipeline_of_more_than_three_stages_traces_first_second_and_last():
    layout = Layout.parse("dp=2,tp=4,pp=5")  # 40 GPUs, 8 a stage
    traced = roles(layout)
    assert [(r.stage, r.through) for r in traced] == [(0, None), (1, 3), (4, None)]
    assert [r.ranks for r in traced] == [(0, 7), (8, 31), (32, 39)]  # stages 1-3: ranks 8 .. 4 x 8 - 1
    assert traced[1].label == "GPU 8-31\nstages 1-3"
    assert [r.stage for r in roles(Layout.parse("pp=3"))] == [0, 1, 2]


# ---- estimates through a layout ----------------------------------------------------------------

def test_each_pipeline_stage_is_a_column_and_the_busiest_sets_the_peak():
    est = memcheck.estimate(tiny_llama(), batch(), device="cpu", layout="dp=2,tp=2,pp=2", accumulate=4)
    assert [d.role for d in est.devices] == ["GPU 0-3\nstage 0", "GPU 4-7\nstage 1"]
    assert est.gpus == 8 and est.strategy == "fsdp x2 in dp=2,tp=2,pp=2,schedule=1f1b"
    assert est.peak_bytes == max(d.peak_bytes for d in est.devices)
    text = str(est)
    assert "stage 0" in text and "stage 1" in text
    assert [d["ranks"] for d in est.to_dict()["per_device"]] == ["GPU 0-3, stage 0", "GPU 4-7, stage 1"]


def test_a_tensor_parallel_rank_holds_its_shards():
    # The Llama's blocks: q, k, v, o (64x64, 64x32, 64x32, 64x64) and gate, up, down (64x128 x 3);
    # tp=2 halves them all. Per block 4096 + 2048 + 2048 + 4096 + 3 x 8192 = 36,864 weights, 18,432 a
    # rank; two norms (64 each) whole. Two blocks, the embedding (vocabulary-parallel) and head (gathered
    # column-wise) of transformers' plan, 128 x 64 each, halved, and the final norm (64) whole:
    # 2 x (18,432 + 128) + 2 x 4,096 + 64 = 45,376 fp32 weights = 181,504 B.
    est = memcheck.estimate(tiny_llama(layers=2), batch(), device="cpu", layout="tp=2", optimizer="sgd")
    assert est.breakdown_at_peak.params == 181_504


def test_layouts_that_cannot_be_traced_are_refused_in_one_line():
    model = tiny_llama()
    with pytest.raises(UsageError, match="ep=2 needs a mixture-of-experts model"):
        memcheck.estimate(model, batch(), device="cpu", layout="dp=2,ep=2")
    with pytest.raises(UsageError, match="5 pipeline stages for the 4 repeated blocks"):
        memcheck.estimate(model, batch(), device="cpu", layout="pp=5", accumulate=5)
    with pytest.raises(UsageError, match="evaluation pass under pipeline"):
        memcheck.estimate(model, batch(), device="cpu", layout="pp=2", accumulate=2, eval_batch=batch())


@pytest.mark.parametrize("args, words", [
    (["--layout", "dp=2,what=3"], "unknown key 'what'"),
    (["--layout", "dp=2", "--compare"], "drop --layout"),
    (["--layout", "tp=3"], "--tp-plan"),
    (["--layout", "tp=3", "--tp-plan", "transformer.h.*.mlp.c_fc=colwise"], "c_fc"),
    (["--layout", "tp=2", "--tp-plan", "transformer.nope=colwise"], "'transformer.nope' matches no module"),
    (["--layout", "tp=2", "--tp-plan", "transformer.h.*.mlp.c_fc=embedding_rowwise"], "an embedding style"),
    (["--layout", "tp=2", "--tp-plan", "transformer.wte=moe_tp_experts"], "use --layout ep=N"),
    (["--layout", "dp=2,loss_parallel=true"], "loss_parallel shards the logits over the tensor-parallel ranks and "
                                              "needs tp > 1"),
])
def test_a_bad_layout_on_the_command_line_exits_2_in_one_line(args, words):
    result = CliRunner().invoke(main, ["examples/gpt2_small.py", "--max-len", "64", "--device", "cpu", *args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], lines


# ---- the layout search -------------------------------------------------------------------------

def test_the_cost_proxy_charges_the_pipeline_bubble_by_hand():
    model = tiny_llama()
    job = memcheck.Job(device="cpu", budget_bytes=2**30, max_len=32, global_batch=64)
    shape = pl._Shape.of(model, pl.repeated_blocks(model), job)
    search = pl._Search(model, lambda m: batch(m), job, shape, None, 2**30, "m", None, None, world=2, node=2)
    # Parameters: a block 4096 + 2048 + 2048 + 4096 + 3 x 8192 + 2 x 64 = 36,992; four blocks, the final norm
    # (64) and the head (8,192) are matmul weights: 156,224 (the embedding's 8,192 are lookups). Attention:
    # 6 x 4 blocks x 4 heads x 16 head dim x 32 tokens = 49,152 FLOPs a token. 64 x 32 = 2,048 tokens.
    flops = 2048 * (6 * 156_224 + 49_152)
    compute = flops / (2 * search.rates.tensor_flops)  # two GPUs, no recomputation
    # pp=2 (no data parallelism, so no FSDP traffic): 1F1B over 16 micro-batches idles (16 + 2 - 1) / 16 of
    # the time; each micro-batch's activation (4 rows x 32 tokens x 64) goes forward and its gradient back.
    sends = 2 * 16 * (4 * 32) * 64 * 2 / pl.NVLINK_BYTES_PER_SECOND
    assert search.cost(Layout(pp=2), 4, 16, "none") == pytest.approx(compute * 17 / 16 + sends, rel=1e-12)
    # full checkpointing recomputes the forward: 8/6 of the FLOPs
    assert search.cost(Layout(pp=2), 4, 16, "full") == pytest.approx(compute * 4 / 3 * 17 / 16 + sends, rel=1e-12)


@pytest.mark.slow
def test_the_layout_search_recommends_a_traced_layout_and_skips_only_what_does_not_fit():
    model = tiny_llama()
    budget = 1_400_000  # bytes a rank: between what the plain 8-way FSDP rank and the tp=2 rank need
    job = memcheck.Job(device="cpu", budget_bytes=budget, margin=0.0, max_len=32, global_batch=16)
    result = pl.plan_layout(model, lambda m: batch(m), job, gpus=8, gpus_per_node=4)
    assert result.fits and result.estimate.total_bytes <= budget
    assert result.job.layout.world == 8 and result.job.global_batch == 16
    again = memcheck.estimate(model, batch(result.job.batch_size), result.job)
    assert again.total_bytes == result.recommended.device_total_bytes
    # every cheaper layout the screen skipped really does not fit: trace them
    for c in result.considered:
        if c.status.startswith("skipped, ~"):
            layout = Layout.parse(c.layout)
            est = memcheck.estimate(model, batch(c.micro_batch_size), result.job.replace(
                layout=layout, gpus=layout.world, batch_size=c.micro_batch_size, accumulate=c.microbatches,
                checkpointing=c.checkpointing))
            assert est.total_bytes > budget, (c, est.total_bytes)


def test_plan_with_a_layout_picks_its_micro_batch_and_checkpointing():
    args = ["plan", "examples/gpt2_small.py", "--layout", "dp=2", "--max-len", "64", "--global-batch", "8",
            "--device", "cpu", "--gpu-memory", "2GiB"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "RECOMMENDED: --layout dp=2 (fsdp x2 inside)" in result.output
    refused = CliRunner().invoke(main, [*args, "--strategy", "ddp"])
    assert refused.exit_code == 2 and "drop --strategy" in refused.output
    with pytest.raises(UsageError, match="plan_layout"):
        memcheck.plan(tiny_llama(), lambda b: batch(b), device="cpu", budget_bytes=2**30, layout="dp=2")
