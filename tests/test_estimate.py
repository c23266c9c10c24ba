"""The Python API: estimate() on meta and on real models."""

import pytest
import torch
from torch import nn

import memcheck
from memcheck.errors import UsageError


def small():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def test_breakdown_sums_to_the_peak():
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    est = memcheck.estimate(model, x, device="cpu")
    assert est.breakdown_at_peak.total == est.peak_bytes
    assert sum(est.to_dict()["breakdown_at_peak"].values()) == est.to_dict()["peak_bytes"]


def test_params_counted_by_hand():
    # (64*256 + 256 + 256*10 + 10) params * 4 B = (16384 + 256 + 2560 + 10) * 4 = 76840 B
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    est = memcheck.estimate(model, x, device="cpu")
    assert est.breakdown_at_peak.params == 76840


def test_pure_bf16_halves_the_weights():
    # the same 19210 params at 2 B each = 38420 B
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    est = memcheck.estimate(model, x, device="cpu", precision="bf16")
    assert est.breakdown_at_peak.params == 38420


def test_a_real_model_is_neither_moved_nor_modified():
    model, x = small(), torch.randn(32, 64)
    before = [p.detach().clone() for p in model.parameters()]
    est = memcheck.estimate(model, x, device="cpu", precision="bf16")
    assert est.peak_bytes > 0
    for p, q in zip(model.parameters(), before):
        assert p.device.type == "cpu" and p.dtype == torch.float32 and torch.equal(p, q)
        assert p.grad is None


def test_dict_batches_use_the_model_loss():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x, labels):
            return {"loss": nn.functional.cross_entropy(self.lin(x), labels)}

    with torch.device("meta"):
        model = WithLoss()
        batch = {"x": torch.empty(4, 8), "labels": torch.zeros(4, dtype=torch.long)}
    est = memcheck.estimate(model, batch, device="cpu")
    assert est.batch.inputs[0].shape == (4, 8)


def test_budget_sets_fits():
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    big = memcheck.estimate(model, x, device="cpu", budget_bytes=2**30)
    tiny = memcheck.estimate(model, x, device="cpu", budget_bytes=1024)
    assert big.fits is True and tiny.fits is False
    assert memcheck.estimate(model, x, device="cpu").fits is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 1}, "steps"),
        ({"device": "tpu"}, "allowed: cpu, cuda"),
        ({"optimizer": "adamm"}, "did you mean 'adam'"),
        ({"precision": "fp8"}, "allowed"),
        ({"budget_bytes": -5}, "budget_bytes"),
    ],
)
def test_bad_arguments_raise_usage_errors_naming_them(kwargs, match):
    with torch.device("meta"):
        model, x = small(), torch.empty(2, 64)
    with pytest.raises(UsageError, match=match):
        memcheck.estimate(model, x, **kwargs)


def test_failing_forward_is_a_trace_error():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            raise ValueError("shape mismatch in my layer")

    with pytest.raises(memcheck.TraceError, match="shape mismatch in my layer"):
        memcheck.estimate(Broken(), torch.empty(2, 2, device="meta"), device="cpu")


def test_a_meta_kernel_that_refuses_a_call_is_named_not_blamed_on_the_model(monkeypatch):
    # Issue 18: aten._grouped_mm's meta kernel accepts bf16 only, where the CPU and CUDA
    # kernels take float32 too. Without memcheck's rule the error names the meta kernel.
    from memcheck.rules import registry

    monkeypatch.delitem(registry.DISPATCH_RULES, torch.ops.aten._grouped_mm.default)

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 32, 64))

        def forward(self, x):
            offs = torch.tensor([8, 16, 24, 32], dtype=torch.int32, device=x.device)
            return torch.nn.functional.grouped_mm(x, self.w, offs=offs).sum()

    with torch.device("meta"):
        model, x = Experts(), torch.empty(32, 32)
    with pytest.raises(memcheck.TraceError, match="in the meta kernel of aten._grouped_mm.default") as info:
        memcheck.estimate(model, x, device="cpu", loss_fn=lambda m, b: m(b))
    assert "fix the model code" not in str(info.value) and "register_op_rule" in str(info.value)


def test_a_model_with_nothing_to_train_is_a_usage_error():
    with pytest.raises(UsageError, match="no trainable parameters"):
        memcheck.estimate(nn.ReLU(), torch.empty(2, 2, device="meta"), device="cpu")


def test_str_is_the_table_and_labels_binary_units():
    with torch.device("meta"):
        model, x = small(), torch.empty(32, 64)
    text = str(memcheck.estimate(model, x, device="cpu", budget_bytes=2**30))
    assert "peak (steady state)" in text and "KiB" in text and "FITS" in text


