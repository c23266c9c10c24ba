"""The command line, through click's CliRunner: exit codes, output, --help."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memcheck.cli import main
from memcheck.job import SPELLINGS

EXAMPLES = Path(__file__).parent.parent / "examples"
TWO_BRANCH = str(EXAMPLES / "two_branch.py")


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_table_is_printed_and_exit_code_is_0_without_budget():
    result = run(TWO_BRANCH, "-b", "8", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "peak (steady state)" in result.output


def test_json_has_the_documented_keys():
    result = run(TWO_BRANCH, "-b", "8", "--device", "cpu", "--json", "--gpu-memory", "1GiB")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("schema_version", "model", "job", "optimizer_implementation", "gpu", "budget_bytes", "fits",
                "peak_bytes", "reserved_bytes", "fragmentation_bytes", "context_bytes", "device_total_bytes",
                "cuda_module_loading", "cuda_context_source", "reserved_peak", "allocator_steady_step", "released_cached", "breakdown_at_peak", "peak_phase", "peak_in", "train_peak_bytes", "eval_peak_bytes", "peak_module",
                "peak_step", "batch", "strategy_label", "busiest_gpu", "per_device", "checkpointed_modules", "work",
                "modules", "assumptions"):  # docs/estimate.md's JSON table, row by row
        assert key in data
    assert data["schema_version"] == 2
    assert set(data["job"]) == {s.json for s in SPELLINGS}  # one key per setting, as docs/reference.md's table
    assert (data["job"]["device"], data["job"]["micro_batch_size"], data["job"]["optimizer"]) == ("cpu", 8, "make_optimizer")  # the file's own factory
    assert set(data["breakdown_at_peak"]) >= {"params", "buffers", "grads", "optimizer", "activations",
                                               "temporaries", "other"}
    assert sum(data["breakdown_at_peak"].values()) == data["peak_bytes"]
    assert data["fits"] is True and data["budget_bytes"] == 2**30


def test_exit_code_1_when_it_does_not_fit():
    result = run(TWO_BRANCH, "-b", "8", "--device", "cpu", "--gpu-memory", "1MiB")
    assert result.exit_code == 1
    assert "DOES NOT FIT" in result.output


def test_estimate_subcommand_is_the_same_as_the_default():
    assert run("estimate", TWO_BRANCH, "-b", "2", "--device", "cpu").exit_code == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.py"], "no such model file"),
        ([TWO_BRANCH, "--device", "tpu"], "allowed: cpu, cuda"),
        ([TWO_BRANCH, "--gpu-memory", "lots"], "--gpu-memory 'lots' is not a size"),
        ([TWO_BRANCH, "-b", "0"], "--batch-size must be a positive integer"),
        ([TWO_BRANCH, "--optimizer", "adamx"], "unknown optimizer"),
        ([TWO_BRANCH, "-b", "abc"], "'abc' is not a valid integer"),
        ([TWO_BRANCH, "--no-such-flag"], "No such option"),
        (["estimate"], "Missing argument"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    result = run(*args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output


def test_every_command_has_help_listing_every_flag():
    top = run("--help")
    assert top.exit_code == 0 and "estimate" in top.output
    est = run("estimate", "--help")
    assert est.exit_code == 0
    for flag in ("--max-len", "--target-len", "--batch-size", "--task", "--attn", "--device", "--precision",
                 "--optimizer", "--steps", "--gpu-memory", "--json", "--allow-download", "--debug", "--top"):
        assert flag in est.output, flag
    assert re.search(r"Exit codes", top.output)


def test_cuda_json_has_reserved_device_total_and_gpu():
    result = run(TWO_BRANCH, "-b", "8", "--gpu", "T4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["gpu"]["name"] == "T4" and data["gpu"]["arch"] == "sm75"
    assert data["reserved_bytes"] >= data["peak_bytes"]
    # device total = reserved + the CUDA context, and fits is judged on it
    assert data["device_total_bytes"] == data["reserved_bytes"] + data["context_bytes"]
    assert data["budget_bytes"] == data["gpu"]["capacity_bytes"]
    # judged against the capacity less the 5% margin, as check and plan judge (one verdict rule)
    assert data["fits"] is (data["device_total_bytes"] <= int(data["budget_bytes"] * 0.95)) and data["margin"] == 0.05
    assert sum(data["breakdown_at_peak"].values()) == data["peak_bytes"]


def test_a_gpu_too_small_for_the_device_total_exits_1():
    # An unnamed GPU's CUDA context is taken as 512 MiB (memcheck.cuda.gpus), so a 512 MiB card
    # has no room left for any tensor: the device total exceeds it although the tensors are tiny.
    result = run(TWO_BRANCH, "-b", "8", "--gpu", "512MiB")
    assert result.exit_code == 1, result.output
    assert "DOES NOT FIT: device total" in result.output


def test_unknown_gpu_name_suggests_the_closest():
    result = run(TWO_BRANCH, "--gpu", "H10O")
    assert result.exit_code == 2
    assert "H100-80GB" in result.output


def test_gpu_with_the_cpu_target_is_refused():
    result = run(TWO_BRANCH, "--device", "cpu", "--gpu", "T4")
    assert result.exit_code == 2
    assert "cuda target only" in result.output


def test_gpus_command_lists_the_table():
    result = run("gpus")
    assert result.exit_code == 0, result.output
    for name in ("V100-16GB", "T4", "A10G", "RTX-3090", "RTX-4090", "L4", "L40S", "A100-40GB", "A100-80GB",
                 "H100-80GB", "H200", "RTX-5090", "RTX-A6000", "H100-NVL", "B200", "RTX-4080", "L40", "A40",
                 "H100-PCIe", "GH200"):
        assert name in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80  # issue 37: was 175 columns
    line = next(ln for ln in result.output.splitlines() if ln.startswith("RTX-3090"))
    # 256 MiB published bare context + 187 MiB estimated step kernels = 443 MiB; GA102 whitepaper: 71
    # TFLOP/s bf16 with fp32 accumulate, 936 GB/s
    assert line.split() == ["RTX-3090", "23.69", "GiB", "sm86", "443.0", "MiB", "published", "71", "936"]
    line = next(ln for ln in result.output.splitlines() if ln.startswith("T4"))
    assert "360.0 MiB" in line and "estimated" in line
    assert "Sources: memcheck gpus --wide or --json." in " ".join(result.output.split())


def test_gpus_wide_adds_the_sources_within_80_columns():
    result = run("gpus", "--wide")
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    text = " ".join(result.output.split())
    assert "RTX-3090: context published: 256 MiB bare (invoke-ai/InvokeAI#9413" in text
    assert "T4: context estimated: 133 MiB + 40 SMs x 1024 threads x 1 KiB" in text
    assert "rates: RTX Blackwell (GB202) whitepaper, fp32 accumulate" in text


def test_gpus_json_carries_the_context_source():
    result = run("gpus", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["RTX-3090"]["context_bytes"] == 443 * 2**20  # 256 + 187 MiB
    assert rows["RTX-3090"]["context_source"].startswith("published: ")
    assert rows["B200"]["context_source"].startswith("estimated: ")
    assert rows["RTX-5090"]["tensor_flops"] == 209.5e12 and rows["RTX-5090"]["bandwidth_bytes_per_s"] == 1792e9


# ---- strategies (issue 4) ------------------------------------------------------------------------

GPT2 = str(EXAMPLES / "gpt2_small.py")


def test_strategy_json_lists_every_gpu():
    result = run(TWO_BRANCH, "-b", "8", "--strategy", "dp", "--gpus", "2", "--gpu", "A100-80GB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["strategy_label"] == "dp x2" and data["job"]["gpus"] == 2
    assert [d["index"] for d in data["per_device"]] == [0, 1]
    for d in data["per_device"]:
        assert set(d) >= {"index", "peak_bytes", "reserved_bytes", "device_total_bytes", "breakdown_at_peak"}
        assert sum(d["breakdown_at_peak"].values()) == d["peak_bytes"]
    assert data["peak_bytes"] == max(d["peak_bytes"] for d in data["per_device"])


def test_strategy_table_has_the_gpus_as_columns():
    result = run(TWO_BRANCH, "-b", "8", "--strategy", "dp", "--gpus", "3", "--gpu", "A100-80GB")
    assert result.exit_code == 0, result.output
    assert re.search(r"per GPU, at its own peak\s+GPU 0\s+GPU 1\s+GPU 2", result.output)
    same = run(TWO_BRANCH, "-b", "8", "--strategy", "ddp", "--gpus", "4", "--gpu", "A100-80GB")
    assert re.search(r"per GPU, at its own peak\s+GPU 0-3", same.output), same.output  # identical ranks share one


def test_compare_prints_one_row_per_strategy():
    result = run(TWO_BRANCH, "-b", "8", "--compare", "--gpus", "2", "--gpu", "A100-80GB")
    assert result.exit_code == 0, result.output
    for name in ("single", "dp x2", "dp-balanced x2", "ddp x2", "fsdp x2", "zero1 x2", "zero2 x2", "zero3 x2"):
        assert re.search(rf"^{re.escape(name)}\s", result.output, re.M), name
    data = json.loads(run(TWO_BRANCH, "-b", "8", "--compare", "--gpus", "2", "--device", "cpu", "--json").output)
    assert len(data["rows"]) == 8 and data["gpus"] == 2


def test_compare_with_one_gpu_lists_single_only():
    result = run(TWO_BRANCH, "-b", "8", "--compare", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "single" in result.output and "ddp" not in result.output


def test_eval_and_checkpointing_flags_reach_the_report():
    result = run(GPT2, "--max-len", "64", "-b", "2", "--device", "cpu", "--checkpointing", "full",
                 "--eval-batch-size", "8", "--eval-accumulate-predictions", "4", "--accumulate", "4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["job"]["accumulation_steps"] == 4 and data["checkpointed_modules"]
    assert data["eval_peak_bytes"] > 0 and data["peak_in"] in ("train", "eval")


@pytest.mark.parametrize("args, message", [
    (["--strategy", "fsdpp"], "unknown strategy 'fsdpp'"),
    (["--strategy", "ddp", "--gpus", "1"], "needs at least 2 GPUs"),
    (["--checkpointing", "nothing.here"], "'nothing.here'"),
    (["--compare", "--strategy", "ddp"], "--compare lists every strategy"),
    (["--eval-batch-size", "0"], "--eval-batch-size must be a positive integer, got 0"),
    (["--offload", "gpu", "--strategy", "fsdp"], "unknown offload 'gpu'"),
])
def test_bad_strategy_flags_exit_2_with_one_line(args, message):
    result = run(TWO_BRANCH, "-b", "8", "--device", "cpu", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
