"""``--snapshot``: the simulated allocator trace in the format of ``torch.cuda.memory._snapshot()``,
so that PyTorch's own viewer opens it (https://pytorch.org/memory_viz, or
``python -m torch.cuda._memory_viz trace_plot FILE -o out.html``).

The format is the one ``torch/cuda/memory.py`` documents for ``_snapshot()``: a dict with
``segments`` (the allocator's state at the end: each segment and the blocks that tile it)
and ``device_traces`` (one list of trace entries per device: ``segment_alloc`` /
``segment_map``, ``alloc``, ``free_requested``, ``free_completed``, ``segment_free``, with
``addr``, ``size``, ``stream`` and ``frames``). As in torch's own trace, an entry's size is
the bytes the tensor asked for, and a block's ``size`` is what the allocator granted.

What is memcheck's own:

- The trace covers every traced event of the busiest GPU, written as device 0: setup,
  step 1, the steady-state step 2 (and any further steps and the evaluation pass).
- An allocation's ``frames`` are the Python stack it was made at, innermost first, as
  ``_record_memory_history(stacks="python")`` records them (``{"filename", "line", "name"}``;
  ``memcheck.trace.stacks`` says which frames are left out), then one synthetic frame,
  outermost, ``{"filename": "step", "line": STEP, "name": "PHASE: MODULE (CATEGORY)"}``,
  which the viewer prints as ``step:2:forward: transformer.h.3.attn (activations)``; the
  category is the one the tensor ends with. A segment's frames are a synthetic one alone.
  The same frame is one dict in the pickle, written once.
- Entries carry a ``category`` key, which the viewer colours by (as for
  ``torch.profiler`` snapshots). Segments belong to no category and are marked
  ``unknown``; MemoryViz.js expects that name among the categories whenever any is set.
- On the CPU target every allocation is its own ``malloc``: a segment of its own at a
  synthetic address, freed with it; allocations of 0 bytes (no memory) are left out.
- The pickle uses protocol 4 and only lists, dicts, strings, ints and tuples: the
  opcodes MemoryViz.js's own unpickler reads.
"""

from __future__ import annotations

import bisect
import pickle

from memcheck.cuda.allocator import SMALL_SIZE
from memcheck.enums import Device
from memcheck.errors import UsageError
from memcheck.report.timeline import (
    Allocation,
    SegmentEvent,
    Timeline,
    check_output_path,
    write_atomically,
)

SUFFIXES = (".pickle",)
PICKLE_PROTOCOL = 4  # MemoryViz.js's unpickler reads protocols 2 to 4
SEGMENT_CATEGORY = "unknown"


def check_snapshot_path(path, what: str = "snapshot") -> None:
    """Raise UsageError naming ``path`` unless a ``.pickle`` file can be written there."""
    check_output_path(path, SUFFIXES, what)


def write_snapshot(estimate, path, *, what: str = "snapshot") -> None:
    """Write ``estimate``'s allocator trace to ``path`` (a ``.pickle``) for PyTorch's memory viewer.

    The file is written to a temporary name in the same directory and then renamed, so
    no half-written file is ever left at ``path``.

    Args:
        estimate: an ``Estimate`` from ``memcheck.estimate(..., timeline=True)``.
        path: the file to write; its directory must exist.
        what: how errors name the path (the CLI passes ``--snapshot``).

    Raises:
        UsageError: the estimate has no timeline, or the path is not a writable ``.pickle`` file.

    Example:
        >>> est = memcheck.estimate(model, batch, gpu="24GiB", timeline=True)
        >>> memcheck.write_snapshot(est, "step.pickle")
        $ python -m torch.cuda._memory_viz trace_plot step.pickle -o step.html

    Known limitations:
        One device and one stream, as the allocator simulation; addresses are the
        simulation's (CUDA) or synthetic (CPU), not what a real run would get. The CUDA
        context lies outside the caching allocator and is not in the snapshot.
    """
    path = check_output_path(path, SUFFIXES, what)
    timeline = _timeline_of(estimate)
    write_atomically(path, pickle.dumps(snapshot_dict(timeline), protocol=PICKLE_PROTOCOL), what)


def _timeline_of(estimate) -> Timeline:
    timeline = getattr(estimate, "timeline", None)
    if timeline is None:
        raise UsageError("this estimate has no timeline; trace it with memcheck.estimate(..., timeline=True)")
    return timeline


def _frames(step: int, text: str) -> list[dict]:
    return [{"filename": "step", "line": step, "name": text}]


