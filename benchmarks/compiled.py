"""torch.compile'd training against eager training, measured on real CPU runs.

    python benchmarks/compiled.py                # every case
    python benchmarks/compiled.py --only gpt2,t5 # cases whose name contains "gpt2" or "t5"
    python benchmarks/compiled.py --measured benchmarks/results/compiled-2026-12-02.md
                                                 # the estimates only, against real runs already measured

memcheck traces a ``torch.compile``'d model as compiled where it can (``memcheck.trace.compiled``:
TorchDynamo's graphs, AOTAutograd's min-cut partition as inductor makes it, inductor's fusion and
channels-last convolutions modelled), eagerly otherwise; its report says which. This benchmark
measures both against real runs: each case of the zoo (tests/zoo.py) is trained for real on the CPU
twice, eager and compiled (``torch.compile(model)``: TorchDynamo + TorchInductor, inductor's C++
backend on the CPU), each measured by the allocator (``memcheck.measure.local.measure_cpu``:
``torch.profiler`` allocation events, the peak of live bytes from step 2 on, so the first step's
compilation is outside the steady window), and estimated twice by memcheck (``--device cpu``):
the uncompiled model (the eager trace) and ``torch.compile(model)`` (the compiled trace). The
table sets each estimate beside the real run it predicts.

Results: ``benchmarks/results/compiled-<host>-<date>.md``. Each case runs in its own process
(a compiled graph and inductor's caches stay in a process).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
CASES = ("mlp", "cnn_bn", "lstm", "gpt2-narrow", "bert-narrow", "vit-narrow", "t5")


def _worker(name: str, measured_only_estimates: bool = False) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    from torch._dynamo.utils import counters  # noqa: the benchmark checks that dynamo compiled frames

    import memcheck
    from memcheck.measure.local import measure_cpu
    from memcheck.training.loop import default_loss
    from zoo import _builder

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

    def real(compiled: bool) -> int:
        box = {}

        def build():
            torch.manual_seed(0)
            model, batch, loss = _builder(name)()
            box["loss"] = loss or default_loss
            return (torch.compile(model) if compiled else model), batch

        return measure_cpu(build, adamw, loss_fn=lambda m, b: box["loss"](m, b), steps=2).steady_peak_bytes

    out = {"case": name}
    if not measured_only_estimates:
        out["eager"], out["compiled"] = real(False), real(True)
        out["frames"] = int(counters["frames"]["ok"])
    with torch.device("meta"):
        model, batch, loss = _builder(name)()
    est = memcheck.estimate(model, batch, device="cpu", optimizer="adamw", loss_fn=loss)
    from memcheck.trace import compiled as compiled_trace

    compiled_trace.TRACE_AS_COMPILED = True  # the compiled trace, off by default (see its docstring)
    with torch.device("meta"):
        model, batch, loss = _builder(name)()
    comp = memcheck.estimate(torch.compile(model), batch, device="cpu", optimizer="adamw", loss_fn=loss)
    notes = [a for a in comp.assumptions if "compile" in a]
    out.update(estimate=est.peak_bytes, estimate_compiled=comp.peak_bytes, notes=notes,
               traced="compiled" if any("traced as compiled" in a for a in notes) else "eager")
    return out


def _read_measured(path: Path) -> dict:
    """The real runs of an earlier results file of this benchmark: case -> {eager, compiled}."""
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] in CASES and cells[1].replace(",", "").isdigit():
            out[cells[0]] = {"eager": int(cells[1].replace(",", "")), "compiled": int(cells[2].replace(",", ""))}
    return out


def _host() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--measured", default="", help="a results file of this benchmark: reuse its real runs "
                        "(same torch and host) and compute the estimates only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--estimates-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.estimates_only)))
        return
    import torch

    measured = _read_measured(Path(args.measured)) if args.measured else {}

    rows = []
    for name in CASES:
        if not any(part in name for part in args.only.split(",")):
            continue
        with tempfile.TemporaryDirectory() as cache:  # a cold inductor cache: nothing from another run
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            command = [sys.executable, __file__, "--worker", name] + (["--estimates-only"] if name in measured else [])
            done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            rows.append({"case": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append({**measured.get(name, {}), **json.loads(done.stdout.strip().splitlines()[-1])})
        print(rows[-1], file=sys.stderr)

    source = (f"real runs from {args.measured} (same torch and host), estimates now" if measured
              else "real runs and estimates now")
    lines = [f"# Compiled (torch.compile, inductor) against eager, real CPU runs ({dt.date.today()})", "",
             f"torch {torch.__version__}, {_host()}, {os.cpu_count()} cores; AdamW, 2 steps, steady peak "
             f"(from step 2 on) of the allocator's events; {source}. estimate (eager): memcheck --device cpu of "
             "the model; estimate (compiled): of torch.compile(model), traced as the `traced` column says.", "",
             "| case | eager (B) | estimate eager (B) | vs eager | compiled (B) | estimate compiled (B) "
             "| vs compiled | eager trace vs compiled | traced |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        e, c, m, mc = r["eager"], r["compiled"], r["estimate"], r["estimate_compiled"]
        lines.append(f"| {r['case']} | {e:,} | {m:,} | {(m - e) / e:+.2%} | {c:,} | {mc:,} | {(mc - c) / c:+.1%} "
                     f"| {(m - c) / c:+.1%} | {r['traced']} |")
    out = ROOT / "benchmarks" / "results" / f"compiled{'-estimates' if measured else ''}-{dt.date.today()}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
