"""The command line: parse, call the library, render, map errors to exit codes.

Exit codes:
    0  the job fits (or no budget was given); check: every job in the configs fits
    1  the job does not fit the budget; check: any job does not fit
    2  bad input: a flag, the model file, the config, an op memcheck cannot trace, a model whose
       code exits, a phase past --timeout, a report or file that could not be written whole
    3  a bug in memcheck itself (please report it with --debug output)
    130  Ctrl-C
A reader that closes stdout early (``| head -1``) does not change the code: the rest of the report
is dropped quietly and the exit code stays the verdict's.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
import traceback

import click

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
_REAL_EXIT = os._exit  # memcheck's own; the model's os._exit raises (``_begin``)
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports a process stopped by it
MAX_MEASURE_STEPS = 1000  # plan --measure: real steps on this machine (20 by default)


class _DefaultGroup(click.Group):
    """A group whose first argument, when it is not a subcommand, goes to ``estimate``."""

    def main(self, args=None, prog_name=None, **extra):
        """Run the CLI; click's own usage errors become one line and exit code 2, like memcheck's."""
        extra["standalone_mode"] = False
        try:
            done = super().main(args=args, prog_name=prog_name, **extra)
            _print("", nl=False)  # --help, --version: flushed and checked as the report is
            return done
        except click.exceptions.Exit as exc:
            _print("", nl=False)
            sys.exit(exc.exit_code)
        except BrokenPipeError:  # --help into | head -1
            _drop_stdout()
            sys.exit(EXIT_FITS)
        except OSError as exc:  # --help into a full disk
            _print_failed(exc)
        except click.ClickException as exc:
            click.echo(f"memcheck: error: {_printable(exc.format_message())}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.Abort as exc:  # click's answer to Ctrl-C (or end of input) outside a command
            if isinstance(exc.__cause__, KeyboardInterrupt):
                click.echo("memcheck: interrupted", err=True)
                sys.exit(EXIT_INTERRUPTED)
            click.echo("memcheck: aborted", err=True)
            sys.exit(EXIT_BAD_INPUT)

    def invoke(self, ctx):
        """Ctrl-C stops at once: one line, exit 130 (128 + SIGINT, as a shell reports it), no
        traceback; every file memcheck writes is renamed into place whole, so none is half-written."""
        saved = os._exit  # _begin makes the model's os._exit raise; put back for an embedding process
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("memcheck: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        finally:
            os._exit = saved
            # What ``_loaded`` froze goes back to the collector, so the interpreter's last collection
            # frees it. Frozen objects are never freed: from torch 2.15 (torch.utils.flop_counter imports
            # triton) triton's nanobind extension then printed some 27 "nanobind: leaked ..." lines at exit.
            gc.unfreeze()

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["estimate", *args]
        return super().parse_args(ctx, args)


def _printable(text: str) -> str:
    """``text`` on one line: a control character a user typed (``\\r`` in a flag's value) is
    shown escaped, as Python writes it, instead of breaking the line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _fail(exc: BaseException, debug: bool, code: int, message: str | None = None) -> None:
    """One line on stderr (``message``, else the error's first line; --debug: the traceback
    first), then exit with ``code``."""
    if debug:
        traceback.print_exception(exc)
    text = str(exc).strip() if message is None else message
    first = text.splitlines()[0] if text else type(exc).__name__
    click.echo(f"memcheck: error: {first}", err=True)
    sys.exit(code)


def _print(text: str, nl: bool = True) -> None:
    """The report on stdout, flushed and checked. A reader that stopped reading (``| head -1``:
    a broken pipe) is not an error: the rest is dropped quietly and the exit code stays the
    verdict's, which the report only shows (``pipefail`` still sees a misfit). A stdout that
    takes only part of it (a full disk, ``> /dev/full``) is: one line on stderr, exit 2."""
    try:
        click.echo(text, nl=nl)
        sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
    except OSError as exc:
        _print_failed(exc)


def _print_failed(exc: OSError) -> None:
    _drop_stdout()
    click.echo(f"memcheck: error: the report could not be written to stdout: {exc.strerror or exc}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still
    buffered neither fails nor prints a traceback (the recipe of Python's signal docs, "Note on SIGPIPE")."""
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _internal(exc: BaseException) -> str:
    return f"internal error ({type(exc).__name__}: {exc}); rerun with --debug and report it"


# --timeout: a 70B-shaped estimate traces in seconds (README "Speed": LLaMA-7B's 32 layers in 1.86 s;
# 80 layers scale that to ~5 s) and a plan of GPT-2 small over two precisions takes ~30 s (~7x more
# layers: ~3.5 min); 600 s per phase leaves room above both and still ends a model that never returns.
DEFAULT_TIMEOUT = 600.0
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: beyond any trace; setitimer takes it on every platform
GRACE = 10.0  # seconds after the limit before the watchdog ends a phase stuck in C code
_LIMIT = {"seconds": 0.0, "phase": None, "watchdog": None}


def _set_timeout(seconds) -> None:
    """Check --timeout (seconds per phase; 0: no limit) and keep it for ``_phase``."""
    from memcheck.errors import UsageError

    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_TIMEOUT:
        raise UsageError(f"--timeout must be a number of seconds from 0 (no limit) to {MAX_TIMEOUT:g} (a week), "
                         f"got {seconds!r}")
    _LIMIT["seconds"] = float(seconds)


def _phase(name: str | None) -> None:
    """Start the time limit of the phase ``name`` ("loading the model", "tracing"), or stop it
    (None). In the main thread, SIGALRM raises ``TimeLimitExceeded`` there when the phase runs
    past --timeout (the model's Python code, sleeps and waits included); a phase stuck in C code
    that never returns to Python (or a model that swallows the exception) is ended by a watchdog
    thread ``GRACE`` seconds later (exit 2). Not covered: C code that never returns and holds the
    GIL all along (a pure-C loop such as ``sum(range(10**13))``); torch's kernels release it."""
    import signal
    import threading

    seconds = _LIMIT["seconds"]
    if _LIMIT["watchdog"] is not None:
        _LIMIT["watchdog"].cancel()
        _LIMIT["watchdog"] = None
    _LIMIT["phase"] = name
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return  # no SIGALRM (Windows), or not the main thread: no limit
    if name is None or not seconds:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    _LIMIT["watchdog"] = threading.Timer(seconds + GRACE, _hard_stop, (_timeout_message(name),))
    _LIMIT["watchdog"].daemon = True
    _LIMIT["watchdog"].start()


def _timeout_message(phase: str) -> str:
    return (f"{phase} took longer than --timeout {_LIMIT['seconds']:g} s, so memcheck stopped; give a longer "
            "--timeout (0: no limit) if the model really needs it")


def _on_alarm(signum, frame):
    from memcheck.errors import TimeLimitExceeded

    phase = _LIMIT["phase"]
    if phase is not None:
        raise TimeLimitExceeded(_timeout_message(phase))


def _hard_stop(message: str) -> None:
    """The watchdog: the main thread did not come back to Python to take the time limit."""
    line = f"memcheck: error: {message}\n"
    if _AT[0] is not None:  # the child of memcheck check: its parent reports it
        import json

        _write_all(_AT[0], (json.dumps({"code": EXIT_BAD_INPUT, "out": "", "err": line}) + "\n").encode())
    else:
        os.write(2, line.encode())
    _REAL_EXIT(EXIT_BAD_INPUT)


@contextlib.contextmanager
def _reported(progress, debug: bool, locate=None):
    """Every command's errors: the progress line erased, then one line on stderr and the exit
    code (a MemcheckError's own; 3 for anything else, which is a bug in memcheck).
    ``locate(message)``, when given, names where it happened (``memcheck check``: the
    config file and job)."""
    from memcheck.errors import MemcheckError, TimeLimitExceeded, exited_message
    from memcheck.job import SettingError

    try:
        try:
            yield
        finally:
            _phase(None)
        _clear(progress)
    except MemcheckError as exc:
        _clear(progress)
        # a setting is named as the user wrote it: a flag here, a key in a config (memcheck check)
        message = exc.worded("config" if locate else "flag") if isinstance(exc, SettingError) else str(exc)
        _fail(exc, debug, exc.exit_code, locate(message) if locate else message)
    except Exception as exc:  # a bug in memcheck: say so, briefly
        _clear(progress)
        _fail(exc, debug, EXIT_INTERNAL, locate(_internal(exc)) if locate else _internal(exc))
    except TimeLimitExceeded as exc:  # --timeout: the phase is named in the message
        _clear(progress)
        _fail(exc, debug, EXIT_BAD_INPUT, locate(str(exc)) if locate else str(exc))
    except BaseException as exc:  # sys.exit() or GeneratorExit from the model's code that no phase named
        message = exited_message(exc, "the model's code")
        if message is None:  # Ctrl-C: main() reports it
            raise
        _clear(progress)
        _fail(exc, debug, EXIT_BAD_INPUT, locate(message) if locate else message)


def _no_train_step(work, what: str) -> None:
    """Refuse, in one line, a model file's own train_step where it is not traced yet."""
    from memcheck.errors import UsageError

    if work.train_step is not None:
        raise UsageError(f"{work.name} defines train_step, which {what} does not trace yet (it would trace "
                         "memcheck's own loop instead); estimate it: memcheck MODEL.py [OPTIONS]")


def _load(model: str, job, optimizer: str | None, allow_download: bool, **load):
    """Run the model file (or read the hf: config) for ``job``; return the workload and the job
    completed from it: its lengths (an hf: model's position limit by default) and the file's
    ``make_optimizer`` unless --optimizer was given."""
    from memcheck.workloads.source import load_workload

    _phase("loading the model")
    work = load_workload(model, batch_size=job.batch_size or 1, max_len=job.max_len, target_len=job.target_len,
                         task=job.task, attn=job.attn, allow_download=allow_download, packing=job.packing,
                         trust_remote_code=job.trust_remote_code, **load)
    _phase("tracing")  # until the command's _reported block ends
    _loaded()
    return work, work.job_for(job, optimizer)


def _lora(lora: str | None, dora: bool):
    """--lora's settings, with --dora's use_dora=True added."""
    if not dora:
        return lora
    return "dora=true" if lora in (None, "", "default") else f"{lora},dora=true"


def _quiet_transformers() -> None:
    """transformers logs warnings about configs it builds; the CLI's output is memcheck's alone."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memcheck", prog_name="memcheck")
def main():
    """Will this PyTorch training job fit in memory? memcheck traces one real
    training step on the meta device (no GPU, no weights) at the worst-case
    padded batch and reports the peak and where it goes.

    \b
    memcheck MODEL [OPTIONS]        same as: memcheck estimate MODEL [OPTIONS]

    Exit codes: 0 fits (or no budget given), 1 does not fit, 2 bad input, 3 internal error.
    """


def _setting_option(spelling, command: str):
    """The click option of one job setting, generated from its declaration (``memcheck.job.setting``):
    its flag, its help for ``command``, its metavar, type and default; the parameter is the field."""
    option = spelling.option
    flag = f"{spelling.flag}/--no-{spelling.flag[2:]}" if option.negatable else spelling.flag
    kwargs = dict(help=option.help_for(command), default=_cli_default(spelling))
    if option.metavar is not None:
        kwargs["metavar"] = option.metavar
    if option.type is not None:
        kwargs["type"] = option.type
    if option.show_default:
        kwargs["show_default"] = True
    if isinstance(kwargs["default"], bool) and not option.negatable:
        kwargs["is_flag"] = True
    return click.option(*filter(None, (option.short, flag, spelling.field)), **kwargs)


def _cli_default(spelling):
    """A setting's default as its flag takes it: the option's own, else the field's (an enum by value)."""
    from memcheck.job import _UNSET, Job

    if spelling.option.default is not _UNSET:
        return spelling.option.default
    default = Job.__dataclass_fields__[spelling.field].default
    return default.value if hasattr(default, "value") else default


def _section(name: str):
    """The decorator that gives a command (estimate, plan: by its function's name) the options of
    the job settings of section ``name``, generated from their declarations, in the fields' order."""

    def decorate(command):
        from memcheck.job import SPELLINGS

        for spelling in reversed(SPELLINGS):
            if spelling.section == name and spelling.option is not None \
                    and command.__name__ in spelling.option.commands:
                command = _setting_option(spelling, command.__name__)(command)
        return command

    return decorate


target_options, batch_options, training_options, parallelism_options, evaluation_options, plan_options = (
    _section(name) for name in ("target", "batch", "training", "parallelism", "evaluation", "plan"))


def _settings_options(command):
    """Every section's options (memcheck.job.SECTIONS), in the sections' order."""
    for decorate in reversed((target_options, batch_options, training_options, parallelism_options,
                              evaluation_options, plan_options)):
        command = decorate(command)
    return command


# The options of estimate and plan that are not job settings: the command line's own, declared here
# once (tests/test_layers.py: every other option of the two is generated from a setting's declaration).
# The common ones each command's function takes in its mapping of options (``_front_end``).
FRONT_END_OPTIONS = {
    "dora": click.option("--dora", is_flag=True,
                         help="DoRA: LoRA with use_dora=True (with --lora's settings, if given)."),
    "as_json": click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table."),
    "allow_download": click.option("--allow-download", is_flag=True,
                                   help="Let hf: names be fetched from the hub (offline otherwise)."),
    "debug": click.option("--debug", is_flag=True, help="Show the full traceback of errors."),
    "timeout": click.option("--timeout", type=float, default=DEFAULT_TIMEOUT, show_default=True, metavar="SECONDS",
                            help="Stop with exit 2 when loading the model, or tracing, takes longer than this (each; "
                                 "0: no limit)."),
}
def _picture_options(step: str) -> dict:
    """``--snapshot`` and ``--plot``, of ``step``."""
    return {
        "snapshot_path": click.option("--snapshot", "snapshot_path", default=None, metavar="FILE.pickle",
                                      help="Write the simulated allocator trace for PyTorch's memory viewer "
                                           "(pytorch.org/memory_viz)."),
        "plot_path": click.option("--plot", "plot_path", default=None, metavar="FILE.png",
                                  help=f"Draw memory over {step}, by category (needs matplotlib)."),
    }


# Each command's own (named parameters of its function)
COMMAND_OPTIONS = {
    "estimate": {
        "compare": click.option("--compare", is_flag=True, help="One table of every strategy that applies to --gpus."),
        "top": click.option("--top", default=8, show_default=True, type=int,
                            help="Modules to list in the table (identical copies of a repeated block count as one)."),
        **_picture_options("the steady-state training step"),
    },
    "plan": {
        "precision_options": click.option(
            "--precision-options", default=None, metavar="PREC,PREC",
            help="Precisions you accept (fp32,amp-bf16,...); the fastest that fits wins. Overrides --precision."),
        "checkpointing_options": click.option(
            "--checkpointing-options", default="none,half,full", show_default=True, metavar="OPT,OPT",
            help="Gradient checkpointing to consider: none, half (every second block), full."),
        "length_profile": click.option(
            "--length-profile", is_flag=True,
            help="Also trace the recommendation at 25-75% of --max-len and search the longest length that fits "
                 "(up to 7 more traces)."),
        "measure": click.option(
            "--measure", is_flag=True,
            help="Then run the recommendation for real (20 steps at the worst-case batch) on this machine's "
                 "GPU (or the CPU for --device cpu) and report measured vs predicted."),
        "measure_steps": click.option("--measure-steps", type=int, default=20, show_default=True,
                                      help="Optimizer steps --measure runs."),
        **_picture_options("the recommendation's steady-state step"),
    },
}


def _command_options(command):
    """The front-end's options of ``command`` (by its function's name): the common ones, then its own."""
    for decorate in reversed([*FRONT_END_OPTIONS.values(), *COMMAND_OPTIONS[command.__name__].values()]):
        command = decorate(command)
    return command


class _FrontEnd:
    """The common front-end options a command took in its mapping (``FRONT_END_OPTIONS``)."""

    def __init__(self, options: dict):
        for name in FRONT_END_OPTIONS:
            setattr(self, name, options.pop(name))


def _job_settings(settings: dict, dora: bool) -> tuple[dict, str | None]:
    """The command's settings as ``Job`` keywords: --gpu-memory parsed as a size, --dora folded into
    --lora's settings, and --optimizer's default (None: a model file's make_optimizer wins, else adamw);
    with the optimizer as given."""
    from memcheck.units import parse_size

    budget, optimizer = settings.get("budget_bytes"), settings.get("optimizer")
    return {**settings, "budget_bytes": parse_size(budget, what="--gpu-memory") if budget is not None else None,
            "lora": _lora(settings.get("lora"), dora), "optimizer": optimizer or "adamw"}, optimizer


def _changed(settings: dict, section: str, *, but: tuple[str, ...] = ()) -> bool:
    """Whether any setting of ``section`` (but those named) differs from its flag's default."""
    from memcheck.job import SPELLING

    return any(settings[f] != _cli_default(SPELLING[f]) for f in settings
               if SPELLING[f].section == section and f not in but)


@main.command()
@click.argument("model", metavar="MODEL")
@_settings_options
@_command_options
def estimate(model, compare, top, snapshot_path, plot_path, **options):
    """Estimate the peak memory of training MODEL: a Python file or hf:NAME_OR_DIR.

    \b
    A model file defines build_model() (or a module-level `model`) and may define
    make_batch(batch_size, max_len), compute_loss(model, batch), make_optimizer(params).
    memcheck runs the file's code (on the meta device).
    """
    front = _FrontEnd(options)  # what is left in options: the job's settings, one a field
    progress = _begin(front.as_json, front.allow_download)
    from memcheck.engine.compare import compare as run_compare
    from memcheck.engine.estimate import estimate as run_estimate
    from memcheck.errors import UsageError
    from memcheck.job import Job, check_setting
    from memcheck.pictures import check_pictures, write_pictures
    from memcheck.report.text import render_json

    with _reported(progress, front.debug), _model_stdout():
        _set_timeout(front.timeout)
        settings, optimizer = _job_settings(options, front.dora)
        if top < 0:
            raise UsageError(f"--top must be 0 or more, got {top}")
        if compare and (snapshot_path or plot_path):
            raise UsageError("--snapshot and --plot draw one estimate; they cannot be used with --compare")
        if compare and _changed(options, "parallelism", but=("gpus", "layout", "tp_plan")):
            raise UsageError("--compare lists every strategy with its defaults; drop --strategy and its settings")
        check_pictures(snapshot_path, plot_path)  # before anything is traced
        gpus = settings["gpus"]
        if compare and gpus is not None:  # --compare's GPUs, bounded before the model loads (issue 20)
            check_setting("gpus", gpus)
        # checked before the model file runs, so a bad flag is never hidden behind the model's errors
        job = Job(**{**settings, "gpus": None if compare else gpus})
        if compare and job.layout is not None:
            raise UsageError("--compare lists the strategies of one kind over --gpus; drop --layout")
        if progress is not None:
            progress(f"loading {model}")
        work, job = _load(model, job, optimizer, front.allow_download)
        eval_batch = work.batch_at(job.eval_batch_size) if job.eval_batch_size is not None else None
        runtime = dict(loss_fn=work.loss_fn, eval_batch=eval_batch, model_name=work.name, top_modules=top,
                       progress=progress)
        if compare:
            _no_train_step(work, "--compare")
            result = run_compare(work.model, work.batch, job, gpus=1 if gpus is None else gpus, **runtime)
        else:
            result = run_estimate(work.model, work.batch, job, timeline=bool(snapshot_path or plot_path),
                                  train_step=work.train_step, **runtime)
            write_pictures(result, snapshot_path, plot_path, margin=job.effective_margin)
    _print(render_json(result) if front.as_json else str(result))
    sys.exit(EXIT_DOES_NOT_FIT if result.fits is False else EXIT_FITS)


@main.command()
@click.argument("model", metavar="MODEL")
@_settings_options
@_command_options
def plan(model, precision_options, checkpointing_options, length_profile, measure, measure_steps, snapshot_path,
         plot_path, **options):
    """Recommend the micro-batch, accumulation, checkpointing and precision that fit MODEL on --gpu.

    Every other setting (--lora, --qlora, --padding, --packing, --strategy, ...) is the job's,
    spelled as memcheck estimate takes it, and every option is traced with it.

    \b
    Every option is traced at the worst-case batch (every sequence padded to --max-len):
    at most 5 traces per (checkpointing, precision) option, and the recommendation is
    traced at exactly its own settings. Exit codes: 0 a configuration fits (and, with
    --measure, ran without running out of memory), 1 nothing fits or --measure ran out of
    memory, 2 bad input, 3 internal error.
    """
    front = _FrontEnd(options)  # what is left in options: the job's settings, one a field
    progress = _begin(front.as_json, front.allow_download)
    from memcheck.errors import UsageError, require_int
    from memcheck.job import Job, check_setting
    from memcheck.pictures import check_pictures
    from memcheck.report.text import render_json

    with _reported(progress, front.debug), _model_stdout():
        _set_timeout(front.timeout)
        settings, optimizer = _job_settings(options, front.dora)
        strategy, gpus, layout, gpus_per_node, precision = (
            settings[f] for f in ("strategy", "gpus", "layout", "gpus_per_node", "precision"))
        require_int(measure_steps, "--measure-steps", minimum=2,
                    message=f"--measure-steps must be an integer of at least 2, got {measure_steps!r}")
        if measure_steps > MAX_MEASURE_STEPS:  # real steps: a bound keeps --measure from running for days
            raise UsageError(f"--measure-steps must be at most {MAX_MEASURE_STEPS} (real training steps; the peak "
                             f"is reached in the first few), got {measure_steps}")
        if measure:  # what --measure needs is checked before any tracing
            if strategy != "single":
                raise UsageError("--measure runs one process on one device; it cannot run a multi-GPU strategy")
            if settings["device"] == "cuda":
                import torch

                if not torch.cuda.is_available():
                    raise UsageError("--measure on the cuda target needs a CUDA GPU, and torch sees none here")
        check_pictures(snapshot_path, plot_path)  # before anything is traced
        # --gpus N (N > 1) without a strategy or layout: the layouts of N GPUs are searched
        spread = gpus if (gpus is not None and gpus > 1 and strategy == "single" and layout is None
                          and not measure) else None
        fixed = check_setting("layout", layout)  # --layout: its micro-batch and checkpointing, by the layout search
        if fixed is not None:
            if measure:
                raise UsageError("--measure runs one process on one device; it cannot run a layout")
            if strategy != "single":
                raise UsageError("memcheck plan --layout runs FSDP2 over the layout's dp*cp ranks; drop --strategy")
            spread = gpus or 0
        if spread is not None:
            check_setting("gpus", gpus)
            gpus = None
        if gpus_per_node is not None and spread is None and strategy != "fsdp1":
            raise UsageError("--gpus-per-node applies to fsdp1's hybrid_shard and to the layout search of memcheck "
                             "plan --gpus N (no --strategy)")
        # checked before the model file runs, so a bad flag is never hidden behind the model's errors
        job = Job(**{**settings, "gpus": gpus, "gpus_per_node": None if spread is not None else gpus_per_node,
                     # plan checks the precision options itself
                     "precision": precision if precision and not precision_options else "fp32"})
        if spread is not None and (job.eval_batch_size is not None or job.eval_accumulate_predictions):
            raise UsageError("the layout search (memcheck plan --gpus N or --layout) traces no evaluation pass yet; "
                             "drop --eval-batch-size and --eval-accumulate-predictions, or give --strategy")
        work, job = _load(model, job.replace(batch_size=1), optimizer, front.allow_download)
        _no_train_step(work, "memcheck plan")
        if spread is not None:  # --gpus N with no strategy: search the layouts of N GPUs
            from memcheck.engine.plan_layout import plan_layout

            job = job.replace(precision=_auto_precision(job, precision, precision_options),
                              optimizer=optimizer or ("adamw-fused" if job.device.value == "cuda" else "adamw"))
            result = plan_layout(work.model, work.batch_at, job, gpus=spread or None, gpus_per_node=gpus_per_node,
                                 layout=fixed,
                                 checkpointing_options=tuple(c.strip() for c in checkpointing_options.split(",")
                                                             if c.strip() in ("none", "full")) or ("full",),
                                 loss_fn=work.loss_fn, model_name=work.name, progress=progress)
            _clear(progress)
        else:
            result = _plan_one(work, job, model, progress, front.as_json, front.allow_download, precision,
                               precision_options, optimizer, checkpointing_options, length_profile, measure,
                               measure_steps, snapshot_path, plot_path)
    _print(render_json(result) if front.as_json else str(result))
    failed = getattr(result, "verification", None) is not None and (
        result.verification.out_of_memory or result.verification.measured_bytes > result.capacity_bytes)
    sys.exit(EXIT_DOES_NOT_FIT if not result.fits or failed else EXIT_FITS)


def _plan_one(work, job, model, progress, as_json, allow_download, precision, precision_options, optimizer,
              checkpointing_options, length_profile, measure, measure_steps, snapshot_path, plot_path):
    """``memcheck plan`` for one strategy: micro-batch, accumulation, checkpointing, precision, optimizer."""
    from memcheck.engine.estimate import estimate as run_estimate
    from memcheck.engine.plan import plan as run_plan
    from memcheck.pictures import write_pictures

    result = run_plan(work.model, work.make, job, precision_options=precision_options or precision or "auto",
                      optimizer_options="auto" if optimizer is None else None,
                      checkpointing_options=checkpointing_options, max_len_limit=work.max_len_limit,
                      loss_fn=work.loss_fn, model_name=work.name, progress=progress, length_profile=length_profile)
    _clear(progress)
    if measure and result.recommended is not None:
        from dataclasses import replace

        _phase(None)  # a real run, not a trace: --measure-steps bounds it
        result = replace(result, verification=_measure_plan(model, result, work, measure_steps, allow_download))
    if (snapshot_path or plot_path) and result.job is not None:
        # A plan keeps no timeline: its recommended job is traced once more, with one, and must agree.
        _phase("tracing")
        rows = result.recommended.micro_batch_size * (result.gpus if result.strategy in ("dp", "dp-balanced")
                                                      else 1)
        eval_rows = result.job.eval_batch_size
        traced = run_estimate(work.model, work.batch_at(rows), result.job, loss_fn=work.loss_fn,
                              model_name=work.name, top_modules=0, progress=progress, timeline=True,
                              eval_batch=work.batch_at(eval_rows) if eval_rows else None)
        _clear(progress)
        if (traced.peak_bytes, traced.total_bytes) != (result.estimate.peak_bytes, result.estimate.total_bytes):
            raise RuntimeError("the recommendation traced again for --snapshot/--plot differs from the plan's")
        write_pictures(traced, snapshot_path, plot_path, margin=result.margin)
    elif snapshot_path or plot_path:
        click.echo("memcheck: note: nothing fits, so --snapshot/--plot have no recommendation to draw; "
                   "nothing written", err=True)
    return result


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--max-len", type=int, default=None,
              help="Pad each batch's token dimension to this length (the worst case); without it batches are "
                   "traced as the script's data loader makes them.")
@click.option("--device", default="cuda", show_default=True, metavar="DEVICE",
              help="Target device of the estimate: cpu or cuda (the device the script trains on stands for it).")
@click.option("--gpu", default=None, metavar="NAME|SIZE",
              help="Target GPU: a name (see `memcheck gpus`) or a capacity such as 24GiB. Exit code 1 when it "
                   "does not fit.")
@click.option("--gpu-memory", "gpu_memory", default=None, metavar="SIZE",
              help="A memory budget such as 24GiB, checked against the device total (the peak on cpu).")
@click.option("--steps", default=2, show_default=True, type=int,
              help="Optimizer steps of the script to trace before stopping it; the peak is taken from step 2 on.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--allow-download", is_flag=True, help="Let from_pretrained read configs from the hub (offline "
                                                     "otherwise; weights are never read).")
@click.option("--debug", is_flag=True, help="Show the full traceback of errors.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- python SCRIPT.py [ARGS]...")
def run(max_len, device, gpu, gpu_memory, steps, as_json, allow_download, debug, command):
    """Run your own training script, unmodified, with its model on the meta device,
    and estimate the peak of its first steps.

    \b
    memcheck run --max-len 1024 --gpu A100-80GB -- python train.py --lr 3e-4
    The script runs in this process: data loading and tokenisation for real, every
    model parameter on the meta device (from_pretrained reads config.json, never the
    weights), each batch padded to --max-len. Its own loop is traced (a plain loop,
    the HF Trainer, Lightning, accelerate) for --steps optimizer steps; then the
    script is stopped. What the script prints goes to stderr; the report to stdout.

    \b
    memcheck run --max-len 1024 -- torchrun --nproc-per-node 8 train.py
    Under torchrun or accelerate launch, no process is started: the script runs once
    as rank 0 of the launcher's world size, with a stand-in process group, and a
    DistributedDataParallel script is answered per rank.
    """
    if not allow_download:
        _offline()
    from memcheck.engine.script import run_script
    from memcheck.job import Job
    from memcheck.report.text import render_json
    from memcheck.units import parse_size

    with _reported(None, debug):
        budget = parse_size(gpu_memory, what="--gpu-memory") if gpu_memory is not None else None
        job = Job(device=device, gpu=gpu, budget_bytes=budget, max_len=max_len, steps=steps)
        with contextlib.redirect_stdout(sys.stderr):  # the script's prints; stdout is the report's
            result = run_script(list(command), job)
    _print(render_json(result) if as_json else str(result))
    sys.exit(EXIT_DOES_NOT_FIT if result.fits is False else EXIT_FITS)


def _begin(as_json: bool, allow_download: bool):
    """What every command that traces does first: the garbage collector paused until the model
    is loaded (``_loaded``), hub offline unless downloads are allowed, transformers' warnings
    quiet, and the progress callback (None unless stderr is a terminal and the output is the
    table)."""
    # Importing torch, transformers, PEFT and bitsandbytes leaves ~500,000 objects alive and
    # makes almost no garbage; with the collector on, it walks them all in some eight full
    # collections on the way (about 1 s of a QLoRA estimate's 11 s on 2 cores, for a few
    # hundred objects freed).
    gc.disable()
    sys.stdin = open(os.devnull)  # memcheck never reads stdin: a model's input() or a prompt gets EOF
    os._exit = _model_os_exit
    if not allow_download:
        _offline()
    _quiet_transformers()
    return _progress_line if not as_json and sys.stderr.isatty() else None


def _offline() -> None:
    """The Hub libraries offline, whatever HF_HUB_OFFLINE says (``hf.force_offline``)."""
    from memcheck.workloads.hf import force_offline

    force_offline()


def _model_stdout():
    """While memcheck runs the model's code (load and trace), what it prints goes to stderr:
    stdout is the report's, and a model's print() must not corrupt --json."""
    return contextlib.redirect_stdout(sys.stderr)


def _model_os_exit(status: int = 0):
    """``os._exit`` while a command that runs the model's code works: in this process it raises
    ``ModelExit`` (reported as the model's exit, exit 2) instead of ending it with a code that
    would read as a verdict; in a process the model's code forked, it is ``os._exit``."""
    from memcheck.errors import ModelExit

    if os.getpid() != _MAIN_PID[0]:
        _REAL_EXIT(status)
    raise ModelExit(status)


_MAIN_PID = [os.getpid()]


def _loaded() -> None:
    """The garbage collector back on once the model is loaded, with what exists now frozen
    (``gc.freeze``): the modules and the loaded model last as long as the process, so the full
    collections during the trace need not walk them. Garbage made from here on is collected as
    before, the trace's included; the estimate is the same with the collector paused or not."""
    gc.freeze()
    gc.enable()


def _progress_line(line: str) -> None:
    """Progress on stderr, one line rewritten in place (only when stderr is a terminal)."""
    click.echo(f"\r\033[K{line}", err=True, nl=False)


def _clear(progress) -> None:
    """Erase the progress line, if one is showing."""
    if progress is not None:
        click.echo("\r\033[K", err=True, nl=False)


def _measure_plan(spec, result, work, steps, allow_download):
    """Build the model for real on the CPU, set it up as the plan's job says, and run it
    (memcheck.measure.local.verify)."""
    from memcheck.measure.local import verify
    from memcheck.training.checkpointing import apply_checkpointing
    from memcheck.training.loop import default_loss
    from memcheck.training.optimizers import resolve_optimizer
    from memcheck.workloads.source import load_workload

    job, rec = result.job, result.recommended

    def build():  # inside the measured region, so the weights are measured too
        real = load_workload(spec, batch_size=job.batch_size, max_len=job.max_len, target_len=job.target_len,
                             task=job.task, attn=job.attn, allow_download=allow_download, device="cpu",
                             packing=job.packing, trust_remote_code=job.trust_remote_code)
        apply_checkpointing(real.model, job.checkpointing, use_reentrant=job.use_reentrant)
        return real.model, real.batch

    _, make_optimizer = resolve_optimizer(job.optimizer, job.device)
    return verify(build, make_optimizer, device=job.device.value, predicted_bytes=rec.predicted_device_total_bytes,
                  loss_fn=work.loss_fn or default_loss, precision=job.precision.value, accumulate=job.accumulate,
                  steps=steps, order=job.step_order)


@main.command("check")
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every job's result.")
@click.option("--allow-download", is_flag=True, help="Let hf: names be fetched from the hub (offline otherwise).")
@click.option("--debug", is_flag=True, help="Show the full traceback of errors.")
@click.option("--timeout", type=float, default=DEFAULT_TIMEOUT, show_default=True, metavar="SECONDS",
              help="Stop with exit 2 when loading a job's model, or tracing it, takes longer than this (each; 0: no "
                   "limit).")
@click.option("--model", default=None, metavar="MODEL",
              help="The FILEs are DeepSpeed JSON configs, and this is their model: a Python file or hf:NAME_OR_DIR.")
@click.option("--gpu", default=None, metavar="NAME|SIZE", help="With --model: the target GPU (a name or a size).")
@click.option("--gpu-memory", "gpu_memory", default=None, metavar="SIZE", help="With --model: a memory budget.")
@click.option("--max-len", type=int, default=None, help="With --model: the sequence length (padded to it).")
@click.option("--gpus", type=int, default=None,
              help="With --model: the world size (default: train_batch_size / (micro x accumulation), else 2).")
@click.option("--checkpointing", default=None, metavar="none|full|half|every:N|LIST",
              help="With --model: gradient checkpointing, as memcheck estimate's.")
def check_configs(files, as_json, allow_download, debug, timeout, model=None, gpu=None, gpu_memory=None,
                  max_len=None, gpus=None, checkpointing=None):
    """Check the jobs in config files (TOML, JSON, YAML, or pyproject.toml's [tool.memcheck]).

    \b
    A file holds one job (model, gpu or gpu_memory, micro_batch, accumulation, precision,
    checkpointing, ... at the top level) or several ([jobs.NAME] tables, inheriting the
    top-level keys). Model files are resolved relative to the config and must lie inside
    its git repository: memcheck runs their code. A pyproject.toml without [tool.memcheck]
    is skipped with a note. Every file is read and every model loaded before anything is
    traced. Exit codes: 0 every job fits, 1 a job does not fit (its fix is printed in
    config keys), 2 a config or model error, 3 internal error. The jobs are loaded and traced
    in a child process: one whose model code ends it (os._exit) is an error, never a pass.

    \b
    DeepSpeed configs: memcheck check ds_config.json --model hf:gpt2 --gpu A100-80GB --max-len 1024
    maps the ZeRO stage, offload, bf16/fp16, batch sizes, clipping, optimizer and bucket sizes
    to the job, and notes what it reads but does not model.
    """
    deepspeed = dict(gpu=gpu, gpu_memory=gpu_memory, max_len=max_len, gpus=gpus, checkpointing=checkpointing)
    _in_child(lambda: _check_jobs(files, as_json, allow_download, debug, timeout, model, deepspeed))


def _in_child(body) -> None:
    """Run ``body`` (a command's work, which ends in ``sys.exit``) in a forked child that hands
    back its output and exit code through a pipe, so that a child that vanishes without one
    (the model's code called ``os._exit``, or it was killed) is an error (exit 2), never the
    exit 0 of a verdict nobody reached. One child for all the jobs; where there is no fork
    (Windows), ``body`` runs in this process, as it does when torch is loaded here already (a
    process that embeds the CLI, such as a test's CliRunner: its warm imports would be lost in
    every child, seconds each; the model's os._exit still raises there, ``_model_os_exit``)."""
    if not hasattr(os, "fork") or (_ISOLATE[0] is None and "torch" in sys.modules) or _ISOLATE[0] is False:
        body()
        return
    import json
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        _AT[0], _MAIN_PID[0] = write, os.getpid()
        _child(body, write)
    os.close(write)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the child, which says so
    try:
        with os.fdopen(read, "rb") as pipe:
            lines = pipe.read().decode("utf-8", "replace").splitlines()
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        signal.signal(signal.SIGINT, old)
    messages = []
    for line in lines:
        with contextlib.suppress(ValueError):
            messages.append(json.loads(line))
    answer = next((m for m in messages if "code" in m), None)
    if answer is None:
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        at = next((m["at"] for m in reversed(messages) if "at" in m), None)
        click.echo(f"memcheck: error: {at + ': ' if at else ''}the process loading and tracing the jobs {how} "
                   "before it judged them (the model's code called os._exit, or the process was killed); no job "
                   "was judged", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if answer["out"]:
        _print(answer["out"], nl=False)
    if answer["err"]:
        click.echo(answer["err"], nl=False, err=True)
    sys.exit(answer["code"])


_ISOLATE = [None]  # _in_child: None: fork unless torch is loaded here; True / False: always / never


def _child(body, fd: int) -> None:
    """The forked child of ``_in_child``: run ``body`` with its stdout (and its stderr, unless
    that is a terminal showing progress) kept, and write ``{"code", "out", "err"}`` to ``fd``."""
    import io
    import json

    try:
        out, err = io.StringIO(), io.StringIO()
        live = sys.stderr.isatty()  # the progress line is drawn as it happens
        code = EXIT_INTERNAL
        with contextlib.redirect_stdout(out), \
                (contextlib.nullcontext() if live else contextlib.redirect_stderr(err)):
            try:
                body()
                code = EXIT_FITS
            except SystemExit as exc:  # the command's own exit
                code = exc.code if isinstance(exc.code, int) else EXIT_INTERNAL
            except KeyboardInterrupt:
                click.echo("memcheck: interrupted", err=True)
                code = EXIT_INTERRUPTED
            except BaseException as exc:  # noqa: BLE001 - a bug in memcheck: say so
                click.echo(f"memcheck: error: {_internal(exc)}", err=True)
        sys.stderr.flush()
        data = json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue()}) + "\n"
        _write_all(fd, data.encode("utf-8"))
    finally:
        _REAL_EXIT(0)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


_AT = [None]  # in the child of _in_child: the pipe's fd, to say which job is being loaded or traced


def _at(where: str) -> None:
    """Tell the parent of ``_in_child`` which job runs now (named if the child vanishes)."""
    if _AT[0] is not None:
        import json

        _write_all(_AT[0], (json.dumps({"at": where}) + "\n").encode("utf-8"))


def _check_jobs(files, as_json, allow_download, debug, timeout=DEFAULT_TIMEOUT, model=None, deepspeed=None) -> None:
    """``memcheck check``'s work (in the child of ``_in_child``); ends in ``sys.exit``."""
    progress = _begin(as_json, allow_download)
    from memcheck.engine.preflight import check as run_check
    from memcheck.report.text import render_config_check
    from memcheck.workloads.source import load_workload

    results, where = [], [None]  # where[0]: the job being loaded or traced, for error messages
    with _reported(progress, debug, locate=lambda message: _in_job(where[0], message)), _model_stdout():
        _set_timeout(timeout)
        jobs, skipped = _configs(files, model, deepspeed or {})
        for path in skipped:
            click.echo(f"memcheck: note: {path} has no [tool.memcheck] table; skipped", err=True)
        workloads = []
        for i, config in enumerate(jobs):  # every model is loaded (its code run) before the first trace
            where[0] = config
            _at(f"{config.label}: {config.model}, loading the model")
            _phase("loading the model")
            if progress is not None:
                progress(f"{config.label}: loading the model")
            job = config.job
            workloads.append(load_workload(config.model, batch_size=job.batch_size or 1, max_len=job.max_len,
                                           target_len=job.target_len, task=job.task, attn=job.attn,
                                           allow_download=allow_download, packing=job.packing,
                                           trust_remote_code=job.trust_remote_code))
            config.check_modules(workloads[-1].model)
            jobs[i] = config.fill_auto(workloads[-1].model)  # a DeepSpeed config's "auto" bucket sizes
            _no_train_step(workloads[-1], f"memcheck check ({config.label})")
        _loaded()
        for config, work in zip(jobs, workloads):
            where[0], label = config, config.label
            _at(f"{label}: {config.model}, tracing")
            _phase("tracing")
            results.append((config, run_check(
                work.model, work.make, config.check_job(work), model_name=work.name, loss_fn=work.loss_fn,
                progress=None if progress is None else (lambda line, label=label: progress(f"{label}: {line}")),
            )))
    if results or as_json:
        _print(render_config_check(results, skipped, as_json=as_json))
    sys.exit(EXIT_DOES_NOT_FIT if any(not v.fits for _, v in results) else EXIT_FITS)


def _configs(files, model, deepspeed: dict):
    """The jobs of ``files``: memcheck configs, or with ``model`` DeepSpeed configs (``deepspeed``: the
    job's settings from the command line, config keys)."""
    from pathlib import Path

    from memcheck.config_gate import JobConfig, load_configs
    from memcheck.errors import UsageError

    if model is None:
        given = [f"--{k.replace('_', '-')}" for k, v in deepspeed.items() if v is not None]
        if given:
            raise UsageError(f"{given[0]} applies to DeepSpeed configs, with --model; a memcheck config names its "
                             "own settings")
        return load_configs(files)
    checkpointing = deepspeed.get("checkpointing")
    if checkpointing is not None and checkpointing.strip().lower() not in ("none", "full", "half", "selective-op") \
            and not checkpointing.strip().lower().startswith("every:"):  # module names, as estimate's flag
        deepspeed = {**deepspeed, "checkpointing": [n.strip() for n in checkpointing.split(",") if n.strip()]}
    spec = model if model.startswith("hf:") else str(Path(model).expanduser().resolve())
    if not model.startswith("hf:") and not Path(spec).is_file():
        raise UsageError(f"--model {model!r}: no such model file (a Python file or hf:NAME_OR_DIR)")
    return [JobConfig.from_deepspeed(f, spec, **deepspeed) for f in dict.fromkeys(files)], []


def _in_job(job, message: str) -> str:
    """The error's line, naming the config file and job it happened in."""
    return message if job is None or message.startswith(job.label) else f"{job.label}: {message}"


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every figure and its source).")
@click.option("--wide", is_flag=True, help="Add each GPU's sources under the table (wrapped to 80 columns).")
def gpus(as_json, wide):
    """List the GPUs --gpu knows: capacity, compute capability, CUDA context, datasheet rates."""
    from memcheck.cuda.gpus import GPUS
    from memcheck.report.text import render_gpus

    _print(render_gpus(GPUS.values(), as_json=as_json, wide=wide))


if __name__ == "__main__":  # pragma: no cover
    main()


def _auto_precision(job, precision, precision_options) -> str:
    """The precision a layout search traces: the one given, else the GPU's best (as plan's auto)."""
    if precision_options:
        return precision_options.split(",")[0].strip()
    if precision and precision != "auto":
        return precision
    if job.device.value != "cuda":
        return "fp32"
    from memcheck.engine.estimate import target_gpu

    target = target_gpu(job)
    return "amp-bf16" if target is None or target.arch >= (8, 0) else "amp-fp16"
