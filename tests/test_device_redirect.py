"""The GPU stays untouched while memcheck estimates: a model's .cuda(), .to("cuda"),
device="cuda" and torch.cuda.* calls are redirected for the trace (memcheck.trace.device_redirect).

This machine's torch is a CPU build, where anything that really reaches CUDA raises
("Torch not compiled with CUDA enabled"), so a model file full of CUDA calls that estimates
cleanly here proves the calls never got there. The GPU test at the end checks
``torch.cuda.is_initialized()`` on a machine with one, and skips without.
"""

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memcheck
from memcheck.cli import main
from memcheck.trace.device_redirect import redirect_cuda
from memcheck.cuda.gpus import resolve_gpu
from memcheck.measure.local import measure_cpu

CUDA_EVERYWHERE = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 32).cuda()
            self.lin = nn.Linear(32, 32, device="cuda")
            self.register_buffer("pos", torch.arange(64, device="cuda"))

        def forward(self, ids):
            torch.cuda.synchronize()
            assert torch.cuda.get_device_capability() >= (7, 0)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                x = self.emb(ids.cuda()) + self.emb(self.pos[: ids.shape[1]].to("cuda", non_blocking=True))
            torch.cuda.current_stream().wait_stream(side)
            x = x + torch.zeros(32, device=torch.device("cuda", 0))
            torch.cuda.empty_cache()
            _ = x.detach().cpu()
            return self.lin(x.to("cuda:0"))

    def build_model():
        return Net().cuda()

    def make_batch(batch_size, max_len):
        return torch.randint(0, 100, (batch_size, max_len), device="cuda")
""")


class PlainNet(nn.Module):
    """CUDA_EVERYWHERE's Net without a single CUDA call: the same ops on the CPU."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.lin = nn.Linear(32, 32)
        self.register_buffer("pos", torch.arange(64))

    def forward(self, ids):
        x = self.emb(ids) + self.emb(self.pos[: ids.shape[1]])
        x = x + torch.zeros(32)
        _ = x.detach()
        return self.lin(x)


@pytest.fixture
def cuda_model(tmp_path):
    path = tmp_path / "cuda_model.py"
    path.write_text(CUDA_EVERYWHERE)
    return path


def test_a_model_full_of_cuda_calls_estimates_without_touching_cuda(cuda_model):
    result = CliRunner().invoke(main, [str(cuda_model), "--max-len", "16", "-b", "4", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert not torch.cuda.is_initialized()


def test_the_redirected_model_is_estimated_as_the_same_model_run_for_real_on_cpu(cuda_model):
    # The CUDA calls change where tensors live, not what is allocated: the estimate of the
    # file that calls them matches the memory a real CPU run of the plain model allocates.
    from memcheck.workloads.source import load_workload

    work = load_workload(str(cuda_model), batch_size=4, max_len=16)
    est = memcheck.estimate(work.model, work.batch, device="cpu", optimizer="adamw")

    def build():
        torch.manual_seed(0)
        return PlainNet(), torch.randint(0, 100, (4, 16))

    measured = measure_cpu(build, lambda p: torch.optim.AdamW(p)).steady_peak_bytes
    assert abs(est.peak_bytes - measured) <= 0.01 * measured, (est.peak_bytes, measured)
    assert not torch.cuda.is_initialized()


def test_building_on_meta_allocates_no_weights(cuda_model):
    from memcheck.workloads.source import load_workload

    work = load_workload(str(cuda_model), batch_size=2, max_len=8)
    tensors = list(work.model.parameters()) + list(work.model.buffers()) + [work.batch]
    assert all(t.is_meta for t in tensors)


def test_torch_cuda_is_restored_after_the_trace(cuda_model):
    originals = (torch.cuda.synchronize, torch.cuda.Stream, torch.cuda._lazy_init, torch.cuda.current_device)
    CliRunner().invoke(main, [str(cuda_model), "--max-len", "8", "--device", "cpu"])
    assert (torch.cuda.synchronize, torch.cuda.Stream, torch.cuda._lazy_init, torch.cuda.current_device) == originals


def test_device_queries_describe_the_target_gpu():
    gpu = resolve_gpu("T4")
    with redirect_cuda(gpu):
        # T4: compute capability 7.5, no bf16 tensor cores.
        assert torch.cuda.get_device_capability() == (7, 5)
        assert torch.cuda.get_device_properties(0).total_memory == gpu.capacity_bytes
        assert torch.cuda.mem_get_info() == (gpu.capacity_bytes, gpu.capacity_bytes)
        assert torch.cuda.is_bf16_supported() is False
    assert not torch.cuda.is_initialized()


def test_a_cuda_call_that_is_not_redirected_stops_with_the_file_and_line(tmp_path):
    path = tmp_path / "rng.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                state = torch.cuda.get_rng_state()
                return self.lin(x)

        def build_model():
            return Net()

        def make_batch(batch_size, max_len):
            return torch.randn(batch_size, 8)
    """))
    result = CliRunner().invoke(main, [str(path), "--max-len", "8", "--device", "cpu"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert f"{path}:11" in lines[0] and "get_rng_state" in lines[0] and "initialise CUDA" in lines[0]
    assert not torch.cuda.is_initialized()


def test_cpu_tensors_made_without_a_device_join_the_trace():
    # nanoGPT-style code that makes positions with no device: on the target they are
    # device tensors; the trace moves them to meta instead of failing on mixed devices.
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(64, 16)

        def forward(self, x):
            return x + self.pos(torch.arange(x.shape[1]))

    with torch.device("meta"):
        model, x = Positions(), torch.empty(2, 8, 16)
    est = memcheck.estimate(model, x, device="cpu", optimizer="sgd")
    assert est.peak_bytes > 0


def test_a_preflight_batch_factory_that_names_cuda_builds_meta_tensors():
    def make_batch(n):
        return torch.randn(n, 8, device="cuda")

    verdict = memcheck.check(nn.Linear(8, 8), make_batch, batch_size=4, device="cpu", budget_bytes=2**30)
    assert verdict.fits
    assert not torch.cuda.is_initialized()


def test_measure_reports_an_out_of_memory_error_and_frees_the_run_first(monkeypatch):
    # measure.verify on cuda with a run that runs out of memory: the result says so, and the
    # run's tensors are gone before empty_cache() hands the cached blocks back.
    import memcheck.cuda.gpus
    import memcheck.measure.local as measure

    class Tensors:
        pass

    held = []

    def run_out(*args, **kwargs):
        model = Tensors()
        held.append(weakref.ref(model))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    freed_before_empty_cache = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed_before_empty_cache.append(held[0]() is None))
    monkeypatch.setattr(memcheck.cuda.gpus, "device_used_bytes", lambda: 0)
    monkeypatch.setattr(measure, "measure_cuda", run_out)
    result = measure.verify(lambda: None, None, device="cuda", predicted_bytes=1)
    assert result.out_of_memory and "CUDA out of memory" in result.error
    assert freed_before_empty_cache == [True]
    gc.collect()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_machine_estimating_never_initialises_cuda(cuda_model):
    code = textwrap.dedent(f"""
        import torch, memcheck
        from memcheck.workloads.source import load_workload
        work = load_workload({str(cuda_model)!r}, batch_size=4, max_len=16)
        est = memcheck.estimate(work.model, work.batch, device="cuda")
        memcheck.plan(work.model, work.make, max_len=16, device="cuda")
        assert not torch.cuda.is_initialized(), "CUDA was initialised"
        print("untouched", est.peak_bytes)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "untouched" in out.stdout
