"""One GPU's memory, event by event, over the traced steps: what ``--plot`` draws and
``--snapshot`` writes, kept in one frozen dataclass of integer bytes.

``estimate(..., timeline=True)`` builds it from the busiest GPU's events (the ones
``estimate`` replays for the peak, cuBLAS workspaces included on CUDA), so its
steady-state peak is the estimate's ``peak_bytes``. On the CUDA target the events are
replayed once more through the caching-allocator simulation (``memcheck.cuda.allocator``),
this time noting where each block lies and when each segment is reserved; on the CPU
target every allocation is its own ``malloc``, at a synthetic address.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from memcheck.cuda.allocator import AllocatorConfig, CachingAllocator
from memcheck.enums import ALLOC, FREE, RECAT, Category, Device, Phase
from memcheck.errors import UsageError

CATEGORIES = tuple(Category)  # the order of ``TimelinePoint.by_category``
# The simulation's addresses start at 0; they are shifted to where a device pointer might
# be (an arbitrary base, chosen to look like one) so that no block sits at address 0.
ADDRESS_BASE = 0x7F00_0000_0000
CPU_ALIGNMENT = 64  # c10::alloc_cpu aligns to gAlignment, 64 B (c10/core/alignment.h)


@dataclass(frozen=True)
class TimelinePoint:
    """Memory right after one traced event."""

    event: int  # the event's index in the timeline
    step: int  # 1-based training step (the evaluation pass counts as the step after the last)
    phase: Phase
    by_category: tuple[int, ...]  # live bytes per category, in CATEGORIES order (granted blocks on CUDA)
    reserved: int | None = None  # CUDA: bytes the caching allocator holds in segments

    @property
    def total(self) -> int:
        """Live bytes: ``memory_allocated()`` on CUDA."""
        return sum(self.by_category)

    def bytes_of(self, category: Category) -> int:
        return self.by_category[CATEGORIES.index(category)]


@dataclass(frozen=True)
class PhaseSpan:
    """A run of consecutive events in one phase of one step: events ``start`` to ``end - 1``."""

    step: int  # 1-based
    phase: Phase
    start: int
    end: int


@dataclass(frozen=True)
class Allocation:
    """One allocation, from its ALLOC event to its FREE event."""

    event: int
    freed: int | None  # the FREE event's index; None when it is live at the end of the trace
    address: int  # the simulated block's address on CUDA; synthetic on CPU
    size: int  # the granted block (what memory_allocated() grows by); the request on CPU
    requested: int  # the bytes the tensor's storage asked for
    category: Category  # the one it ends with (a tensor saved for backward starts as a temporary)
    module: str
    phase: Phase  # where it was allocated
    step: int  # 1-based
    # the Python stack it was allocated at, innermost first, as (filename, line, name); empty
    # unless the trace recorded stacks (memcheck.trace.stacks says which frames are kept)
    frames: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class SegmentEvent:
    """Memory the caching allocator reserved from the driver (CUDA only; never given back
    in an estimate, which sets no capacity, so there are no releases)."""

    event: int  # the ALLOC event that needed it
    address: int
    size: int
    small: bool  # the small pool's (requests of at most 1 MiB) or the large pool's
    expandable: bool  # pages mapped into an expandable segment, rather than a cudaMalloc


@dataclass(frozen=True)
class Timeline:
    """The busiest GPU's (or the CPU's) memory over every traced event.

    ``points[i]`` is the memory after event ``i``; ``allocations`` and ``segments`` are
    what an allocator trace records (``memcheck.pictures.snapshot`` writes them as
    ``torch.cuda.memory._snapshot()`` does); ``spans`` are the phases in event order.
    """

    device: Device
    gpu: int  # the GPU's index (0 on the CPU target)
    points: tuple[TimelinePoint, ...]
    spans: tuple[PhaseSpan, ...]
    allocations: tuple[Allocation, ...]
    segments: tuple[SegmentEvent, ...]
    steady_start: int  # the first event of step 2: the steady state, where the peak is taken
    context_bytes: int | None = None  # CUDA: the context outside the allocator

    def peak(self, start: int = 0, end: int | None = None) -> TimelinePoint:
        """The first point with the most live bytes among events ``start`` to ``end - 1``."""
        window = self.points[start:end]
        if not window:
            raise UsageError(f"the timeline has no events in [{start}, {end})")
        return max(window, key=lambda p: (p.total, -p.event))

    @property
    def train_peak(self) -> TimelinePoint:
        """The steady-state training peak (the estimate's ``train_peak_bytes``)."""
        eval_start = next((s.start for s in self.spans if s.phase is Phase.EVAL), len(self.points))
        return self.peak(self.steady_start, max(eval_start, self.steady_start + 1))

    def step_range(self, step: int) -> tuple[int, int]:
        """``(start, end)``: the events of 1-based training ``step`` (its evaluation pass excluded)."""
        spans = [s for s in self.spans if s.step == step and s.phase not in (Phase.SETUP, Phase.EVAL)]
        if not spans:
            raise UsageError(f"step {step} was not traced")
        return spans[0].start, spans[-1].end


def build_timeline(
    events: list[tuple],
    steady_start: int,
    *,
    device: Device,
    gpu: int = 0,
    context_bytes: int | None = None,
    config: AllocatorConfig | None = None,
    module_label: Callable[[str | None], str] = lambda m: m or "(outside modules)",
    stacks: Mapping[int, tuple] | None = None,
) -> Timeline:
    """The timeline of one GPU's ``TraceLog.events`` (as ``estimate`` selects them).

    Args:
        events: ``memcheck.enums.Event``s of one GPU.
        steady_start: the index of step 2's first event.
        device: on CUDA the events go through the caching-allocator simulation.
        config: the allocator settings (default: ``AllocatorConfig.from_env()``, as ``estimate``).
        module_label: the report's name for a tracer module name.
        stacks: ``TraceLog.stacks``: the Python stack of each ALLOC event, by the event's ``id``.
    """
    cuda = device is Device.CUDA
    reserved_now: list[tuple[int, int, bool, bool]] = []  # (address, size, small, expandable), as reserved
    allocator = CachingAllocator(config or AllocatorConfig.from_env(),
                                 on_reserve=lambda *piece: reserved_now.append(piece)) if cuda else None
    next_cpu_address = 0
    by_cat = [0] * len(CATEGORIES)
    index = {c: i for i, c in enumerate(CATEGORIES)}
    live: dict = {}  # storage id -> the index of its allocation in ``allocs``
    allocs: list[list] = []  # Allocation fields, mutable until the end
    segments: list[SegmentEvent] = []
    points: list[TimelinePoint] = []
    spans: list[PhaseSpan] = []
    stacks = stacks or {}
    for i, event in enumerate(events):
        kind, sid, nbytes, category, module, phase, step = (event.kind, event.sid, event.nbytes, event.category,
                                                             event.module, event.phase, event.step)
        if kind == ALLOC:
            if cuda:
                size = allocator.malloc(sid, nbytes, event.stream)
                address = ADDRESS_BASE + allocator.live[sid].addr
                segments.extend(SegmentEvent(i, ADDRESS_BASE + a, n, small, expandable)
                                for a, n, small, expandable in reserved_now)
                reserved_now.clear()
            else:
                size, address = nbytes, ADDRESS_BASE + next_cpu_address
                next_cpu_address += (nbytes + CPU_ALIGNMENT - 1) // CPU_ALIGNMENT * CPU_ALIGNMENT
            live[sid] = len(allocs)
            allocs.append([i, None, address, size, nbytes, category, module_label(module), phase, step + 1,
                           stacks.get(id(event), ())])
            by_cat[index[category]] += size
        elif kind == FREE:
            if cuda:
                allocator.free(sid)
            a = live.pop(sid, None)
            if a is not None:
                allocs[a][1] = i
                by_cat[index[allocs[a][5]]] -= allocs[a][3]
        elif kind == RECAT and sid in live:
            a = allocs[live[sid]]
            by_cat[index[a[5]]] -= a[3]
            by_cat[index[category]] += a[3]
            a[5] = category
            if module is not None:
                a[6] = module_label(module)
        points.append(TimelinePoint(i, step + 1, phase, tuple(by_cat), allocator.reserved if cuda else None))
        if spans and spans[-1].phase is phase and spans[-1].step == step + 1:
            spans[-1] = PhaseSpan(step + 1, phase, spans[-1].start, i + 1)
        else:
            spans.append(PhaseSpan(step + 1, phase, i, i + 1))
    return Timeline(
        device=device, gpu=gpu, points=tuple(points), spans=tuple(spans),
        allocations=tuple(Allocation(*a) for a in allocs), segments=tuple(segments),
        steady_start=steady_start, context_bytes=context_bytes if cuda else None,
    )


# ---- the files --snapshot and --plot write ---------------------------------------------


def check_output_path(path, suffixes: tuple[str, ...], what: str) -> Path:
    """``path`` as a Path, if a file with one of ``suffixes`` can be written there.

    Raises:
        UsageError: naming the path, for a wrong suffix, a directory, or a missing or
            read-only directory.
    """
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise UsageError(f"{what} {str(path)!r} must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a directory; name a file")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{what} {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{what} {str(path)!r}: directory {str(parent)!r} is not writable")
    return path


def write_atomically(path: Path, data: bytes, what: str) -> None:
    """Write ``data`` to a temporary file next to ``path``, then rename it over ``path``, so
    that a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        written = os.stat(tmp).st_size  # checked after the write: a file cut short is an error
        if written != len(data):
            raise OSError(f"{written} of {len(data)} bytes written")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UsageError(f"{what} {str(path)!r} could not be written: {exc.strerror or exc}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
