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

memcheck runs a model file's code, so a config may only name model files (and ``hf:``
directories) inside the git repository that holds the config (outside a git repository:
inside the config file's own directory tree); a symlink is judged by where it points, and a
config that is itself a symlink by where the link is. ``trust_remote_code = true`` is
accepted only for an ``hf:`` directory whose ``auto_map`` code lies inside that repository.
Checkpointed module names (``checkpointing = ["a.b", ...]``) are matched against the
model once it is loaded (``JobConfig.check_modules``), still before anything is traced.

A DeepSpeed JSON config is a job too, with the model and the GPU named beside it
(``memcheck check ds_config.json --model MODEL --gpu GPU``: ``JobConfig.from_deepspeed``;
in Python ``deepspeed_job``); ``memcheck.workloads.deepspeed`` maps its keys.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memcheck.enums import Device
from memcheck.errors import UsageError, closest
from memcheck.job import SPELLING, SPELLINGS, VALUE_ALIASES, Job, SettingError, check_setting, translate_alias
from memcheck.training.checkpointing import parse_checkpointing
from memcheck.workloads.trainer_files import check_config_size, parse_data, parse_limited, read_data

# The keys of a job: the model, then the job's settings as configs spell them (memcheck.job.SPELLINGS).
_FIELD = {s.config: s.field for s in SPELLINGS if s.config}
TRAINER_CONFIG = "trainer_config"  # a TrainingArguments / LightningCLI / accelerate / DeepSpeed file
JOB_KEYS = ("model", TRAINER_CONFIG, *_FIELD)
# HF TrainingArguments / Lightning names accepted for a config key (the Job's one table of spellings)
_ALIASES = {alias: s.config for s in SPELLINGS if s.config for alias in s.aliases}
JOBS = "jobs"  # the table of named jobs
SUFFIXES = (".toml", ".json", ".yaml", ".yml")
PYPROJECT = "pyproject.toml"


def _model(v):
    if not isinstance(v, str) or not v.strip():
        raise UsageError(f"model must be a string: a model file (*.py) or hf:NAME_OR_DIR; got {v!r}")
    return v


def _checkpointing(v):
    """A config spells modules as a list: a string is 'none', 'full', 'half', 'every:N' or 'selective-op' (a typo is
    not a module name)."""
    if isinstance(v, str):
        text = v.strip().lower()
        if text.startswith("every:"):
            return parse_checkpointing(text)  # names a bad N
        if text not in ("none", "full", "half", "selective-op"):
            hint = closest(text, ("none", "full", "half", "selective-op"))
            raise UsageError(f"checkpointing {v!r} is none of 'none', 'full', 'half', 'every:N' or 'selective-op'{hint}; "
                             "name modules as a list, such as [\"transformer.h.0\", \"transformer.h.2\"]")
    if not isinstance(v, str) and not (isinstance(v, (list, tuple)) and v
                                       and all(isinstance(n, str) and n.strip() for n in v)):
        raise UsageError(f"checkpointing must be 'none', 'full', 'half', 'every:N', 'selective-op' or a non-empty "
                         f"list of module names or patterns; got {v!r}")
    return v


def check_key(key: str, value):
    """One config key's value, checked and normalised by the job's own checks (named as the key)."""
    if key == "model":
        return _model(value)
    if key == "checkpointing":
        _checkpointing(value)
    if key == "gpu" and value is not None and not isinstance(value, str):
        raise UsageError(f"gpu must be a string: a GPU name such as 'A100-80GB' or a size such as '24GiB'; "
                         f"got {value!r}")
    try:
        return check_setting(_FIELD[key], value)
    except SettingError as exc:
        raise UsageError(exc.worded("config")) from None


def _label(file: str, where: str) -> str:
    """How messages and results name a job: the file, and its table when there is one."""
    return f"{file} [{where}]" if where else file


@dataclass(frozen=True)
class JobConfig:
    """One job of a config file: a model and the ``Job`` that ``memcheck.check`` judges it at.

    ``model`` is what ``load_workload`` takes: a model file's absolute path (the loader
    resolves it against the config file and refuses one outside the config's
    repository) or ``hf:NAME_OR_DIR``. ``JobConfig.parse`` checks the settings, given as
    config keys (``memcheck.job.SPELLINGS``), with the job's own checks, naming each
    as the config spells it; a job needs a capacity, ``gpu`` or ``gpu_memory``. Only
    ``None`` means the local GPU to ``memcheck.check``; a job never does: on the cuda
    target ``gpu_memory`` alone is an unnamed GPU of that size, so a config gets the
    same answer on every machine.
    """

    file: str  # the config file, as it was named
    where: str  # the job's table in the file: "jobs.NAME", "tool.memcheck", ... or "" (the top level)
    model: str
    job: Job
    optimizer: str | None = None  # as the config names it; None: the model file's make_optimizer, else adamw
    name: str | None = None  # the job's name under jobs; None for a file's single job
    notes: tuple[str, ...] = ()  # a DeepSpeed config's keys read and not modelled (memcheck.workloads.deepspeed)
    deepspeed: Any = None  # a DeepSpeed config's DeepSpeedSettings: its "auto" bucket sizes, filled from the model

    @classmethod
    def parse(cls, *, file: str, where: str, model: str, name: str | None = None, **settings) -> "JobConfig":
        """The job of a config table whose ``settings`` are config keys.

        Raises:
            UsageError: naming the file, the job and the key.
        """
        label = _label(file, where)
        try:
            model = _model(model)
            unknown = sorted(set(settings) - set(_FIELD))
            if unknown:
                raise UsageError(f"unknown key {unknown[0]!r}{closest(unknown[0], JOB_KEYS)}; "
                                 f"allowed: {', '.join(JOB_KEYS)}")
            checked = {key: check_key(key, value) for key, value in settings.items()}
            if checked.get("gpu") is not None and checked.get("device") is Device.CPU:
                raise UsageError(f"gpu = {checked['gpu']!r} applies to device = \"cuda\" only; "
                                 "give the CPU's budget as gpu_memory")
            job = Job.from_settings(checked, vocabulary="config")
        except UsageError as exc:
            raise UsageError(f"{label}: {exc}") from None
        if job.gpu is None and job.budget_bytes is None:
            raise UsageError(f"{label}: no capacity to judge the job against; add gpu = \"A100-80GB\" "
                             "(a GPU name or a size such as \"24GiB\") or gpu_memory = \"24GiB\"")
        if job.eval_accumulate_predictions and job.eval_batch_size is None:
            raise UsageError(f"{label}: eval_accumulate_predictions needs eval_batch (the evaluation batch size)")
        return cls(file=file, where=where, model=model, job=job, optimizer=checked.get("optimizer"), name=name)

    @classmethod
    def from_deepspeed(cls, path, model: str, **settings) -> "JobConfig":
        """The job of a DeepSpeed JSON config (``memcheck check ds_config.json --model MODEL``): its
        keys mapped by ``memcheck.workloads.deepspeed.read_deepspeed``, with ``model`` and the
        ``settings`` a DeepSpeed config lacks (``gpu``, ``gpu_memory``, ``max_len``, ``gpus``,
        ``checkpointing``: config keys, None for not given) from the command line.

        Raises:
            UsageError: naming the file and the key.
        """
        from memcheck.workloads.deepspeed import read_deepspeed

        file = str(path)
        data = read_deepspeed_file(Path(path))
        gpus = settings.pop("gpus", None)
        try:
            if gpus is not None:
                gpus = check_key("gpus", gpus)
            read = read_deepspeed(data, gpus=gpus)
        except UsageError as exc:
            raise UsageError(f"{file}: {exc}") from None
        given = {k: v for k, v in settings.items() if v is not None}
        if given.get("gpu") is None and given.get("gpu_memory") is None:
            raise UsageError(f"{file}: no capacity to judge the job against; give --gpu (a GPU name such as A100-80GB, "
                             "or a size such as 24GiB) or --gpu-memory 24GiB")
        config = cls.parse(file=file, where="", model=model, **{**read.settings, **given})
        return replace(config, notes=read.notes, deepspeed=read)

    def fill_auto(self, model) -> "JobConfig":
        """This job with a DeepSpeed config's "auto" bucket sizes filled from ``model``'s hidden size,
        as the HF Trainer fills them (UsageError naming the keys when the model has none)."""
        if self.deepspeed is None or not self.deepspeed.auto:
            return self
        from memcheck.workloads.deepspeed import fill_auto, model_hidden_size

        try:
            keys = fill_auto(self.deepspeed, model_hidden_size(model), type(model).__name__)
        except UsageError as exc:
            raise UsageError(f"{self.label}: {exc}") from None
        filled = {_FIELD[k]: v for k, v in keys.items() if k not in self.deepspeed.settings}
        try:
            return replace(self, job=self.job.replace(**filled))
        except SettingError as exc:
            raise UsageError(f"{self.label}: {exc.worded('config')}") from None

    @property
    def label(self) -> str:
        """``FILE [TABLE]``, as messages and results name the job."""
        return _label(self.file, self.where)

    def check_modules(self, model) -> None:
        """Raise UsageError, naming the job, when a pattern of ``checkpointing`` matches no
        module of ``model`` (run on the loaded model, before anything is traced)."""
        if isinstance(self.job.checkpointing, str):
            return
        names = [n for n, _ in model.named_modules() if n]
        for pattern in self.job.checkpointing:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise UsageError(f"{self.label}: checkpointing: no module of {type(model).__name__} is named "
                                 f"{pattern!r}{closest(pattern, names)} (names look like {', '.join(names[:3])}, ...)")

    def check_job(self, work) -> Job:
        """The job ``memcheck.check`` judges, completed from the loaded workload ``work``
        (``Workload.job_for``: its micro-batch and lengths, the model file's ``make_optimizer``
        unless the config names one) and, on the cuda target without a GPU named, given an
        unnamed GPU of ``gpu_memory``."""
        from memcheck.cuda.gpus import sized_gpu

        job = work.job_for(self.job, self.optimizer)
        if job.gpu is None and job.device is Device.CUDA:
            job = job.replace(gpu=sized_gpu(job.budget_bytes))
        return job


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
    from memcheck.workloads.deepspeed import looks_like_deepspeed

    if not prefix and looks_like_deepspeed(data):
        raise UsageError(f"{file}: a DeepSpeed config, which names no model or GPU; name them beside it: "
                         f"memcheck check {file} --model MODEL --gpu GPU [--max-len N] [--gpus N]")
    if not data:
        raise UsageError(f"{_label(file, prefix)}: no jobs; give a job's settings (model, gpu, micro_batch, ...) "
                         "at the top level, or one table per job under jobs")
    defaults = _settings(data, file, prefix, top=True, path=path)
    if JOBS not in data:
        job = _job(defaults, file, prefix, None)
        _remote_code_inside(job, path)
        return [job]
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
        _remote_code_inside(jobs[-1], path)
    return jobs


def _settings(table: dict, file: str, where: str, *, top: bool, path: Path) -> dict:
    """One table's job settings, each checked where it is written (a model file is
    resolved against the config file ``path``)."""
    allowed = JOB_KEYS + ((JOBS,) if top else ())
    out, written = {}, {}
    for key, value in table.items():
        if key == JOBS and top:
            continue
        if key not in JOB_KEYS and key not in _ALIASES and key not in VALUE_ALIASES:
            hint = "; jobs are tables under [jobs] at the top level" if key == JOBS else ""
            raise UsageError(f"{_label(file, where)}: unknown key {key!r}"
                             f"{closest(key, [*allowed, *_ALIASES, *VALUE_ALIASES])}{hint}; "
                             f"allowed: {', '.join(allowed)} (or the HF TrainingArguments names "
                             f"{', '.join([*_ALIASES, *VALUE_ALIASES])})")
        if key == TRAINER_CONFIG:
            continue  # read after the table's own keys, below
        try:
            if key in VALUE_ALIASES:  # bf16 = true, optim = "adamw_torch_fused", ...
                translated = translate_alias(key, value)
                if translated is None:  # bf16 = false: says nothing
                    continue
                name, value = SPELLING[translated[0]].config, translated[1]
            else:
                name = _ALIASES.get(key, key)
            if name in written:
                raise UsageError(f"{key!r} sets {name!r}, which {written[name]!r} already set")
            value = resolve_model(_model(value), path) if name == "model" else check_key(name, value)
        except UsageError as exc:
            raise UsageError(f"{_label(file, where)}: {exc}") from None
        out[name], written[name] = value, key
    if TRAINER_CONFIG in table:
        out.update(_trainer_config(table[TRAINER_CONFIG], written, file, where, path))
    return out


def _trainer_config(value, written: dict, file: str, where: str, path: Path) -> dict:
    """The settings of the trainer's own config file that ``trainer_config`` names (relative to
    the config file), as config keys; a setting both files give is refused, naming both, so
    the two cannot disagree."""
    from memcheck.workloads.trainer_files import trainer_settings

    label = _label(file, where)
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{label}: trainer_config must be the path of a TrainingArguments, LightningCLI, "
                         f"accelerate or DeepSpeed file, got {value!r}")
    trainer_file = (path.parent / value).resolve()
    try:
        kind, settings = trainer_settings(trainer_file)
    except UsageError as exc:
        raise UsageError(f"{label}: trainer_config: {exc}") from None
    out = {}
    for name, setting in settings.items():
        if name in written:
            raise UsageError(f"{label}: {written[name]!r} sets {name!r}, which {value} ({kind}) sets too; "
                             "give it in one place")
        try:
            out[name] = check_key(name, setting)
        except UsageError as exc:
            raise UsageError(f"{label}: {value} ({kind}): {exc}") from None
    return out


