"""cuDNN convolution workspaces on the CUDA target (memcheck.rules.cuda_conv), worked out by hand."""

import pytest
import torch
import torch.nn.functional as F

import memcheck
from memcheck.cuda.allocator import simulate
from memcheck.enums import Device
from memcheck.errors import UsageError
from memcheck.pictures.snapshot import snapshot_dict
from memcheck.rules import cuda_conv
from memcheck.rules.cuda_conv import (
    BACKWARD_DATA,
    BACKWARD_FILTER,
    FORWARD,
    conv_workspace_calls,
    heuristic_workspace_bytes,
    im2col_bytes,
    nhwc_copy_bytes,
    wscap_bytes,
)
from memcheck.trace.tracer import ALLOC, FREE, MemoryTracer

MiB = 2**20


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _scratch(tracer):
    """(bytes, name) of each named scratch block, in order."""
    out = []
    for e in tracer.log.events:
        if e[0] == ALLOC and e[1] < 0:
            frames = tracer.log.stacks.get(id(e), ())
            out.append((e[2], frames[0][2] if frames else None))
    return out


# -- sizes ------------------------------------------------------------------------------------

def test_nhwc_copy_pads_channels_to_16_bytes():
    # fp32 (TF32): 4 channels a 16-byte vector; 3 -> 4: 2 * 4 * 8 * 8 * 4 B = 2,048 B
    assert nhwc_copy_bytes(meta(2, 3, 8, 8)) == 2_048
    # fp16: 8 channels; 3 -> 8: 2 * 8 * 8 * 8 * 2 B = 2,048 B; 16 stays 16: 2 * 16 * 64 * 2 = 4,096 B
    assert nhwc_copy_bytes(meta(2, 3, 8, 8, dtype=torch.float16)) == 2_048
    assert nhwc_copy_bytes(meta(2, 16, 8, 8, dtype=torch.float16)) == 4_096


