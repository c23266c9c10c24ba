"""The CPU allocator's events, read from ``torch.profiler``: what the CPU kernel rules'
probes measure (``memcheck.rules.cpu_kernels``) and what ``memcheck.measure`` compares
the tracer with. Nothing here uses the tracer's accounting."""

from __future__ import annotations

import contextlib
import os
import sys

from memcheck import compat


def cpu_memory_events(raw_events) -> list[tuple[int, int]]:
    """``(start_ns, signed nbytes)`` of the CPU allocator's events, in time order.

    ``raw_events`` is ``prof.profiler.kineto_results.events()``; the sort is stable,
    so events with the same timestamp keep the order they were recorded in.
    """
    cpu = compat.ProfilerDeviceType.CPU
    return sorted(
        ((e.start_ns(), e.nbytes()) for e in raw_events if e.name() == "[memory]" and e.device_type() == cpu),
        key=lambda x: x[0],
    )


def running_peak(deltas) -> int:
    """The highest running sum of signed allocation deltas (0 when it never rises)."""
    live = peak = 0
    for delta in deltas:
        live += delta
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def profile_memory():
    """The autograd profiler of CPU activity with memory events, for a probe of a real op; read
    ``.kineto_results.events()`` after it.

    ``torch.autograd.profiler.profile``, not ``torch.profiler.profile``: the same Kineto events,
    without the wrapper's start-up and post-processing, which took 640 ms a session here against
    0.9 ms (torch 2.13, 2 cores, ten empty sessions each); a model's convolutions are each probed.
    Kineto writes a line to the process's stderr at every start and stop of a profiler
    (``SyncActivityProfilerHandler.cpp``: "profiler_start", "profiler_stop"); a probe is
    memcheck's business, not the user's, so file descriptor 2 points at /dev/null meanwhile
    and is restored on the way out.
    """
    from torch.autograd.profiler import profile

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        with profile(use_cpu=True, profile_memory=True) as prof:
            yield prof
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
