"""One rank of a launched training script, run for real and measured (the oracle of
``memcheck run -- torchrun ...``, ``memcheck.measure.distributed.measure_launched``):

    torchrun --standalone --nproc-per-node 2 -m memcheck.measure.script_rank OUT train.py ARGS

runs ``train.py ARGS`` in each rank under ``memcheck.measure.local.measure_script`` and writes
that rank's ``Measured`` to ``OUT/rank<RANK>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from memcheck.measure.local import measure_script


def main(argv: list[str]) -> None:
    out, script = Path(argv[0]), argv[1:]
    measured = measure_script(script)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(dataclasses.asdict(measured)))


if __name__ == "__main__":
    main(sys.argv[1:])
