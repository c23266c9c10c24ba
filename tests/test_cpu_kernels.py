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


def test_one_element_padding_is_repeated_per_dimension():
    # padding="valid" reaches aten.convolution as [0]; stride=2 from a model can be [2].
    image = torch.empty(1, 3, 8, 8, device="meta")
    assert cpu_kernels._per_dim([0], image) == [0, 0]
    assert cpu_kernels._per_dim([2, 3], image) == [2, 3]


@pytest.mark.parametrize(
    "conv, shape, channels_last",
    [
        (dict(in_channels=32, out_channels=64, kernel_size=3, stride=2, padding="valid"), (32, 32, 32, 32), False),
        (dict(in_channels=16, out_channels=32, kernel_size=2, stride=2), (4, 16, 16, 16), True),  # ConvNext
        (dict(in_channels=16, out_channels=16, kernel_size=8, stride=8), (4, 16, 16, 16), True),  # PvtV2 patches
        (dict(in_channels=64, out_channels=64, kernel_size=7, padding=3, groups=64), (4, 64, 4, 4), True),  # fallback
        (dict(in_channels=128, out_channels=128, kernel_size=3, padding=1, groups=128), (4, 128, 2, 2), True),  # 3 > 2
        (dict(in_channels=128, out_channels=128, kernel_size=3, padding=1, groups=128), (4, 128, 8, 8), True),  # jit
    ],
)
def test_string_padding_and_channels_last_convolutions_match_real_cpu_run(conv, shape, channels_last):
    # The real model is built inside the measured region, so that its weights are measured too.
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(**conv), nn.ReLU()), torch.randn(shape).contiguous(memory_format=fmt)

    measured = measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1)).steady_peak_bytes
    with torch.device("meta"):
        model, x = nn.Sequential(nn.Conv2d(**conv), nn.ReLU()), torch.empty(shape).contiguous(memory_format=fmt)
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd")
    assert abs(est.peak_bytes - measured) / measured <= 0.02, (est.peak_bytes, measured)


# The hand-worked cases below restate allocation sequences read from the profiler
# (torch 2.13, oneDNN 3.12, AVX-512: 16-channel blocks) as arithmetic.

def test_channels_last_strided_convolution_buffers():
    # Conv2d(16, 32, 2, stride=2) on a channels-last (4, 16, 16, 16) input.
    # weight 32*16*2*2*4 = 8,192 B; its channels-last copy (Conv.cpp) 8,192 B; oneDNN's blocked
    # copy 32*16*2*2*4 = 8,192 B (both channel counts are multiples of 16); scratchpad 12,336 B.
    # Forward: 8,192 + 12,336 + 8,192 = 28,720 B above the output.
    assert cpu_kernels.nhwc_conv_forward_extra((4, 16, 16, 16), (32, 16, 2, 2), (2, 2), 1, False, 32768) == 28720
    # Backward, all three gradients: channels-last weight 8,192 + grad_input 4*16*16*16*4 = 65,536
    # + blocked weight 8,192 + strided backward-data scratchpad 61,488 = 143,408 B at the peak;
    # outputs 65,536 + 8,192 + 128 (bias) = 73,856 B, so 69,552 B above them.
    assert cpu_kernels.nhwc_conv_backward_extra((4, 16, 16, 16), (32, 16, 2, 2), (2, 2), 1, False,
                                                [True, True, True]) == 69552


def test_channels_last_depthwise_7x7_backward_keeps_256_weight_gradients():
    # ConvNext's Conv2d(128, 128, 7, padding=3, groups=128) on a channels-last (4, 128, 2, 2) input.
    # Reduction buffer 256 * 128*1*7*7 * 4 B = 6,422,528 B; then the bias-gradient temporary and the
    # bias gradient (128*4 = 512 B each) and the weight gradient with a copy (25,088 B each):
    # peak 8,192 (grad_input) + 6,422,528 + 512 + 512 + 25,088 + 25,088 = 6,481,920 B;
    # outputs 8,192 + 25,088 + 512 = 33,792 B, so 6,448,128 B above them: the transient of that
    # convolution_backward in a real ConvNext step.
    assert cpu_kernels.nhwc_conv_backward_extra((4, 128, 2, 2), (128, 1, 7, 7), (1, 1), 128, True,
                                                [True, True, True]) == 6448128
    # Forward: only the weight, blocked: 128*7*7*4 = 25,088 B.
    assert cpu_kernels.nhwc_conv_forward_extra((4, 128, 2, 2), (128, 1, 7, 7), (1, 1), 128, True, 8192) == 25088


def test_channels_last_depthwise_3x3_backward_uses_the_weight_sized_buffer():
    # Conv2d(16, 16, 3, padding=1, groups=16) on a channels-last (4, 16, 16, 16) input: the
    # jit_uni_dw kernel; its buffer is the blocked weight gradient, 16*3*3*4 = 576 B.
    # Peak 65,536 (grad_input) + 576 + 64 + 64 + 576 + 576 = 67,392 B;
    # outputs 65,536 + 576 + 64 = 66,176 B, so 1,216 B above them.
    assert cpu_kernels.nhwc_conv_backward_extra((4, 16, 16, 16), (16, 1, 3, 3), (1, 1), 16, True,
                                                [True, True, True]) == 1216


def test_patch_embedding_backward_weights_keeps_im2col_columns(monkeypatch):
    # SigLIP's Conv2d(3, 64, 16, stride=16) on (4, 3, 224, 224): a kernel side of 16 takes oneDNN's
    # gemm backward-weights. Per thread: im2col columns 3*16*16 * 14*14 = 150,528 floats and four
    # weight-sized buffers 4 * 64*3*16*16 = 196,608 floats; with 2 threads and 64 more floats:
    # (2 * (150,528 + 196,608) + 64) * 4 B = 2,777,344 B.
    # Profiled sequence: [diff_W 196,608, scratch 2,777,344, grad_b tmp 256, -scratch, grad_b 256, grad_W 196,608,
    # -diff_W, -tmp]: peak 196,608 + 2,777,344 + 256 = 2,974,208 B over outputs 196,608 + 256 = 196,864 B.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    extra = cpu_kernels.conv_backward_extra((4, 3, 224, 224), (64, 3, 16, 16), (16, 16), (0, 0), (1, 1), 1,
                                            [False, True, True])
    assert extra == 2974208 - 196864


def test_patch_embedding_convolution_matches_real_cpu_run():
    # The gemm backward-weights scratchpad is 48% of this step's peak.
    def model():
        return nn.Sequential(nn.Conv2d(3, 64, 16, stride=16, padding="valid"), nn.Flatten(2), nn.Linear(196, 8))

    def build():
        torch.manual_seed(0)
        return model(), torch.randn(4, 3, 224, 224)

    measured = measure_cpu(build, lambda p: torch.optim.SGD(p, lr=0.1)).steady_peak_bytes
    with torch.device("meta"):
        est = memcheck.estimate(model(), torch.empty(4, 3, 224, 224), device="cpu", optimizer="sgd")
    assert abs(est.peak_bytes - measured) / measured <= 0.02, (est.peak_bytes, measured)


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
