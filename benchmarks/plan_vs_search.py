"""memcheck's plan against a BatchSizeFinder-style search on the local GPU, workload by workload.

    python benchmarks/plan_vs_search.py                      # every workload, a 24 GiB card
    python benchmarks/plan_vs_search.py --only gpt2          # names containing "gpt2"
    python benchmarks/plan_vs_search.py --capacity-gib 16    # emulate a 16 GiB card
    python benchmarks/plan_vs_search.py --list               # the workloads, no GPU needed

Two ways to find the largest micro-batch that trains, for each workload:

* **The plan**, in this process on the meta device: ``memcheck.engine.plan.plan()`` with the
  workload's one precision and no checkpointing, timed (wall clock). CUDA is never
  initialised by it (checked). The batch maker takes the micro-batch only, at the
  workload's fixed length, so the plan traces no length profile: the search has no
  counterpart of one.
* **The search**, in one fresh subprocess per workload, as Lightning's
  ``BatchSizeFinder(mode="binsearch")`` runs in the training process: the model and
  its AdamW optimizer are put on the GPU once; each trial trains 3 steps
  (``memcheck.training.loop.run_steps``, the loop memcheck traces) on a new batch;
  the micro-batch starts at 2 and doubles while trials succeed, then a binary search
  runs between the last success and the first out-of-memory error. After an OOM
  the gradients are dropped, ``gc.collect()`` and ``torch.cuda.empty_cache()`` run,
  and the search goes on. Lightning's defaults: ``init_val=2``, ``steps_per_trial=3``,
  ``max_trials=25``. Two deliberate differences: when micro-batch 2 fails, 1 is tried
  (Lightning returns 1 untried), and ``max_trials`` counts every trial (Lightning
  counts successes).

Then the plan is verified: its micro-batch trains 50 steps in a fresh subprocess
(``memcheck.measure.local.measure_cuda``), and whether that OOMs is recorded. The ratio
is planned / largest micro-batch the search found. Targets: the planned micro-batch
never OOMs; ratio >= 0.9. The wall-time ratio is the search's seconds over the
plan's, both measured in this run: the search's are its trial loop alone (the model
already on the GPU, as in Lightning, where the model exists before the search);
the subprocess's whole wall clock (interpreter, imports, CUDA context, model
construction) is recorded beside it.

**A smaller card, emulated.** A full H100 or H200 would take long searches at large
micro-batches; a 24 GiB card (``--capacity-gib``) is realistic and short. Every real
subprocess runs a first tiny CUDA op, measures its context (driver used, from
``cudaMemGetInfo``, minus what other processes used before it started, per nvidia-smi,
minus ``torch.cuda.memory_reserved()``), and calls
``torch.cuda.set_per_process_memory_fraction(f)`` so the caching allocator may
reserve at most CAP - context; the allocator's limit takes the same path as a real
OOM (it frees its cache and retries, then raises ``torch.cuda.OutOfMemoryError``).
The plan targets a GpuSpec with the local GPU's compute capability (its kernel
choices and workspaces) and capacity CAP. Driver memory that grows after the first
op (kernel modules loaded lazily by the first training step) is not under the
allocator's limit; the plan's context figure (``memcheck.cuda.overhead.context_bytes``) includes
it. Both contexts, at the start and after training, are in the JSON.

**The margin is part of the ratio.** The plan recommends a micro-batch whose
predicted device total stays under CAP x (1 - ``memcheck.job.DEFAULT_MARGIN``);
the search fills the whole card. With memory affine in the micro-batch, fixed part F
(weights, gradients, optimizer state, context), an exact prediction alone gives a
ratio near ((1 - margin) x CAP - F) / (CAP - F): 0.94 for F = 2 GiB on 24 GiB with a
5% margin. The ratio therefore measures the margin and the prediction's error together,
and the rounding to whole samples (one sample in 14 is 7%).

Known limitations:
    The search's largest comes from a process that has hit OOMs (a fragmented cache,
    3 steps a trial), so it can be a sample below what a fresh process trains; the
    planned micro-batch is the one run for 50 steps in a fresh process. Nothing here
    has been run on a GPU yet: the CPU tests cover the CLI, the search logic, the
    fraction's arithmetic and the plan half.

Workloads reuse ``benchmarks/gpu_accuracy.py``'s builders and table (its batch size
is ignored: the micro-batch is what is searched); lengths are its own moderate ones
(GPT-2 1024, BERT and T5 512, images 224x224), except the llama-shaped model's, run
at 1024 rather than 2048 (see WORKLOADS), so the default set runs in about 6-8 minutes
on an H100 (estimated; not yet timed).

Results go to ``benchmarks/results/plan_vs_search-<gpu>-<date>.json`` and ``.md``,
with the torch, transformers, CUDA and driver versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_accuracy  # noqa: E402  (the builders and the workload table; it puts the repo root on sys.path)

RESULTS = gpu_accuracy.RESULTS
GiB = 2**30
DEFAULT_CAPACITY_GIB = 24.0
# Lightning's BatchSizeFinder defaults (lightning/pytorch/callbacks/batch_size_finder.py).
START_MICRO_BATCH = 2  # init_val
STEPS_PER_TRIAL = 3  # steps_per_trial
MAX_TRIALS = 25  # max_trials
VERIFY_STEPS = 50
TARGET_RATIO = 0.9
CHILD_TIMEOUT_S = 600

# name -> (the gpu_accuracy workload it reuses: builder, precision, attention; the length).
# One of each model, across fp32, pure bf16, amp-bf16 and amp-fp16 (GradScaler), eager and sdpa.
# The llama-shaped model runs at 1024 rather than the table's 2048: at 2048 about 9 samples
# fit in 24 GiB, where one sample is 11% of the micro-batch and the ratio's target cannot
# tell the planner's error from rounding.
WORKLOADS = {
    "gpt2 x1024 bf16 sdpa": ("gpt2 b8x1024 bf16 sdpa", 1024),
    "bert-base x512 amp-fp16 sdpa": ("bert-base b16x512 amp-fp16 sdpa", 512),
    "llama-shaped x1024 amp-bf16 sdpa": ("llama-shaped b4x2048 amp-bf16 sdpa", 1024),
    "cnn 224px amp-fp16": ("cnn b32 amp-fp16", None),
    "vit-base 224px amp-bf16 sdpa": ("vit-base b64 amp-bf16 sdpa", None),
    "t5-small x512 fp32 eager": ("t5-small b8x512 fp32 eager", 512),
}


def workload(name: str) -> tuple[str, int | None, str, str | None]:
    """``(builder key, length, precision, attention)`` of one of :data:`WORKLOADS`."""
    source, length = WORKLOADS[name]
    key, _batch_size, _length, precision, attn, options = gpu_accuracy._workload(source)
    if options:
        raise ValueError(f"{name}: {source!r} has strategy options {options}; the search has none")
    return key, length, precision, attn


# --- the search ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The largest micro-batch found, every trial in order, and whether the search ended
    at a boundary (a fit next to an OOM, or micro-batch 1 failing) rather than at MAX_TRIALS."""

    largest: int  # 0 when nothing fits
    trials: tuple[tuple[int, bool], ...]  # (micro-batch, fitted)
    converged: bool


