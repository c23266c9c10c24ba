"""The allocator simulation against the real CUDA caching allocator.

A fixed sequence of about 200 allocations and frees (small, 1-10 MiB, large, with frees
that leave holes) is replayed with ``torch.empty(n, dtype=torch.uint8, device="cuda")``
and ``del`` in a fresh subprocess, so the caching allocator starts empty, and the
measured ``max_memory_reserved()`` / ``max_memory_allocated()`` (and the growth of
``memory_allocated()`` per allocation, the granted block) must equal ``simulate()``'s
exactly. The GPU tests are skipped where ``torch.cuda.is_available()`` is False; the
sequence itself is checked everywhere.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from memcheck.cuda.allocator import AllocatorConfig, CachingAllocator, simulate
from memcheck.trace.tracer import ALLOC, FREE

KiB, MiB = 2**10, 2**20
_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def recorded_sequence(seed: int = 2024, n_events: int = 200) -> list[tuple[int, int, int]]:
    """``(kind, sid, nbytes)`` events: deterministic, mixed sizes, frees that leave holes.

    Sizes are arbitrary byte counts (not round numbers), so two cached blocks rarely have
    the same size and the allocator's tie-break by address (which the simulation cannot
    know for real cudaMalloc addresses) hardly ever decides anything.
    """
    rng = random.Random(seed)
    events, live, sid = [], [], 0

    def alloc(nbytes):
        nonlocal sid
        sid += 1
        live.append(sid)
        events.append((ALLOC, sid, nbytes))

    def free(index):
        events.append((FREE, live.pop(index), 0))

    while len(events) < n_events:
        phase = len(events) * 4 // n_events
        r = rng.random()
        if live and r < (0.25, 0.4, 0.45, 0.55)[phase]:
            # Mostly frees from the middle (holes), sometimes the newest (stack-like).
            free(rng.randrange(len(live)) if rng.random() < 0.7 else len(live) - 1)
            continue
        kind = rng.random()
        if kind < 0.4:
            alloc(rng.randint(1, 1 * MiB))  # small pool
        elif kind < 0.75:
            alloc(rng.randint(1 * MiB + 1, 10 * MiB - 1))  # large pool, split from 20 MiB segments
        elif kind < 0.95:
            alloc(rng.randint(10 * MiB, 96 * MiB))  # large, own segment rounded to 2 MiB
        else:
            alloc(rng.randint(96 * MiB, 300 * MiB))
    return events


_CHILD = r"""
import json, sys, torch
events = json.load(sys.stdin)
torch.cuda.init()
assert torch.cuda.memory_reserved() == 0, "the caching allocator did not start empty"
live, granted, reserved = {}, [], []
for kind, sid, nbytes in events:
    if kind == 0:
        before = torch.cuda.memory_allocated()
        live[sid] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        granted.append(torch.cuda.memory_allocated() - before)
    else:
        del live[sid]
        granted.append(0)
    reserved.append(torch.cuda.memory_reserved())
print(json.dumps({
    "torch": torch.__version__,
    "max_reserved": torch.cuda.max_memory_reserved(),
    "max_allocated": torch.cuda.max_memory_allocated(),
    "granted": granted,
    "reserved": reserved,
}))
"""


def replay_on_gpu(events, conf: str) -> dict:
    """Run ``events`` in a fresh process with ``PYTORCH_CUDA_ALLOC_CONF=conf``."""
    env = {k: v for k, v in os.environ.items() if k not in _CONF_VARS}
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(events),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def simulated_reserved(events, config) -> list[int]:
    alloc = CachingAllocator(config)
    reserved = []
    for kind, sid, nbytes in events:
        alloc.malloc(sid, nbytes) if kind == ALLOC else alloc.free(sid)
        reserved.append(alloc.reserved)
    return reserved


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_recorded_sequence_mixes_sizes_and_leaves_holes():
    events = recorded_sequence()
    assert len(events) == 200 and events == recorded_sequence()  # deterministic
    sizes = [n for kind, _, n in events if kind == ALLOC]
    assert min(sizes) <= 1 * MiB < max(s for s in sizes if s < 10 * MiB) and max(sizes) > 96 * MiB
    assert sum(1 for s in sizes if s <= 1 * MiB) >= 20 and sum(1 for s in sizes if s >= 10 * MiB) >= 10
    # Holes: some frees are of a storage that was not the newest one still live.
    live, holes = [], 0
    for kind, sid, _ in events:
        if kind == ALLOC:
            live.append(sid)
        else:
            holes += sid != live[-1]
            live.remove(sid)
    assert holes >= 10
    # The simulation of the two settings differs, so the GPU comparison tells them apart.
    plain, exp = simulate(events), simulate(events, AllocatorConfig(expandable_segments=True))
    assert plain.peak_reserved_bytes != exp.peak_reserved_bytes
    assert max(plain.peak_reserved_bytes, exp.peak_reserved_bytes) < 8 * 2**30  # fits any current GPU


@needs_gpu
@pytest.mark.parametrize(
    "conf",
    ["", "expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:[16:4,64:8,>:2]"],
    ids=["default", "expandable_segments", "max_split_and_roundup"],
)
def test_simulation_matches_the_cuda_caching_allocator(conf):
    events = recorded_sequence()
    config = AllocatorConfig.from_env(conf)
    real = replay_on_gpu(events, conf)
    sim = simulate(events, config)
    sim_reserved = simulated_reserved(events, config)
    where = f"torch {real['torch']}, PYTORCH_CUDA_ALLOC_CONF={conf!r}"
    i = first_difference(real["granted"], list(sim.granted))
    assert i is None, f"{where}: event {i} {events[i]}: granted {real['granted'][i]} (GPU) != {sim.granted[i]} (sim)"
    i = first_difference(real["reserved"], sim_reserved)
    assert i is None, f"{where}: after event {i} {events[i]}: reserved {real['reserved'][i]} (GPU) != {sim_reserved[i]}"
    assert sim.peak_allocated_bytes == real["max_allocated"], where
    assert sim.peak_reserved_bytes == real["max_reserved"], where
