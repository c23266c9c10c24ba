"""One trace summed up: each GPU's steady-state peak, what was live at it and which modules
held it, on CUDA the caching allocator's reserved and device total (``memcheck.cuda.replay``),
the step's compute, and the ``Estimate`` that carries them (``summarise``, ``result``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable

from memcheck.cuda.allocator import AllocatorConfig
from memcheck.cuda.gpus import GpuSpec
from memcheck.cuda.overhead import context_bytes, context_source, module_loading
from memcheck.cuda.replay import allocator_life, device_events, device_totals, growing_life
from memcheck.engine.setup import TracedRun
from memcheck.enums import ALLOC, FREE, RECAT, Category, Device, Phase
from memcheck.errors import TraceError
from memcheck.job import Job, limit_bytes
from memcheck.report.results import Branches, Breakdown, DeviceMemory, Estimate, ModuleMemory, Work
from memcheck.trace.tracer import TraceLog


_STATE = (Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER, Category.COMMUNICATION)


def summarise(run: TracedRun, gpu_map: list[int], job: Job, target: GpuSpec | None, name: str,
               top_modules: int, shorter: list | None = None) -> list[DeviceMemory]:
    """Each real GPU's memory; ranks that look alike are summarised once."""
    traced_summaries: dict[int, DeviceMemory] = {}
    devices = []
    for index, traced in enumerate(gpu_map):
        if traced not in traced_summaries:
            traced_summaries[traced] = device_summary(
                run.tracer.log, traced, index, job.device, run.arch, target, root=type(run.twin).__name__,
                name=name, top_modules=top_modules, shorter=shorter, margin=job.effective_margin,
                assume=run.tracer.assume,
            )
        devices.append(dataclasses.replace(traced_summaries[traced], index=index))
    if job.device is Device.CUDA:
        loading = module_loading()
        run.tracer.assume(f"CUDA context for {loading} module loading"
                          + (" (CUDA_MODULE_LOADING=EAGER: the measured eager-minus-lazy difference of "
                             "pytorch#86509 added)" if loading == "eager" else
                             " (torch's default; CUDA_MODULE_LOADING=EAGER adds every library kernel)")
                          + f", {context_source(target)}")
    return devices


def result(run: TracedRun, gpu_map: list[int], devices: list[DeviceMemory], job: Job, target: GpuSpec | None,
            name: str, timeline: bool, branches: Branches | None = None) -> Estimate:
    """The busiest GPU's figures (and every GPU's, under a multi-GPU strategy) as an Estimate."""
    busiest = max(devices, key=lambda d: (d.total_bytes, -d.index))
    budget = job.budget_bytes
    if budget is None and target is not None and target.capacity_bytes:
        budget = target.capacity_bytes
    return Estimate(
        model=name, job=job, optimizer=run.optimizer_label, batch=run.info, devices=tuple(devices),
        busiest_gpu=busiest.index, assumptions=tuple(run.tracer.log.assumptions), budget_bytes=budget, gpu=target,
        checkpointing=run.wrapped, work=_work(run.tracer.log, step=job.steps - 1, micro_steps=min(job.accumulate, 2)),
        weights_dtype=run.weights_dtype, module_loading=module_loading() if job.device is Device.CUDA else None,
        context_source=context_source(target) if job.device is Device.CUDA else None,
        timeline=_timeline(run.tracer.log, gpu_map[busiest.index], busiest, job.device, run.arch,
                           root=type(run.twin).__name__) if timeline else None,
        branches=branches,
    )


_MICRO_PHASES = (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD)


