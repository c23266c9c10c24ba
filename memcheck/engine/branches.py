"""The data-dependent answers of a trace (``memcheck.choices``): each other combination of
answers traced, or, for an unpadded batch, bounded by the first trace's forward, and the trace
with the larger peak kept (``traced_branches``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

from memcheck.choices import NO_PADDING, PADDING, Choices, point_of
from memcheck.cuda.gpus import GpuSpec
from memcheck.engine.setup import TracedRun, with_step_precision
from memcheck.engine.summary import summarise
from memcheck.enums import ALLOC, FREE, RECAT, Event, Phase
from memcheck.job import Job
from memcheck.report.results import Branch, Branches
from memcheck.trace.tracer import TraceLog


def traced_branches(run: TracedRun, gpu_map: list[int], traced: Callable, job: Job, target: GpuSpec | None,
              name: str, top_modules: int) -> tuple[tuple[TracedRun, list[int], list | None], Branches | None]:
    """The trace whose data-dependent answers give the larger peak (``memcheck.choices``).

    The first trace answers every choice point with its first answer and notes the points
    whose answer decided something; the whole step is then traced again with each other
    combination of answers at those points (the job's pinned ones stay). An unpadded batch is
    first traced to the end of its first forward only, and not further when that is bounded
    by the first trace (``_bounded_by``). The trace with the largest device total (peak on
    the CPU) wins; ties keep the first. Returns the winner's run, GPU map and summaries."""
    others = run.tracer.choices.alternatives()
    if not others:
        return (run, gpu_map, None), None
    first = run.tracer.choices
    names = list(first.consulted)
    start = time.perf_counter()
    candidates, bounded = [(run, gpu_map)], []
    for answers in others:
        if _only_padding_differs(first, answers) and first.in_forwards_only(PADDING):
            prefix, done = traced(Choices(job.assume, forced=answers), forward_only=True)
            if done is None and _bounded_by(run.tracer.log, prefix.tracer.log):
                bounded.append(answers)
                continue
        candidates.append(traced(Choices(job.assume, forced=answers)))
        names += [n for n in candidates[-1][0].tracer.choices.consulted if n not in names]
    seconds = time.perf_counter() - start
    totals, summaries = [], []
    for r, g in candidates:
        devices = summarise(r, g, with_step_precision(r, job), target, name, top_modules)
        busiest = max(devices, key=lambda d: d.total_bytes)
        totals.append((busiest.total_bytes, busiest.peak_bytes))
        summaries.append(devices)
    best = max(range(len(candidates)), key=lambda i: (totals[i][0], -i))
    mine = candidates[best][0].tracer.log.assumptions
    traces = []
    for i, (r, _) in enumerate(candidates):
        own = tuple(a for a in r.tracer.log.assumptions if a not in mine) if i != best else tuple(
            a for a in mine if len(candidates) > 1
            and all(a not in c[0].tracer.log.assumptions for j, c in enumerate(candidates) if j != best))
        answers = r.tracer.choices.taken(names)
        traces.append(Branch(answers=tuple(a for a in answers if a not in job.assume), total_bytes=totals[i][0],
                             peak_bytes=totals[i][1], only_here=own))
    for answers in bounded:  # traced to the end of step 1's forward only
        traces.append(Branch(answers=tuple(a for a in answers if a not in job.assume), total_bytes=None,
                             peak_bytes=None, only_here=(), bounded=True))
    winner = traces[best]
    branches = Branches(taken=winner.answers, traces=(winner, *traces[:best], *traces[best + 1:]),
                        seconds=round(seconds, 3))
    return (*candidates[best], summaries[best]), branches


def _only_padding_differs(first: Choices, answers: tuple[str, ...]) -> bool:
    """Whether the alternative ``answers`` change only the ``padding`` point, to ``no-padding``."""
    changed = [a for a in answers if a != first.answer(point_of(a).name)]
    return changed == [NO_PADDING]


def _forward_prefix(log: TraceLog) -> list[Event]:
    """The events of step 1 before its backward begins: the setup and the first forward and loss."""
    out = []
    for ev in log.events:
        if ev.step > 0 or ev.phase in (Phase.BACKWARD, Phase.OPTIMIZER, Phase.ZERO_GRAD, Phase.EVAL):
            break
        out.append(ev)
    return out


def _bounded_by(base: TraceLog, alt: TraceLog) -> bool:
    """Whether the trace ``alt`` (stopped where step 1's backward begins) is bounded by ``base``
    over the whole step: its first forward made no assumption ``base`` did not (the same
    kernels), allocated a subsequence of ``base``'s allocations (same size, module and GPU,
    in order: the same ops, some skipped, as an unpadded batch skips its attention mask),
    and ends it with no more live bytes, per category and in all, than ``base`` held at the
    same point, never peaking above ``base``'s forward peak. The backward then runs the
    same kernels over no more saved tensors."""
    if any(a not in base.assumptions for a in alt.assumptions):
        return False
    mine, theirs = _forward_prefix(base), _forward_prefix(alt)
    if not mine or len(theirs) != len(alt.events):
        return False
    allocs = iter((ev.nbytes, ev.module, ev.gpu) for ev in mine if ev.kind == ALLOC)
    if not all(any(sig == other for other in allocs) for sig in ((ev.nbytes, ev.module, ev.gpu) for ev in theirs
                                                                 if ev.kind == ALLOC)):
        return False
    (base_live, base_peak), (alt_live, alt_peak) = _live_by_category(mine), _live_by_category(theirs)
    return alt_peak <= base_peak and all(n <= base_live.get(c, 0) for c, n in alt_live.items())


def _live_by_category(events: list[Event]) -> tuple[dict, int]:
    """The bytes live at the end of ``events`` by category, and the peak of their sum."""
    sizes, cats, live, peak = {}, {}, 0, 0
    for ev in events:
        kind, sid, n, cat = ev.kind, ev.sid, ev.nbytes, ev.category
        if kind == ALLOC:
            sizes[sid], cats[sid] = n, cat
            live += n
            peak = max(peak, live)
        elif kind == FREE and sid in sizes:
            live -= sizes.pop(sid)
            cats.pop(sid)
        elif kind == RECAT and sid in cats:
            cats[sid] = cat
    by_cat: dict = defaultdict(int)
    for sid, n in sizes.items():
        by_cat[cats[sid]] += n
    return by_cat, peak
