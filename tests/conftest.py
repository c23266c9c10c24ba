import os
import sys
from pathlib import Path

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


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: every file keeps its own order, the rest stay alphabetical
