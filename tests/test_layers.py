"""The package's layers: imports run downward only, and no module imports itself in a cycle;
private torch names come through ``memcheck.compat`` only.

The import graph is read from the source with ``ast`` (module-level and function-level
imports; those under ``if TYPE_CHECKING:`` are for typing only and do not count), so
the check needs nothing imported. Each top-level module or subpackage of ``memcheck``
sits in one layer; a module may import from its own layer and the layers below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "memcheck"

# Bottom to top: the pipeline (trace -> rules -> CUDA allocator and overheads -> training
# emulation -> engine -> reports and pictures -> front-ends), with what each part needs beneath it.
LAYERS = (
    ("compat",),  # the private torch APIs, per torch version (imports no memcheck module)
    ("errors", "units", "enums", "choices"),  # the vocabulary: exceptions, byte units, the choices, choice points
    ("cuda",),  # the GPU table, the caching-allocator simulation, CUDA context and workspaces
    ("rules",),  # the op-rule registry and the rules per device
    ("trace",),  # the TorchDispatchMode tracer and the device redirect
    ("training",),  # the traced loop, optimizers, checkpointing, one module per strategy family
    ("job",),  # one value for every setting of a job, and its spellings
    ("workloads",),  # model files and hf: configs, with their worst-case batches
    ("report",),  # frozen results, their text and JSON, the timeline
    ("engine",),  # estimate, compare, plan, preflight
    ("pictures", "measure"),  # memory_viz snapshots and plots; real runs to check against
    ("config_gate", "integrations"),  # front-ends: configs for `memcheck check`, trainer callbacks
    ("cli", "__main__", "__init__"),  # the command line and the public face
)


def layer_of(module: str, layers=LAYERS) -> int:
    """The layer index of ``memcheck.X...`` (by X), or of the package itself (``__init__``)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for rank, names in enumerate(layers):
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer; add {top!r} to tests/test_layers.py LAYERS")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _typing_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import node of ``tree``, except those inside ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _typing_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: the memcheck modules it imports}`` for every module under ``root``."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                # `from pkg import sub` imports the submodule sub when there is one
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names]
            deps.update(t for t in targets if t in files and t != name)
        graph[name] = deps
    return graph


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a, layers)}) imports {b} (layer {layer_of(b, layers)})"
                  for a, deps in graph.items() for b in deps if layer_of(b, layers) > layer_of(a, layers))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    for module in import_graph():
        layer_of(module)


def test_imports_run_downward_only():
    assert upward_imports(import_graph()) == []


def test_no_module_imports_itself_through_a_cycle():
    assert cycles(import_graph()) == []


def test_every_folder_of_modules_is_a_package_that_a_wheel_ships():
    # setuptools' find_packages (pyproject.toml) takes only folders with an __init__.py
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert [f for f in folders if not (f / "__init__.py").exists()] == []


def test_the_package_has_at_most_twelve_modules_at_its_top_level():
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 12, top


@pytest.fixture
def fake_package(tmp_path):
    """A copy-free stand-in: a tiny package laid out like memcheck, to break on purpose."""
    root = tmp_path / "memcheck"
    (root / "rules").mkdir(parents=True)
    (root / "engine").mkdir()
    (root / "__init__.py").write_text("from memcheck.engine.estimate import estimate\n")
    (root / "errors.py").write_text("")
    (root / "rules" / "__init__.py").write_text("")
    (root / "rules" / "registry.py").write_text("from memcheck.errors import x\n")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "estimate.py").write_text("from memcheck.rules.registry import r\n")
    return root


def test_the_check_passes_a_clean_package(fake_package):
    graph = import_graph(fake_package)
    assert graph["memcheck.engine.estimate"] == {"memcheck.rules.registry"}
    assert upward_imports(graph) == [] and cycles(graph) == []


def test_an_upward_import_added_on_purpose_fails_the_check(fake_package):
    # a rule reaching up into the engine, inside a function: still an import
    (fake_package / "rules" / "registry.py").write_text("def f():\n    from memcheck.engine import estimate\n")
    graph = import_graph(fake_package)
    assert upward_imports(graph) == [
        "memcheck.rules.registry (layer 3) imports memcheck.engine.estimate (layer 9)"]
    # and, since the engine imports the registry, a cycle as well
    assert cycles(graph) == [["memcheck.engine.estimate", "memcheck.rules.registry"]]


def test_an_import_cycle_added_on_purpose_fails_the_check(fake_package):
    (fake_package / "rules" / "other.py").write_text("from memcheck.rules import registry\n")
    (fake_package / "rules" / "registry.py").write_text("import memcheck.rules.other\n")
    assert cycles(import_graph(fake_package)) == [["memcheck.rules.other", "memcheck.rules.registry"]]


def test_typing_only_imports_do_not_count(fake_package):
    (fake_package / "rules" / "registry.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memcheck.engine.estimate import E\n")
    assert upward_imports(import_graph(fake_package)) == []


# The one module that imports torch's private names, and the one left to move to it.
PRIVATE_TORCH_ALLOWED = {"memcheck.compat"}


