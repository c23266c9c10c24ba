"""All human-readable output: tables through tabulate, JSON through ``to_dict``."""

from __future__ import annotations

import json

from tabulate import tabulate

from memcheck.report import Comparison, DeviceMemory, Estimate
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
    "communication": "communication buffers",
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
    how = [est.strategy]
    if est.accumulate > 1:
        how.append(f"accumulate {est.accumulate}")
    if est.checkpointing:
        how.append(f"checkpointing {len(est.checkpointing)} module(s)" if est.checkpointing[0][0] != "("
                   else "checkpointing " + est.checkpointing[0])
    lines = [
        f"memcheck: {est.model} on {est.device.value}, {est.precision.value}, {est.optimizer}, "
        f"batch {b.batch_size}" + (f" x {b.max_len} tokens" if b.max_len else ""),
        f"strategy: {', '.join(how)}",
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
    if est.per_device:
        lines.append("")
        lines.append(render_devices(est.per_device))
    lines.append("")
    where = f"GPU {est.busiest_gpu}, " if est.per_device else ""
    lines.append(
        f"peak {where}in step {est.peak_step}, phase {est.peak_phase.value}, module {est.peak_module}"
    )
    if est.eval_peak_bytes is not None:
        lines.append(
            f"the job's peak is in {'evaluation' if est.peak_in == 'eval' else 'training'}: "
            f"training {format_bytes(est.train_peak_bytes)}, evaluation {format_bytes(est.eval_peak_bytes)}"
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
                headers=["top modules at the peak", "weights+grads+optim+comm", "activations", "total"],
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


def _device_groups(devices) -> list[tuple[str, DeviceMemory]]:
    """Consecutive GPUs with the same figures share a column ("GPU 1-7")."""
    groups: list[list[DeviceMemory]] = []
    for d in devices:
        if groups and _same(groups[-1][-1], d):
            groups[-1].append(d)
        else:
            groups.append([d])
    return [(f"GPU {g[0].index}" if len(g) == 1 else f"GPU {g[0].index}-{g[-1].index}", g[0]) for g in groups]


def _same(a: DeviceMemory, b: DeviceMemory) -> bool:
    return (a.peak_bytes, a.reserved_bytes, a.device_total_bytes, a.breakdown_at_peak) == (
        b.peak_bytes, b.reserved_bytes, b.device_total_bytes, b.breakdown_at_peak)


def render_devices(devices) -> str:
    """Each GPU's figures, GPUs as columns."""
    groups = _device_groups(devices)
    rows = []
    for key, label in _CATEGORY_LABELS.items():
        values = [getattr(d.breakdown_at_peak, key) for _, d in groups]
        if any(values):
            rows.append([label] + [format_bytes(v) for v in values])
    rows.append(["allocated peak"] + [format_bytes(d.peak_bytes) for _, d in groups])
    if groups[0][1].device_total_bytes is not None:
        rows.append(["reserved"] + [format_bytes(d.reserved_bytes) for _, d in groups])
        rows.append(["device total"] + [format_bytes(d.device_total_bytes) for _, d in groups])
    rows.append(["peak phase"] + [d.peak_phase.value for _, d in groups])
    return tabulate(rows, headers=["per GPU, at its own peak"] + [name for name, _ in groups], tablefmt="simple")


def render_comparison(cmp: Comparison) -> str:
    """The table printed by ``memcheck MODEL --compare``."""
    first = cmp.rows[0]
    b = first.batch
    lines = [
        f"memcheck: {first.model} on {first.device.value}, {first.precision.value}, {first.optimizer}, "
        f"{b.batch_size} per GPU" + (f" x {b.max_len} tokens" if b.max_len else "") + f", {cmp.gpus} GPU(s)",
        "",
    ]
    cuda = first.device_total_bytes is not None
    headers = ["strategy", "peak (allocated)"] + (["reserved", "device total"] if cuda else []) + ["busiest GPU"]
    rows = []
    for r in cmp.rows:
        row = [r.strategy, format_bytes(r.peak_bytes)]
        if cuda:
            row += [format_bytes(r.reserved_bytes), format_bytes(r.device_total_bytes)]
        row.append(str(r.busiest_gpu) if r.per_device else "-")
        if r.fits is not None:
            row.append("fits" if r.fits else "DOES NOT FIT")
        rows.append(row)
    if any(r.fits is not None for r in cmp.rows):
        headers.append(f"vs {format_bytes(first.budget_bytes)}")
    lines.append(tabulate(rows, headers=headers, tablefmt="simple"))
    lines.append("")
    lines.append("figures are each strategy's busiest GPU; run one with --strategy NAME --gpus N for its breakdown")
    return "\n".join(lines)


def render_json(est) -> str:
    """One JSON object, as ``--json`` prints it (an Estimate or a Comparison)."""
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
