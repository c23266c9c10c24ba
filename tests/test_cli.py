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
