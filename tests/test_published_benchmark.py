"""benchmarks/published/: the cases others measured on real GPUs are well-formed, and run.py
turns one of them into a table row (its prediction is not checked against anything here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "benchmarks" / "published"
REQUIRED = ("id", "source", "model", "batch_size", "max_len", "precision", "optimizer", "checkpointing",
            "gpu", "torch_version", "metric", "value_bytes", "unit_conversion", "stack_notes")
METRICS = {"max_memory_allocated", "max_memory_reserved", "nvidia-smi"}


def _cases():
    return json.loads((HERE / "cases.json").read_text())["cases"]


def test_every_case_has_the_fields_a_comparison_needs():
    cases = _cases()
    assert len(cases) >= 20
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids))
    for case in cases:
        missing = [k for k in REQUIRED if k not in case]
        assert not missing, (case.get("id"), missing)
        assert case["metric"] in METRICS, case["id"]
        assert isinstance(case["value_bytes"], int) and not isinstance(case["value_bytes"], bool), case["id"]
        assert case["value_bytes"] > 0, case["id"]
        assert case["source"].get("quote"), case["id"]
        assert isinstance(case["stack_notes"], str), case["id"]
        assert case["checkpointing"] in ("none", "full"), case["id"]
        assert case["model"]["config_class"] and case["model"]["task"], case["id"]


def test_every_gpu_is_one_memcheck_knows():
    from memcheck.cuda.gpus import resolve_gpu

    for case in _cases():
        assert resolve_gpu(case["gpu"]) is not None, case["id"]


@pytest.mark.slow
def test_run_prints_a_row_for_one_case():
    case_id = "card-xlmr-base-squad-bs16-384"
    assert case_id in {c["id"] for c in _cases()}
    out = subprocess.run([sys.executable, str(HERE / "run.py"), "--only", case_id],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(case_id)]
    assert len(rows) == 1 and "SKIPPED" not in rows[0], out.stdout
    assert "max_memory_allocated" in rows[0] and "%" in rows[0]
    assert "median |error|" in out.stdout


def test_every_loss_and_protocol_is_one_run_py_knows():
    sys.path.insert(0, str(HERE))
    try:
        import run
    finally:
        sys.path.remove(str(HERE))
    for case in _cases():
        assert case["model"]["task"] in run._AUTO, case["id"]
        assert case["model"].get("loss") in (None, *run.LOSSES), case["id"]
        assert case.get("protocol", "train") in ("train", "forward-backward"), case["id"]
        if case.get("protocol") == "forward-backward":
            assert case["model"].get("loss"), case["id"]  # the step needs a named loss


def test_recent_torch_reads_the_version_prefix():
    sys.path.insert(0, str(HERE))
    try:
        import run
    finally:
        sys.path.remove(str(HERE))
    assert run.recent_torch({"torch_version": "2.4.1"})
    assert run.recent_torch({"torch_version": "2.14.0+cu130"})
    assert not run.recent_torch({"torch_version": "2.2.0"})
    assert not run.recent_torch({"torch_version": "unknown (early 2022; CUDA 11.2 driver)"})
