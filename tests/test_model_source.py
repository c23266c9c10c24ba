"""Model files: what they may define, and one clear error for each way they fail."""

import textwrap

import pytest

from memcheck.errors import ModelLoadError, UsageError
from memcheck.job import SettingError
from memcheck.workloads.source import load_workload


def write(tmp_path, body, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


GOOD = """
    import torch
    def build_model():
        return torch.nn.Linear(8, 2)
    def make_batch(batch_size, max_len):
        return torch.randn(batch_size, max_len, 8)
"""


def test_model_file_builds_on_meta(tmp_path):
    work = load_workload(write(tmp_path, GOOD), batch_size=4, max_len=16)
    assert next(work.model.parameters()).device.type == "meta"
    assert work.batch.device.type == "meta" and tuple(work.batch.shape) == (4, 16, 8)


def test_module_level_model_is_accepted(tmp_path):
    body = """
        import torch
        model = torch.nn.Linear(8, 2)
        def make_batch(batch_size, max_len=None):
            return torch.randn(batch_size, 8)
    """
    work = load_workload(write(tmp_path, body), batch_size=2)
    assert next(work.model.parameters()).device.type == "meta"


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "import torch\ndef build_model(:\n    pass\n")
    with pytest.raises(ModelLoadError, match=r"model.py:2: loading the model file failed: SyntaxError"):
        load_workload(path)


def test_import_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "import torch\nimport not_a_module_anywhere\n")
    with pytest.raises(ModelLoadError, match=r"model.py:2: .*ModuleNotFoundError"):
        load_workload(path)


def test_missing_build_model_says_what_to_add(tmp_path):
    with pytest.raises(ModelLoadError, match="neither build_model"):
        load_workload(write(tmp_path, "x = 1\n"))


def test_build_model_raising_names_the_line(tmp_path):
    body = "def build_model():\n    raise RuntimeError('no config here')\n"
    with pytest.raises(ModelLoadError, match=r"model.py:2: build_model\(\) raised RuntimeError: no config here"):
        load_workload(write(tmp_path, body))


def test_plain_model_without_make_batch_is_rejected(tmp_path):
    body = "import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n"
    with pytest.raises(ModelLoadError, match="make_batch"):
        load_workload(write(tmp_path, body))


def test_make_batch_needing_a_length_requires_max_len(tmp_path):
    with pytest.raises(SettingError, match="give max_len") as info:  # the Python keyword here
        load_workload(write(tmp_path, GOOD))
    assert info.value.worded("flag").endswith("give --max-len")  # the CLI names the flag
    assert info.value.worded("config").endswith("give max_len")  # a config, its key


@pytest.mark.parametrize("flag, kwargs", [("--batch-size", {"batch_size": 0}), ("--max-len", {"max_len": -3})])
def test_non_positive_sizes_are_rejected(tmp_path, flag, kwargs):
    (keyword,) = kwargs
    with pytest.raises(SettingError, match=f"^{keyword} must be a positive integer") as info:
        load_workload(write(tmp_path, GOOD), **kwargs)
    assert info.value.worded("flag").startswith(f"{flag} must be a positive integer")


def test_other_suffixes_are_rejected(tmp_path):
    with pytest.raises(UsageError, match="neither a Python file"):
        load_workload(str(tmp_path / "model.yaml"))


FAILING_FILES = {
    "syntax": ("import torch\ndef build_model(:\n    pass\n", 2, "SyntaxError"),
    "import": ("import torch\nimport not_a_module_anywhere\n", 2, "ModuleNotFoundError"),
    "no build_model": ("x = 1\n", None, "defines neither build_model() nor a module-level `model`"),
    "build_model raises": ("def build_model():\n    raise RuntimeError('no config here')\n", 2, "RuntimeError"),
    "forward raises": (textwrap.dedent("""\
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 2)
            def forward(self, x):
                raise ValueError("shapes do not line up")
        def build_model():
            return Net()
        def make_batch(batch_size, max_len):
            return torch.randn(batch_size, 8)
    """), 7, "ValueError: shapes do not line up"),
}


@pytest.mark.parametrize("case", FAILING_FILES)
def test_each_failing_model_file_is_one_line_with_file_line_and_exit_2(tmp_path, case):
    from click.testing import CliRunner

    from memcheck.cli import main

    body, line, what = FAILING_FILES[case]
    path = write(tmp_path, body)
    result = CliRunner().invoke(main, [path, "--max-len", "8", "--device", "cpu"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memcheck: error: "), result.output
    assert (f"{path}:{line}:" if line else f"{path}:") in lines[0] and what in lines[0]
    debug = CliRunner().invoke(main, [path, "--max-len", "8", "--device", "cpu", "--debug"])
    assert debug.exit_code == 2 and "Traceback (most recent call last)" in debug.output
