"""``memcheck run`` (memcheck.engine.script): a user's unmodified training script, traced as it runs.

The oracle is the same script run for real on the CPU under the profiler
(``memcheck.measure.local.measure_script``), with every sample already ``max_len`` tokens
long (``--min-len`` = ``--max-len``), so the real batches are the worst case that memcheck
pads to. The real run trains 2 steps (``--max-steps 2``); memcheck is given a script that
would train 5 and must stop it after 2 by itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from memcheck import Job, run_script
from memcheck.cli import main
from memcheck.errors import TraceError, UsageError
from memcheck.measure.local import measure_script

SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "scripts"
LEN = ["--max-len", "128", "--min-len", "128", "--batch-size", "4"]


def _within(estimate: int, measured: int, tolerance: float = 0.02) -> None:
    assert abs(estimate - measured) <= tolerance * measured, (estimate, measured, estimate / measured - 1)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_loop.py", "train_hf_trainer.py", "train_lightning.py", "train_accelerate.py"])
def test_script_estimate_matches_a_real_cpu_run_of_the_same_script(script):
    measured = measure_script([str(SCRIPTS / script), *LEN, "--max-steps", "2"])
    est = run_script([sys.executable, str(SCRIPTS / script), *LEN, "--max-steps", "5"], Job(device="cpu", max_len=128))
    _within(est.peak_bytes, measured.steady_peak_bytes)
    assert est.peak_step == 2


def test_a_script_is_stopped_after_the_traced_steps_and_says_what_it_ran():
    est = run_script([str(SCRIPTS / "train_loop.py"), *LEN, "--max-steps", "1000", "--width", "64"],
                     device="cpu", max_len=128)
    assert "train_loop.py ran as written: its own loop, traced for 2 optimizer steps, then stopped at the next " \
           "forward" in est.assumptions
    assert est.optimizer == "AdamW (for-loop)"  # on meta torch's default for a CPU model is the for-loop


def test_each_batch_is_padded_to_max_len_along_its_token_dimension():
    # samples of 8 to 16 tokens, padded per batch to the longest (at most 16); the model gets ids[:, :-1]
    est = run_script([str(SCRIPTS / "train_loop.py"), "--max-len", "128", "--min-len", "8", "--max-len", "16",
                      "--batch-size", "4", "--width", "64"], device="cpu", max_len=128)
    # the script's own --max-len (16, last given) sizes its position table; memcheck pads to 128
    assert [i.shape for i in est.batch.inputs] == [(4, 127)]  # 128 tokens, the last cut off by ids[:, :-1]


def test_the_cuda_target_takes_torch_default_foreach_for_the_scripts_optimizer():
    est = run_script([str(SCRIPTS / "train_loop.py"), *LEN, "--width", "64"], device="cuda", gpu="A100-80GB",
                     max_len=128)
    assert est.optimizer == "AdamW (foreach)"
    assert est.gpu.name == "A100-80GB"


def test_from_pretrained_builds_from_config_json_on_meta_and_reads_no_weights(tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2).save_pretrained(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"  # a folder without weights
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    ids = torch.randint(0, 1000, (2, 64))\n"
        "    model(input_ids=ids, labels=ids).loss.backward()\n"
        "    opt.step(); opt.zero_grad()\n")
    est = run_script([str(script)], device="cpu", max_len=64)
    # GPT-2 at width 64, 2 layers, vocabulary 1000, 64 positions (lm_head tied to wte):
    # wte 64,000 + wpe 4,096 + per layer (ln 2x128 + c_attn 64x192+192 + c_proj 64x64+64
    # + c_fc 64x256+256 + c_proj 256x64+64) = 256+12,480+4,160+16,640+16,448 = 49,984,
    # x2 = 99,968, + ln_f 128 = 168,192 parameters x 4 B = 672,768 B
    assert est.breakdown_at_peak.params == 672_768


def test_files_the_script_wrote_are_left_as_they_are(tmp_path):
    out = tmp_path / "run"
    est = run_script([str(SCRIPTS / "train_hf_trainer.py"), *LEN, "--output-dir", str(out)], device="cpu",
                     max_len=128)
    assert out.is_dir()  # TrainingArguments made it before training; memcheck leaves it
    assert any("files train_hf_trainer.py wrote are left as they are" in a for a in est.assumptions)


def test_a_script_that_fails_before_training_names_its_own_line(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\n\nopen('no-such-data.csv')\n")
    with pytest.raises(TraceError, match=r"broken.py:3 failed before its first training step \(FileNotFoundError"):
        run_script([str(script)], device="cpu")


def test_a_script_without_two_training_steps_is_refused(tmp_path):
    script = tmp_path / "infer.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(4, 4)\nwith torch.no_grad():\n    model(torch.ones(2, 4))\n")
    with pytest.raises(UsageError, match="infer.py ran to its end with 0 optimizer step"):
        run_script([str(script)], device="cpu")


def test_run_cli_prints_the_report_on_stdout_and_the_scripts_output_on_stderr():
    result = CliRunner().invoke(main, ["run", "--device", "cpu", "--max-len", "128", "--json", "--",
                                       "python", str(SCRIPTS / "train_loop.py"), *LEN, "--width", "64"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"] == "train_loop.py"


@pytest.mark.parametrize("args, message", [
    ([], "needs the script to run after --"),
    (["python", "no_such_script.py"], "no such script: no_such_script.py"),
    (["python", "-m", "train"], "takes a script file"),
    (["python", str(SCRIPTS / "train_loop.py"), "--bogus"], "exited with status 2 before its training step 1"),
])
def test_run_cli_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["run", "--device", "cpu", "--", *args])
    assert result.exit_code == 2
    assert message in result.stderr.splitlines()[-1]


def test_run_leaves_torch_as_it_found_it():
    before = (torch.nn.Module.__call__, torch.Tensor.backward, torch.optim.Optimizer.zero_grad)
    run_script([str(SCRIPTS / "train_loop.py"), *LEN, "--width", "64"], device="cpu", max_len=128)
    assert (torch.nn.Module.__call__, torch.Tensor.backward, torch.optim.Optimizer.zero_grad) == before
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the registration hooks are gone
