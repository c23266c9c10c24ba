"""A simulation of PyTorch's CUDA caching allocator, replayed on a traced event log.

It follows the native allocator of ``c10/cuda/CUDACachingAllocator.cpp`` for one
device and one stream, with the settings of ``PYTORCH_CUDA_ALLOC_CONF`` parsed as
``c10/core/AllocatorConfig.cpp`` parses them (see ``AllocatorConfig``).

Requests are rounded up to 512 B, or to a power-of-two division with
``roundup_power2_divisions``. Rounded requests of at most 1 MiB come from a small
pool, larger ones from a large pool. A request takes the smallest cached free block
that fits (best fit, ties to the lower address). Without expandable segments a miss
``cudaMalloc``s a new segment: 2 MiB for the small pool, ``large_segment_size``
(20 MiB) for large requests under 10 MiB, and the request rounded up to 2 MiB above
that. The found block is split when the remainder is worth keeping (any remainder of
512 B or more in the small pool; more than 1 MiB in the large pool, and only for
requests under ``max_split_size``); otherwise the whole block is handed out, and the
leftover counts as allocated. Freed blocks merge with free neighbours and stay
cached: reserved memory only goes back to the driver when ``capacity`` would be
exceeded (the allocator's retry path before an OOM).

With ``expandable_segments:True`` each pool has one segment of reserved address
space that grows by mapping pages (2 MiB in the small pool, ``large_segment_size``
in the large one); ``reserved`` is the mapped bytes. Any remainder of 512 B or more
is split off, and pages are unmapped only on the retry path before an OOM.

What it predicts is ``torch.cuda.max_memory_reserved()`` and
``max_memory_allocated()``. Status: checked against hand-worked sequences in
``tests/test_allocator.py``; ``tests/test_allocator_gpu.py`` replays a mixed sequence
on a real GPU and demands exact agreement (it is skipped where no GPU is present).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Callable

from memcheck.enums import ALLOC, FREE, Event
from memcheck.errors import UsageError, closest
from memcheck.units import MiB, round_up

MIN_BLOCK = 512  # kMinBlockSize (c10/core/AllocatorConfig.h): every request is rounded up to this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest "small" request, 1 MiB
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment size (and expandable small-pool page), 2 MiB
LARGE_BUFFER = 20 << 20  # kLargeBuffer / default large_segment_size_: segment for 1-10 MiB requests, 20 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on, segments fit the request
ROUND_LARGE = 2 << 20  # kRoundLarge: large segments are rounded up to 2 MiB
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one entry per power of two
# An expandable segment reserves address space for 1 1/8 of the GPU's memory
# (ExpandableSegment::init); the amount never matters to the simulation, only that it is huge.
EXPANDABLE_ADDRESS_SPACE = 1 << 50

# The environment variables torch 2.13 reads, in the order it reads them; the first one set
# wins (AcceleratorAllocatorConfig::instance(); libc10.so of torch 2.13.0 lists them so).
CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
BACKENDS = ("native", "cudaMallocAsync", "hipMallocAsync")
# Keys the real parsers accept that do not change how device memory is carved up here
# (host/pinned memory, locking, CUDA-graph and IPC settings). They are checked for shape
# only and reported in ``AllocatorConfig.ignored_keys``.
_IGNORED_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
        "pinned_free_catch_all",
        "graph_capture_record_stream_reuse",
        "per_process_memory_fraction",
        "throw_on_cudamalloc_oom",
        "expandable_segments_reserve",
        "expandable_segments_reserve_by_class",
    }
)
# Of those, the ones whose value must be True or False (ConfigTokenizer::toBool).
_BOOL_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_use_background_threads",
        "graph_capture_record_stream_reuse",
    }
)
_MODELLED_KEYS = (
    "backend",
    "expandable_segments",
    "garbage_collection_threshold",
    "large_segment_size_mb",
    "max_non_split_rounding_mb",
    "max_split_size_mb",
    "roundup_power2_divisions",
)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` sets them.

    Attributes:
        max_split_size: ``max_split_size_mb`` in bytes; blocks this big are never split,
            and requests below it never take them. None: unlimited (the default).
        expandable_segments: ``expandable_segments:True``: one growing segment per pool.
        roundup_power2_divisions: divisions per power-of-two size interval, 16 entries
            for [1, 2) MiB (and everything smaller), [2, 4) MiB, ..., [32 GiB, ...);
            0 or 1: plain 512 B rounding. An int sets every interval.
        garbage_collection_threshold: parsed and validated, but the allocator only acts on
            it when ``torch.cuda.set_per_process_memory_fraction`` is set and usage
            nears that fraction; the simulation does not model it.
        large_segment_size: ``large_segment_size_mb`` in bytes: segment size for 1-10 MiB
            requests and the large pool's expandable page (default 20 MiB).
        max_non_split_rounding_size: ``max_non_split_rounding_mb`` in bytes: how much
            bigger than an oversize request a cached block may be. None: ``large_segment_size``.
        backend: ``native`` or ``cudaMallocAsync`` (not simulated).
        ignored_keys: keys that were set but do not affect the simulation.
    """

    max_split_size: int | None = None
    expandable_segments: bool = False
    roundup_power2_divisions: int | tuple[int, ...] = 0
    garbage_collection_threshold: float | None = None
    large_segment_size: int = LARGE_BUFFER
    max_non_split_rounding_size: int | None = None
    backend: str = "native"
    ignored_keys: tuple[str, ...] = field(default=())

    def __post_init__(self):
        large = self.large_segment_size
        if not isinstance(large, int) or large <= MIN_LARGE_ALLOC:
            raise UsageError(f"large_segment_size must be an int > {MIN_LARGE_ALLOC} B (10 MiB), got {large!r}")
        split = self.max_split_size
        if split is not None and (not isinstance(split, int) or split < large):
            raise UsageError(f"max_split_size must be None or an int >= {large} B, got {self.max_split_size!r}")
        rounding = large if self.max_non_split_rounding_size is None else self.max_non_split_rounding_size
        if not isinstance(rounding, int) or rounding < large:
            raise UsageError(f"max_non_split_rounding_size must be an int >= {large} B, got {rounding!r}")
        object.__setattr__(self, "max_non_split_rounding_size", rounding)
        div = self.roundup_power2_divisions
        table = (div,) * ROUNDUP_INTERVALS if isinstance(div, int) else tuple(div)
        bad = [d for d in table if not isinstance(d, int) or (d != 0 and not _is_pow2(d))]
        if len(table) != ROUNDUP_INTERVALS or bad:
            raise UsageError(
                f"roundup_power2_divisions must be 0, a power of 2, or {ROUNDUP_INTERVALS} such values, got {div!r}"
            )
        object.__setattr__(self, "roundup_power2_divisions", table)
        gc = self.garbage_collection_threshold
        if gc is not None and not 0.0 < gc < 1.0:
            raise UsageError(f"garbage_collection_threshold must be in (0.0, 1.0), got {gc!r}")
        if self.backend not in BACKENDS:
            raise UsageError(f"allocator backend {self.backend!r} is not one of {', '.join(BACKENDS)}")

    def divisions(self, nbytes: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the entry for ``nbytes``."""
        index = max(0, nbytes.bit_length() - 1 - 20)  # log2(size) - log2(1 MiB), clamped
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    @classmethod
    def from_env(cls, conf: str | None = None) -> AllocatorConfig:
        """Parse an allocator config string, or the environment when ``conf`` is None.

        With ``conf=None`` the variables are read in torch 2.13's order,
        ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``,
        and the first one that is set is used (an earlier upstream version preferred
        ``PYTORCH_ALLOC_CONF``; both are accepted). The grammar is
        ``AcceleratorAllocatorConfig::parseArgs``: ``key:value`` pairs separated by
        commas, lists in brackets, whitespace ignored, later keys overriding earlier ones.

        Raises:
            UsageError: naming the key and the bad value, for an unknown key, a malformed
                value, or a value the real parser rejects (``max_split_size_mb`` below
                ``large_segment_size_mb`` (20), a division that is not a power of two, a
                ``garbage_collection_threshold`` outside (0, 1), ``expandable_segments``
                other than ``True``/``False``, ...).

        Example:
            >>> cfg = AllocatorConfig.from_env("expandable_segments:True,max_split_size_mb:256")
            >>> cfg.expandable_segments, cfg.max_split_size
            (True, 268435456)
        """
        source = "PYTORCH_CUDA_ALLOC_CONF"
        if conf is None:
            conf = ""
            for var in CONF_VARS:
                if var in os.environ:
                    source, conf = var, os.environ[var]
                    break
        return _Parser(conf, source).parse()


class _Parser:
    """``ConfigTokenizer`` plus the key parsers of ``AcceleratorAllocatorConfig`` and
    ``CUDAAllocatorConfig``, raising UsageError where they raise."""

    def __init__(self, conf: str, source: str):
        self.source = source
        self.tokens: list[str] = []
        buf = ""
        for ch in conf:
            if ch in ",:[]":
                if buf:
                    self.tokens.append(buf)
                    buf = ""
                self.tokens.append(ch)
            elif not ch.isspace():
                buf += ch
        if buf:
            self.tokens.append(buf)

    def _fail(self, key: str, value: str, why: str):
        raise UsageError(f"{self.source} {key}: {value!r} {why}")

    def _token(self, i: int, key: str) -> str:
        if i >= len(self.tokens):
            self._fail(key, "", "is missing a value")
        return self.tokens[i]

    def _expect(self, i: int, token: str, key: str):
        got = self._token(i, key)
        if got != token:
            self._fail(key, got, f"is out of place: expected {token!r}")

    def _int(self, i: int, key: str) -> int:
        value = self._token(i, key)
        if not (value.isascii() and value.isdigit()):
            self._fail(key, value, "is not a non-negative integer")
        return int(value)

    def _bool(self, i: int, key: str) -> bool:
        value = self._token(i, key)
        if value not in ("True", "False"):
            self._fail(key, value, "must be True or False (capitalised)")
        return value == "True"

    def parse(self) -> AllocatorConfig:
        t = self.tokens
        settings: dict = {}
        # large_segment_size_mb is read first: the minimums of two other keys depend on it.
        large_mb = LARGE_BUFFER // MiB
        for i, tok in enumerate(t):
            if tok == "large_segment_size_mb" and (i == 0 or t[i - 1] == ","):
                self._expect(i + 1, ":", tok)
                large_mb = self._int(i + 2, tok)
                if large_mb <= MIN_LARGE_ALLOC // MiB:
                    self._fail(tok, str(large_mb), f"must be > {MIN_LARGE_ALLOC // MiB}")
        settings["large_segment_size"] = large_mb * MiB
        ignored = []
        i = 0
        while i < len(t):
            key = t[i]
            if key not in _MODELLED_KEYS and key not in _IGNORED_KEYS:
                known = sorted((*_MODELLED_KEYS, *_IGNORED_KEYS))
                hint, allowed = closest(key, known), ", ".join(known)
                raise UsageError(f"{self.source}: {key!r} is not an allocator option{hint}; allowed: {allowed}")
            self._expect(i + 1, ":", key)
            i += 2  # i: the value
            if key == "large_segment_size_mb":
                pass  # handled above
            elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                mb = self._int(i, key)
                if mb < large_mb:  # "CachingAllocator option max_split_size_mb too small, must be >= 20"
                    self._fail(key, t[i], f"is too small: must be >= {large_mb} (large_segment_size_mb)")
                name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
                settings[name] = mb * MiB
            elif key == "garbage_collection_threshold":
                try:
                    gc = float(self._token(i, key))
                except ValueError:
                    self._fail(key, t[i], "is not a number")
                if not 0.0 < gc < 1.0:
                    self._fail(key, t[i], "must be in (0.0, 1.0)")
                settings["garbage_collection_threshold"] = gc
            elif key == "roundup_power2_divisions":
                settings["roundup_power2_divisions"], i = self._divisions(i, key)
            elif key == "expandable_segments":
                settings["expandable_segments"] = self._bool(i, key)
            elif key == "backend":
                value = self._token(i, key)
                if value not in BACKENDS:
                    self._fail(key, value, f"is not one of {', '.join(BACKENDS)}")
                settings["backend"] = value
            else:  # a key that does not change the simulation
                if key in _BOOL_KEYS:
                    self._bool(i, key)
                elif self._token(i, key) == "[":  # ConfigTokenizer::skipKey
                    while i < len(t) and t[i] != "]":
                        i += 1
                    if i == len(t):
                        self._fail(key, "[", "has no closing ']'")
                ignored.append(key)
            if i + 1 < len(t):
                self._expect(i + 1, ",", key)
            i += 2
        return AllocatorConfig(**settings, ignored_keys=tuple(dict.fromkeys(ignored)))

    def _divisions(self, i: int, key: str) -> tuple[tuple[int, ...], int]:
        """``parseRoundUpPower2Divisions``: a single power of two, or ``[mb:div,...,>:div]``."""
        t = self.tokens
        if self._token(i, key) != "[":  # the backwards-compatible single value: 0 is rejected here
            value = self._int(i, key)
            if not _is_pow2(value):
                self._fail(key, t[i], "must be a power of 2")
            return (value,) * ROUNDUP_INTERVALS, i
        table = [0] * ROUNDUP_INTERVALS
        first, last_index = True, 0
        i += 1
        while i < len(t) and t[i] != "]":
            boundary = t[i]
            self._expect(i + 1, ":", key)
            value = self._int(i + 2, key)
            if value != 0 and not _is_pow2(value):
                self._fail(key, f"{boundary}:{value}", "needs a division that is 0 or a power of 2")
            if boundary == ">":  # every interval after the last one named
                table[last_index + 1 :] = [value] * (ROUNDUP_INTERVALS - last_index - 1)
            else:
                if not (boundary.isascii() and boundary.isdigit()) or not _is_pow2(int(boundary)):
                    self._fail(key, f"{boundary}:{value}", "needs a size (MB) that is a power of 2")
                # The interval index is log2 of the number of MB, so "256" names [256, 512) MiB.
                index = min(int(boundary).bit_length() - 1, ROUNDUP_INTERVALS - 1)
                if first:  # the first value also covers every smaller interval
                    table[:index] = [value] * index
                    first = False
                table[index] = value
                last_index = index
            i += 3
            if i < len(t) and t[i] == ",":
                i += 1
        if i >= len(t):
            self._fail(key, "[", "has no closing ']'")
        return tuple(table), i


def max_split_size_from_env(conf: str | None = None) -> int | None:
    """``max_split_size_mb`` in bytes (None: unlimited); ``AllocatorConfig.from_env(conf).max_split_size``."""
    return AllocatorConfig.from_env(conf).max_split_size


_DEFAULT = AllocatorConfig()


def round_size(nbytes: int, config: AllocatorConfig | None = None) -> int:
    """``get_round_size``: 512 B multiples, or the next power-of-two division.

    With ``d`` divisions for the request's interval (``d > 1`` and the request above
    ``512 * d`` B), a request between 2^k and 2^(k+1) is rounded up to a multiple of
    2^k / d: with 4 divisions, 5 MiB + 1 B becomes 6 MiB.
    """
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    divisions = (config or _DEFAULT).divisions(nbytes)
    if divisions > 1 and nbytes > MIN_BLOCK * divisions:
        if _is_pow2(nbytes):  # roundup_power2_next_division
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = nbytes & ~(step - 1)
        return nbytes if rounded == nbytes else rounded + step
    return round_up(nbytes, MIN_BLOCK)


def segment_size(nbytes: int, config: AllocatorConfig | None = None) -> int:
    """``get_allocation_size``: how much a new segment for a rounded request takes."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return (config or _DEFAULT).large_segment_size
    return round_up(nbytes, ROUND_LARGE)


