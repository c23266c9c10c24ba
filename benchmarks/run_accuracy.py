"""``memcheck run`` against real CPU runs of the same scripts: the README's table.

    HF_HUB_OFFLINE=1 python benchmarks/run_accuracy.py

Each script in examples/scripts/ runs for real on the CPU for 2 optimizer steps under the
profiler (``memcheck.measure.local.measure_script``), every sample at 128 tokens, batch 4;
then ``memcheck run --device cpu --max-len 128`` runs it with 5 steps and stops it after 2.
Prints one Markdown row per script: the measured steady peak, memcheck's, and the error.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from memcheck import Job, run_script
from memcheck.measure.local import measure_script

SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "scripts"
LENGTH = ["--max-len", "128", "--min-len", "128", "--batch-size", "4"]
CASES = [("train_loop.py", []), ("train_hf_trainer.py", []), ("train_hf_trainer.py", ["--bf16"]),
         ("train_lightning.py", []), ("train_accelerate.py", []), ("train_sft.py", [])]  # train_sft.py: pip install trl


def main() -> None:
    rows = []
    for script, extra in CASES:
        with contextlib.redirect_stdout(sys.stderr):  # the scripts' own prints
            measured = measure_script([str(SCRIPTS / script), *LENGTH, *extra, "--max-steps", "2"])
            est = run_script([str(SCRIPTS / script), *LENGTH, *extra, "--max-steps", "5"],
                             Job(device="cpu", max_len=128))
        real = measured.steady_peak_bytes
        rows.append(f"| `{' '.join([script, *extra])}` | {real:,} B | {est.peak_bytes:,} B | "
                    f"{(est.peak_bytes - real) / real:+.3%} |")
    print("| script | real peak | memcheck run | error |\n|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
