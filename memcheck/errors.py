"""Exceptions raised by memcheck, and the exit code the CLI maps each one to.

The library never prints and never exits; it raises one of these. ``cli.py``
turns them into one line on stderr and the exit code named in ``exit_code``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path


class MemcheckError(Exception):
    """Base class of every error memcheck raises on purpose."""

    exit_code = 2


class UsageError(MemcheckError):
    """A flag, argument or config value is invalid."""


class ModelLoadError(MemcheckError):
    """The model file or ``hf:`` spec could not be turned into a model and a batch."""


class TraceError(MemcheckError):
    """The model's own code failed while it was being traced."""


class UnsupportedOpError(MemcheckError):
    """An operator has no meta kernel and no memcheck rule; register one with ``register_op_rule``."""


class TorchVersionError(MemcheckError):
    """A setting needs a newer torch than the one installed (``require_torch``)."""


def require_torch(name: str, setting: str):
    """``memcheck.compat``'s ``name``, or a TorchVersionError naming ``setting`` and the torch
    minor that first has it, when the running torch lacks it."""
    from memcheck import compat

    value = getattr(compat, name)
    if value is None:
        raise TorchVersionError(f"{setting} needs torch {compat.SINCE[name]} or newer (for torch's {name}); "
                                f"this is torch {compat.TORCH_VERSION}")
    return value


class WillNotFit(MemcheckError):
    """The job will not fit: ``memcheck.preflight`` and the trainer callbacks raise it.

    The message (``memcheck.report.text.will_not_fit_message``) is the verdict on one line
    and the fix on the next; ``.verdict`` is the
    whole ``memcheck.report.results.Verdict`` (its ``estimate``, ``fix`` and ``eval_fix``).
    """

    exit_code = 1

    def __init__(self, verdict, message: str):
        self.verdict = verdict
        super().__init__(message)


class TimeLimitExceeded(BaseException):
    """A phase (loading the model, tracing) ran past the CLI's ``--timeout``. A BaseException, so
    that no ``except Exception`` of the model's code takes it; the CLI reports it (exit 2)."""

    exit_code = 2


class ModelExit(SystemExit):
    """The model's code called ``os._exit(status)`` while the CLI ran it (the CLI makes
    ``os._exit`` raise this, so that the process does not end with a code read as a verdict)."""


def exited_message(exc: BaseException, what: str, when: str = "") -> str | None:
    """The one line for a BaseException the model's own code raised that is not an error
    (``SystemExit`` from ``sys.exit()``/``exit()``, ``GeneratorExit``, ...), naming ``what``
    (the model, where it happened); None for an ``Exception``, a ``KeyboardInterrupt`` (the
    user's Ctrl-C) or memcheck's own ``TimeLimitExceeded``, which are not the model's exits."""
    if isinstance(exc, (Exception, KeyboardInterrupt, TimeLimitExceeded)):
        return None
    if isinstance(exc, ModelExit):
        how = f"exited (os._exit({exc.code!r}))"
    elif isinstance(exc, SystemExit):
        how = f"exited (sys.exit({exc.code!r}))"
    else:
        how = f"raised {type(exc).__name__}"
    return (f"{what} {how}{when}, so memcheck could not finish judging the job; remove the exit from the model's "
            "code (memcheck runs it)")


