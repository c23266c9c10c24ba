"""The GPU table, --gpu parsing and local GPU detection (no GPU here: nvidia-smi is faked)."""

import os
import stat
import sys

import pytest
import torch

from memcheck.errors import UsageError
from memcheck.cuda.gpus import (
    GENERIC_CONTEXT_BYTES,
    GPUS,
    GpuSpec,
    gpu_from_smi,
    local_gpu,
    resolve_gpu,
    sized_gpu,
)

MiB = 2**20
GiB = 2**30

REQUIRED = [
    "V100-16GB", "V100-32GB", "T4", "A10G", "RTX-3090", "RTX-4090",
    "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200",
    "RTX-5090", "RTX-A6000", "H100-NVL", "B200",  # issue 37: GPUs people have in 2026
    "RTX-4080", "L40", "A40", "H100-PCIe", "GH200",
]


def test_the_table_covers_the_common_training_gpus():
    assert set(REQUIRED) <= set(GPUS)
    for name, gpu in GPUS.items():
        assert gpu.name == name and gpu.named
        assert gpu.context_bytes < gpu.capacity_bytes


def test_h100_capacity_is_what_cuda_reports_not_nvidia_smi():
    # torch reports total_memory=81089 MiB; nvidia-smi's memory.total is 81559 MiB.
    assert GPUS["H100-80GB"].capacity_bytes == 81089 * MiB
    assert GPUS["H100-80GB"].arch == (9, 0)
    assert GPUS["A100-40GB"].arch == (8, 0)
    assert GPUS["T4"].arch == (7, 5)


def test_context_estimate_grows_with_the_sm_count():
    # bare 133 MiB + 108 SMs * 2048 threads * 1 KiB (216 MiB) + 187 MiB step kernels = 536 MiB on an A100;
    # bare 133 MiB + 40 SMs * 1024 threads * 1 KiB (40 MiB) + 187 MiB step kernels = 360 MiB on a T4.
    assert GPUS["A100-80GB"].context_bytes == 536 * MiB
    assert GPUS["T4"].context_bytes == 360 * MiB
    assert GPUS["A100-80GB"].context_source.startswith("estimated: 133 MiB + 108 SMs x 2048 threads x 1 KiB")


def test_the_rtx_3090_uses_its_published_bare_context_plus_the_step_kernels():
    # invoke-ai/InvokeAI#9413: a bare context (no kernel run, torch 2.7.1+cu128, lazy) held
    # 256 MiB on an RTX 3090; memcheck adds its 187 MiB estimate of the kernels a training
    # step loads: 256 + 187 = 443 MiB.
    gpu = GPUS["RTX-3090"]
    assert gpu.context_bytes == 443 * MiB
    assert gpu.context_source.startswith("published: 256 MiB bare (invoke-ai/InvokeAI#9413")
    assert "187 MiB step kernels (estimated)" in gpu.context_source


def test_only_gpus_with_a_published_or_measured_context_are_marked_so():
    published = sorted(name for name, gpu in GPUS.items() if gpu.context_source.startswith("published: "))
    measured = sorted(name for name, gpu in GPUS.items() if gpu.context_source.startswith("measured: "))
    assert published == ["RTX-3090"] and measured == ["H200"]
    for gpu in GPUS.values():
        assert gpu.context_source.startswith(("published: ", "measured: ", "estimated: "))


def test_gpus_outside_the_table_say_their_context_is_the_generic_estimate():
    for gpu in (resolve_gpu("24GiB"), gpu_from_smi("NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887, 12.0")):
        assert gpu.context_bytes == 512 * MiB
        assert gpu.context_source.startswith("estimated: 512 MiB")


def test_a_hand_built_spec_says_its_context_was_given():
    gpu = GpuSpec("test", capacity_bytes=GiB, arch=(8, 0), context_bytes=64 * MiB)
    assert gpu.context_source.startswith("given: ")
    with pytest.raises(UsageError, match="context source"):
        GpuSpec("x", GiB, (8, 0), 0, context_source=" ")


@pytest.mark.parametrize("text", ["H100-80GB", "h100-80gb", "h100_80gb", "H100 80GB", "NVIDIA H100-80GB"])
def test_names_match_ignoring_case_dashes_underscores_and_spaces(text):
    assert resolve_gpu(text) is GPUS["H100-80GB"]


@pytest.mark.parametrize(
    "alias, name",
    [("h100", "H100-80GB"), ("H100", "H100-80GB"), ("3090", "RTX-3090"), ("4090", "RTX-4090"),
     ("rtx 3090", "RTX-3090"), ("a100-80g", "A100-80GB"), ("t4", "T4"), ("l40s", "L40S")],
)
def test_unambiguous_aliases(alias, name):
    assert resolve_gpu(alias) is GPUS[name]


