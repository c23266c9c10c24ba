"""``run_script()``: the user's own training script, run as it is, with its model on meta.

``memcheck run [OPTIONS] -- python train.py ARGS...`` runs ``train.py`` in this process
(``runpy``, with ``sys.argv`` as given), under the tracer and the same redirect as
``estimate`` (``.cuda()``/``.to("cuda")`` land on meta; ``torch.cuda`` answers for the target
GPU without the driver), and changes four things:

1. **Weights are never built.** Every parameter and buffer a module registers becomes a
   meta tensor of the same shape and dtype (torch's global registration hooks,
   ``register_module_parameter_registration_hook``), so a plain ``nn.Module`` holds one
   real parameter at a time while it is built, and none after; transformers'
   ``from_pretrained`` builds from the checkpoint's ``config.json`` on meta and reads no
   weights (``_meta_from_pretrained``).
2. **The batch is the worst case.** A real tensor moved to a device (``.to(device)``,
   ``.cuda()``), or handed to the model without a move, becomes a meta tensor; with
   ``max_len``, an integer tensor's second dimension (tokens) shorter than ``max_len`` is
   padded to it, and so is any other tensor whose second dimension is that length
   (``padding=True`` pads each batch only to its longest sample).
3. **The loop's phases come from its own calls**: the model's outermost forward (a module
   with parameters called outside any other, in training mode), ``Tensor.backward``,
   ``optimizer.step`` (torch's global step hooks; inside Lightning's closure the update
   follows the closure's backward) and ``zero_grad`` (the optimizer's or the module's).
   The HF Trainer's, Lightning's and accelerate's loops are followed as they run.
4. **The script stops** when the forward after ``steps`` optimizer steps begins: an
   exception that ``except Exception`` does not catch (``ScriptStopped``). What ran before
   that ran for real: data loading, tokenisation, and anything the script wrote (an output
   folder, a log), which is left as it is.

Known limitations (each said in the report when it applies):
    ``torch.autocast`` inside the script is emulated on the target's autocast lists, but a
    GradScaler is not; DataLoader workers are real processes (their tensors are real);
    a model built before ``memcheck run`` imports (a pickled module) keeps its real weights.

Multi-process launches (``torchrun``, ``python -m torch.distributed.run``, ``accelerate launch``;
``memcheck.engine.launch``) start no process: the script runs once, as rank 0 of the launcher's
world size, with the environment the launcher gives that rank, and
``torch.distributed.init_process_group`` gets torch's "fake" backend (every collective completes
at once and sends nothing) whatever backend the script names. ``DistributedDataParallel`` is
followed: the wrapper the script builds runs the module itself, with memcheck's emulation of
its buckets (``memcheck.training.strategies.ddp.MetaDDP``), so the answer is one rank's, which
every rank shares. FSDP (``fully_shard``, ``FullyShardedDataParallel``) and DeepSpeed set up by
the script are refused with one line naming the ``--strategy`` to estimate instead.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memcheck import compat
from memcheck.compat import tree_map_only
from memcheck.choices import Choices
from memcheck.engine.estimate import _translate, compiled_note, target_gpu
from memcheck.engine.setup import DEFAULT_ARCH, TracedRun, describe_batch, dtype_name, model_dtype, rank_threads
from memcheck.engine.summary import result, summarise
from memcheck.enums import Category, Device, Phase, Precision
from memcheck.engine import launch as launches
from memcheck.enums import Strategy
from memcheck.errors import MemcheckError, TraceError, UsageError, stock_package
from memcheck.job import Job, as_job
from memcheck.report.results import Estimate
from memcheck.rules import extensions
from memcheck.rules.autocast import UserAutocast, meta_autocast_queries
from memcheck.trace.device_redirect import meta_parameters, redirect_cuda
from memcheck.trace.tracer import MemoryTracer
from memcheck.training.optimizers import implementation, prefill_fused_state

_INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


class ScriptStopped(BaseException):
    """Raised inside the script once the traced steps are done; a ``BaseException``, so the
    script's own ``except Exception`` does not swallow it."""


