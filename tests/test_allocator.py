"""The caching-allocator simulation on sequences whose totals are worked out by hand.

The rules are those of c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.cpp.
These tests run without a GPU; tests/test_allocator_gpu.py checks the same simulation
against a real GPU. The config parser is also checked against torch's own parser,
which the CPU wheel ships.
"""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcheck.cuda.allocator import (
    AllocatorConfig,
    CachingAllocator,
    max_split_size_from_env,
    round_size,
    segment_size,
    simulate,
)
from memcheck.errors import UsageError
from memcheck.trace.tracer import ALLOC, FREE, RECAT

KiB, MiB, GiB = 2**10, 2**20, 2**30


def ev(kind, sid, n=0):
    return (kind, sid, n)


# -- rounding and segment sizes ---------------------------------------------------------------


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
    assert segment_size(5 * MiB, AllocatorConfig(large_segment_size=32 * MiB)) == 32 * MiB  # large_segment_size_mb:32


def test_roundup_power2_divisions_rounds_to_a_division_of_the_power_of_two_interval():
    four = AllocatorConfig(roundup_power2_divisions=4)
    # 5 MiB + 1 B lies in [4, 8) MiB; 4 divisions are 1 MiB apart (4, 5, 6, 7 MiB): next is 6 MiB.
    assert round_size(5 * MiB + 1, four) == 6 * MiB
    assert round_size(4 * MiB, four) == 4 * MiB  # a power of two is left as it is
    # 1200 B is not above 512 B * 4 = 2048 B, so plain 512 B rounding: 1536 B.
    assert round_size(1200, four) == 1536
    # 3000 B in [2048, 4096): divisions 512 B apart -> 3072 B (here the same as plain rounding).
    assert round_size(3000, four) == 3072
    # 600 KiB in [512, 1024) KiB (sizes under 2 MiB use the first entry): 8 divisions are 64 KiB
    # apart, 600 / 64 = 9.375 -> 10 * 64 KiB = 640 KiB. Plain rounding would keep 600 KiB.
    assert round_size(600 * KiB, AllocatorConfig(roundup_power2_divisions=8)) == 640 * KiB
    assert round_size(600 * KiB) == 600 * KiB
    # 1 division means no power-of-two rounding at all ("divisions > 1" in get_round_size).
    assert round_size(5 * MiB + 1, AllocatorConfig(roundup_power2_divisions=1)) == 5 * MiB + 512