def _job(settings: dict, file: str, where: str, name: str | None) -> JobConfig:
    if "model" not in settings:
        raise UsageError(f"{_label(file, where)}: no model; add model = \"path/to/model.py\" (relative to the "
                         "config file) or model = \"hf:NAME_OR_DIR\"")
    return JobConfig.parse(file=file, where=where, name=name, **settings)


def project_root(config: Path) -> Path:
    """The git repository holding ``config`` (a directory with ``.git``), else the config's directory.
    A config that is a symlink is held where the link is, not where it points: a link to a file
    outside the repository must not bring the models beside its target in."""
    here = Path(config).absolute().parent.resolve()
    for d in (here, *here.parents):
        if (d / ".git").exists():
            return d
    return here


def resolve_model(model: str, config: Path) -> str:
    """A config's ``model`` as ``load_workload`` takes it: a model file resolved against the
    config's directory (it must lie inside ``project_root(config)``), or ``hf:NAME_OR_DIR``
    (a directory is resolved against the config's directory when it exists there)."""
    base = config.resolve().parent
    root = project_root(config)
    if model.startswith("hf:"):
        name = model[3:]
        local = base / Path(name).expanduser() if name else None
        if local is None or not local.is_dir():
            return model  # a hub name: its cached config.json (no code runs without trust_remote_code)
        target = local.resolve()  # follows symlinks, as for model files
        _inside(model, target, root)
        return f"hf:{target}"
    if not model.endswith(".py"):
        raise UsageError(f"model {model!r} is neither a model file (*.py) nor hf:NAME_OR_DIR")
    target = (base / model).resolve()  # follows symlinks: a link is judged by where it points
    _inside(model, target, root)
    if not target.is_file():
        near = [p.name for p in target.parent.glob("*.py")] if target.parent.is_dir() else []
        raise UsageError(f"model {model!r}: no such file ({target}){closest(Path(model).name, near)}")
    return str(target)