def binsearch(fits: Callable[[int], bool], *, start: int = START_MICRO_BATCH,
              max_trials: int = MAX_TRIALS) -> SearchResult:
    """Lightning's ``binsearch`` scaling: double from ``start`` while ``fits``, then bisect
    between the largest size that fitted and the smallest that did not."""
    low, high, size = 0, None, start
    trials: list[tuple[int, bool]] = []
    while len(trials) < max_trials:
        ok = bool(fits(size))
        trials.append((size, ok))
        if ok:
            low = size
        else:
            high = size
        if high is None:
            size *= 2
            continue
        if high - low <= 1:
            return SearchResult(low, tuple(trials), True)
        size = (low + high) // 2
    return SearchResult(low, tuple(trials), False)


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory failure, as Lightning's ``is_oom_error`` reads them: the caching
    allocator's OutOfMemoryError, a driver-level "CUDA ... out of memory", cuBLAS failing
    to allocate, and cuDNN's NOT_SUPPORTED (raised when its workspace cannot be had)."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or not exc.args:
        return False
    text = str(exc.args[0])
    return (("CUDA" in text and "out of memory" in text) or "CUBLAS_STATUS_ALLOC_FAILED" in text
            or "CUDNN_STATUS_NOT_SUPPORTED" in text)


