"""The command line, through click's CliRunner: exit codes, output, --help."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memcheck.cli import main

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
    for key in ("peak_bytes", "breakdown_at_peak", "peak_phase", "peak_module", "batch", "device",
                "precision", "optimizer", "budget_bytes", "fits"):
        assert key in data
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
    assert data["fits"] is (data["device_total_bytes"] <= data["budget_bytes"])
    assert sum(data["breakdown_at_peak"].values()) == data["peak_bytes"]


def test_a_gpu_too_small_for_the_device_total_exits_1():
    # An unnamed GPU's CUDA context is taken as 512 MiB (memcheck.gpus), so a 512 MiB card
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
                 "H100-80GB", "H200"):
        assert name in result.output
