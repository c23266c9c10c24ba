"""memcheck.compat: the private torch APIs per torch version, and the one-line refusal of a
setting whose torch feature the running torch lacks (issue 38)."""

import pytest
from click.testing import CliRunner

import memcheck
from memcheck import compat
from memcheck.cli import main
from memcheck.errors import MemcheckError, TorchVersionError, require_torch
from test_cli import TWO_BRANCH


def test_every_optional_name_says_which_torch_first_has_it():
    assert set(compat.SINCE) == set(compat._OPTIONAL)
    for name, since in compat.SINCE.items():
        major, minor = map(int, since.split("."))
        assert (major, minor) >= (2, 4), name
        if compat.TORCH >= (major, minor) and name not in ("cp_attention", "cp_sharding_rules"):
            assert getattr(compat, name) is not None, f"{name}: torch {compat.TORCH_VERSION} should have it"


def test_every_name_compat_exports_resolves_on_this_torch():
    for name in compat.__all__:
        assert hasattr(compat, name), name


def test_the_stand_in_for_is_non_overlapping_and_dense_answers_as_torch_does():
    import torch

    x = torch.empty(4, 6, device="meta")
    assert compat.is_non_overlapping_and_dense_or_false(x)
    assert compat.is_non_overlapping_and_dense_or_false(x.t())  # a permutation of a dense tensor
    assert not compat.is_non_overlapping_and_dense_or_false(x[:, ::2])  # a gap every other column


def test_a_missing_torch_feature_is_a_torch_version_error_naming_the_setting(monkeypatch):
    monkeypatch.setattr(compat, "CheckpointPolicy", None, raising=False)
    monkeypatch.setattr(compat, "TORCH_VERSION", "2.3.1")
    with pytest.raises(TorchVersionError) as info:
        require_torch("CheckpointPolicy", "checkpointing selective-op")
    assert isinstance(info.value, MemcheckError) and info.value.exit_code == 2
    assert str(info.value) == ("checkpointing selective-op needs torch 2.4 or newer (for torch's CheckpointPolicy); "
                               "this is torch 2.3.1")


def test_selective_op_on_a_torch_without_it_is_one_line_and_exit_2(monkeypatch):
    # as on a torch before 2.4, which has no torch.utils.checkpoint.CheckpointPolicy
    monkeypatch.setattr(compat, "CheckpointPolicy", None, raising=False)
    result = CliRunner().invoke(main, [TWO_BRANCH, "-b", "2", "--device", "cpu", "--checkpointing", "selective-op"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].endswith(f"checkpointing selective-op (torch's selective activation checkpointing) needs torch 2.4 "
                             f"or newer (for torch's CheckpointPolicy); this is torch {compat.TORCH_VERSION}")


def test_a_plain_estimate_needs_none_of_the_optional_features(monkeypatch):
    import torch
    from torch import nn

    for name in compat.SINCE:
        monkeypatch.setattr(compat, name, None, raising=False)
    # Linear(16, 4): (64 + 4) params * 4 B = 272 B
    with torch.device("meta"):
        model, batch = nn.Linear(16, 4), torch.randn(2, 16)
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=lambda m, b: m(b).sum())
    assert est.peak_bytes > 272


def test_a_real_fsdp2_run_on_a_torch_without_fully_shard_is_refused_before_any_rank_starts(monkeypatch):
    from memcheck.measure.distributed import measure_fsdp_cpu

    monkeypatch.setattr(compat, "fully_shard", None, raising=False)
    with pytest.raises(TorchVersionError, match=r"measure_fsdp_cpu \(a real FSDP2 run\) needs torch 2.4 or newer"):
        measure_fsdp_cpu(lambda: None, lambda p: None)
