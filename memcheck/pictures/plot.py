"""``--plot``: a PNG of memory over the steady-state training step, stacked by category.

matplotlib is an optional extra (``pip install 'memcheck[plot]'``). It is imported only
here and only when a plot is drawn; the figure is drawn on the Agg canvas directly (no
pyplot, no window, and the caller's backend is left as it was).
"""

from __future__ import annotations

import importlib
import io

from memcheck.enums import Category, Device, Phase
from memcheck.errors import UsageError
from memcheck.job import DEFAULT_MARGIN, limit_bytes
from memcheck.pictures.snapshot import _timeline_of
from memcheck.report.text import _CATEGORY_LABELS
from memcheck.report.timeline import (
    CATEGORIES,
    Timeline,
    check_output_path,
    write_atomically,
)
from memcheck.units import GiB, KiB, MiB, format_bytes

SUFFIXES = (".png",)
INSTALL_HINT = "pip install 'memcheck[plot]'"
SIZE_INCHES = (10.0, 5.6)  # at DPI: 1000 x 560 px, legible at README width
DPI = 100
# Bottom to top: what lives through the step first, then what comes and goes.
STACK_ORDER = (
    Category.PARAMETER, Category.BUFFER, Category.OPTIMIZER, Category.GRADIENT, Category.COMMUNICATION,
    Category.INPUT, Category.WORKSPACE, Category.OTHER, Category.ACTIVATION, Category.OUTPUT, Category.TEMPORARY,
)
COLORS = {  # Tableau 10, as PyTorch's memory viewer uses
    Category.PARAMETER: "#4e79a7", Category.BUFFER: "#a0cbe8", Category.OPTIMIZER: "#59a14f",
    Category.GRADIENT: "#f28e2b", Category.COMMUNICATION: "#76b7b2", Category.INPUT: "#9c755f",
    Category.WORKSPACE: "#bab0ac", Category.OTHER: "#edc948", Category.ACTIVATION: "#e15759",
    Category.OUTPUT: "#b07aa1", Category.TEMPORARY: "#ff9d9a",
}
CONTEXT_COLOR = "#d9d9d9"
PHASE_LABELS = {Phase.OPTIMIZER: "optimizer step", Phase.ZERO_GRAD: "zero_grad"}


