"""The user's own training step (issue 17): a model file's ``train_step(model, batch, optimizer)``
is traced as it is, checked against a real CPU run of the same step."""

import importlib.util

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.measure.local import measure_cpu
from memcheck.workloads.source import load_workload

EXAMPLE = "examples/late_zero_grad.py"
# Its MLP's parameters: 512 x 2,048 + 2,048 + 2,048 x 2,048 + 2,048 + 2,048 x 10 + 10 = 5,267,466,
# so a full set of fp32 gradients is 5,267,466 x 4 = 21,069,864 B.
GRAD_BYTES = 21_069_864


def _module():
    spec = importlib.util.spec_from_file_location("late_zero_grad", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)  # no state and no step temporaries: the gradients stand out


def test_a_step_that_zeroes_gradients_after_the_forward_matches_a_real_cpu_run():
    # batch 1,024 with plain SGD: the peak is at the loss, with last step's gradients still alive
    # through the forward (zero_grad comes after it)
    work = load_workload(EXAMPLE, batch_size=1024)
    est = memcheck.estimate(work.model, work.batch, memcheck.Job(device="cpu", optimizer=_sgd),
                            train_step=work.train_step)
    module = _module()
    torch.manual_seed(0)
    real = measure_cpu(lambda: (module.build_model(), module.make_batch(1024)), _sgd, train_step=module.train_step)
    assert abs(est.peak_bytes - real.steady_peak_bytes) <= 0.02 * real.steady_peak_bytes
    assert est.peak_phase.value == "loss"
    assert est.breakdown_at_peak.grads == GRAD_BYTES  # every gradient of the step before is live at the peak
    assert any("model's own train_step(model, batch, optimizer), traced as it is" in a for a in est.assumptions)


def test_memchecks_own_loop_frees_the_gradients_before_the_forward():
    # the same model, batch and SGD through memcheck's loop (zero_grad at the end of each step):
    # no gradient of the step before is live in the forward, and the peak is in the backward
    work = load_workload(EXAMPLE, batch_size=1024)
    job = memcheck.Job(device="cpu", optimizer=_sgd)
    own = memcheck.estimate(work.model, work.batch, job, train_step=work.train_step)
    loop = memcheck.estimate(work.model, work.batch, job,
                             loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert loop.peak_phase.value == "backward" and loop.breakdown_at_peak.grads < GRAD_BYTES
    assert loop.peak_bytes < own.peak_bytes


@pytest.mark.parametrize("settings, words", [
    (dict(precision="amp-bf16"), "precision amp-bf16 is memcheck's autocast around its own loop"),
    (dict(accumulate=2), "accumulate must be 1 with a train_step"),
])
def test_what_a_train_step_cannot_be_combined_with_is_refused(settings, words):
    work = load_workload(EXAMPLE, batch_size=8)
    with pytest.raises(memcheck.UsageError, match=words):
        memcheck.estimate(work.model, work.batch, memcheck.Job(device="cpu", **settings), train_step=work.train_step)


def test_plan_refuses_a_train_step_it_would_not_trace():
    result = CliRunner().invoke(main, ["plan", EXAMPLE, "--device", "cpu", "--gpu-memory", "1GiB"])
    assert result.exit_code == 2
    assert "defines train_step, which memcheck plan does not trace yet" in result.output


def test_the_cli_traces_the_files_train_step():
    result = CliRunner().invoke(main, [EXAMPLE, "--batch-size", "64", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "traced as it is" in result.output


def _gpt2_and_batch():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=2000, n_positions=128, n_embd=128, n_layer=2, n_head=4))
    ids = torch.randint(0, 2000, (8, 128))
    return model, {"input_ids": ids, "labels": ids}


def _autocast_step(model, batch, optimizer):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the step's own mixed precision
        logits = model(input_ids=batch["input_ids"]).logits
        with torch.autocast("cpu", enabled=False):  # the loss in fp32, as many steps write it
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_steps_own_autocast_is_emulated_and_matches_a_real_cpu_run():
    model, batch = _gpt2_and_batch()
    est = memcheck.estimate(model, batch, memcheck.Job(device="cpu", optimizer=_sgd), train_step=_autocast_step)
    real = measure_cpu(_gpt2_and_batch, _sgd, train_step=_autocast_step)
    assert abs(est.peak_bytes - real.steady_peak_bytes) <= 0.02 * real.steady_peak_bytes
    assert est.job.precision is memcheck.Precision.AMP_BF16  # the header says what the step ran
    assert any("train_step's own torch.autocast (amp-bf16) emulated" in a for a in est.assumptions)
    assert torch.amp.autocast_mode.autocast.__enter__.__name__ == "__enter__"  # torch's own again


def _checkpointed_gpt2_and_batch():
    model, batch = _gpt2_and_batch()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, batch


@pytest.mark.slow
def test_a_steps_own_autocast_under_checkpointing_recomputes_in_its_precision(recwarn):
    # torch.utils.checkpoint recomputes each block in the autocast state its forward had; that state is
    # the emulated region's, so the recomputation casts as the forward did (it used to run in fp32 and
    # fail checkpoint's "Recomputed values ... have different metadata" check).
    model, batch = _checkpointed_gpt2_and_batch()
    est = memcheck.estimate(model, batch, memcheck.Job(device="cpu", optimizer=_sgd), train_step=_autocast_step)
    real = measure_cpu(_checkpointed_gpt2_and_batch, _sgd, train_step=_autocast_step)
    assert abs(est.peak_bytes - real.steady_peak_bytes) <= 0.02 * real.steady_peak_bytes, (
        est.peak_bytes, real.steady_peak_bytes)
    import torch.utils.checkpoint as checkpoint_module

    assert checkpoint_module._get_autocast_kwargs.__module__ == "torch.utils.checkpoint"  # torch's own again


def test_a_cuda_autocast_region_is_emulated_without_torchs_cuda_warning(recwarn):
    def step(model, batch, optimizer):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch).float().sum()
        loss.backward()
        optimizer.step()

    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    est = memcheck.estimate(model, torch.ones(8, 64, device="meta"), memcheck.Job(gpu="A100-80GB"), train_step=step)
    assert est.job.precision is memcheck.Precision.AMP_BF16
    assert not [w for w in recwarn if "Disabling autocast" in str(w.message)]