MiB_ = 2**20


def _tiny_linear():
    with torch.device("meta"):
        model = torch.nn.Linear(1024, 1024, bias=False)
        x = torch.empty(8, 1024)
    return model, x


def test_cuda_estimate_adds_two_cublas_workspaces_of_the_arch_size():
    model, x = _tiny_linear()
    # sm90: 4096 KiB * 8 = 32 MiB per workspace (CublasHandlePool.cpp); one for the forward's
    # thread, one for autograd's device thread.
    h100 = memcheck.estimate(model, x, device="cuda", optimizer="sgd", gpu="H100-80GB")
    assert h100.breakdown_at_peak.workspaces == 2 * 32 * MiB_
    # Other archs: 4096 KiB * 2 + 16 KiB * 8 = 8,519,680 B each.
    a100 = memcheck.estimate(model, x, device="cuda", optimizer="sgd", gpu="A100-80GB")
    assert a100.breakdown_at_peak.workspaces == 2 * 8_519_680


def test_cublas_workspace_config_changes_the_workspaces(monkeypatch):
    model, x = _tiny_linear()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # deterministic mode: 16 KiB * 8 = 128 KiB
    est = memcheck.estimate(model, x, device="cuda", optimizer="sgd", gpu="A100-80GB")
    assert est.breakdown_at_peak.workspaces == 2 * 128 * 1024


def test_cuda_totals_are_consistent_and_segments_whole():
    model, x = _tiny_linear()
    est = memcheck.estimate(model, x, device="cuda", optimizer="sgd", gpu="H100-80GB")
    assert est.breakdown_at_peak.total == est.peak_bytes
    # Every segment is a multiple of 2 MiB (2 MiB small segments, 20 MiB, or rounded up to 2 MiB).
    assert est.reserved_bytes % (2 * MiB_) == 0 and est.reserved_bytes >= est.peak_bytes
    # Large-pool segments at least: two 32 MiB workspaces (one segment each: >= 10 MiB is
    # rounded to 2 MiB), and the 4 MiB weight in a 20 MiB segment (requests of 1-10 MiB).
    assert est.reserved_bytes >= (32 + 32 + 20) * MiB_
    assert est.device_total_bytes == est.reserved_bytes + est.context_bytes
    assert est.budget_bytes == est.gpu.capacity_bytes


def test_expandable_segments_are_read_from_the_environment(monkeypatch):
    model, x = _tiny_linear()
    plain = memcheck.estimate(model, x, device="cuda", optimizer="sgd", gpu="H100-80GB")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    expandable = memcheck.estimate(model, x, device="cuda", optimizer="sgd", gpu="H100-80GB")
    assert expandable.peak_bytes == plain.peak_bytes  # rounding to 512 B is the same...
    assert expandable.reserved_bytes != plain.reserved_bytes  # ...but segments grow by pages


def test_a_bad_alloc_conf_is_one_clear_error(monkeypatch):
    model, x = _tiny_linear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:abc")
    with pytest.raises(UsageError, match="max_split_size_mb"):
        memcheck.estimate(model, x, device="cuda", gpu="T4")


def test_estimating_for_cuda_never_initialises_cuda():
    model, x = _tiny_linear()
    memcheck.estimate(model, x, device="cuda", precision="amp-fp16", gpu="H100-80GB")
    assert not torch.cuda.is_initialized()


def test_cpu_estimates_have_no_device_totals():
    model, x = _tiny_linear()
    est = memcheck.estimate(model, x, device="cpu")
    assert est.reserved_bytes is None and est.device_total_bytes is None and est.gpu is None


def test_fragmentation_is_what_is_reserved_beyond_the_allocated_peak():
    model, x = _tiny_linear()
    est = memcheck.estimate(model, x, device="cuda", optimizer="sgd", gpu="H100-80GB")
    assert est.fragmentation_bytes == est.reserved_bytes - est.peak_bytes >= 0


