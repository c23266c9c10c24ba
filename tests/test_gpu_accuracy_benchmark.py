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
    w = [bench._workload(n) for n in bench.WORKLOADS]
    assert len(bench.WORKLOADS) >= 12
    assert {x[0] for x in w} >= {"cnn", "vit", "bert", "gpt2", "llama", "t5"}
    assert {x[3] for x in w} >= {"fp32", "amp-bf16", "amp-fp16", "bf16"}
    assert {x[4] for x in w} >= {"eager", "sdpa"}
    assert any(len({y[1] for y in w if y[0] == x[0]}) >= 2 for x in w)  # one model at two batch sizes


def test_the_single_gpu_strategies_of_issue_4_are_measured_too():
    bench = _load()
    options = [bench._workload(n)[5] for n in bench.WORKLOADS]
    assert any(o.get("accumulate", 1) > 1 for o in options)
    assert {o.get("use_reentrant", False) for o in options if o.get("checkpointing")} == {False, True}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_load().WORKLOADS))
def test_each_workload_is_predicted_without_touching_cuda(name):
    bench = _load()
    pred = bench.predict(name, "H100-80GB")
    assert pred["reserved"] >= pred["allocated"] > 0
    assert pred["device_total"] > pred["reserved"]
    assert not torch.cuda.is_initialized()
