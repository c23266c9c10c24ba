"""What ``memcheck run`` is asked to run: a script, alone or under a multi-process launcher.

``memcheck run -- torchrun --nproc-per-node 8 train.py ARGS`` (also ``python -m
torch.distributed.run``) and ``memcheck run -- accelerate launch --num_processes 8 train.py ARGS``
start no process: the launcher's own argument parser reads its arguments (torch's
``torch.distributed.run.get_args_parser``, accelerate's ``launch_command_parser`` with its
config file and defaults), and the script then runs once, in memcheck's process, as rank 0 of
that many, with the environment the launcher gives each rank (torchrun's ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``;
accelerate's ``ACCELERATE_*``). ``memcheck.engine.script`` does the rest.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from memcheck.errors import UsageError

MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@dataclass(frozen=True)
class Launch:
    """A script and how it is launched: ``launcher`` is ``None`` for ``python train.py``."""

    script: Path
    args: tuple[str, ...]
    launcher: str | None = None  # "torchrun" or "accelerate launch"
    world_size: int = 1
    per_node: int = 1
    env: dict = field(default_factory=dict)  # what the launcher sets for rank 0

    def describe(self) -> str:
        """``torchrun, 8 ranks (8 a node)`` as the report says it."""
        nodes = self.world_size // self.per_node
        where = f"{self.per_node} a node on {nodes} nodes" if nodes > 1 else "one node"
        return f"{self.launcher}: {self.world_size} rank{'s' if self.world_size != 1 else ''} ({where})"


def parse(argv: list[str]) -> Launch:
    """The ``Launch`` of ``python train.py ARGS``, ``train.py ARGS``, ``torchrun ... train.py ARGS``,
    ``python -m torch.distributed.run ...`` or ``accelerate launch ... train.py ARGS``.

    Raises:
        UsageError: for no script, a missing script file, ``python -m MODULE``, a launcher's
            argument it refuses, or what memcheck does not follow (a launcher's ``-m``,
            DeepSpeed and FSDP set up by accelerate's launcher).
    """
    argv = list(argv)
    if not argv:
        raise UsageError("memcheck run needs the script to run after --: memcheck run [OPTIONS] -- python train.py ARGS")
    head = Path(argv[0]).name
    if head.startswith("python") or argv[0] == sys.executable:
        argv = argv[1:]
        if argv[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
            return _torchrun(argv[2:], "python " + " ".join(argv[:2]))
        if argv[:2] in (["-m", "accelerate.commands.launch"],):
            return _accelerate(argv[2:])
        if argv[:1] == ["-m"]:
            raise UsageError("memcheck run takes a script file (python train.py ...), not python -m MODULE")
    elif head == "torchrun":
        return _torchrun(argv[1:], "torchrun")
    elif head == "accelerate":
        if argv[1:2] != ["launch"]:
            raise UsageError(f"memcheck run follows `accelerate launch`, not `accelerate {' '.join(argv[1:2])}`")
        return _accelerate(argv[2:])
    elif head in ("deepspeed", "deepspeed.exe"):
        raise UsageError("memcheck run does not follow the deepspeed launcher; estimate the model with "
                         "--strategy zero1/zero2/zero3 --gpus N, or check the DeepSpeed config with memcheck check")
    return _script(argv, None)


def _script(argv: list[str], launcher: str | None, **fields) -> Launch:
    if not argv:
        raise UsageError("memcheck run needs the script to run after --: memcheck run [OPTIONS] -- python train.py ARGS")
    path = Path(argv[0])
    if not path.is_file():
        raise UsageError(f"no such script: {argv[0]}")
    return Launch(path.resolve(), tuple(argv[1:]), launcher, **fields)


def _count(value, flag: str, launcher: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{launcher} {flag} {value!r}: memcheck needs a number of processes (it does not count "
                         "this machine's devices, which are not the target's)") from None
    if number < 1:
        raise UsageError(f"{launcher} {flag} {value!r}: must be at least 1")
    return number


def _parsed(parser, argv: list[str], launcher: str):
    """``parser.parse_args(argv)``; its error message (argparse prints and exits) as one UsageError line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(sys.stderr):
            return parser.parse_args(argv)
    except SystemExit:
        lines = [line for line in err.getvalue().strip().splitlines() if line.strip()]
        raise UsageError(f"{launcher}: {lines[-1] if lines else 'bad arguments'}") from None


def _torchrun(argv: list[str], launcher: str) -> Launch:
    """torchrun's arguments, read by its own parser (torch/distributed/run.py, ``get_args_parser``)."""
    from torch.distributed.run import get_args_parser

    args = _parsed(get_args_parser(), argv, launcher)
    if args.module or args.no_python:
        raise UsageError(f"{launcher} {'-m' if args.module else '--no-python'}: memcheck run follows a script file "
                         "(torchrun ... train.py ARGS)")
    per_node = _count(args.nproc_per_node, "--nproc-per-node", launcher)
    nodes = _count(str(args.nnodes).split(":")[-1], "--nnodes", launcher)  # MIN:MAX: the most it runs
    world = per_node * nodes
    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(per_node), "ROLE_WORLD_SIZE": str(world), "TORCHELASTIC_RUN_ID": "memcheck",
           **MASTER}
    return _script([args.training_script, *args.training_script_args], launcher, world_size=world,
                   per_node=per_node, env=env)


def _accelerate(argv: list[str]) -> Launch:
    """accelerate's arguments, read and completed from its config file by its own code
    (accelerate/commands/launch.py: ``launch_command_parser``, ``_validate_launch_command``; the
    environment from accelerate/utils/launch.py, ``prepare_multi_gpu_env`` or
    ``prepare_simple_launcher_cmd_env``)."""
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
    except ImportError:
        raise UsageError("accelerate launch: accelerate is not installed in this environment") from None
    launcher = "accelerate launch"
    args = _parsed(launch_command_parser(), argv, launcher)
    with contextlib.redirect_stdout(sys.stderr):  # its notes on defaulted values
        try:
            args, _, _ = _validate_launch_command(args)
        except ValueError as exc:
            raise UsageError(f"{launcher}: {str(exc).strip().splitlines()[0]}") from None
    if args.use_deepspeed or args.use_fsdp or getattr(args, "use_megatron_lm", False):
        what = "DeepSpeed" if args.use_deepspeed else "FSDP" if args.use_fsdp else "Megatron-LM"
        raise UsageError(f"{launcher} with {what}: memcheck run follows DistributedDataParallel launches only; "
                         f"estimate the model with --strategy and --gpus instead")
    if args.module or args.no_python:
        raise UsageError(f"{launcher} {'-m' if args.module else '--no_python'}: memcheck run follows a script file")
    processes = _count(args.num_processes or 1, "--num_processes", launcher)
    nodes = _count(args.num_machines or 1, "--num_machines", launcher)
    saved = dict(os.environ)
    try:
        if processes > 1 or nodes > 1:
            env = prepare_multi_gpu_env(args)
        else:
            _, env = prepare_simple_launcher_cmd_env(args)
    finally:  # both start from a copy of os.environ, and may write to it
        os.environ.clear()
        os.environ.update(saved)
    env = {k: v for k, v in env.items() if os.environ.get(k) != v and k != "OMP_NUM_THREADS"}
    per_node = max(1, processes // nodes)
    if processes > 1 or nodes > 1:
        env.update({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": str(processes),
                    "LOCAL_WORLD_SIZE": str(per_node), **MASTER})
    return _script([args.training_script, *args.training_script_args], launcher, world_size=processes,
                   per_node=per_node, env=env)
