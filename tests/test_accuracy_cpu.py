"""--device cpu estimates against real CPU runs, measured by the allocator itself.

The oracle is ``memcheck.measure.local.measure_cpu``: it builds the same model and
batch on CPU, runs the same training loop, and takes the peak of live bytes from
``torch.profiler.profile(profile_memory=True)`` allocation events. The estimate
is traced on meta. Target (issue 2): within 2% on every model in the zoo.
"""

import pytest
import torch

from zoo import ZOO, estimate_zoo, measure_zoo

TOLERANCE = 0.02
# Zoo models whose estimate is known to miss, and why.
# (CLIPForImageClassification was 17-35% under until the CPU rules for its patch convolution, a
# large-kernel oneDNN backward-weights scratchpad, came in: memcheck/rules/cpu_kernels.py.)
KNOWN_MISSES: dict[str, str] = {}
ZOO_CASES = [
    pytest.param(name, marks=pytest.mark.xfail(reason=KNOWN_MISSES[name], strict=True))
    if name in KNOWN_MISSES else name
    for name in sorted(ZOO)
]


def _measure(name, optimizer):
    return measure_zoo(name, optimizer)


def _estimate(name, optimizer, device="cpu"):
    return estimate_zoo(name, optimizer, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_CASES)
def test_cpu_estimate_matches_measured_peak_within_2_percent(name):
    measured = _measure(name, lambda params: torch.optim.AdamW(params))
    est = _estimate(name, "adamw")
    error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
    assert abs(error) <= TOLERANCE, (
        f"{name}: estimated {est.peak_bytes} B, measured {measured.steady_peak_bytes} B ({error:+.2%})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_cpu_estimate_matches_measured_peak_with_sgd_momentum(name):
    measured = _measure(name, lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9))
    est = _estimate(name, "sgd-momentum")
    error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
    assert abs(error) <= TOLERANCE, f"{name}: {error:+.2%}"


@pytest.mark.slow
def test_foreach_optimizer_temporaries_match_a_real_cpu_run():
    # foreach AdamW allocates whole-parameter-list temporaries in step(): its peak is
    # in the optimizer step for this small-activation MLP. Measured with foreach=True on CPU.
    foreach = lambda params: torch.optim.AdamW(params, foreach=True)  # noqa: E731
    measured = _measure("mlp", foreach)
    est = _estimate("mlp", foreach)
    error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
    assert abs(error) <= TOLERANCE, f"{error:+.2%}"
    assert est.peak_phase.value == "optimizer_step"
    # By hand: P = (512*2048 + 2048 + 2048*2048 + 2048 + 2048*10 + 10) params * 4 B
    #            = 5,267,466 * 4 B = 21,069,864 B.
    # At the peak: params, grads, exp_avg, exp_avg_sq (4P) + the list-wide
    # _foreach_sqrt(exp_avg_sqs) temporary (P) + the batch (256*512*4 B = 524,288 B of
    # inputs, 256*8 B = 2,048 B of labels) + six float32 'step' scalars (24 B).
    P = 5_267_466 * 4
    assert est.peak_bytes == 5 * P + 524_288 + 2_048 + 24


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt2-narrow", "bert-narrow", "vit-narrow", "gpt2", "bert", "vit"])
def test_amp_bf16_estimate_matches_a_real_cpu_autocast_run(name):
    """The autocast emulation against ``torch.autocast("cpu", bfloat16)`` for real: the casts,
    the weight-cast cache and the low-precision saved activations all show in the peak."""
    measured = measure_zoo(name, lambda p: torch.optim.AdamW(p), autocast_dtype=torch.bfloat16)
    est = estimate_zoo(name, "adamw", precision="amp-bf16")
    error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
    assert abs(error) <= TOLERANCE, f"{name}: {error:+.2%}"
