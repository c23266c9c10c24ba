"""Pipeline parallelism: memcheck's per-rank estimate against real ``torch.distributed.pipelining`` runs.

    HF_HUB_OFFLINE=1 python benchmarks/pp_accuracy.py

Each case runs the real schedule on gloo CPU ranks (``memcheck.measure.distributed.measure_pp_cpu``,
one process per rank, 2 steps, the allocator's steady peak from step 2) with the tiny fp32
LlamaForCausalLM of tests/test_pp_cpu.py (hidden 64, 4 heads, 4 layers, vocab 128, sequence 32,
micro-batch 2, AdamW), then estimates every rank (``pp.make_stage`` + ``pp.train_step``,
``whole_batch=True``). Prints one Markdown row per rank. docs/pp.md quotes the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CASES = [("1f1b", 2, 1), ("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 2, 2)]  # schedule, ranks, virtual
MICROBATCHES = 4


def estimate(schedule: str, rank: int, ranks: int, virtual: int) -> int:
    import memcheck
    from memcheck.training.strategies import pp
    from test_pp_cpu import build_llama

    with torch.device("meta"):
        model, batch = build_llama()
    pp.make_stage(model, rank, ranks, virtual)
    whole = {k: torch.cat([v] * MICROBATCHES) for k, v in batch.items()}
    step = pp.train_step(schedule, rank, ranks, MICROBATCHES, whole_batch=True, virtual=virtual)
    return memcheck.estimate(model, whole, device="cpu", optimizer="adamw", train_step=step).peak_bytes


def main() -> None:
    from memcheck.measure.distributed import measure_pp_cpu
    from test_pp_cpu import adamw, build_llama

    print("| schedule | ranks x chunks | rank | measured (B) | estimated (B) | error |")
    print("|---|---|---|---:|---:|---:|")
    for schedule, ranks, virtual in CASES:
        measured = measure_pp_cpu(build_llama, adamw, world_size=ranks, schedule=schedule,
                                  microbatches=MICROBATCHES, virtual=virtual)
        for rank, m in enumerate(measured):
            est = estimate(schedule, rank, ranks, virtual)
            error = (est - m.steady_peak_bytes) / m.steady_peak_bytes
            print(f"| {schedule} | {ranks} x {virtual} | {rank} | {m.steady_peak_bytes:,} | {est:,} | {error:+.3%} |",
                  flush=True)


if __name__ == "__main__":
    main()
