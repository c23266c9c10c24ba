"""Single-GPU strategies against real CPU runs (issue 4): accumulation, checkpointing
in both use_reentrant modes, and the evaluation pass.

The oracle is the CPU allocator, as in test_accuracy_cpu: ``torch.profiler`` with
``profile_memory=True`` on a real run of the same work. Checkpointing is turned on
in the *real* model the way a user does it (HF's own call, or torch.utils.checkpoint
written into the model), never with memcheck's code. Target: within 2%.
"""

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

import memcheck
from memcheck.measure.local import measure_cpu
from memcheck.rules.probe import cpu_memory_events
from zoo import ZOO, estimate_zoo, measure_zoo

TOLERANCE = 0.02


def _adamw(params):
    return torch.optim.AdamW(params)


def _hf_checkpointing(reentrant):
    """Turn on HF's gradient checkpointing as a user would, on the real model."""

    def prepare(model):
        kwargs = {"use_reentrant": reentrant}
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:  # transformers < 5.2x
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    return prepare


def _check(name, estimated, measured):
    error = (estimated - measured) / measured
    assert abs(error) <= TOLERANCE, f"{name}: estimated {estimated} B, measured {measured} B ({error:+.2%})"


# ---- gradient accumulation --------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, n", [("mlp", 3), ("gpt2", 4)])
def test_accumulation_matches_a_real_run(name, n):
    # The real run does all n micro-steps; memcheck traces 2 (the rest repeat the second).
    measured = measure_zoo(name, _adamw, accumulate=n)
    est = estimate_zoo(name, "adamw", accumulate=n)
    _check(f"{name} accumulate={n}", est.peak_bytes, measured.steady_peak_bytes)
    assert est.accumulate == n


@pytest.mark.slow
def test_accumulation_keeps_gradients_live_through_the_next_forward():
    # With accumulation, micro-step 2's forward runs with step 1's gradients held, so the
    # peak can only rise; measured on the real runs, and the estimates must agree in kind.
    plain = measure_zoo("gpt2", _adamw).steady_peak_bytes
    accumulated = measure_zoo("gpt2", _adamw, accumulate=2).steady_peak_bytes
    assert accumulated >= plain
    assert estimate_zoo("gpt2", "adamw", accumulate=2).peak_bytes >= estimate_zoo("gpt2", "adamw").peak_bytes


# ---- gradient checkpointing -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_checkpointing_in_user_code_matches_a_real_run(reentrant):
    prepare = _hf_checkpointing(reentrant)
    measured = measure_zoo("gpt2", _adamw, prepare=prepare)
    est = estimate_zoo("gpt2", "adamw", prepare=prepare)
    _check(f"gpt2 HF checkpointing use_reentrant={reentrant}", est.peak_bytes, measured.steady_peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name, reentrant", [("gpt2", False), ("bert", True)])
def test_checkpointing_full_matches_hf_checkpointing_measured(name, reentrant):
    measured = measure_zoo(name, _adamw, prepare=_hf_checkpointing(reentrant))
    est = estimate_zoo(name, "adamw", checkpointing="full", use_reentrant=reentrant)
    _check(f"{name} --checkpointing full", est.peak_bytes, measured.steady_peak_bytes)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(512, 2048), nn.Linear(2048, 512)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Blocks(nn.Module):
    """Four residual MLP blocks; ``reentrant`` None runs them plainly, else through
    torch.utils.checkpoint in the model's own code (blocks 1-3: block 0's input needs
    no gradient, which the reentrant form cannot handle)."""

    def __init__(self, reentrant=None):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.reentrant = reentrant

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if self.reentrant is None or i == 0:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


# Rows enough for activations to outweigh the 4 x 8,398,848 B of weights and gradients:
# each block saves about 2 x 2048 x 2048 x 4 B = 33.5 MB for backward.
ROWS = 2048


def _blocks_loss(model, x):
    return model(x).pow(2).mean()


def _measure_blocks(reentrant):
    def build():
        torch.manual_seed(0)
        return _Blocks(reentrant), torch.randn(ROWS, 512)

    # SGD without momentum: no optimizer state, so the peak is in backward, where checkpointing acts.
    return measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=_blocks_loss).steady_peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_in_user_code_matches_a_real_run(reentrant):
    measured = _measure_blocks(reentrant)
    with torch.device("meta"):
        model, x = _Blocks(reentrant), torch.randn(ROWS, 512)
    est = memcheck.estimate(model, x, device="cpu", loss_fn=_blocks_loss, optimizer="sgd")
    _check(f"torch.utils.checkpoint use_reentrant={reentrant}", est.peak_bytes, measured)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_a_list_of_modules_matches_checkpointing_written_in_the_model(reentrant):
    measured = _measure_blocks(reentrant)
    with torch.device("meta"):
        model, x = _Blocks(), torch.randn(ROWS, 512)
    est = memcheck.estimate(model, x, device="cpu", loss_fn=_blocks_loss, optimizer="sgd",
                            checkpointing="blocks.1,blocks.2,blocks.3", use_reentrant=reentrant)
    assert est.checkpointing == ("blocks.1", "blocks.2", "blocks.3")
    _check(f"--checkpointing LIST use_reentrant={reentrant}", est.peak_bytes, measured)
    # And it is a cure: the same model without checkpointing, measured, needs more.
    assert _measure_blocks(None) > measured