def require_matplotlib(what: str = "plot_timeline") -> None:
    """Raise UsageError (one line, with the install command) unless matplotlib imports."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise UsageError(f"{what} needs matplotlib: {INSTALL_HINT}") from None


def check_plot_path(path, what: str = "plot_timeline") -> None:
    """Raise UsageError naming ``path`` unless a ``.png`` can be written there, or naming
    the install command when matplotlib is missing."""
    check_output_path(path, SUFFIXES, what)
    require_matplotlib(what)


def plot_timeline(estimate, path, *, margin: float = DEFAULT_MARGIN, what: str = "plot_timeline") -> None:
    """Draw memory over ``estimate``'s steady-state training step to ``path`` (a ``.png``).

    An area chart stacked by category (the CUDA context as a base band on the CUDA
    target, with the reserved memory as a line on top of it: the device total), the
    phases as shaded spans, and lines at the budget (the GPU's capacity by default)
    and at the limit the planner keeps to, the budget less ``margin``. The x axis is
    the step's allocation events in trace order, not time.

    Args:
        estimate: an ``Estimate`` from ``memcheck.estimate(..., timeline=True)``.
        path: the PNG to write (atomically: a temporary file in the same directory, renamed).
        margin: the fraction of the budget held back (default ``memcheck.job.DEFAULT_MARGIN``).
        what: how errors name the path (the CLI passes ``--plot``).

    Raises:
        UsageError: no timeline, a path that is not a writable ``.png``, or no matplotlib.

    Example:
        >>> est = memcheck.estimate(model, batch, gpu="24GiB", timeline=True)
        >>> memcheck.plot_timeline(est, "step.png")

    Known limitations:
        The step drawn is the one with the steady-state training peak; an evaluation
        pass is not drawn (its peak is noted when it is the higher one).
    """
    path = check_output_path(path, SUFFIXES, what)
    require_matplotlib(what)
    timeline = _timeline_of(estimate)
    buf = io.BytesIO()
    _figure(estimate, timeline, margin).savefig(buf, format="png", dpi=DPI)
    write_atomically(path, buf.getvalue(), what)


BUCKETS = 500  # at most this many points drawn: each about 2 pixels of the plot's width


def _envelope(points, buckets: int) -> tuple[list[int], list]:
    """At most ``buckets`` points, each drawn from the start of its run of consecutive events
    (x, counted from the first): the highest of the run, so that a peak one event wide
    keeps a visible width (a sub-pixel spike would all but vanish). The last point is
    repeated at the end, where the final step of a ``step="post"`` drawing ends."""
    size = max(1, -(-len(points) // buckets))
    xs = list(range(0, len(points), size))
    highest = [max(points[x:x + size], key=lambda p: p.total) for x in xs]
    return xs + [len(points)], highest + highest[-1:]


def _unit(top: int) -> tuple[int, str]:
    for size, label in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if top >= size:
            return size, label
    return 1, "B"


def _figure(est, timeline: Timeline, margin: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory, offset_copy

    peak = timeline.train_peak
    start, end = timeline.step_range(peak.step)
    xs, points = _envelope(timeline.points[start:end], BUCKETS)
    context = timeline.context_bytes or 0
    budget = est.budget_bytes
    limit = limit_bytes(budget, margin) if budget else None
    reserved = [context + p.reserved for p in points] if timeline.device is Device.CUDA else None
    top = max([context + peak.total, *(reserved or []), *([budget] if budget else [])])
    unit, unit_label = _unit(top)

    fig = Figure(figsize=SIZE_INCHES, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    base = [context / unit] * len(points)
    handles = []
    if context:
        ax.fill_between(xs, 0, base, step="post", color=CONTEXT_COLOR, linewidth=0)
        handles.append(Patch(color=CONTEXT_COLOR, label=f"CUDA context ({format_bytes(context)})"))
    for cat in STACK_ORDER:
        i = CATEGORIES.index(cat)
        values = [p.by_category[i] for p in points]
        if not any(values):
            continue
        upper = [b + v / unit for b, v in zip(base, values)]
        ax.fill_between(xs, base, upper, step="post", color=COLORS[cat], linewidth=0)
        handles.append(Patch(color=COLORS[cat], label=_CATEGORY_LABELS[cat.value]))
        base = upper
    ax.step(xs, base, where="post", color="#444444", linewidth=0.5)  # the outline keeps narrow spikes visible
    if reserved is not None:
        handles += ax.step(xs, [r / unit for r in reserved], where="post", color="black", linewidth=1.2,
                           label=f"reserved + context: device total (max {format_bytes(max(reserved))})")
    if budget:
        name = "capacity" if est.gpu is not None and est.gpu.capacity_bytes == budget else "budget"
        handles.append(ax.axhline(budget / unit, color="#b2182b", linewidth=1.4,
                                  label=f"{'GPU ' if name == 'capacity' else ''}{name} ({format_bytes(budget)})"))
        handles.append(ax.axhline(limit / unit, color="#b2182b", linewidth=1.2, linestyle="--",
                                  label=f"limit ({name} \u2212 {margin:.0%} margin, {format_bytes(limit)})"))
    # The peak: a marker whose tip touches it, explained in the legend (a label in the plot
    # would collide with the lines above it).
    peak_marker = {"marker": "v", "markersize": 10, "color": "black", "markeredgecolor": "white", "linestyle": "none"}
    ax.plot([peak.event - start], [(context + peak.total) / unit], **peak_marker,
            transform=offset_copy(ax.transData, fig=fig, y=5, units="points"))
    handles.append(Line2D([], [], **peak_marker, label=f"allocated peak {format_bytes(peak.total)} "
                                                        f"({peak.phase.value})"))

    _phases(ax, timeline, start, end, blended_transform_factory(ax.transData, ax.transAxes))
    ax.set_xlim(0, xs[-1])
    ax.set_ylim(0, top / unit * 1.12)
    ax.set_ylabel(f"memory ({unit_label}" + (f", 1 {unit_label} = 2^{unit.bit_length() - 1} B)" if unit > 1 else ")"))
    ax.set_xlabel(f"allocation events of training step {peak.step} (trace order, not time)")
    ax.grid(axis="y", color="#e5e5e5", linewidth=0.8)
    ax.set_axisbelow(True)
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8.5, frameon=False)
    where = est.gpu.name if est.gpu is not None else est.device.value
    batch = f"batch {est.batch.batch_size}" + (f" \u00d7 {est.batch.max_len}" if est.batch.max_len else "")
    fig.suptitle(f"{est.model} on {where}: {est.precision.value}, {est.optimizer}, {batch}, "
                 f"training step {peak.step} of {est.steps}", fontsize=11)
    if est.peak_in == "eval":
        fig.text(0.01, 0.005, f"not drawn: the evaluation pass, whose peak ({format_bytes(est.eval_peak_bytes)}) "
                 "is higher", fontsize=8, color="#555555")
    return fig


def _phases(ax, timeline: Timeline, start: int, end: int, transform) -> None:
    """Shade every second phase, label each above the plot; narrow ones on a second row."""
    spans = [s for s in timeline.spans if start <= s.start < end]
    width = max(end - start, 1)
    row = 0
    for n, span in enumerate(spans):
        left, right = span.start - start, span.end - start
        if n % 2:
            ax.axvspan(left, right, color="#000000", alpha=0.05, linewidth=0)
        if n:
            ax.axvline(left, color="#888888", linewidth=0.6)
        narrow = (right - left) / width < 0.08
        row = (row + 1) % 2 if narrow else 0
        ax.text((left + right) / 2, 1.01 + 0.045 * row, PHASE_LABELS.get(span.phase, span.phase.value),
                transform=transform, ha="center", va="bottom", fontsize=8.5, clip_on=False)
