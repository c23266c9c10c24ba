"""Gradient checkpointing applied to the traced twin: which modules, and how.

``full`` wraps every repeated block: the children of the outermost ``ModuleList``
or ``nn.Sequential`` containers whose children are two or more modules of one
class with parameters (a transformer's layers, an HF ResNet's stages, a
torchvision ResNet stage's blocks). transformers models that support it use
their own ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
before 5.x), the call the Trainer makes for ``gradient_checkpointing=True``.
A list names modules by qualified name or ``fnmatch`` pattern (``transformer.h.*``).

Checkpointing already in the user's code (``torch.utils.checkpoint`` or HF's
flag, either ``use_reentrant``) needs nothing here: it runs under the tracer as
it would for real, and the recomputed block's activations are traced during its
backward.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch.utils.checkpoint import checkpoint

from memcheck.errors import UsageError, closest, require_torch

NONE, FULL = "none", "full"
HALF = "half"  # the planner's selective option: every second repeated block
EVERY = "every:"  # every:N: every Nth repeated block from the first (transformers' every_n_layers)
SELECTIVE_OP = "selective-op"  # op-level selective checkpointing of every repeated block, torchtitan's policy

# torchtitan's op-level selective activation checkpointing (torchtitan/distributed/activation_checkpoint.py,
# ``_apply_op_sac`` with the ``op_sac_save_list`` of its Llama models, 2025): inside each checkpointed block
# the outputs of these ops are saved, every other op is recomputed in backward, and of the matmuls
# (``aten.mm``) every second one is recomputed too ("Saves output of all compute ops, except every
# second mm"). Run through torch.utils.checkpoint's own ``create_selective_checkpoint_contexts``.
_SAC_SAVE = (
    "mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention", "max",
)


def half_of(blocks) -> tuple[str, ...]:
    """The blocks ``half`` checkpointing wraps: every second one, from the first."""
    return tuple(blocks)[::2]


def parse_checkpointing(value) -> str | tuple[str, ...]:
    """``"none"``, ``"full"``, ``"half"``, ``"every:N"``, ``"selective-op"``, or a tuple of module names/patterns from
    ``"a,b"`` or a list."""
    if value is None or value is False:
        return NONE
    if value is True:
        return FULL
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == SELECTIVE_OP:
            _selective_checkpointing_api()  # a torch without it: one line, before anything is traced
        if text.lower() in (NONE, FULL, HALF, SELECTIVE_OP):
            return text.lower()
        if text.lower().startswith(EVERY):
            step = text[len(EVERY):].strip()
            if not step.isdigit() or int(step) < 1:
                raise UsageError(f"checkpointing every:N needs a whole number N of at least 1, got {value!r}")
            return f"{EVERY}{int(step)}"
        names = tuple(n.strip() for n in text.split(",") if n.strip())
    elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        names = tuple(n.strip() for n in value if n.strip())
    else:
        raise UsageError(f"checkpointing must be 'none', 'full', 'half', 'every:N', 'selective-op' or a list of "
                         f"module names, got {value!r}")
    if not names:
        raise UsageError(f"checkpointing names no modules: {value!r}")
    return names


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """Qualified names of the blocks ``full`` checkpointing wraps (outermost first)."""
    found: list[str] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        children = list(module.named_children())
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            # a pipeline stage's stand-ins for the blocks other ranks hold (memcheck.training.strategies.pp)
            # are not blocks: the ones this rank keeps are, even one alone
            kept = [(n, c) for n, c in children if not getattr(c, "memcheck_stand_in", False)]
            enough = 1 if len(kept) < len(children) else 2
            kinds = {type(c) for _, c in kept}
            if len(kept) >= enough and len(kinds) == 1 and all(
                    any(True for _ in c.parameters()) and list(c.children()) for _, c in kept):
                found.extend(f"{prefix}{name}" for name, _ in kept)
                return
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def _wrap(module: torch.nn.Module, use_reentrant: bool, context_fn=None) -> None:
    forward = module.forward
    extra = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        # Reentrant checkpointing takes positional tensors only; kwargs ride in a partial, as in HF.
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=use_reentrant, **extra)

    module.forward = checkpointed


def _selective_checkpointing_api() -> tuple:
    """torch's ``CheckpointPolicy`` and ``create_selective_checkpoint_contexts`` (torch 2.4+), or
    TorchVersionError naming the setting."""
    setting = "checkpointing selective-op (torch's selective activation checkpointing)"
    return (require_torch("CheckpointPolicy", setting),
            require_torch("create_selective_checkpoint_contexts", setting))


def selective_op_context():
    """A fresh ``context_fn`` result for one checkpointed block under torchtitan's op-level policy
    (``_SAC_SAVE``; every second ``mm`` recomputed, counted apart in the forward and the recompute)."""
    CheckpointPolicy, create_selective_checkpoint_contexts = _selective_checkpointing_api()  # noqa: N806

    aten = torch.ops.aten
    save = {getattr(aten, name).default for name in _SAC_SAVE if hasattr(aten, name)}
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _hf_enable(model: torch.nn.Module, use_reentrant: bool) -> bool:
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    kwargs = {"use_reentrant": use_reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def _cache_off(model: torch.nn.Module) -> None:
    """Turn transformers' KV cache off in every config of ``model``, as transformers does for the
    layers it checkpoints (modeling_layers.py, ``GradientCheckpointingLayer``: ``use_cache=False``,
    ``past_key_values=None``). A checkpointed layer would otherwise update its cache again when it
    is recomputed, or read back what the forward put there: T5's cross-attention, recomputed, takes
    its keys and values from the ``EncoderDecoderCache`` its forward filled (``is_updated``), so it
    saves 4 tensors fewer than the forward did and ``torch.utils.checkpoint`` refuses the mismatch.
    Every config, not only the model's: T5 and its kin give the encoder and decoder stacks copies
    of their own (``copy.deepcopy(config)``), which the stacks read ``use_cache`` from."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False