def test_channels_last_tensors_need_no_copy():
    x = meta(2, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    assert nhwc_copy_bytes(x) == 0


def test_heuristic_workspace_is_the_three_nhwc_copies():
    # Conv2d(16 -> 32, 3x3) on (4, 16, 32, 32) fp32: x 4*16*32*32*4 = 262,144 B, w 32*16*9*4 =
    # 18,432 B (16 channels, a multiple of 4), y 4*32*30*30*4 = 460,800 B -> 741,376 B.
    x, w, y = meta(4, 16, 32, 32), meta(32, 16, 3, 3), meta(4, 32, 30, 30)
    assert heuristic_workspace_bytes(x, w, y) == 741_376


def test_fp32_without_tf32_takes_no_tensor_core_engine_and_no_workspace():
    x, w, y = meta(4, 16, 32, 32), meta(32, 16, 3, 3), meta(4, 32, 30, 30)
    assert heuristic_workspace_bytes(x, w, y, allow_tf32=False) == 0
    assert heuristic_workspace_bytes(x.double(), w.double(), y.double()) == 0


def test_im2col_buffer_of_the_cnn_stage_one_conv():
    # x (32, 64, 224, 224), w (64, 64, 3, 3), y (32, 64, 224, 224) fp32:
    # 32 * 64 * 9 * 50,176 * 4 B = 3,699,376,128 B
    x, w = meta(32, 64, 224, 224), meta(64, 64, 3, 3)
    assert im2col_bytes(x, w, x) == 3_699_376_128


def test_wscap_caps_the_workspace_in_mib():
    x, w, y = meta(4, 16, 32, 32), meta(32, 16, 3, 3), meta(4, 32, 30, 30)
    assert wscap_bytes({"CUDNN_CONV_WSCAP_DBG": "0"}) == 0
    assert wscap_bytes({}) is None
    assert heuristic_workspace_bytes(x, w, y, cap=wscap_bytes({"CUDNN_CONV_WSCAP_DBG": "0"})) == 0
    # a cap above the need changes nothing: 1 MiB > 741,376 B
    assert heuristic_workspace_bytes(x, w, y, cap=1 * MiB) == 741_376
    with pytest.raises(UsageError, match="CUDNN_CONV_WSCAP_DBG='64MB'"):
        wscap_bytes({"CUDNN_CONV_WSCAP_DBG": "64MB"})


def test_benchmark_search_runs_once_per_convolution_with_the_larger_block():
    # benchmark on, first call: the search block max(741,376, im2col 4*16*9*900*4 = 2,073,600) =
    # 2,073,600 B, then the chosen plan's 741,376 B; a second call: the plan alone.
    x, w, y = meta(4, 16, 32, 32), meta(32, 16, 3, 3), meta(4, 32, 30, 30)
    first = conv_workspace_calls(FORWARD, x, w, y, benchmark=True, first_call=True)
    assert [(c.name, c.nbytes) for c in first] == [
        ("cuDNN benchmark search workspace: conv forward", 2_073_600),
        ("cuDNN workspace: conv forward", 741_376),
    ]
    later = conv_workspace_calls(FORWARD, x, w, y, benchmark=True, first_call=False)
    assert [c.nbytes for c in later] == [741_376]
    # benchmark off (the default): no search, ever
    assert [c.nbytes for c in conv_workspace_calls(FORWARD, x, w, y)] == [741_376]


def test_unknown_kind_is_refused_by_name():
    with pytest.raises(UsageError, match="'sideways'"):
        conv_workspace_calls("sideways", meta(1, 4, 4, 4), meta(4, 4, 1, 1), meta(1, 4, 4, 4))


# -- through the allocator ----------------------------------------------------------------------

def test_stage_one_workspace_through_the_allocator_rounding():
    # The CNN's second convolution, fp32 (32, 64, 224, 224) in and out, (64, 64, 3, 3) weight:
    # 411,041,792 + 147,456 + 411,041,792 = 822,231,040 B, a multiple of 512 (1,605,920 x 512).
    # Over 10 MiB, its segment is rounded up to 2 MiB: ceil(822,231,040 / 2,097,152) = 393
    # -> 824,180,736 B reserved; the 1,949,696 B rest is over 1 MiB, so it is split off and
    # the block granted is the request.
    x, w = meta(32, 64, 224, 224), meta(64, 64, 3, 3)
    ws = heuristic_workspace_bytes(x, w, x)
    assert ws == 822_231_040
    stats = simulate([(ALLOC, 1, ws)])
    assert stats.granted == (822_231_040,)
    assert stats.peak_reserved_bytes == 824_180_736


def test_a_freed_workspace_stays_reserved_and_serves_the_next_activation():
    # workspace 822,231,040 B freed, then a 411,041,792 B activation: carved from the cached
    # segment, so reserved stays 824,180,736 B (no second cudaMalloc).
    stats = simulate([(ALLOC, 1, 822_231_040), (FREE, 1, 822_231_040), (ALLOC, 2, 411_041_792)])
    assert stats.peak_reserved_bytes == 824_180_736
    assert stats.segments_at_peak == 1


def test_a_small_workspace_takes_a_small_pool_segment():
    # 741,376 B <= 1 MiB: small pool, one 2 MiB segment
    stats = simulate([(ALLOC, 1, 741_376)])
    assert stats.peak_reserved_bytes == 2 * MiB


# -- in the trace -----------------------------------------------------------------------------

def test_forward_call_emits_one_named_block_after_its_output():
    x, w = meta(4, 16, 32, 32), meta(32, 16, 3, 3)
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        F.conv2d(x, w)
    assert _scratch(tracer) == [(741_376, "cuDNN workspace: conv forward")]
    sizes = [e[2] for e in tracer.log.events if e[0] == ALLOC]
    assert sizes == [460_800, 741_376]  # the output first, as run_conv_plan allocates after it
    assert any("NHWC" in a for a in tracer.log.assumptions)


def test_backward_emits_the_data_call_then_the_filter_call():
    # grad_input's call (backward data) then grad_weight's (backward filter); each sees the
    # same three shapes: 741,376 B each.
    x = meta(4, 16, 32, 32).requires_grad_()
    w = meta(32, 16, 3, 3).requires_grad_()
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        F.conv2d(x, w).sum().backward()
    names = [n for _, n in _scratch(tracer)]
    assert names == ["cuDNN workspace: conv forward", "cuDNN workspace: conv backward data",
                     "cuDNN workspace: conv backward filter"]
    assert {b for b, _ in _scratch(tracer)} == {741_376}


def test_a_first_layer_backward_has_no_data_call():
    x = meta(4, 16, 32, 32)  # the batch: no gradient wanted
    w = meta(32, 16, 3, 3).requires_grad_()
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        F.conv2d(x, w).sum().backward()
    assert [n for _, n in _scratch(tracer)] == ["cuDNN workspace: conv forward",
                                                "cuDNN workspace: conv backward filter"]


def test_benchmark_reaches_the_rule_through_the_tracer():
    x, w = meta(4, 16, 32, 32), meta(32, 16, 3, 3)
    tracer = MemoryTracer(Device.CUDA)
    tracer.cudnn_benchmark = True
    with tracer:
        F.conv2d(x, w)
        F.conv2d(x, w)
    assert [b for b, _ in _scratch(tracer)] == [2_073_600, 741_376, 741_376]


def test_depthwise_convolutions_take_no_cudnn_workspace():
    x, w = meta(4, 16, 32, 32), meta(16, 1, 3, 3)
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        F.conv2d(x, w, groups=16)
    assert _scratch(tracer) == []


def test_the_cpu_target_gets_no_cudnn_workspace():
    x, w = meta(4, 16, 32, 32), meta(32, 16, 3, 3)
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        cuda_conv.cudnn_convolution_scratch(tracer, [(FORWARD, x, w, meta(4, 32, 30, 30))])
    assert _scratch(tracer) == []


def test_cuda_snapshot_names_the_workspace_blocks():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    est = memcheck.estimate(model, torch.randn(2, 3, 16, 16), device="cuda", optimizer="sgd", timeline=True,
                            loss_fn=lambda m, b: m(b).sum())
    names = {f["name"] for e in snapshot_dict(est.timeline)["device_traces"][0] if e["action"] == "alloc"
             for f in e["frames"]}
    assert {"cuDNN workspace: conv forward", "cuDNN workspace: conv backward data",
            "cuDNN workspace: conv backward filter"} <= names


def test_the_cudnn_benchmark_job_setting_adds_one_search_block_per_convolution():
    # --cudnn-benchmark / Job(cudnn_benchmark=True) (Lightning's Trainer(benchmark=True)) reaches the rule.
    # Two Conv2d(16, 16, 3, padding=1) on x (4, 16, 32, 32) fp32: the search block is the larger of the
    # NHWC copies (x 65,536 + w 2,304 + y 65,536 elements = 133,376 x 4 B = 533,504 B) and the im2col
    # buffer 4 * 16 * 9 * 1,024 elements x 4 B = 2,359,296 B, once for each of forward, backward data
    # (the second conv's; the first's input needs no gradient) and backward filter: the two convs have
    # the same shapes, so cuDNN's plan cache serves the second from the first's search.
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 16, 3, padding=1, bias=False))

    def searches(**settings):
        est = memcheck.estimate(model, torch.randn(4, 16, 32, 32), device="cuda", optimizer="sgd", timeline=True,
                                loss_fn=lambda m, b: m(b).sum(), **settings)
        return sorted((e["frames"][0]["name"], e["size"]) for e in snapshot_dict(est.timeline)["device_traces"][0]
                      if e["action"] == "alloc" and e["frames"] and "search" in e["frames"][0]["name"])

    assert searches() == []
    assert searches(cudnn_benchmark=True) == [
        ("cuDNN benchmark search workspace: conv backward data", 2_359_296),
        ("cuDNN benchmark search workspace: conv backward filter", 2_359_296),
        ("cuDNN benchmark search workspace: conv forward", 2_359_296)]
