"""Pictures of a traced step: ``snapshot`` writes the simulated allocator trace for PyTorch's
memory viewer (pytorch.org/memory_viz), ``plot`` draws memory over the step by category.
Both read an estimate's ``Timeline`` (``memcheck.report.timeline``)."""

from __future__ import annotations

from memcheck.job import DEFAULT_MARGIN
from memcheck.pictures.plot import check_plot_path, plot_timeline
from memcheck.pictures.snapshot import check_snapshot_path, write_snapshot


def check_pictures(snapshot=None, plot=None) -> None:
    """The CLI's ``--snapshot`` and ``--plot`` paths (and matplotlib, for a plot), checked
    before anything is traced. Raises UsageError naming the bad path."""
    if snapshot is not None:
        check_snapshot_path(snapshot, "--snapshot")
    if plot is not None:
        check_plot_path(plot, "--plot")


def write_pictures(estimate, snapshot=None, plot=None, *, margin: float | None = None) -> None:
    """Write the CLI's ``--snapshot`` and ``--plot`` files for an estimate traced with a timeline."""
    if snapshot is not None:
        write_snapshot(estimate, snapshot, what="--snapshot")
    if plot is not None:
        plot_timeline(estimate, plot, margin=DEFAULT_MARGIN if margin is None else margin, what="--plot")