@dataclass
class _Session:
    """What one ``memcheck run`` has seen of the script so far."""

    tracer: MemoryTracer
    job: Job
    root: torch.nn.Module | None = None
    batch: Any = None  # the last training batch the model got (meta twins)
    optimizers: list = field(default_factory=list)
    steps_done: int = 0  # optimizer steps of the first optimizer, completed
    depth: int = 0  # nesting of module calls
    in_step: bool = False
    seq_len: int | None = None  # the token length of the batch being moved
    twins: dict = field(default_factory=dict)  # id(real tensor) -> (real, meta twin)
    autocast: UserAutocast | None = None  # the script's own torch.autocast regions, emulated
    entered: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # extensions, at the 1st forward
    compiled: list = field(default_factory=list)  # what the script handed to torch.compile, by name
    ddp: dict | None = None  # the settings of the DistributedDataParallel the traced model is, if it is one
    emulation: Any = None  # MetaDDP, built at the first training forward

    def __post_init__(self):
        self.autocast = UserAutocast(self.tracer, self.job.device)

    # ---- the batch ------------------------------------------------------------------
    def twin(self, t: torch.Tensor) -> torch.Tensor:
        """The meta tensor standing for real tensor ``t`` on the training device, padded to max_len."""
        hit = self.twins.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        shape = list(t.shape)
        max_len = self.job.max_len
        if t.dim() >= 2:
            if t.dtype in _INTEGER:
                self.seq_len = shape[1]
            if max_len and shape[1] == self.seq_len and shape[1] < max_len:
                shape[1] = max_len
        out = torch.empty(shape, dtype=t.dtype, device="meta")
        if t.requires_grad:
            out.requires_grad_(True)
        self.tracer.ignore(t)  # the twin stands for it (the CPU target counted the real one)
        self.twins[id(t)] = (t, out)
        return out

    def twins_of(self, tree):
        return tree_map_only(torch.Tensor, lambda t: t if t.is_meta else self.twin(t), tree)

    # ---- the loop's phases -------------------------------------------------------------
    def is_model(self, module: torch.nn.Module) -> bool:
        if self.root is not None:
            return module is self.root
        return any(p.is_meta and p.requires_grad for p in module.parameters())

    def forward_starts(self, module: torch.nn.Module, args, kwargs):
        training = module.training and torch.is_grad_enabled()
        if training:
            if self.steps_done >= self.job.steps:
                raise ScriptStopped()
            if self.root is None:
                self.root = module
                # the extensions the script has imported by its first forward (TRL's fused head)
                self.entered.enter_context(extensions.tracing(self.tracer, self.job.device))
                self.tracer.watch(model=module)
                for opt in self.optimizers:  # adopted before the first forward (Lightning's closure)
                    self._outside(opt)
                if isinstance(module, _ScriptDDP):
                    from memcheck.training.strategies.ddp import MetaDDP

                    self.ddp = module.memcheck_settings
                    self.emulation = MetaDDP(self.tracer, module.module, **self.ddp)
            self.tracer.set_phase(self.steps_done, Phase.FORWARD)
        args, kwargs = self.twins_of((args, kwargs))
        if training:
            self.batch = _as_batch(args, kwargs)
            self.tracer.watch(batch=self.batch)
        return args, kwargs

    def step_starts(self, optimizer) -> None:
        if not any(o is optimizer for o in self.optimizers):
            self._adopt(optimizer)
        self.in_step = True
        self.tracer.set_phase(self.steps_done, Phase.OPTIMIZER)

    def step_ends(self, optimizer) -> None:
        self.in_step = False
        if optimizer is self.optimizers[0]:
            self.steps_done += 1

    def _adopt(self, optimizer) -> None:
        """Watch an optimizer the script built: its parameters outside the model as parameters,
        torch's default implementation on the target, the fused state meta needs."""
        self.optimizers.append(optimizer)
        for group in optimizer.param_groups:
            if self.job.device is Device.CUDA and "foreach" in group and group["foreach"] is None \
                    and not group.get("fused"):
                # torch picks foreach when every parameter is on CUDA (optimizer.py,
                # _default_to_fused_or_foreach); on meta it would pick the for-loop.
                group["foreach"] = True
        if self.root is not None:
            self._outside(optimizer)
        prefill_fused_state(optimizer)
        self.tracer.watch(optimizer=optimizer)

    def _outside(self, optimizer) -> None:
        """Count the parameters ``optimizer`` trains that the model does not hold (a second model's)."""
        owned = {id(p) for p in self.root.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in owned:
                    self.tracer.register(p, Category.PARAMETER, "(outside the model)")

    def label(self) -> str:
        if not self.optimizers:
            return "none seen"
        names = []
        for opt in self.optimizers:
            group = opt.param_groups[0]
            impl = implementation({k: group[k] for k in ("foreach", "fused") if k in group})
            names.append(type(opt).__name__ + (f" ({impl})" if impl else ""))
        return ", ".join(names)


class _Moves(TorchFunctionMode):
    """Tensor moves to a device: a real tensor becomes its meta twin (``_Session.twin``)."""

    def __init__(self, session: _Session):
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args and isinstance(args[0], torch.Tensor) \
                and not args[0].is_meta and args[0].dim() and self.session.depth == 0:
            device = _device_of(func, args[1:], kwargs)
            if device is not None and device.type in ("cuda", "cpu"):
                out = self.session.twin(args[0])
                dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
                return out.to(dtype) if dtype is not None else out
        return func(*args, **kwargs)


class _ScriptDDP(torch.nn.parallel.DistributedDataParallel):
    """What ``DistributedDataParallel(module, ...)`` builds in a traced script: the module itself
    under the wrapper's name (``.module``, ``no_sync()``, ``isinstance`` as the script and its
    trainer expect), with no reducer and no process group of its own; the buckets are memcheck's
    emulation (``_Session.emulation``), made with the settings given here (``memcheck_settings``) once
    the wrapper's first training forward makes it the traced model."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False, **kwargs):
        torch.nn.Module.__init__(self)
        self.module = module
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.static_graph = static_graph
        self.memcheck_settings = dict(bucket_cap_mb=bucket_cap_mb, bucket_view=gradient_as_bucket_view)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _set_static_graph(self):
        self.static_graph = True



def _refuse(what: str, strategy: str):
    def refused(*args, **kwargs):
        raise UsageError(f"the script builds {what}: memcheck run follows DistributedDataParallel scripts only; "
                         f"estimate the model with --strategy {strategy} --gpus N instead")
    return refused


@contextlib.contextmanager
def _distributed(launch: launches.Launch):
    """The launcher's environment for rank 0, torch.distributed's process group as the fake
    backend, and the wrappers the script may build: DDP followed, FSDP refused (module docstring);
    all restored on exit, and a process group made here destroyed."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    import torch.nn.parallel as parallel
    from torch.nn.parallel import distributed as ddp_module

    saved_env, threads = dict(os.environ), torch.get_num_threads()  # accelerate's state sets OMP_NUM_THREADS=1
    os.environ.update(launch.env)
    made = []
    real_init = dist.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None, device_id=None, **kwargs):
        world = world_size if world_size and world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
        own = rank if rank is not None and rank >= 0 else int(os.environ.get("RANK", "0"))
        real_init("fake", store=compat.FakeStore(), rank=own, world_size=world)
        made.append(True)

    patches = [(dist, "init_process_group", init_process_group),
               (dist.distributed_c10d, "init_process_group", init_process_group),
               (parallel, "DistributedDataParallel", _ScriptDDP), (ddp_module, "DistributedDataParallel", _ScriptDDP)]
    if hasattr(fsdp, "fully_shard"):
        patches.append((fsdp, "fully_shard", _refuse("FSDP2 (fully_shard)", "fsdp")))
    patches.append((fsdp, "FullyShardedDataParallel", _refuse("FSDP (FullyShardedDataParallel)", "fsdp1")))
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None:
        patches.append((deepspeed, "initialize", _refuse("a DeepSpeed engine", "zero1/zero2/zero3")))
    originals = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, value in patches:
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in originals:
            setattr(mod, name, value)
        if made and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)