@dataclass(frozen=True)
class AllocatorStats:
    """What the simulated allocator saw over a whole event log.

    ``granted[i]`` is, for an ALLOC event ``i``, the size of the block the allocator
    handed out: the rounded request, or the whole cached block when the remainder was
    not worth splitting off (what ``torch.cuda.memory_allocated()`` grows by); 0 for
    other events and for an allocation that did not fit in ``capacity``.

    With ``simulate(..., repeat=(start, end))`` the training step ``events[start:end]``
    is replayed again after its first pass until the allocator's layout repeats:
    ``steady_repeats`` is the number of extra replays it took to see every segment and
    block end a step where the step before left it (1: the log's own last step had
    already settled; k: it settled k - 1 steps after the log's last; 0: the step before the
    log's last had already settled, as the log's last step shows without a replay). None: it had not
    settled within ``MAX_REPEATS`` replays, or the step leaves tensors behind that the
    next one does not free. ``reserved_peak_event`` is the index in ``events`` of the request that
    grew ``reserved`` to its peak and ``reserved_peak_repeat`` how many extra replays of
    the step came before it (0: the peak was reached in the log's own pass).
    """

    peak_allocated_bytes: int  # max over time of granted live blocks (max_memory_allocated)
    peak_reserved_bytes: int  # max over time of segments held or pages mapped (max_memory_reserved)
    fragmentation_bytes: int  # reserved minus allocated at the reserved peak
    segments_at_peak: int  # cudaMalloc'd segments plus expandable segments, at the reserved peak
    granted: tuple[int, ...] = field(default=(), repr=False)
    first_oom: int | None = None  # index of the first ALLOC that did not fit in ``capacity``
    reserved_peak_event: int | None = None
    reserved_peak_repeat: int = 0
    steady_repeats: int | None = None
    released: bool = False  # cached blocks were given back to the driver to make room (near capacity)


