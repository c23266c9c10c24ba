"""The cuDNN convolution workspaces a real CUDA step allocates, call by call (needs a GPU).

    python benchmarks/cudnn_workspace_probe.py                 # the H200 CNN, fp32 and amp-fp16
    python benchmarks/cudnn_workspace_probe.py --benchmark     # with torch.backends.cudnn.benchmark
    python benchmarks/cudnn_workspace_probe.py --out DIR       # also write DIR/cudnn_workspaces.json

``memcheck/rules/cuda_conv.py`` ASSUMES the workspace of each cuDNN call (NHWC copies of the
call's NCHW tensors), because the engine cuDNN's heuristics pick cannot be known without the
GPU. This script measures it: it runs the CNN of ``benchmarks/gpu_accuracy.py`` for two
training steps under ``torch.cuda.memory._record_memory_history(stacks="all")``, and lists
every block allocated and freed inside a cuDNN convolution (a C++ frame naming
``run_conv_plan``, ``generate_and_filter_plans`` or the v7 path's ``Workspace``) with its
bytes and call kind, one JSON line per block, to set beside the sizes
``memcheck.rules.cuda_conv.conv_workspace_calls`` assumes for the same shapes. Not yet run:
no GPU was available when it was written. Run it in a fresh process: the plan cache is per
process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

_MARKS = ("run_conv_plan", "generate_and_filter_plans", "Workspace::Workspace", "raw_cudnn_convolution")


def _inside_cudnn(frames) -> str | None:
    names = [f.get("name", "") for f in frames]
    for mark in _MARKS:
        if any(mark in n for n in names):
            kind = next((k for k, key in (("backward data", "backward_input"), ("backward filter", "backward_weight"),
                                          ("forward", "forward")) if any(key in n for n in names)), "?")
            return f"{mark} {kind}"
    return None


def probe(precision: str, benchmark: bool) -> list[dict]:
    import torch

    from gpu_accuracy import _cnn

    torch.backends.cudnn.benchmark = benchmark
    torch.manual_seed(0)
    model, (x, y), loss_fn = _cnn(32, None, None)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cuda") if precision == "amp-fp16" else None
    torch.cuda.memory._record_memory_history(stacks="all", max_entries=1_000_000)
    try:
        for _ in range(2):
            with torch.autocast("cuda", torch.float16, enabled=scaler is not None):
                loss = loss_fn(model, (x, y))
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    rows = []
    for e in snap["device_traces"][0]:
        if e["action"] != "alloc":
            continue
        where = _inside_cudnn(e.get("frames", []))
        if where is not None:
            rows.append({"precision": precision, "benchmark": benchmark, "where": where, "bytes": e["size"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    parser.add_argument("--out", help="write cudnn_workspaces.json into this folder")
    args = parser.parse_args(argv)
    rows = []
    for precision in ("fp32", "amp-fp16"):
        got = probe(precision, args.benchmark)
        rows += got
        for r in got:
            print(json.dumps(r), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cudnn_workspaces.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
