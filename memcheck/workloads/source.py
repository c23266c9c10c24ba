"""Turn what the user names (a Python model file, or ``hf:NAME_OR_DIR``) into a workload.

A model file defines ``build_model()`` (or a module-level ``model``) and may define
``make_batch(batch_size, max_len)``, ``compute_loss(model, batch)`` and
``make_optimizer(params)`` and ``train_step(model, batch, optimizer)`` (one training step of
its own, traced instead of memcheck's loop). memcheck runs the file's code: everything it builds is
built under ``torch.device("meta")`` for an estimate, so no weights are allocated.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from memcheck.enums import Attention, Task
from memcheck.errors import (MemcheckError, ModelLoadError, TimeLimitExceeded, UsageError, check_module_depth,
                             exited_message, require_int)
from memcheck.job import Job, SettingError, check_setting, escape
from memcheck.trace.device_redirect import on_meta, on_meta_keeping_host, reads_meta_data
from memcheck.workloads import hf


@dataclass
class Workload:
    """A model, its worst-case batch, and how to train it."""

    name: str
    model: torch.nn.Module
    batch: Any
    loss_fn: Callable | None
    make_optimizer: Callable | None
    batch_size: int
    max_len: int | None
    target_len: int | None
    # make(batch_size, max_len, target_len): the worst-case batch at other sizes or lengths
    make: Callable[[int, int | None, int | None], Any] | None = None
    max_len_limit: int | None = None  # the position limit, when the model has one
    default_optimizer: str = "adamw"  # when neither the user nor the file names one: torch's, or the Trainer's
    train_step: Callable | None = None  # the file's own train_step(model, batch, optimizer), traced instead of the loop
    default_max_grad_norm: float | None = None  # the clipping when the job names none: the HF Trainer's for hf:

    def job_for(self, job: Job, optimizer: str | None = None) -> Job:
        """``job`` completed from this workload: its batch size and lengths as loaded (an hf:
        model's position limit by default) and the model file's ``make_optimizer`` unless
        ``optimizer`` names one (else the workload's default: for ``hf:`` models the installed
        HF Trainer's default ``optim``, torch's AdamW otherwise)."""
        return job.replace(batch_size=self.batch_size, max_len=self.max_len, target_len=self.target_len,
                           optimizer=optimizer or self.make_optimizer or self.default_optimizer,
                           max_grad_norm=self.default_max_grad_norm if job.max_grad_norm is None else job.max_grad_norm)

    def batch_at(self, batch_size: int, max_len: int | None = None, target_len: int | None = None) -> Any:
        """The worst-case batch with ``batch_size`` rows, padded to ``max_len`` (default: the
        workload's own lengths); for an eval pass, the planner's search and its length profile."""
        require_int(batch_size, "batch size")
        max_len = self.max_len if max_len is None else max_len
        target_len = self.target_len if target_len is None else target_len
        if (batch_size, max_len, target_len) == (self.batch_size, self.max_len, self.target_len):
            return self.batch
        if self.make is None:
            raise UsageError(f"{self.name} cannot build a batch of another size or length")
        return self.make(batch_size, max_len, target_len)


def _where(exc: BaseException, path: Path) -> str:
    """'file:line' of the innermost frame inside the model file, else the file."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{path}:{exc.lineno}"
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    return f"{path}:{line}" if line else str(path)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _import_file(path: Path):
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such model file")
    name = f"memcheck_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # No __pycache__/*.pyc beside the model file (nor beside what it imports): memcheck writes
    # nothing into the user's tree, and a pre-commit run must leave the repository clean.
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except MemcheckError:
        raise
    except BaseException as exc:  # SyntaxError, ImportError, anything the file raises
        sys.modules.pop(name, None)
        if isinstance(exc, (KeyboardInterrupt, TimeLimitExceeded)):
            raise
        raise ModelLoadError(
            f"{_where(exc, path)}: loading the model file failed: {_one_line(exc)}; fix the file and retry"
        ) from exc
    finally:
        sys.dont_write_bytecode = dont_write
    return module


def _call(path: Path, fn, what: str, *args):
    try:
        return fn(*args)
    except MemcheckError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{_where(exc, path)}: {what} raised {_one_line(exc)}") from exc
    except BaseException as exc:  # sys.exit(), GeneratorExit, ... from the model's code
        exited = exited_message(exc, f"{_where(exc, path)}: {what}")
        if exited is None:  # Ctrl-C, the time limit
            raise
        raise ModelLoadError(exited) from exc


def _building(device: str, keep_host: bool = False):
    """Where the model's code runs while memcheck builds a model or batch on ``device``: for
    meta, every ``.cuda()``/``.to(...)``/``device=`` lands on meta, and the GPU is never touched;
    with ``keep_host``, the CPU tensors the code makes stay real and only what modules register
    goes to meta (``on_meta_keeping_host``)."""
    if device != "meta":
        return torch.device(device)
    return on_meta_keeping_host() if keep_host else on_meta()


def _built(device: str, build):
    """``build(keep_host)`` under ``_building``; once more keeping host tensors real when the model's
    code read a meta tensor's values while it was built (a drop-path schedule from
    ``torch.linspace(...).tolist()``: ConvNext, Swinv2, PvtV2 ...). Returns (result, keep_host)."""
    try:
        with _building(device):
            return build(False), False
    except Exception as exc:
        if device != "meta" or not reads_meta_data(exc):
            raise
    with _building(device, keep_host=True):
        return build(True), True


def _check_sizes(batch_size, max_len, target_len):
    for field, value in (("batch_size", batch_size), ("max_len", max_len), ("target_len", target_len)):
        check_setting(field, value)


def _check_target(name: str, task: Task, target_len: int | None) -> None:
    """Only a seq2seq or CTC model's labels have a length of their own; elsewhere a target length
    would be reported but never traced."""
    if target_len is not None and task not in (Task.SEQ2SEQ, Task.CTC):
        raise SettingError("target_len", "{name} applies to seq2seq and ctc models only; "
                           + escape(f"{name} is {task.value}") + ": drop {name}")


def load_workload(
    spec: str,
    *,
    batch_size: int = 1,
    max_len: int | None = None,
    target_len: int | None = None,
    task: Task | str | None = None,
    attn: Attention | str | None = None,
    allow_download: bool = False,
    device: str = "meta",
    packing: bool = False,
    trust_remote_code: bool = False,
) -> Workload:
    """Load ``spec`` and build its model and worst-case batch on ``device`` (meta for estimates);
    ``packing``: the packed, padding-free batch of a transformers causal LM (``hf.packed_batch``);
    ``trust_remote_code``: let transformers run the custom code an ``hf:`` config names."""
    _check_sizes(batch_size, max_len, target_len)
    task = Task.parse(task, what="task") if task is not None else None
    attn = Attention.parse(attn, what="attn") if attn is not None else None
    if spec.startswith("hf:"):
        name = spec[3:]
        if not name:
            raise UsageError("hf: needs a model name or a directory holding config.json, as in hf:gpt2")
        config = hf.load_config(name, allow_download=allow_download, trust_remote_code=trust_remote_code)
        model, _ = _built(device, lambda keep_host: hf.build_model(config, task, attn,
                                                                   device="cpu" if keep_host else device,
                                                                   trust_remote_code=trust_remote_code))
        task = task or hf.infer_task(config, model)
        if max_len is None and hf.takes_length(model, config, task):
            max_len = hf.default_max_len(model, config, task)
        hf.check_lengths(model, config, max_len, target_len, task)
        _check_target(type(model).__name__, task, target_len)

        def make(size, length, target):
            with _building(device):
                return hf.make_batch(model, config, task, size, length, target, device=device, packing=packing)

        return Workload(type(model).__name__, model, make(batch_size, max_len, target_len), None, None,
                        batch_size, max_len, target_len, make, _limit(model, config, task), hf.trainer_optimizer(),
                        default_max_grad_norm=hf.trainer_max_grad_norm())

    path = Path(spec)
    if path.suffix != ".py":
        raise UsageError(
            f"model {spec!r} is neither a Python file (*.py) nor hf:NAME_OR_DIR"
        )
    def build(keep_host):
        module = _import_file(path)
        if hasattr(module, "build_model"):
            return module, _call(path, module.build_model, "build_model()")
        if isinstance(getattr(module, "model", None), torch.nn.Module):
            return module, module.model
        raise ModelLoadError(
            f"{path}: defines neither build_model() nor a module-level `model`; add one returning an nn.Module")

    (module, model), keep_host = _built(device, build)
    with _building(device, keep_host):
        if not isinstance(model, torch.nn.Module):
            raise ModelLoadError(f"{path}: build_model() returned {type(model).__name__}, not a torch.nn.Module")
        check_module_depth(model, str(path))
        if attn is not None and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(attn.value)
        config = getattr(model, "config", None)
        if hasattr(module, "make_batch"):
            params = inspect.signature(module.make_batch).parameters
            if max_len is None and len(params) >= 2 and "max_len" in params and params["max_len"].default is inspect.Parameter.empty:
                raise SettingError("max_len", escape(f"{path}: make_batch needs a length") + ": give {name}")
            if config is not None:
                hf.check_lengths(model, config, max_len, target_len)
            if target_len is not None:  # make_batch takes no target length: it would be reported, never traced
                raise SettingError("target_len", "{name} applies to transformers seq2seq models; " + escape(
                    f"{path}'s make_batch(batch_size, max_len) builds its own labels") + ": drop {name}")

            def make(size, length, target):
                with _building(device):
                    return _call(path, module.make_batch, "make_batch()", size, length)
        elif config is not None and hasattr(model, "main_input_name"):
            task = task or hf.infer_task(config, model)
            if max_len is None and hf.takes_length(model, config, task):
                max_len = hf.default_max_len(model, config, task)
            hf.check_lengths(model, config, max_len, target_len, task)
            _check_target(type(model).__name__, task, target_len)

            def make(size, length, target):
                with _building(device):
                    return hf.make_batch(model, config, task, size, length, target, device=device,
                                         packing=packing)
        else:
            raise ModelLoadError(
                f"{path}: defines no make_batch(batch_size, max_len), and memcheck cannot infer "
                f"inputs for {type(model).__name__}; add make_batch"
            )
        batch = make(batch_size, max_len, target_len)
    loss_fn = getattr(module, "compute_loss", None)
    make_optimizer = getattr(module, "make_optimizer", None)
    train_step = getattr(module, "train_step", None)
    if train_step is not None and not callable(train_step):
        raise ModelLoadError(f"{path}: train_step must be a function train_step(model, batch, optimizer)")
    return Workload(
        path.stem, model, batch, loss_fn, make_optimizer, batch_size, max_len, target_len, make,
        _limit(model, config, task) if config is not None else None, train_step=train_step,
    )


def _limit(model, config, task=None) -> int | None:
    """The longest max_len the model takes: its position limit for text; none for images, Whisper's
    fixed windows or raw audio."""
    if hf.known_kind(model, config, task) not in (hf.TEXT, hf.IMAGE_TEXT):
        return None
    return hf.position_limit(config)[0]