class _AllocFrames:
    """Each allocation's frames: its Python stack, innermost first, then the synthetic frame.

    The same frame is the same dict, and the same frames the same list, so the pickle writes
    each once and refers back to it (BINGET)."""

    def __init__(self):
        self._frame: dict[tuple, dict] = {}
        self._frames: dict[tuple, list[dict]] = {}

    def __call__(self, a: Allocation) -> list[dict]:
        text = f"{a.phase.value}: {a.module} ({a.category.value})"
        key = (a.frames, a.step, text)
        frames = self._frames.get(key)
        if frames is None:
            frames = self._frames[key] = [self._dict(f) for f in a.frames] + _frames(a.step, text)
        return frames

    def _dict(self, frame: tuple[str, int, str]) -> dict:
        d = self._frame.get(frame)
        if d is None:
            filename, line, name = frame
            d = self._frame[frame] = {"filename": filename, "line": line, "name": name}
        return d


def snapshot_dict(timeline: Timeline) -> dict:
    """The ``torch.cuda.memory._snapshot()`` dict of a timeline (see the module docstring)."""
    cuda = timeline.device is Device.CUDA
    allocations = [a for a in timeline.allocations if cuda or a.requested > 0]
    points = timeline.points
    entries: list[tuple[int, int, dict]] = []  # (event, order within the event, entry)
    alloc_frames = _AllocFrames()

    def add(event: int, order: int, action: str, addr: int, size: int, frames: list, category: str):
        entries.append((event, order, {"action": action, "addr": addr, "size": size, "stream": 0,
                                       "frames": frames, "category": category}))

    for s in timeline.segments:
        add(s.event, 0, "segment_map" if s.expandable else "segment_alloc", s.address, s.size,
            _segment_frames(s, points[s.event].step, points[s.event].phase.value), SEGMENT_CATEGORY)
    for a in allocations:
        frames, category = alloc_frames(a), a.category.value
        if not cuda:  # its own malloc
            add(a.event, 0, "segment_alloc", a.address, a.requested, frames, SEGMENT_CATEGORY)
        add(a.event, 1, "alloc", a.address, a.requested, frames, category)
        if a.freed is not None:
            add(a.freed, 2, "free_requested", a.address, a.requested, frames, category)
            add(a.freed, 3, "free_completed", a.address, a.requested, frames, category)
            if not cuda:
                add(a.freed, 4, "segment_free", a.address, a.requested, frames, SEGMENT_CATEGORY)
    entries.sort(key=lambda e: (e[0], e[1]))
    live = sorted((a for a in allocations if a.freed is None), key=lambda a: a.address)
    if cuda:
        segments = [_segment(address, size, small, expandable, frames, live, alloc_frames)
                    for address, size, small, expandable, frames in _reserved_ranges(timeline)]
    else:
        segments = [_segment(a.address, a.requested, a.requested <= SMALL_SIZE, False, alloc_frames(a), [a],
                             alloc_frames)
                    for a in live]
    return {"segments": segments, "device_traces": [[e for _, _, e in entries]]}


def _segment_frames(s: SegmentEvent, step: int, phase: str) -> list[dict]:
    pool = "small" if s.small else "large"
    how = "page mapped into the expandable segment" if s.expandable else "cudaMalloc"
    return _frames(step, f"{phase}: {how} ({pool} pool)")


def _reserved_ranges(timeline: Timeline) -> list[tuple[int, int, bool, bool, list]]:
    """The segments at the end: each cudaMalloc'd one, and each run of contiguous mapped
    pages of an expandable segment (torch reports those as one segment each)."""
    points = timeline.points
    out: list[list] = []
    for s in sorted(timeline.segments, key=lambda s: s.address):
        frames = _segment_frames(s, points[s.event].step, points[s.event].phase.value)
        if s.expandable and out and out[-1][3] and out[-1][0] + out[-1][1] == s.address:
            out[-1][1] += s.size
        else:
            out.append([s.address, s.size, s.small, s.expandable, frames])
    return [tuple(r) for r in out]


def _segment(address: int, size: int, small: bool, expandable: bool, frames: list,
             live: list[Allocation], alloc_frames: _AllocFrames) -> dict:
    """One segment at the end of the trace, tiled by its live blocks and the free gaps between them."""
    addresses = [a.address for a in live]
    blocks, at = [], address
    for a in live[bisect.bisect_left(addresses, address):bisect.bisect_left(addresses, address + size)]:
        if a.address > at:
            blocks.append(_free_block(at, a.address - at))
        blocks.append({"address": a.address, "size": a.size, "requested_size": a.requested,
                       "state": "active_allocated", "frames": alloc_frames(a)})
        at = a.address + a.size
    if at < address + size:
        blocks.append(_free_block(at, address + size - at))
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": 0, "address": address, "total_size": size, "stream": 0,
        "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
        "allocated_size": allocated, "active_size": allocated,
        "requested_size": sum(b["requested_size"] for b in blocks), "is_expandable": expandable,
        "frames": frames, "blocks": blocks,
    }


def _free_block(address: int, size: int) -> dict:
    return {"address": address, "size": size, "requested_size": 0, "state": "inactive", "frames": []}
