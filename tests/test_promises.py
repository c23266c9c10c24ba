"""Issue 24: the four promises of the Safety page (docs/safety.md; the README's section until
issue 37), each tried as an unlucky user or an attacker would: no CUDA initialised, no network
without --allow-download, no code from outside the repository (nor custom hf: code without
--trust-remote-code), nothing written.

Every test here is in-process (CliRunner) on a model of a few hundred parameters."""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch
from click.testing import CliRunner
from transformers import GPT2Config

from memcheck.cli import main
from memcheck.config_gate import load_config
from memcheck.errors import UsageError
from memcheck.workloads.source import load_workload

# A model whose code reaches for the GPU and prints, as model files do.
MODEL = '''
import torch
from torch import nn

print("model file imported")


def build_model():
    print("building")
    torch.cuda.synchronize()
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()


def make_batch(batch_size, max_len=None):
    return torch.randn(batch_size, 8, device="cuda")


def compute_loss(model, batch):
    print("forward")
    return model(batch).sum()
'''
CONFIG = 'model = "model.py"\ngpu = "T4"\nmicro_batch = 2\n'


def run(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "model.py").write_text(MODEL)
    (root / "memcheck.toml").write_text(CONFIG)
    return root


def _gpt2_dir(path, **extra):
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0,
                        eos_token_id=0, architectures=["GPT2LMHeadModel"], **extra)
    config.save_pretrained(path)
    return path


# -- 1. no CUDA initialised -------------------------------------------------------------------------------