class _Segment:
    """An expandable segment: a huge address range mapped page by page."""

    __slots__ = ("base", "page")

    def __init__(self, base: int, page: int):
        self.base, self.page = base, page


class _Block:
    """A ``Block``: a piece of a segment, linked to its address neighbours."""

    __slots__ = ("addr", "size", "allocated", "prev", "next", "small", "es", "mapped", "stream")

    def __init__(self, addr: int, size: int, small: bool, es: _Segment | None = None, mapped: bool = True,
                 stream=0):
        self.addr, self.size, self.small, self.es, self.mapped = addr, size, small, es, mapped
        self.stream = stream
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """A ``BlockPool``: free mapped blocks by (size, address), unmapped ones by address."""

    __slots__ = ("small", "stream", "keys", "free", "unmapped")

    def __init__(self, small: bool, stream=0):
        self.small, self.stream = small, stream
        self.keys: list[tuple[int, int]] = []  # sorted (size, addr) of the free mapped blocks
        self.free: dict[int, _Block] = {}  # addr -> free mapped block
        self.unmapped: dict[int, _Block] = {}  # addr -> unmapped block of an expandable segment

    def insert(self, b: _Block):
        bisect.insort(self.keys, (b.size, b.addr))
        self.free[b.addr] = b

    def remove(self, b: _Block):
        del self.keys[bisect.bisect_left(self.keys, (b.size, b.addr))]
        del self.free[b.addr]