def _as_batch(args: tuple, kwargs: dict):
    """What the model was called with, as the report names it: the keywords (``model(**batch)``),
    the one argument, or the arguments; 0-dim tensors (HF's ``num_items_in_batch``) left out."""
    kwargs = {k: v for k, v in kwargs.items() if not (isinstance(v, torch.Tensor) and v.dim() == 0)}
    if kwargs and not args:
        return kwargs
    if len(args) == 1 and not kwargs:
        return args[0]
    return (*args, kwargs) if kwargs else args


def _device_of(func, rest, kwargs) -> torch.device | None:
    if func is torch.Tensor.cuda:
        return torch.device("cuda")
    try:
        device = compat.parse_to(*rest, **{k: v for k, v in kwargs.items() if k != "copy"})[0]
    except (TypeError, RuntimeError):
        return None
    return device


@contextlib.contextmanager
def _patched(session: _Session):
    """The hooks and wrappers of a run (module docstring, points 1-4), removed on exit."""
    module_cls, tensor_cls, optim_cls = torch.nn.Module, torch.Tensor, torch.optim.Optimizer
    originals = dict(call=module_cls.__call__, backward=tensor_cls.backward, opt_zero=optim_cls.zero_grad,
                     mod_zero=module_cls.zero_grad)
    from torch.optim import optimizer as optim_mod

    def call(module, *args, **kwargs):
        if session.depth == 0 and compat.current_graph_task_id() == -1 and session.is_model(module):
            args, kwargs = session.forward_starts(module, args, kwargs)
        session.depth += 1
        try:
            return originals["call"](module, *args, **kwargs)
        finally:
            session.depth -= 1

    def backward(self, *args, **kwargs):
        session.tracer.set_phase(session.steps_done, Phase.BACKWARD)
        try:
            return originals["backward"](self, *args, **kwargs)
        finally:
            if session.in_step:  # Lightning: the closure's backward runs inside optimizer.step
                session.tracer.set_phase(session.steps_done, Phase.OPTIMIZER)
                for opt in session.optimizers:
                    prefill_fused_state(opt)

    def compile_eagerly(model=None, **options):
        """torch.compile as the script calls it (``torch.compile(m)``, ``@torch.compile``,
        ``@torch.compile(mode=...)``, ``module.compile()``, the HF Trainer's and Lightning's):
        a module, or a function of the user's own code, is returned as it is and recorded;
        memcheck traces what it runs eagerly (compiled_note). A library's own kernels that it
        compiles as it is imported (bitsandbytes' ``@torch.compile`` helpers) are compiled as
        they would be, not recorded: they are not the user's step."""
        if model is None:
            return lambda m: compile_eagerly(m, **options)
        owner = getattr(model, "__self__", model)  # module.compile() compiles the bound _call_impl
        if not isinstance(owner, torch.nn.Module) and not _users_code(model):
            return originals["compile"](model, **options)
        name = getattr(model, "__qualname__", None) or type(model).__name__
        session.compiled.append("the model's call (module.compile())" if name == "Module._call_impl" else name)
        return model

    def zero_grad(original):
        def marked(self, *args, **kwargs):
            if session.root is not None and session.depth == 0:
                session.tracer.set_phase(session.tracer.step, Phase.ZERO_GRAD)
            return original(self, *args, **kwargs)
        return marked

    handles = [
        optim_mod.register_optimizer_step_pre_hook(lambda opt, a, k: session.step_starts(opt)),
        optim_mod.register_optimizer_step_post_hook(lambda opt, a, k: session.step_ends(opt)),
    ]
    module_cls.__call__ = call
    tensor_cls.backward = backward
    originals["compile"], torch.compile = torch.compile, compile_eagerly
    optim_cls.zero_grad = zero_grad(originals["opt_zero"])
    module_cls.zero_grad = zero_grad(originals["mod_zero"])
    try:
        with meta_parameters(), session.autocast.patched(), _meta_from_pretrained(), \
                meta_autocast_queries(session.tracer, session.job.device):
            yield
    finally:
        session.entered.close()
        module_cls.__call__ = originals["call"]
        tensor_cls.backward = originals["backward"]
        torch.compile = originals["compile"]
        optim_cls.zero_grad = originals["opt_zero"]
        module_cls.zero_grad = originals["mod_zero"]
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _meta_from_pretrained():
    """transformers' ``from_pretrained`` builds the model from the checkpoint's ``config.json``
    on meta, in the dtype it would load (``dtype``/``torch_dtype``, "auto": config.json's), and
    reads no weights. Without transformers imported by then, nothing to do."""
    try:
        from transformers import AutoConfig, PreTrainedModel
    except ImportError:
        yield
        return
    original = PreTrainedModel.__dict__["from_pretrained"]

    def from_pretrained(cls, name_or_path, *args, config=None, **kwargs):
        if config is None or isinstance(config, (str, os.PathLike)):
            keep = {k: kwargs[k] for k in ("revision", "trust_remote_code", "subfolder", "cache_dir") if k in kwargs}
            config = AutoConfig.from_pretrained(config or name_or_path, **keep)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
        if dtype == "auto" or dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if "attn_implementation" in kwargs:
            config._attn_implementation = kwargs["attn_implementation"]
        with torch.device("meta"):
            return cls._from_config(config, dtype=dtype)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


