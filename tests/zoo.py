"""The accuracy zoo: small, real architectures, each buildable on any device.

Each entry returns ``(model, batch, loss_fn)`` built on the current default device
(``torch.device("meta")`` for estimates, CPU for measured runs). The transformers
models are the real architectures from their config classes, scaled down in
depth so a real CPU step takes about a second.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys
from pathlib import Path

import torch
from torch import nn

from memcheck.workloads import hf
from memcheck.enums import Task

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from two_branch import TwoBranch  # noqa: E402  (the example model is also a zoo member)


def _classify(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def mlp():
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    return model, (torch.randn(256, 512), torch.randint(0, 10, (256,))), _classify


def cnn_bn():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )
    return model, (torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))), _classify


def two_branch():
    batch = (torch.randn(64, 3, 64, 64), torch.randn(64, 40), torch.randint(0, 5, (64,)))

    def loss(model, b):
        return nn.functional.cross_entropy(model(b[0], b[1]), b[2])

    return TwoBranch(), batch, loss


class LSTMTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5000, 128)
        self.lstm = nn.LSTM(128, 256, num_layers=2, batch_first=True)
        self.out = nn.Linear(256, 5000)

    def forward(self, ids):
        return self.out(self.lstm(self.embed(ids))[0])


def lstm():
    ids = torch.randint(0, 5000, (16, 64))

    def loss(model, b):
        return nn.functional.cross_entropy(model(b).flatten(0, 1), b.flatten())

    return LSTMTagger(), ids, loss


def _hf(config, task, batch_size, max_len, target_len=None):
    model = hf.build_model(config, task, device=torch.get_default_device())
    batch = hf.make_batch(model, config, task, batch_size, max_len, target_len, device=torch.get_default_device())
    return model, batch, None


def gpt2():
    from transformers import GPT2Config

    return _hf(GPT2Config(n_layer=2), Task.CAUSAL_LM, 2, 128)


def bert():
    from transformers import BertConfig

    return _hf(BertConfig(num_hidden_layers=2), Task.MASKED_LM, 2, 128)


def pegasus():
    from transformers import PegasusConfig

    return _hf(PegasusConfig(encoder_layers=2, decoder_layers=2), Task.SEQ2SEQ, 2, 128, 32)


def t5():
    from transformers import T5Config

    return _hf(T5Config(num_layers=2, num_decoder_layers=2, decoder_start_token_id=0), Task.SEQ2SEQ, 2, 128, 32)


def vit():
    from transformers import ViTConfig

    return _hf(ViTConfig(num_hidden_layers=2), Task.IMAGE_CLASSIFICATION, 4, None)


def mamba():
    # transformers' reference scan (no mamba_ssm kernels on CPU) loops over the sequence and sums the
    # state's gradient at every position: the engine's in-place sums show in the peak (issue 18, cause 5).
    from transformers import MambaConfig

    return _hf(MambaConfig(num_hidden_layers=2, hidden_size=256, vocab_size=1000), Task.CAUSAL_LM, 2, 128)


def dinov2():
    from transformers import Dinov2Config

    config = Dinov2Config(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, intermediate_size=512,
                          image_size=112, patch_size=14)
    return _hf(config, Task.IMAGE_CLASSIFICATION, 4, None)


def clip():
    from transformers import CLIPConfig

    config = CLIPConfig(
        text_config=dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4),
        vision_config=dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           image_size=224, patch_size=32),
    )
    return _hf(config, Task.IMAGE_CLASSIFICATION, 4, None)


ZOO = {
    "mlp": mlp, "cnn_bn": cnn_bn, "two_branch": two_branch, "lstm": lstm,
    "gpt2": gpt2, "bert": bert, "pegasus": pegasus, "t5": t5, "vit": vit,
    "mamba": mamba, "dinov2": dinov2, "clip": clip,
}


# The same architectures at a width an AVX2 host runs in seconds under bf16 autocast: without
# AVX-512 BF16, oneDNN has no bf16 matmul there and ATen's reference gemm takes minutes at GPT-2's
# 768 x 50257 head (issue 32: 280 s for the full-width GPT-2 case on the 2-core AVX2 CI host).
# Every mechanism the autocast test checks (the casts, the weight-cast cache, the bf16 saved
# activations) is the same at any width; the full-width cases run in make test-bench.
def gpt2_narrow():
    from transformers import GPT2Config

    return _hf(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=2048, bos_token_id=0, eos_token_id=0),
               Task.CAUSAL_LM, 2, 128)


def bert_narrow():
    from transformers import BertConfig

    return _hf(BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                          vocab_size=2048), Task.MASKED_LM, 2, 128)


def vit_narrow():
    from transformers import ViTConfig

    return _hf(ViTConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512),
               Task.IMAGE_CLASSIFICATION, 4, None)


NARROW = {"gpt2-narrow": gpt2_narrow, "bert-narrow": bert_narrow, "vit-narrow": vit_narrow}


def _builder(name):
    return ZOO[name] if name in ZOO else NARROW[name]


def measure_zoo(name, make_optimizer, *, autocast_dtype=None, accumulate=1, prepare=None):
    """A real CPU run of zoo model ``name``, measured by ``memcheck.measure.local.measure_cpu``.

    ``prepare(model)``, if given, changes the real model first as a user would
    (e.g. turns on gradient checkpointing in its own code).
    """
    from memcheck.measure.local import measure_cpu
    from memcheck.training.loop import default_loss

    builder = _builder(name)
    box = {}

    def build():
        torch.manual_seed(0)
        model, batch, loss = builder()
        if prepare is not None:
            prepare(model)
        box["loss"] = loss or default_loss
        return model, batch

    return measure_cpu(
        build, make_optimizer, loss_fn=lambda m, b: box["loss"](m, b), steps=2, autocast_dtype=autocast_dtype,
        accumulate=accumulate,
    )


def estimate_zoo(name, optimizer, *, device="cpu", precision="fp32", prepare=None, **options):
    """memcheck's estimate of the same work, traced on meta; ``options`` go to ``memcheck.engine.estimate``."""
    import memcheck

    with torch.device("meta"):
        model, batch, loss = _builder(name)()
        if prepare is not None:
            prepare(model)
    return memcheck.estimate(
        model, batch, device=device, optimizer=optimizer, loss_fn=loss, precision=precision, **options
    )