def test_full_checkpointing_finds_the_repeated_blocks():
    from memcheck.training.checkpointing import repeated_blocks

    with torch.device("meta"):
        model, _, _ = ZOO["gpt2"]()
    assert repeated_blocks(model) == ["transformer.h.0", "transformer.h.1"]
    assert repeated_blocks(_Blocks()) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    with torch.device("meta"):
        mlp, _, _ = ZOO["mlp"]()
    assert repeated_blocks(mlp) == []  # Linear layers are leaves, not blocks


def test_checkpointing_errors_name_the_bad_value():
    with torch.device("meta"):
        model, x = _Blocks(), torch.randn(8, 512)
    with pytest.raises(memcheck.UsageError, match="'blokcs.*'"):
        memcheck.estimate(model, x, device="cpu", loss_fn=_blocks_loss, checkpointing="blokcs.*")
    with torch.device("meta"):
        mlp, batch, loss = ZOO["mlp"]()
    with pytest.raises(memcheck.UsageError, match="no repeated blocks"):
        memcheck.estimate(mlp, batch, device="cpu", loss_fn=loss, checkpointing="full")


# ---- evaluation pass ----------------------------------------------------------------------------

def _measure_eval(build, loss_and_logits, eval_batch, keep):
    """Two training steps, then a Trainer-style evaluation loop, measured by the CPU allocator.

    Written here, independently of memcheck's run_eval: each eval batch runs under
    no_grad and, with ``keep``, its logits are concatenated onto the predictions held so far.
    Returns the peak of live bytes from the start of the evaluation loop.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, batch = build()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            loss, _ = loss_and_logits(model, batch)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        with record_function("eval.start"):
            pass
        model.eval()
        ebatch = eval_batch()
        preds = logits = None
        with torch.no_grad():
            for _ in range(max(keep, 1)):
                loss, logits = loss_and_logits(model, ebatch)
                if keep:
                    preds = logits if preds is None else torch.cat([preds, logits])
        del model, batch, opt, preds, logits, ebatch
    raw = prof.profiler.kineto_results.events()
    start = next(e.start_ns() for e in raw if e.name() == "eval.start")
    live = peak = 0
    for t, n in cpu_memory_events(raw):
        live += n
        if t >= start:
            peak = max(peak, live)
    return peak


def _gpt2_loss_and_logits(model, batch):
    out = model(**batch)
    return out.loss, out.logits


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0, 3])
def test_eval_pass_matches_a_trainer_style_loop(keep):
    from memcheck.workloads import hf

    def build():
        torch.manual_seed(0)
        model, batch, _ = ZOO["gpt2"]()
        return model, batch

    def eval_batch():  # batch 8 for eval, 2 for training: the usual larger eval batch
        model = build_box["model"]
        return hf.make_batch(model, model.config, memcheck.Task.CAUSAL_LM, 8, 128, None, device="cpu")

    build_box = {}

    def build_and_keep():
        model, batch = build()
        build_box["model"] = model
        return model, batch

    measured = _measure_eval(build_and_keep, _gpt2_loss_and_logits, eval_batch, keep)
    with torch.device("meta"):
        model, batch, _ = ZOO["gpt2"]()
        ebatch = hf.make_batch(model, model.config, memcheck.Task.CAUSAL_LM, 8, 128, None, device="meta")
    est = memcheck.estimate(model, batch, device="cpu", eval_batch=ebatch, eval_accumulate_predictions=keep)
    _check(f"gpt2 eval keep={keep}", est.eval_peak_bytes, measured)


def test_eval_predictions_set_the_peak_and_the_report_says_so():
    # An LM head of 50257 tokens: logits per eval batch = 8 x 128 x 50257 x 4 B = 205,852,672 B.
    # Keeping 6 batches: the last concatenation holds 5 + 1 + 6 = 12 batches of logits,
    # 2,470,232,064 B, far above a training step of batch 2 (GPT-2 with 2 layers, ~1.3 GB).
    from memcheck.workloads import hf

    with torch.device("meta"):
        model, batch, _ = ZOO["gpt2"]()
        ebatch = hf.make_batch(model, model.config, memcheck.Task.CAUSAL_LM, 8, 128, None, device="meta")
    est = memcheck.estimate(model, batch, device="cpu", eval_batch=ebatch, eval_accumulate_predictions=6)
    assert est.peak_in == "eval"
    assert est.eval_peak_bytes > 12 * 8 * 128 * 50257 * 4
    assert est.peak_bytes == est.eval_peak_bytes > est.train_peak_bytes
    assert "the job's peak is in evaluation" in str(est)


def test_eval_accumulate_without_an_eval_batch_is_an_error():
    with torch.device("meta"):
        mlp, batch, loss = ZOO["mlp"]()
    with pytest.raises(memcheck.UsageError, match="eval_accumulate_predictions needs an eval batch"):
        memcheck.estimate(mlp, batch, device="cpu", loss_fn=loss, eval_accumulate_predictions=2)
