"""benchmarks/published/multi_gpu/: the published multi-GPU measurements are well-formed records
(source quote, layout, metric, exact integer bytes, stated gaps), and the committed JSON files are
exactly what make_records.py writes; ``run.py --multi-gpu`` translates each into the memcheck job a user
would write (checked here without an estimate: the comparison itself is benchmarks/results/published-multi-gpu-*)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "benchmarks" / "published" / "multi_gpu"
REQUIRED = ("id", "source", "model", "gpus", "layout", "local_batch", "seq_len", "precision", "optimizer",
            "activation_checkpointing", "compile", "float8", "torch_version", "metric", "metric_definition",
            "rank", "value_published", "value_bytes", "unit_conversion", "gaps", "stack_differences",
            "reproducibility", "can_check")
METRICS = {"max_memory_allocated", "max_memory_reserved", "memory_allocated_after_step"}


def _records():
    return {p.stem: json.loads(p.read_text()) for p in sorted((HERE / "records").glob("*.json"))}


def test_every_record_has_its_source_layout_metric_and_gaps():
    records = _records()
    assert len(records) >= 40
    for stem, r in records.items():
        assert r["id"] == stem
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, (stem, missing)
        assert r["metric"] in METRICS, stem
        assert isinstance(r["value_bytes"], int) and not isinstance(r["value_bytes"], bool) and r["value_bytes"] > 0, stem
        assert r["source"]["url"].startswith("https://github.com/") and r["source"]["quote"], stem
        assert r["gaps"] and r["stack_differences"], stem  # every published multi-GPU run differs from memcheck somewhere
        assert r["reproducibility"] in ("A", "B", "C"), stem
        assert "pp" in r["layout"] and "tp" in r["layout"], stem


def test_unit_conversions_by_hand():
    r = _records()
    # torchtitan prints GiB: 82.4 GiB = 82.4 * 2**30 B
    assert r["tt2412-t1-llama3.1-8b-fsdp8-sac"]["value_bytes"] == round(82.4 * 1073741824) == 88476326298  # 88,046,829,568 + 429,496,729.6
    # PR #165 prints percent of 95.0396 GiB: 23.92 % -> 0.2392 * 95.0396 * 2**30
    assert r["tt165-llama2-7b-fsdp2-dp8-ac-bs8-active"]["value_bytes"] == round(0.2392 * 95.0396 * 2**30)
    # Lightning prints /1e9 as "GB"
    assert r["lightning-trainer-tp2-fsdp2-llama2-7b-bs8-seq128"]["value_bytes"] == 36_730_000_000
    # Megatron logs exact bytes
    assert r["mcore-gpt7b-tp1-pp4-vpp8-h100-peak"]["value_bytes"] == 60720852992


def test_committed_records_are_what_make_records_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_records", HERE / "make_records.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.OUT = tmp_path
    mod.main()
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in (HERE / "records").glob("*.json")}
    assert fresh == committed


@pytest.fixture(scope="module")
def run():
    sys.path.insert(0, str(HERE.parent))
    try:
        import run
    finally:
        sys.path.remove(str(HERE.parent))
    return run


def test_every_record_translates_into_a_valid_job(run):
    for record in _records().values():
        t = run.multi_gpu_job(record)
        job = run.build_job(t)  # Job validates the combination (layout, strategy, FSDP policy, step order)
        assert job.batch_size == t["settings"]["batch_size"] and job.max_len == record["seq_len"], record["id"]
        assert (t["field"] is None) == (record["metric"] == "memory_allocated_after_step"), record["id"]
        assert t["flags"].startswith("--batch-size"), record["id"]


def test_the_torchtitan_fsdp2_row_is_fsdp_over_8_with_bf16_params_and_fp32_reduce(run):
    from memcheck.enums import Dtype, StepOrder, Strategy

    t = run.multi_gpu_job(_records()["tt2412-t1-llama3.1-8b-fsdp8-sac"])
    job = run.build_job(t)
    assert job.strategy is Strategy.FSDP and job.gpus == 8 and job.layout is None
    assert (job.param_dtype, job.reduce_dtype) == (Dtype.BF16, Dtype.FP32)  # MixedPrecisionPolicy(bf16, fp32)
    assert job.precision.value == "fp32" and job.optimizer == "adamw-foreach"  # fp32 shards, AdamW foreach
    assert job.checkpointing == "selective-op" and job.max_grad_norm == 1.0
    assert job.step_order is StepOrder.PLAIN  # torchtitan zeroes the gradients before the forward
    assert (job.batch_size, job.max_len) == (2, 8192)
    assert job.gpu.capacity_bytes == round(95.0396 * 2**30) and job.gpu.arch == (9, 0)  # HBM2e H100, sm90
    assert (t["field"], t["rank"]) == ("reserved_bytes", "max")  # reserved, max over the ranks
    assert "--strategy fsdp --gpus 8" in t["flags"] and "--param-dtype bf16 --reduce-dtype fp32" in t["flags"]


def test_the_405b_pipeline_row_is_a_layout_with_micro_batches(run):
    from memcheck.enums import Schedule, Strategy

    t = run.multi_gpu_job(_records()["tt2412-t5-llama3.1-405b-fsdp8-tp8-pp8-interleaved-1f1b"])
    job = run.build_job(t)
    layout = job.layout
    assert (layout.dp, layout.tp, layout.pp, layout.virtual, layout.sp) == (8, 8, 8, 2, True)
    assert layout.schedule is Schedule.INTERLEAVED_1F1B and job.world == 512  # 8 x 8 x 8
    # local batch 32 = 8 micro-batches (accumulate under pp) x 4 samples
    assert (job.accumulate, job.batch_size) == (8, 4)
    assert job.strategy_config.strategy is Strategy.FSDP and job.strategy_config.gpus == 8
    assert t["model"]["kwargs"]["num_hidden_layers"] == 126 and t["model"]["kwargs"]["hidden_size"] == 16384


def test_a_record_with_a_config_file_takes_its_shapes(run):
    # tt2412-t4 names examples/llama-3-70b/config.json: 80 layers of 8192, vocab 128256, fp32 weights
    t = run.multi_gpu_job(_records()["tt2412-t4-llama3.1-70b-fsdp32-tp8-compile-fp8"])
    kwargs = t["model"]["kwargs"]
    assert (kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["vocab_size"]) == (80, 8192, 128256)
    assert "dtype" not in kwargs


def test_fsdp1_tp_and_pipeline_ranks_translate(run):
    from memcheck.enums import Strategy

    records = _records()
    t165 = run.multi_gpu_job(records["tt165-llama2-7b-fsdp1-dp8-ac-bs8-active"])
    fsdp1 = run.build_job(t165)
    assert fsdp1.strategy is Strategy.FSDP1 and fsdp1.gpus == 8 and fsdp1.checkpointing == "full"
    assert t165["model"]["loss"] in run.MULTI_LOSSES  # 83c879f1's float32 logits kept through the backward
    # 83c879f1's 2D runs: enable_loss_parallel defaults to True
    two_d = run.build_job(run.multi_gpu_job(records["tt165-llama2-7b-fsdp2-dp4-tp2sp-ac-bs16-active"]))
    assert two_d.layout.loss_parallel
    t = run.multi_gpu_job(records["lightning-trainer-tp2-fsdp2-llama2-7b-bs8-seq128"])
    job = run.build_job(t)
    assert (job.layout.dp, job.layout.tp, job.layout.sp, job.layout.loss_parallel) == (2, 2, True, True)
    assert job.step_order.value == "lightning" and t["rank"] == "first"  # rank 0 printed it
    rank7 = run.multi_gpu_job(records["tt773-llama3-8b-pp8-interleaved-zb-bs16-seq512-rank7"])
    assert rank7["rank"] == "last" and run.build_job(rank7).layout.schedule.value == "zero-bubble"
    # Megatron: global batch 8 = micro-batch 2 x 2 micro-batches x dp 2; vocab 131073 padded to 128 x tp 4
    mcore = run.multi_gpu_job(records["mcore-gpt7b-tp4-pp1-h100-peak"])
    assert mcore["settings"]["accumulate"] == 2 and mcore["model"]["kwargs"]["vocab_size"] == 131584  # 257 x 512
    assert mcore["settings"]["strategy"] == "zero1" and mcore["outside"]
