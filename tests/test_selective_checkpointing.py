"""Op-level selective activation checkpointing (issue 18): ``--checkpointing selective-op`` wraps
every repeated block in ``torch.utils.checkpoint`` with torchtitan's policy (save matmuls and
attention, recompute the rest and every second matmul), run through torch's own
``create_selective_checkpoint_contexts``; checked against a real CPU run of the same policy."""

import pytest
import torch

import memcheck
from memcheck.measure.local import measure_cpu
from memcheck.training.checkpointing import apply_checkpointing


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _estimate(checkpointing):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config())
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    return memcheck.estimate(model, {"input_ids": ids, "labels": ids},
                             memcheck.Job(device="cpu", checkpointing=checkpointing, optimizer=_sgd))


@pytest.mark.slow
def test_selective_op_checkpointing_matches_a_real_cpu_run_of_the_same_policy():
    from transformers import LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config())
        apply_checkpointing(model, "selective-op")  # the policy, on the real model, as a user sets it up
        ids = torch.zeros(2, 128, dtype=torch.long)
        return model, {"input_ids": ids, "labels": ids}

    est = _estimate("selective-op")
    real = measure_cpu(build, _sgd).steady_peak_bytes
    assert abs(est.peak_bytes - real) <= 0.02 * real, (est.peak_bytes, real)
    # it keeps more than full checkpointing and less than none
    assert _estimate("full").peak_bytes < est.peak_bytes < _estimate("none").peak_bytes
    assert est.to_dict()["checkpointed_modules"] == ["model.layers.0", "model.layers.1"]


@pytest.mark.slow
def test_full_checkpointing_matches_a_real_cpu_run():
    # With checkpointing transformers turns the cache off, and with no cache and no attention mask it
    # asks whether the position ids it made from arange restart (a packed batch). memcheck knows they
    # do not (memcheck.rules.known_values' rows), as the real run does; answered "packed", the trace
    # built and recomputed a (2, 1, 128, 128) mask and read +4.5%.
    from transformers import LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config())
        apply_checkpointing(model, "full")
        ids = torch.zeros(2, 128, dtype=torch.long)
        return model, {"input_ids": ids, "labels": ids}

    est = _estimate("full")
    real = measure_cpu(build, _sgd).steady_peak_bytes
    assert abs(est.peak_bytes - real) <= 0.02 * real, (est.peak_bytes, real)
    assert not any("padding" in a for a in est.assumptions), est.assumptions


def test_selective_op_needs_the_non_reentrant_checkpoint():
    with pytest.raises(memcheck.UsageError, match="selective-op needs use_reentrant=False"):
        memcheck.estimate(torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(2)]),
                          torch.ones(2, 4, device="meta"),
                          memcheck.Job(device="cpu", checkpointing="selective-op", use_reentrant=True))