def _inside(model: str, target: Path, root: Path) -> None:
    """Refuse ``model`` (as the config wrote it) when ``target``, symlinks resolved, is outside ``root``."""
    if not target.is_relative_to(root):
        inside = ("the git repository holding the config" if (root / ".git").exists()
                  else "the config file's directory (no git repository holds it)")
        raise UsageError(f"model {model!r} is {target}, outside {root} ({inside}); memcheck runs a model "
                         "file's code, so a config may name only model files inside its own repository")


def _remote_code_inside(job: JobConfig, config: Path) -> None:
    """``trust_remote_code = true`` only where the code it lets run lies inside the config's
    repository: an ``hf:`` directory there whose config.json's ``auto_map`` names modules
    beside it (symlinks resolved), not a hub name (its code comes from the hub's cache) nor
    another hub repository's code (``OWNER/REPO--module.Class``)."""
    if not job.job.trust_remote_code:
        return
    from memcheck.workloads.hf import remote_code

    root, name = project_root(config), job.model[3:] if job.model.startswith("hf:") else None
    refuse = f"{job.label}: trust_remote_code = true runs the code an hf: config.json's auto_map names, "
    if name is None:
        raise UsageError(refuse + f"and model {job.model!r} is a model file; drop trust_remote_code")
    directory = Path(name)
    if not directory.is_absolute() or not directory.is_dir():
        raise UsageError(refuse + f"and hf:{name} is a hub name, whose code is not in {root}; memcheck check runs "
                         "only code inside the config's own repository: give an hf: directory inside it")
    for module in remote_code(directory):
        file = (directory / (module.replace(".", "/") + ".py")).resolve()
        if "--" in module or not file.is_relative_to(root):
            where = "another hub repository's" if "--" in module else str(file)
            raise UsageError(refuse + f"and {module!r} is {where} code, outside {root}; memcheck check runs only "
                             "code inside the config's own repository")


