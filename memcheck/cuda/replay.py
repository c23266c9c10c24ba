"""The caching allocator over a job's process life: one traced GPU's events, with the workspaces
a real step adds, replayed through ``memcheck.cuda.allocator`` from the set-up to a steady step
and on to the evaluation, bounded by the GPU where a real run would give cached segments back,
and, for batches that grow (``padding="longest"``), a run of growing lengths; and the reserved
and device-total figures that replay gives a ``DeviceMemory``.

``memcheck.engine.estimate`` calls these for each traced GPU; the events are
``memcheck.enums.Event``s of a ``memcheck.trace.tracer.TraceLog``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Callable

from memcheck.cuda.allocator import AllocatorConfig, growing_run, simulate
from memcheck.cuda.gpus import GpuSpec
from memcheck.cuda.overhead import context_bytes, workspace_allocations
from memcheck.enums import ALLOC, AUTOGRAD_THREAD, MAIN_THREAD, Category, Device, Event, Phase
from memcheck.units import format_bytes

if TYPE_CHECKING:
    from memcheck.trace.tracer import TraceLog


def with_workspaces(events: list[Event], arch, start: int, firsts: list[tuple[int, str]]) -> tuple[list[Event], int]:
    """One GPU's events with cuBLAS's workspaces allocated where a real step first needs
    them, and where event ``start`` (the steady state's first) now is.

    torch keeps one workspace per (cuBLAS handle, stream) in the caching allocator, bound
    when a thread first takes its handle: inside its first cuBLAS op, after the op's output
    (CublasHandlePool.cpp ``getCurrentCUDABlasHandle`` -> ``setWorkspaceForHandle``). The
    forward runs on the main thread and backward on autograd's device thread, each with its
    own handle (memcheck.cuda.overhead). ``firsts``: ``(position in events, thread)`` of each
    thread's first cuBLAS op (``TraceLog.blas_first``); a thread that calls none gets none.
    Both live to the end.

    Where each goes matters to ``reserved``: GPT-2 in pure bf16 on an H200 (2026-11-26 run)
    frees its 823 MB bf16 logits before backward; the autograd thread's 32 MiB workspace,
    placed at backward's first event, took that freed segment, so the bf16 grad of the
    logits went to a logits-sized fp32 segment and the next step fitted in the segments it
    had: reserved 11.08 GB against 12.72 GB measured. At the lm_head backward's mm, where
    torch takes it, the grad fills the bf16 segment first and one more 1.65 GB segment is
    needed later: 12.73 GB.
    """
    by_thread: dict[str, list[tuple[str, int]]] = {MAIN_THREAD: [], AUTOGRAD_THREAD: []}
    for label, nbytes in workspace_allocations(arch):
        by_thread[AUTOGRAD_THREAD if AUTOGRAD_THREAD in label else MAIN_THREAD].append((label, nbytes))
    at: dict[int, list[str]] = defaultdict(list)
    for position, thread in firsts:
        at[position].append(thread)
    out, new_start = [], None
    for i in range(len(events) + 1):
        if events:
            ev = events[max(i - 1, 0)]  # the op's output: its phase, step and GPU
            for thread in at.get(i, ()):
                for label, nbytes in by_thread.pop(thread, ()):
                    out.append(Event(ALLOC, f"workspace:{label}:{ev.gpu}", nbytes, Category.WORKSPACE, f"({label})",
                                     ev.phase, ev.step, ev.gpu))
        if i == len(events):
            break
        if i == start:
            new_start = len(out)
        out.append(events[i])
    return out, len(out) if new_start is None else new_start


def device_events(log: TraceLog, traced: int, device: Device, arch) -> tuple[list[Event], int]:
    """One traced GPU's events of ``log`` (with cuBLAS's workspaces on CUDA), and the index of
    step 2's first."""
    second = log.step_starts[1] if len(log.step_starts) > 1 else 0
    marks: dict[int, list[str]] = defaultdict(list)  # log index -> threads whose first cuBLAS op ends there
    for (thread, gpu), index in log.blas_first.items():
        if gpu == traced:
            marks[index].append(thread)
    events, start, firsts = [], None, []
    for i, ev in enumerate(log.events):
        for thread in marks.pop(i, ()):
            firsts.append((len(events), thread))
        if ev.gpu != traced:
            continue
        if start is None and i >= second:
            start = len(events)
        events.append(ev)
    firsts += [(len(events), thread) for threads in marks.values() for thread in threads]
    start = len(events) if start is None else start
    if device is Device.CUDA:
        events, start = with_workspaces(events, arch, start, firsts)
    return events, start