def test_the_allocator_life_releases_cached_segments_when_the_gpu_is_full():
    # Setup (phase SETUP, step 0) then one training step whose events are those of
    # tests/test_allocator.py's release test: a 12 MiB segment cached, then a 16 MiB request.
    # Unbounded the allocator reserves 12 + 16 = 28 MiB. On a GPU with 20 MiB of room beside its
    # context it gives the cached 12 MiB segment back and retries: 16 MiB; with 15 MiB the retry
    # fails too, and the unbounded figures stand (the job does not fit).
    from memcheck.cuda.gpus import GpuSpec
    from memcheck.cuda.replay import allocator_life
    from memcheck.enums import ALLOC, FREE, Category, Event, Phase

    MiB = 2**20
    act = (Category.ACTIVATION, None)
    events = [Event(ALLOC, "x", 12 * MiB, *act, Phase.FORWARD), Event(FREE, "x", 12 * MiB, *act, Phase.FORWARD),
              Event(ALLOC, "y", 16 * MiB, *act, Phase.BACKWARD), Event(FREE, "y", 16 * MiB, *act, Phase.BACKWARD)]

    def gpu(room):
        return GpuSpec("test", capacity_bytes=room + 64 * MiB, arch=(8, 0), context_bytes=64 * MiB)

    fits = allocator_life(events, 0, len(events), gpu(20 * MiB))
    assert (fits.peak_reserved_bytes, fits.released) == (16 * MiB, True)
    full = allocator_life(events, 0, len(events), gpu(15 * MiB))
    assert (full.peak_reserved_bytes, full.released) == (28 * MiB, False)
    assert allocator_life(events, 0, len(events), None).peak_reserved_bytes == 28 * MiB


def test_the_report_says_where_reserved_peaked_and_when_the_allocator_settles():
    # a rendering test: the report and the JSON carry the allocator's life as the Estimate has it
    from torch import nn

    from memcheck.report.text import render_estimate

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))
    est = memcheck.estimate(model, torch.empty(256, 1024, device="meta"), memcheck.Job(gpu="A100-80GB",
                                                                                        optimizer="sgd"))
    assert est.steady_step is not None and est.reserved_peak_step is not None
    text = " ".join(render_estimate(est).split())  # the table wraps its lines at 80 columns
    data = est.to_dict()
    assert data["allocator_steady_step"] == est.steady_step
    assert data["reserved_peak"] == {"phase": est.reserved_peak_phase.value, "step": est.reserved_peak_step}
    assert f"the allocator settles after step {est.steady_step}" in text


# ---- who is to blame: the model's own code, or stock library code it did not write (issue 38) ----


def test_a_failure_in_the_user_s_own_forward_says_to_fix_the_model_there():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            raise ValueError("shape mismatch in my layer")

    with pytest.raises(memcheck.TraceError) as info:
        memcheck.estimate(Broken(), torch.empty(2, 2, device="meta"), device="cpu")
    assert "fix the model code there" in str(info.value) and "test_estimate.py:" in str(info.value)
    assert "memcheck could not trace" not in str(info.value)


def test_the_user_s_code_calling_torch_with_what_it_refuses_is_the_model_s_to_fix():
    class Mismatched(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 3)

        def forward(self, x):
            return sum(torch.split(self.lin(x), [1, 1], dim=1))  # 3 columns split as 1 + 1: torch refuses

    with torch.device("meta"):
        model = Mismatched()
    with pytest.raises(memcheck.TraceError, match="fix the model code there"):
        memcheck.estimate(model, torch.empty(2, 2, device="meta"), device="cpu")


def test_a_failure_inside_stock_transformers_code_is_memcheck_s_naming_the_op_and_the_settings(monkeypatch):
    # A memcheck rule made to fail (the CUDA dropout rule's argument binding replaced by a builtin
    # that refuses its arguments), called from GPT-2's own (stock transformers) forward. Nothing of
    # the user's is on the stack (a stand-in written here would be: this file is user code), so the
    # message must not blame the model: memcheck could not trace it, where, the op, the settings.
    from transformers import GPT2Config, GPT2LMHeadModel

    from memcheck.rules import dropout

    monkeypatch.setattr(dropout, "bind", int)  # int(func, args, kwargs, names=..., defaults=...): TypeError
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with pytest.raises(memcheck.TraceError) as info:
        memcheck.estimate(model, {"input_ids": ids, "labels": ids}, device="cuda", gpu="T4", checkpointing="half")
    message = str(info.value)
    assert "fix the model code" not in message
    assert message.startswith("memcheck could not trace GPT2LMHeadModel with --device cuda --checkpointing half: "
                              "TypeError: "), message
    assert "raised inside transformers (transformers/models/gpt2/modeling_gpt2.py:" in message
    assert "while tracing torch.nn.functional.dropout" in message
    assert len(message.splitlines()) == 1


# -- cuBLAS workspaces: taken inside each thread's first cuBLAS op ------------------------------

def test_the_tracer_marks_each_threads_first_cublas_op_after_its_output():
    from memcheck.enums import ALLOC, Device, Phase
    from memcheck.enums import AUTOGRAD_THREAD, MAIN_THREAD
    from memcheck.trace.tracer import MemoryTracer

    x, w = torch.empty(4, 8, device="meta"), torch.empty(8, 8, device="meta")
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        tracer.phase = Phase.FORWARD
        kept = [torch.relu(x)]  # event 0: no cuBLAS
        kept.append(torch.mm(x, w))  # event 1: its output; the main thread's workspace goes after it
        kept.append(torch.mm(x, w))  # event 2: a second call binds nothing new
        tracer.phase = Phase.BACKWARD
        kept.append(torch.relu(x))  # event 3
        kept.append(torch.mm(x, w))  # event 4: the autograd thread's first cuBLAS op
    assert [e[0] for e in tracer.log.events[:5]] == [ALLOC] * 5
    assert tracer.log.blas_first == {(MAIN_THREAD, 0): 2, (AUTOGRAD_THREAD, 0): 5}


