"""cuBLAS/cuBLASLt/cuDNN workspace sizes and the CUDA context, worked out by hand.

The rules are those of aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.11-2.13).
"""

import pytest

from memcheck.cuda.overhead import (
    CUBLAS_WORKSPACE_DEFAULT,
    CUBLAS_WORKSPACE_LARGE,
    context_bytes,
    cublas_workspace_bytes,
    cublaslt_unified,
    cublaslt_workspace_bytes,
    parse_cublas_workspace_config,
    workspace_allocations,
)
from memcheck.errors import UsageError
from memcheck.cuda.gpus import GENERIC_CONTEXT_BYTES, GPUS

KiB = 2**10
MiB = 2**20


def test_the_default_workspace_is_4096_kib_twice_plus_16_kib_eight_times():
    # ":4096:2:16:8" = 4096 KiB * 2 + 16 KiB * 8 = 8 MiB + 128 KiB = 8,519,680 B,
    # the figure pytorch#95668 saw allocated after one nn.Linear call on an A10G.
    assert CUBLAS_WORKSPACE_DEFAULT == 8_519_680
    assert cublas_workspace_bytes((8, 0), {}) == 8 * MiB + 128 * KiB
    assert cublas_workspace_bytes((8, 6), {}) == 8_519_680
    assert cublas_workspace_bytes((7, 0), {}) == 8_519_680


@pytest.mark.parametrize("arch", [(9, 0), (10, 0), (12, 0)])
def test_hopper_and_blackwell_get_32_mib(arch):
    # 4096 KiB * 8 = 32 MiB
    assert CUBLAS_WORKSPACE_LARGE == 32 * MiB
    assert cublas_workspace_bytes(arch, {}) == 32 * MiB


@pytest.mark.parametrize(
    "config, expected",
    [
        (":4096:8", 4096 * KiB * 8),  # 32 MiB
        (":16:8", 16 * KiB * 8),  # 128 KiB, the deterministic-mode setting
        (":4096:2:16:8", 4096 * KiB * 2 + 16 * KiB * 8),  # the default, spelt out
        (" :4096:8 ", 32 * MiB),
        (":0:8", 0),
    ],
)
def test_cublas_workspace_config_sums_its_pairs(config, expected):
    assert parse_cublas_workspace_config(config) == expected
    # the variable overrides the arch default both ways
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": config}) == expected
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": config}) == expected


@pytest.mark.parametrize("config", ["4096:8", ":4096", ":4096:8x", "16:8:", ":a:8", "4096"])
def test_a_malformed_cublas_workspace_config_is_named(config):
    with pytest.raises(UsageError, match=f"CUBLAS_WORKSPACE_CONFIG {config!r}"):
        cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": config})


def test_an_empty_cublas_workspace_config_means_the_default():
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ""}) == 32 * MiB


