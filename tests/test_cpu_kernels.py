"""CPU kernel rules (oneDNN convolution, batch norm, layer norm, LSTM) against real CPU ops under the profiler."""

import pytest
import torch
from torch import nn

import memcheck
from memcheck.rules import cpu_kernels
from memcheck.measure.local import measure_cpu


@pytest.mark.parametrize(
    "conv, shape",
    [
        (nn.Conv2d(32, 64, 3, padding=1, stride=2), (32, 32, 32, 32)),  # blocked input, strided (NHWC backward)
        (nn.Conv2d(3, 32, 3, padding=1), (16, 3, 32, 32)),  # "first conv": plain input read in place
        (nn.Conv2d(16, 16, 1), (32, 16, 32, 32)),  # 1x1
        pytest.param(
            nn.Conv2d(16, 16, 1), (8, 16, 20, 20),
            marks=pytest.mark.xfail(
                strict=True,
                reason="known gap: oneDNN's backward-weights scratchpad (21,696 B here) is not modelled; "
                "on tensors this small it is 2.4% of the peak",
            ),
        ),
        (nn.Conv2d(32, 32, 3, padding=1, groups=32), (16, 32, 16, 16)),  # depthwise
    ],
)
def test_convolution_training_step_matches_real_cpu_run(conv, shape):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(conv, nn.ReLU()), torch.randn(shape)

    measured = measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1)).steady_peak_bytes
    with torch.device("meta"):
        model, x = nn.Sequential(nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size,
                                           conv.stride, conv.padding, groups=conv.groups), nn.ReLU()), torch.empty(shape)
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd")
    assert abs(est.peak_bytes - measured) / measured <= 0.02, (est.peak_bytes, measured)


def test_lstm_long_sequences_are_extrapolated_within_2_percent(monkeypatch):
    # The oracle: probing the full shape, which runs the real oneDNN layer at that size.
    exact = cpu_kernels._probe_layer(256, 4, 32, 64)
    cpu_kernels.lstm_layer_sizes.cache_clear()
    monkeypatch.setattr(cpu_kernels, "_PROBE_LIMIT", 4 * 4 * (32 + 24 * 64) * 40)  # forces 2 probes of <= 40 steps
    ws, fwd, bwd, extrapolated = cpu_kernels.lstm_layer_sizes(256, 4, 32, 64)
    cpu_kernels.lstm_layer_sizes.cache_clear()
    assert extrapolated
    for got, want in ((ws, exact["ws"]), (fwd, exact["fwd"]), (bwd, exact["bwd"])):
        assert abs(got - want) / want <= 0.02, (got, want)


class ConvLayerNorm(nn.Module):
    """Wav2Vec2's layer-norm feature encoder layer: Conv1d, LayerNorm over channels (a
    transposed, non-contiguous view), GELU; two of them, so the second conv gets the
    non-contiguous GELU output and, in backward, a non-contiguous gradient."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(1, 32, 10, 5), nn.Conv1d(32, 32, 3, 2)])
        self.norms = nn.ModuleList([nn.LayerNorm(32), nn.LayerNorm(32)])

    def forward(self, x):
        h = x[:, None]
        for conv, norm in zip(self.convs, self.norms):
            h = nn.functional.gelu(norm(conv(h).transpose(1, 2)).transpose(1, 2))
        return h.sum()


def test_conv1d_and_layer_norm_on_transposed_inputs_match_a_real_cpu_run():
    # 4 clips of 16,000 samples: conv 1 gives (4, 32, 3199) float32 = 1,637,888 B. Its layer norm
    # normalises a contiguous copy (1,637,888 B) into a contiguous output; conv 2 runs as a 2-d conv
    # on a contiguous copy of its transposed input, and its backward copies the transposed gradient.
    def loss(model, batch):
        return model(batch)

    def build():
        torch.manual_seed(0)
        return ConvLayerNorm(), torch.randn(4, 16000)

    measured = measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss).steady_peak_bytes
    with torch.device("meta"):
        model, x = ConvLayerNorm(), torch.empty(4, 16000)
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd", loss_fn=loss)
    assert abs(est.peak_bytes - measured) / measured <= 0.02, (est.peak_bytes, measured)


def test_padding_valid_is_one_value_for_every_dimension():
    # F.conv2d(padding="valid") reaches aten.convolution with padding [0] (SigLIP's patch embedding):
    # the same oneDNN buffers as padding=0
    def estimate(padding):
        with torch.device("meta"):
            model, x = nn.Sequential(nn.Conv2d(3, 16, 8, stride=8, padding=padding), nn.ReLU()), torch.empty(4, 3, 64, 64)
        return memcheck.estimate(model, x, device="cpu", optimizer="sgd").peak_bytes

    assert estimate("valid") == estimate(0)
