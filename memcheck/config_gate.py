"""Job configs for ``memcheck check``: TOML, JSON, YAML or ``[tool.memcheck]`` in pyproject.toml.

A file holds one job (its keys at the top level) or several, each a table under
``jobs``; keys at the top level beside ``jobs`` are defaults every job inherits::

    model = "train/model.py"      # relative to this file; or "hf:NAME_OR_DIR"
    gpu = "A100-80GB"
    max_len = 2048

    [jobs.pretrain]
    micro_batch = 8
    accumulation = 4
    precision = "amp-bf16"

    [jobs.finetune]
    micro_batch = 16
    checkpointing = "full"

The keys are the CLI's settings, spelled as ``fix_line(style="config")`` words a fix
(``JOB_KEYS``). Every value is checked here, before anything is traced: a wrong key,
type or name is a ``UsageError`` naming the file, the job, the key and what is allowed.

memcheck runs a model file's code, so a config may only name model files inside the
git repository that holds the config (outside a git repository: inside the config
file's own directory tree); a symlink is judged by where it points.
Checkpointed module names (``checkpointing = ["a.b", ...]``) are matched against the
model once it is loaded (``JobConfig.check_modules``), still before anything is traced.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

from memcheck.enums import Attention, Device, Offload, Precision, Strategy, Task
from memcheck.errors import UsageError, closest, require_int, require_margin, require_positive_number

# The keys of a job, in the order the docs list them.
JOB_KEYS = (
    "model", "max_len", "target_len", "micro_batch", "accumulation", "precision", "checkpointing", "optimizer",
    "strategy", "gpus", "gpu", "gpu_memory", "device", "margin", "task", "attn", "eval_batch",
    "eval_accumulate_predictions", "reentrant", "offload", "bucket_view", "bucket_cap_mb",
)
JOBS = "jobs"  # the table of named jobs
SUFFIXES = (".toml", ".json", ".yaml", ".yml")
PYPROJECT = "pyproject.toml"


def _positive(key):
    return lambda v: require_int(v, key, message=f"{key} must be a positive integer, got {v!r}")


def _choice(cls, key):
    def check(v):
        if not isinstance(v, str):
            raise UsageError(f"{key} must be a string, one of: {', '.join(m.value for m in cls)}; got {v!r}")
        return cls.parse(v, what=key)
    return check


def _flag(key):
    def check(v):
        if not isinstance(v, bool):
            raise UsageError(f"{key} must be true or false, got {v!r}")
        return v
    return check


def _model(v):
    if not isinstance(v, str) or not v.strip():
        raise UsageError(f"model must be a string: a model file (*.py) or hf:NAME_OR_DIR; got {v!r}")
    return v


def _checkpointing(v):
    if isinstance(v, str):
        if v.strip().lower() in ("none", "full"):
            return v.strip().lower()
        hint = closest(v.strip().lower(), ("none", "full"))
        raise UsageError(f"checkpointing {v!r} is neither 'none' nor 'full'{hint}; "
                         "name modules as a list, such as [\"transformer.h.0\", \"transformer.h.2\"]")
    if isinstance(v, (list, tuple)) and v and all(isinstance(n, str) and n.strip() for n in v):
        return tuple(n.strip() for n in v)
    raise UsageError(f"checkpointing must be 'none', 'full' or a non-empty list of module names or patterns; got {v!r}")


def _optimizer(v):
    from memcheck.training.optimizers import OPTIMIZERS

    if v is None:
        return None
    if not isinstance(v, str) or v.strip().lower() not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {v!r}{closest(str(v).strip().lower(), OPTIMIZERS)}; "
                         f"allowed: {', '.join(OPTIMIZERS)}")
    return v.strip().lower()


def _gpu(v):
    from memcheck.cuda.gpus import resolve_gpu

    if v is None:
        return None
    if not isinstance(v, str):
        raise UsageError(f"gpu must be a string: a GPU name such as 'A100-80GB' or a size such as '24GiB'; got {v!r}")
    try:
        resolve_gpu(v)  # a name or a size: never the local GPU, which only None asks for
    except UsageError as exc:
        raise UsageError(f"gpu: {exc}") from None
    return v


def _gpu_memory(v):
    from memcheck.units import parse_size

    if v is None or isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise UsageError(f"gpu_memory must be a size such as '24GiB' or a byte count; got {v!r}")
    return parse_size(v, what="gpu_memory")


def _margin(v):
    return None if v is None else float(require_margin(v))


def _eval_keep(v):
    return require_int(v, "eval_accumulate_predictions", minimum=0,
                       message=f"eval_accumulate_predictions must be an integer of 0 or more, got {v!r}")


def _bucket_cap(v):
    return None if v is None else require_positive_number(v, "bucket_cap_mb")


def _optional(check):
    return lambda v: None if v is None else check(v)


# key -> the function that checks a value and returns it normalised (idempotent)
_CHECKS = {
    "model": _model,
    "max_len": _optional(_positive("max_len")),
    "target_len": _optional(_positive("target_len")),
    "micro_batch": _positive("micro_batch"),
    "accumulation": _positive("accumulation"),
    "precision": _choice(Precision, "precision"),
    "checkpointing": _checkpointing,
    "optimizer": _optimizer,
    "strategy": _choice(Strategy, "strategy"),
    "gpus": _optional(_positive("gpus")),
    "gpu": _gpu,
    "gpu_memory": _gpu_memory,
    "device": _choice(Device, "device"),
    "margin": _margin,
    "task": _optional(_choice(Task, "task")),
    "attn": _optional(_choice(Attention, "attn")),
    "eval_batch": _optional(_positive("eval_batch")),
    "eval_accumulate_predictions": _eval_keep,
    "reentrant": _flag("reentrant"),
    "offload": _choice(Offload, "offload"),
    "bucket_view": _flag("bucket_view"),
    "bucket_cap_mb": _bucket_cap,
}
assert tuple(_CHECKS) == JOB_KEYS


def _label(file: str, where: str) -> str:
    """How messages and results name a job: the file, and its table when there is one."""
    return f"{file} [{where}]" if where else file


# The CLI flags that loading a model names in its messages (model_source, hf), as a config spells them.
_FLAG_KEYS = {"--max-len": "max_len", "--target-len": "target_len", "--batch-size": "micro_batch",
              "--task": "task", "--attn": "attn"}
_FLAG = re.compile("|".join(re.escape(flag) + r"\b" for flag in _FLAG_KEYS))


def in_config_words(message: str) -> str:
    """``message`` with the CLI flags it names spelled as config keys (``--max-len`` as ``max_len``)."""
    return _FLAG.sub(lambda m: _FLAG_KEYS[m.group(0)], message)


@dataclass(frozen=True)
class JobConfig:
    """One job of a config file: a model and the settings ``memcheck.check`` judges it at.

    ``model`` is what ``load_workload`` takes: a model file's absolute path (the loader
    resolves it against the config file and refuses one outside the config's
    repository) or ``hf:NAME_OR_DIR``. Values are checked and normalised here
    (strings to enums, module lists to tuples); a job needs a capacity, ``gpu`` or
    ``gpu_memory``. Only ``None`` means the local GPU to ``memcheck.check``; a job
    never does: on the cuda target ``gpu_memory`` alone is an unnamed GPU of that size,
    so a config gets the same answer on every machine.
    """

    file: str  # the config file, as it was named
    where: str  # the job's table in the file: "jobs.NAME", "tool.memcheck", ... or "" (the top level)
    model: str
    max_len: int | None = None
    target_len: int | None = None
    micro_batch: int = 1
    accumulation: int = 1
    precision: Precision | str = Precision.FP32
    checkpointing: str | tuple[str, ...] = "none"
    optimizer: str | None = None  # None: the model file's make_optimizer, else adamw
    strategy: Strategy | str = Strategy.SINGLE
    gpus: int | None = None
    gpu: str | None = None
    gpu_memory: int | str | None = None  # bytes once checked
    device: Device | str = Device.CUDA
    margin: float | None = None  # None: memcheck.engine.plan.DEFAULT_MARGIN
    task: Task | str | None = None
    attn: Attention | str | None = None
    eval_batch: int | None = None
    eval_accumulate_predictions: int = 0
    reentrant: bool = False
    offload: Offload | str = Offload.NONE
    bucket_view: bool = False
    bucket_cap_mb: float | None = None
    name: str | None = None  # the job's name under jobs; None for a file's single job

    def __post_init__(self):
        for key in JOB_KEYS:
            try:
                object.__setattr__(self, key, _CHECKS[key](getattr(self, key)))
            except UsageError as exc:
                raise UsageError(f"{self.label}: {exc}") from None
        if self.gpu is None and self.gpu_memory is None:
            raise UsageError(f"{self.label}: no capacity to judge the job against; add gpu = \"A100-80GB\" "
                             "(a GPU name or a size such as \"24GiB\") or gpu_memory = \"24GiB\"")
        if self.device is Device.CPU and self.gpu is not None:
            raise UsageError(f"{self.label}: gpu = {self.gpu!r} applies to device = \"cuda\" only; "
                             "give the CPU's budget as gpu_memory")
        if self.eval_accumulate_predictions and self.eval_batch is None:
            raise UsageError(f"{self.label}: eval_accumulate_predictions needs eval_batch (the evaluation batch size)")
        from memcheck.training.strategies import StrategyConfig

        try:
            StrategyConfig.parse(self.strategy, self.gpus, bucket_view=self.bucket_view,
                                 bucket_cap_mb=self.bucket_cap_mb, offload=self.offload)
        except UsageError as exc:
            raise UsageError(f"{self.label}: {exc}") from None

    @property
    def label(self) -> str:
        """``FILE [TABLE]``, as messages and results name the job."""
        return _label(self.file, self.where)

    def check_modules(self, model) -> None:
        """Raise UsageError, naming the job, when a pattern of ``checkpointing`` matches no
        module of ``model`` (run on the loaded model, before anything is traced)."""
        if isinstance(self.checkpointing, str):
            return
        names = [n for n, _ in model.named_modules() if n]
        for pattern in self.checkpointing:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise UsageError(f"{self.label}: checkpointing: no module of {type(model).__name__} is named "
                                 f"{pattern!r}{closest(pattern, names)} (names look like {', '.join(names[:3])}, ...)")

    def check_kwargs(self) -> dict:
        """The job's settings as ``memcheck.check`` keyword arguments (the model and
        batch, ``max_len``, ``optimizer`` and ``loss_fn`` come from the workload)."""
        from memcheck.cuda.gpus import sized_gpu

        gpu = self.gpu
        if gpu is None and self.device is Device.CUDA:
            gpu = sized_gpu(self.gpu_memory)
        return dict(
            batch_size=self.micro_batch, device=self.device, gpu=gpu, budget_bytes=self.gpu_memory,
            margin=self.margin, precision=self.precision, accumulate=self.accumulation,
            checkpointing=self.checkpointing if isinstance(self.checkpointing, str) else list(self.checkpointing),
            strategy=self.strategy, gpus=self.gpus, eval_batch_size=self.eval_batch,
            eval_accumulate_predictions=self.eval_accumulate_predictions, use_reentrant=self.reentrant,
            bucket_view=self.bucket_view, bucket_cap_mb=self.bucket_cap_mb, offload=self.offload.value,
        )


def load_configs(paths) -> tuple[list[JobConfig], list[str]]:
    """Read every config file; return its jobs, and the pyproject.toml files without a
    ``[tool.memcheck]`` table (skipped: pyproject.toml is every tool's file, and a
    pre-commit hook passes it whenever it changes). Files named twice are read once.

    Raises:
        UsageError: for the first file, job or key that is wrong, naming it.
    """
    jobs, skipped, seen = [], [], set()
    for path in paths:
        key = Path(path).resolve()
        if key in seen:
            continue
        seen.add(key)
        found = load_config(path)
        if found is None:
            skipped.append(str(path))
        else:
            jobs.extend(found)
    return jobs, skipped


def load_config(path) -> list[JobConfig] | None:
    """The jobs of one config file; None for a pyproject.toml without ``[tool.memcheck]``.

    Raises:
        UsageError: naming the file, the job and the key, for an unreadable file, an
            unknown key (with the closest one), a wrong type or name, or no jobs at all.
    """
    file = str(path)
    path = Path(path)
    data = _read(path)
    prefix = ""
    if path.name == PYPROJECT:
        table = data.get("tool", {}).get("memcheck") if isinstance(data.get("tool"), dict) else None
        if table is None:
            return None
        data, prefix = table, "tool.memcheck"
    if not isinstance(data, dict):
        raise UsageError(f"{_label(file, prefix)}: a config is a table of settings (and [jobs.NAME] tables), "
                         f"not a {type(data).__name__}")
    if not data:
        raise UsageError(f"{_label(file, prefix)}: no jobs; give a job's settings (model, gpu, micro_batch, ...) "
                         "at the top level, or one table per job under jobs")
    defaults = _settings(data, file, prefix, top=True, path=path)
    if JOBS not in data:
        return [_job(defaults, file, prefix, None)]
    where = f"{prefix}.{JOBS}" if prefix else JOBS
    tables = data[JOBS]
    if not isinstance(tables, dict) or not tables:
        raise UsageError(f"{_label(file, where)}: jobs must be a table of named jobs, such as [jobs.small], "
                         f"[jobs.large]; got {tables!r}")
    jobs = []
    for name, table in tables.items():
        job_where = f"{where}.{name}"
        if not isinstance(table, dict):
            raise UsageError(f"{_label(file, job_where)}: a job is a table of settings, got {table!r}")
        jobs.append(_job({**defaults, **_settings(table, file, job_where, top=False, path=path)}, file, job_where,
                         str(name)))
    return jobs


def _settings(table: dict, file: str, where: str, *, top: bool, path: Path) -> dict:
    """One table's job settings, each checked where it is written (a model file is
    resolved against the config file ``path``)."""
    allowed = JOB_KEYS + ((JOBS,) if top else ())
    out = {}
    for key, value in table.items():
        if key == JOBS and top:
            continue
        if key not in JOB_KEYS:
            hint = "; jobs are tables under [jobs] at the top level" if key == JOBS else ""
            raise UsageError(f"{_label(file, where)}: unknown key {key!r}{closest(key, allowed)}{hint}; "
                             f"allowed: {', '.join(allowed)}")
        try:
            value = resolve_model(_model(value), path) if key == "model" else _CHECKS[key](value)
        except UsageError as exc:
            raise UsageError(f"{_label(file, where)}: {exc}") from None
        out[key] = value
    return out


def _job(settings: dict, file: str, where: str, name: str | None) -> JobConfig:
    if "model" not in settings:
        raise UsageError(f"{_label(file, where)}: no model; add model = \"path/to/model.py\" (relative to the "
                         "config file) or model = \"hf:NAME_OR_DIR\"")
    return JobConfig(file=file, where=where, name=name, **settings)


def project_root(config: Path) -> Path:
    """The git repository holding ``config`` (a directory with ``.git``), else the config's directory."""
    here = config.resolve().parent
    for d in (here, *here.parents):
        if (d / ".git").exists():
            return d
    return here


