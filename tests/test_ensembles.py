"""Ensembles of small heads (examples/ensemble.py), as a ModuleList loop and as torch.func's vmap.

The oracle is a real CPU run measured by ``memcheck.measure.local.measure_cpu``, as in
test_accuracy_cpu.py: the model and batch are built on CPU for the measurement
and under ``torch.device("meta")`` for the estimate. Target: within 2% for both forms.
"""

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.measure.local import measure_cpu

EXAMPLES = Path(__file__).parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import ensemble  # noqa: E402

TOLERANCE = 0.02
FORMS = ("loop", "vmap")
BATCH = 256  # big enough that the peak is in backward, with the activations live

# Parameters by hand, the same in both forms (the vmap template head lives on meta, unregistered):
#   one head: Linear(256, 256) 256*256 + 256 = 65,792, Linear(256, 10) 256*10 + 10 = 2,570 -> 68,362
#   128 heads * 68,362 = 8,750,336 params * 4 B = 35,001,344 B (33.4 MiB).
PARAM_BYTES = 128 * (256 * 256 + 256 + 256 * 10 + 10) * 4
# On CUDA the caching allocator grants blocks in multiples of 512 B (kMinBlockSize), and the
# breakdown counts granted bytes. Loop: per head 262,144 + 1,024 + 10,240 B are multiples of 512,
# the 40 B bias of Linear(256, 10) takes 512 B -> 128 * 273,920 B = 35,061,760 B. vmap's stacked
# tensors are all multiples of 512 B (the smallest, 128 * 10 * 4 B = 5,120 B), so nothing is added.
PARAM_BYTES_CUDA = {"loop": 128 * (262_144 + 1_024 + 10_240 + 512), "vmap": PARAM_BYTES}


def _build(form):
    return ensemble.build_model(form), ensemble.make_batch(BATCH)


@functools.lru_cache(maxsize=None)
def _measure(form):
    def build():
        torch.manual_seed(0)
        return _build(form)

    return measure_cpu(build, lambda params: torch.optim.AdamW(params), loss_fn=ensemble.compute_loss, steps=2)


@functools.lru_cache(maxsize=None)
def _estimate(form, device="cpu"):
    with torch.device("meta"):
        model, batch = _build(form)
    return memcheck.estimate(model, batch, device=device, optimizer="adamw", loss_fn=ensemble.compute_loss)


@pytest.mark.parametrize("form", FORMS)
def test_both_forms_hold_the_same_parameters_and_the_template_head_holds_none(form):
    with torch.device("meta"):
        model, _ = _build(form)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == PARAM_BYTES
    assert _estimate(form).breakdown_at_peak.params == PARAM_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_cpu_estimate_matches_measured_peak_within_2_percent(form):
    measured = _measure(form)
    est = _estimate(form)
    error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
    assert abs(error) <= TOLERANCE, (
        f"{form}: estimated {est.peak_bytes} B, measured {measured.steady_peak_bytes} B ({error:+.2%})"
    )


@pytest.mark.slow
def test_vmap_and_loop_estimates_differ_in_the_direction_the_measurements_differ():
    # vmap materialises each layer's output for all 128 heads at once, (128, 256, 256) * 4 B =
    # 32 MiB, in backward as well as forward; the loop's per-head temporaries are 128 times smaller.
    measured_gap = _measure("vmap").steady_peak_bytes - _measure("loop").steady_peak_bytes
    estimated_gap = _estimate("vmap").peak_bytes - _estimate("loop").peak_bytes
    assert measured_gap != 0
    assert (estimated_gap > 0) == (measured_gap > 0), f"estimated {estimated_gap:+} B, measured {measured_gap:+} B"


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("form", FORMS)
def test_the_command_line_traces_the_form_that_ENSEMBLE_FORM_names(form, device):
    result = CliRunner().invoke(
        main, [str(EXAMPLES / "ensemble.py"), "-b", str(BATCH), "--device", device, "--json"],
        env={"ENSEMBLE_FORM": form},
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["breakdown_at_peak"]["params"] == (PARAM_BYTES if device == "cpu" else PARAM_BYTES_CUDA[form])
    assert data["peak_bytes"] == _estimate(form, device).peak_bytes