def test_workspaces_are_inserted_at_the_marks_and_a_thread_without_cublas_gets_none():
    from memcheck.cuda.replay import with_workspaces
    from memcheck.enums import ALLOC, MAIN_THREAD, Category, Event, Phase

    def ev(sid, phase):
        return Event(ALLOC, sid, 1024, Category.TEMPORARY, "m", phase, 0, 0)

    events = [ev(1, Phase.FORWARD), ev(2, Phase.FORWARD), ev(3, Phase.BACKWARD)]
    out, start = with_workspaces(events, (9, 0), 2, [(2, MAIN_THREAD)])
    # sm90: one 32 MiB workspace for the main thread, after event 2 (the mm's output); backward
    # called no cuBLAS op, so no autograd-thread workspace
    assert [e[1] for e in out] == [1, 2, "workspace:cuBLAS workspace (main thread):0", 3]
    assert out[2][2] == 32 * 2**20 and out[2][5] is Phase.FORWARD
    assert start == 3 and out[start][1] == 3  # step 2 still starts at its own first event


def test_where_the_workspace_lands_decides_a_later_segment():
    # The GPT-2 pure-bf16 mechanism in miniature (MiB): a 24 MiB output is freed before
    # backward; backward allocates a 24 MiB grad and takes a 4 MiB cuBLAS workspace.
    # At backward's start the workspace splits the freed 24 MiB segment (4 + 20 free), so
    # the grad needs a second 24 MiB segment: 48 MiB reserved. Taken inside the op, after
    # the grad, the grad refills the 24 MiB segment exactly and the 4 MiB workspace gets a
    # new 20 MiB segment (kLargeBuffer, requests of 1-10 MiB): 44 MiB reserved.
    from memcheck.cuda.allocator import simulate
    from memcheck.enums import ALLOC, FREE

    MiB = 2**20
    out, ws, grad = [(ALLOC, 1, 24 * MiB), (FREE, 1, 24 * MiB)], (ALLOC, 2, 4 * MiB), (ALLOC, 3, 24 * MiB)
    assert simulate(out + [ws, grad]).peak_reserved_bytes == 48 * MiB
    assert simulate(out + [grad, ws]).peak_reserved_bytes == 44 * MiB


_THREADS_SEEN: list[int] = []  # module-level: the trace works on a copy of the model


class _CountsThreads(torch.nn.Module):
    """Notes the intra-op thread count the CPU rules would read while it is traced."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        _THREADS_SEEN.append(torch.get_num_threads())
        return self.lin(x)


@pytest.mark.parametrize("settings, threads", [
    (dict(strategy="ddp", gpus=2), 1),  # two CPU ranks on the machine: torchrun gives each OMP_NUM_THREADS=1
    (dict(), None),  # one process: the process's own count
])
def test_cpu_ranks_are_traced_with_the_one_thread_torchrun_gives_each(settings, threads, monkeypatch):
    # c03-wav2vec2 of issue 38's matrix: oneDNN's buffers for a grouped convolution's backward are per thread
    # (551,168 B on one, 1,108,224 B on two); the probes ran on this process's threads and the real ranks on one
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    was = torch.get_num_threads()
    if was == 1:
        pytest.skip("this process runs one intra-op thread: nothing to tell apart")
    seen = _THREADS_SEEN
    seen.clear()
    with torch.device("meta"):
        model, x = _CountsThreads(), torch.randn(4, 8)
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd", loss_fn=lambda m, b: m(b).sum(), **settings)
    assert set(seen) == {threads or was} and torch.get_num_threads() == was
    assert any("torchrun sets OMP_NUM_THREADS=1" in a for a in est.assumptions) == (threads == 1)


def test_an_omp_num_threads_the_user_set_is_the_ranks_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # torchrun keeps a value that is set
    seen = _THREADS_SEEN
    seen.clear()
    with torch.device("meta"):
        model, x = _CountsThreads(), torch.randn(4, 8)
    memcheck.estimate(model, x, device="cpu", optimizer="sgd", loss_fn=lambda m, b: m(b).sum(), strategy="ddp",
                      gpus=2)
    assert set(seen) == {torch.get_num_threads()}
