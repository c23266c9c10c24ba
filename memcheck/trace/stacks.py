"""The Python stack at an allocation, as ``torch.cuda.memory._record_memory_history(stacks="python")``
records it, for ``--snapshot``'s frames.

torch gathers the running thread's Python frames at each ``malloc``
(``CapturedTraceback::gather``, torch/csrc/profiler/combined_traceback.cpp) and the snapshot
lists them innermost first, each as ``(filename, line, name)``: the file's full path, the
line being run and the code object's ``co_name`` (torch/csrc/profiler/python/combined_traceback.cpp).
``StackRecorder.record`` walks ``sys._getframe`` the same way and keeps the same three values, with
what a real run would not have taken out:

- memcheck's own frames (the tracer, the rules, the training loop and strategies): in a
  real run the allocator is C++ and the loop is the user's;
- everything outward of the call that started the trace (``memcheck.estimate``, the CLI,
  click): the stack ends where memcheck handed control to the traced code;
- ``runpy``'s launcher frames;
- what memcheck's dispatch and function modes add to torch's frames: the innermost run of
  dispatch glue (``torch._disable_dynamo``'s wrapper of ``__torch_dispatch__``, ``torch/_ops.py``
  calls made by a rule) and ``torch.overrides.handle_torch_function``, with the frame it
  re-enters from (``F.embedding`` handing itself to the mode, which calls it again), so a
  function reads once, at the line a real run is at;
- the caller's side of the autograd engine (``loss.backward()`` and what called it): torch
  runs a GPU backward on its own device thread, which has no Python frames of the caller,
  so only what the engine itself calls into Python (hooks, a custom Function's backward,
  checkpointing's recomputation) is kept.

Frames of torch, transformers, the Python standard library and the user's own files stay, as
torch keeps them. Each frame tuple and each whole stack is interned, so a trace holds each
distinct stack once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.overrides

KEEP, SKIP, STOP, GLUE, REENTRY = 0, 1, 2, 3, 4

_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep  # memcheck/
# where memcheck's driver starts the trace: everything outward of it is memcheck's own caller
_DRIVER = _PACKAGE + "engine" + os.sep
_TORCH = os.path.dirname(torch.__file__)
# torch's frames between an op's Python caller and a dispatch mode's handler
_GLUE = frozenset(os.path.join(_TORCH, *p) for p in (
    ("_compile.py",), ("_dynamo", "eval_frame.py"), ("_ops.py",), ("utils", "_python_dispatch.py")))


def _engine_code():
    """The code object of the function that enters the autograd engine
    (torch/autograd/graph.py ``_engine_run_backward``), or None in a torch without it."""
    from memcheck.compat import engine_run_backward

    return getattr(engine_run_backward, "__code__", None)  # None: a torch without it, the caller's frames stay


def _kind(code, engine) -> int:
    filename = code.co_filename
    if code is engine or filename.startswith(_DRIVER):
        return STOP
    if code is torch.overrides.handle_torch_function.__code__:
        return REENTRY
    if filename in _GLUE:
        return GLUE
    if filename.startswith(_PACKAGE) or os.path.basename(filename) == "runpy.py":
        return SKIP
    return KEEP


class StackRecorder:
    """Records the Python stack at each call, interned; ``record()`` is its one method."""

    def __init__(self):
        # keyed by id(code): hashing a code object hashes its constants, every time. The code
        # objects are kept (``_codes``), so no id is reused while the recorder lives.
        self._kinds: dict[int, int] = {}  # id(code) -> its kind: KEEP, SKIP, STOP, GLUE or REENTRY
        self._codes: list = []
        self._frames: dict = {}  # (id(code), line) -> (filename, line, name)
        self._stacks: dict = {}  # stack -> the same stack, interned
        self._engine = _engine_code()

    def record(self, skip: int = 1) -> tuple[tuple[str, int, str], ...]:
        """The caller's stack, innermost first, as ``(filename, line, name)`` tuples, without the
        frames the module docstring lists; ``skip`` frames of the caller are left out first."""
        kinds, frames, engine = self._kinds, self._frames, self._engine
        out = []
        inner = None  # the code of the last frame kept
        f = sys._getframe(skip + 1)
        while f is not None:
            code = f.f_code
            kind = kinds.get(id(code))
            if kind is None:
                kind = kinds[id(code)] = _kind(code, engine)
                self._codes.append(code)
            if kind == STOP:
                break
            if kind == REENTRY:
                f = f.f_back
                if f is not None and f.f_code is inner:  # the function the mode called again
                    f = f.f_back
                continue
            if kind == KEEP or (kind == GLUE and out):
                inner = code
                line = f.f_lineno
                frame = frames.get((id(code), line))
                if frame is None:
                    frame = frames[(id(code), line)] = (code.co_filename, line, code.co_name)
                out.append(frame)
            f = f.f_back
        stack = tuple(out)
        return self._stacks.setdefault(stack, stack)