def read_deepspeed_file(path: Path) -> dict:
    """A DeepSpeed config file's data (JSON; UsageError naming the file otherwise)."""
    if Path(path).suffix.lower() != ".json":
        raise UsageError(f"{path}: a DeepSpeed config is a .json file")
    data = read_data(Path(path))
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a DeepSpeed config is a JSON object, not a {type(data).__name__}")
    return data


def deepspeed_job(config, *, gpus: int | None = None, model=None, hidden_size: int | None = None, **settings):
    """The ``Job`` a DeepSpeed config describes, and its notes: the Python form of
    ``memcheck check ds_config.json --model MODEL``.

    Example:
        >>> job, notes = memcheck.deepspeed_job("ds_config.json", gpus=8, model=model, gpu="H100-80GB",
        ...                                     max_len=2048)
        >>> memcheck.check(model, make_batch, job)

    Args:
        config: the config file's path, or its JSON object.
        gpus: the world size; None: derived from ``train_batch_size`` when the three batch keys are
            numbers, else 2 (noted).
        model: the model, for the "auto" bucket sizes (its ``config.hidden_size``).
        hidden_size: the hidden size instead of ``model``.
        settings: the job's other settings as ``memcheck.Job`` keywords (``gpu``, ``max_len``,
            ``checkpointing``, ...); one the DeepSpeed config sets too is refused.

    Returns:
        ``(Job, notes)``: notes name what the config sets that memcheck reads but does not model.

    Raises:
        UsageError: naming the key (and the file), as ``read_deepspeed``.
    """
    from memcheck.workloads.deepspeed import fill_auto, model_hidden_size, read_deepspeed

    label = None
    if isinstance(config, (str, Path)):
        label = str(config)
        config = read_deepspeed_file(Path(config))
    try:
        read = read_deepspeed(config, gpus=gpus)
        h = hidden_size if hidden_size is not None else (model_hidden_size(model) if model is not None else None)
        keys = fill_auto(read, h, type(model).__name__ if model is not None else "no model (give model= or "
                                                                                   "hidden_size=)")
        python = {_FIELD[k]: v for k, v in keys.items()}
        for name in python:
            if name in settings:
                raise UsageError(f"{name} is set by the DeepSpeed config ({name}={python[name]!r}); give it there, "
                                 f"not as {name}={settings[name]!r} too")
        job = Job.from_settings({**settings, **python})
    except UsageError as exc:
        raise UsageError(f"{label}: {exc}" if label else str(exc)) from None
    return job, list(read.notes)


def _read(path: Path):
    """The file's data: a dict for a well-formed config (any value for JSON or YAML)."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UsageError(f"{path}: not a memcheck config; use a .toml, .json, .yaml or .yml file, or "
                         f"{PYPROJECT} with a [tool.memcheck] table")
    if not path.is_file():
        raise UsageError(f"{path}: no such config file")
    check_config_size(path)
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
            return parse_limited(path, tomllib.loads, text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{path}: not valid TOML: {exc}") from None
    return parse_data(path, text)
