"""Vision models whose convolutions take oneDNN's channels-last, depthwise and string-padding
paths on the CPU target, against a real CPU training step (issue 18, cause 3).

Each config is the real architecture from its transformers config class, scaled down so
that a real step takes a second or two; batch 4, SGD.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import memcheck
from memcheck.enums import Task
from memcheck.measure.local import measure_cpu
from memcheck.training.loop import default_loss
from memcheck.workloads import hf

transformers = pytest.importorskip("transformers")

_STAGES = dict(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], num_labels=10, image_size=64)
_HEADS = dict(num_attention_heads=[1, 2, 4, 8])


def _configs():
    t = transformers
    return {
        # string padding ("valid", "same") in the depthwise blocks; top_bn reads hidden_dim, which must
        # equal round_filters(1280) at this width.
        "efficientnet": t.EfficientNetConfig(image_size=64, num_labels=10, width_coefficient=0.25,
                                             depth_coefficient=0.25, hidden_dim=320),
        # the patch embedding's padding="valid"; make_batch reads image_size from the top-level config
        # only, so the vision tower keeps its 224.
        "siglip": t.SiglipConfig(
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                               image_size=224, patch_size=16),
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2),
            num_labels=10),
        # channels-last patch embeddings and a depthwise 3x3 in each MLP
        "segformer": t.SegformerConfig(**_STAGES, **_HEADS),
        "pvtv2": t.PvtV2Config(**_STAGES, **_HEADS),
        # channels-last depthwise 7x7 and 2x2 downsampling convolutions
        "convnext": t.ConvNextConfig(**_STAGES),
        "convnextv2": t.ConvNextV2Config(**_STAGES),
    }


def _build(config, device):
    model = hf.build_model(config, Task.IMAGE_CLASSIFICATION, device=device)
    batch = hf.make_batch(model, config, Task.IMAGE_CLASSIFICATION, 4, None, None, device=device)
    return model, batch


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "efficientnet", "segformer", "pvtv2", "convnext", "convnextv2",
        # the attention-pooling head's output is computed and dropped; its graph goes with it, after the
        # forward (the tracer's saved-tensor packing and ModuleTracker's hooks kept it: +11% before)
        "siglip",
    ],
)
def test_vision_model_training_step_matches_real_cpu_run(name):
    config = _configs()[name]

    def build():
        torch.manual_seed(0)
        return _build(config, torch.device("cpu"))

    measured = measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=default_loss).steady_peak_bytes
    with torch.device("meta"):
        model, batch = _build(config, torch.device("meta"))
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd")
    assert abs(est.peak_bytes - measured) / measured <= 0.02, (est.peak_bytes, measured)