def apply_checkpointing(model: torch.nn.Module, spec, *, use_reentrant: bool = False) -> tuple[str, ...]:
    """Wrap ``model``'s modules in ``torch.utils.checkpoint`` as ``spec`` says; return what was wrapped.

    Raises UsageError naming a pattern that matches no module, or when ``full``
    finds no repeated block.
    """
    spec = parse_checkpointing(spec)
    if spec == NONE:
        return ()
    context_fn = None
    names = dict(model.named_modules())
    if spec in (FULL, HALF, SELECTIVE_OP) or (isinstance(spec, str) and spec.startswith(EVERY)):
        blocks = repeated_blocks(model)
        if not blocks:
            raise UsageError(
                f"checkpointing='{spec}' found no repeated blocks in {type(model).__name__}; "
                "name the modules to wrap instead (--checkpointing a.b,c.*)"
            )
        if spec == HALF:  # every second repeated block, from the first (the planner's option)
            blocks = list(half_of(blocks))
        elif spec == SELECTIVE_OP:
            if use_reentrant:
                raise UsageError("checkpointing selective-op needs use_reentrant=False (torch.utils.checkpoint's "
                                 "context_fn); drop --reentrant")
            context_fn = selective_op_context
        elif spec != FULL:  # every:N, as transformers' every_n_layers picks layers 0, N, 2N, ...
            blocks = blocks[::int(spec[len(EVERY):])]
        elif _hf_enable(model, use_reentrant):
            return ("(transformers' own checkpointing)",)
    else:
        blocks = []
        for pattern in spec:
            hits = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise UsageError(  # a typo of 'full' or 'none' lands here too, so they are suggested as well
                    f"checkpointing: no module of {type(model).__name__} is named {pattern!r}"
                    f"{closest(pattern, [NONE, FULL, *(n for n in names if n)])} "
                    f"(names look like {', '.join(list(n for n in names if n)[:3])}, ...)"
                )
            blocks.extend(h for h in hits if h not in blocks)
        # A module inside another wrapped module is recomputed with it already.
        blocks = [b for b in blocks if not any(b.startswith(o + ".") for o in blocks)]
    _cache_off(model)
    for name in blocks:
        _wrap(names[name], use_reentrant, context_fn)
    return tuple(blocks)
