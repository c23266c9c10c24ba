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
        (nn.Conv2d(16, 16, 1), (8, 16, 20, 20)),  # small: oneDNN's backward-weights scratchpad matters
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


# The probe itself: what it runs and what it reads.

def test_probe_batches_keep_a_batch_outermost_layout_and_re_stride_others():
    # A channels-last (4, 16, 8, 8) tensor has strides (16*8*8, 1, 8*16, 16) = (1024, 1, 128, 16): the
    # batch is outermost, so a batch of 2 keeps them. A (4, 16, 8)-shaped transpose of a (16, 4, 8)
    # tensor has strides (8, 32, 1): batch not outermost, so batch 2 is laid out densely in the same
    # order (channels, batch, width): strides (8, 2*8, 1) = (8, 16, 1).
    cl = cpu_kernels._real(((4, 16, 8, 8), (1024, 1, 128, 16), torch.float32), 2)
    assert cl.shape == (2, 16, 8, 8) and cl.stride() == (1024, 1, 128, 16)
    tr = cpu_kernels._real(((4, 16, 8), (8, 32, 1), torch.float32), 2)
    assert tr.shape == (2, 16, 8) and tr.stride() == (8, 16, 1)


def test_probe_reads_the_im2col_columns_of_a_slow_convolution():
    # float64 is not a oneDNN dtype (ConvUtils.h use_mkldnn), so Conv2d(2, 3, 3) on (2, 2, 8, 8) runs
    # slow_conv2d (aten/src/ATen/native/ConvolutionMM2d.cpp), whose forward unfolds the input into
    # columns of (n, C_in*kh*kw, oh*ow) = (2, 2*3*3, 6*6) doubles: 2 * 18 * 36 * 8 B = 10,368 B beyond
    # its (2, 3, 6, 6) output, which is contiguous: strides (108, 36, 6, 1).
    specs = (((2, 2, 8, 8), (128, 64, 8, 1), torch.float64), ((3, 2, 3, 3), (18, 9, 3, 1), torch.float64), None)
    extra, strides, extrapolated = cpu_kernels.conv_probe(False, specs, ((1, 1), (0, 0), (1, 1), False, (0, 0), 1),
                                                          torch.get_num_threads(), "any")
    assert (extra, strides, extrapolated) == (10368, ((108, 36, 6, 1),), False)


def test_probe_gives_a_channels_last_input_a_channels_last_output():
    # Conv.cpp allocates a oneDNN convolution's output in the input's suggested memory format:
    # (4, 32, 8, 8) channels-last has strides (32*8*8, 1, 8*32, 32) = (2048, 1, 256, 32).
    specs = (((4, 16, 16, 16), (4096, 1, 256, 16), torch.float32), ((32, 16, 2, 2), (64, 4, 2, 1), torch.float32),
             ((32,), (1,), torch.float32))
    _, strides, _ = cpu_kernels.conv_probe(False, specs, ((2, 2), (0, 0), (1, 1), False, (0, 0), 1),
                                           torch.get_num_threads(), "any")
    assert strides == ((2048, 1, 256, 32),)


def test_large_convolutions_are_extrapolated_in_the_batch_within_2_percent(monkeypatch):
    # Conv2d(32, 64, 3, stride=2, padding=1) on (32, 32, 32, 32): the oracle is the probe of the full
    # batch, which runs the real op at that size; the extrapolation probes batches 8 and 16 only.
    def specs(backward):
        inp = ((32, 32, 32, 32), (32768, 1024, 32, 1), torch.float32)
        wt = ((64, 32, 3, 3), (288, 9, 3, 1), torch.float32)
        if backward:
            return (((32, 64, 16, 16), (16384, 256, 16, 1), torch.float32), inp, wt)
        return (inp, wt, ((64,), (1,), torch.float32))

    conv = ((2, 2), (1, 1), (1, 1), False, (0, 0), 1)
    for backward, params in ((False, conv), (True, ((64,), *conv, (True, True, True)))):
        args = specs(backward)
        exact, _, _ = cpu_kernels.conv_probe(backward, args, params, torch.get_num_threads(), "exact")
        monkeypatch.setattr(cpu_kernels, "CONV_PROBE_LIMIT", cpu_kernels._probe_bytes(args, 16, backward))
        got, _, extrapolated = cpu_kernels.conv_probe(backward, args, params, torch.get_num_threads(), "extrapolated")
        monkeypatch.undo()
        assert extrapolated
        assert abs(got - exact) <= 0.02 * exact, (backward, got, exact)


def test_probes_write_nothing_to_stderr(capfd):
    specs = (((2, 3, 8, 8), (192, 64, 8, 1), torch.float32), ((4, 3, 3, 3), (27, 9, 3, 1), torch.float32), None)
    cpu_kernels.conv_probe(False, specs, ((1, 1), (1, 1), (1, 1), False, (0, 0), 1), torch.get_num_threads(), "quiet")
    assert capfd.readouterr().err == ""


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
