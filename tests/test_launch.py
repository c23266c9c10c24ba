"""``memcheck run`` under a multi-process launcher (memcheck.engine.launch, memcheck.engine.script):
``torchrun`` / ``python -m torch.distributed.run`` / ``accelerate launch`` read by their own argument
parsers, the script run once as rank 0 with a stand-in process group, DistributedDataParallel
followed with memcheck's emulation of its buckets.

The oracle is the same script run for real under ``torchrun --standalone`` on 2 gloo ranks, each
rank measured by the allocator (``memcheck.measure.distributed.measure_launched``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from memcheck import Job, run_script
from memcheck.cli import main
from memcheck.engine import launch
from memcheck.errors import UsageError

SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "scripts"
DDP = str(SCRIPTS / "train_ddp.py")
LEN = ["--max-len", "128", "--min-len", "128", "--batch-size", "4"]


@pytest.mark.slow
def test_a_ddp_script_under_torchrun_matches_its_real_ranks():
    from memcheck.measure.distributed import measure_launched

    ranks = measure_launched([DDP, *LEN, "--max-steps", "2"], 2)
    est = run_script(["torchrun", "--nproc-per-node", "2", DDP, *LEN, "--max-steps", "5"],
                     Job(device="cpu", max_len=128))
    measured = max(r.steady_peak_bytes for r in ranks)
    assert abs(est.peak_bytes - measured) <= 0.02 * measured, (est.peak_bytes, measured)


def test_the_ddp_buckets_hold_every_trainable_parameter_once():
    est = run_script(["torchrun", "--nproc-per-node=8", DDP, *LEN, "--max-steps", "5"], device="cpu", max_len=128)
    # TinyDecoder(vocab 8000, width 256, 4 layers, max_len 128), head tied to the embedding:
    #   embed 8000*256 = 2,048,000; pos 128*256 = 32,768; final norm 2*256 = 512
    #   a layer: in_proj 3*256*256 + 3*256 = 197,376; out_proj 256*256 + 256 = 65,792;
    #            linear1 256*1024 + 1024 = 263,168; linear2 1024*256 + 256 = 262,400; 2 norms 1,024
    #            = 789,760; 4 layers 3,159,040
    #   = 5,240,320 fp32 parameters = 20,961,280 B of buckets (gradient_as_bucket_view off: a copy)
    assert est.breakdown_at_peak.communication == 20_961_280
    assert est.job.strategy.value == "ddp" and est.job.gpus == 8
    notes = " ".join(est.assumptions)
    assert "launched by torchrun: 8 ranks (one node)" in notes
    assert "DistributedDataParallel as the script built it (bucket_cap_mb 25" in notes


def test_torchrun_arguments_are_read_by_torchs_own_parser():
    run = launch.parse(["torchrun", "--nnodes", "2", "--nproc_per_node", "4", "--rdzv-backend", "c10d",
                        DDP, "--max-steps", "3"])
    assert (run.launcher, run.world_size, run.per_node) == ("torchrun", 8, 4)
    assert run.script == Path(DDP).resolve() and run.args == ("--max-steps", "3")
    assert run.env["WORLD_SIZE"] == "8" and run.env["LOCAL_WORLD_SIZE"] == "4" and run.env["RANK"] == "0"
    module = launch.parse(["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", DDP])
    assert (module.launcher, module.world_size) == ("python -m torch.distributed.run", 2)
    assert launch.parse(["python", DDP]).launcher is None


def test_accelerate_launch_arguments_are_read_by_accelerates_own_parser():
    pytest.importorskip("accelerate")
    run = launch.parse(["accelerate", "launch", "--multi_gpu", "--num_processes", "4", "--num_machines", "1",
                        "--mixed_precision", "bf16", "--dynamo_backend", "no", DDP, "--max-steps", "3"])
    assert (run.launcher, run.world_size, run.per_node) == ("accelerate launch", 4, 4)
    assert run.env["ACCELERATE_MIXED_PRECISION"] == "bf16" and run.env["WORLD_SIZE"] == "4"
    assert run.args == ("--max-steps", "3")


@pytest.mark.parametrize("args, message", [
    (["torchrun", "--nproc-per-node", "gpu", DDP], "needs a number of processes"),
    (["torchrun", "--nproc-per-node", "2", "-m", "train"], "follows a script file"),
    (["torchrun", "--nproc-per-node", "2", "no_such_script.py"], "no such script: no_such_script.py"),
    (["deepspeed", "--num_gpus", "8", DDP], "does not follow the deepspeed launcher"),
    (["accelerate", "config"], "follows `accelerate launch`"),
])
def test_launcher_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["run", "--device", "cpu", "--", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr.splitlines()[-1]


def test_fsdp_in_a_launched_script_is_refused_in_one_line(tmp_path):
    script = tmp_path / "fsdp.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "from torch.distributed.fsdp import fully_shard\n"
                      "dist.init_process_group('nccl')\n"
                      "fully_shard(torch.nn.Linear(4, 4))\n")
    with pytest.raises(UsageError, match=r"builds FSDP2 \(fully_shard\).*--strategy fsdp --gpus N"):
        run_script(["torchrun", "--nproc-per-node", "2", str(script)], device="cpu")


def test_a_launched_run_leaves_the_environment_and_torch_distributed_as_it_found_them():
    before = dict(os.environ)
    ddp_class = torch.nn.parallel.DistributedDataParallel
    run_script(["torchrun", "--nproc-per-node", "2", DDP, *LEN, "--max-steps", "5"], device="cpu", max_len=128)
    assert dict(os.environ) == before
    assert not dist.is_initialized()
    assert torch.nn.parallel.DistributedDataParallel is ddp_class and dist.init_process_group.__module__ \
        == "torch.distributed.distributed_c10d"