class CachingAllocator:
    """The simulated allocator; ``malloc``/``free`` by storage id.

    Args:
        config: the allocator settings (default: ``AllocatorConfig()``, torch's defaults).
        capacity: device bytes; when a new segment or page would exceed it, cached
            memory is released first (``release_available_cached_blocks``, then
            ``release_cached_blocks``), and ``malloc`` reports an OOM if that is not enough.
        on_reserve: an observer called as ``on_reserve(address, nbytes, small, expandable)``
            each time device memory is reserved: a new segment (``cudaMalloc``), or pages
            mapped into an expandable segment (``cuMemMap``). The timeline records reserved
            memory through it (memcheck.report.timeline).
    """

    def __init__(self, config: AllocatorConfig | None = None, *, capacity: int | None = None,
                 on_reserve: Callable[[int, int, bool, bool], None] | None = None):
        self.on_reserve = on_reserve
        self.config = config or _DEFAULT
        if self.config.backend != "native":
            raise UsageError(f"backend:{self.config.backend} is not simulated, only the native caching allocator")
        self.max_split = self.config.max_split_size if self.config.max_split_size is not None else float("inf")
        self.capacity = capacity
        # One pool per size class and stream. CUDACachingAllocator.cpp's header comment: "Allocations
        # are associated with a stream. Once freed, blocks can be re-allocated on the same stream,
        # but not on any other stream." (its BlockPools order blocks by stream, then size, then
        # address, and get_free_block refuses a block of another stream); a segment's blocks all
        # belong to the stream it was cudaMalloc'd for, so each (class, stream) is a pool of its own.
        self.pools: dict[tuple[bool, object], _Pool] = {}
        self.live: dict[object, _Block] = {}
        self.reserved = self.allocated = self.segments = 0
        self.peak_reserved = 0
        self.released = False  # cached memory went back to the driver to make room
        self._next_addr = 0

    def layout(self) -> tuple:
        """Every block, free or allocated, as ``(address, size, allocated, mapped)``, in address
        order: two equal layouts replay any request sequence the same way."""
        blocks = [(b.addr, b.size, True, True) for b in self.live.values()]
        for pool in self.pools.values():
            blocks += [(b.addr, b.size, False, True) for b in pool.free.values()]
            blocks += [(b.addr, b.size, False, False) for b in pool.unmapped.values()]
        return tuple(sorted(blocks))

    # -- malloc / free ---------------------------------------------------------------
    def _pool(self, small: bool, stream) -> _Pool:
        pool = self.pools.get((small, stream))
        if pool is None:
            pool = self.pools[small, stream] = _Pool(small, stream)
        return pool

    def malloc(self, key, nbytes: int, stream=0) -> int:
        """Allocate on ``stream``; return the granted block size, or 0 when ``capacity`` is
        exceeded (an OOM). A block freed on one stream serves only requests on that stream."""
        size = round_size(nbytes, self.config)
        pool = self._pool(size <= SMALL_SIZE, stream)
        b = self._get_free_block(pool, size)
        if b is None:
            b = self._alloc_block(pool, size)
            if b is None and self._release_available_cached_blocks(pool, size):
                b = self._alloc_block(pool, size)
            if b is None and self.capacity is not None:
                self._release_cached_blocks()
                b = self._alloc_block(pool, size)
            if b is None:
                return 0
        if self._should_split(b, size):  # alloc_found_block: b keeps the front, the rest stays cached
            rest = _Block(b.addr + size, b.size - size, b.small, b.es, stream=b.stream)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            pool.insert(rest)
        b.allocated = True
        self.live[key] = b
        self.allocated += b.size
        return b.size

    def free(self, key) -> None:
        """``free_block``: merge with free neighbours and return the block to its pool."""
        b = self.live.pop(key, None)
        if b is None:
            return
        self.allocated -= b.size
        b.allocated = False
        pool = self._pool(b.small, b.stream)
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)

    # -- finding and making blocks ---------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        keys = pool.keys
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        b = pool.free[keys[i][1]]
        if b.es is not None:
            if self.config.expandable_segments:
                # A block next to unmapped space counts as the size it can grow to, so a
                # tighter block further up the size order may be preferred to it.
                while i + 1 < len(keys):
                    nxt = pool.free[keys[i + 1][1]]
                    if not b.es or _expandable_size(nxt) >= _expandable_size(b):
                        break
                    i, b = i + 1, nxt
            else:  # expandable segments switched off: skip their blocks
                while b.es is not None:
                    i += 1
                    if i == len(keys):
                        return None
                    b = pool.free[keys[i][1]]
        if size < self.max_split and b.size >= self.max_split:
            return None  # do not hand out an oversize block for a smaller request
        if size >= self.max_split and b.size >= size + self.config.max_non_split_rounding_size:
            return None  # an oversize request may take a somewhat bigger block, within a limit
        pool.remove(b)
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.max_split and remaining > SMALL_SIZE

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        seg_size = segment_size(size, self.config)
        if self.capacity is not None and self.reserved + seg_size > self.capacity:
            return None
        b = _Block(self._take_addresses(seg_size), seg_size, pool.small, stream=pool.stream)
        self.segments += 1
        self._grow(seg_size)
        if self.on_reserve is not None:
            self.on_reserve(b.addr, seg_size, pool.small, False)
        return b

    def _take_addresses(self, n: int) -> int:
        addr = self._next_addr
        self._next_addr += n
        return addr

    def _grow(self, n: int):
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    # -- expandable segments -----------------------------------------------------------------
    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(pool, c, min(c.size, size)):
            return None
        while c.size < size:  # c is free and followed by unmapped space: map more, merging into it
            nxt = c.next
            if not self._map_block(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.remove(c)
        return c

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """The lowest address where free and unmapped blocks together hold ``size``."""
        for addr in sorted(pool.unmapped):
            c = pool.unmapped[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room, b = room + b.size, b.next
            if room >= size:
                return c
        page = SMALL_BUFFER if pool.small else self.config.large_segment_size
        base = self._take_addresses(EXPANDABLE_ADDRESS_SPACE)
        c = _Block(base, EXPANDABLE_ADDRESS_SPACE, pool.small, _Segment(base, page), mapped=False, stream=pool.stream)
        pool.unmapped[base] = c
        self.segments += 1
        return c

    def _map_block(self, pool: _Pool, b: _Block, size: int) -> bool:
        """Map whole pages over the start of unmapped ``b``; they merge with free neighbours."""
        page, address = b.es.page, b.addr
        mapped = round_up(size, page)  # b starts on a page boundary
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False
        del pool.unmapped[b.addr]
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.addr + mapped, b.size - mapped, b.small, b.es, mapped=False, stream=b.stream)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = mapped
            pool.unmapped[rest.addr] = rest
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        self._grow(mapped)
        if self.on_reserve is not None:
            self.on_reserve(address, mapped, b.small, True)
        return True

    def _unmap_block(self, pool: _Pool, b: _Block):
        """Unmap the whole pages inside free block ``b``; partial pages stay mapped and free."""
        es = b.es
        begin = es.base + round_up(b.addr - es.base, es.page)
        end = es.base + (b.addr + b.size - es.base) // es.page * es.page
        if begin >= end:
            return
        self.released = True
        pool.remove(b)
        if begin > b.addr:
            before = _Block(b.addr, begin - b.addr, b.small, es, stream=b.stream)
            before.prev, before.next = b.prev, b
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            pool.insert(before)
        if b.addr + b.size > end:
            after = _Block(end, b.addr + b.size - end, b.small, es, stream=b.stream)
            after.prev, after.next = b, b.next
            if b.next is not None:
                b.next.prev = after
            b.next = after
            pool.insert(after)
        b.addr, b.size, b.mapped = begin, end - begin, False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.unmapped[b.addr] = b
        self.reserved -= end - begin

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool):
        """``try_merge_blocks``: absorb free neighbour ``src`` (same mapped state) into ``dst``."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[src.addr]
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- giving memory back (only on the way to an OOM) ------------------------------------------
    def _release_block(self, pool: _Pool, b: _Block):
        self.released = True
        pool.remove(b)
        self.reserved -= b.size
        self.segments -= 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Free cached oversize segments (>= max_split_size) until ``size`` would fit."""
        if self.config.max_split_size is None or self.capacity is None:
            return False
        target = max(size, self.config.max_split_size)
        keys = pool.keys
        i = bisect.bisect_left(keys, (target, -1))
        if i < len(keys) and pool.free[keys[i][1]].es is None:
            self._release_block(pool, pool.free[keys[i][1]])
            return True
        released = 0
        for size_, addr in reversed(keys[:i]):  # from the largest down
            if released >= target or size_ < self.config.max_split_size:
                break
            b = pool.free[addr]
            if b.es is None and b.prev is None and b.next is None:
                self._release_block(pool, b)
                released += size_
        return released >= target

    def _release_cached_blocks(self):
        """``release_cached_blocks``: free unsplit segments, unmap free pages of expandable ones."""
        for pool in sorted(self.pools.values(), key=lambda p: p.small):  # the large pool, then the small
            to_unmap = []
            for _, addr in list(pool.keys):
                b = pool.free[addr]
                if b.es is not None:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(pool, b)
            for b in to_unmap:
                self._unmap_block(pool, b)
                if not b.mapped and b.prev is None and b.next is None:  # the whole segment is unmapped
                    del pool.unmapped[b.addr]
                    self.segments -= 1