@pytest.fixture
def cuda_build(monkeypatch):
    """This CPU torch dressed as a CUDA 13.0 build with a GPU visible: every entry point that
    starts CUDA (or, like torch.backends.cudnn.version(), checks devices and so starts it)
    records its name and raises. Returns the list of names."""
    from memcheck.workloads import hf

    # bitsandbytes (which PEFT, and so TrainingArguments, imports) is imported first, as the CPU
    # build it is: imported under a CUDA dress it would stay half set up for CUDA for every later
    # test. That its import runs under the stand-ins is test_third_party_imports_run_cuda_stubbed.
    hf._training_arguments()
    started: list[str] = []

    def starts(name):
        def start(*args, **kwargs):
            started.append(name)
            raise AssertionError(f"{name} initialised CUDA")
        return start

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    for module in (torch.cuda, sys.modules.get("torch.cuda.memory"), sys.modules.get("torch.cuda.random")):
        if module is not None and hasattr(module, "_lazy_init"):
            monkeypatch.setattr(module, "_lazy_init", starts(f"{module.__name__}._lazy_init"))
    monkeypatch.setattr(torch.cuda, "init", starts("torch.cuda.init"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", starts("torch.cuda.get_device_properties"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", starts("torch.cuda.get_device_capability"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", starts("torch.cuda.mem_get_info"))
    monkeypatch.setattr(torch.backends.cudnn, "version", starts("torch.backends.cudnn.version"))
    monkeypatch.setattr(torch._C, "_cuda_init", starts("torch._C._cuda_init"), raising=False)
    return started


@pytest.mark.parametrize("command", ["estimate", "plan", "check"])
def test_no_command_initialises_cuda_on_a_cuda_build(repo, cuda_build, command):
    # The model calls torch.cuda.synchronize(), .cuda() and device="cuda": all redirected. Before
    # issue 24 estimate called torch.backends.cudnn.version(), outside the redirect.
    args = {"estimate": ["estimate", repo / "model.py", "--gpu", "T4", "-b", "2"],
            "plan": ["plan", repo / "model.py", "--gpu", "T4", "--precision", "fp32",
                     "--checkpointing-options", "none"],
            "check": ["check", repo / "memcheck.toml"]}[command]
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert cuda_build == []
    assert not torch.cuda.is_initialized()


def test_an_hf_estimate_initialises_no_cuda_on_a_cuda_build(tmp_path, cuda_build):
    # transformers asks torch.cuda about the device in places; the config and model are read
    # and built with CUDA redirected.
    result = run(f"hf:{_gpt2_dir(tmp_path / 'gpt2')}", "--gpu", "T4", "--max-len", "8")
    assert result.exit_code == 0, result.output
    assert cuda_build == []


def test_third_party_imports_run_cuda_stubbed(monkeypatch):
    # bitsandbytes' cuda_specs.get_compute_capabilities() calls torch.cuda.get_device_capability
    # for every GPU when PEFT imports it: that starts CUDA. Its imports are made with the
    # torch.cuda stand-ins installed (memcheck.trace.device_redirect.cuda_stubbed).
    import contextlib

    from memcheck.training import adapters
    from memcheck.workloads import hf

    entered = []

    @contextlib.contextmanager
    def stubbed(gpu=None):
        entered.append(True)
        yield

    monkeypatch.setattr(hf, "cuda_stubbed", stubbed)
    monkeypatch.setattr("memcheck.trace.device_redirect.cuda_stubbed", stubbed)
    hf._training_arguments()
    adapters._peft()
    assert entered == [True, True]


# -- 2. no network without --allow-download -----------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails loudly and is recorded; the environment says HF_HUB_OFFLINE=0,
    and huggingface_hub is as if imported under it."""
    import huggingface_hub.constants

    tried: list[object] = []

    def connect(*args, **kwargs):
        tried.append(args)
        raise AssertionError(f"memcheck connected to the network: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect)
    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "false")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return tried


def test_hf_hub_offline_0_in_the_environment_does_not_let_memcheck_connect(tmp_path, no_network):
    import huggingface_hub.constants

    result = run(f"hf:{_gpt2_dir(tmp_path / 'gpt2')}", "--device", "cpu", "--max-len", "8")
    assert result.exit_code == 0, result.output
    # A hub name that is not cached: before issue 24, huggingface_hub connected (to fetch its
    # agent registry) even with local_files_only=True.
    result = run("hf:memcheck-tests/no-such-model", "--device", "cpu")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "pass --allow-download to fetch it" in result.stderr
    assert no_network == []
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True


# -- 3. no code from outside the repository, and custom code only when asked ------------------------------


CUSTOM = {"model_type": "memcheck_custom", "architectures": ["CustomModel"],
          "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                       "AutoModelForCausalLM": "modeling_custom.CustomModel"}}
RAN = "open(__file__ + '.ran', 'w').write('ran')  # the proof that this file's code ran\n"


def _custom_dir(path, code_dir=None):
    """An hf: directory whose config.json's auto_map names custom code (in ``code_dir``, linked
    in, when given); the code leaves a file behind if it ever runs."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CUSTOM))
    for module in ("configuration_custom", "modeling_custom"):
        if code_dir is None:
            (path / f"{module}.py").write_text(RAN)
        else:
            (code_dir / f"{module}.py").write_text(RAN)
            (path / f"{module}.py").symlink_to(code_dir / f"{module}.py")
    return path


def test_custom_hf_code_is_refused_without_the_flag_even_with_yes_on_stdin(tmp_path, monkeypatch):
    # Before issue 24 transformers asked "run the custom code? [y/N]" on stdin: `yes | memcheck`
    # ran it (and copied it into the module cache).
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not the user's cache
    monkeypatch.setattr(sys, "path", list(sys.path))
    model = _custom_dir(tmp_path / "custom")
    result = run(f"hf:{model}", "--device", "cpu", input="y\n" * 20)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "--trust-remote-code" in result.stderr, result.stderr
    assert "configuration_custom" in result.stderr
    assert not list(tmp_path.rglob("*.ran"))


def test_with_the_flag_the_custom_code_runs_and_its_failure_is_one_line(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not the user's cache
    monkeypatch.setattr(sys, "path", list(sys.path))
    model = _custom_dir(tmp_path / "custom")
    result = run(f"hf:{model}", "--device", "cpu", "--trust-remote-code")
    for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
        monkeypatch.delitem(sys.modules, name)
    assert list(tmp_path.rglob("configuration_custom.py.ran"))  # run (from its copy): the flag reached transformers
    # the file defines no CustomConfig: the user's code failed, a bad input (2), not memcheck's bug (3)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "custom code (trust_remote_code) failed" in result.stderr


def test_trust_remote_code_reaches_transformers_as_true_or_false_never_none(tmp_path, monkeypatch):
    import transformers

    from memcheck.workloads import hf

    seen = []

    def from_pretrained(name, **kwargs):
        seen.append(kwargs.get("trust_remote_code", "missing"))
        return GPT2Config()

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    directory = _gpt2_dir(tmp_path / "gpt2")
    hf.load_config(str(directory))
    hf.load_config(str(directory), trust_remote_code=True)
    hf.load_config("gpt2")
    assert seen == [False, True, False]


def test_check_refuses_trust_remote_code_unless_the_code_is_in_the_repository(repo, tmp_path):
    _custom_dir(repo / "custom")
    (repo / "memcheck.toml").write_text('model = "hf:custom"\ngpu = "T4"\ntrust_remote_code = true\n')
    (job,) = load_config(repo / "memcheck.toml")  # the code lies in the repository
    assert job.job.trust_remote_code is True
    for model in ("hf:gpt2", "model.py"):  # a hub name's code is the hub cache's
        (repo / "memcheck.toml").write_text(f'model = "{model}"\ngpu = "T4"\ntrust_remote_code = true\n')
        with pytest.raises(UsageError, match="trust_remote_code = true runs the code"):
            load_config(repo / "memcheck.toml")
    (tmp_path / "outside").mkdir()
    _custom_dir(repo / "linked", code_dir=tmp_path / "outside")  # links to code outside
    (repo / "memcheck.toml").write_text('model = "hf:linked"\ngpu = "T4"\ntrust_remote_code = true\n')
    with pytest.raises(UsageError, match="outside"):
        load_config(repo / "memcheck.toml")
    result = run("check", repo / "memcheck.toml")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output


def test_check_refuses_an_hf_directory_outside_the_repository(repo, tmp_path):
    _gpt2_dir(tmp_path / "outside")
    (repo / "memcheck.toml").write_text('model = "hf:../outside"\ngpu = "T4"\n')
    with pytest.raises(UsageError, match="outside"):
        load_config(repo / "memcheck.toml")
    (repo / "inside").symlink_to(tmp_path / "outside")  # a link is judged by where it points
    (repo / "memcheck.toml").write_text('model = "hf:inside"\ngpu = "T4"\n')
    with pytest.raises(UsageError, match="outside"):
        load_config(repo / "memcheck.toml")


def test_a_config_linked_to_a_file_outside_the_repository_runs_no_model_beside_its_target(repo, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.py").write_text(MODEL)
    (elsewhere / "memcheck.toml").write_text(CONFIG)
    (repo / "memcheck.toml").unlink()
    (repo / "memcheck.toml").symlink_to(elsewhere / "memcheck.toml")
    with pytest.raises(UsageError, match="outside"):
        load_config(repo / "memcheck.toml")


# -- 4. nothing written --------------------------------------------------------------------------------


def test_loading_a_model_file_writes_no_bytecode_beside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python's default
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "layers_for_memcheck_test.py").write_text("from torch import nn\nLinear = nn.Linear\n")
    (tmp_path / "model.py").write_text("import layers_for_memcheck_test as layers\nfrom torch import nn\n"
                                       "model = nn.Sequential(layers.Linear(8, 4))\n"
                                       "def make_batch(batch_size, max_len=None):\n"
                                       "    import torch\n    return torch.randn(batch_size, 8)\n")
    try:
        load_workload(str(tmp_path / "model.py"))
    finally:
        sys.modules.pop("layers_for_memcheck_test", None)
    assert not (tmp_path / "__pycache__").exists()
    assert sys.dont_write_bytecode is False  # restored


def test_a_models_prints_go_to_stderr_and_the_json_stays_whole(repo):
    result = run(repo / "model.py", "--gpu", "T4", "-b", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == "model"
    assert "model file imported" in result.stderr and "forward" in result.stderr
    result = run("check", repo / "memcheck.toml", "--json")
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)
