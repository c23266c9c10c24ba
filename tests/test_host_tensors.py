"""Models whose ``__init__`` reads a CPU tensor's values (issue 18, cause 2): a drop-path schedule
from ``torch.linspace(...).tolist()`` in ConvNext, ConvNextV2, Swinv2, PvtV2 and about 20 more
transformers modeling files. Building on meta fails there (a meta tensor has no values), so
memcheck builds once more with host tensors left real and only what modules register on meta
(``memcheck.trace.device_redirect.on_meta_keeping_host``)."""

import pytest
import torch

import memcheck
from memcheck.enums import Task
from memcheck.measure.local import measure_cpu
from memcheck.workloads import hf
from memcheck.workloads.source import load_workload


def _configs():
    from transformers import ConvNextConfig, ConvNextV2Config, PvtV2Config, Swinv2Config

    small = dict(drop_path_rate=0.1, num_labels=10, image_size=64)
    return {
        "convnext": ConvNextConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], **small),
        "convnextv2": ConvNextV2Config(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], **small),
        "swinv2": Swinv2Config(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, **small),
        "pvtv2": PvtV2Config(hidden_sizes=[16, 32, 64, 128], num_attention_heads=[1, 2, 4, 8],
                             depths=[1, 1, 1, 1], **small),
    }


@pytest.mark.parametrize("name", ["convnext", "convnextv2", "swinv2", "pvtv2"])
def test_drop_path_models_load_on_meta_from_hf_and_trace_on_both_targets(name, tmp_path):
    _configs()[name].save_pretrained(tmp_path)
    work = load_workload(f"hf:{tmp_path}", batch_size=2, task="image-classification")
    assert {p.device.type for p in work.model.parameters()} == {"meta"}
    for job in (memcheck.Job(device="cpu"), memcheck.Job(gpu="A100-80GB")):
        assert memcheck.estimate(work.model, work.batch, job).peak_bytes > 0


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.slow
def test_swinv2_with_drop_path_matches_a_real_cpu_run(tmp_path):
    config = _configs()["swinv2"]
    config.save_pretrained(tmp_path)
    work = load_workload(f"hf:{tmp_path}", batch_size=4, task="image-classification")
    est = memcheck.estimate(work.model, work.batch, memcheck.Job(device="cpu", optimizer=_sgd))

    def build():
        torch.manual_seed(0)
        model = hf.build_model(config, Task.IMAGE_CLASSIFICATION, device="cpu")
        return model, hf.make_batch(model, config, Task.IMAGE_CLASSIFICATION, 4, None, None, device="cpu")

    real = measure_cpu(build, _sgd)
    assert abs(est.peak_bytes - real.steady_peak_bytes) <= 0.02 * real.steady_peak_bytes


def test_a_model_file_whose_init_reads_a_linspace_keeps_its_real_values(tmp_path):
    path = tmp_path / "drop_path.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.rates = torch.linspace(0, 0.3, 4).tolist()  # read while building\n"
        "        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in self.rates)\n"
        "        self.register_buffer('scale', torch.ones(8))\n"
        "    def forward(self, x):\n"
        "        for block in self.blocks:\n"
        "            x = block(x) * self.scale\n"
        "        return x\n\n"
        "def build_model():\n    return Net()\n\n"
        "def make_batch(batch_size, max_len=None):\n    return torch.randn(batch_size, 8)\n")
    work = load_workload(str(path), batch_size=2)
    assert work.model.rates == pytest.approx([0.0, 0.1, 0.2, 0.3])  # the real values, not stand-ins
    assert {t.device.type for t in [*work.model.parameters(), *work.model.buffers()]} == {"meta"}
    assert work.batch.device.type == "meta"
    # 4 x Linear(8, 8) = 4 x 72 params x 4 B = 1,152 B of parameters
    est = memcheck.estimate(work.model, work.batch, memcheck.Job(device="cpu"))
    assert est.breakdown_at_peak.params == 1_152
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the registration hooks are gone
