import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

try:
    from transformers.utils import logging as _hf_logging

    _hf_logging.set_verbosity_error()
except ImportError:  # pragma: no cover
    pass


# The files holding the suite's longest tests, run first. `make test` runs two pytest-xdist
# workers, which take tests in collection order (alphabetical by file); a long test near the
# end keeps one worker busy while the other has nothing left: in one full run test_scale.py's
# LLaMA-70B plan (133 s, the longest test) started near the end of the order. Whole files move,
# in their own order, so module-scoped fixtures (test_scale.py's fsdp_plan) are still built once
# per worker; what each test checks is unchanged.
LONG_FILES = ("test_scale.py", "test_fuzz.py", "test_accuracy_cpu.py", "test_strategies_cpu.py")


def _lanes() -> dict[str, str]:
    """Node id -> the lane ``tests/lanes.txt`` moves it to ("bench" or "slow")."""
    lane, out = None, {}
    for line in (Path(__file__).parent / "lanes.txt").read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            lane = line[1:-1]
        elif line and not line.startswith("#"):
            out[line] = lane
    return out


def pytest_collection_modifyitems(config, items):
    # The lanes (benchmarks/suite_lanes.py writes tests/lanes.txt from measured durations): bench
    # leaves `make test` for `make test-bench`, slow leaves `make test-fast`.
    lanes = _lanes()
    for item in items:
        lane = lanes.get(item.nodeid)
        if lane is not None:
            item.add_marker(getattr(pytest.mark, lane))

    def rank(item):
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: every file keeps its own order, the rest stay alphabetical
