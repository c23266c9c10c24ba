"""Coverage of the installed transformers: every architecture at tiny size, real CPU step vs estimate.

    HF_HUB_OFFLINE=1 python benchmarks/coverage.py [MODEL_TYPE ...]

One case per model type of the installed transformers' Auto mappings (tests/hf_coverage.py says
how the task is chosen and the config shrunk): two real AdamW steps on the CPU, measured by the
allocator (``measure_cpu``'s steady peak), against memcheck's CPU estimate of the same steps.
Prints one Markdown row per case (architecture, task, measured bytes, estimated bytes, error, or
the stage that failed and its message), then the totals. tests/test_coverage.py asserts the same
cases and lists the ones that cannot pass, with the reason.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hf_coverage import cases, run_case  # noqa: E402

TOLERANCE = 0.02


def main(only: list[str]) -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    rows, counts, started = [], Counter(), time.perf_counter()
    for case in cases():
        if only and case[0] not in only:
            continue
        o = run_case(*case)
        counts["tried"] += 1
        if o.stage == "ok":
            counts["built and ran"] += 1
            counts["within 2%" if abs(o.error) <= TOLERANCE else "outside 2%"] += 1
            rows.append(f"| {o.architecture} | {o.task} | {o.measured_bytes:,} | {o.estimated_bytes:,} | "
                        f"{o.error:+.2%} |")
        else:
            counts[f"failed: {o.stage}"] += 1
            message = o.message.replace("|", "\\|")
            rows.append(f"| {o.architecture} | {o.task} | | | {o.stage} failed: {message} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print("| architecture | task | measured peak (B) | estimated (B) | error |\n|---|---|---:|---:|---:|")
    print("\n".join(rows))
    print()
    print(", ".join(f"{k}: {v}" for k, v in counts.items()) + f" ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
