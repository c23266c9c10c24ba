"""Pictures: ``--snapshot`` (PyTorch's memory_viz format) and ``--plot`` (a PNG), and the
timeline both are drawn from (memcheck.report.timeline, memcheck.pictures.snapshot, memcheck.pictures.plot).

The byte counts are worked by hand for an ``nn.Linear(10, 5)`` trained with AdamW on a
batch of 4, and the snapshot is read back with torch's own ``torch.cuda._memory_viz``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import pickle
import pickletools
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch.cuda import _memory_viz

import memcheck
from memcheck.cli import main
from memcheck.enums import Category, Device, Phase
from memcheck.errors import UsageError
from memcheck.cuda.gpus import GPUS
from memcheck.pictures.snapshot import snapshot_dict
from memcheck.units import KiB, MiB

# nn.Linear(10, 5) in fp32, a batch of 4 rows, AdamW (torch's single-tensor loop):
WEIGHT, BIAS = 10 * 5 * 4, 5 * 4  # 200 B, 20 B
PARAMS = GRADS = WEIGHT + BIAS  # 220 B each
MOMENTS = 2 * PARAMS  # exp_avg and exp_avg_sq: 440 B
STEP_SCALARS = 2 * 4  # one fp32 `step` tensor per parameter (on the CPU target only)
INPUT = 4 * 10 * 4  # 160 B
# The peak is in step 2's optimizer step, at the weight: denom = (exp_avg_sq.sqrt() /
# bias_correction2_sqrt).add_(eps) holds the sqrt and the quotient, 200 B each, at once.
ADAMW_TEMPS = 2 * WEIGHT
CPU_PEAK = PARAMS + GRADS + MOMENTS + STEP_SCALARS + INPUT + ADAMW_TEMPS  # 1448 B

# On the CUDA target every request below 1 MiB takes a 512 B block of the small pool's
# 2 MiB segment (kMinBlockSize, kSmallBuffer), and AdamW's `step` tensors stay on the CPU.
BLOCK = 512
# torch's default cuBLAS workspace below sm90, ":4096:2:16:8": 2 * 4096 KiB + 8 * 16 KiB per
# handle, one handle for the forward's thread and one for autograd's. Each is over 1 MiB,
# so both come from one 20 MiB large-pool segment (kLargeBuffer), split.
WORKSPACE = 2 * 4096 * KiB + 8 * 16 * KiB  # 8519680 B
# On CUDA torch's AdamW defaults to foreach, whose torch._foreach_sqrt(exp_avg_sqs) makes one
# temporary per parameter (200 B + 20 B), divided and shifted in place.
FOREACH_TEMPS = WEIGHT + BIAS
# The steady-state peak: 2 params + input + 4 moments + 2 grads + 2 transient 512 B blocks
# (in backward: the loss and its gradient; in the optimizer step: the two sqrt temporaries).
CUDA_PEAK = 2 * BLOCK + BLOCK + 4 * BLOCK + 2 * BLOCK + 2 * BLOCK + 2 * WORKSPACE  # 17044992 B
CUDA_RESERVED = 2 * MiB + 20 * MiB

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The opcodes MemoryViz.js's unpickler reads (torch/utils/viz/MemoryViz.js, unpickle()).
VIEWER_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT",
    "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK", "MEMOIZE",
    "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP",
    "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}

TINY = """\
import torch


def build_model():
    return torch.nn.Linear(10, 5)


def make_batch(batch_size, max_len=None):
    return torch.randn(batch_size, 10)
"""


@pytest.fixture(autouse=True)
def _torch_defaults(monkeypatch):
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                "CUBLAS_WORKSPACE_CONFIG", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)


def tiny(device: str, **kwargs) -> memcheck.Estimate:
    torch.manual_seed(0)
    gpu = {"gpu": "A100-40GB"} if device == "cuda" else {}
    return memcheck.estimate(torch.nn.Linear(10, 5), torch.randn(4, 10), device=device, optimizer="adamw",
                             timeline=True, **gpu, **kwargs)


def replay(snapshot: dict, size=lambda n: n) -> int:
    """The most bytes live at once in the snapshot's trace (alloc to free_completed)."""
    live = peak = 0
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live += size(e["size"])
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= size(e["size"])
    return peak


