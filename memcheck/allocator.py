"""A simulation of PyTorch's CUDA caching allocator, replayed on a traced event log.

It follows ``c10/cuda/CUDACachingAllocator.cpp`` (native allocator, one stream,
``expandable_segments`` off). Requests are rounded up to 512 B. Requests of at most
1 MiB come from a small pool of 2 MiB segments; larger ones come from a large pool,
where requests under 10 MiB get 20 MiB segments and the rest are rounded up to
2 MiB. A request takes the smallest cached free block that fits. The block is split
when the remainder is worth keeping, and freed blocks merge with their free
neighbours. ``max_split_size_mb`` keeps oversize blocks from being split. When
``capacity`` is given and a new segment would exceed it, unused cached segments are
released first, as the real allocator does before it reports an OOM.

What it predicts is ``torch.cuda.max_memory_reserved()``: the segments held from
the driver. Status: measured against hand-worked sequences only; not yet against
a real GPU.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from memcheck.errors import UsageError
from memcheck.tracer import ALLOC, FREE

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest "small" request, 1 MiB
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment size, 2 MiB
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for requests of 1-10 MiB, 20 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on, segments fit the request
ROUND_LARGE = 2 << 20  # kRoundLarge: large segments are rounded up to 2 MiB


def round_size(nbytes: int) -> int:
    """``CUDACachingAllocator::round_size`` without ``roundup_power2_divisions``."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def segment_size(nbytes: int) -> int:
    """``get_allocation_size``: how much a new segment for a rounded request takes."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (nbytes + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def max_split_size_from_env(conf: str | None = None) -> int | None:
    """``max_split_size_mb`` from ``PYTORCH_CUDA_ALLOC_CONF`` (None: unlimited)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if conf is None else conf
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "max_split_size_mb":
            try:
                mb = int(value)
            except ValueError:
                raise UsageError(f"PYTORCH_CUDA_ALLOC_CONF max_split_size_mb {value!r} is not an integer") from None
            if mb <= 20:  # the allocator's own check: "max_split_size_mb too small, must be > 20"
                raise UsageError(f"PYTORCH_CUDA_ALLOC_CONF max_split_size_mb must be > 20, got {mb}")
            return mb << 20
    return None


@dataclass(frozen=True)
class AllocatorStats:
    """What the simulated allocator saw over a whole event log."""

    peak_allocated_bytes: int  # max over time of rounded live blocks (max_memory_allocated)
    peak_reserved_bytes: int  # max over time of segments held (max_memory_reserved)
    fragmentation_bytes: int  # reserved minus allocated at the reserved peak
    segments_at_peak: int


class _Block:
    __slots__ = ("seg", "addr", "size", "free", "small")

    def __init__(self, seg, addr, size, small):
        self.seg, self.addr, self.size, self.free, self.small = seg, addr, size, True, small


class CachingAllocator:
    """The simulated allocator; ``malloc``/``free`` by storage id."""

    def __init__(self, *, max_split_size: int | None = None, capacity: int | None = None):
        self.max_split = max_split_size if max_split_size is not None else float("inf")
        self.capacity = capacity
        self.pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}  # (size, addr, block)
        self.segments: dict[int, list[_Block]] = {}  # segment id -> blocks in address order
        self.live: dict[object, _Block] = {}
        self.reserved = self.allocated = 0
        self._next_addr = 0

    # -- pools ---------------------------------------------------------------------
    def _insert(self, b: _Block):
        bisect.insort(self.pools[b.small], (b.size, b.addr, b), key=lambda t: (t[0], t[1]))

    def _remove(self, b: _Block):
        pool = self.pools[b.small]
        i = bisect.bisect_left(pool, (b.size, b.addr), key=lambda t: (t[0], t[1]))
        del pool[i]

    def _find(self, size: int, small: bool) -> _Block | None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1), key=lambda t: (t[0], t[1]))
        if i == len(pool):
            return None
        b = pool[i][2]
        if not small:  # get_free_block's oversize rules
            if size < self.max_split and b.size >= self.max_split:
                return None
            if size >= self.max_split and b.size >= size + LARGE_BUFFER:
                return None
        return b

    def _new_segment(self, size: int, small: bool) -> _Block | None:
        seg_size = segment_size(size)
        if self.capacity is not None and self.reserved + seg_size > self.capacity:
            self._release_cached()
            if self.reserved + seg_size > self.capacity:
                return None
        seg = self._next_addr
        self._next_addr += seg_size
        b = _Block(seg, seg, seg_size, small)
        self.segments[seg] = [b]
        self.reserved += seg_size
        return b

    def _release_cached(self):
        for seg, blocks in list(self.segments.items()):
            if len(blocks) == 1 and blocks[0].free:
                self._remove(blocks[0])
                self.reserved -= blocks[0].size
                del self.segments[seg]

    # -- malloc / free ---------------------------------------------------------------
    def malloc(self, key, nbytes: int) -> bool:
        """Allocate; False when ``capacity`` is exceeded even after releasing the cache (an OOM)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        b = self._find(size, small)
        if b is not None:
            self._remove(b)
        else:
            b = self._new_segment(size, small)
            if b is None:
                return False
        remaining = b.size - size
        split = remaining >= MIN_BLOCK if small else (size < self.max_split and remaining > SMALL_SIZE)
        if split:
            rest = _Block(b.seg, b.addr + size, remaining, small)
            blocks = self.segments[b.seg]
            blocks.insert(blocks.index(b) + 1, rest)
            self._insert(rest)
            b.size = size
        b.free = False
        self.live[key] = b
        self.allocated += b.size
        return True

    def free(self, key) -> None:
        b = self.live.pop(key, None)
        if b is None:
            return
        self.allocated -= b.size
        b.free = True
        blocks = self.segments[b.seg]
        i = blocks.index(b)
        for j in (i + 1, i - 1):  # merge with free neighbours (next first, as free_block does)
            if 0 <= j < len(blocks) and blocks[j].free:
                other = blocks[j]
                self._remove(other)
                b.addr = min(b.addr, other.addr)
                b.size += other.size
                blocks.remove(other)
                i = blocks.index(b)
        self._insert(b)


def simulate(events, *, max_split_size: int | None = None, capacity: int | None = None) -> AllocatorStats:
    """Replay a ``TraceLog.events`` list through the caching allocator."""
    alloc = CachingAllocator(max_split_size=max_split_size, capacity=capacity)
    peak_alloc = peak_res = frag = segs = 0
    for ev in events:
        kind, sid, nbytes = ev[0], ev[1], ev[2]
        if kind == ALLOC:
            alloc.malloc(sid, nbytes)
            peak_alloc = max(peak_alloc, alloc.allocated)
            if alloc.reserved > peak_res:
                peak_res, frag, segs = alloc.reserved, alloc.reserved - alloc.allocated, len(alloc.segments)
        elif kind == FREE:
            alloc.free(sid)
    return AllocatorStats(peak_alloc, peak_res, frag, segs)
