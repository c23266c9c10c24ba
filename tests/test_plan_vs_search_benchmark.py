"""benchmarks/plan_vs_search.py must run on the GPU machine: its CLI, its search logic
against a fake oracle, the emulated card's arithmetic, and the plan half, all without a GPU."""

import dataclasses
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "plan_vs_search.py"
GiB = 2**30
MiB = 2**20


@functools.cache
def _load():
    spec = importlib.util.spec_from_file_location("plan_vs_search", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


# --- the CLI ---------------------------------------------------------------------------

def test_list_names_at_least_six_workloads_without_a_gpu():
    run = _run("--list")
    assert run.returncode == 0, run.stderr
    names = run.stdout.strip().splitlines()
    assert len(names) >= 6
    assert names == list(_load().WORKLOADS)


NO_GPU_ENVS = {
    "no visible device": {"CUDA_VISIBLE_DEVICES": ""},
    "no nvidia-smi on PATH": {"PATH": "/usr/bin:/bin"},
}


@pytest.mark.slow
@pytest.mark.parametrize("env", list(NO_GPU_ENVS.values()), ids=list(NO_GPU_ENVS))
def test_without_a_gpu_it_exits_2_with_one_line(env):
    if "PATH" in env and shutil.which("nvidia-smi", path=env["PATH"]):
        pytest.skip("nvidia-smi is in /usr/bin or /bin here")
    run = _run(env=env)
    assert run.returncode == 2
    assert run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1
    assert "no GPU" in run.stderr


# --- the workloads ---------------------------------------------------------------------

def test_every_workload_reuses_a_gpu_accuracy_workload_without_strategy_options():
    bench = _load()
    assert len(bench.WORKLOADS) >= 6
    for name, (source, _length) in bench.WORKLOADS.items():
        assert source in bench.gpu_accuracy.WORKLOADS, name
    w = [bench.workload(n) for n in bench.WORKLOADS]  # raises on strategy options
    assert {x[0] for x in w} >= {"cnn", "vit", "bert", "gpt2", "llama", "t5"}
    assert {x[2] for x in w} >= {"fp32", "bf16", "amp-bf16", "amp-fp16"}


@pytest.mark.parametrize("name", list(_load().WORKLOADS))
def test_the_batch_maker_gives_the_micro_batch_on_meta(name):
    bench = _load()
    key, length, _precision, attn = bench.workload(name)
    with torch.device("meta"):
        model, _batch, _loss = bench.gpu_accuracy.BUILDERS[key](1, length, attn)
    batch = bench.batch_maker(key, length, attn, model, "meta")(3)
    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
    assert tensors and all(t.device.type == "meta" and t.shape[0] == 3 for t in tensors)
    if length is not None and isinstance(batch, dict):
        assert batch["input_ids"].shape == (3, length)


def test_the_plan_half_runs_on_meta_without_touching_cuda():
    from memcheck.cuda.gpus import GPUS

    bench = _load()
    gpu = dataclasses.replace(GPUS["H100-80GB"], capacity_bytes=24 * GiB, name="H100-80GB limited to 24 GiB")
    p = bench.plan_one("cnn 224px amp-fp16", gpu)
    # The CNN's weights, gradients and AdamW state are ~5M params * 16 B = ~80 MB, and a
    # 224x224 sample's activations tens of MB: hundreds of samples fit in 24 GiB.
    assert p["micro_batch"] > 100
    assert 0 < p["traces"] <= 5  # memcheck.engine.plan.TRACES_PER_OPTION, one option
    assert p["predicted_device_total_bytes"] <= p["limit_bytes"] == int(24 * GiB * (1 - p["margin"]))
    assert p["seconds"] > 0
    assert not torch.cuda.is_initialized()


# --- the search: power doubling, then binary search ------------------------------------

def _search(bench, largest_that_fits, **kwargs):
    return bench.binsearch(lambda b: b <= largest_that_fits, **kwargs)


def test_the_search_doubles_then_bisects_to_37():
    result = _search(_load(), 37)
    # doubling from 2: 2, 4, 8, 16, 32 fit, 64 does not          (6 trials)
    # bisect (lo, hi): (32, 64) -> 48 no; (32, 48) -> 40 no; (32, 40) -> 36 fits;
    #                  (36, 40) -> 38 no; (36, 38) -> 37 fits; 38 - 37 = 1, done (5 trials)
    assert result.trials == ((2, True), (4, True), (8, True), (16, True), (32, True), (64, False),
                             (48, False), (40, False), (36, True), (38, False), (37, True))
    assert len(result.trials) == 6 + 5 == 11
    assert result.largest == 37 and result.converged


def test_a_power_of_two_boundary_costs_a_full_bisection():
    result = _search(_load(), 64)
    # 2 .. 64 fit (6 trials), 128 does not (1); bisecting (64, 128) takes log2(64) = 6 more:
    # 96, 80, 72, 68, 66, 65, none of which fits
    assert [b for b, _ in result.trials] == [2, 4, 8, 16, 32, 64, 128, 96, 80, 72, 68, 66, 65]
    assert len(result.trials) == 6 + 1 + 6 == 13
    assert result.largest == 64


@pytest.mark.parametrize("largest, tried", [
    (0, [2, 1]),  # 2 fails; (0, 2) -> 1 fails; nothing fits
    (1, [2, 1]),  # 2 fails; (0, 2) -> 1 fits; 2 - 1 = 1, done (Lightning would return 1 untried)
    (2, [2, 4, 3]),  # 2 fits, 4 fails; (2, 4) -> 3 fails
    (3, [2, 4, 3]),  # 2 fits, 4 fails; (2, 4) -> 3 fits
])
def test_the_smallest_boundaries(largest, tried):
    result = _search(_load(), largest)
    assert [b for b, _ in result.trials] == tried
    assert result.largest == largest and result.converged


def test_the_search_stops_at_max_trials():
    bench = _load()
    result = bench.binsearch(lambda b: True)
    # always fits: 25 trials (Lightning's max_trials) of 2, 4, ..., 2**25
    assert len(result.trials) == bench.MAX_TRIALS == 25
    assert result.largest == 2**25
    assert not result.converged


def test_only_out_of_memory_errors_are_trial_failures():
    bench = _load()
    assert bench.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert bench.is_oom(RuntimeError("CUDA error: out of memory"))
    assert bench.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert bench.is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."))
    assert not bench.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"))
    assert not bench.is_oom(ValueError("CUDA out of memory"))


# --- the emulated card ------------------------------------------------------------------

def test_the_allocator_may_reserve_the_card_less_the_context():
    bench = _load()
    # 24 GiB card, 512 MiB context, on an 80 GiB GPU: (24 - 0.5) / 80 = 0.29375,
    # and 0.29375 * 80 GiB = 23.5 GiB for the caching allocator
    f = bench.allocator_fraction(24 * GiB, 512 * MiB, 80 * GiB)
    assert f == pytest.approx(0.29375)
    assert int(f * 80 * GiB) == 24 * GiB - 512 * MiB


def test_the_emulated_card_must_fit_the_gpu_and_hold_the_context():
    bench = _load()
    with pytest.raises(ValueError, match="cannot emulate"):
        bench.allocator_fraction(100 * GiB, 512 * MiB, 80 * GiB)
    with pytest.raises(ValueError, match="context"):
        bench.allocator_fraction(512 * MiB, 512 * MiB, 80 * GiB)
