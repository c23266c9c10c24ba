"""memcheck's CPU rules against real CPU training steps, over a grid, per instruction set and thread count.

    HF_HUB_OFFLINE=1 python benchmarks/cpu_rules.py            # every cap this host can run, 1 and 2 threads
    HF_HUB_OFFLINE=1 python benchmarks/cpu_rules.py --quick    # a tenth of the grid

Each point is one small model (a convolution, a norm or an attention block, then a ReLU or a
projection), trained for real for two SGD steps on the CPU under the profiler
(``memcheck.measure.local.measure_cpu``: the allocator's events, steady peak from the second step),
and estimated by ``memcheck.estimate(..., device="cpu")`` on the meta device. The error is
(estimate - measured) / measured.

The instruction set a process runs is capped before torch loads: ``ATEN_CPU_CAPABILITY`` for
ATen's kernels and ``ONEDNN_MAX_CPU_ISA`` for oneDNN's. Each (cap, thread count) runs in a
subprocess of its own, since neither can change once torch is imported. A cap above what the host
has runs the host's own ISA, so the caps this host cannot run are reported as skipped, with the
reason, rather than run twice under another name.

Two points of the grid crash torch 2.13.0+cpu's own kernels on an AVX2 host, with or without
memcheck (plain ``model(x).sum().backward()`` in a fresh process): ``nn.GroupNorm`` backward on a
channels-last input (SIGSEGV, any thread count) and a strided 1x1 ``nn.Conv2d(3, 32, 1, 2)`` on a
channels-last (4, 3, 16, 16) input with one thread (glibc "double free or corruption"). Such a
point is reported as a crash of the real run and the grid goes on in a new process.

Writes ``benchmarks/results/cpu_rules-<capability>-<date>.{json,md}`` and prints the Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.02
# name -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, the /proc/cpuinfo flag the host needs)
CAPS = {
    "avx512": ("avx512", "AVX512_CORE", "avx512f"),
    "avx2": ("avx2", "AVX2", "avx2"),
    "default": ("default", "SSE41", "sse4_1"),  # ATen's baseline kernels, oneDNN's SSE4.1 ones
}
MAX_INPUT_BYTES = 8 * 2**20  # keeps one point's real run to a few tenths of a second on 2 cores


def grid(quick: bool = False) -> list[dict]:
    """The points: a seeded sample of the convolution grid (every value of every axis appears),
    the norms and the attention shapes. The same list on every host."""
    rng = random.Random(0)
    axes = {
        "kind": ["conv", "depthwise"], "kernel": [1, 2, 3, 5, 7], "stride": [1, 2], "spatial": [1, 2, 4, 7, 16, 32, 64],
        "channels": [3, 8, 16, 24, 64, 96, 256, 512], "batch": [1, 2, 4, 8], "layout": ["contiguous", "channels_last"],
    }
    points, seen = [], set()
    # every pair of values of two axes meets at least once (a greedy covering array), then random fill
    pairs = {(a, va, b, vb) for a, b in itertools.combinations(axes, 2) for va in axes[a] for vb in axes[b]}
    while pairs:
        best, best_cover = None, -1
        for _ in range(60):
            cand = {k: rng.choice(v) for k, v in axes.items()}
            cover = sum((a, cand[a], b, cand[b]) in pairs for a, b in itertools.combinations(axes, 2))
            if cover > best_cover:
                best, best_cover = cand, cover
        pairs -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(axes, 2)}
        key = tuple(best.values())
        if key not in seen:
            seen.add(key)
            points.append(best)
    convs = []
    for p in points:
        c = p["channels"]
        out_c = c if p["kind"] == "depthwise" else rng.choice([8, 16, 32, 64, 128])
        if 4 * p["batch"] * c * p["spatial"] ** 2 > MAX_INPUT_BYTES:
            p["batch"] = max(1, MAX_INPUT_BYTES // (4 * c * p["spatial"] ** 2))
        if 4 * p["batch"] * c * p["spatial"] ** 2 > MAX_INPUT_BYTES:
            continue
        convs.append({"op": "conv", **p, "out_channels": out_c})
    norms = [{"op": op, "channels": c, "spatial": s, "batch": b, "layout": lay}
             for op, (c, s, b, lay) in itertools.product(
                 ["batch_norm", "layer_norm", "group_norm"],
                 [(16, 8, 4, "contiguous"), (64, 16, 2, "channels_last"), (3, 32, 8, "contiguous")])]
    norms += [{"op": "batch_norm_after_conv", "channels": c, "spatial": s, "batch": b, "layout": lay}
              for c, s, b, lay in [(16, 8, 4, "contiguous"), (64, 16, 2, "channels_last"), (32, 32, 4, "contiguous")]]
    attention = [{"op": "attention", "batch": b, "heads": h, "seq": s, "head_dim": d, "causal": c}
                 for b, h, s, d, c in [(1, 2, 16, 16, False), (2, 4, 128, 32, True), (4, 8, 256, 64, True),
                                       (2, 2, 512, 128, False), (1, 12, 1024, 64, True), (3, 5, 77, 40, False)]]
    out = convs + norms + attention
    return out[::10] if quick else out


def _model(point):
    """(a builder of (model, batch) on the current default device, a label) for one point."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attention(nn.Module):
        def __init__(self, heads, head_dim, causal):
            super().__init__()
            self.heads, self.causal = heads, causal
            self.qkv = nn.Linear(heads * head_dim, 3 * heads * head_dim)
            self.out = nn.Linear(heads * head_dim, heads * head_dim)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            return self.out(y.transpose(1, 2).reshape(b, s, -1))

    op = point["op"]
    fmt = torch.channels_last if point.get("layout") == "channels_last" else torch.contiguous_format
    if op == "conv":
        c, k = point["channels"], point["kernel"]
        groups = c if point["kind"] == "depthwise" else 1
        layer = lambda: nn.Conv2d(c, point["out_channels"], k, point["stride"], padding=k // 2, groups=groups)  # noqa: E731
        shape = (point["batch"], c, point["spatial"], point["spatial"])
        label = (f"{point['kind']} {c}->{point['out_channels']} k{k} s{point['stride']} "
                 f"{point['batch']}x{point['spatial']}x{point['spatial']} {point['layout']}")
    elif op == "batch_norm_after_conv":  # the usual place: its input needs a gradient
        c, s = point["channels"], point["spatial"]
        layer = lambda: nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))  # noqa: E731
        shape = (point["batch"], c, s, s)
        label = f"conv3x3+batch_norm {c} {point['batch']}x{s}x{s} {point['layout']}"
    elif op in ("batch_norm", "layer_norm", "group_norm"):
        c, s = point["channels"], point["spatial"]
        layer = {"batch_norm": lambda: nn.BatchNorm2d(c), "layer_norm": lambda: nn.LayerNorm([s, s]),
                 "group_norm": lambda: nn.GroupNorm(1, c)}[op]
        shape = (point["batch"], c, s, s)
        label = f"{op} {c} {point['batch']}x{s}x{s} {point['layout']}"
    else:
        h, d = point["heads"], point["head_dim"]
        layer = lambda: Attention(h, d, point["causal"])  # noqa: E731
        shape = (point["batch"], point["seq"], h * d)
        label = f"sdpa b{point['batch']} h{h} s{point['seq']} d{d}{' causal' if point['causal'] else ''}"

    def build():
        torch.manual_seed(0)
        x = torch.randn(shape)
        if x.dim() == 4:
            x = x.contiguous(memory_format=fmt)
        return nn.Sequential(layer(), nn.ReLU()), x

    return build, label