# --- the emulated card -----------------------------------------------------------------

def allocator_fraction(cap_bytes: int, context_bytes: int, device_total_bytes: int) -> float:
    """The ``set_per_process_memory_fraction`` under which the caching allocator may reserve
    ``cap_bytes - context_bytes``: the allocator's limit is fraction x cudaMemGetInfo's total
    (CUDACachingAllocator.cpp, ``setMemoryFraction``)."""
    if cap_bytes > device_total_bytes:
        raise ValueError(f"cannot emulate {cap_bytes / GiB:.2f} GiB on a {device_total_bytes / GiB:.2f} GiB GPU")
    if context_bytes >= cap_bytes:
        raise ValueError(f"the CUDA context ({context_bytes / GiB:.2f} GiB) fills the {cap_bytes / GiB:.2f} GiB card")
    return (cap_bytes - context_bytes) / device_total_bytes


def _emulate(cap_bytes: int, baseline_bytes: int) -> dict:
    """Create the context with a tiny op, measure it, and cap the allocator (in a child)."""
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    context = total - free - baseline_bytes - torch.cuda.memory_reserved()
    # below 0 only if another process freed memory after nvidia-smi was read: recorded as is
    fraction = allocator_fraction(cap_bytes, max(context, 0), total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return {"context_at_start_bytes": context, "allocator_limit_bytes": int(fraction * total),
            "fraction": fraction, "device_total_bytes": total, "baseline_bytes": baseline_bytes}


def _context_now(baseline_bytes: int) -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - baseline_bytes - torch.cuda.memory_reserved()


# --- one workload ----------------------------------------------------------------------

def batch_maker(key: str, length: int | None, attn: str | None, model, device: str) -> Callable[[int], object]:
    """``make(micro_batch)``: the workload's batch on ``device``, as gpu_accuracy's builders
    make it, without building the model again (transformers models) each time."""
    import torch

    if hasattr(model, "config"):  # a transformers model: memcheck.workloads.hf's worst-case padded batch
        from memcheck.workloads import hf
        from memcheck.enums import Task

        task = hf.infer_task(model.config, model)
        target = length // 4 if task is Task.SEQ2SEQ else None  # as gpu_accuracy._hf
        seq = None if task is Task.IMAGE_CLASSIFICATION else length
        return lambda b: hf.make_batch(model, model.config, task, b, seq, target, device=device)

    def make(b):
        with torch.device(device):
            return gpu_accuracy.BUILDERS[key](b, length, attn)[1]

    return make


def plan_one(name: str, gpu) -> dict:
    """memcheck's plan on the meta device, timed; never touches CUDA."""
    import torch

    from memcheck.engine.plan import plan

    key, length, precision, attn = workload(name)
    with torch.device("meta"):
        model, _batch, loss = gpu_accuracy.BUILDERS[key](1, length, attn)
    make = batch_maker(key, length, attn, model, "meta")
    start = time.perf_counter()
    p = plan(model, lambda b: make(b), gpu=gpu, max_len=length, precision_options=(precision,),
             checkpointing_options=("none",), loss_fn=loss, optimizer="adamw")
    seconds = time.perf_counter() - start
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise AssertionError(f"{name}: the plan initialised CUDA")
    rec = p.recommended
    return {
        "micro_batch": rec.micro_batch_size if rec else 0, "seconds": seconds, "traces": p.traces,
        "predicted_device_total_bytes": rec.predicted_device_total_bytes if rec else None,
        "boundary_confirmed": rec.boundary_confirmed if rec else None,
        "limit_bytes": p.limit_bytes, "margin": p.margin, "suggestion": p.suggestion,
    }


def _cuda_job(name: str):
    """The workload's model on the GPU (moved as measure_cuda moves it), its batch maker,
    loss, optimizer, autocast and scaler."""
    import torch
    from torch.utils._pytree import tree_map_only

    from memcheck.enums import Precision
    from memcheck.training.loop import default_loss

    key, length, precision, attn = workload(name)
    precision = Precision.parse(precision)
    dtype, amp = precision.weights_dtype, precision.autocast_dtype
    torch.manual_seed(0)
    model, _batch, loss = gpu_accuracy.BUILDERS[key](1, length, attn)
    del _batch
    make_cpu = batch_maker(key, length, attn, model, "cpu")
    model = model.to("cuda", dtype) if dtype is not None else model.to("cuda")

    def move(t):
        if dtype is not None and t.is_floating_point():
            return t.to("cuda", dtype)
        return t.to("cuda")

    def make(b):
        return tree_map_only(torch.Tensor, move, make_cpu(b))

    optimizer = torch.optim.AdamW(model.parameters())
    autocast = (lambda: torch.autocast("cuda", dtype=amp)) if amp is not None else None
    scaler = torch.amp.GradScaler("cuda") if precision is Precision.AMP_FP16 else None
    return model, make, loss or default_loss, optimizer, autocast, scaler


def search_one(name: str, cap_bytes: int, baseline_bytes: int) -> dict:
    """The BatchSizeFinder-style search (call in a fresh process)."""
    import torch

    from memcheck.training.loop import run_steps

    emulated = _emulate(cap_bytes, baseline_bytes)
    model, make, loss, optimizer, autocast, scaler = _cuda_job(name)
    state = {"scaler": scaler}
    log = []

    def fits(b: int) -> bool:
        gc.collect()  # Lightning's garbage_collection_cuda() before every trial
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        oom, batch = False, None
        try:
            batch = make(b)
            run_steps(model, batch, loss, optimizer, STEPS_PER_TRIAL, autocast=autocast, scaler=state["scaler"])
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - OOMs are the answer; anything else is re-raised
            if not is_oom(exc):
                raise
            oom = True
        del batch  # before the next trial's
        if oom:  # outside the except block, so the traceback's frames are gone
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:  # an OOM inside scaler.step() leaves it mid-step; start afresh
                state["scaler"] = torch.amp.GradScaler("cuda")
            gc.collect()
            torch.cuda.empty_cache()
        log.append({"micro_batch": b, "fits": not oom, "seconds": time.perf_counter() - start,
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved()})
        return not oom

    start = time.perf_counter()
    result = binsearch(fits)
    seconds = time.perf_counter() - start
    return {**emulated, "largest": result.largest, "converged": result.converged, "seconds": seconds,
            "trials": log, "context_after_bytes": _context_now(baseline_bytes)}


def verify_one(name: str, micro_batch: int, cap_bytes: int, baseline_bytes: int) -> dict:
    """The planned micro-batch for VERIFY_STEPS real steps (call in a fresh process)."""
    import torch

    from memcheck.measure.local import measure_cuda
    from memcheck.training.loop import default_loss

    emulated = _emulate(cap_bytes, baseline_bytes)
    key, length, precision, attn = workload(name)
    box = {}

    def build():
        torch.manual_seed(0)
        model, batch, loss = gpu_accuracy.BUILDERS[key](micro_batch, length, attn)
        box["loss"] = loss or default_loss
        return model, batch

    start = time.perf_counter()
    try:
        m = measure_cuda(build, lambda p: torch.optim.AdamW(p), loss_fn=lambda mod, b: box["loss"](mod, b),
                         steps=VERIFY_STEPS, precision=precision, baseline_used_bytes=baseline_bytes)
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {**emulated, "micro_batch": micro_batch, "steps": VERIFY_STEPS, "oom": True,
                "message": message, "seconds": time.perf_counter() - start}
    return {**emulated, "micro_batch": micro_batch, "steps": VERIFY_STEPS, "oom": False,
            "seconds": time.perf_counter() - start, "peak_allocated_bytes": m.peak_allocated_bytes,
            "peak_reserved_bytes": m.peak_reserved_bytes, "device_used_bytes": m.device_used_bytes,
            "context_after_bytes": m.context_bytes}


def _child(*args: str) -> tuple[dict | None, float, list[str]]:
    """Run this script with hidden flags in a fresh process: (its JSON, wall seconds, error tail)."""
    start = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start, [f"timed out after {CHILD_TIMEOUT_S} s"]
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        return None, seconds, (run.stderr or run.stdout).strip().splitlines()[-1:]
    return json.loads(run.stdout.strip().splitlines()[-1]), seconds, []


def run_workload(name: str, gpu, cap_bytes: int) -> dict:
    """Plan, search and verify one workload."""
    row: dict = {"workload": name, "source": WORKLOADS[name][0]}
    key, length, precision, attn = workload(name)
    row.update(model=key, length=length, precision=precision, attention=attn)
    try:
        row["plan"] = plan_one(name, gpu)
    except Exception as exc:  # noqa: BLE001 - a failed plan is a result too
        row["plan"] = None
        row["error"] = [f"plan: {type(exc).__name__}: {str(exc).strip()[:300]}"]
    cap = str(cap_bytes)
    search, seconds, tail = _child("--search-one", name, "--cap-bytes", cap,
                                   "--baseline", str(gpu_accuracy._device_used()))
    row["search"] = search and {**search, "process_seconds": seconds}
    if tail:
        row.setdefault("error", []).append("search: " + " ".join(tail))
    planned = row["plan"]["micro_batch"] if row["plan"] else None
    row["verify"] = None
    if planned:
        verify, seconds, tail = _child("--verify-one", name, "--micro-batch", str(planned), "--cap-bytes", cap,
                                       "--baseline", str(gpu_accuracy._device_used()))
        row["verify"] = verify and {**verify, "process_seconds": seconds}
        if tail:
            row.setdefault("error", []).append("verify: " + " ".join(tail))
    largest = search["largest"] if search else None
    row["ratio"] = planned / largest if planned is not None and largest else None
    row["planned_oom_in_50_steps"] = row["verify"]["oom"] if row["verify"] else None
    row["search_over_plan_seconds"] = (search["seconds"] / row["plan"]["seconds"]
                                       if search and row["plan"] else None)
    row["meets_targets"] = (row["ratio"] is not None and row["ratio"] >= TARGET_RATIO
                            and row["planned_oom_in_50_steps"] is False)
    return row


def _summary(row: dict) -> str:
    p, s = row["plan"], row["search"]
    parts = [row["workload"] + ":"]
    parts.append(f"planned {p['micro_batch']} ({p['seconds']:.1f} s, {p['traces']} traces)" if p else "plan failed")
    parts.append(f"search {s['largest']} ({s['seconds']:.1f} s, {len(s['trials'])} trials)" if s
                 else "search failed")
    if row["ratio"] is not None:
        parts.append(f"ratio {row['ratio']:.2f}")
    if row["planned_oom_in_50_steps"] is not None:
        parts.append(f"OOM in {VERIFY_STEPS} steps: {row['planned_oom_in_50_steps']}")
    if row.get("error"):
        parts.append(f"errors: {row['error']}")
    return " ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run workloads whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit (no GPU needed)")
    parser.add_argument("--capacity-gib", type=float, default=DEFAULT_CAPACITY_GIB,
                        help=f"the card to emulate, in GiB (default {DEFAULT_CAPACITY_GIB:g})")
    parser.add_argument("--search-one", help=argparse.SUPPRESS)
    parser.add_argument("--verify-one", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cap-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(WORKLOADS))
        return 0
    if args.search_one:
        print(json.dumps(search_one(args.search_one, args.cap_bytes, args.baseline)))
        return 0
    if args.verify_one:
        print(json.dumps(verify_one(args.verify_one, args.micro_batch, args.cap_bytes, args.baseline)))
        return 0

    from memcheck.cuda.gpus import local_gpu
    from memcheck.job import DEFAULT_MARGIN

    local = local_gpu()
    if local is None:
        print("no GPU found (nvidia-smi); nothing to measure", file=sys.stderr)
        return 2
    cap_bytes = int(args.capacity_gib * GiB)
    if not 0 < cap_bytes <= local.capacity_bytes:
        print(f"--capacity-gib {args.capacity_gib:g} must be above 0 and at most the local "
              f"{local.name}'s {local.capacity_bytes / GiB:.1f} GiB", file=sys.stderr)
        return 2
    names = [n for n in WORKLOADS if args.only in n]
    if not names:
        print(f"no workload name contains {args.only!r}; see --list", file=sys.stderr)
        return 2
    gpu = dataclasses.replace(local, capacity_bytes=cap_bytes,
                              name=f"{local.name} limited to {args.capacity_gib:g} GiB")
    start = time.perf_counter()
    rows = []
    for name in names:
        row = run_workload(name, gpu, cap_bytes)
        rows.append(row)
        print(_summary(row), flush=True)

    from memcheck.cuda.overhead import context_bytes, context_source

    info = gpu_accuracy._versions()
    stamp = dt.date.today().isoformat()
    slug = local.name.replace(" ", "_")
    payload = {
        "date": stamp, "versions": info, "gpu": local.name, "emulated_gpu": gpu.name, "capacity_bytes": cap_bytes,
        "planner_context_bytes": context_bytes(gpu), "planner_context_source": context_source(gpu),
        "margin": DEFAULT_MARGIN,
        "search": {"start": START_MICRO_BATCH, "steps_per_trial": STEPS_PER_TRIAL, "max_trials": MAX_TRIALS},
        "verify_steps": VERIFY_STEPS, "targets": {"ratio_at_least": TARGET_RATIO, "planned_oom": False},
        "total_seconds": time.perf_counter() - start, "workloads": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"plan_vs_search-{slug}-{stamp}"
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(payload))
    print(f"wrote {out.with_suffix('.json')} ({payload['total_seconds']:.0f} s)")
    return 0