def test_roundup_power2_divisions_per_interval_list():
    # [256:1,512:2,>:8]: [256, 512) MiB and (first entry) everything smaller: 1; [512 MiB, 1 GiB): 2;
    # from 1 GiB: 8.
    cfg = AllocatorConfig.from_env("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6
    assert round_size(10 * MiB + 1, cfg) == 10 * MiB + 512  # 1 division: plain rounding
    assert round_size(300 * MiB + 1, cfg) == 300 * MiB + 512
    # 600 MiB in [512, 1024) MiB with 2 divisions (512, 768): 768 MiB.
    assert round_size(600 * MiB, cfg) == 768 * MiB
    # 1100 MiB in [1024, 2048) MiB with 8 divisions, 128 MiB apart: 9 * 128 = 1152 MiB.
    assert round_size(1100 * MiB, cfg) == 1152 * MiB
    # A leading ">" fills from the second interval on, as the real parser does: [1, 2) MiB keeps 0.
    quirk = AllocatorConfig.from_env("roundup_power2_divisions:[>:4]")
    assert quirk.roundup_power2_divisions == (0,) + (4,) * 15
    assert round_size(1 * MiB + 1, quirk) == 1 * MiB + 512
    # 3 MiB + 1 B in [2, 4) MiB with 4 divisions, 512 KiB apart: 3.5 MiB.
    assert round_size(3 * MiB + 1, quirk) == 3 * MiB + 512 * KiB


def test_roundup_power2_divisions_change_what_is_granted_and_reserved():
    # Two requests of 5 MiB + 1 B with 4 divisions are 6 MiB each. The first gets a 20 MiB
    # segment split 6 + 14; the second splits the 14 into 6 + 8: allocated 12 MiB, reserved 20 MiB.
    seq = [ev(ALLOC, 1, 5 * MiB + 1), ev(ALLOC, 2, 5 * MiB + 1)]
    stats = simulate(seq, AllocatorConfig(roundup_power2_divisions=4))
    assert stats.granted == (6 * MiB, 6 * MiB)
    assert stats.peak_allocated_bytes == 12 * MiB
    assert stats.peak_reserved_bytes == 20 * MiB
    # Plain rounding: (5 MiB + 512 B) * 2 allocated.
    assert simulate(seq).peak_allocated_bytes == 2 * (5 * MiB + 512)


# -- the default allocator ---------------------------------------------------------------------


def test_small_requests_share_one_2_mib_segment():
    # 1000 requests of 1000 B -> 1024 B each = 1,024,000 B, all inside one 2 MiB segment.
    stats = simulate([ev(ALLOC, i, 1000) for i in range(1000)])
    assert stats.peak_allocated_bytes == 1000 * 1024
    assert stats.peak_reserved_bytes == 2 * MiB
    assert stats.segments_at_peak == 1


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
    assert stats.segments_at_peak == 3


def test_neighbouring_free_blocks_merge():
    # 4 MiB (< 10 MiB) gets a 20 MiB segment, split into 4 + 16; the second 4 MiB splits
    # the 16 into 4 + 12. Freeing both merges 4 + 4 + 12 back into one free 20 MiB block,
    # which an 18 MiB request then reuses: reserved stays 20 MiB (without merging it
    # would need a new 18 MiB segment: 38 MiB).
    stats = simulate([ev(ALLOC, 1, 4 * MiB), ev(ALLOC, 2, 4 * MiB), ev(FREE, 1), ev(FREE, 2), ev(ALLOC, 3, 18 * MiB)])
    assert stats.peak_reserved_bytes == 20 * MiB


def test_granted_is_the_block_handed_out_including_an_unsplit_leftover():
    # 1.5 MiB: a fresh 20 MiB segment, 18.5 MiB left > 1 MiB is split off: granted 1.5 MiB.
    assert simulate([ev(ALLOC, 1, 3 * MiB // 2)]).granted == (3 * MiB // 2,)
    # 10.5 MiB: a fresh 12 MiB segment (2 MiB rounding), 1.5 MiB left > 1 MiB: granted 10.5 MiB.
    assert simulate([ev(ALLOC, 1, 21 * MiB // 2)]).granted == (21 * MiB // 2,)
    # 11 MiB: a fresh 12 MiB segment, 1 MiB left is not > 1 MiB: the whole 12 MiB is granted.
    assert simulate([ev(ALLOC, 1, 11 * MiB)]).granted == (12 * MiB,)
    seq = [
        ev(ALLOC, 1, 19 * MiB // 2),  # 9.5 MiB: fresh 20 MiB segment, split 9.5 + 10.5 free
        ev(ALLOC, 2, 10 * MiB),  # takes the 10.5 MiB block; 0.5 MiB left is not split off: 10.5 MiB
        ev(RECAT, 2),  # not an allocation: 0
        ev(FREE, 1),  # 0
        ev(ALLOC, 3, 1000),  # small pool: 1024 B of a fresh 2 MiB segment
    ]
    stats = simulate(seq)
    assert stats.granted == (19 * MiB // 2, 21 * MiB // 2, 0, 0, 1024)
    assert stats.peak_allocated_bytes == 20 * MiB  # 9.5 + 10.5
    assert stats.peak_reserved_bytes == 22 * MiB  # 20 + 2
    assert stats.fragmentation_bytes == 22 * MiB - (21 * MiB // 2 + 1024)  # at the peak, 1 had been freed


def test_a_zero_byte_storage_takes_no_block():
    # NativeCachingAllocator::allocate calls malloc only when size != 0 (a null data pointer
    # otherwise), so an empty tensor costs nothing: only the 512 B request opens a segment.
    stats = simulate([ev(ALLOC, 1, 0), ev(ALLOC, 2, 100), ev(FREE, 1), ev(FREE, 2)])
    assert stats.granted == (0, 512, 0, 0)
    assert stats.peak_allocated_bytes == 512
    assert stats.peak_reserved_bytes == 2 * MiB  # one small-pool segment


def test_storage_ids_may_be_reused_after_their_free():
    # sid 7 is allocated, freed and allocated again; each ALLOC has its own granted entry.
    stats = simulate([ev(ALLOC, 7, 4 * MiB), ev(FREE, 7), ev(ALLOC, 7, 2 * MiB), ev(FREE, 7), ev(FREE, 7)])
    assert stats.granted == (4 * MiB, 0, 2 * MiB, 0, 0)
    assert stats.peak_reserved_bytes == 20 * MiB


# -- max_split_size ---------------------------------------------------------------------------


def test_max_split_size_keeps_oversize_blocks_whole():
    # With max_split_size 40 MiB, a cached 100 MiB block is not split for a 30 MiB request:
    # a new 30 MiB segment is made -> 130 MiB reserved. Without the limit it would be reused.
    seq = [ev(ALLOC, 1, 100 * MiB), ev(FREE, 1), ev(ALLOC, 2, 30 * MiB)]
    assert simulate(seq, AllocatorConfig(max_split_size=40 * MiB)).peak_reserved_bytes == 130 * MiB
    assert simulate(seq).peak_reserved_bytes == 100 * MiB


def test_oversize_requests_take_a_cached_block_up_to_max_non_split_rounding_bigger():
    cfg = AllocatorConfig(max_split_size=40 * MiB)  # max_non_split_rounding: 20 MiB by default
    # 85 MiB >= max_split: the cached 100 MiB block is < 85 + 20 = 105 MiB, so it is handed out
    # whole (oversize blocks never split): granted 100 MiB, reserved stays 100 MiB.
    reuse = simulate([ev(ALLOC, 1, 100 * MiB), ev(FREE, 1), ev(ALLOC, 2, 85 * MiB)], cfg)
    assert reuse.granted[2] == 100 * MiB
    assert reuse.peak_reserved_bytes == 100 * MiB
    # 75 MiB: 100 >= 75 + 20, so a new segment of 76 MiB (2 MiB rounding) is made, and its
    # 1 MiB leftover is not split off: granted 76 MiB, reserved 176 MiB.
    fresh = simulate([ev(ALLOC, 1, 100 * MiB), ev(FREE, 1), ev(ALLOC, 2, 75 * MiB)], cfg)
    assert fresh.granted[2] == 76 * MiB
    assert fresh.peak_reserved_bytes == 176 * MiB
    # max_non_split_rounding_mb:30 lets the 75 MiB request have the 100 MiB block (100 < 105).
    wide = AllocatorConfig(max_split_size=40 * MiB, max_non_split_rounding_size=30 * MiB)
    assert simulate([ev(ALLOC, 1, 100 * MiB), ev(FREE, 1), ev(ALLOC, 2, 75 * MiB)], wide).granted[2] == 100 * MiB


# -- capacity ----------------------------------------------------------------------------------


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


def test_simulate_reports_the_first_allocation_that_does_not_fit():
    # Capacity 100 MiB: 60 MiB fits, a second 60 MiB (120 > 100, nothing cached) does not.
    stats = simulate([ev(ALLOC, 1, 60 * MiB), ev(ALLOC, 2, 60 * MiB), ev(ALLOC, 3, 30 * MiB)], capacity=100 * MiB)
    assert stats.first_oom == 1
    assert stats.granted == (60 * MiB, 0, 30 * MiB)
    assert stats.peak_reserved_bytes == 90 * MiB


def test_max_split_size_releases_oversize_segments_first_near_capacity():
    # Capacity 200 MiB, max_split 40 MiB. A 100 MiB segment is cached, a 50 MiB one is live.
    # A 60 MiB request: the 100 MiB block is oversize (>= 60 + 20), a new 60 MiB segment would
    # make 210 MiB > 200, so release_available_cached_blocks frees the 100 MiB segment: 110 MiB.
    alloc = CachingAllocator(AllocatorConfig(max_split_size=40 * MiB), capacity=200 * MiB)
    alloc.malloc(1, 100 * MiB)
    alloc.malloc(2, 50 * MiB)
    alloc.free(1)
    assert alloc.malloc(3, 60 * MiB) == 60 * MiB
    assert alloc.reserved == 110 * MiB


# -- expandable segments ---------------------------------------------------------------------


def test_expandable_segments_grow_by_20_mib_pages_and_split_any_remainder():
    # 3 x 15 MiB. Expandable: one segment growing in 20 MiB pages. The first maps a page and
    # splits 15 + 5 free; the second uses the 5 free + maps a page (40 MiB), leaving 10 free;
    # the third uses the 10 free + maps a page (60 MiB), leaving 15 free. Remainders are split
    # off, so each grant is exactly 15 MiB: allocated 45 MiB, reserved 60 MiB, 1 segment.
    seq = [ev(ALLOC, i, 15 * MiB) for i in range(3)]
    exp = simulate(seq, AllocatorConfig(expandable_segments=True))
    assert exp.granted == (15 * MiB,) * 3
    assert exp.peak_allocated_bytes == 45 * MiB
    assert exp.peak_reserved_bytes == 60 * MiB
    assert exp.segments_at_peak == 1
    # Without: three 16 MiB segments (15 MiB rounded to 2 MiB); the 1 MiB leftovers are not
    # split off, so each grant is 16 MiB: allocated = reserved = 48 MiB, 3 segments.
    plain = simulate(seq)
    assert plain.granted == (16 * MiB,) * 3
    assert plain.peak_reserved_bytes == plain.peak_allocated_bytes == 48 * MiB
    assert plain.segments_at_peak == 3


def test_expandable_segments_reuse_freed_memory_for_a_bigger_request():
    # 30 MiB maps two 20 MiB pages (40 MiB): 30 used + 10 free. Freed, it merges into one
    # 40 MiB free block, which a 40 MiB request takes whole: reserved stays 40 MiB.
    # Without expandable segments the 30 MiB segment cannot hold 40 MiB: 30 + 40 = 70 MiB.
    seq = [ev(ALLOC, 1, 30 * MiB), ev(FREE, 1), ev(ALLOC, 2, 40 * MiB)]
    assert simulate(seq, AllocatorConfig(expandable_segments=True)).peak_reserved_bytes == 40 * MiB
    assert simulate(seq).peak_reserved_bytes == 70 * MiB


def test_expandable_small_pool_maps_2_mib_pages_in_one_segment():
    # 3 x 700 KiB: a 2 MiB page holds two (1400 KiB) with 648 KiB free; the third uses those
    # 648 KiB plus a second page: 4 MiB reserved, as with two 2 MiB segments, but in 1 segment.
    seq = [ev(ALLOC, i, 700 * KiB) for i in range(3)]
    exp = simulate(seq, AllocatorConfig(expandable_segments=True))
    assert exp.peak_reserved_bytes == 4 * MiB
    assert exp.segments_at_peak == 1
    assert simulate(seq).segments_at_peak == 2


def test_expandable_pages_are_unmapped_only_to_avoid_an_oom():
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True), capacity=80 * MiB)
    alloc.malloc("A", 30 * MiB)  # maps [0, 40): A = [0, 30), free [30, 40)
    alloc.malloc("B", 15 * MiB)  # free 10 + one more page [40, 60): B = [30, 45), free [45, 60)
    alloc.free("A")  # [0, 30) free, still mapped: reserved 60 MiB
    assert alloc.reserved == 60 * MiB
    # C = 40 MiB: free [45, 60) + 25 MiB more = 2 pages -> 100 MiB > 80. The retry path unmaps
    # the whole pages inside free blocks: [0, 20) goes, [20, 30) stays mapped (its page also
    # holds B), and so does [45, 60): reserved 40 MiB. Then 2 more pages fit: 80 MiB, C = [45, 85).
    assert alloc.malloc("C", 40 * MiB) == 40 * MiB
    assert alloc.reserved == 80 * MiB
    assert alloc.peak_reserved == 80 * MiB
    _check_invariants(alloc)


# -- the config --------------------------------------------------------------------------------


def test_alloc_conf_parsing():
    cfg = AllocatorConfig.from_env(
        "max_split_size_mb:128, expandable_segments:True,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:4,release_lock_on_cudamalloc:True"
    )
    assert cfg.max_split_size == 128 * MiB
    assert cfg.expandable_segments is True
    assert cfg.garbage_collection_threshold == 0.6
    assert cfg.roundup_power2_divisions == (4,) * 16
    assert cfg.ignored_keys == ("release_lock_on_cudamalloc",)
    assert AllocatorConfig.from_env("") == AllocatorConfig()
    assert max_split_size_from_env("max_split_size_mb:128") == 128 * MiB
    assert max_split_size_from_env("expandable_segments:False") is None
    # large_segment_size_mb is read first, and raises the floor of max_split_size_mb.
    big = AllocatorConfig.from_env("max_split_size_mb:64,large_segment_size_mb:32")
    assert big.large_segment_size == 32 * MiB and big.max_split_size == 64 * MiB
    assert big.max_non_split_rounding_size == 32 * MiB  # defaults to large_segment_size


@pytest.mark.parametrize(
    "conf, message",
    [
        ("max_split_size_mb:8", r"max_split_size_mb: '8' is too small: must be >= 20"),
        ("max_split_size_mb:abc", r"max_split_size_mb: 'abc' is not a non-negative integer"),
        ("max_split_size_mb", r"max_split_size_mb: '' is missing a value"),
        ("large_segment_size_mb:40,max_split_size_mb:30", r"max_split_size_mb: '30' is too small: must be >= 40"),
        ("roundup_power2_divisions:3", r"roundup_power2_divisions: '3' must be a power of 2"),
        ("roundup_power2_divisions:[256:3]", r"roundup_power2_divisions: '256:3' needs a division"),
        ("roundup_power2_divisions:[100:4]", r"roundup_power2_divisions: '100:4' needs a size"),
        ("roundup_power2_divisions:[256:1", r"roundup_power2_divisions: '\[' has no closing"),
        ("expandable_segments:true", r"expandable_segments: 'true' must be True or False"),
        ("garbage_collection_threshold:1.5", r"garbage_collection_threshold: '1.5' must be in \(0.0, 1.0\)"),
        ("garbage_collection_threshold:x", r"garbage_collection_threshold: 'x' is not a number"),
        ("backend:magic", r"backend: 'magic' is not one of native"),
        ("max_split_size:64", r"'max_split_size' is not an allocator option \(did you mean 'max_split_size_mb'\?\)"),
        ("expandable_segments=True", r"is not an allocator option"),
        ("max_split_size_mb:64 expandable_segments:True", r"is not a non-negative integer"),
    ],
)
def test_bad_alloc_conf_values_name_the_key_and_the_value(conf, message):
    with pytest.raises(UsageError, match=message):
        AllocatorConfig.from_env(conf)


def test_config_checks_itself_when_built_directly():
    with pytest.raises(UsageError, match="max_split_size"):
        AllocatorConfig(max_split_size=10 * MiB)  # below large_segment_size (20 MiB)
    with pytest.raises(UsageError, match="roundup_power2_divisions"):
        AllocatorConfig(roundup_power2_divisions=3)
    with pytest.raises(UsageError, match="roundup_power2_divisions"):
        AllocatorConfig(roundup_power2_divisions=(4, 4))
    with pytest.raises(UsageError, match="garbage_collection_threshold"):
        AllocatorConfig(garbage_collection_threshold=1.0)
    with pytest.raises(UsageError, match="not simulated"):
        simulate([], AllocatorConfig(backend="cudaMallocAsync"))


def test_from_env_reads_the_variables_in_torch_2_13_order(monkeypatch):
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert AllocatorConfig.from_env() == AllocatorConfig()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert AllocatorConfig.from_env().expandable_segments
    # torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF first; the first variable set wins.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert AllocatorConfig.from_env() == AllocatorConfig(max_split_size=64 * MiB)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1")
    with pytest.raises(UsageError, match="PYTORCH_CUDA_ALLOC_CONF max_split_size_mb: '1'"):
        AllocatorConfig.from_env()


_ORACLE_CASES = [
    "",
    "max_split_size_mb:20",
    "max_split_size_mb:19",
    "max_split_size_mb:abc",
    "max_split_size_mb",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:0",
    "roundup_power2_divisions:3",
    "roundup_power2_divisions:[256:1,512:2,>:8]",
    "roundup_power2_divisions:[1:0,2:16]",
    "roundup_power2_divisions:[256:3]",
    "roundup_power2_divisions:[255:4]",
    "roundup_power2_divisions:[256:1",
    "expandable_segments:True,",
    "expandable_segments:true",
    "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:1.5",
    "large_segment_size_mb:10",
    "large_segment_size_mb:40,max_split_size_mb:30",
    "max_non_split_rounding_mb:19",
    " expandable_segments : True , max_split_size_mb : 512 ",
    "pinned_use_background_threads:yes",
]


def test_parser_accepts_and_rejects_what_torch_own_parser_does():
    """The oracle: ``torch._C._accelerator_setAllocatorSettings`` runs c10's parser on CPU."""
    import torch

    if not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        pytest.skip("this torch does not expose the allocator config parser")
    # One subprocess, since the parser's settings are process-global; large_segment_size_mb
    # is not reset between calls, so each case starts from large_segment_size_mb:20.
    script = (
        "import json, sys, torch\n"
        "set_ = torch._C._accelerator_setAllocatorSettings\n"
        "ok = []\n"
        "for conf in json.load(sys.stdin):\n"
        "    set_('large_segment_size_mb:20')\n"
        "    try:\n"
        "        set_(conf); ok.append(True)\n"
        "    except Exception:\n"
        "        ok.append(False)\n"
        "print(json.dumps(ok))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(_ORACLE_CASES), capture_output=True, text=True, check=True
    )
    torch_ok = json.loads(out.stdout.strip().splitlines()[-1])
    ours = []
    for conf in _ORACLE_CASES:
        try:
            AllocatorConfig.from_env(conf)
            ours.append(True)
        except UsageError:
            ours.append(False)
    assert dict(zip(_ORACLE_CASES, ours)) == dict(zip(_ORACLE_CASES, torch_ok))


# -- invariants over random sequences ---------------------------------------------------------


def _check_invariants(alloc: CachingAllocator):
    """Blocks tile their segments, free neighbours are merged, and the counters add up."""
    blocks = set(alloc.live.values())
    for pool in alloc.pools.values():
        blocks |= set(pool.free.values()) | set(pool.unmapped.values())
        assert sorted((b.size, b.addr) for b in pool.free.values()) == pool.keys
    mapped = allocated = 0
    for head in (b for b in blocks if b.prev is None):
        b = head
        while b is not None:
            assert b in blocks
            if b.next is not None:
                assert b.next.prev is b and b.addr + b.size == b.next.addr
                assert b.allocated or b.next.allocated or b.mapped != b.next.mapped, "unmerged free neighbours"
            mapped += b.size if b.mapped else 0
            allocated += b.size if b.allocated else 0
            b = b.next
    assert mapped == alloc.reserved
    assert allocated == alloc.allocated


_sizes = st.one_of(
    st.integers(1, 1 * MiB), st.integers(1 * MiB + 1, 10 * MiB), st.integers(10 * MiB, 120 * MiB)
)
_ops = st.lists(st.tuples(st.booleans(), _sizes, st.integers(0, 1000)), min_size=1, max_size=120)
_configs = st.sampled_from(
    [
        AllocatorConfig(),
        AllocatorConfig(expandable_segments=True),
        AllocatorConfig(max_split_size=40 * MiB, roundup_power2_divisions=4),
        AllocatorConfig(expandable_segments=True, max_split_size=64 * MiB, roundup_power2_divisions=(8,) * 16),
    ]
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, config=_configs, capacity=st.sampled_from([None, 200 * MiB, 500 * MiB]))
def test_random_sequences_keep_the_allocator_consistent(ops, config, capacity):
    alloc = CachingAllocator(config, capacity=capacity)
    live, sid = [], 0
    for is_free, nbytes, pick in ops:
        if is_free and live:
            alloc.free(live.pop(pick % len(live)))
        else:
            sid += 1
            got = alloc.malloc(sid, nbytes)
            if got:
                assert got >= round_size(nbytes, config)
                live.append(sid)
            else:
                assert capacity is not None
        _check_invariants(alloc)
        assert alloc.reserved <= (capacity or alloc.reserved)
    for s in live:
        alloc.free(s)
    _check_invariants(alloc)
    assert alloc.allocated == 0


# -- the allocator over a process's life (issue 22) ----------------------------------------------
# A step that keeps one tensor (k, 2 MiB, made in the step before, freed and made again, as a
# gradient kept across steps would be) among three transients of 5, 12 and 12 MiB.
LIFE = [
    ev(ALLOC, "k", 2 * MiB),  # before the step: 2 MiB > 1 MiB, large pool, < 10 MiB: a 20 MiB segment A
    ev(ALLOC, "t0", 5 * MiB), ev(ALLOC, "t1", 12 * MiB), ev(FREE, "k", 2 * MiB), ev(ALLOC, "k", 2 * MiB),
    ev(ALLOC, "t2", 12 * MiB), ev(FREE, "t0", 5 * MiB), ev(FREE, "t2", 12 * MiB), ev(FREE, "t1", 12 * MiB),
]


def test_a_step_replayed_until_the_layout_repeats_finds_the_reserved_peak_of_a_long_run():
    # The log's own pass (step 1): k at A[0:2]; t0 splits A[2:7]; t1 12 MiB takes the 13 MiB rest
    # whole (a 1 MiB remainder is not split off in the large pool); k is freed and made again at
    # A[0:2]; t2 finds nothing free: new segment B of 12 MiB (>= 10 MiB: rounded to 2 MiB).
    # Reserved 20 + 12 = 32 MiB. At its end: k A[0:2], free A[2:20] (18), free B (12).
    one = simulate(LIFE)
    assert one.peak_reserved_bytes == 32 * MiB
    # Replay 1 (step 2): t0 5 MiB best-fits B (12 < 18): B[20:25]; t1 splits A[2:14]; k back at
    # A[0:2]; t2 12 MiB: free are A[14:20] (6) and B[25:32] (7): new segment C of 12 MiB: 44 MiB.
    # End: k, free A[2:20] (18), B (12), C (12).
    # Replay 2 (step 3): t0 takes B[20:25] (12-tie, lower address); t1 takes C whole; freeing k
    # merges A[0:20] free, so k's 2 MiB best-fits B's 7 MiB rest: B[25:27]; t2 splits A[0:12].
    # End: A free (20), B: free [20:25], k [25:27], free [27:32], C free (12).
    # Replay 3 (step 4): t0 takes B[20:25] exactly; t1 C; k freed (merges with [27:32]) and made
    # again at B[25:27]; t2 A[0:12]: the same layout as after replay 2. Settled after 3 replays.
    life = simulate(LIFE, repeat=(1, len(LIFE)))
    assert life.peak_reserved_bytes == 44 * MiB
    assert (life.reserved_peak_event, life.reserved_peak_repeat) == (5, 1)  # t2's request, in replay 1
    assert life.steady_repeats == 3
    assert life.granted == one.granted  # per-event grants are those of the log's own pass


def test_a_step_that_leaves_tensors_behind_is_not_repeated():
    # t0 is made in the step and never freed: each replay would add 5 MiB, so there is no steady state
    leak = [ev(ALLOC, "t0", 5 * MiB), ev(ALLOC, "t1", 12 * MiB), ev(FREE, "t1", 12 * MiB)]
    stats = simulate(leak, repeat=(0, len(leak)))
    assert stats.steady_repeats is None
    # the log's own pass only: t0 opens a 20 MiB segment A at [0:5]; t1 12 MiB splits the 15 MiB rest
    assert stats.peak_reserved_bytes == 20 * MiB


def test_a_step_whose_kept_tensor_changes_size_is_not_repeated():
    # the step frees a 2 MiB tensor made before it and keeps a 4 MiB one: they cannot be matched
    grow = [ev(ALLOC, "k", 2 * MiB), ev(FREE, "k", 2 * MiB), ev(ALLOC, "k", 4 * MiB)]
    assert simulate(grow, repeat=(1, len(grow))).steady_repeats is None


def test_near_capacity_cached_segments_are_released_and_the_request_retried():
    # A 12 MiB request gets its own 12 MiB segment; freed, it stays cached. A 16 MiB request
    # cannot use it: unbounded, a second segment makes 28 MiB reserved. With 20 MiB of room,
    # cudaMalloc of 16 MiB would exceed it, so release_cached_blocks frees the unsplit cached
    # 12 MiB segment and the retry succeeds: 16 MiB reserved, peak max(12, 16) = 16 MiB.
    seq = [ev(ALLOC, "x", 12 * MiB), ev(FREE, "x"), ev(ALLOC, "y", 16 * MiB), ev(FREE, "y")]
    free = simulate(seq)
    assert (free.peak_reserved_bytes, free.released) == (28 * MiB, False)
    tight = simulate(seq, capacity=20 * MiB)
    assert (tight.peak_reserved_bytes, tight.released, tight.first_oom) == (16 * MiB, True, None)
    # with 15 MiB of room even the retry fails: an out-of-memory at the 16 MiB request (event 2)
    assert simulate(seq, capacity=15 * MiB).first_oom == 2


def test_a_block_freed_on_one_stream_serves_only_that_stream():
    # CUDACachingAllocator.cpp get_free_block: the pools are ordered by (stream, size, address)
    # and a block found for another stream is refused, so each stream caches its own segments.
    # x, 8 MiB on stream 0: a 20 MiB segment (1-10 MiB requests), freed and cached.
    # y, 8 MiB on stream 0 again: reuses it, 20 MiB reserved.
    # y on stream 1 instead: cannot, a second 20 MiB segment: 40 MiB.
    def on(stream, sid):  # an ALLOC event with its stream in the ninth field
        return (ALLOC, sid, 8 * MiB, None, None, None, 0, 0, stream)

    same = [on(0, "x"), ev(FREE, "x"), on(0, "y")]
    other = [on(0, "x"), ev(FREE, "x"), on(1, "y")]
    assert simulate(same).peak_reserved_bytes == 20 * MiB
    assert simulate(other).peak_reserved_bytes == 40 * MiB
    # near capacity the retry gives back the other stream's cached segment too (all pools): 20 MiB
    assert simulate(other, capacity=30 * MiB).peak_reserved_bytes == 20 * MiB


def test_a_run_of_growing_lengths_strands_the_segments_of_the_shorter_steps():
    # One step, one transient whose size is 12 MiB a unit of length: 12, 24 and 36 MiB at lengths
    # 1, 2 and 3 (each >= 10 MiB: a segment of its own, rounded to 2 MiB). Growing 1 -> 2 -> 3,
    # each step finds only smaller cached segments: 12 + 24 + 36 = 72 MiB reserved; three steps
    # at length 3 reserve one 36 MiB segment. With 50 MiB of room the third step's cudaMalloc
    # fails, the unsplit cached 12 and 24 MiB segments go back, and the retry fits: 36 MiB.
    from memcheck.cuda.allocator import growing_run

    step = [ev(ALLOC, "a", 36 * MiB), ev(FREE, "a", 36 * MiB)]
    log = step + [ev(ALLOC, "b", 36 * MiB), ev(FREE, "b", 36 * MiB)]  # a traced log: step 1, then step 2 at [2:4]
    sizes = {1: [12 * MiB] * 4, 2: [24 * MiB] * 4, 3: [36 * MiB] * 4}
    # step 1 (the log's [0:2]) at length 1, then its step 2 at lengths 2 and 3
    run, last = growing_run(log, 2, 4, lambda length: sizes[length], [1, 2, 3])
    assert [e[2] for e in run] == [12 * MiB, 12 * MiB, 24 * MiB, 24 * MiB, 36 * MiB, 36 * MiB] and last == 4
    assert [e[1] for e in run][:4] == ["a", "a", ("step", 1, 2), ("step", 1, 2)]  # each step's own keys
    assert simulate(run).peak_reserved_bytes == 72 * MiB
    assert simulate(step + step + step).peak_reserved_bytes == 36 * MiB
    tight = simulate(run, capacity=50 * MiB)
    assert (tight.peak_reserved_bytes, tight.released, tight.first_oom) == (36 * MiB, True, None)


def test_a_growing_run_frees_what_the_step_before_kept():
    # k (4 MiB) is made in each step and freed by the next: step r's FREE of k frees step r-1's k
    from memcheck.cuda.allocator import growing_run

    log = [ev(ALLOC, "k", 4 * MiB), ev(FREE, "k", 4 * MiB), ev(ALLOC, "k", 4 * MiB)]
    run, _ = growing_run(log, 1, 3, lambda length: [4 * MiB] * 3, [1, 2, 3])
    assert [(e[0], e[1]) for e in run] == [(ALLOC, "k"), (FREE, "k"), (ALLOC, ("step", 1, 2)),
                                           (FREE, ("step", 1, 2)), (ALLOC, ("step", 2, 2))]