def run_script(argv: list[str], job: Job | None = None, *, progress=None, **settings) -> Estimate:
    """Run ``argv`` (``["train.py", ARGS...]``, or with a leading ``python``) as the user would,
    trace its first ``job.steps`` optimizer steps on the meta device, then stop it and
    return the ``Estimate`` (module docstring).

    Example:
        >>> est = memcheck.run_script(["examples/scripts/train_loop.py", "--max-steps", "100"],
        ...                           device="cpu", max_len=256)

    Known limitations: see the module docstring.
    """
    job = as_job(job, settings, caller="run_script()")
    launch = launches.parse(argv)
    path, args = launch.script, launch.args
    target = target_gpu(job)
    arch = target.arch if target is not None else DEFAULT_ARCH
    tracer = MemoryTracer(job.device, arch=arch, choices=Choices(job.assume))
    session = _Session(tracer, job)

    def on_phase(step, phase):
        if session.emulation is not None:
            session.emulation.on_phase(step, phase)
        if progress is not None:
            progress(f"running {path.name}: step {step + 1}, {phase.value}")

    tracer.on_phase = on_phase
    name = path.name
    stopped = False
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    try:
        with redirect_cuda(target), tracer, rank_threads(launch.per_node, job.device, tracer), \
                _distributed(launch), _patched(session), _Moves(session):
            try:
                stopped = _run(path, name, session)
            finally:
                if session.emulation is not None:
                    session.emulation.close()
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if session.root is None or session.steps_done < 2:
        raise UsageError(
            f"{name} ran {'until memcheck stopped it' if stopped else 'to its end'} with "
            f"{session.steps_done} optimizer step(s) of a model memcheck could follow; it needs 2 (give the script "
            "more steps or data, or check that it builds its model after it starts)")
    _explain(session, path, stopped, launch)
    dtype = model_dtype(session.root)
    info = describe_batch(session.batch, None, job.max_len, job.target_len)  # the batch size: its first tensor's
    job = job.replace(batch_size=info.batch_size, precision=_precision(dtype, session))
    if session.ddp is not None:
        job = job.replace(strategy=Strategy.DDP, gpus=max(2, launch.world_size),
                          bucket_view=bool(session.ddp["bucket_view"]), bucket_cap_mb=session.ddp["bucket_cap_mb"])
    run = TracedRun(session.root, (), session.batch, None, info, tracer, arch, session.label(), None,
               weights_dtype=dtype_name(dtype))
    gpu_map = [0]
    choices = tracer.choices
    for other in choices.alternatives():  # a script runs once: the other branches are not traced
        taken = choices.taken(choices.consulted)
        tracer.assume(f"data-dependent answers: {', '.join(taken)} traced; a script runs once, so "
                      f"{', '.join(other)} was not (assume= pins either)")
    devices = summarise(run, gpu_map, job, target, name, 8)
    return result(run, gpu_map, devices, job, target, name, False)


