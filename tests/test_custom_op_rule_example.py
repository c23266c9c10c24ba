"""examples/custom_op_rule.py: the error without a rule, the estimate with one, as a script
and as a model file; the rule's estimate against the real CPU run the script makes."""

import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from memcheck.cli import main

EXAMPLE = Path(__file__).parent.parent / "examples" / "custom_op_rule.py"
# Python numbers in tensor arithmetic become 0-dim CPU tensors (8 B double, sometimes a 4 B
# float copy) that the CPU allocator sees and a meta trace does not; a few live at once.
WRAPPED_SCALARS = 64


def test_the_script_shows_the_error_then_an_estimate_that_matches_a_real_run():
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Without a rule:" in out
    assert "op mylib::fused_rms_norm has no meta kernel and no memcheck rule" in out
    assert "peak (steady state)" in out
    real, estimated = (int(n.replace(",", "")) for n in
                       re.search(r"peaks at ([\d,]+) B; the estimate is ([\d,]+) B", out).groups())
    assert abs(real - estimated) <= WRAPPED_SCALARS, out


def test_the_example_is_a_model_file_that_registers_its_rule():
    result = CliRunner().invoke(main, [str(EXAMPLE), "--device", "cpu", "--max-len", "16"])
    assert result.exit_code == 0, result.output
    assert "peak (steady state)" in result.output
    assert "batch 1 x 16 tokens" in " ".join(result.output.split())  # the table wraps at 80 columns
