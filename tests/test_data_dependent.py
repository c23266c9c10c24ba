"""Stand-ins for data-dependent ops (memcheck.rules.data_dependent): no crash, the assumption in
the report, and, where a real CPU run can realise what was assumed (an all-True mask, all
distinct values, repeats of 1), the estimate against the allocator's measured peak."""

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.profiler import ProfilerActivity, profile

import memcheck
from memcheck.cli import main
from memcheck.enums import Device
from memcheck.errors import TraceError, UnsupportedOpError
from memcheck.measure.local import measure_cpu
from memcheck.rules.probe import cpu_memory_events, running_peak
from memcheck.trace.tracer import ALLOC, FREE, MemoryTracer

TOLERANCE = 0.02  # as tests/test_op_rules.py


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


class Probe(nn.Module):
    """Runs ``op`` on the batch after a learned per-feature scale, so that gradients flow
    back through the op where it has a backward; the op's outputs, as floats, are the loss."""

    def __init__(self, op, features):
        super().__init__()
        self.op = op
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, batch):
        out = self.op(self.scale, *batch)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return sum(o.float().sum() for o in outs)


def loss(model, batch):
    return model(batch)


# name -> (batch builder, op(scale, *batch), words the assumption must contain). Every batch
# realises the case memcheck assumes (all-True masks, distinct values, repeats of 1), so a
# real run allocates what the trace does. The ops are sized to dominate the step's peak.
B, S, D = 32, 512, 4  # 16,384 rows of 4 floats: 16 B a row, as much as a 2-d mask's int64 indices
N = 65536  # elements for the value-dependent ops: 2 * GRAIN_SIZE, where masked_select goes parallel
CASES = {
    # 16,384 rows * 16 B = 256 KiB selected, with nonzero's (16384, 2) int64 * 8 B = 256 KiB
    # held while they are written; backward's index_put holds the indices again.
    "x[mask]": (
        lambda: (torch.randn(B, S, D), torch.ones(B, S, dtype=torch.bool)),
        lambda w, x, m: (x * w)[m],
        "x[mask] assumed to select every element",
    ),
    "x[mask] = v": (  # the same 256 KiB of indices, values not a scalar: no masked_fill_ shortcut
        lambda: (torch.randn(B, S, D), torch.ones(B, S, dtype=torch.bool)),
        lambda w, x, m: torch.zeros_like(x).index_put_((m,), (x * w).reshape(-1, D)),
        "x[mask] = v",
    ),
    # A broadcast mask: 65,536 * 8 B = 512 KiB for mask.sum()'s int64 copy, then the parallel
    # kernel's int64 mask and prefix sum, 2 * 512 KiB, beside the 256 KiB output.
    "masked_select": (
        lambda: (torch.randn(B, S, D), torch.ones(B, S, 1, dtype=torch.bool)),
        lambda w, x, m: torch.masked_select(x * w, m),
        "masked_select assumed to select every element",
    ),
    # 2,048 elements, below GRAIN_SIZE: the serial kernel, whose peak is mask.sum()'s
    # 2048 * 8 B = 16 KiB int64 copy (and 8 B sum), before the 2048 * 4 B = 8 KiB output.
    "masked_select (serial kernel)": (
        lambda: (torch.randn(512, D), torch.ones(512, D, dtype=torch.bool)),
        lambda w, x, m: torch.masked_select(x * w, m),
        "masked_select assumed to select every element",
    ),
    "nonzero": (  # (16384, 2) int64 = 256 KiB each for nonzero and argwhere; where: 2 * 128 KiB
        lambda: (torch.ones(B, S, dtype=torch.bool),),
        lambda w, m: (torch.nonzero(m), torch.where(m)[0], torch.argwhere(m), w),
        "nonzero() assumed to select every element",
    ),
    # 65,536 distinct int64: the sort's copy, indices and a work buffer, 3 * 512 KiB, then
    # values, inverse and counts (3 * 512 KiB) beside the copy, indices and counts' buffer.
    "unique": (
        lambda: (torch.randperm(N),),
        lambda w, ids: (*torch.unique(ids, return_inverse=True, return_counts=True), w),
        "torch.unique assumed every element distinct",
    ),
    "unique sorted only": (  # float32: 256 KiB copy + 2 * 512 KiB int64 before the 256 KiB values
        lambda: (torch.randperm(N).float(),),
        lambda w, v: (v.unique(), w),
        "torch.unique assumed every element distinct",
    ),
    # 16 distinct columns of 4,096 floats (256 KiB): a transposed copy and the sort's copy.
    "unique dim": (
        lambda: (torch.randn(N // 16, 16),),
        lambda w, x: (*torch.unique(x, dim=1, return_counts=True), w),
        "torch.unique(dim=...) assumed every slice distinct",
    ),
    "unique_consecutive": (  # no neighbours equal: 3 * 512 KiB of outputs, no work buffers
        lambda: (torch.randperm(N),),
        lambda w, ids: (*torch.unique_consecutive(ids, return_inverse=True, return_counts=True), w),
        "torch.unique_consecutive assumed no element equal to its neighbour",
    ),
    # randperm: the largest value is N - 1, so N bins, as memcheck assumes: 65536 * 8 B = 512 KiB
    # of int64 counts, and 512 KiB of float64 sums for float64 weights.
    "bincount": (
        lambda: (torch.randperm(N), torch.rand(N, dtype=torch.float64)),
        lambda w, ids, weights: (torch.bincount(ids), torch.bincount(ids, weights, minlength=10), w),
        "bincount: the largest value taken as the element count - 1",
    ),
    # Repeats of 1, as memcheck assumes: 65,536 int64 indices (512 KiB) and their cumulative
    # sum (512 KiB), then 65536 rows * 16 B = 1 MiB gathered.
    "repeat_interleave": (
        lambda: (torch.randn(N, D), torch.ones(N, dtype=torch.long)),
        lambda w, x, r: torch.repeat_interleave(x * w, r, dim=0),
        "repeat_interleave with a tensor of repeats: each repeat taken as 1",
    ),
    # CTC (Wav2Vec2ForCTC's loss): T=200 steps, 16 samples, 4 classes; 16 targets of 50 labels
    # concatenated (labels.masked_select(labels >= 0)), every one full length as memcheck assumes.
    # alpha (16, 200, 2*50+1) float32 = 1,292,800 B, kept for backward; beta the same, inside it.
    "ctc_loss": (
        lambda: (torch.randn(200, 16, D), torch.randint(1, D, (16 * 50,)), torch.full((16,), 200),
                 torch.full((16,), 50)),
        lambda w, x, targets, x_len, t_len: nn.functional.ctc_loss(
            (x * w).log_softmax(-1), targets, x_len, t_len, reduction="sum"),
        "CTC targets taken as 50 labels each",
    ),
}


def estimate_case(name, device="cpu"):
    make_batch, op, _ = CASES[name]
    with torch.device("meta"):
        model, batch = Probe(op, D), make_batch()
    return memcheck.estimate(model, batch, device=device, optimizer="sgd", loss_fn=loss)


@pytest.mark.parametrize("name", CASES)
def test_estimate_matches_a_real_run_that_realises_the_assumption(name):
    make_batch, op, words = CASES[name]

    def build():
        torch.manual_seed(0)
        return Probe(op, D), make_batch()

    measured = measure_cpu(build, sgd, loss_fn=loss).steady_peak_bytes
    est = estimate_case(name)
    assert abs(est.peak_bytes - measured) / measured <= TOLERANCE, (est.peak_bytes, measured)
    assert any(words in a for a in est.assumptions), est.assumptions


def _op_peak_measured(op, args) -> int:
    """The allocator's peak while ``op`` runs on real CPU tensors, above what existed before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = op(*args)
        del out
    return running_peak(n for _, n in cpu_memory_events(prof.profiler.kineto_results.events()))


def _op_peak_traced(op, args) -> int:
    """The trace's peak while ``op`` runs on meta twins of ``args``, above the registered inputs."""
    args = [torch.empty_like(a, device="meta") for a in args]
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        tracer.watch(batch=args)
        start = len(tracer.log.events)
        out = op(*args)
        del out
    return running_peak(ev[2] if ev[0] == ALLOC else -ev[2] if ev[0] == FREE else 0
                        for ev in tracer.log.events[start:])


X, MASK, IDS = torch.randn(4, 16), torch.ones(4, 16, dtype=torch.bool), torch.randperm(64)


@pytest.mark.parametrize("op, args, expected", [
    # 64 selected floats * 4 B = 256 B, beside nonzero's (64, 2) int64 indices * 8 B = 1024 B
    (lambda x, m: x[m], (X, MASK), 64 * 4 + 64 * 2 * 8),
    # serial kernel (64 < GRAIN_SIZE): mask.sum() casts 64 bools to int64 (512 B) + the 8 B sum,
    # freed before the 64 * 4 B = 256 B output
    (lambda x, m: torch.masked_select(x, m), (X, MASK), 64 * 8 + 8),
    # 64 distinct int64: the sort's copy, indices and work buffer, 3 * 512 B; then the values
    # (512 B) beside the copy and indices (2 * 512 B)
    (lambda ids: torch.unique(ids), (IDS,), 3 * 64 * 8),
    # values, inverse and counts (3 * 512 B) beside the copy and indices (2 * 512 B) and the
    # counts' 64 * 8 + 8 B buffer
    (lambda ids: torch.unique(ids, return_inverse=True, return_counts=True), (IDS,), 3 * 512 + 2 * 512 + 520),
    # values, inverse, counts: 3 * 64 int64 * 8 B, nothing more
    (lambda ids: torch.unique_consecutive(ids, return_inverse=True, return_counts=True), (IDS,), 3 * 64 * 8),
    # 4 distinct rows of 16 floats: the output (256 B) and the sort's copy (256 B), with the
    # inverse and counts, 2 * 4 int64 * 8 B = 64 B
    (lambda x: torch.unique(x, dim=0), (X,), 256 + 256 + 64),
    (lambda ids: torch.bincount(ids), (IDS,), 64 * 8),  # largest value 63: 64 int64 bins
    # repeats of 1: 64 int64 indices (512 B) beside the repeats' int64 cumulative sum (512 B)
    (lambda r: torch.repeat_interleave(r), (torch.ones(64, dtype=torch.long),), 64 * 8 + 64 * 8),
    (lambda m: torch.nonzero(m), (MASK,), 64 * 2 * 8),  # (64, 2) int64
])
def test_one_op_allocates_what_the_arithmetic_and_the_allocator_say(op, args, expected):
    assert _op_peak_measured(op, args) == expected
    assert _op_peak_traced(op, args) == expected


@pytest.mark.parametrize("name", CASES)
def test_the_cuda_target_traces_it_too(name):
    est = estimate_case(name, device="cuda")
    assert est.peak_bytes > 0
    assert any(CASES[name][2] in a for a in est.assumptions)


def test_mask_indexing_selects_every_element_and_holds_the_indices():
    shapes = {}

    def op(w, x, m):
        out = (x * w)[m]
        shapes["out"] = tuple(out.shape)
        return out

    with torch.device("meta"):
        model = Probe(op, D)
        batch = (torch.empty(2, 8, D), torch.empty(2, 8, dtype=torch.bool))
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert shapes["out"] == (16, D)  # 2 * 8 rows, all selected
    assert "boolean-mask indexing x[mask] assumed to select every element (worst case)" in est.assumptions


def test_masked_scatter_needs_no_assumption():
    with torch.device("meta"):
        model = Probe(lambda w, x, m: x.masked_scatter(m, x * w), D)
        batch = (torch.empty(4, D), torch.empty(4, D, dtype=torch.bool))
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert est.peak_bytes > 0  # its output has the input's shape whatever the mask holds


def test_unique_of_bool_has_at_most_two_values():
    shapes = {}

    def op(w, m):
        values, counts = torch.unique(m, return_counts=True)
        shapes["values"], shapes["counts"] = tuple(values.shape), tuple(counts.shape)
        return w

    with torch.device("meta"):
        model = Probe(op, 1)
        batch = (torch.empty(100, dtype=torch.bool),)
    memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert shapes == {"values": (2,), "counts": (2,)}


def test_repeat_interleave_with_output_size_assumes_nothing():
    with torch.device("meta"):
        model = Probe(lambda w, x, r: torch.repeat_interleave(x * w, r, dim=0, output_size=12), D)
        batch = (torch.empty(4, D), torch.empty(4, dtype=torch.long))
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert not any("repeat_interleave" in a for a in est.assumptions)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask):
        y = self.lin(x)
        if (mask == 0).any():  # data-dependent branch
            y = y.masked_fill(mask[..., None] == 0, 0.0)
        scale = float(mask.sum().item())  # data-dependent scalar
        return y * scale


def test_data_dependent_checks_resolve_and_are_listed():
    with torch.device("meta"):
        model = DataDependent()
        batch = (torch.empty(4, 8), torch.ones(4, dtype=torch.long))
    est = memcheck.estimate(model, batch, device="cpu", loss_fn=lambda m, b: m(*b).sum())
    assert est.peak_bytes > 0
    text = " ".join(est.assumptions)
    assert "any" in text and ".item()" in text


def test_a_range_check_on_a_max_or_min_passes():
    # transformers' CTC heads: `if labels.max() >= vocab_size: raise ValueError(...)`
    seen = {}

    def op(w, x, labels):
        seen["max >= 32"], seen["min < 0"] = bool(labels.max() >= 32), bool(labels.min() < 0)
        seen["(labels == 0).any()"] = bool((labels == 0).any())  # unchanged: padding assumed present
        return x * w

    with torch.device("meta"):
        model, batch = Probe(op, D), (torch.empty(3, D), torch.empty(3, 5, dtype=torch.long))
    memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert seen == {"max >= 32": False, "min < 0": False, "(labels == 0).any()": True}


def test_nonzero_on_meta_assumes_every_element():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
        x = torch.empty(5, 4)

    def loss(m, b):
        idx = torch.nonzero(b)  # worst case: all 20 elements -> (20, 2) int64 = 320 B
        assert idx.shape == (20, 2)
        return m(b).sum()

    est = memcheck.estimate(model, x, device="cpu", loss_fn=loss)
    assert any("nonzero" in a for a in est.assumptions)


def test_equal_and_allclose_resolve_to_false_as_eq_does():
    seen = {}

    def op(w, x):
        seen["equal"], seen["allclose"] = torch.equal(x, x), torch.allclose(x, x)
        return x * w

    with torch.device("meta"):
        model, batch = Probe(op, D), (torch.empty(3, D),)
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert seen == {"equal": False, "allclose": False}
    assert "torch.equal resolved to False: the batch is assumed to contain padding" in est.assumptions
    assert "torch.allclose resolved to False: the batch is assumed to contain padding" in est.assumptions


SEEN = {}


class ReadsData(nn.Module):
    """Reads values back in Python, as training code does: split sizes from ``.tolist()``, a
    count through numpy, the loss formatted for a log line. What it read goes to ``SEEN``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, lengths):
        sizes = lengths.tolist()
        rows = int(np.asarray(lengths).sum())
        array = lengths.cpu().numpy()
        y = torch.stack([c.sum(0) for c in self.lin(x).split(sizes)])[:rows]
        SEEN.update(sizes=sizes, rows=rows, strides=array.strides, writeable=array.flags.writeable,
                         log=f"{y.sum():.1f}")
        return y


def test_tolist_and_numpy_read_the_synthetic_value_and_match_a_real_run():
    # Lengths of 1, what memcheck reads from a meta tensor: the real run splits the same way.
    def build():
        torch.manual_seed(0)
        return ReadsData(), (torch.randn(64, D), torch.ones(64, dtype=torch.long))

    def loss_fn(model, batch):
        return model(*batch).sum()

    measured = measure_cpu(build, sgd, loss_fn=loss_fn).steady_peak_bytes
    with torch.device("meta"):
        model, batch = build()
    SEEN.clear()
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss_fn)
    assert abs(est.peak_bytes - measured) / measured <= TOLERANCE, (est.peak_bytes, measured)
    # A zero-stride, read-only array: 64 lengths, no host memory for them.
    assert SEEN == {"sizes": [1] * 64, "rows": 64, "strides": (0,), "writeable": False, "log": "1.0"}
    text = " | ".join(est.assumptions)
    for words in ("Tensor.tolist() of a meta tensor read every element as 1",
                  "Tensor.numpy() of a meta tensor read every element as 1",
                  "a data-dependent float (.item()) was taken as 1.0"):
        assert words in text


def test_numpy_of_bfloat16_fails_as_a_real_run_does():
    with torch.device("meta"):
        model = Probe(lambda w, x: (x.numpy(), w)[1], D)
        batch = (torch.empty(4, D, dtype=torch.bfloat16),)
    with pytest.raises(TraceError, match="unsupported ScalarType BFloat16"):
        memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)


# --------------------------------------------------------------------------------------
# What the user is told when an op cannot be traced.

mylib = torch.library.Library("memcheck_dd_test", "DEF")
mylib.define("double_it(Tensor x) -> Tensor")
mylib.impl("double_it", lambda x: x * 2, "CPU")  # a CPU kernel, no meta kernel


@torch.library.custom_op("memcheck_dd_test::triple_it", mutates_args=())
def triple_it(x: torch.Tensor) -> torch.Tensor:  # no register_fake
    return x * 3


@pytest.mark.parametrize("op, name", [
    (lambda x: torch.ops.memcheck_dd_test.double_it(x), "memcheck_dd_test::double_it"),
    (triple_it, "memcheck_dd_test::triple_it"),
    (lambda x: torch.histogram(x.flatten(), bins=4)[0], "aten::histogram.bin_ct"),
])
def test_an_op_without_a_meta_kernel_is_named_on_one_line(op, name):
    with torch.device("meta"):
        model, batch = Probe(lambda w, x: op(x * w), D), (torch.empty(3, D),)
    with pytest.raises(UnsupportedOpError) as info:
        memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert str(info.value) == (
        f"op {name} has no meta kernel and no memcheck rule, so memcheck cannot trace Probe; "
        "register one with memcheck.register_op_rule (see examples/custom_op_rule.py)"
    )


@pytest.mark.parametrize("message, op", [
    ("Could not run 'mylib::fused' with arguments from the 'Meta' backend. This could be because ...",
     "mylib::fused"),
    ("aten::bincount: attempted to run this operator with Meta tensors, but there was no fake impl or Meta "
     "kernel registered. You may have run into this message while using an operator with PT2 ...",
     "aten::bincount"),
    ("The register_meta function for torch.nonzero() raises unimplemented by default, as a correct "
     "data-independent implementation does not exist.", "torch.nonzero"),
])
def test_each_shape_of_torchs_missing_kernel_message_names_the_op(message, op):
    from memcheck.engine.estimate import _translate

    error = _translate(NotImplementedError(message + "\nmore lines"), "m_bincount")
    assert isinstance(error, UnsupportedOpError)
    assert str(error).startswith(f"op {op} has no meta kernel and no memcheck rule, so memcheck cannot "
                                 "trace m_bincount; register one with memcheck.register_op_rule")
    assert "\n" not in str(error)


def test_reading_data_is_not_called_a_missing_kernel():
    with torch.device("meta"):
        model, batch = Probe(lambda w, x: torch.as_tensor(x * w, device="cpu"), D), (torch.empty(3, D),)
    with pytest.raises(TraceError) as info:
        memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss)
    assert not isinstance(info.value, UnsupportedOpError)
    assert "Probe reads tensor data (.numpy()/.tolist()/...) that meta tensors do not have" in str(info.value)


# --------------------------------------------------------------------------------------
# The command line, through a model file.

DEDUP = '''
import torch
from torch import nn


class Dedup(nn.Module):
    """Keeps the unmasked tokens, embeds each distinct one once, weights it by its count."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 8)

    def forward(self, ids, mask):
        kept = ids[mask]
        values, inverse = torch.unique(kept, return_inverse=True)
        counts = torch.bincount(inverse)
        return (self.emb(values)[inverse] * counts[inverse, None]).sum()


def build_model():
    return Dedup()


def make_batch(batch_size, max_len):
    return torch.randint(0, 1000, (batch_size, max_len)), torch.ones(batch_size, max_len, dtype=torch.bool)


def compute_loss(model, batch):
    return model(*batch)
'''

NO_META_KERNEL = '''
import torch
from torch import nn

lib = torch.library.Library("memcheck_dd_cli", "DEF")
lib.define("double_it(Tensor x) -> Tensor")
lib.impl("double_it", lambda x: x * 2, "CPU")


class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.memcheck_dd_cli.double_it(self.lin(x))


def build_model():
    return Doubler()


def make_batch(batch_size, max_len):
    return torch.randn(batch_size, max_len, 4)
'''


def test_cli_traces_a_model_file_with_data_dependent_ops_and_lists_the_assumptions(tmp_path):
    path = tmp_path / "dedup.py"
    path.write_text(DEDUP)
    result = CliRunner().invoke(main, [str(path), "--max-len", "16", "-b", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    for words in ("boolean-mask indexing x[mask] assumed to select every element (worst case)",
                  "torch.unique assumed every element distinct (worst case)",
                  "bincount: the largest value taken as the element count - 1, so max(minlength, numel) = 32 bins"):
        assert words in " ".join(result.output.split())  # 2 * 16 tokens kept, all distinct: 32 bins


def test_cli_names_an_op_without_a_meta_kernel_and_exits_2(tmp_path):
    path = tmp_path / "doubler.py"
    path.write_text(NO_META_KERNEL)
    result = CliRunner().invoke(main, [str(path), "--max-len", "16", "-b", "2", "--device", "cpu"])
    assert result.exit_code == 2
    assert result.stderr == (
        "memcheck: error: op memcheck_dd_cli::double_it has no meta kernel and no memcheck rule, so memcheck "
        "cannot trace doubler; register one with memcheck.register_op_rule (see examples/custom_op_rule.py)\n"
    )


def test_a_non_negative_ids_check_reads_the_valid_batch_and_says_so():
    # ProphetNet asserts torch.all(shifted_input_ids >= 0): a batch a job can train on passes it.
    with MemoryTracer("cpu") as tracer:
        ids = torch.empty(4, 8, dtype=torch.long, device="meta")
        tracer.watch(batch={"ids": ids})
        answers = {
            "ids >= 0": torch.all(ids >= 0).item(),
            "ids > -1": bool((ids > -1).all()),
            "ids >= 3 (not a validity check)": bool((ids >= 3).all()),
        }
    assert answers == {"ids >= 0": True, "ids > -1": True, "ids >= 3 (not a validity check)": False}
    assert "token ids assumed non-negative: all(ids >= 0) read True" in tracer.log.assumptions
