"""``memcheck plan`` through click's CliRunner: exit codes, the table, the JSON, --measure.

The models are GPT-2s of two blocks written into a temporary directory, so that each
plan takes a handful of traces (about 0.3 s each on a 2-core machine). Numbers are
checked by arithmetic, by feeding the recommended flags back to ``memcheck`` (estimate),
and, for ``--measure``, against a real CPU run measured by the profiler.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
import re
import shlex

import click
import pytest
import torch
from click.testing import CliRunner

from memcheck.cli import main
from memcheck.cuda.gpus import GPUS
from memcheck.report.text import PADDING_NOTE
from memcheck.report.results import PlanOption
from memcheck.units import GiB, MiB

SMALL = """\
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=128{extra}))
"""

# Four wide blocks: 4 * 12 * 1024**2 + (500 + 128) * 1024 = 50.98M parameters, and fp32
# AdamW keeps 16 B of each (weight, gradient, two moments) = 816 MB = 778 MiB: more than a
# 1 GiB GPU leaves after its 5% margin and the 512 MiB context of an unnamed GPU
# (1024 * 0.95 - 512 = 460.8 MiB), whatever is checkpointed.
WIDE = """\
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=1024, n_head=8, vocab_size=500, n_positions=128))
"""

OPTION_FIELDS = {"micro_batch_size", "accumulation_steps", "checkpointing", "precision",
                 "predicted_device_total_bytes", "fits", "relative_cost", "traces",
                 "largest_fitting_micro_batch", "boundary_confirmed", "note", "optimizer", "offload"}
RECOMMENDED = re.compile(r"RECOMMENDED: micro-batch (\d+) x (\d+) accumulation step\(s\)(?: x (\d+) GPUs)? = "
                         r"(\d+) samples per optimizer step")


def run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def plan(*args, env=None):
    return run("plan", *args, env=env)


def setting(out: str, label: str) -> str:
    """A ``label:`` line of the plan table with its continuation lines joined: the table
    wraps it at 80 columns (flags continued with `` \\``, arguments broken after commas,
    each continuation indented 4)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(label + ":"))
    parts = [lines[at].split(label + ":", 1)[1]]
    for line in lines[at + 1:]:
        if not line.startswith("    "):
            break
        parts.append(line)
    return " ".join(p.strip().removesuffix("\\").strip() for p in parts).strip()


def flat(out: str) -> str:
    """The output with its whitespace runs as single spaces: the table wraps its prose at 80
    columns, so a phrase may span lines (layout only)."""
    return " ".join(out.split())


def one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_cli") / "small.py"
    path.write_text(SMALL.format(extra=""))
    return str(path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_cli") / "wide.py"
    path.write_text(WIDE)
    return str(path)


# One plan, printed as the table and as JSON: a 1 GiB GPU, every sequence padded to 32.
ONE_GIB = ("--max-len", "32", "--gpu", "1GiB", "--checkpointing-options", "none,full", "--length-profile",
           "--precision", "fp32", "--optimizer", "adamw")


@pytest.fixture(scope="module")
def table(small):
    result = plan(small, *ONE_GIB)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def as_json(small):
    result = plan(small, *ONE_GIB, "--json")
    assert result.exit_code == 0, result.output
    return result


# ---- --help ----------------------------------------------------------------------------------------


def test_plan_help_lists_every_flag():
    from memcheck.cli import plan as plan_command

    result = run("plan", "--help")
    assert result.exit_code == 0, result.output
    flags = [o for p in plan_command.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts]
    for flag in ("--global-batch", "--margin", "--precision", "--precision-options", "--checkpointing-options",
                 "--measure", "--measure-steps", "--gpu", "--gpu-memory", "--max-len", "--device", "--strategy",
                 "--gpus", "--json", "--debug"):
        assert flag in flags, flag
    for flag in flags:  # as a whole word: "--gpu" must not pass on "--gpus" alone
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.output), flag
    assert "Exit codes" in result.output
    assert "plan" in run("--help").output


