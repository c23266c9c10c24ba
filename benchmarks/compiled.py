"""torch.compile'd training against eager training, measured on real CPU runs.

    python benchmarks/compiled.py                # every case
    python benchmarks/compiled.py --only gpt2,t5 # cases whose name contains "gpt2" or "t5"

memcheck traces a ``torch.compile``'d model eagerly (its report says so). This benchmark measures
what that costs in accuracy: each case of the zoo (tests/zoo.py) is trained for real on the CPU
twice, eager and compiled (``torch.compile(model)``: TorchDynamo + TorchInductor, inductor's C++
backend on the CPU), each measured by the allocator (``memcheck.measure.local.measure_cpu``:
``torch.profiler`` allocation events, the peak of live bytes from step 2 on, so the first step's
compilation is outside the steady window), and once as memcheck's ``--device cpu`` estimate.
The table gives compiled against eager, and the estimate against each.

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


def _worker(name: str) -> dict:
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

    eager, compiled = real(False), real(True)
    frames = int(counters["frames"]["ok"])
    with torch.device("meta"):
        model, batch, loss = _builder(name)()
    est = memcheck.estimate(torch.compile(model), batch, device="cpu", optimizer="adamw", loss_fn=loss)
    return {"case": name, "eager": eager, "compiled": compiled, "estimate": est.peak_bytes, "frames": frames,
            "notes": [a for a in est.assumptions if "compile" in a]}


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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker)))
        return
    import torch

    rows = []
    for name in CASES:
        if not any(part in name for part in args.only.split(",")):
            continue
        with tempfile.TemporaryDirectory() as cache:  # a cold inductor cache: nothing from another run
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            done = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True,
                                  env=env)
        if done.returncode != 0:
            rows.append({"case": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr)

    lines = [f"# Compiled (torch.compile, inductor) against eager, real CPU runs ({dt.date.today()})", "",
             f"torch {torch.__version__}, {_host()}, {os.cpu_count()} cores; AdamW, 2 steps, steady peak "
             "(from step 2 on) of the allocator's events; estimate: memcheck --device cpu, traced eagerly.", "",
             "| case | eager (B) | compiled (B) | compiled vs eager | estimate vs eager | estimate vs compiled |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][:80]} | | | | |")
            continue
        e, c, m = r["eager"], r["compiled"], r["estimate"]
        lines.append(f"| {r['case']} | {e:,} | {c:,} | {(c - e) / e:+.1%} | {(m - e) / e:+.2%} | {(m - c) / c:+.1%} |")
    out = ROOT / "benchmarks" / "results" / f"compiled-{dt.date.today()}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