def allocator_life(events: list[Event], start: int, eval_start: int, gpu: GpuSpec | None):
    """The caching allocator over the process's life: the setup (weights, batch), the traced
    steps, the last step replayed until the allocator's layout repeats, then the evaluation,
    on the GPU beside its context (``replayed``)."""
    room = None if gpu is None else gpu.capacity_bytes - context_bytes(gpu)
    return replayed(events, (start, eval_start), room)[0]


def replayed(events: list[Event], repeat: tuple[int, int], room: int | None):
    """``simulate`` with ``repeat``, first with unbounded memory, as the allocator behaves while
    nothing fails; then, when that reserves more than ``room``, again at ``room``: a real
    run's ``cudaMalloc`` fails there and the allocator gives cached segments back and retries
    (``CUDACachingAllocator.cpp``, ``release_cached_blocks``). Returns the run's figures (the
    bounded replay's when it completes) and the unbounded reserved peak."""
    config = AllocatorConfig.from_env()
    sim = simulate(events, config=config, repeat=repeat)
    if room is None or sim.peak_reserved_bytes <= room or sim.peak_allocated_bytes > room:
        return sim, sim.peak_reserved_bytes  # it fits without giving anything back, or nothing can make it fit
    bounded = simulate(events, config=config, capacity=room, repeat=repeat)
    return (sim if bounded.first_oom is not None else bounded), sim.peak_reserved_bytes


GROWING_STEPS = 16  # a padding="longest" run: steps from max_len / 16 up to max_len