# The Job fields memcheck plan chooses itself, so it takes no flag for them, each with why.
PLAN_SEARCHES = {
    "batch_size": "the micro-batch is what plan searches (the largest that fits, or a divisor of --global-batch)",
    "accumulate": "follows from the micro-batch: --global-batch / (micro-batch x GPUs)",
    "checkpointing": "searched over --checkpointing-options (none, half, full)",
}


def test_plan_takes_every_job_setting_estimate_takes():
    """Every Job field is a plan flag, spelled as SPELLINGS spells it, or one plan searches."""
    from memcheck.cli import estimate as estimate_command
    from memcheck.cli import plan as plan_command
    from memcheck.job import SPELLING, Job

    def flags(command):
        return {o for p in command.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}

    taken = flags(plan_command)
    missing = [f.name for f in dataclasses.fields(Job) if f.name in SPELLING  # defaulted: not a setting
               and f.name not in PLAN_SEARCHES and SPELLING[f.name].flag not in taken]
    assert not missing, f"memcheck plan has no flag for Job field(s) {missing}"
    # and the searched ones are estimate's (plan cannot drop a field nobody else takes either)
    assert {SPELLING[f].flag for f in PLAN_SEARCHES} <= flags(estimate_command)
    # estimate's own flags beyond the job's are its table's and pictures'; the rest plan takes too
    own = {"--compare", "--top", "--accumulate", "--checkpointing", "--batch-size", "-b"}
    assert flags(estimate_command) - own <= taken | {"--snapshot", "--plot"}


