"""All human-readable output: tables through tabulate, JSON through ``to_dict``."""

from __future__ import annotations

import json

from tabulate import tabulate

from memcheck.report import Estimate
from memcheck.units import format_bytes

_CATEGORY_LABELS = {
    "params": "parameters",
    "buffers": "buffers",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations (saved for backward)",
    "temporaries": "temporaries",
    "outputs": "outputs and loss",
    "inputs": "input batch",
    "workspaces": "cuBLAS workspaces",
    "other": "other",
}


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _gpu_label(est: Estimate) -> str:
    gpu = est.gpu
    if gpu is None:
        return "no GPU named"
    return f"{gpu.name}, {format_bytes(gpu.capacity_bytes)}, sm{gpu.arch[0]}{gpu.arch[1]}"


def render_estimate(est: Estimate) -> str:
    """The table printed by ``memcheck MODEL``."""
    b = est.batch
    shapes = ", ".join(f"{i.name} {tuple(i.shape)}" for i in b.inputs)
    lines = [
        f"memcheck: {est.model} on {est.device.value}, {est.precision.value}, {est.optimizer}, "
        f"batch {b.batch_size}" + (f" x {b.max_len} tokens" if b.max_len else ""),
        f"worst-case batch: {shapes}" if shapes else "",
        "",
    ]
    bd = est.breakdown_at_peak.to_dict()
    rows = [
        [_CATEGORY_LABELS[k], format_bytes(v), _pct(v, est.peak_bytes)] for k, v in bd.items() if v
    ]
    peak_label = "allocated peak (steady state)" if est.reserved_bytes is not None else "peak (steady state)"
    rows.append([peak_label, format_bytes(est.peak_bytes), "100.0%"])
    lines.append(tabulate(rows, headers=["at the peak", "memory", "share"], tablefmt="simple"))
    if est.device_total_bytes is not None:
        lines.append("")
        lines.append(tabulate(
            [
                ["allocated peak (max_memory_allocated)", format_bytes(est.peak_bytes)],
                ["reserved by the caching allocator (max_memory_reserved)", format_bytes(est.reserved_bytes)],
                ["  of which beyond the allocated peak (fragmentation)", format_bytes(est.fragmentation_bytes)],
                ["CUDA context and libraries (estimate)", format_bytes(est.context_bytes)],
                ["device total (as nvidia-smi shows)", format_bytes(est.device_total_bytes)],
            ],
            headers=[f"on the GPU ({_gpu_label(est)})", "memory"], tablefmt="simple",
        ))
    lines.append("")
    lines.append(
        f"peak in step {est.peak_step}, phase {est.peak_phase.value}, module {est.peak_module}"
    )
    if est.modules:
        lines.append("")
        mrows = [
            [m.name, format_bytes(m.state_bytes), format_bytes(m.activation_bytes), format_bytes(m.total)]
            for m in est.modules
        ]
        lines.append(
            tabulate(
                mrows,
                headers=["top modules at the peak", "weights+grads+optim", "activations", "total"],
                tablefmt="simple",
            )
        )
    if est.assumptions:
        lines.append("")
        lines.append("assumed:")
        lines.extend(f"  - {a}" for a in est.assumptions)
    if est.budget_bytes is not None:
        lines.append("")
        verdict = "FITS" if est.fits else "DOES NOT FIT"
        what = "device total" if est.device_total_bytes is not None else "peak"
        lines.append(
            f"{verdict}: {what} {format_bytes(est.total_bytes)} vs {format_bytes(est.budget_bytes)} available"
        )
    return "\n".join(line for line in lines if line is not None).replace("\n\n\n", "\n\n")


def render_json(est: Estimate) -> str:
    """One JSON object, as ``--json`` prints it."""
    return json.dumps(est.to_dict(), indent=2)


def render_gpus(gpus, as_json: bool = False) -> str:
    """The table (or JSON) of ``memcheck gpus``."""
    rows = [
        {"name": g.name, "capacity_bytes": g.capacity_bytes, "arch": f"sm{g.arch[0]}{g.arch[1]}",
         "context_bytes": g.context_bytes}
        for g in gpus
    ]
    if as_json:
        return json.dumps(rows, indent=2)
    return tabulate(
        [[r["name"], format_bytes(r["capacity_bytes"]), r["arch"], format_bytes(r["context_bytes"])] for r in rows],
        headers=["GPU", "capacity", "arch", "CUDA context (estimate)"], tablefmt="simple",
    )