def require_int(value, what: str, *, minimum: int = 1, message: str | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``; otherwise raise
    UsageError with ``message`` (by default "WHAT must be a positive integer, got VALUE")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(message or f"{what} must be a positive integer, got {value!r}")
    return value


def require_positive_number(value, what: str):
    """Return ``value`` if it is a finite number above 0 (an int or float, not a bool; nan and inf
    refused); otherwise raise UsageError "WHAT must be a positive number, got VALUE"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise UsageError(f"{what} must be a positive number, got {value!r}")
    return value


def closest(name: str, allowed) -> str:
    """Return a ' (did you mean X?)' suffix for a mistyped ``name``, or ''."""
    import difflib

    match = difflib.get_close_matches(str(name), [str(a) for a in allowed], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def model_frame(exc: BaseException) -> str | None:
    """'file:line' of the innermost frame of ``exc``'s traceback in the model's own code: outside
    torch, memcheck and the standard library (transformers counts as model code). None if none."""
    import sysconfig
    import traceback
    from pathlib import Path

    import torch

    skip = tuple(str(p) for p in (Path(torch.__file__).parent, Path(__file__).parent,
                                  Path(sysconfig.get_paths()["stdlib"])))
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith(skip) and not frame.filename.startswith("<"):
            found = f"{frame.filename}:{frame.lineno}"
    return found


# Packages whose code a user runs without writing it (a failure there is memcheck's to explain, not
# the model's to fix), found where they are installed; any other package under site-packages counts too.
STOCK_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "trl", "lightning",
                  "pytorch_lightning", "deepspeed", "torchvision", "timm", "safetensors", "huggingface_hub")


@functools.cache
def _stock_roots() -> tuple[tuple[str, str], ...]:
    """``(directory, package)`` for each installed stock package, then each site-packages directory
    (``package`` empty: read from the path), longest first."""
    import importlib.util
    import site
    import sysconfig

    roots = []
    for name in STOCK_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)  # a top-level name: nothing is imported
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            roots.append((str(Path(location).resolve()) + os.sep, name))
    paths = sysconfig.get_paths()
    sites = {paths.get("purelib"), paths.get("platlib"), *getattr(site, "getsitepackages", lambda: [])()}
    roots.extend((str(Path(p).resolve()) + os.sep, "") for p in sites if p)
    return tuple(sorted(roots, key=lambda r: -len(r[0])))


def stock_package(filename: str) -> tuple[str, str] | None:
    """``(package, path inside it)`` when ``filename`` is installed library code (a stock package of
    ``STOCK_PACKAGES`` or anything under site-packages), else None (the user's own code)."""
    try:
        resolved = str(Path(filename).resolve())
    except (OSError, ValueError):
        return None
    for root, name in _stock_roots():
        if resolved.startswith(root):
            rest = resolved[len(root):]
            if not name:  # site-packages/<package>/...
                name = rest.split(os.sep, 1)[0].removesuffix(".py")
                return name, rest
            return name, f"{name}{os.sep}{rest}"
    return None


def library_failure(exc: BaseException) -> tuple[str, str, str, str | None] | None:
    """Where ``exc`` came from when no code of the user's raised it: ``(package, "path:line",
    function, op)`` for the innermost frame outside memcheck and the standard library, when that
    frame is stock library code (``stock_package``); when it is torch's, for the innermost frame that
    called torch, if that is a library's (transformers calling torch), else torch's own (memcheck's
    loop calling torch). ``op`` is the aten op (or torch function) the tracer was running, if any. None when the
    user's code raised or called torch with what torch refused: then the model is to be fixed.
    """
    import sysconfig
    import traceback

    here = str(Path(__file__).resolve().parent) + os.sep
    stdlib = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    # site-packages may lie under the standard library's directory (lib/python3.X/site-packages)
    own = [f for f in frames if stock_package(f.filename) is not None or not _under(f.filename, (here, stdlib))]
    if not own:
        return None
    innermost = own[-1]
    stock = stock_package(innermost.filename)
    if stock is None:
        return None  # the user's own code raised
    if stock[0] == "torch":  # torch raised: whoever called it is to blame
        callers = [f for f in own if (stock_package(f.filename) or ("",))[0] != "torch"]
        if callers:
            caller = stock_package(callers[-1].filename)
            if caller is None:
                return None  # the user's code called torch with what torch refused
            innermost, stock = callers[-1], caller  # a library called torch: name the library's line
    return stock[0], f"{stock[1]}:{innermost.lineno}", innermost.name, _traced_op(exc)


def _under(filename: str, roots: tuple[str, ...]) -> bool:
    try:
        return str(Path(filename).resolve()).startswith(roots)
    except (OSError, ValueError):
        return False


def _traced_op(exc: BaseException) -> str | None:
    """The innermost op that memcheck's tracer (``__torch_dispatch__``) or its kernel-choice mode
    (``__torch_function__``) was running when ``exc`` was raised, as its name."""
    from memcheck import compat

    op = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_code.co_name
        func = frame.f_locals.get("func") if name in ("__torch_dispatch__", "__torch_function__") else None
        if isinstance(func, compat.OpOverload):
            op = str(func)
        elif func is not None and callable(func):
            op = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or op
            module = getattr(func, "__module__", None)
            if op and module and not op.startswith(module):
                op = f"{module}.{op}"
        tb = tb.tb_next
    return op


# Where torch keeps its Python meta kernels (relative to the torch package).
_META_KERNEL_FILES = ("_meta_registrations.py", "_refs", "_prims", "_prims_common", "_decomp")


def meta_kernel_failure(exc: BaseException) -> str | None:
    """The aten op whose Python meta kernel raised ``exc`` while the tracer ran it (as
    ``"aten._grouped_mm.default"``), or None when the error came from elsewhere (the
    model's code, a memcheck rule, a C++ kernel)."""
    from pathlib import Path

    import torch

    from memcheck.compat import OpOverload

    meta_dirs = tuple(str(Path(torch.__file__).parent / name) for name in _META_KERNEL_FILES)
    op = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__torch_dispatch__" and isinstance(frame.f_locals.get("func"), OpOverload):
            op = frame.f_locals["func"]  # the innermost op the tracer was running
        elif op is not None and frame.f_code.co_filename.startswith(meta_dirs):
            return str(op)
        tb = tb.tb_next
    return None


# The deepest nesting of modules memcheck takes: 100 levels. It copies and walks a model recursively
# (copy.deepcopy spends 4 Python frames a level, a nested forward 3, Python stops at 1000 frames), so
# a model nested ~200 deep fails somewhere with RecursionError; real models nest under 20 (a
# transformers Llama: 5 levels, a torchvision ResNet: 4).
MAX_MODULE_DEPTH = 100


def check_module_depth(model, name: str) -> None:
    """Raise ModelLoadError when ``model``'s modules nest deeper than ``MAX_MODULE_DEPTH`` (walked
    without recursion, so the check itself cannot overflow the stack)."""
    stack = [(model, 1)]
    seen = set()
    while stack:
        module, depth = stack.pop()
        if depth > MAX_MODULE_DEPTH:
            raise ModelLoadError(f"{name} nests modules more than {MAX_MODULE_DEPTH} levels deep, which memcheck "
                                 "cannot walk or copy (Python's recursion limit); flatten it, e.g. one "
                                 "nn.Sequential of the layers instead of each inside the next")
        if id(module) in seen:
            continue
        seen.add(id(module))
        children = getattr(module, "_modules", None) or {}
        stack.extend((child, depth + 1) for child in children.values() if child is not None)
