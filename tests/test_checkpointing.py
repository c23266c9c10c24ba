"""memcheck.training.checkpointing: the KV cache is off in every config of a checkpointed model.

T5 gives its encoder and decoder stacks deep copies of its config; memcheck turned ``use_cache``
off in the model's config alone, so the decoder kept an ``EncoderDecoderCache``, and the
cross-attention recomputed under ``half``, ``every:2`` or ``selective-op`` (memcheck's own wrap;
``full`` is transformers' own) read its keys and values back from it: 4 saved tensors fewer than
the forward, and ``CheckpointError`` on both targets, in a real run of the same wrap too.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import memcheck
from memcheck.enums import Task
from memcheck.measure.local import measure_cpu
from memcheck.training.checkpointing import apply_checkpointing
from memcheck.workloads import hf

TOLERANCE = 0.02


def _t5_config(width=32):
    from transformers import T5Config

    return T5Config(vocab_size=256, d_model=width, d_kv=width // 4, d_ff=4 * width, num_layers=2,
                    num_decoder_layers=2, num_heads=4, decoder_start_token_id=0)


def _build(config, device, batch=2, source=32, target=16):
    model = hf.build_model(config, Task.SEQ2SEQ, device=device)
    return model, hf.make_batch(model, config, Task.SEQ2SEQ, batch, source, target, device=device)


def test_every_config_of_the_model_has_its_cache_turned_off():
    with torch.device("meta"):
        model, _ = _build(_t5_config(), torch.device("meta"))
    assert model.decoder.config.use_cache is True  # the decoder's own copy (copy.deepcopy in T5's __init__)
    apply_checkpointing(model, "half")
    assert [name for name, m in model.named_modules() if getattr(getattr(m, "config", None), "use_cache", False)] == []


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("checkpointing", ["half", "every:2", "selective-op"])
def test_t5_traces_with_memcheck_s_own_checkpointing(checkpointing, device):
    with torch.device("meta"):
        model, batch = _build(_t5_config(), torch.device("meta"))
    est = memcheck.estimate(model, batch, device=device, checkpointing=checkpointing,
                            **({"gpu": "T4"} if device == "cuda" else {}))
    assert est.peak_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["half", "selective-op"])
def test_t5_checkpointed_matches_a_real_cpu_run(checkpointing):
    # width 128, batch 4 x 256 source / 64 target tokens, vocab 256: activations are most of the peak
    # (without checkpointing 72.6 of 85.7 MB), so a recomputation traced wrong would show.
    config = _t5_config(128)

    def build():
        torch.manual_seed(0)
        model, batch = _build(config, torch.device("cpu"), 4, 256, 64)
        apply_checkpointing(model, checkpointing)
        return model, batch

    measured = measure_cpu(build, lambda params: torch.optim.AdamW(params), steps=2).steady_peak_bytes
    with torch.device("meta"):
        model, batch = _build(config, torch.device("meta"), 4, 256, 64)
    est = memcheck.estimate(model, batch, device="cpu", optimizer="adamw", checkpointing=checkpointing)
    error = (est.peak_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, f"estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