_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep


def _users_code(fn) -> bool:
    """Whether function ``fn`` was written outside installed library code (``errors.stock_package``,
    as the error messages decide it) and the standard library."""
    filename = getattr(getattr(fn, "__code__", None), "co_filename", None)
    return (bool(filename) and stock_package(filename) is None
            and not os.path.realpath(filename).startswith(_STDLIB))


def _run(path: Path, name: str, session: _Session) -> bool:
    """Run the script until it ends (False) or memcheck stops it (True); its failures as one line."""
    try:
        runpy.run_path(str(path), run_name="__main__")
    except ScriptStopped:
        return True
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise UsageError(f"{name} exited with status {exc.code} before its training step {session.steps_done + 1}"
                             f" (its own arguments: {' '.join(sys.argv[1:]) or 'none'})") from None
    except MemcheckError:
        raise
    except Exception as exc:
        raise _failed(exc, name, session) from exc
    return False


def _failed(exc: Exception, name: str, session: _Session) -> MemcheckError:
    """The script's own failure, as one line naming where it happened."""
    if session.root is None:
        import traceback

        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith(name)]
        where = f"{name}:{frames[-1].lineno}" if frames else name
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return TraceError(f"{where} failed before its first training step ({type(exc).__name__}: {first}); "
                          "memcheck runs everything before the model's first forward for real")
    return _translate(exc, name)