def _expandable_size(b: _Block) -> int:
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


MAX_REPEATS = 32  # extra replays of the training step looked at for a steady layout


def simulate(events, config: AllocatorConfig | None = None, *, capacity: int | None = None,
             repeat: tuple[int, int] | None = None) -> AllocatorStats:
    """Replay a ``TraceLog.events`` list through the caching allocator.

    Args:
        events: ``memcheck.enums.Event``s (or tuples of their first fields, ``(kind, sid,
            nbytes)`` at least) with kind ALLOC, FREE or RECAT; a storage id may be reused after
            its FREE; ``stream`` is the stream an ALLOC is made on (default 0).
        config: allocator settings; None means torch's defaults (use
            ``AllocatorConfig.from_env()`` to honour ``PYTORCH_CUDA_ALLOC_CONF``).
        capacity: device memory in bytes; see ``CachingAllocator``.
        repeat: ``(start, end)``: ``events[start:end]`` is one training step. After the
            log's pass up to ``end``, that step is replayed again, as a long run would,
            until the layout of segments and blocks at the step's end is the one the step
            before left (a fixed point: every later step replays the same), and only then
            ``events[end:]`` (an evaluation pass). A tensor freed in the step but made
            before it (made in the step before and kept) is matched, by size and order, to
            the tensors the step makes and keeps; when they do not match, the step is not
            repeated and ``steady_repeats`` is None.

    Returns:
        AllocatorStats with the peaks over the whole replay and, per event of the log's
        own pass, the granted block size.

    Example:
        >>> from memcheck.enums import ALLOC
        >>> simulate([(ALLOC, 1, 3 << 19)]).granted  # 1.5 MiB, split off a 20 MiB segment
        (1572864,)

    Known limitations:
        One device. Streams keep their blocks apart, but a block freed while another
        stream still uses it (``record_stream``) is freed at once, not when that stream's
        work is done; and memcheck's traces put every allocation on stream 0. No CUDA
        graphs or private memory pools, no ``empty_cache()`` calls and no
        ``garbage_collection_threshold`` / memory-fraction GC. A zero-byte request takes
        no block (``NativeCachingAllocator::allocate`` calls ``malloc`` only for a nonzero
        size). Ties between equal-size
        cached blocks go to the lower simulated address, and new segments get ever higher
        addresses, which real ``cudaMalloc`` does not promise.
    """
    events = as_events(events)
    run = _Run(CachingAllocator(config, capacity=capacity))
    end = len(events) if repeat is None else repeat[1]
    before = None
    for n in range(end):
        if repeat is not None and n == repeat[0]:
            before = run.alloc.layout()
        run.replay(n, events[n], events[n].sid)
    steady = None
    if repeat is not None:
        kept = carried(events, *repeat)  # None: the step keeps what no later step frees, no steady state
        if kept is not None:
            # 0: the log's last step already left the layout the step before it left
            steady = 0 if run.alloc.layout() == before else run.repeat(events, *repeat, kept)
    for n in range(end, len(events)):
        run.replay(n, events[n], events[n].sid)
    a = run.alloc
    return AllocatorStats(run.peak_alloc, a.peak_reserved, run.frag, run.segs, tuple(run.granted), run.first_oom,
                          run.peak_event, run.peak_repeat, steady, a.released)