def test_the_environment_is_read_when_none_is_given(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert cublas_workspace_bytes((9, 0)) == 128 * KiB


def test_a_bad_arch_is_refused():
    with pytest.raises(UsageError, match="compute capability"):
        cublas_workspace_bytes(9, {})


def test_cublaslt_is_unified_unless_turned_off():
    assert cublaslt_unified({})
    assert cublaslt_unified({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"})
    assert not cublaslt_unified({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"})
    with pytest.raises(UsageError, match="TORCH_CUBLASLT_UNIFIED_WORKSPACE 'yes' must be 0 or 1"):
        cublaslt_unified({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "yes"})


def test_cublaslt_workspace_is_1_mib_and_capped_by_cublas_when_unified():
    assert cublaslt_workspace_bytes((9, 0), {}) == 1024 * KiB
    # 4096 KiB requested: 4 MiB, under sm90's 32 MiB cuBLAS workspace
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    # 65536 KiB = 64 MiB requested, unified: capped at the 32 MiB cuBLAS workspace
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == 32 * MiB
    # not unified: no cap
    env = {"CUBLASLT_WORKSPACE_SIZE": "65536", "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert cublaslt_workspace_bytes((9, 0), env) == 64 * MiB


@pytest.mark.parametrize("value", ["1MiB", "-1", "1.5"])
def test_a_malformed_cublaslt_workspace_size_is_named(value):
    with pytest.raises(UsageError, match=f"CUBLASLT_WORKSPACE_SIZE {value!r}"):
        cublaslt_workspace_bytes((8, 0), {"CUBLASLT_WORKSPACE_SIZE": value})


def test_a_training_step_leaves_two_cublas_workspaces_per_gpu():
    # H100: 2 threads (Python, autograd) * 32 MiB = 64 MiB; Lt shares them.
    allocations = workspace_allocations((9, 0), {})
    assert allocations == [
        ("cuBLAS workspace (main thread)", 32 * MiB),
        ("cuBLAS workspace (autograd thread)", 32 * MiB),
    ]
    # A100: 2 * 8,519,680 B = 17,039,360 B
    assert sum(n for _, n in workspace_allocations((8, 0), {})) == 17_039_360


def test_forward_only_work_has_one_workspace():
    assert workspace_allocations((8, 0), {}, threads=1) == [("cuBLAS workspace (main thread)", 8_519_680)]
    assert workspace_allocations((8, 0), {}, threads=0) == []
    with pytest.raises(UsageError, match="threads"):
        workspace_allocations((8, 0), {}, threads=-1)


def test_separate_cublaslt_workspaces_when_not_unified():
    # A100, not unified: 2 * 8,519,680 B (cuBLAS) + 2 * 1 MiB (Lt)
    env = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    allocations = workspace_allocations((8, 0), env)
    assert [label for label, _ in allocations] == [
        "cuBLAS workspace (main thread)",
        "cuBLAS workspace (autograd thread)",
        "cuBLASLt workspace (main thread)",
        "cuBLASLt workspace (autograd thread)",
    ]
    assert sum(n for _, n in allocations) == 2 * 8_519_680 + 2 * MiB


def test_deterministic_config_shrinks_the_workspaces():
    # CUBLAS_WORKSPACE_CONFIG=:16:8 on an H100: 2 * 128 KiB = 256 KiB
    assert sum(n for _, n in workspace_allocations((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"})) == 256 * KiB


def test_a_zero_workspace_is_not_an_allocation():
    assert workspace_allocations((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":0:8"}) == []


def test_context_bytes_comes_from_the_table():
    assert context_bytes(GPUS["H100-80GB"]) == GPUS["H100-80GB"].context_bytes
    assert context_bytes(None) == GENERIC_CONTEXT_BYTES  # no GPU named: the generic estimate
    with pytest.raises(UsageError):
        context_bytes("H100")


def test_eager_module_loading_adds_the_measured_difference(monkeypatch):
    # pytorch/pytorch#86509, after a first tensor on the GPU (cudaMemGetInfo total - free):
    # 666,632,192 B with eager loading, 287,047,680 B lazy: 379,584,512 B more
    from memcheck.cuda.gpus import GPUS
    from memcheck.cuda.overhead import context_bytes, module_loading

    gpu = GPUS["A100-80GB"]
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    assert module_loading() == "lazy" and context_bytes(gpu) == gpu.context_bytes
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    assert module_loading() == "eager" and context_bytes(gpu) == gpu.context_bytes + 379_584_512


def test_context_source_names_the_figure_and_the_eager_addition(monkeypatch):
    from memcheck.cuda.gpus import GPUS
    from memcheck.cuda.overhead import context_source

    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    assert context_source(GPUS["RTX-3090"]) == GPUS["RTX-3090"].context_source
    assert context_source(None).startswith("estimated: 512 MiB")  # no GPU named: the generic estimate
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    # 379,584,512 B / 2**20 = 362.0 MiB, pytorch#86509's eager-minus-lazy difference
    assert context_source(GPUS["T4"]).endswith("; + 362 MiB for eager module loading (measured, pytorch#86509)")
    with pytest.raises(UsageError):
        context_source("T4")


def test_the_report_carries_the_context_source(monkeypatch):
    import torch

    import memcheck
    from memcheck.report.text import render_estimate

    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    est = memcheck.estimate(model, torch.empty(4, 8, device="meta"), memcheck.Job(gpu="RTX-3090"))
    # 256 MiB published bare context + 187 MiB estimated step kernels = 443 MiB
    assert est.context_bytes == 443 * 2**20
    assert est.to_dict()["cuda_context_source"].startswith("published: 256 MiB bare (invoke-ai/InvokeAI#9413")
    # the label is wrapped in its cell to keep the table at 80 columns (layout)
    text = render_estimate(est)
    assert "CUDA context and libraries" in text
    assert "(published bare context + estimate, lazy module loading)" in text
    assert any("invoke-ai/InvokeAI#9413" in a for a in est.assumptions)
    cpu = memcheck.estimate(model, torch.empty(4, 8, device="meta"), memcheck.Job(device="cpu"))
    assert cpu.to_dict()["cuda_context_source"] is None


def test_the_report_names_the_module_loading(monkeypatch):
    import torch

    import memcheck

    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    est = memcheck.estimate(model, torch.empty(4, 8, device="meta"), memcheck.Job(gpu="T4"))
    assert est.module_loading == "eager" and est.to_dict()["cuda_module_loading"] == "eager"
    from memcheck.report.text import render_estimate

    assert "CUDA context and libraries (estimate, eager module loading)" in render_estimate(est)