def _private(dotted: str) -> bool:
    """True when a dotted torch path names a private part (``_x``; dunders such as ``__version__`` are not)."""
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    """``torch._C._nn`` for that attribute chain, or None when it does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_torch_uses(root: Path = PACKAGE) -> list[str]:
    """Every ``from torch._x import``, ``from torch.x import _y``, ``import torch._x`` and
    ``torch._x`` attribute read, as ``module:line: what``, outside ``PRIVATE_TORCH_ALLOWED``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        if name in PRIVATE_TORCH_ALLOWED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # not a chain's outermost
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [a.name for a in node.names]
                if _private(node.module) or (node.module.split(".")[0] == "torch"
                                             and any(_private(f"torch.{n}") for n in names)):
                    what = f"from {node.module} import {', '.join(names)}"
            elif isinstance(node, ast.Import):
                bad = [a.name for a in node.names if _private(a.name)]
                what = f"import {', '.join(bad)}" if bad else None
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                dotted = _dotted(node)
                what = dotted if dotted and _private(dotted) else None
            if what:
                found.append(f"{name}:{node.lineno}: {what}")
    return found


def test_no_module_but_compat_imports_a_private_torch_name():
    assert private_torch_uses() == []


def test_a_private_torch_import_added_on_purpose_fails_the_check(fake_package):
    (fake_package / "rules" / "registry.py").write_text(
        "import torch\nimport torch._dynamo\nfrom torch._prims_common import x\nfrom torch.utils._pytree import f\n"
        "from torch.autograd.graph import _MultiHandle\nfrom torch.utils import checkpoint\n"
        "def g():\n    return torch._C._current_graph_task_id(), torch.__version__, torch.nn.Linear\n")
    assert private_torch_uses(fake_package) == [
        "memcheck.rules.registry:2: import torch._dynamo",
        "memcheck.rules.registry:3: from torch._prims_common import x",
        "memcheck.rules.registry:4: from torch.utils._pytree import f",
        "memcheck.rules.registry:5: from torch.autograd.graph import _MultiHandle",
        "memcheck.rules.registry:8: torch._C._current_graph_task_id",
    ]


# ---- the command line is generated from the settings' declarations (issue 33, items 3 and 7) ---------

MAX_COMMAND_PARAMETERS = 12  # named parameters of cli.estimate and cli.plan; the settings come as one mapping


def _declared(decorate):
    """The click parameter a decorator adds, built on a throwaway function."""

    def command():
        pass

    decorate(command)
    return command.__click_params__[-1]


def option_problems(command) -> list[str]:
    """Each option of ``command`` (a click command of memcheck.cli) that is neither generated from a
    job setting's declaration (``memcheck.job.setting``) nor one of the front-end options declared
    once in ``cli.FRONT_END_OPTIONS`` / ``cli.COMMAND_OPTIONS``; and each declared one it lacks."""
    import click

    from memcheck import cli
    from memcheck.job import SPELLING

    own = {**cli.FRONT_END_OPTIONS, **cli.COMMAND_OPTIONS[command.name]}
    problems, seen = [], set()
    for param in command.params:
        if isinstance(param, click.Argument):
            continue
        seen.add(param.name)
        if param.name in own:
            expected = _declared(own[param.name])
        elif param.name in SPELLING and SPELLING[param.name].option is not None:
            expected = _declared(cli._setting_option(SPELLING[param.name], command.name))
        else:
            problems.append(f"{command.name} {'/'.join(param.opts)}: not generated from a setting's declaration "
                            "(memcheck.job.setting) nor a front-end option of cli.FRONT_END_OPTIONS")
            continue
        if (param.to_info_dict(), param.help) != (expected.to_info_dict(), expected.help):
            problems.append(f"{command.name} {'/'.join(param.opts)}: written by hand, not as its declaration "
                            "generates it")
    problems += [f"{command.name}: lacks the front-end option {name}" for name in own if name not in seen]
    return problems


def parameter_problems(function) -> list[str]:
    import inspect

    named = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    if len(named) > MAX_COMMAND_PARAMETERS:
        return [f"{function.__name__} has {len(named)} named parameters (at most {MAX_COMMAND_PARAMETERS}: the "
                "settings come as one mapping, **options)"]
    return []


@pytest.mark.parametrize("name", ["estimate", "plan"])
def test_every_option_of_estimate_and_plan_is_generated_from_a_declaration(name):
    from memcheck import cli

    assert option_problems(getattr(cli, name)) == []


@pytest.mark.parametrize("name", ["estimate", "plan"])
def test_estimate_and_plan_take_at_most_twelve_named_parameters(name):
    from memcheck import cli

    assert parameter_problems(getattr(cli, name).callback) == []


def test_a_hand_written_option_added_on_purpose_fails_the_check():
    import click

    from memcheck import cli

    @click.command("estimate")
    @click.argument("model")
    @cli._settings_options
    @cli._command_options
    @click.option("--max-len", "max_len", type=int, help="written by hand, a second time")
    @click.option("--warp-speed", is_flag=True, help="a flag no setting declares")
    def estimate(model, compare, top, snapshot_path, plot_path, **options):
        pass

    problems = option_problems(estimate)
    assert any("--warp-speed: not generated" in p for p in problems), problems
    assert any("--max-len: written by hand" in p for p in problems), problems


def test_a_command_with_a_thirteenth_parameter_added_on_purpose_fails_the_check():
    def plan(model, a, b, c, d, e, f, g, h, i, j, k, m, **options):
        pass

    assert parameter_problems(plan) and not parameter_problems(lambda model, **options: None)


def test_the_command_line_reads_the_declarations_without_importing_torch():
    # cli builds estimate's and plan's options from memcheck.job at import; that must not load torch:
    # --help stays fast, and memcheck check forks its child only while torch is not loaded (cli._in_child)
    import subprocess
    import sys

    code = "import sys, memcheck.cli, memcheck.job; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, env={**__import__("os").environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.stdout.strip() == "False", out.stderr
