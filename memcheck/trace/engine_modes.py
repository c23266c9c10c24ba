"""The autograd engine, run under memcheck's function modes.

memcheck's ``TorchFunctionMode``\\ s stand for the target device: the tracer's kernel choice
(``_KernelChoiceMode``: ``native_dropout`` and the fused SDPA kernels that ATen picks for a CUDA
tensor, autocast's casts) and the device redirect (``.cuda()`` to meta). A real run on the
target device makes those choices in backward as well, so they must be in force there too:
in a gradient-checkpointing recomputation (the forward run again inside backward), in a custom
``autograd.Function``'s Python ``backward``, in a gradient hook.

torch does not carry them there on its own. It runs a mode's handler with that mode popped
off the stack (torch/overrides.py, ``handle_torch_function`` under ``_pop_mode_temporarily``),
and ``loss.backward()`` under a mode reaches the engine through those handlers
(``Tensor.backward``, and ``torch.autograd.backward`` / ``grad`` themselves since 2.13, call
``handle_torch_function``). So the engine starts with every mode popped; it copies the
thread-local state as ``run_backward`` begins (ATen/ThreadLocalState.h,
``python_torch_function_state_``) and sets that copy around every node it runs
(autograd/engine.cpp, ``thread_main``: ``ThreadLocalStateGuard tls_guard(graph_task->thread_locals_)``),
so nothing pushed inside one node outlives it. Measured (torch 2.13): a recomputation started
by ``loss.backward()`` under a mode runs with an empty mode stack; the same recomputation
started by ``Variable._execution_engine.run_backward`` with the mode on the stack runs under it.

A recomputation without them traced ``F.dropout`` as the meta device's ``_dropout_impl`` (a
float noise tensor saved) where the forward had traced CUDA's ``native_dropout`` (a bool mask),
and ``torch.utils.checkpoint`` (``use_reentrant=False``) refused the mismatch: every BART,
mBART, Pegasus and Marian job on the CUDA target with checkpointing ended in ``CheckpointError``
(its layer's own dropouts run in the checkpointed ``forward``, outside any submodule). With
``use_reentrant=True`` nothing checks, and the recomputation's masks were counted at 4 B an
element instead of 1 B.

:class:`EngineUnderModes` puts them back: while it is entered, ``Variable._execution_engine``
(through which every Python caller reaches the engine: torch/autograd/graph.py
``_engine_run_backward``, and ``queue_callback`` users) is a stand-in whose ``run_backward``
pushes the given modes that are not on the stack, in their order, around the real call.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

from memcheck.compat import current_function_modes as _get_current_function_mode_stack


class _Engine:
    """``Variable._execution_engine`` with ``modes()`` in force in every backward it runs."""

    def __init__(self, engine, modes: Callable[[], Sequence[TorchFunctionMode]]):
        self._engine = engine
        self._modes = modes

    def run_backward(self, *args, **kwargs):
        on = _get_current_function_mode_stack()
        with contextlib.ExitStack() as stack:
            for mode in self._modes():
                if not any(mode is m for m in on):
                    stack.enter_context(mode)
            return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name):  # queue_callback, is_checkpoint_valid, ...: the engine's own
        return getattr(self._engine, name)


class EngineUnderModes:
    """A context manager: inside it, backward runs under ``modes()`` (see the module docstring).

    ``modes`` is called as each backward starts, so it may list modes entered later than this.
    Nesting is allowed; each exit restores the engine it found.
    """

    def __init__(self, modes: Callable[[], Sequence[TorchFunctionMode]]):
        self._modes = modes
        self._saved: list = []

    def __enter__(self):
        engine = Variable._execution_engine
        self._saved.append(engine)
        Variable._execution_engine = _Engine(engine, self._modes)
        return self

    def __exit__(self, *exc):
        Variable._execution_engine = self._saved.pop()
        return False


def device_modes() -> list[TorchFunctionMode]:
    """The function modes on the stack now that stand for the target device (memcheck's own,
    marked ``stands_for_device``), bottom first: what a tracer carries into backward."""
    return [m for m in _get_current_function_mode_stack() if getattr(m, "stands_for_device", False)]
