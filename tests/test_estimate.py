"""The Python API: estimate() on meta and on real models."""

import pytest
import torch
from torch import nn

import memcheck
from memcheck.errors import UsageError


def small():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def test_breakdown_sums_to_the_peak():
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    est = memcheck.estimate(model, x, device="cpu")
    assert est.breakdown_at_peak.total == est.peak_bytes
    assert sum(est.to_dict()["breakdown_at_peak"].values()) == est.to_dict()["peak_bytes"]


def test_params_counted_by_hand():
    # (64*256 + 256 + 256*10 + 10) params * 4 B = (16384 + 256 + 2560 + 10) * 4 = 76840 B
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    est = memcheck.estimate(model, x, device="cpu")
    assert est.breakdown_at_peak.params == 76840


def test_pure_bf16_halves_the_weights():
    # the same 19210 params at 2 B each = 38420 B
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    est = memcheck.estimate(model, x, device="cpu", precision="bf16")
    assert est.breakdown_at_peak.params == 38420


def test_a_real_model_is_neither_moved_nor_modified():
    model, x = small(), torch.randn(32, 64)
    before = [p.detach().clone() for p in model.parameters()]
    est = memcheck.estimate(model, x, device="cpu", precision="bf16")
    assert est.peak_bytes > 0
    for p, q in zip(model.parameters(), before):
        assert p.device.type == "cpu" and p.dtype == torch.float32 and torch.equal(p, q)
        assert p.grad is None


def test_dict_batches_use_the_model_loss():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x, labels):
            return {"loss": nn.functional.cross_entropy(self.lin(x), labels)}

    with torch.device("meta"):
        model = WithLoss()
        batch = {"x": torch.empty(4, 8), "labels": torch.zeros(4, dtype=torch.long)}
    est = memcheck.estimate(model, batch, device="cpu")
    assert est.batch.inputs[0].shape == (4, 8)


def test_budget_sets_fits():
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    big = memcheck.estimate(model, x, device="cpu", budget_bytes=2**30)
    tiny = memcheck.estimate(model, x, device="cpu", budget_bytes=1024)
    assert big.fits is True and tiny.fits is False
    assert memcheck.estimate(model, x, device="cpu").fits is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 1}, "steps"),
        ({"device": "tpu"}, "allowed: cpu, cuda"),
        ({"optimizer": "adamm"}, "did you mean 'adam'"),
        ({"precision": "fp8"}, "allowed"),
        ({"budget_bytes": -5}, "budget_bytes"),
    ],
)
def test_bad_arguments_raise_usage_errors_naming_them(kwargs, match):
    with torch.device("meta"):
        model, x = small(), torch.empty(2, 64)
    with pytest.raises(UsageError, match=match):
        memcheck.estimate(model, x, **kwargs)


def test_failing_forward_is_a_trace_error():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            raise ValueError("shape mismatch in my layer")

    with pytest.raises(memcheck.TraceError, match="shape mismatch in my layer"):
        memcheck.estimate(Broken(), torch.empty(2, 2, device="meta"), device="cpu")


def test_a_model_with_nothing_to_train_is_a_usage_error():
    with pytest.raises(UsageError, match="no trainable parameters"):
        memcheck.estimate(nn.ReLU(), torch.empty(2, 2, device="meta"), device="cpu")


def test_str_is_the_table_and_labels_binary_units():
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    text = str(memcheck.estimate(model, x, device="cpu", budget_bytes=2**30))
    assert "peak (steady state)" in text and "KiB" in text and "FITS" in text