def round_block(n: int) -> int:
    return max(BLOCK, -(-n // BLOCK) * BLOCK) if n < MiB else -(-n // BLOCK) * BLOCK


def identity(folded: str) -> str:  # instead of flamegraph.pl, which _memory_viz would download
    return folded


# ---- the timeline and the snapshot's sizes ----------------------------------------------


def test_cpu_snapshot_peak_is_the_hand_worked_peak():
    est = tiny("cpu")
    snap = snapshot_dict(est.timeline)
    assert est.peak_bytes == CPU_PEAK == 1448
    assert replay(snap) == CPU_PEAK
    peak = est.timeline.train_peak
    assert (peak.step, peak.phase) == (2, Phase.OPTIMIZER)
    assert peak.bytes_of(Category.OPTIMIZER) == MOMENTS + STEP_SCALARS
    assert peak.bytes_of(Category.TEMPORARY) == ADAMW_TEMPS


def test_cuda_snapshot_sizes_are_requests_and_blocks_are_rounded():
    est = tiny("cuda")
    snap = snapshot_dict(est.timeline)
    assert est.peak_bytes == CUDA_PEAK == 17044992
    assert est.reserved_bytes == CUDA_RESERVED
    # torch's trace records what each tensor asked for; rounded up to the allocator's
    # blocks, the live total peaks at the estimate's allocated peak.
    assert replay(snap, round_block) == CUDA_PEAK
    # Requests alone peak in the optimizer step: 1260 B + the workspaces.
    assert replay(snap) == PARAMS + INPUT + GRADS + MOMENTS + FOREACH_TEMPS + 2 * WORKSPACE
    segments = sorted((s["total_size"], s["segment_type"]) for s in snap["segments"])
    assert segments == [(2 * MiB, "small"), (20 * MiB, "large")]
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                assert b["size"] == round_block(b["requested_size"])


def test_cuda_trace_reserves_each_segment_before_its_first_block():
    actions = [(e["action"], e["size"]) for e in snapshot_dict(tiny("cuda").timeline)["device_traces"][0]]
    assert actions[:4] == [("segment_alloc", 2 * MiB), ("alloc", WEIGHT), ("alloc", BIAS), ("alloc", INPUT)]
    assert actions.count(("segment_alloc", 20 * MiB)) == 1
    assert actions.index(("segment_alloc", 20 * MiB)) + 1 == actions.index(("alloc", WORKSPACE))


def test_frames_name_the_step_phase_module_and_category():
    trace = snapshot_dict(tiny("cpu").timeline)["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    # the synthetic frame is the outermost (last); parameters are registered by memcheck, not by
    # Python code of the model's, so it is their only frame
    assert allocs[0]["frames"] == [{"filename": "step", "line": 1, "name": "setup: (model) (params)"}]
    assert allocs[0]["category"] == "params"
    assert {e["category"] for e in trace} >= {"params", "grads", "optimizer", "inputs", "unknown"}
    assert any(e["frames"][-1]["name"] == "backward: (model) (grads)" and e["frames"][-1]["line"] == 2
               for e in allocs)


FRAMED = """\
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(10, 5)

    def forward(self, x):
        h = self.fc(x)
        return h * 2  # the doubled output
"""


def test_frames_carry_the_python_stack_of_the_models_own_file(tmp_path):
    path = tmp_path / "framed.py"
    path.write_text(FRAMED)
    spec = importlib.util.spec_from_file_location("framed", path)
    framed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(framed)
    line = FRAMED.splitlines().index("        return h * 2  # the doubled output") + 1  # 1-based: line 11
    est = memcheck.estimate(framed.Net(), torch.randn(4, 10), device="cpu", optimizer="sgd", timeline=True)
    allocs = [e for e in snapshot_dict(est.timeline)["device_traces"][0] if e["action"] == "alloc"]
    # `h * 2` makes a (4, 5) fp32 tensor, 4 * 5 * 4 B = 80 B, in each step's forward: its
    # innermost frame is that line of the model's file; outward of it, torch's Module call
    # (module.py's _call_impl), then the synthetic frame, outermost.
    doubled = [e for e in allocs if e["frames"][0] == {"filename": str(path), "line": line, "name": "forward"}]
    assert [e["size"] for e in doubled] == [4 * 5 * 4] * 2
    for e in doubled:
        assert any(f["name"] == "_call_impl" and f["filename"].endswith("module.py") for f in e["frames"])
        assert e["frames"][-1]["filename"] == "step" and e["frames"][-1]["name"].startswith("forward: ")
    # innermost first, as torch records it: Linear's forward, then the model's line that called it
    fc = [e for e in allocs if e["frames"][0]["name"] == "forward" and e["frames"][0]["filename"].endswith("linear.py")]
    assert fc and all({"filename": str(path), "line": line - 1, "name": "forward"} in e["frames"] for e in fc)
    # memcheck's own frames (tracer, loop, estimate) are never written
    package = os.path.dirname(memcheck.__file__) + os.sep
    assert not any(f["filename"].startswith(package) for e in allocs for f in e["frames"])
    # the backward runs on autograd's device thread on a GPU, which has no Python frames of the
    # caller: the gradients' allocations carry the synthetic frame alone
    grads = [e for e in allocs if e["category"] == "grads"]
    assert grads and all(len(e["frames"]) == 1 for e in grads)


def test_expandable_segments_are_written_as_mapped_pages(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    est = tiny("cuda")
    snap = snapshot_dict(est.timeline)
    maps = [e["size"] for e in snap["device_traces"][0] if e["action"].startswith("segment")]
    # One 2 MiB page for the small pool; 20 MiB pages for the large one: the first
    # workspace (8.1 MiB) maps one, the second fits in what is left of it (20 - 8.1 MiB).
    assert maps == [2 * MiB, 20 * MiB]
    assert sorted(s["total_size"] for s in snap["segments"]) == [2 * MiB, 20 * MiB]
    assert all(s["is_expandable"] for s in snap["segments"])
    assert replay(snap, round_block) == est.peak_bytes


def test_timeline_points_and_spans():
    tl = tiny("cpu").timeline
    assert [p.event for p in tl.points] == list(range(len(tl.points)))
    assert tl.points[-1].total == PARAMS + INPUT + MOMENTS + STEP_SCALARS  # zero_grad freed the gradients
    start, end = tl.step_range(2)
    assert start == tl.steady_start
    phases = [s.phase for s in tl.spans if start <= s.start < end]
    assert phases == [Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.OPTIMIZER, Phase.ZERO_GRAD]


def test_estimate_keeps_no_timeline_unless_asked_and_json_ignores_it():
    with_tl = tiny("cpu")
    without = memcheck.estimate(torch.nn.Linear(10, 5), torch.randn(4, 10), device="cpu")
    assert without.timeline is None
    assert with_tl.to_dict() == without.to_dict()
    assert "timeline" not in repr(with_tl)


# ---- torch's own viewer reads it ----------------------------------------------------------


def test_memory_viz_renders_the_snapshot():
    snap = snapshot_dict(tiny("cuda").timeline)
    for html in (_memory_viz.trace_plot(snap), _memory_viz.segment_plot(snap)):
        encoded = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))[0]["base64"]
        assert pickle.loads(base64.b64decode(encoded)) == snap
    stats = _memory_viz.segsum(snap)
    assert "total_reserved: 22.0MiB" in stats  # 2 MiB small + 20 MiB large segment
    # Live at the end, as requested (segsum sums requested sizes): weight, bias, input,
    # four moments and both workspaces: 820 B + 2 * 8519680 B = 16.3 MiB.
    assert f"total_allocated: {_memory_viz.Bytes(PARAMS + INPUT + MOMENTS + 2 * WORKSPACE)}" in stats
    text = _memory_viz.trace(snap)
    assert text.count("cudaMalloc(") == 2 and f"{_memory_viz.Bytes(WEIGHT)}]" in text
    folded = _memory_viz.memory(snap, format_flamegraph=identity)
    assert f"stream_0;active_allocated;step:1:setup: (model) (params) {WEIGHT}\n" in folded
    # the flame graph reads outermost first: the synthetic frame, then torch's optimizer frames
    # down to where AdamW makes its state (adam.py's _init_group; adamw.py's before torch 2.6)
    assert re.search(rf"step:1:optimizer_step: \(model\) \(optimizer\);[^\n]*adamw?\.py:\d+:_init_group {WEIGHT}\n",
                     folded)
    per_segment = _memory_viz.segments(snap, format_flamegraph=identity)
    assert per_segment.count(";seg_") == folded.count("stream_0;")


def test_memory_viz_command_line_writes_its_html(tmp_path):
    path = tmp_path / "step.pickle"
    memcheck.write_snapshot(tiny("cpu"), path)
    for command in ("trace_plot", "segment_plot"):
        out = tmp_path / f"{command}.html"
        done = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", command, str(path), "-o", str(out)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "MemoryViz.js" in out.read_text()


def test_snapshot_uses_only_opcodes_the_viewer_unpickles(tmp_path):
    path = tmp_path / "s.pickle"
    memcheck.write_snapshot(tiny("cuda"), path)
    data = path.read_bytes()
    assert data[:2] == b"\x80\x04"  # protocol 4: the viewer reads 2 to 4
    assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES


def test_every_block_lies_in_a_segment_at_every_point_of_the_trace():
    """MemoryViz.js's segment view walks back from the final state; each live block must
    lie inside a segment then, or the viewer fails on it."""
    for device in ("cpu", "cuda"):
        snap = snapshot_dict(tiny(device).timeline)
        segments = {s["address"]: s["total_size"] for s in snap["segments"]}
        blocks = {b["address"]: b["size"] for s in snap["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"}
        for e in reversed(snap["device_traces"][0]):
            for addr in blocks:
                assert any(a <= addr < a + n for a, n in segments.items()), (device, e)
            if e["action"] == "free_completed":
                blocks[e["addr"]] = e["size"]
            elif e["action"] == "alloc":
                del blocks[e["addr"]]
            elif e["action"] in ("segment_alloc", "segment_map"):
                del segments[e["addr"]]
            elif e["action"] == "segment_free":
                segments[e["addr"]] = e["size"]
        assert not blocks and not segments


# ---- the plot --------------------------------------------------------------------------------


def test_plot_is_a_png_of_the_documented_size(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.png"
        memcheck.plot_timeline(tiny(device, budget_bytes=None if device == "cuda" else 4 * KiB), path)
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert image.imread(path).shape == (560, 1000, 4)  # 10 x 5.6 inches at 100 dpi, RGBA


def test_plot_of_an_eval_peak_draws_the_training_step_and_leaves_the_backend_alone(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    est = tiny("cpu", eval_batch=torch.randn(64, 10))
    assert est.peak_in == "eval"
    memcheck.plot_timeline(est, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").read_bytes()[:8] == PNG_MAGIC
    assert matplotlib.get_backend() == before


def test_writers_refuse_an_estimate_without_timeline(tmp_path):
    est = memcheck.estimate(torch.nn.Linear(10, 5), torch.randn(4, 10), device="cpu")
    for write, name in ((memcheck.write_snapshot, "s.pickle"), (memcheck.plot_timeline, "p.png")):
        with pytest.raises(UsageError, match=r"timeline=True"):
            write(est, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    est = tiny("cpu")
    (tmp_path / "s.pickle").write_bytes(b"old")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(UsageError, match=r"s\.pickle.*No space left on device"):
        memcheck.write_snapshot(est, tmp_path / "s.pickle")
    assert [p.name for p in tmp_path.iterdir()] == ["s.pickle"]
    assert (tmp_path / "s.pickle").read_bytes() == b"old"


# ---- the command line ----------------------------------------------------------------------


@pytest.fixture
def model_file(tmp_path):
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "tiny.py"
    path.write_text(TINY)
    out = tmp_path / "out"
    out.mkdir()
    return str(path), out


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_writes_only_the_requested_files(model_file):
    model, out = model_file
    result = run(model, "-b", "4", "--device", "cpu", "--snapshot", out / "s.pickle")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["s.pickle"]
    assert replay(pickle.loads((out / "s.pickle").read_bytes())) == CPU_PEAK
    result = run(model, "-b", "4", "--gpu", "A100-40GB", "--plot", out / "p.png")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["p.png", "s.pickle"]
    assert (out / "p.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_json_is_unchanged_by_the_picture_flags(model_file):
    model, out = model_file
    plain = run(model, "-b", "4", "--gpu", "A100-40GB", "--json")
    drawn = run(model, "-b", "4", "--gpu", "A100-40GB", "--json", "--snapshot", out / "s.pickle",
                "--plot", out / "p.png")
    assert plain.exit_code == drawn.exit_code == 0, drawn.output
    assert drawn.stdout == plain.stdout
    assert json.loads(drawn.stdout)["peak_bytes"] == CUDA_PEAK


@pytest.mark.parametrize("flag, path, message", [
    ("--snapshot", "missing/s.pickle", r"--snapshot '.*missing/s\.pickle': directory '.*missing' does not exist"),
    ("--plot", "missing/p.png", r"--plot '.*missing/p\.png': directory '.*missing' does not exist"),
    ("--snapshot", "s.json", r"--snapshot '.*s\.json' must end in \.pickle"),
    ("--plot", "p.svg", r"--plot '.*p\.svg' must end in \.png"),
    ("--plot", ".", r"--plot '.*' must end in \.png"),
])
def test_cli_bad_paths_are_one_line_and_exit_2_before_tracing(model_file, flag, path, message):
    _, out = model_file
    # The model file does not exist either: the path is checked first.
    result = run(out / "no_model.py", flag, out / path)
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert re.search(message, result.stderr), result.stderr
    assert list(out.iterdir()) == []


def test_cli_plot_without_matplotlib_is_one_line_and_exit_2(model_file, monkeypatch):
    _, out = model_file
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    result = run(out / "no_model.py", "--plot", out / "p.png")
    assert result.exit_code == 2
    assert result.stderr == "memcheck: error: --plot needs matplotlib: pip install 'memcheck[plot]'\n"
    assert list(out.iterdir()) == []


def test_cli_compare_refuses_pictures(model_file):
    model, out = model_file
    result = run(model, "--compare", "--gpus", "2", "--snapshot", out / "s.pickle")
    assert result.exit_code == 2
    assert "cannot be used with --compare" in result.stderr
    assert list(out.iterdir()) == []


def test_cli_plan_draws_its_recommendation(model_file):
    model, out = model_file
    result = run("plan", model, "--device", "cpu", "--gpu-memory", "64KiB", "--json",
                 "--snapshot", out / "s.pickle", "--plot", out / "p.png")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["p.png", "s.pickle"]
    plan = json.loads(result.stdout)
    snap = pickle.loads((out / "s.pickle").read_bytes())
    assert replay(snap) == plan["estimate"]["peak_bytes"]
    assert plan["estimate"]["batch"]["micro_batch_size"] == plan["plan"]["micro_batch_size"]


def test_cli_plan_with_nothing_fitting_writes_nothing_and_says_so(model_file):
    model, out = model_file
    result = run("plan", model, "--device", "cpu", "--gpu-memory", "1KiB", "--plot", out / "p.png")
    assert result.exit_code == 1
    assert "nothing fits, so --snapshot/--plot have no recommendation to draw" in result.stderr
    assert list(out.iterdir()) == []


def test_timeline_device_and_context_are_the_estimates():
    assert tiny("cpu").timeline.device is Device.CPU and tiny("cpu").timeline.context_bytes is None
    est = tiny("cuda")
    assert est.timeline.device is Device.CUDA
    assert est.timeline.context_bytes == est.context_bytes == GPUS["A100-40GB"].context_bytes


def test_a_snapshot_of_the_gpt2_example_has_frames_in_the_example_file(tmp_path):
    """Issue 19: memory_viz shows the user's own file and line. examples/gpt2_small.py's
    compute_loss (``return model(**batch).loss``) is the frame under the model's allocations."""
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "gpt2_small.py"
    line = 1 + example.read_text().splitlines().index("    return model(**batch).loss")
    out = tmp_path / "gpt2.pickle"
    result = CliRunner().invoke(main, [str(example), "--max-len", "16", "-b", "1", "--gpu", "24GiB",
                                       "--snapshot", str(out)])
    assert result.exit_code == 0, result.output
    snapshot = pickle.loads(out.read_bytes())
    frames = [f for event in snapshot["device_traces"][0] for f in event["frames"]]
    ours = [f for f in frames if f["filename"] == str(example)]
    assert ours and {(f["line"], f["name"]) for f in ours} == {(line, "compute_loss")}
    assert any(f["filename"].endswith("modeling_gpt2.py") for f in frames)
    _memory_viz.trace_plot(snapshot)  # and torch's viewer renders it