def worker(threads: int, start: int) -> None:
    """Run the points from ``start`` on under this process's caps; one JSON line per point on stdout,
    each after a ``point N`` line, so that a point that kills the process is known."""
    import torch

    import memcheck
    from memcheck.measure.local import measure_cpu

    torch.set_num_threads(threads)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    for i, point in enumerate(grid(os.environ.get("CPU_RULES_QUICK") == "1")):
        if i < start:
            continue
        print(f"point {i}", flush=True)
        build, label = _model(point)
        row = {"label": label, "threads": threads, "capability": torch.backends.cpu.get_cpu_capability()}
        try:
            measured = measure_cpu(build, sgd).steady_peak_bytes
            with torch.device("meta"):
                model, x = build()
            est = memcheck.estimate(model, x, device="cpu", optimizer="sgd").peak_bytes
            row.update(measured=measured, estimated=est, error=(est - measured) / measured)
        except Exception as exc:  # a point that cannot run is reported, not hidden
            row.update(failed=f"{type(exc).__name__}: {exc}"[:200])
        print(json.dumps(row), flush=True)


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("USDT:", "INFO:", "WARNING:"))]
    return lines[-1][:120] if lines else "no message"


def _host_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.split(":", 1)[-1].split())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the grid")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    ap.add_argument("--caps", default=",".join(CAPS), help=f"caps to run (default {','.join(CAPS)})")
    ap.add_argument("--lower-cap-env", action="store_true",
                    help="print the shell exports that cap ATen and oneDNN one ISA below this host's, and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(int(args.threads), args.start)
        return
    flags = _host_flags()
    if args.lower_cap_env:
        have = [name for name, (_, _, flag) in CAPS.items() if flag in flags]  # CAPS runs from the highest down
        aten, onednn, _ = CAPS[have[1] if len(have) > 1 else have[-1]] if have else CAPS["default"]
        print(f"export ATEN_CPU_CAPABILITY={aten} ONEDNN_MAX_CPU_ISA={onednn}")
        return
    rows, skipped = [], []
    for cap in args.caps.split(","):
        aten, onednn, flag = CAPS[cap]
        if flags and flag not in flags:
            skipped.append(f"{cap}: this host has no {flag}")
            continue
        for threads in args.threads.split(","):
            env = {**os.environ, "ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn,
                   "CPU_RULES_QUICK": "1" if args.quick else "0", "HF_HUB_OFFLINE": "1"}
            got, start = [], 0
            points = grid(args.quick)
            while start < len(points):
                proc = subprocess.run([sys.executable, __file__, "--worker", "--threads", threads, "--start", str(start)],
                                      env=env, capture_output=True, text=True)
                out = proc.stdout.splitlines()
                got += [json.loads(ln) for ln in out if ln.startswith("{")]
                if proc.returncode == 0:
                    break
                # the real run of a point killed the process (torch's own kernels: see the module docstring)
                crashed = int(next(ln for ln in reversed(out) if ln.startswith("point ")).split()[1])
                label = _model(points[crashed])[1]
                got.append({"label": label, "threads": int(threads), "capability": "?",
                            "failed": f"the real CPU run killed the process (signal {-proc.returncode}): "
                                      f"{_last_error(proc.stderr)}"})
                start = crashed + 1
            for r in got:
                r["cap"] = cap
            rows.extend(got)
            print(f"{cap}, {threads} threads: {len(got)} points", file=sys.stderr)
    ok = [r for r in rows if "error" in r]
    within = sum(abs(r["error"]) <= TOLERANCE for r in ok)
    capability = rows[0]["capability"] if rows else "none"
    lines = [f"# CPU rules against real CPU steps ({datetime.date.today()})", "",
             f"Host: {_cpu_name()}; torch {_torch_version()}; native capability {capability}.", "",
             f"{within} of {len(ok)} points within {TOLERANCE:.0%}; {len(rows) - len(ok)} failed to run; "
             f"largest |error| {max((abs(r['error']) for r in ok), default=0):.3%}.", ""]
    lines += [f"Skipped: {s}" for s in skipped] + ([""] if skipped else [])
    lines += ["| cap | threads | point | measured B | estimated B | error |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cap']} | {r['threads']} | {r['label']} | {r['measured']:,} | {r['estimated']:,} | "
                         f"{r['error']:+.3%} |")
        else:
            lines.append(f"| {r['cap']} | {r['threads']} | {r['label']} | failed: {r['failed']} | | |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"cpu_rules-{_cpu_name().replace(' ', '_')}-{datetime.date.today()}{'-quick' if args.quick else ''}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"skipped": skipped, "rows": rows}, indent=1) + "\n")
    print(text)


def _cpu_name() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return out.stdout.strip()


if __name__ == "__main__":
    main()