def resolve_model(model: str, config: Path) -> str:
    """A config's ``model`` as ``load_workload`` takes it: a model file resolved against the
    config's directory (it must lie inside ``project_root(config)``), or ``hf:NAME_OR_DIR``
    (a directory is resolved against the config's directory when it exists there)."""
    base = config.resolve().parent
    if model.startswith("hf:"):
        name = model[3:]
        return f"hf:{(base / name).resolve()}" if name and (base / name).is_dir() else model
    if not model.endswith(".py"):
        raise UsageError(f"model {model!r} is neither a model file (*.py) nor hf:NAME_OR_DIR")
    target = (base / model).resolve()  # follows symlinks: a link is judged by where it points
    root = project_root(config)
    if not target.is_relative_to(root):
        inside = ("the git repository holding the config" if (root / ".git").exists()
                  else "the config file's directory (no git repository holds it)")
        raise UsageError(f"model {model!r} is {target}, outside {root} ({inside}); memcheck runs a model "
                         "file's code, so a config may name only model files inside its own repository")
    if not target.is_file():
        near = [p.name for p in target.parent.glob("*.py")] if target.parent.is_dir() else []
        raise UsageError(f"model {model!r}: no such file ({target}){closest(Path(model).name, near)}")
    return str(target)


def _read(path: Path):
    """The file's data: a dict for a well-formed config (any value for JSON or YAML)."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UsageError(f"{path}: not a memcheck config; use a .toml, .json, .yaml or .yml file, or "
                         f"{PYPROJECT} with a [tool.memcheck] table")
    if not path.is_file():
        raise UsageError(f"{path}: no such config file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot be read: {exc}") from None
    if suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise UsageError(f"{path}: reading TOML on Python 3.10 needs tomli: pip install tomli") from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{path}: not valid TOML: {exc}") from None
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: not valid JSON: {exc}") from None
    try:
        import yaml
    except ImportError:
        raise UsageError(f"{path}: reading YAML needs PyYAML: pip install pyyaml") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()
        raise UsageError(f"{path}: not valid YAML: {' '.join(s.strip() for s in first)}") from None