@pytest.mark.parametrize("text, names", [("a100", "A100-40GB, A100-80GB"), ("V100", "V100-16GB, V100-32GB")])
def test_an_ambiguous_name_lists_the_candidates(text, names):
    with pytest.raises(UsageError, match=f"ambiguous; use one of: {names}"):
        resolve_gpu(text)


def test_a_binary_size_gives_an_unnamed_sm80_gpu():
    gpu = resolve_gpu("24GiB")
    assert gpu.capacity_bytes == 24 * GiB
    assert gpu.name == "24.0 GiB GPU"
    assert gpu.arch == (8, 0)
    assert gpu.context_bytes == GENERIC_CONTEXT_BYTES
    assert not gpu.named


def test_g_is_binary_and_gb_is_decimal():
    assert resolve_gpu("80G").capacity_bytes == 80 * GiB
    # 24 GB = 24e9 B = 22.35 GiB
    gpu = resolve_gpu("24GB")
    assert gpu.capacity_bytes == 24_000_000_000
    assert gpu.name == "22.4 GiB GPU"


def test_a_bare_number_that_is_not_an_alias_needs_a_unit():
    with pytest.raises(UsageError, match="needs a unit"):
        resolve_gpu("24")


def test_a_zero_size_is_refused():
    with pytest.raises(UsageError, match="greater than zero"):
        resolve_gpu("0GiB")


def test_an_unknown_name_suggests_the_closest_typo():
    with pytest.raises(UsageError) as info:
        resolve_gpu("H100-8GB")
    message = str(info.value)
    assert message == "unknown GPU 'H100-8GB'; did you mean 'H100-80GB'?"


@pytest.mark.parametrize("text, name", [("H10O", "H100-80GB"), ("RTX4900", "RTX-4090"), ("A10", "A10G"),
                                        ("Tesla V100-SXM2-16GB", "V100-16GB")])
def test_a_likely_typo_is_offered_its_card(text, name):
    with pytest.raises(UsageError, match=f"did you mean '{name}'"):
        resolve_gpu(text)


def test_the_rtx_5090_is_in_the_table_with_its_cuda_capacity():
    # deviceQuery on an RTX 5090 (NVIDIA/nccl#1637): 33,680,457,728 B = 32120 MiB + 1,245,184 B (32,120 *
    # 1,048,576 = 33,554,432,000 + 125,829,120 = 33,680,261,120), kept as 32120 MiB = 31.37 GiB; the
    # datasheet's 32 GB of GDDR7 is 32 * 2**30 = 34,359,738,368 B physical, of which CUDA reports 98%.
    gpu = resolve_gpu("RTX-5090")
    assert gpu.capacity_bytes == 33_680_261_120
    assert gpu.arch == (12, 0)
    # bare 133 MiB + 170 SMs * 1536 threads * 1 KiB (255 MiB) + 187 MiB step kernels = 575 MiB
    assert gpu.context_bytes == 575 * MiB
    assert resolve_gpu("5090") is gpu and resolve_gpu("NVIDIA GeForce RTX 5090") is gpu


def test_the_l4_is_cudas_figure_now_not_nvidia_smis():
    # deviceQuery on an L4 (bottlerocket-os/bottlerocket-kernel-kit#139): 23,583,784,960 B = 22491 MiB
    # (22491 * 1,048,576 = 23,583,522,816) + 262,144 B; nvidia-smi says 23034 MiB, 543 MiB (2.4%) more.
    assert GPUS["L4"].capacity_bytes == 23_583_522_816
    assert gpu_from_smi("NVIDIA L4, 23034, 8.9") is GPUS["L4"]


def test_the_h100_nvl_and_rtx_a6000_keep_nvidia_smis_figure_and_say_so():
    from memcheck.cuda.gpus import SMI_CAPACITY

    # nvidia-smi memory.total: H100 NVL 95830 MiB (NVIDIA/gpu-admin-tools#4), RTX A6000 49140 MiB.
    assert GPUS["H100-NVL"].capacity_bytes == 95830 * MiB  # 100,484,382,720 B
    assert GPUS["RTX-A6000"].capacity_bytes == 49140 * MiB
    assert {"H100-NVL", "RTX-A6000"} <= set(SMI_CAPACITY)


@pytest.mark.parametrize("text", ["RTX-5080", "B300", "RTX-3080", "A800", "lots", "GB200", "B100"])
def test_another_model_number_is_not_offered_a_table_card_as_its_match(text):
    # RTX-5090 used to be offered the RTX-4090 (8 GB smaller); a changed digit is another card, and a
    # changed family letter too (a GB200's GPU is not a B200, a B100 not an H100).
    with pytest.raises(UsageError) as info:
        resolve_gpu(text)
    message = str(info.value)
    assert "did you mean" not in message
    assert message.startswith(f"unknown GPU {text!r}; see memcheck gpus")