def growing_lengths(max_len: int, steps: int = GROWING_STEPS) -> list[int]:
    """The batch lengths of a run whose batches grow to ``max_len`` in ``steps`` even steps."""
    return sorted({max(1, max_len * i // steps) for i in range(1, steps + 1)})


def lagrange(points: list[tuple[int, int]], x: int) -> int:
    """The quadratic (or lower) through ``points`` at ``x``, rounded up to whole bytes."""
    from fractions import Fraction

    total = Fraction(0)
    for j, (xj, yj) in enumerate(points):
        term = Fraction(yj)
        for k, (xk, _) in enumerate(points):
            if k != j:
                term *= Fraction(x - xk, xj - xk)
        total += term
    return max(0, -(-total.numerator // total.denominator))


def _signature(ev: Event) -> tuple:
    """What must agree for two traces' events to be the same op's: kind, category, phase, step,
    and for an allocation its module."""
    return ev.kind, ev.category, ev.phase, ev.step, ev.module if ev.kind == ALLOC else None


def aligned(base: list[Event], other: list[Event]) -> list | None:
    """For each event of ``base`` (the max_len trace), the index of the same event in ``other``
    (a shorter trace), or None where only ``base`` has it (a kernel that takes another
    algorithm above a size: CUDA's embedding backward sorts above 3,072 indices); None when
    ``other`` has events ``base`` lacks. Matched in order: an event of ``base`` that does not
    match ``other``'s next is taken as one only ``base`` has."""
    pairs, j = [], 0
    for ev in base:
        if j < len(other) and _signature(other[j]) == _signature(ev):
            pairs.append(j)
            j += 1
        else:
            pairs.append(None)
    return pairs if j == len(other) else None


def growing_life(events: list[Event], start: int, eval_start: int, gpu: GpuSpec | None, shorter: list,
                 traced: int, arch, room: int | None, margin: float, assume: Callable[[str], None]):
    """The caching allocator over a run whose batches grow to the traced length (issue 22).

    Its steps are replayed at ``growing_lengths``; an allocation's size at a length no trace
    had is the quadratic through its sizes in the three traces (exact for sizes linear or
    quadratic in the length, as activations and attention scores are). Lengths that grow
    leave cached segments too small for the next step: the cache fills until the allocator
    must give segments back, so the run is replayed in ``room`` (the GPU less the margin and
    the context), and its figures are those of a GPU that keeps the margin free. Falls back to
    the steady max-length life (with a note, None) when the traces differ op for op."""
    (length, _), *others = shorter
    base = events[:eval_start]
    points = []  # (length, its trace's index of each max_len event, or None, and its events)
    partial = False
    for l, log in others:
        evs, _ = device_events(log, traced, Device.CUDA, arch)
        pairs = aligned(base, evs)
        if pairs is None:
            assume(f"padding=longest: the traces at {length} and {l} tokens differ op for op, so the run of "
                   f"growing lengths was not replayed; reserved is that of steps at {length} tokens")
            return None
        partial |= None in pairs
        points.append((l, pairs, evs))
    lengths = growing_lengths(length)

    def sizes_at(l: int) -> list[int]:
        sizes = [ev.nbytes for ev in base]
        if l == length:
            return sizes
        known = next(((pairs, evs) for x, pairs, evs in points if x == l), None)
        for n in range(len(base)):
            if known is not None:
                pairs, evs = known
                if pairs[n] is not None:
                    sizes[n] = evs[pairs[n]].nbytes
            elif all(pairs[n] is not None for _, pairs, _ in points):
                sizes[n] = lagrange([(length, sizes[n])] + [(x, evs[pairs[n]].nbytes) for x, pairs, evs in points],
                                    l)
        return sizes

    run, last = growing_run(events, start, eval_start, sizes_at, lengths)
    run += [ev._replace(step=len(lengths)) for ev in events[eval_start:]]  # the evaluation, after training
    sim, grown = replayed(run, (last, last + eval_start - start), room)
    traced_lengths = ", ".join(str(x) for x in [length] + [p[0] for p in points])
    note = (f"padding=longest: the caching allocator replayed {len(lengths)} steps of lengths growing from "
            f"{lengths[0]} to {length} tokens (sizes between the traced {traced_lengths} "
            f"interpolated per allocation), then {length} until it settled"
            + (f"; buffers only the {length}-token trace has (a kernel that switches algorithm with the "
               f"size, such as CUDA's sorting embedding backward) are replayed at their {length}-token size "
               "at every length" if partial else ""))
    if sim.peak_reserved_bytes < grown:  # the bounded replay completed
        note += (f"; unbounded its cache would grow to {format_bytes(grown)}, so it was "
                 f"replayed on the {gpu.name} less the {margin:.0%} margin, where it gives cached segments "
                 "back and completes")
    assume(note)
    return sim, run


def device_totals(allocated_peak: int, cuda) -> dict:
    """The CUDA fields of a ``DeviceMemory`` (none on the CPU): ``cuda`` is ``(the allocator's
    replay, its events, the context's bytes)``."""
    if cuda is None:
        return {}
    sim, events, context = cuda
    reserved = max(sim.peak_reserved_bytes, allocated_peak)
    at = events[sim.reserved_peak_event] if sim.reserved_peak_event is not None else None
    last_step = max((ev.step for ev in events if ev.phase is not Phase.EVAL), default=0) + 1  # 1-based
    return {
        # What the cache holds beyond the allocated peak: blocks too fragmented, or in the
        # wrong pool, to serve the peak's requests, so new segments had to be reserved.
        "reserved_bytes": reserved, "fragmentation_bytes": reserved - allocated_peak, "context_bytes": context,
        "device_total_bytes": reserved + context,
        "reserved_peak_phase": None if at is None else at.phase,
        "reserved_peak_step": None if at is None else at.step + 1 + sim.reserved_peak_repeat,
        "steady_step": None if sim.steady_repeats is None else last_step + sim.steady_repeats - 1,
        "released_cached": sim.released,
    }
