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