@pytest.mark.parametrize("text, listed", [
    ("H100-94GB", "at least 94 GB: H100-NVL, GH200"),  # by datasheet: 94 GB, then 96 GB
    ("H100-96GB", "at least 96 GB: GH200, H200"),  # the H100 NVL's 94 GB is less: not listed
    ("Quadro-48GB", "at least 48 GB: L40S, L40"),  # 48 GB each; a third would pass 80 columns
    ("B300-288GB", "none has 288 GB: --gpu 288GB"),
])
def test_a_name_with_its_memory_lists_only_cards_at_least_that_large(text, listed):
    with pytest.raises(UsageError) as info:
        resolve_gpu(text)
    assert str(info.value) == f"unknown GPU {text!r}; {listed}"


@pytest.mark.parametrize("text", ["RTX-5080", "H100-80GX", "RTX4900", "H100-94GB", "B300-288GB",
                                  "Quadro-48GB", "H100-96GB", "lots"])
def test_the_unknown_gpu_line_fits_80_columns_as_the_cli_prints_it(text):
    with pytest.raises(UsageError) as info:
        resolve_gpu(text)
    assert len(f"memcheck: error: --gpu: {info.value}") <= 80


def test_a_number_with_letters_that_are_not_a_unit_is_an_unknown_name():
    with pytest.raises(UsageError, match="unknown GPU '4090D'.*did you mean 'RTX-4090'"):
        resolve_gpu("4090D")


def test_a_gpuspec_passes_through():
    gpu = sized_gpu(10 * GiB)
    assert resolve_gpu(gpu) is gpu


def test_a_gpuspec_checks_itself():
    with pytest.raises(UsageError, match="capacity"):
        GpuSpec("x", 0, (8, 0), 0)
    with pytest.raises(UsageError, match="compute capability"):
        GpuSpec("x", GiB, (8,), 0)


def test_usable_bytes_is_capacity_less_context():
    gpu = GPUS["H100-80GB"]
    assert gpu.usable_bytes == (81089 - 767) * MiB


# --- nvidia-smi output ---------------------------------------------------------------


@pytest.mark.parametrize(
    "line, name",
    [
        ("NVIDIA H100 80GB HBM3, 81559, 9.0", "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB, 40960, 8.0", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB, 81920, 8.0", "A100-80GB"),
        ("Tesla V100-SXM2-32GB, 32510, 7.0", "V100-32GB"),
        ("Tesla T4, 15360, 7.5", "T4"),
        ("NVIDIA GeForce RTX 3090, 24268, 8.6", "RTX-3090"),
        ("NVIDIA GeForce RTX 4090, 24564, 8.9", "RTX-4090"),
        ("NVIDIA L4, 23034, 8.9", "L4"),
        ("NVIDIA H200, 143771, 9.0", "H200"),
        ("NVIDIA B200, 183359, 10.0", "B200"),
        ("NVIDIA H100 NVL, 95830, 9.0", "H100-NVL"),  # not the H100-80GB: memory.total picks the row
        ("NVIDIA GeForce RTX 5090, 32607, 12.0", "RTX-5090"),
        ("NVIDIA RTX A6000, 49140, 8.6", "RTX-A6000"),
        ("NVIDIA H100 PCIe, 81559, 9.0", "H100-PCIe"),  # same memory.total as the SXM: the name decides
        ("NVIDIA GH200 480GB, 97871, 9.0", "GH200"),  # "gh200" holds "h200": memory.total decides
        ("NVIDIA L40, 46068, 8.9", "L40"),
        ("NVIDIA L40S, 46068, 8.9", "L40S"),
        ("NVIDIA A40, 46068, 8.6", "A40"),
        ("NVIDIA GeForce RTX 4080, 16376, 8.9", "RTX-4080"),
        ("NVIDIA A10G, 23028", "A10G"),  # an old driver without compute_cap
    ],
)
def test_nvidia_smi_names_map_to_the_table(line, name):
    assert gpu_from_smi(line) is GPUS[name]


def test_an_unlisted_card_keeps_nvidia_smis_figures():
    # RTX PRO 6000 Blackwell: not in the table, so its nvidia-smi figures and arch are kept.
    blackwell = gpu_from_smi("NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887, 12.0")
    assert blackwell.name == "NVIDIA RTX PRO 6000 Blackwell Server Edition" and not blackwell.named
    assert blackwell.arch == (12, 0) and blackwell.capacity_bytes == 97887 * MiB
    assert blackwell.context_bytes == GENERIC_CONTEXT_BYTES


@pytest.mark.parametrize("line", ["", "garbage", "NVIDIA H100, [N/A], 9.0", "NVIDIA X, 0, 9.0"])
def test_unreadable_lines_give_none(line):
    assert gpu_from_smi(line) is None


def test_local_gpu_is_none_here_and_does_not_initialise_cuda(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi on this machine, and none found
    assert local_gpu() is None
    assert resolve_gpu(None) is None
    assert not torch.cuda.is_initialized()


def _fake_smi(tmp_path, body):
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


@pytest.mark.skipif(os.name != "posix", reason="fake nvidia-smi is a POSIX script")
def test_local_gpu_reads_nvidia_smi_without_touching_cuda(tmp_path, monkeypatch):
    body = (
        "import sys\n"
        "assert '--format=csv,noheader,nounits' in sys.argv\n"
        "print('NVIDIA H100 80GB HBM3, 81559, 9.0')\n"
        "print('NVIDIA H100 80GB HBM3, 81559, 9.0')"
    )
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, body))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_gpu() is GPUS["H100-80GB"]
    assert not torch.cuda.is_initialized()


