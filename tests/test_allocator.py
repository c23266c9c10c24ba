"""The caching-allocator simulation on sequences whose totals are worked out by hand.

The rules are those of c10/cuda/CUDACachingAllocator.cpp. A GPU comparison is issue 3's
benchmark; these tests run without a GPU.
"""

import pytest

from memcheck.allocator import CachingAllocator, max_split_size_from_env, round_size, segment_size, simulate
from memcheck.errors import UsageError
from memcheck.tracer import ALLOC, FREE

MiB = 2**20


def ev(kind, sid, n=0):
    return (kind, sid, n)


def test_requests_round_up_to_512_bytes():
    assert round_size(1) == 512
    assert round_size(513) == 1024
    assert round_size(4096) == 4096


def test_segment_sizes_follow_the_pools():
    assert segment_size(512) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB  # 1 MiB is still small
    assert segment_size(1 * MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB on: rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_one_2_mib_segment():
    # 1000 requests of 1000 B -> 1024 B each = 1,024,000 B, all inside one 2 MiB segment.
    stats = simulate([ev(ALLOC, i, 1000) for i in range(1000)])
    assert stats.peak_allocated_bytes == 1000 * 1024
    assert stats.peak_reserved_bytes == 2 * MiB


def test_a_third_1_5_mib_request_reuses_the_20_mib_segment():
    # 3 * 1.5 MiB = 4.5 MiB allocated, carved from one 20 MiB segment (remainders > 1 MiB split).
    stats = simulate([ev(ALLOC, i, 3 * MiB // 2) for i in range(3)])
    assert stats.peak_allocated_bytes == 3 * (3 * MiB // 2)
    assert stats.peak_reserved_bytes == 20 * MiB


def test_freed_blocks_are_cached_and_reused():
    # 100 MiB, freed, then 100 MiB again: the cached segment is reused; reserved stays 100 MiB.
    stats = simulate([ev(ALLOC, 1, 100 * MiB), ev(FREE, 1), ev(ALLOC, 2, 100 * MiB)])
    assert stats.peak_reserved_bytes == 100 * MiB


def test_fragmentation_when_a_larger_request_cannot_use_split_holes():
    # 50 MiB + 50 MiB, free the first, then 60 MiB: the 50 MiB hole does not fit,
    # so a new 60 MiB segment is made: reserved 160 MiB, allocated 110 MiB -> 50 MiB fragmentation.
    stats = simulate([ev(ALLOC, 1, 50 * MiB), ev(ALLOC, 2, 50 * MiB), ev(FREE, 1), ev(ALLOC, 3, 60 * MiB)])
    assert stats.peak_reserved_bytes == 160 * MiB
    assert stats.fragmentation_bytes == 50 * MiB


def test_neighbouring_free_blocks_merge():
    # 4 MiB (< 10 MiB) gets a 20 MiB segment, split into 4 + 16; the second 4 MiB splits
    # the 16 into 4 + 12. Freeing both merges 4 + 4 + 12 back into one free 20 MiB block,
    # which an 18 MiB request then reuses: reserved stays 20 MiB (without merging it
    # would need a new 18 MiB segment: 38 MiB).
    stats = simulate([ev(ALLOC, 1, 4 * MiB), ev(ALLOC, 2, 4 * MiB), ev(FREE, 1), ev(FREE, 2), ev(ALLOC, 3, 18 * MiB)])
    assert stats.peak_reserved_bytes == 20 * MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    # With max_split_size 40 MiB, a cached 100 MiB block is not split for a 30 MiB request:
    # a new 30 MiB segment is made -> 130 MiB reserved. Without the limit it would be reused.
    seq = [ev(ALLOC, 1, 100 * MiB), ev(FREE, 1), ev(ALLOC, 2, 30 * MiB)]
    assert simulate(seq, max_split_size=40 * MiB).peak_reserved_bytes == 130 * MiB
    assert simulate(seq).peak_reserved_bytes == 100 * MiB


def test_capacity_releases_the_cache_before_giving_up():
    # Capacity 150 MiB. 100 MiB is allocated and freed (its segment stays cached). 120 MiB
    # does not fit in it, and a new 120 MiB segment would make 220 MiB > 150 MiB, so the
    # allocator releases the unused 100 MiB segment first: reserved = 120 MiB.
    alloc = CachingAllocator(capacity=150 * MiB)
    assert alloc.malloc(1, 100 * MiB)
    alloc.free(1)
    assert alloc.malloc(2, 120 * MiB)
    assert alloc.reserved == 120 * MiB
    assert not alloc.malloc(3, 40 * MiB)  # 120 + 40 > 150 and nothing cached: an OOM


def test_alloc_conf_parsing():
    assert max_split_size_from_env("max_split_size_mb:128") == 128 * MiB
    assert max_split_size_from_env("expandable_segments:False") is None
    with pytest.raises(UsageError, match="must be > 20"):
        max_split_size_from_env("max_split_size_mb:8")