def _explain(session: _Session, path: Path, stopped: bool, launch: launches.Launch) -> None:
    assume = session.tracer.assume
    if launch.launcher is not None:
        assume(f"launched by {launch.describe()}: rank 0 traced, in this one process, with a stand-in process "
               "group (collectives send nothing)")
    if session.ddp is not None:
        cap = session.ddp["bucket_cap_mb"]
        assume(f"DistributedDataParallel as the script built it (bucket_cap_mb {cap if cap is not None else 25}, "
               f"gradient_as_bucket_view {bool(session.ddp['bucket_view'])}): its buckets emulated; every rank "
               "holds the same")
    elif launch.world_size > 1:
        assume("the script built no DistributedDataParallel: each rank holds the whole model and its gradients, "
               "as traced")
    assume(f"{path.name} ran as written: its own loop, traced for {session.job.steps} optimizer steps"
           + (", then stopped at the next forward" if stopped else ", to its end"))
    assume(f"everything before the model's first forward ran for real (data loading, tokenisation); files "
           f"{path.name} wrote are left as they are")
    if session.job.max_len:
        assume(f"each batch moved to the device padded to max_len {session.job.max_len} along its token dimension")
    else:
        assume("batches traced as the script's data loader made them (give max_len to pad to the worst case)")
    if session.autocast.regions:
        assume("the script's torch.autocast regions emulated on the target's autocast lists; a GradScaler is not")
    for note in compiled_note(sorted(set(session.compiled))):
        assume(note)


def _precision(dtype: torch.dtype, session: _Session) -> Precision:
    pure = {torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}.get(dtype, Precision.FP32)
    return session.autocast.precision(pure)