def _markdown(payload) -> str:
    v = payload["versions"]
    lines = [
        f"# memcheck plan vs a BatchSizeFinder-style search on {v['gpu']} ({payload['date']})",
        "",
        f"torch {v['torch']}, transformers {v['transformers']}, CUDA {v['cuda']}, driver {v['driver']}, "
        f"compute capability {v['capability']}. Emulated card: {payload['capacity_bytes'] / GiB:.1f} GiB "
        f"(allocator capped by set_per_process_memory_fraction); plan margin {payload['margin']:.0%}. "
        f"The search doubles from {payload['search']['start']}, then bisects, {payload['search']['steps_per_trial']} "
        f"steps a trial; the planned micro-batch then trains {payload['verify_steps']} steps in a fresh process.",
        "",
        "| workload | planned | plan s (traces) | search largest | search s (trials) | ratio "
        f"| planned OOM in {payload['verify_steps']} steps | search s / plan s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["workloads"]:
        p, s = r["plan"], r["search"]
        cells = [
            str(p["micro_batch"]) if p else "failed",
            f"{p['seconds']:.1f} ({p['traces']})" if p else "-",
            (str(s["largest"]) + ("" if s["converged"] else " (max trials)")) if s else "failed",
            f"{s['seconds']:.1f} ({len(s['trials'])})" if s else "-",
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
            "-" if r["planned_oom_in_50_steps"] is None else ("yes" if r["planned_oom_in_50_steps"] else "no"),
            "-" if r["search_over_plan_seconds"] is None else f"{r['search_over_plan_seconds']:.1f}x",
        ]
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + " |")
    errors = [f"- {r['workload']}: {r['error']}" for r in payload["workloads"] if r.get("error")]
    if errors:
        lines += ["", "Errors:", *errors]
    lines.append("")
    lines.append(
        f"Targets: planned never OOMs; ratio (planned / search's largest) >= {payload['targets']['ratio_at_least']}. "
        "The ratio includes the plan's margin. Search seconds are its trial loop (model already on the GPU); "
        "the whole subprocess's wall clock, per-trial times and peaks, and the measured contexts are in the JSON. "
        f"Whole run: {payload['total_seconds']:.0f} s."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
