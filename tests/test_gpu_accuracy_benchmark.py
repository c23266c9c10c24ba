"""benchmarks/gpu_accuracy.py must run on the GPU machine: its workloads cover what issue 3
asks for, and each one's prediction works here, without a GPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_accuracy.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_accuracy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_zoo_spans_models_precisions_attention_and_batch_sizes():
    bench = _load()
    w = bench.WORKLOADS.values()
    assert len(bench.WORKLOADS) >= 12
    assert {k for k, *_ in w} >= {"cnn", "vit", "bert", "gpt2", "llama", "t5"}
    assert {p for *_, p, _ in w} >= {"fp32", "amp-bf16", "amp-fp16", "bf16"}
    assert {a for *_, a in w} >= {"eager", "sdpa"}
    assert any(len({b for k2, b, *_ in w if k2 == k}) >= 2 for k, *_ in w)  # one model at two batch sizes


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_load().WORKLOADS))
def test_each_workload_is_predicted_without_touching_cuda(name):
    bench = _load()
    pred = bench.predict(name, "H100-80GB")
    assert pred["reserved"] >= pred["allocated"] > 0
    assert pred["device_total"] > pred["reserved"]
    assert not torch.cuda.is_initialized()