@pytest.mark.skipif(os.name != "posix", reason="fake nvidia-smi is a POSIX script")
def test_local_gpu_retries_without_compute_cap_and_honours_cuda_visible_devices(tmp_path, monkeypatch):
    body = (
        "import sys\n"
        "if 'compute_cap' in sys.argv[1]: sys.exit(2)\n"
        "assert sys.argv[-2:] == ['-i', '3'], sys.argv\n"
        "print('NVIDIA A100-SXM4-80GB, 81920')"
    )
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, body))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert local_gpu() is GPUS["A100-80GB"]


@pytest.mark.skipif(os.name != "posix", reason="fake nvidia-smi is a POSIX script")
@pytest.mark.parametrize("visible", ["", "-1", "MIG-4f0b2c1e-0000-0000-0000-000000000000"])
def test_no_visible_device_or_a_mig_slice_gives_none(tmp_path, monkeypatch, visible):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, "print('NVIDIA H100 80GB HBM3, 81559, 9.0')"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert local_gpu() is None


@pytest.mark.skipif(os.name != "posix", reason="fake nvidia-smi is a POSIX script")
def test_a_hanging_nvidia_smi_times_out_to_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, "import time; time.sleep(30)"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_gpu(timeout=0.5) is None


def test_library_versions_read_cudnn_without_initialising_cuda(monkeypatch):
    # On an H200 with torch 2.11 an estimate initialised CUDA here: torch.backends.cudnn.version()
    # checks every device's compute capability (torch/backends/cudnn/__init__.py, _init). Stand in a
    # CUDA 13.0 build with cuDNN 9.19.0 whose CUDA must not start.
    import types

    from memcheck.cuda.gpus import local_library_versions

    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA was initialised")

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch._C, "_cudnn", types.SimpleNamespace(getVersionInt=lambda: 91900), raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.backends.cudnn, "version", no_cuda)
    assert local_library_versions() == {"cuda_version": (13, 0), "cudnn_version": 91900}


def test_the_h200_context_is_the_one_measured_on_an_h200():
    # benchmarks/results/NVIDIA_H200-2026-11-26-run/measured.jsonl: cudaMemGetInfo's used memory
    # less max_memory_reserved was 804,061,184 B = 766.8 MiB in 20 of 27 runs; the table rounds to
    # 767 MiB. The H100 (same GH100 chip) borrows it and says so.
    assert GPUS["H200"].context_bytes == 767 * 2**20
    assert GPUS["H200"].context_source.startswith("measured: 767 MiB")
    assert GPUS["H100-80GB"].context_source.startswith("estimated: 767 MiB measured on an H200")
    # The H100 PCIe has 114 of the 132 SMs: 767 - 18 SMs x 2048 threads x 1 KiB (36 MiB) = 731 MiB.
    assert GPUS["H100-PCIe"].context_bytes == 731 * 2**20


def test_every_table_gpu_has_its_datasheet_size_and_rates():
    from memcheck.cuda.gpus import DATASHEET_GB, RATES

    assert set(DATASHEET_GB) == set(GPUS) == set(RATES)  # no table card falls back to the A100's rates


@pytest.mark.parametrize("size", [8, 16, 24, 32, 40, 48, 80, 94, 96, 141, 180])
def test_no_card_with_less_memory_than_the_name_says_is_ever_offered(size):
    from memcheck.cuda.gpus import DATASHEET_GB

    with pytest.raises(UsageError) as info:
        resolve_gpu(f"Mystery-{size}GB")
    offered = str(info.value).split(f"at least {size} GB: ")[1].split(", ")
    assert offered and all(DATASHEET_GB[name] >= size for name in offered), str(info.value)
