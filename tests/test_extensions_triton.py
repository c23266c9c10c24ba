"""memcheck.rules.extensions.triton: Triton launches on meta tensors do nothing; the host code is traced.

The first tests need no Triton: a stand-in ``triton.runtime.jit`` module with triton 3.9's
``KernelInterface.__getitem__`` (triton/runtime/jit.py:369). The last one compares memcheck
with a real CPU run of Liger's fused linear cross-entropy, run by Triton's interpreter
(``TRITON_INTERPRET=1``), in a subprocess of its own (this file run as a script); it runs
only where ``liger-kernel`` and ``triton`` are installed (not in CI: Triton's wheel is
about 290 MB and sets other packages' Triton paths for the whole suite).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from memcheck.rules.extensions import triton as triton_extension


class _Tracer:
    def __init__(self):
        self.assumed: list[str] = []

    def assume(self, text: str) -> None:
        self.assumed.append(text)


@pytest.fixture
def fake_triton(monkeypatch):
    """A ``triton.runtime.jit`` whose kernels record their launches, as triton 3.9 launches them."""
    jit = types.ModuleType("triton.runtime.jit")

    class KernelInterface:
        def __getitem__(self, grid):  # triton/runtime/jit.py:369-375
            return lambda *args, **kwargs: self.run(grid=grid, warmup=False, *args, **kwargs)

    class JITFunction(KernelInterface):
        def __init__(self, fn):
            self.fn, self.launched = fn, []

        def run(self, *args, grid, warmup, **kwargs):
            self.launched.append(grid)

    jit.KernelInterface, jit.JITFunction = KernelInterface, JITFunction
    monkeypatch.setitem(sys.modules, "triton.runtime.jit", jit)
    return jit


def test_a_launch_on_meta_tensors_does_nothing_and_is_listed(fake_triton):
    def add_kernel(x_ptr, out_ptr):
        pass

    kernel, tracer = fake_triton.JITFunction(add_kernel), _Tracer()
    x = torch.empty(4, device="meta")
    with triton_extension.tracing(tracer):
        assert kernel[(4,)](x, out_ptr=torch.empty_like(x)) is None
    assert kernel.launched == []
    assert tracer.assumed == ["Triton kernel add_kernel: writes only the tensors its caller allocated "
                              "(launch not run)"]


def test_a_launch_on_real_tensors_runs_and_the_interface_is_put_back(fake_triton):
    kernel = fake_triton.JITFunction(lambda x: None)
    original = fake_triton.KernelInterface.__getitem__
    with triton_extension.tracing(_Tracer()):
        kernel[(2,)](torch.zeros(2))
    assert kernel.launched == [(2,)]
    assert fake_triton.KernelInterface.__getitem__ is original


def test_without_triton_loaded_nothing_is_patched(monkeypatch):
    monkeypatch.delitem(sys.modules, "triton.runtime.jit", raising=False)
    with triton_extension.tracing(_Tracer()):
        pass


# Liger's fused linear cross-entropy on a Llama of 2 layers, width 64, vocabulary 8,000,
# batch 4 x 128 tokens, plain SGD (no optimizer state, so the loss's memory decides the peak).
# The full logits would be 4 * 127 * 8,000 * 4 B = 16.3 MB in fp32, each copy; Liger
# (fused_linear_cross_entropy.py:103-106) projects chunk_size = next_pow2(ceil(508 / ceil(8,000
# / 64))) = 8 tokens at a time: 8 * 8,000 * 4 B = 256,000 B of logits live.
_LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def _build():
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    apply_liger_kernel_to_llama(model=model, rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                fused_linear_cross_entropy=True)
    ids = torch.randint(0, 8000, (4, 128))
    return model, {"input_ids": ids, "labels": ids}


def _compare() -> dict:
    """memcheck's CPU estimate and the real run's steady peak (run with TRITON_INTERPRET=1)."""
    import memcheck
    from memcheck.measure.local import measure_cpu

    model, batch = _build()
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd")
    real = measure_cpu(_build, lambda p: torch.optim.SGD(p, lr=0.1), steps=2).steady_peak_bytes
    return {"estimate": est.total_bytes, "measured": real, "assumptions": list(est.assumptions)}


@pytest.mark.slow
@pytest.mark.skipif(not _LIGER, reason="needs liger-kernel and triton (pip install liger-kernel)")
def test_ligers_fused_linear_cross_entropy_traced_matches_a_real_cpu_run():
    import memcheck

    here = os.path.dirname(os.path.dirname(memcheck.__file__))  # the memcheck this test imported
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    error = result["estimate"] / result["measured"] - 1
    assert abs(error) <= 0.02, result
    assert any(a.startswith("Triton kernel liger_cross_entropy_kernel") for a in result["assumptions"])


if __name__ == "__main__":
    print(json.dumps(_compare()))