def _work(log: TraceLog, *, step: int, micro_steps: int) -> Work:
    """The last traced step's compute on its busiest GPU (by FLOPs), per micro-step."""
    per_gpu: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (s, phase, gpu), (flops, low, kernels) in log.work.items():
        if s != step:
            continue
        if phase in _MICRO_PHASES:
            per_gpu[gpu][0] += flops
            per_gpu[gpu][1] += low
            per_gpu[gpu][2] += kernels
        elif phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD):
            per_gpu[gpu][3] += kernels
    flops, low, kernels, opt = max(per_gpu.values(), default=[0, 0, 0, 0])
    return Work(flops // micro_steps, low // micro_steps, kernels // micro_steps, opt)


def _top_modules(rows: list[ModuleMemory], top: int) -> list[ModuleMemory]:
    """The rows of the ``top`` largest groups, a group being the rows of one repeated block that
    hold exactly the same bytes (``model.layers.7.mlp`` beside ``model.layers.3.mlp``,
    ``ModuleMemory.repeat_key``) or a row alone, so the report can show each group whole
    (``memcheck.report.text`` draws a group as one row)."""
    keys: list = []
    for m in rows:
        if m.repeat_key not in keys:
            if len(keys) == top:
                break
            keys.append(m.repeat_key)
    kept = set(keys)
    return [m for m in rows if m.repeat_key in kept]


def short_name(module: str | None, root: str) -> str:
    if not module or module == "Global":
        return "(outside modules)"
    if module.startswith("("):
        return module
    if module == root:
        return "(model)"
    return module.split(".", 1)[1] if module.startswith(root + ".") else module


def _timeline(log: TraceLog, traced: int, busiest: DeviceMemory, device: Device, arch, *, root: str):
    """The busiest GPU's memory event by event (``estimate(timeline=True)``)."""
    from memcheck.report.timeline import build_timeline

    events, start = device_events(log, traced, device, arch)
    return build_timeline(events, start, device=device, gpu=busiest.index, context_bytes=busiest.context_bytes,
                          config=AllocatorConfig.from_env(), module_label=lambda m: short_name(m, root),
                          stacks=log.stacks)


def device_summary(log: TraceLog, traced: int, index: int, device: Device, arch, gpu: GpuSpec | None, *,
                    root: str, name: str, top_modules: int, shorter: list | None = None,
                    margin: float = 0.0, assume: Callable[[str], None] = lambda text: None) -> DeviceMemory:
    """The steady-state peak of one traced GPU (or the CPU), what was live at it, and on CUDA
    what the caching allocator reserves and the device shows in use.

    ``shorter``: ``(length, log)`` traces of the same job at shorter lengths, and the
    traced length first, for a run whose batch lengths vary (``padding="longest"``)."""
    events, start = device_events(log, traced, device, arch)
    eval_start = next((i for i, ev in enumerate(events) if ev.phase is Phase.EVAL), len(events))
    cuda = None
    if device is Device.CUDA:
        sim = allocator_life(events, start, eval_start, gpu)
        sizes, life, life_events = sim.granted, sim, events
        room = None if gpu is None else limit_bytes(gpu.capacity_bytes, margin) - context_bytes(gpu)
        grown = None if shorter is None else growing_life(events, start, eval_start, gpu, shorter, traced, arch,
                                                          room, margin, assume)
        if grown is not None:
            life, life_events = grown
        cuda = (life, life_events, context_bytes(gpu))
    else:
        sizes = [ev.nbytes for ev in events]

    live = 0
    best = train_best = eval_best = -1
    best_at = 0
    granted: dict = {}
    for i, ev in enumerate(events):
        kind = ev.kind
        if kind == ALLOC:
            granted[ev.sid] = sizes[i]
            live += sizes[i]
            if i >= start:
                if i < eval_start:
                    train_best = max(train_best, live)
                else:
                    eval_best = max(eval_best, live)
                if live > best:
                    best, best_at = live, i
        elif kind == FREE:
            live -= granted.pop(ev.sid, ev.nbytes)
    if best < 0:
        raise TraceError(f"tracing {name} recorded no memory after step 1")

    # Replay up to the peak to see what was live and why.
    # Categories set just after the peak's allocation (a buffer created, then registered)
    # belong to it too, so the replay runs on through those RECAT events.
    end = best_at + 1
    while end < len(events) and events[end].kind == RECAT:
        end += 1
    state: dict = {}
    for i, ev in enumerate(events[:end]):
        kind, sid, cat, module = ev.kind, ev.sid, ev.category, ev.module
        if kind == ALLOC:
            state[sid] = [sizes[i], cat, module]
        elif kind == FREE:
            state.pop(sid, None)
        elif sid in state:
            state[sid][1] = cat
            if module is not None:
                state[sid][2] = module
    by_cat: dict[Category, int] = defaultdict(int)
    by_mod: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # state, not state, saved for backward
    for n, cat, module in state.values():
        by_cat[cat] += n
        row = by_mod[short_name(module, root)]
        row[0 if cat in _STATE else 1] += n
        if cat is Category.ACTIVATION:
            row[2] += n
    modules = _top_modules(
        sorted((ModuleMemory(m, st, act, saved) for m, (st, act, saved) in by_mod.items()), key=lambda m: -m.total),
        top_modules)
    peak_event = events[best_at]
    return DeviceMemory(
        index=index, peak_bytes=best, breakdown_at_peak=Breakdown.from_categories(by_cat),
        peak_phase=peak_event.phase, peak_module=short_name(peak_event.module, root), peak_step=peak_event.step + 1,
        modules=tuple(modules), train_peak_bytes=max(train_best, 0),
        eval_peak_bytes=eval_best if eval_best >= 0 else None, **device_totals(best, cuda),
    )