def test_plan_passes_the_adapters_padding_and_clipping_into_the_job_it_traces(small):
    # one option (fp32, adamw, no checkpointing) on a 64 MiB CPU budget: a few traces of two tiny blocks
    where = ("--device", "cpu", "--gpu-memory", "64MiB", "--max-len", "32", "--precision", "fp32", "--optimizer",
             "adamw", "--checkpointing-options", "none", "--global-batch", "4")
    mine = ("--lora", "r=4,alpha=8,targets=c_attn", "--dora", "--padding", "longest", "--max-grad-norm", "0.5",
            "--eval-batch-size", "2")
    result = plan(small, *where, *mine, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    job = out["job"]
    assert job["lora"] == "r=4,alpha=8,targets=c_attn,dora=true"
    assert (job["padding"], job["max_grad_norm"], job["eval_batch_size"]) == ("longest", 0.5, 2)
    assert out["estimate"]["job"]["lora"] == job["lora"]
    # the table's flags carry them, so that pasting the flags back traces the plan's own job
    table = plan(small, *where, *mine)
    flags = shlex.split(setting(table.stdout, "memcheck flags"))
    for flag in ("--lora", "--padding", "--max-grad-norm", "--eval-batch-size"):
        assert flag in flags, flags
    again = run(small, "--device", "cpu", "--gpu-memory", "64MiB", "--max-len", "32", *flags, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["peak_bytes"] == out["plan"]["predicted_device_total_bytes"]


# ---- the table ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_table_names_the_recommendation_flags_and_training_arguments(table):
    out = table.stdout
    # 1 GiB minus 5%: 1024 MiB * 0.05 = 51.2 MiB held back, 1024 - 51.2 = 972.8 MiB the limit
    assert "limit: device total at most 972.8 MiB = capacity 1.00 GiB minus a 5% margin (51.2 MiB)" in flat(out)
    rec = RECOMMENDED.search(flat(out))
    assert rec, out
    micro, accumulation, samples = int(rec.group(1)), int(rec.group(2)), int(rec.group(4))
    assert rec.group(3) is None  # one GPU: no "x N GPUs"
    assert samples == micro * accumulation  # x 1 GPU
    assert accumulation == 1  # no global batch: the micro-batch is maximised, never accumulated
    flags = setting(out, "memcheck flags")
    assert flags.startswith(f"--batch-size {micro}")
    args = setting(out, "TrainingArguments")
    assert f"per_device_train_batch_size={micro}" in args
    assert f"gradient_accumulation_steps={accumulation}" in args
    if "--checkpointing full" in flags:
        assert "activation_checkpointing=True" in args  # transformers 5's name (gradient_checkpointing: deprecated)


def test_table_lists_the_alternatives_the_length_profile_traces_and_padding(table):
    out = table.stdout
    # both options are rows, the recommended one starred; GPT-2 with n_layer=2 has 2 blocks
    assert re.search(r"^\*?\s+fp32\s+adamw\s+none\s", out, re.M), out
    assert re.search(r"^\*?\s+fp32\s+adamw\s+full \(2/2\)\s", out, re.M), out
    assert len(re.findall(r"^\*\s", out, re.M)) == 1
    # the length profile at 25/50/75/100% of --max-len 32: 8, 16, 24, 32
    for length, share in ((8, 25), (16, 50), (24, 75), (32, 100)):
        assert re.search(rf"^\s*{length}\s+{share}%\s", out, re.M), (length, out)
    assert "longest padded length that fits" in flat(out)
    traces = int(re.search(r"^traces: (\d+)$", out, re.M).group(1))
    per_option = [int(m.group(1)) for m in re.finditer(r"^\*?\s+fp32\s.*\s(\d+)$", out, re.M)]
    assert len(per_option) == 2
    # every option's traces are the plan's, plus lengths 8, 16 and 24 (32 is the recommendation's own)
    assert traces >= sum(per_option) + 3
    assert flat(PADDING_NOTE) in flat(out)


@pytest.mark.slow
def test_json_and_table_are_the_same_plan(table, as_json):
    data = json.loads(as_json.stdout)["plan"]
    rec = RECOMMENDED.search(flat(table.stdout))
    assert (int(rec.group(1)), int(rec.group(2))) == (data["micro_batch_size"], data["accumulation_steps"])
    assert int(re.search(r"^traces: (\d+)$", table.stdout, re.M).group(1)) == data["traces"]


# ---- --json ----------------------------------------------------------------------------------------


def test_json_has_the_plan_and_the_recommendations_own_estimate(as_json):
    data = json.loads(as_json.stdout)
    p, est = data["plan"], data["estimate"]
    for key in ("micro_batch_size", "accumulation_steps", "checkpointing", "precision",
                "predicted_device_total_bytes", "margin_bytes", "traces", "alternatives", "length_profile"):
        assert key in p, key
    assert OPTION_FIELDS == {f.name for f in dataclasses.fields(PlanOption)}
    assert p["alternatives"] and all(set(a) == OPTION_FIELDS for a in p["alternatives"])
    assert p["checkpointing"] in ("none", "full") and p["precision"] == "fp32"
    # capacity 2**30 B; the limit int(2**30 * 0.95) = 1020054732 B; the margin the rest, 53687092 B
    assert p["capacity_bytes"] == GiB
    assert p["limit_bytes"] == int(GiB * 0.95) == 1020054732
    assert p["margin_bytes"] == GiB - 1020054732 == 53687092
    assert p["predicted_device_total_bytes"] <= p["limit_bytes"]
    for alt in p["alternatives"]:
        if alt["fits"]:
            assert alt["predicted_device_total_bytes"] <= p["limit_bytes"]
    # the estimate is the recommended configuration's own trace
    assert est["batch"]["micro_batch_size"] == p["micro_batch_size"]
    assert est["job"]["accumulation_steps"] == p["accumulation_steps"]
    assert est["device_total_bytes"] == p["predicted_device_total_bytes"]
    assert est["job"]["precision"] == p["precision"]
    assert bool(est["checkpointed_modules"]) == (p["checkpointing"] != "none")
    assert est["batch"]["max_len"] == 32
    # the length profile: 8, 16, 24, 32 tokens, memory growing with the length
    lengths = [pt["length"] for pt in p["length_profile"]]
    assert lengths == [8, 16, 24, 32]
    totals = [pt["predicted_device_total_bytes"] for pt in p["length_profile"]]
    assert totals == sorted(totals) and len(set(totals)) == 4
    assert p["length_profile"][-1]["predicted_device_total_bytes"] == p["predicted_device_total_bytes"]
    assert p["traces"] >= sum(o["traces"] for o in p["alternatives"]) + 3


def test_the_recommended_flags_given_to_memcheck_reproduce_the_prediction(small, table, as_json):
    predicted = json.loads(as_json.stdout)["plan"]["predicted_device_total_bytes"]
    flags = shlex.split(setting(table.stdout, "memcheck flags"))
    result = run(small, "--max-len", "32", "--gpu", "1GiB", *flags, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["device_total_bytes"] == predicted


# ---- --global-batch ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_global_batch_is_micro_times_accumulation_times_gpus(small):
    # An 8 MiB CPU budget holds a few samples of 32 tokens: a block saves about 34*s*h + 5*a*s**2
    # 16-bit values per sample (Korthikanti et al. 2022), 34*32*64 + 5*2*32**2 = 79872, so 160 KB in
    # fp32, 320 KB for 2 blocks, and the logits 32 * 500 * 4 B = 64 KB more; micro-batch 24 (= 48 / 2)
    # needs about 24 * 384 KB = 9.2 MB > 8 MiB, so 48 over 2 ranks needs accumulation.
    result = plan(small, "--max-len", "32", "--device", "cpu", "--gpu-memory", "8MiB", "--checkpointing-options",
                  "none", "--strategy", "ddp", "--gpus", "2", "--global-batch", "48", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    p, est = data["plan"], data["estimate"]
    assert p["micro_batch_size"] * p["accumulation_steps"] * 2 == 48
    assert p["accumulation_steps"] > 1  # the micro-batch 24 (= 48 / 2) does not fit in 8 MiB
    assert 24 % p["micro_batch_size"] == 0
    assert p["effective_global_batch"] == p["global_batch"] == 48 and p["gpus"] == 2
    assert est["batch"]["micro_batch_size"] == p["micro_batch_size"]
    assert est["job"]["accumulation_steps"] == p["accumulation_steps"]
    assert est["strategy_label"] == "ddp x2" and est["job"]["gpus"] == 2
    # on the CPU target the limit is on the peak: int(8 MiB * 0.95) = 7969177 B
    assert p["limit_bytes"] == int(8 * MiB * 0.95) == 7969177
    assert est["peak_bytes"] == p["predicted_device_total_bytes"] <= 7969177


def test_global_batch_not_divisible_by_the_gpus_exits_2_naming_both(small):
    result = plan(small, "--gpu", "1GiB", "--strategy", "ddp", "--gpus", "2", "--global-batch", "33")
    assert result.exit_code == 2
    line = one_line(result)
    # 33 = 16 * 2 + 1: the nearest multiples of 2 are 32 and 34
    assert "33" in line and "2 GPUs" in line and "32" in line and "34" in line


# ---- nothing fits ------------------------------------------------------------------------------------


# fp32 and torch's AdamW pinned: left to choose, the plan fits WIDE in bf16 (test_the_default_search_...).
NOTHING_FITS = ("--max-len", "32", "--gpu", "1GiB", "--checkpointing-options", "full", "--precision", "fp32",
                "--optimizer", "adamw")


@pytest.fixture(scope="module")
def nothing_fits_json(wide):
    result = plan(wide, *NOTHING_FITS, "--json")
    assert result.exit_code == 1, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_nothing_fits_exits_1_and_says_what_would(wide, nothing_fits_json):
    result = plan(wide, *NOTHING_FITS)
    assert result.exit_code == 1, result.output
    assert "NOTHING FITS" in result.stdout and "RECOMMENDED" not in result.stdout
    what = setting(result.stdout, "what would")
    smallest = min(GPUS.values(), key=lambda g: g.capacity_bytes)
    # 816 MB of state + a 360 MiB context is far below the smallest table GPU's 14.75 GiB
    assert f"one {smallest.name} " in what, what
    assert re.search(r"fsdp over \d+ GPUs of this size holds", what), what

    data = nothing_fits_json
    p = data["plan"]
    assert p["fits"] is False and data["estimate"] is None
    assert p["micro_batch_size"] is None and p["accumulation_steps"] is None
    assert p["suggestion"] == what
    # Not traced: fp32 weights, gradients and AdamW's two moments are 16 B a parameter, over
    # 16 * 50.98M B = 778 MiB, plus the unnamed GPU's 512 MiB context: over 1.26 GiB, past the limit.
    assert p["alternatives"] == []
    (skipped,) = p["not_traced"]
    assert skipped.startswith("fp32, adamw: not traced: its weights, gradients and optimizer state alone take ")
    floor = float(re.search(r"take ([0-9.]+) GiB", skipped).group(1))
    assert floor >= (16 * 50.98e6 + 512 * 2**20) / GiB > p["limit_bytes"] / GiB


def test_what_would_fit_is_what_memcheck_estimates(wide, nothing_fits_json):
    """The GPU and the fsdp GPU count the plan names, checked one by one with ``memcheck``."""
    what = nothing_fits_json["plan"]["suggestion"]
    count = int(re.search(r"fsdp over (\d+) GPUs", what).group(1))
    smallest = min(GPUS.values(), key=lambda g: g.capacity_bytes)
    common = (wide, "--max-len", "32", "-b", "1", "--checkpointing", "full", "--json")

    def total(*args):
        out = run(*common, *args)
        assert out.exit_code in (0, 1), out.output
        return json.loads(out.stdout)["device_total_bytes"]

    assert total("--gpu", smallest.name) <= smallest.capacity_bytes * 0.95
    assert total("--gpu", "1GiB", "--strategy", "fsdp", "--gpus", str(count)) <= GiB * 0.95
    # 777.9 MiB of state over 2 ranks is 388.9 MiB; with the 512 MiB context that is 900.9 MiB, and one
    # gathered block (12 * 1024**2 * 4 B = 48 MiB) with its full gradient (48 MiB) passes 972.8 MiB
    assert count >= 3
    # the fewest: one GPU fewer does not fit (the plan traced it too, and says so)
    assert total("--gpu", "1GiB", "--strategy", "fsdp", "--gpus", str(count - 1)) > GiB * 0.95
    assert f"({count - 1} GPUs: " in what
    sharded = nothing_fits_json["plan"]["sharded"]
    assert sharded["strategy"] == "fsdp" and sharded["gpus"] == count and sharded["fewer_do_not_fit"]


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--gpu", "1GiB", "--margin", "1.5"], "got 1.5"),
    (["--gpu", "1GiB", "--margin", "-0.1"], "got -0.1"),
    (["--gpu", "1GiB", "--precision-options", "fp33"], "did you mean 'fp32'"),
    (["--gpu", "1GiB", "--checkpointing-options", "bogus"], "'bogus'"),
    (["--gpu", "T4", "--device", "cpu"], "cuda target only"),
    (["--gpu", "1GiB", "--global-batch", "0"], "--global-batch must be a positive integer, got 0"),
    (["--gpu", "1GiB", "--measure", "--measure-steps", "1"], "--measure-steps"),
    (["--gpu", "1GiB", "--strategy", "fsdpp"], "unknown strategy 'fsdpp'"),
])
def test_bad_input_exits_2_with_one_line(small, args, message):
    result = plan(small, "--max-len", "32", *args)
    assert result.exit_code == 2, result.output
    assert message in one_line(result)


def test_margin_names_the_allowed_range(small):
    line = one_line(plan(small, "--max-len", "32", "--gpu", "1GiB", "--margin", "1.5"))
    assert "margin" in line and "[0, 1)" in line


def test_checkpointing_option_lists_the_allowed_ones(small):
    line = one_line(plan(small, "--max-len", "32", "--gpu", "1GiB", "--checkpointing-options", "none,bogus"))
    assert "none, half, full" in line


def test_no_capacity_on_the_cuda_target_without_a_local_gpu_asks_for_the_gpu(small):
    # CUDA_VISIBLE_DEVICES="" hides any GPU from memcheck.cuda.gpus.local_gpu, as on a machine with none
    result = plan(small, "--max-len", "32", env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert "name the GPU" in line and "--gpu" in line and "--gpu-memory" in line


# ---- progress ----------------------------------------------------------------------------------------


def test_json_prints_nothing_but_json_and_stderr_stays_empty(as_json, table):
    assert as_json.stdout.lstrip().startswith("{") and as_json.stdout.rstrip().endswith("}")
    json.loads(as_json.stdout)
    # CliRunner's stderr is not a tty, so no progress lines in either output
    assert as_json.stderr == "" and table.stderr == ""
    assert "\r" not in table.stdout and "\033[" not in table.stdout


# ---- --measure ---------------------------------------------------------------------------------------

MEASURE_CPU = ("--max-len", "32", "--device", "cpu", "--gpu-memory", "8MiB", "--checkpointing-options", "full",
               "--measure", "--measure-steps", "2")


def test_measure_on_the_cpu_target_prints_the_measured_line(small):
    result = plan(small, *MEASURE_CPU)
    assert result.exit_code == 0, result.output
    assert re.search(r"^MEASURED over 2 real steps on cpu: peak \(profiler\) ", result.stdout, re.M), result.stdout


def test_measure_on_the_cpu_target_is_within_1_percent_of_the_profiler(small):
    """The oracle: the recommendation built for real and trained for 2 steps under torch.profiler."""
    result = plan(small, *MEASURE_CPU, "--json")
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)["plan"]
    v = p["verification"]
    assert v["device"] == "cpu" and v["steps"] == 2 and v["out_of_memory"] is False
    assert v["predicted_bytes"] == p["predicted_device_total_bytes"]
    assert abs(v["measured_bytes"] - v["predicted_bytes"]) <= 0.01 * v["measured_bytes"], v
    # and the real run stayed inside the budget: 8 MiB = 8388608 B
    assert v["measured_bytes"] <= 8 * MiB


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA GPU")
def test_measure_on_the_cuda_target_without_a_gpu_exits_2(small):
    result = plan(small, "--max-len", "32", "--gpu", "1GiB", "--checkpointing-options", "none", "--measure")
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert "CUDA GPU" in line and "torch sees none" in line


# ---- known bugs (strict: each fails loudly once it is fixed, so the marker can go) -------------------


def test_global_batch_below_the_gpu_count_suggests_two_different_sizes(small):
    line = one_line(plan(small, "--gpu", "1GiB", "--strategy", "ddp", "--gpus", "2", "--global-batch", "1"))
    assert "use 2 or 2" not in line


def test_gpus_without_a_strategy_is_refused_by_estimate_and_searched_by_plan(small):
    assert run(small, "--max-len", "32", "--gpu", "1GiB", "--gpus", "2").exit_code == 2  # estimate refuses
    # issue 21: plan --gpus N with no strategy searches the layouts of N GPUs (memcheck.engine.plan_layout)
    result = plan(small, "--max-len", "32", "--gpu", "1GiB", "--gpus", "2", "--global-batch", "4",
                  "--checkpointing-options", "none")
    assert result.exit_code == 0, result.output
    assert "RECOMMENDED: --layout dp=2" in result.output


def test_measure_runs_the_attention_implementation_it_planned(tmp_path):
    # attn_pdrop=0, so that sdpa takes the fused CPU kernel and eager's saved scores make the difference
    path = tmp_path / "nodrop.py"
    path.write_text(SMALL.format(extra=", attn_pdrop=0.0").replace("n_head=2", "n_head=8"))
    result = plan(str(path), "--max-len", "128", "--device", "cpu", "--gpu-memory", "16MiB", "--attn", "eager",
                  "--checkpointing-options", "none", "--measure", "--measure-steps", "2", "--json")
    assert result.exit_code in (0, 1), result.output
    v = json.loads(result.stdout)["plan"]["verification"]
    assert abs(v["measured_bytes"] - v["predicted_bytes"]) <= 0.01 * v["measured_bytes"], v


def test_measure_runs_pure_bf16_in_bf16(small):
    result = plan(small, "--max-len", "32", "--device", "cpu", "--gpu-memory", "8MiB", "--precision", "bf16",
                  "--checkpointing-options", "none", "--measure", "--measure-steps", "2", "--json")
    assert result.exit_code in (0, 1), result.output
    v = json.loads(result.stdout)["plan"]["verification"]
    assert abs(v["measured_bytes"] - v["predicted_bytes"]) <= 0.01 * v["measured_bytes"], v


@pytest.mark.slow
def test_the_toml_the_plan_prints_is_a_memcheck_check_job_with_the_same_device_total(table, as_json, small):
    """The copy-paste TOML block, pasted under the job's own top-level keys, checks the same job."""
    lines = table.stdout.splitlines()
    at = lines.index("  memcheck check (TOML):")
    block = []
    for line in lines[at + 1:]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    assert block[0] == "[jobs.recommended]"
    config = Path(small).parent / "plan.toml"  # a config names model files beside it only
    config.write_text('model = "small.py"\ngpu = "1GiB"\nmax_len = 32\n' + "\n".join(block) + "\n")
    result = run("check", str(config), "--json")
    assert result.exit_code == 0, result.output
    (checked,) = json.loads(result.stdout)["results"]
    data = json.loads(as_json.stdout)["plan"]
    assert checked["fits"] and checked["total_bytes"] == data["predicted_device_total_bytes"]


def test_a_model_files_own_optimizer_is_named_in_the_plan_and_left_out_of_its_toml():
    # examples/two_branch.py defines make_optimizer: the plan traces it and names it; a config key
    # cannot name a function, so the TOML job leaves the optimizer to the file (it was a crash: exit 3).
    from click.testing import CliRunner

    from memcheck.cli import main

    args = ["plan", "examples/two_branch.py", "--device", "cpu", "--gpu-memory", "1GiB", "--max-len", "8"]
    text = CliRunner().invoke(main, args)
    assert text.exit_code == 0, text.output
    assert "make_optimizer" in text.output and 'optimizer = "' not in text.output
    as_json = CliRunner().invoke(main, [*args, "--json"])
    assert as_json.exit_code == 0 and '"optimizer": "make_optimizer"' in as_json.output


def _block(out: str, header: str) -> list[str]:
    """The lines under a ``header`` line of the plan table, without their 4-space indent."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    block = []
    for line in lines[at + 1:]:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return block


# accelerate's mixed_precision under FSDP also sets FSDP's policy to that dtype (trainer_files.fsdp_mixed_precision)
POLICY = {"fsdp": ("--param-dtype", "bf16", "--reduce-dtype", "bf16", "--output-dtype", "bf16"),
          "fsdp1": ("--param-dtype", "bf16", "--reduce-dtype", "bf16"), "ddp": ()}


def _two_gpu_plan(small, strategy: str, *more: str, gpu: str = "1GiB", precision: str = "amp-bf16"):
    """A plan of ``small`` over 2 GPUs at 32 tokens, no checkpointing, AdamW: its table and its JSON plan."""
    args = (small, "--max-len", "32", "--gpu", gpu, "--gpus", "2", "--strategy", strategy, "--checkpointing-options",
            "none", "--precision-options", precision, "--optimizer", "adamw", *more)
    result = plan(*args)
    assert result.exit_code == 0, result.output
    return result, json.loads(plan(*args, "--json").stdout)["plan"]


def _checked_total(*args: str) -> int:
    """The device total ``memcheck check ARGS --json`` gives its one job, which must fit."""
    checked = run("check", *args, "--json")
    assert checked.exit_code == 0, checked.output
    (job,) = json.loads(checked.stdout)["results"]
    return job["total_bytes"]


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "ddp"])
def test_the_accelerate_config_the_plan_prints_checks_the_same_job(small, strategy):
    """A multi-GPU plan's accelerate config, pasted into a file, read back through a memcheck check job's
    trainer_config (the job's batch, accumulation, checkpointing and optimizer beside it, as the training
    script sets them), gives the plan's own device total."""
    result, r = _two_gpu_plan(small, strategy, *POLICY[strategy])
    yaml_lines = _block(result.stdout, "  accelerate config (YAML")
    assert "num_processes: 2" in yaml_lines and 'mixed_precision: "bf16"' in yaml_lines
    folder = Path(small).parent
    (folder / f"accelerate_{strategy}.yaml").write_text("\n".join(yaml_lines) + "\n")
    (folder / f"accel_{strategy}.toml").write_text(
        f'model = "small.py"\ngpu = "1GiB"\nmax_len = 32\ntrainer_config = "accelerate_{strategy}.yaml"\n'
        f'micro_batch = {r["micro_batch_size"]}\naccumulation = {r["accumulation_steps"]}\ncheckpointing = "none"\n'
        'optimizer = "adamw"\nassume = ["padding"]\n')
    assert _checked_total(str(folder / f"accel_{strategy}.toml")) == r["predicted_device_total_bytes"]


def test_the_deepspeed_config_the_plan_prints_checks_the_same_job(small):
    """A ZeRO-3 plan's DeepSpeed JSON, pasted into a file and given to memcheck check with the model
    (as its --model form takes a DeepSpeed config), gives the plan's own device total."""
    result, r = _two_gpu_plan(small, "zero3", gpu="4GiB", precision="bf16")
    config = json.loads("\n".join(_block(result.stdout, "  DeepSpeed config (JSON")))
    assert config["zero_optimization"] == {"stage": 3} and config["bf16"] == {"enabled": True}
    assert "accelerate config" not in result.stdout  # DeepSpeed's own config instead
    path = Path(small).parent / "ds_zero3.json"
    path.write_text(json.dumps(config))
    assert _checked_total(str(path), "--model", small, "--gpu", "4GiB", "--max-len", "32", "--gpus", "2",
                          "--checkpointing", "none") == r["predicted_device_total_bytes"]


def test_an_fsdp_plan_without_accelerates_policy_says_which_flags_would_make_one(small):
    """FSDP2 under autocast with no policy (fp32 gathers) is no accelerate config: the plan says so and
    names the flags of the job an accelerate launch would be."""
    result, _ = _two_gpu_plan(small, "fsdp")
    assert "accelerate config (YAML" not in result.stdout
    assert ("accelerate config: none is this job: accelerate's mixed_precision also gives FSDP a policy in that "
            "dtype, the job of --param-dtype bf16 --reduce-dtype bf16 --output-dtype bf16") in flat(result.stdout)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1"])
def test_the_training_arguments_the_plan_prints_check_the_same_job(small, strategy):
    """A multi-GPU FSDP plan's TrainingArguments line, written as a TrainingArguments JSON and read back through a
    memcheck check job's trainer_config (the world size and checkpointing beside it, which TrainingArguments does not
    hold), gives the plan's own device total; with accelerate's policy (POLICY), as the Trainer's bf16=True gives
    FSDP through accelerate."""
    import ast

    result, r = _two_gpu_plan(small, strategy, *POLICY[strategy])
    call = ast.parse(f"f({setting(result.stdout, 'TrainingArguments')})", mode="eval").body
    arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert arguments["bf16"] is True and arguments["fsdp"] == "full_shard"
    folder = Path(small).parent
    (folder / f"training_args_{strategy}.json").write_text(json.dumps(arguments))
    (folder / f"ta_{strategy}.toml").write_text(
        f'model = "small.py"\ngpu = "1GiB"\nmax_len = 32\ngpus = 2\ntrainer_config = "training_args_{strategy}.json"\n'
        'checkpointing = "none"\nassume = ["padding"]\n')
    assert _checked_total(str(folder / f"ta_{strategy}.toml")) == r["predicted_device_total_bytes"]