def as_events(events) -> list[Event]:
    """``events`` as ``Event``s: the list itself when its first already is one (a trace's log)."""
    if not events or isinstance(events[0], Event):
        return events
    return [Event(*ev) for ev in events]


def carried(events: list[Event], start: int, end: int) -> dict[int, int] | None:
    """For the step ``events[start:end]``: which tensor the next step's FREE at position ``n``
    frees, as the position of the ALLOC in this step that made it.

    A step may free tensors made before it (a gradient kept from the previous step) and
    keep tensors it made; replayed again, each such FREE frees what the previous replay
    kept. They are matched by size, in order. None when they do not match (the step keeps
    more than the next one frees, or of other sizes): its replays would grow without end.
    """
    made, outside = {}, []
    for n in range(start, end):
        ev = events[n]
        if ev.kind == ALLOC:
            made[ev.sid] = n
        elif ev.kind == FREE:
            if ev.sid in made:
                del made[ev.sid]
            else:
                outside.append(n)
    pool = sorted(made.values())
    kept = {}
    for n in outside:
        match = next((m for m in pool if events[m].nbytes == events[n].nbytes), None)
        if match is None:
            return None
        pool.remove(match)
        kept[n] = match
    return None if pool else kept


def growing_run(events: list[Event], start: int, end: int, sizes_at, lengths: list[int]) -> tuple[list, int]:
    """The event log of a run whose batches grow: ``events[:start]`` (the setup and first
    step) at ``lengths[0]``, then the step ``events[start:end]`` once at each later length.

    ``sizes_at(length)`` gives every event's size in ``events[:end]`` at that length (the
    events are those of one trace; only the sizes change with the length). Each replayed
    step's own tensors get keys of their own, and a FREE of a tensor made before the step
    frees what the step before kept (``carried``). Returns the log and where its last step
    starts; its steps are numbered in ``step`` (0: the setup and first step).
    """
    events = as_events(events)
    kept = carried(events, start, end)
    if kept is None:
        raise ValueError("the step keeps tensors the next step does not free; it cannot be replayed")
    sizes = sizes_at(lengths[0])
    out = [ev._replace(nbytes=sizes[n]) for n, ev in enumerate(events[:start])]
    last = start
    for r, length in enumerate(lengths[1:], 1):
        sizes, last = sizes_at(length), len(out)
        out += [ev._replace(sid=key, nbytes=sizes[n], step=r)  # made before the first step: as traced
                for n, ev, key in replay_keys(events, start, end, r, kept, lambda n: events[n].sid)]
    return out, last


