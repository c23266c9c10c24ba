"""benchmarks/published/multi_gpu/: the published multi-GPU measurements are well-formed records
(source quote, layout, metric, exact integer bytes, stated gaps), and the committed JSON files are
exactly what make_records.py writes. Nothing here compares memcheck with them."""

import importlib.util
import json
from pathlib import Path

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
