"""``single``: one GPU, the plain loop (``memcheck.training.loop.run_steps``).

``train_one_rank`` is also the loop of every strategy that traces one rank (``ddp``,
``fsdp``, ``zero1``-``zero3``): they pass the ``Emulation`` of what their wrapper adds.
"""

from __future__ import annotations

from typing import Callable

from memcheck.training.strategies.base import Emulation, Run


def train(run: Run) -> list[int]:
    """The model, its gradients and the optimizer on one GPU."""
    return train_one_rank(run)


def train_one_rank(run: Run, emulate: Callable[[], Emulation] | None = None) -> list[int]:
    """Trace the steps on one rank, with ``emulate()``'s emulation built once the model and batch are watched."""
    tracer, model = run.tracer, run.model
    tracer.watch(model=model, batch=run.batch)
    emulation = emulate() if emulate is not None else None
    opt = emulation.make_optimizer(run.make_optimizer) if emulation else run.make_optimizer(model.parameters())
    tracer.watch(optimizer=opt)

    def on_phase(step, phase):
        tracer.set_phase(step, phase)
        if emulation is not None:
            emulation.on_phase(step, phase)

    try:
        run.run_steps(run.loss_fn, opt, on_phase)
        if run.evaluate is not None:
            run.evaluate(model)
    finally:
        if emulation is not None:
            emulation.close()
    return [0] * run.config.gpus