def replay_keys(events: list[Event], start: int, end: int, r: int, kept: dict[int, int], first_outside):
    """``(n, event, key)`` for replay ``r`` (from 1) of the step ``events[start:end]``: the
    step's own tensors are keyed ``("step", r, n)``; a FREE of a tensor made before the step
    frees what replay ``r - 1`` kept (``kept``, from ``carried``), or, in replay 1, the tensor
    ``first_outside(n)`` names."""
    keys = {}
    for n in range(start, end):
        ev = events[n]
        key = ev.sid
        if ev.kind == ALLOC:
            key = keys[ev.sid] = ("step", r, n)
        elif ev.kind == FREE:
            key = keys.pop(ev.sid, None)
            if key is None:
                key = ("step", r - 1, kept[n]) if r > 1 else first_outside(n)
        yield n, ev, key


class _Run:
    """The replay's bookkeeping: peaks, the first OOM, where ``reserved`` peaked."""

    def __init__(self, alloc: CachingAllocator):
        self.alloc = alloc
        self.granted: list[int] = []
        self.peak_alloc = self.frag = self.segs = self.seen_reserved = 0
        self.first_oom = self.peak_event = None
        self.peak_repeat = 0
        self.repeat_no = 0  # 0 in the log's own pass, r in the r-th extra replay of the step
        self.empty: set = set()  # zero-byte storages: torch's allocate() hands out a null pointer, no block

    def replay(self, n: int, ev: Event, key) -> None:
        kind, first = ev.kind, self.repeat_no == 0
        got = 0
        if kind == ALLOC and ev.nbytes == 0:
            self.empty.add(key)
        elif kind == FREE and key in self.empty:
            self.empty.discard(key)
        elif kind == ALLOC:
            got = self.alloc.malloc(key, ev.nbytes, ev.stream)
            if not got and self.first_oom is None:
                self.first_oom = n
            self.peak_alloc = max(self.peak_alloc, self.alloc.allocated)
            if self.alloc.reserved > self.seen_reserved:
                self.seen_reserved, self.frag = self.alloc.reserved, self.alloc.reserved - self.alloc.allocated
                self.segs, self.peak_event, self.peak_repeat = self.alloc.segments, n, self.repeat_no
        elif kind == FREE:
            self.alloc.free(key)
        if first:
            self.granted.append(got)

    def repeat(self, events, start: int, end: int, kept: dict[int, int]) -> int | None:
        """Replay ``events[start:end]`` until the layout repeats; how many replays that took.
        ``kept`` is ``carried(events, start, end)``: in replay 1, a FREE of a tensor made before
        the step frees what the log's own pass of the step kept."""
        before = self.alloc.layout()
        for r in range(1, MAX_REPEATS + 1):
            self.repeat_no = r
            for n, ev, key in replay_keys(events, start, end, r, kept, lambda n: events[kept[n]].sid):
                self.replay(n, ev, key)
            after = self.alloc.layout()
            if after == before:  # replay r left the layout the pass before it left
                self.repeat_no = 0
                return r
            before = after
        self.repeat_no = 0
        return None
