"""Tensor parallelism (degree T): what ONE rank of torch's ``parallelize_module`` holds and computes.

``shard(model, T)`` turns a model whose parameters are on the meta device, in
place, into one tensor-parallel rank of the same model sharded by torch's
``ColwiseParallel()`` and ``RowwiseParallel()`` styles (their defaults:
``use_local_output=True``, a row-wise output redistributed to ``Replicate``).
The caller traces the result as a plain one-GPU model (``memcheck.estimate``);
the two collectives that allocate appear as ops of two autograd functions.

What a rank holds and does, from torch 2.13's source:

- column-wise ``nn.Linear``: weight ``[out/T, in]`` and bias ``[out/T]``
  (``Shard(0)``; torch/distributed/tensor/parallel/style.py:121-132,
  ``ColwiseParallel._partition_linear_fn``). Its input is annotated
  ``Replicate`` with ``DTensor.from_local`` (style.py:99-119), a view: nothing
  is allocated in the forward. Its output is ``Shard(-1)``, returned with
  ``to_local()``, a view (torch/distributed/tensor/_api.py:97-112,
  ``_ToTorchTensor.forward``). In the backward, the input's gradient is
  ``Partial`` (the matmul with a ``Shard(0)`` weight sums over the rank's
  columns) and ``_FromTorchTensor.backward`` (_api.py:238-283) redistributes it
  to ``Replicate``: ``Partial._reduce_value`` (placement_types.py:1529-1536) is
  ``funcol.all_reduce`` (torch/distributed/_functional_collectives.py:161-182),
  whose C++ op ``_c10d_functional::all_reduce`` clones its input and reduces
  the clone in place (torch/csrc/distributed/c10d/Functional.cpp,
  ``c10d::all_reduce``: ``input.clone(at::MemoryFormat::Contiguous)`` then
  ``all_reduce_``). So each column-wise module's input gradient is copied once
  in the backward (``_GradAllReduce``); q/k/v that read the same input make
  three copies, as torch does.
- row-wise ``nn.Linear``: weight ``[out, in/T]`` (``Shard(1)``), bias whole on
  every rank (``Replicate``; style.py:250-278, ``RowwiseParallel._partition_linear_fn``).
  Its input is the column-wise output, annotated ``Shard(-1)`` (a view); its
  output is ``Partial`` and redistributed to ``Replicate`` (style.py:292-300),
  the same cloning ``all_reduce`` (``_AllReduce``'s forward). In the backward,
  ``Redistribute.backward`` keeps the ``Replicate`` gradient as it is
  (torch/distributed/tensor/_redistribute.py:1817-1830, "skip the replicate to
  partial transformation when we are in backward pass"): no copy.
- ``colwise_gather_output`` (transformers' name for
  ``ColwiseParallel(output_layouts=Replicate())``, e.g. on an LM head): the
  column-wise weight, and the output all-gathered (``_AllGatherLastDim``).
- ``embedding_rowwise`` (vocabulary-parallel; transformers adds it on ``embed_tokens``): weight
  ``[V/T, H]``, the lookup masked to the rank's rows and all-reduced (a copy), and, on DTensor, the
  weight's gradient is the WHOLE vocabulary's ``[V, H]`` on every rank until ``zero_grad``
  (``_VocabParallelLookup``); ``embedding_colwise``: ``[V, H/T]``, the lookup all-gathered.
- transformers' other styles (``STYLE_KINDS``): ``packed_colwise`` as column-wise, ``colwise_rep`` as
  ``colwise_gather_output``, ``rowwise_rep``/``rowwise_split_input`` row-wise with the whole input
  cut first (a chunk clone; the backward all-gathers), ``all_reduce`` (the output all-reduced, a
  copy), ``mla_kv_a_proj`` (the output split and concatenated, a copy), and ``replicate``,
  ``replicated_with_grad_allreduce``, ``sequence_parallel``, ``local_params``, which leave the
  module whole and allocate nothing. The expert styles (``moe_tp_experts`` ...) are refused: ``ep``
  shards experts.
- everything the plan does not name (norms, ...) stays whole on every rank and computes on the
  whole activations, as under ``parallelize_module``; their gradients need no communication.
- ``loss_parallel=True`` (torchtitan's, ``--layout tp=T,loss_parallel=true``): the head's logits stay
  ``[.., V/T]`` and the cross-entropy runs as torch's ``loss_parallel()`` computes it on the shards
  (``_ParallelCrossEntropy``, ``loss_parallel_context``).
- gradients and optimizer state follow the local shards (a DTensor's
  ``.grad`` and AdamW's ``exp_avg``/``exp_avg_sq`` hold the local shard).

The plan is ``{glob: style}`` with ``parallelize_module``'s
matching (torch/distributed/tensor/parallel/api.py, ``parallelize_module``:
the key split on ``.``, each part matched with ``fnmatch`` against the child
module names). By default it is the plan transformers applies for
``from_pretrained(tp_plan="auto")``, the model's ``tp_plan`` (transformers/distributed/mixin.py
``init_parallel_plans``: the class's ``_tp_plan``, e.g. ``lm_head: colwise_gather_output``, the
config's ``base_model_tp_plan`` under ``model.``, and ``embed_tokens: embedding_rowwise``); with an
older transformers, the config's ``base_model_tp_plan`` prefixed with the base model's attribute.

Sequence parallelism (``sequence_parallel=True``; ``--layout tp=T,sp=true``): torchtitan's
``apply_tp`` (llama3/infra/parallelize.py) as ``measure_tp_cpu(sequence_parallel=True)`` applies
it to a transformers decoder (``layers.N.{input_layernorm, self_attn, post_attention_layernorm,
mlp}`` and ``norm``): the first layer's input cut to ``[B, S/T, H]`` (``PrepareModuleInput``
Replicate -> Shard(1), a chunk clone; transformers builds positions and the mask from the whole
sequence, so the cut cannot come at the embedding), the residual stream and norms
(``SequenceParallel``) at S/T tokens, the attention (``hidden_states=``) and MLP inputs and the
LM head's input all-gathered to ``[B, S, H]`` (``_GatherSequence``: the ``[T*B, S/T, H]`` buffer
and the concatenated copy, which the column-wise linears save), the row-wise outputs
reduce-scattered to ``[B, S/T, H]`` (``_ReduceScatterSequence``: funcol's whole-size chunk-cat
copy, gloo's clone of it under ``backend="gloo"``, the output); the backward swaps them
(an all-gather for each reduce-scatter, a chunk clone for each gather). The LM head stays whole.

LoRA (PEFT) over tensor parallelism, as PEFT builds it over a tensor-parallel transformers
model (peft/tuners/lora/model.py, ``_create_and_replace`` and ``add_lora_tp_hooks_dtensor``,
PEFT 0.21): the plan is matched on the transformers model inside the ``PeftModel``
(``get_base_model()``), a LoRA layer's ``base_layer`` is sharded as the plan says, and of its
adapter the half that meets the sharded dimension: under a column-wise base, ``lora_B`` column-wise
(``Shard(0)``, its input annotated ``Replicate``, its output the local shard added to the base's);
under a row-wise base, ``lora_A`` row-wise (``Shard(1)``, its output ``Partial`` all-reduced, a
copy); the other half stays whole on every rank. Refused: DoRA, 4-bit (QLoRA) bases and sequence
parallelism under LoRA, and LoRA over a style but ``colwise``/``rowwise`` (PEFT's own limits).

Not modelled (``UsageError``): the expert styles; the linear styles on anything but ``nn.Linear``
and the embedding ones on anything but ``nn.Embedding``; a sharded dimension the degree does not
divide (transformers lets the last rank hold less). See docs/tp.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial

import torch
from torch import nn

from memcheck.errors import UsageError
from memcheck.units import short_repr

COLWISE = "colwise"
ROWWISE = "rowwise"
COLWISE_GATHER_OUTPUT = "colwise_gather_output"  # transformers' name for ColwiseParallel(output_layouts=Replicate())
EMBEDDING_ROWWISE = "embedding_rowwise"  # vocabulary-parallel embedding
EMBEDDING_COLWISE = "embedding_colwise"  # hidden-dimension-parallel embedding

# What a rank holds and allocates under each style of transformers 5.23's ALL_PARALLEL_STYLES
# (transformers/distributed/tensor_parallel.py:599-622, the registry ``from_pretrained(tp_plan=...)``
# applies through ``apply_tensor_parallelism``, tensor_parallel.py:639-662), by kind:
#   linear_colwise   weight/bias Shard(0), output Shard(-1) kept local (ColwiseParallel, :143-213)
#   linear_gather    the same weight, output Shard(-1) -> Replicate: an all-gather (:603, :605)
#   linear_rowwise   weight Shard(-1), bias whole, output Partial -> Replicate: an all-reduce (RowwiseParallel, :216-311)
#   linear_rowwise_replicated_input   the same, its whole input cut to Shard(-1) first (:609, :611)
#   embedding_rowwise / embedding_colwise   EmbeddingParallel(shard_dim=0 / 1) (:314-353)
#   whole            parameters whole, nothing allocated: ``replicate`` (the base TensorParallelLayer, :96-140,
#                    :622), ``replicated_with_grad_allreduce`` (:356-388: dist.all_reduce of param.grad in
#                    place), ``sequence_parallel`` on its own (:445-470: from_local/to_local views, its input
#                    already cut), ``local_params`` (:591-596: the forward on local views of the parameters)
#   all_reduce       parameters whole, output Partial -> Replicate (AllReduceParallel, :391-402)
#   mla_kv_a_proj    parameters whole, output split and concatenated again (MlaKvAProjParallel, :432-442)
STYLE_KINDS = {
    COLWISE: "linear_colwise",
    "packed_colwise": "linear_colwise",  # :473-532, _StridedShard(0): a [out/T, in] local weight all the same
    COLWISE_GATHER_OUTPUT: "linear_gather",
    "colwise_rep": "linear_gather",
    ROWWISE: "linear_rowwise",
    "rowwise_rep": "linear_rowwise_replicated_input",
    "rowwise_split_input": "linear_rowwise_replicated_input",
    EMBEDDING_ROWWISE: "embedding_rowwise",
    EMBEDDING_COLWISE: "embedding_colwise",
    "replicate": "whole",
    "replicated_with_grad_allreduce": "whole",
    "sequence_parallel": "whole",
    "local_params": "whole",
    "all_reduce": "all_reduce",
    "mla_kv_a_proj": "mla_kv_a_proj",
}
STYLES = tuple(STYLE_KINDS)
# transformers' expert styles: memcheck shards MoE experts with ep (``--layout ep=``), not with tp
EXPERT_STYLES = ("moe_tp_experts", "moe_identity_expert", "packed_rowwise", "grouped_gemm", "ep_dispatch_experts")
_ROWWISE_KINDS = ("linear_rowwise", "linear_rowwise_replicated_input")
_LINEAR_KINDS = ("linear_colwise", "linear_gather", *_ROWWISE_KINDS)


@dataclass(frozen=True)
class TensorParallelRank:
    """What ``shard`` did: the plan it applied and one rank's parameter bytes before and after."""

    degree: int
    sequence_parallel: bool
    plan: tuple[tuple[str, str], ...]  # the resolved plan, (glob, style) in order
    colwise: tuple[str, ...]  # the linear modules sharded column-wise (gathered or not)
    rowwise: tuple[str, ...]  # the linear modules sharded row-wise
    embeddings: tuple[tuple[str, str], ...]  # (module, style) of the embeddings sharded
    whole: tuple[str, ...]  # the modules a style names but leaves whole (replicate, all_reduce, ...)
    full_parameter_bytes: int  # the whole model's parameters
    parameter_bytes: int  # one rank's parameters after sharding
    replicated_parameter_bytes: int  # of those, the ones every rank holds whole


def check_plan(plan) -> dict[str, str]:
    """A user's plan validated: a non-empty dict of string globs to a style of ``STYLES``."""
    if not isinstance(plan, dict) or not plan:
        raise UsageError(f"a tensor-parallel plan must be a non-empty dict {{module glob: 'colwise' | 'rowwise'}}, "
                         f"got {short_repr(plan)}")
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise UsageError(f"tensor-parallel plan key {short_repr(key)} must be a module name or glob "
                             "such as 'layers.*.mlp.up_proj'")
        if style in EXPERT_STYLES:
            raise UsageError(f"tensor-parallel plan style {short_repr(style)} for {short_repr(key)} shards MoE experts; "
                             "memcheck shards experts with expert parallelism: drop the entry and use --layout ep=N")
        if style not in STYLES:
            raise UsageError(f"tensor-parallel plan style {short_repr(style)} for {short_repr(key)} is not modelled; "
                             f"use one of transformers' styles: {', '.join(STYLES)}")
    return dict(plan)


def default_plan(model: nn.Module) -> dict[str, str] | None:
    """The transformers config's ``base_model_tp_plan`` with each key prefixed by the base model's
    attribute (``model.`` for LlamaForCausalLM, nothing for LlamaModel); ``None`` if there is none."""
    model = base_of(model)
    # transformers >= 5.x: the plan from_pretrained(tp_plan="auto") applies, as the model resolves it
    # (transformers/distributed/mixin.py:79-104, init_parallel_plans): the class's ``_tp_plan`` (e.g.
    # ``lm_head: colwise_gather_output``), the config's ``base_model_tp_plan`` under the base model's
    # attribute, and ``embed_tokens: embedding_rowwise`` where the base model has an nn.Embedding there.
    resolved = getattr(model, "tp_plan", None)
    if isinstance(resolved, dict) and resolved and all(isinstance(v, str) for v in resolved.values()):
        return dict(resolved)
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        return None
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    head = f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""
    return {head + key: style for key, style in base_plan.items()}


def base_of(model: nn.Module) -> nn.Module:
    """The model that tensor parallelism shards: under PEFT the transformers model inside the
    ``PeftModel`` (``get_base_model()``; PEFT puts LoRA over a tensor-parallel model, whose plan
    names its modules), else ``model``."""
    get = getattr(model, "get_base_model", None)
    base = get() if callable(get) else None
    return base if isinstance(base, nn.Module) else model


def lora_parts(module: nn.Module) -> tuple[nn.Module, nn.ModuleDict, nn.ModuleDict] | None:
    """``(base_layer, lora_A, lora_B)`` of a PEFT LoRA layer, else None."""
    base = getattr(module, "base_layer", None)
    a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if isinstance(base, nn.Module) and isinstance(a, nn.ModuleDict) and isinstance(b, nn.ModuleDict):
        return base, a, b
    return None


def resolve_plan(model: nn.Module, plan: dict[str, str] | None = None) -> dict[str, str]:
    """The plan to apply: the user's (validated) or ``default_plan(model)``; a model with neither is an error."""
    if plan is not None:
        return check_plan(plan)
    found = default_plan(model)
    if found is None:
        raise UsageError(
            f"{type(model).__name__} has no tensor-parallel plan (its config carries no base_model_tp_plan); "
            "give one: --tp-plan 'h.*.attn.c_attn=colwise,h.*.attn.c_proj=rowwise' (tp_plan= in Python, "
            "{module glob: 'colwise' | 'rowwise'})"
        )
    for key, style in found.items():
        if style not in STYLES:
            raise UsageError(
                f"{type(model).__name__}'s tensor-parallel plan shards {key!r} as {style!r}, which memcheck does not "
                f"model; pass your own plan (--tp-plan) with these styles only: {', '.join(STYLES)}"
            )
    return found


def match_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``{module name: style}`` for every module the plan names, matched as ``parallelize_module`` does.

    A key that matches no module, or a module two keys match, is an error (torch warns and skips
    the first, and would shard the second twice)."""
    names = {id(module): name for name, module in model.named_modules()}
    matched: dict[str, str] = {}
    for key, style in plan.items():
        found = _match(model, key.split("."))
        if not found:
            owner, _, leaf = key.rpartition(".")
            if any(leaf in dict(module.named_parameters(recurse=False)) for module in _match(model, owner.split("."))):
                raise UsageError(f"tensor-parallel plan key {short_repr(key)} names a parameter of "
                                 f"{type(model).__name__}; memcheck shards whole modules only (transformers' "
                                 "parameter-level entries are not modelled)")
            raise UsageError(f"tensor-parallel plan key {short_repr(key)} matches no module of {type(model).__name__}")
        for module in found:
            name = names[id(module)]
            if name in matched:
                raise UsageError(f"module {name!r} is matched by two tensor-parallel plan keys; "
                                 f"the second is {key!r}")
            matched[name] = style
    return matched


def _match(module: nn.Module, parts: list[str]) -> list[nn.Module]:
    # parallelize_module (torch/distributed/tensor/parallel/api.py): fnmatch the first part
    # against named_children(), then recurse with the rest of the path.
    if not parts:
        return [module]
    found = []
    for name, child in module.named_children():
        if fnmatch(name, parts[0]):
            found.extend(_match(child, parts[1:]))
    return found


BACKENDS = ("nccl", "gloo")  # the process group's backend: gloo's reduce-scatter clones its input, NCCL's does not


def shard(model: nn.Module, degree: int, *, plan: dict[str, str] | None = None,
          sequence_parallel: bool = False, backend: str = "nccl", loss_parallel: bool = False) -> TensorParallelRank:
    """Turn ``model`` (parameters on the meta device) IN PLACE into one tensor-parallel rank of degree ``degree``.

    Column-wise ``nn.Linear`` keep ``out/T`` output features, row-wise ones ``in/T`` input
    features (bias whole); hooks add the collectives' copies (see the module docstring).
    ``plan`` is ``{glob: "colwise" | "rowwise"}``; by default the transformers config's
    ``base_model_tp_plan``. Pass a meta copy (``memcheck.engine.setup.meta_twin(model)``)
    and hand the result to ``memcheck.estimate`` as a one-GPU model.

    Raises:
        UsageError: a bad degree or plan, a model not on meta, no plan for the model, a
            sharded module that is not ``nn.Linear``, a dimension (attention heads, key/value
            heads, features) the degree does not divide, or ``sequence_parallel=True``.

    Example:
        >>> with torch.device("meta"):
        ...     model = LlamaForCausalLM(LlamaConfig(...))
        >>> rank = shard(model, 4)
        >>> memcheck.estimate(model, batch, memcheck.Job(device="cpu")).peak_bytes
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise UsageError(f"tensor-parallel degree must be an integer >= 1, got {short_repr(degree)}")
    if not isinstance(sequence_parallel, bool):
        raise UsageError(f"sequence_parallel must be True or False, got {short_repr(sequence_parallel)}")
    if backend not in BACKENDS:
        raise UsageError(f"tensor-parallel backend must be 'nccl' or 'gloo', got {short_repr(backend)}")
    if not isinstance(loss_parallel, bool):
        raise UsageError(f"loss_parallel must be True or False, got {short_repr(loss_parallel)}")
    on_device = next((name for name, t in [*model.named_parameters(), *model.named_buffers()]
                      if t.device.type != "meta"), None)
    if on_device is not None:
        raise UsageError(f"shard() changes the model in place and needs it on the meta device, but {on_device!r} "
                         "is not; pass a meta copy (memcheck.engine.setup.meta_twin(model))")
    target = base_of(model)  # under PEFT, the transformers model that the plan names
    resolved = resolve_plan(target, plan)
    matched = match_plan(target, resolved)
    modules = dict(target.named_modules())
    layers = {name: _module_of(name, modules[name], style, sequence_parallel, target)
              for name, style in matched.items()}
    _check_divisible(target, layers, matched, degree)
    decoder = _sequence_parallel_decoder(target, matched) if sequence_parallel else None
    head_name = _head_name(target) if loss_parallel else None
    if loss_parallel and STYLE_KINDS.get(matched.get(head_name, "")) not in ("linear_colwise", "linear_gather"):
        raise UsageError(f"loss parallelism keeps the LM head's logits sharded by vocabulary, so the plan must shard "
                         f"the head column-wise; {type(target).__name__}'s head "
                         f"{head_name or '(get_output_embeddings() is None)'} is "
                         f"{'sharded as ' + repr(matched[head_name]) if head_name in matched else 'not in the plan'}")
    full = _parameter_bytes(model)
    sharded: set[int] = set()
    replaced: dict[int, nn.Parameter] = {}  # a tied weight (embedding and head) sharded once, still tied
    for name, style in matched.items():
        kind, layer, lora = STYLE_KINDS[style], layers[name], lora_parts(modules[name])
        if kind in ("embedding_rowwise", "embedding_colwise"):
            _embedding(layer, degree, rows=kind == "embedding_rowwise", replaced=replaced)
            sharded.add(id(layer.weight))
            continue
        if kind == "whole":
            continue  # parameters whole, nothing allocated (STYLE_KINDS)
        if kind == "all_reduce":
            layer.register_forward_hook(_all_reduced_output)
            continue
        if kind == "mla_kv_a_proj":
            layer.register_forward_hook(partial(_mla_kv_a_output, _rope_dim(target, name)))
            continue
        # under LoRA, PEFT shards the adapter half that meets the sharded dimension (add_lora_tp_hooks_dtensor)
        pairs = [(layer, kind)] + ([(b, "linear_colwise") for b in lora[2].values()] if lora and style == COLWISE
                                   else [(a, "linear_rowwise") for a in lora[1].values()] if lora else [])
        for linear, how in pairs:
            if how in _ROWWISE_KINDS:
                _rowwise(linear, degree, scatter_sequence=sequence_parallel, gloo=backend == "gloo",
                         replicated_input=how == "linear_rowwise_replicated_input")
            else:
                head = sequence_parallel and decoder[0] and name == "lm_head"  # its input is Shard(1) under SP
                # torchtitan's apply_tp under loss_parallel: the head's output_layouts=Shard(-1),
                # use_local_output=False: the logits stay this rank's [.., V/T] (no gather)
                gather = how == "linear_gather" and not (loss_parallel and name == head_name)
                _colwise(linear, degree, gather_output=gather, replaced=replaced,
                         sequence_input=(backend == "gloo") if head else None)
            sharded.update(id(p) for p in linear.parameters() if not (how in _ROWWISE_KINDS and p is linear.bias))
    if decoder is not None:
        _sequence_parallel_hooks(target, decoder, degree, head_sharded="lm_head" in matched)
    if loss_parallel and isinstance(getattr(type(target), "loss_function", None), property):
        # transformers' causal-LM loss views the logits as [-1, config.vocab_size] (loss/loss_utils.py:69,
        # ForCausalLMLoss), which the global shape of the real run's DTensor logits satisfies; this rank's
        # local logits are [.., V/T], so the loss is handed that width (the model's loss_function setter)
        target.loss_function = partial(_local_vocab_loss, target.loss_function, modules[head_name].out_features)
    seen: set[int] = set()
    replicated = sum(p.numel() * p.element_size() for p in model.parameters()
                     if id(p) not in sharded and not (id(p) in seen or seen.add(id(p))))
    kinds = {name: STYLE_KINDS[style] for name, style in matched.items()}
    return TensorParallelRank(
        degree=degree,
        sequence_parallel=sequence_parallel,
        plan=tuple(resolved.items()),
        colwise=tuple(n for n, k in kinds.items() if k in ("linear_colwise", "linear_gather")),
        rowwise=tuple(n for n, k in kinds.items() if k in _ROWWISE_KINDS),
        embeddings=tuple((n, matched[n]) for n, k in kinds.items() if k.startswith("embedding_")),
        whole=tuple(n for n, k in kinds.items() if k in ("whole", "all_reduce", "mla_kv_a_proj")),
        full_parameter_bytes=full,
        parameter_bytes=_parameter_bytes(model),
        replicated_parameter_bytes=replicated,
    )


def _module_of(name: str, module: nn.Module, style: str, sequence_parallel: bool, model: nn.Module) -> nn.Module:
    """The module that the plan's ``style`` acts on at ``name``: an ``nn.Linear`` (or a LoRA layer's base)
    for the linear styles, an ``nn.Embedding`` for the embedding ones, the module itself for the rest."""
    kind = STYLE_KINDS[style]
    lora = lora_parts(module)
    if lora is not None:
        base, _, _ = lora
        if any(getattr(module, "use_dora", {}).values()):
            raise UsageError(f"tensor parallelism with DoRA (use_dora on {name!r}) is not modelled: DoRA's weight norm "
                             "needs the whole weight; drop --dora or tp")
        if style not in (COLWISE, ROWWISE):
            raise UsageError(f"tensor-parallel plan shards {name!r} as {style!r} under LoRA; PEFT shards LoRA layers "
                             "colwise or rowwise only (add_lora_tp_hooks_dtensor)")
        if sequence_parallel:
            raise UsageError(f"sequence parallelism with LoRA ({name!r}) is not modelled; drop sp=true or --lora")
        module = base
    if kind.startswith("embedding_"):
        if not isinstance(module, nn.Embedding):
            raise UsageError(f"tensor-parallel plan shards {name!r} ({type(module).__name__}) as {style!r}, "
                             "an embedding style; it shards nn.Embedding only")
        if module.max_norm is not None or module.sparse:
            raise UsageError(f"tensor-parallel plan shards {name!r} as {style!r}, but it is an nn.Embedding with "
                             "max_norm or sparse gradients, which memcheck does not model sharded")
        return module
    if kind == "mla_kv_a_proj":
        _rope_dim(model, name)  # checked before anything changes
    if kind not in _LINEAR_KINDS and kind != "mla_kv_a_proj":
        return module
    if type(module) is not nn.Linear:
        hint = "; 4-bit (QLoRA) weights cannot be tensor-parallel here, drop --qlora or tp" if "4bit" in \
            type(module).__name__ else ""
        raise UsageError(f"tensor-parallel plan shards {name!r} ({type(module).__name__}) as {style!r}; "
                         f"memcheck models that style on nn.Linear only{hint}")
    return module


def _rope_dim(model: nn.Module, name: str) -> int:
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(rope, int) or rope < 1:
        raise UsageError(f"tensor-parallel plan shards {name!r} as 'mla_kv_a_proj', which needs the config's "
                         "qk_rope_head_dim (MlaKvAProjParallel); this model's config has none")
    return rope


def _parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() skips tied duplicates


def _check_divisible(model: nn.Module, modules: dict, matched: dict[str, str], degree: int) -> None:
    """Every sharded dimension divisible by ``degree``: attention heads and key/value heads (a
    column-wise output that is a whole number of heads), then each Linear's sharded features and each
    embedding's sharded dimension. (transformers lets the last rank hold a shorter slice; memcheck
    traces one rank for all, so it asks for equal ones.)"""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and heads and getattr(config, "hidden_size", None):
        head_dim = config.hidden_size // heads
    named = [("num_attention_heads", heads), ("num_key_value_heads", kv_heads)]
    kinds = {name: STYLE_KINDS[style] for name, style in matched.items()}
    for name, kind in kinds.items():
        linear = modules[name]
        if kind in ("linear_colwise", "linear_gather") and head_dim:
            for attr, count in named:
                if isinstance(count, int) and linear.out_features == count * head_dim and count % degree:
                    raise UsageError(f"tensor-parallel degree {degree} does not divide {attr}={count} "
                                     f"(the heads of {name!r})")
    for name, kind in kinds.items():
        module = modules[name]
        if kind in _ROWWISE_KINDS:
            attr, size = "in_features", module.in_features
        elif kind in ("linear_colwise", "linear_gather"):
            attr, size = "out_features", module.out_features
        elif kind == "embedding_rowwise":
            attr, size = "num_embeddings", module.num_embeddings
        elif kind == "embedding_colwise":
            attr, size = "embedding_dim", module.embedding_dim
        else:
            continue
        if size % degree:
            named_size = next((f" ({key}={size})" for key in ("intermediate_size", "vocab_size", "hidden_size")
                               if getattr(config, key, None) == size), "")
            raise UsageError(f"tensor-parallel degree {degree} does not divide {name}.{attr}={size}{named_size}")


def _meta_parameter(param: nn.Parameter, shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)


def _shared(replaced: dict | None, param: nn.Parameter, shape: tuple[int, ...]) -> nn.Parameter:
    """The sharded stand-in of ``param``: one per parameter, so a weight tied between an embedding and a
    head (tie_word_embeddings) stays one tensor (both styles shard it Shard(0), [V/T, H])."""
    if replaced is None:
        return _meta_parameter(param, shape)
    new = replaced.get(id(param))
    if new is None or tuple(new.shape) != tuple(shape):
        new = replaced[id(param)] = _meta_parameter(param, shape)
    return new


def _colwise(linear: nn.Linear, degree: int, *, gather_output: bool = False, replaced: dict | None = None,
             sequence_input: bool | None = None) -> None:
    # ColwiseParallel._partition_linear_fn (style.py:121-132): weight and bias Shard(0); transformers'
    # ColwiseParallel.shard_param (transformers/distributed/tensor_parallel.py:163-171) the same.
    out = linear.out_features // degree
    linear.weight = _shared(replaced, linear.weight, (out, linear.in_features))
    if linear.bias is not None:
        linear.bias = _meta_parameter(linear.bias, (out,))
    linear.out_features = out
    if sequence_input is None:
        linear.register_forward_pre_hook(_colwise_input)
    else:  # ColwiseParallel(input_layouts=Shard(1)) on the head under SP (torchtitan's apply_tp)
        linear.register_forward_pre_hook(partial(_gather_sequence_input, degree, sequence_input))
    if gather_output:
        linear.register_forward_hook(partial(_colwise_gathered_output, degree))


def _rowwise(linear: nn.Linear, degree: int, *, scatter_sequence: bool = False, gloo: bool = False,
             replicated_input: bool = False) -> None:
    # RowwiseParallel._partition_linear_fn (style.py:250-278): weight Shard(1), bias Replicate.
    inp = linear.in_features // degree
    linear.weight = _meta_parameter(linear.weight, (linear.out_features, inp))
    linear.in_features = inp
    if replicated_input:
        # rowwise_rep / rowwise_split_input: RowwiseParallel(input_layouts=Replicate())
        # (transformers/distributed/tensor_parallel.py:609, :611); transform_inputs_pre_forward
        # (:250-268) redistributes the whole input Replicate -> Shard(-1): Shard._replicate_to_shard
        # (torch/distributed/tensor/placement_types.py:619-637), this rank's last-dim chunk cloned.
        linear.register_forward_pre_hook(partial(_cut_last_dim_input, degree))
    if scatter_sequence:  # RowwiseParallel(output_layouts=Shard(1)): Partial -> Shard(1)
        linear.register_forward_hook(partial(_rowwise_scattered_output, degree, gloo))
    else:
        linear.register_forward_hook(_rowwise_output)


def _sequence_parallel_decoder(model: nn.Module, matched: dict[str, str]):
    """``(base prefix, base model)`` of a transformers decoder that sequence parallelism can cut, checked.

    It needs ``layers`` (each with ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``
    and ``mlp``), a final ``norm``, and a plan whose row-wise modules are the attention and MLP
    outputs (their Shard(1) outputs are what the residual stream adds)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    head = f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""
    base = base if head else model
    layers = getattr(base, "layers", None)
    parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    if (not isinstance(layers, nn.ModuleList) or not len(layers)
            or not isinstance(getattr(base, "norm", None), nn.Module)
            or any(not isinstance(getattr(layer, part, None), nn.Module) for layer in layers for part in parts)):
        raise UsageError(f"sequence parallelism is modelled for transformers decoders (layers.N.input_layernorm, "
                         f"self_attn, post_attention_layernorm, mlp and a final norm, as LlamaForCausalLM); "
                         f"{type(model).__name__} is not one")
    for name, style in matched.items():
        if style == ROWWISE and not any(name.startswith(f"{head}layers.{i}.self_attn.")
                                        or name.startswith(f"{head}layers.{i}.mlp.") for i in range(len(layers))):
            raise UsageError(f"sequence parallelism needs the row-wise modules inside the attention and MLP blocks; "
                             f"the plan shards {name!r} row-wise")
    return head, base


def _sequence_parallel_hooks(model: nn.Module, decoder, degree: int, *, head_sharded: bool = False) -> None:
    """torchtitan's ``apply_tp`` styles (llama3/infra/parallelize.py) as measure_tp_cpu applies them to a
    transformers decoder: the first layer's input cut to S/T tokens, the norms on the cut, the attention
    and MLP inputs gathered, the final norm's output gathered before the LM head."""
    head, base = decoder
    # PrepareModuleInput(Replicate -> Shard(1)) on layers.0: positions and the causal mask are built in
    # LlamaModel.forward from the whole sequence, so the cut cannot come at the embedding.
    base.layers[0].register_forward_pre_hook(partial(_scatter_first_arg, degree))
    for layer in base.layers:
        # SequenceParallel on the norms (style.py:339-422): from_local / to_local, views; they compute on
        # [B, S/T, H]. PrepareModuleInput(Shard(1) -> Replicate) on self_attn (hidden_states=) and mlp.
        layer.self_attn.register_forward_pre_hook(partial(_gather_hidden_states, degree), with_kwargs=True)
        layer.mlp.register_forward_pre_hook(partial(_gather_first_arg, degree))
    lm_head = getattr(model, "lm_head", None) if head else None
    if isinstance(lm_head, nn.Module) and not head_sharded:  # a sharded head gathers its own input (_colwise)
        lm_head.register_forward_pre_hook(partial(_gather_first_arg, degree))


def _scatter_first_arg(degree, module, args):
    return (_ScatterSequence.apply(args[0], degree), *args[1:])


def _gather_sequence_input(degree, gloo, module, args):
    return (_GatherSequenceColwise.apply(args[0], degree, gloo), *args[1:])


class _GatherSequenceColwise(torch.autograd.Function):
    """A column-wise layer's ``Shard(1)`` input under SP (``ColwiseParallel(input_layouts=Shard(1))``,
    style.py:99-119: ``from_local`` then ``redistribute`` to ``Replicate``). Forward: the all-gather, as
    ``_GatherSequence``. Backward: the input's gradient is ``Partial`` (the matmul with the ``Shard(0)``
    weight) and ``Redistribute.backward`` takes it to the input's ``Shard(1)`` (_redistribute.py:1817-1830):
    a reduce-scatter, with the copies ``_ReduceScatterSequence``'s forward makes."""

    @staticmethod
    def forward(ctx, local, degree, gloo):
        ctx.degree, ctx.gloo = degree, gloo
        return _all_gather_dim1(local.contiguous(), degree)

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatterSequence.forward(ctx, grad, ctx.degree, ctx.gloo), None, None


def _gather_first_arg(degree, module, args):
    return (_GatherSequence.apply(args[0], degree), *args[1:])


def _gather_hidden_states(degree, module, args, kwargs):
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": _GatherSequence.apply(kwargs["hidden_states"], degree)}
    return (_GatherSequence.apply(args[0], degree), *args[1:]), kwargs


def _rowwise_scattered_output(degree, gloo, module, args, output):
    return _ReduceScatterSequence.apply(output, degree, gloo)


def _all_gather_dim1(local: torch.Tensor, degree: int) -> torch.Tensor:
    # Shard._to_replicate_tensor (placement_types.py:591-617) -> funcol.all_gather_single
    # (_functional_collectives.py:185-222): all_gather_into_tensor allocates [T*B, S/T, H]
    # (Functional.cpp allocate_all_gather_output), _maybe_view_chunk_cat concatenates its T chunks
    # along dim 1 into [B, S, H]; the gathered buffer is then dropped.
    gathered = local.new_empty((degree * local.shape[0], *local.shape[1:]))
    return torch.cat(torch.chunk(gathered, degree, dim=0), dim=1)


def _chunk_dim1(whole: torch.Tensor, degree: int) -> torch.Tensor:
    # Shard._replicate_to_shard (placement_types.py:619-637): _select_split_tensor(clone=True), this
    # rank's [B, S/T, H] chunk cloned.
    return torch.chunk(whole, degree, dim=1)[0].clone()


class _ScatterSequence(torch.autograd.Function):
    """The first layer's input, Replicate -> Shard(1) (PrepareModuleInput, style.py:522-544). Forward:
    this rank's chunk cloned. Backward: Redistribute.backward (_redistribute.py:1953) takes the Shard(1)
    gradient back to Replicate, an all-gather."""

    @staticmethod
    def forward(ctx, whole, degree):
        if whole.shape[1] % degree:
            raise UsageError(f"sequence parallelism cuts the sequence into tp={degree} equal parts, but its length "
                             f"is {whole.shape[1]}; use a sequence length divisible by {degree}")
        ctx.degree = degree
        return _chunk_dim1(whole, degree)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim1(grad.contiguous(), ctx.degree), None


class _GatherSequence(torch.autograd.Function):
    """An attention / MLP / LM-head input, Shard(1) -> Replicate (PrepareModuleInput, style.py:522-544):
    the all-gather's [T*B, S/T, H] buffer and the [B, S, H] it is concatenated into. Backward: the
    Replicate gradient (the column-wise inputs' all-reduced gradients, summed) back to Shard(1), this
    rank's chunk cloned."""

    @staticmethod
    def forward(ctx, local, degree):
        ctx.degree = degree
        return _all_gather_dim1(local.contiguous(), degree)

    @staticmethod
    def backward(ctx, grad):
        return _chunk_dim1(grad, ctx.degree), None


class _ReduceScatterSequence(torch.autograd.Function):
    """A row-wise output, Partial -> Shard(1) (RowwiseParallel(output_layouts=Shard(1)), style.py:293-300).

    Forward: ``Shard._reduce_shard_tensor`` (placement_types.py:475-520) calls
    ``funcol.reduce_scatter_single`` (_functional_collectives.py:247-286), which for a scatter dim
    other than 0 first concatenates the T chunks along dim 0 (``_chunk_or_narrow_cat``, a whole-size
    copy); ``_c10d_functional::reduce_scatter_tensor`` allocates the [B, S/T, H] output
    (Functional.cpp); the copy is then dropped. Under gloo (``backend="gloo"``, CPU ranks),
    ``ProcessGroupGloo``'s ``reduce_scatter_tensor_coalesced`` clones that whole-size input once
    more before the output is allocated (measured: the 2-rank SP runs in docs/tp.md); NCCL does
    not. Backward: ``Redistribute.backward`` turns Shard(1) -> Partial into Shard(1) -> Replicate
    (_redistribute.py:1824-1829), an all-gather.
    """

    @staticmethod
    def forward(ctx, whole, degree, gloo=False):
        ctx.degree = degree
        chunks = torch.cat(torch.chunk(whole, degree, dim=1), dim=0)
        staged = chunks.clone() if gloo else None  # noqa: F841 (alive while the output is allocated)
        return chunks.new_empty((whole.shape[0], whole.shape[1] // degree, *whole.shape[2:]))

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim1(grad.contiguous(), ctx.degree), None, None


def _colwise_input(module, args):
    # ColwiseParallel._prepare_input_fn (style.py:99-119): DTensor.from_local(x, Replicate), a view.
    return (_GradAllReduce.apply(args[0]), *args[1:])


def _colwise_gathered_output(degree, module, args, output):
    # ColwiseParallel(output_layouts=Replicate())._prepare_output_fn (style.py:146-151): Shard(-1) -> Replicate.
    return _AllGatherLastDim.apply(output, degree)


def _rowwise_output(module, args, output):
    # RowwiseParallel._prepare_output_fn (style.py:292-300): Partial -> Replicate, then to_local().
    return _AllReduce.apply(output)


class _AllReduce(torch.autograd.Function):
    """Forward: ``funcol.all_reduce``'s copy of the row-wise output (Functional.cpp ``c10d::all_reduce``
    clones, then reduces the clone in place). Backward: the Replicate gradient passes as it is
    (_redistribute.py:1817-1830)."""

    @staticmethod
    def forward(ctx, partial):
        return partial.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GradAllReduce(torch.autograd.Function):
    """Forward: ``DTensor.from_local``, a view of the column-wise input. Backward: the Partial input
    gradient all-reduced to Replicate (_api.py:238-283, ``_FromTorchTensor.backward``), a copy."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(memory_format=torch.contiguous_format)


class _AllGatherLastDim(torch.autograd.Function):
    """Shard(-1) -> Replicate of a column-wise output (``colwise_gather_output``).

    Forward: ``Shard._to_replicate_tensor`` (placement_types.py:591-617) calls
    ``funcol.all_gather_single`` (_functional_collectives.py:185-222): ``all_gather_into_tensor``
    allocates ``[T * d0, ...]`` (Functional.cpp ``allocate_all_gather_output``), and for a gather
    dimension other than 0 ``_maybe_view_chunk_cat`` concatenates its T chunks along that dimension,
    a second whole-size tensor; the gathered one is then dropped. Backward: Replicate -> Shard(-1)
    is ``Shard._replicate_to_shard`` (placement_types.py:619-637), this rank's chunk cloned.
    """

    @staticmethod
    def forward(ctx, local, degree):
        ctx.degree = degree
        gathered = local.new_empty((degree * local.shape[0], *local.shape[1:]))
        return torch.cat(torch.chunk(gathered, degree, dim=0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return torch.chunk(grad, ctx.degree, dim=-1)[0].clone(), None


# ---- transformers' other styles -------------------------------------------------------------------


def _embedding(embedding: nn.Embedding, degree: int, *, rows: bool, replaced: dict) -> None:
    """``embedding_rowwise`` (``rows=True``, vocabulary-parallel) or ``embedding_colwise``: transformers'
    ``EmbeddingParallel(shard_dim=0 | 1)`` (transformers/distributed/tensor_parallel.py:314-353)."""
    vocab, dim = embedding.num_embeddings, embedding.embedding_dim
    if rows:
        # shard_param (:326-333): weight Shard(0), [V/T, H].
        embedding.weight = _shared(replaced, embedding.weight, (vocab // degree, dim))
        embedding.num_embeddings = vocab // degree
        embedding.forward = partial(_vocab_parallel_forward, embedding, vocab)
    else:
        # shard_param: weight Shard(1), [V, H/T]. The lookup runs on the local shard (aten.embedding's
        # colwise strategy, torch/distributed/tensor/_ops/_embedding_ops.py:47-48: output Shard(-1),
        # indices Replicate) and transform_output_post_forward (:347-353) gathers Shard(-1) -> Replicate,
        # the all-gather colwise_gather_output makes; the backward's weight gradient stays [V, H/T]
        # (embedding_dense_backward's colwise strategy, _embedding_ops.py:87-88).
        embedding.weight = _shared(replaced, embedding.weight, (vocab, dim // degree))
        embedding.embedding_dim = dim // degree
        embedding.register_forward_hook(partial(_colwise_gathered_output, degree))


def _vocab_parallel_forward(embedding: nn.Embedding, vocab: int, *args, **kwargs) -> torch.Tensor:
    # The module's own forward (a subclass's too, e.g. Gemma3's scaled embedding, which multiplies
    # nn.Embedding.forward's output), with its F.embedding of this weight run as the vocabulary-parallel lookup.
    original = torch.nn.functional.embedding

    def lookup(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
        if weight is not embedding.weight:
            return original(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        padding = -1 if padding_idx is None else padding_idx
        return _VocabParallelLookup.apply(input, weight, vocab, padding, scale_grad_by_freq)

    torch.nn.functional.embedding = lookup
    try:
        return type(embedding).forward(embedding, *args, **kwargs)
    finally:
        torch.nn.functional.embedding = original


class _VocabParallelLookup(torch.autograd.Function):
    """A vocabulary-parallel lookup (``embedding_rowwise``) as transformers 5.23 runs it on DTensor (torch 2.13).

    Forward: ``EmbeddingParallel.transform_inputs_pre_forward`` (transformers/distributed/tensor_parallel.py:335-345)
    wraps the ids ``Replicate`` (``DTensor.from_local``, a view). ``aten.embedding``'s row-wise strategy
    (torch/distributed/tensor/_ops/_embedding_ops.py:50-53) redistributes them to ``_MaskPartial``:
    ``_MaskPartial._mask_tensor`` (torch/distributed/tensor/placement_types.py:1656-1696) builds the
    out-of-shard mask (bool ``[B, S]``, two comparisons or-ed; kept in the ``MaskBuffer`` until the reduction)
    and the shifted ids (``ids.clone() - offset``, int64 ``[B, S]``, out-of-shard ones set to 0 in place); the
    local lookup gives ``[B, S, H]``; ``transform_output_post_forward`` (:347-353) redistributes it to
    ``Replicate``: ``_MaskPartial._reduce_value`` (placement_types.py:1697-1714) zeroes the masked rows in
    place and calls ``funcol.all_reduce``, which clones (Functional.cpp ``c10d::all_reduce``); the partial
    lookup is dropped after.

    Backward: ``Redistribute.backward`` keeps the ``Replicate`` gradient as it is
    (torch/distributed/tensor/_redistribute.py:1817-1830), and the saved ids are the ``Replicate`` ones, so
    ``aten.embedding_dense_backward`` runs on replicated inputs: none of its strategies shards the weight
    gradient by rows (_embedding_ops.py:62-97), so every rank computes the WHOLE vocabulary's gradient
    ``[V, H]``, and it becomes the parameter's ``.grad`` (a ``Replicate`` DTensor over the ``Shard(0)``
    weight) until ``zero_grad``. Here: ``[V, H]`` computed, and this rank's rows of it (a view, which keeps
    the whole ``[V, H]`` alive) returned as the gradient of the ``[V/T, H]`` weight.
    """

    @staticmethod
    def forward(ctx, ids, weight, vocab, padding, scale_grad_by_freq):
        mask = (ids < 0) | (ids >= weight.shape[0])  # noqa: F841 (the MaskBuffer: alive until the reduction)
        shifted = ids.clone() - 0  # the real offset is this rank's first row; rank 0's is 0
        local = torch.ops.aten.embedding(weight, shifted)  # the local lookup (not F.embedding: patched here)
        del shifted
        out = local.clone(memory_format=torch.contiguous_format)  # funcol.all_reduce's copy
        ctx.save_for_backward(ids)
        ctx.vocab, ctx.padding, ctx.scale = vocab, padding, scale_grad_by_freq
        ctx.rows = weight.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        (ids,) = ctx.saved_tensors
        whole = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.vocab, ctx.padding, ctx.scale)
        return None, whole.narrow(0, 0, ctx.rows), None, None, None


def _cut_last_dim_input(degree, module, args):
    return (_CutLastDim.apply(args[0], degree), *args[1:])


class _CutLastDim(torch.autograd.Function):
    """A whole input cut to this rank's last-dim chunk (``rowwise_rep``/``rowwise_split_input``).

    Forward: ``Shard._replicate_to_shard`` (torch/distributed/tensor/placement_types.py:619-637),
    ``_select_split_tensor(clone=True)``: the chunk cloned. Backward: ``Redistribute.backward`` takes the
    ``Shard(-1)`` gradient back to ``Replicate`` (_redistribute.py:1817-1830), an all-gather along the last
    dimension: the ``[T * d0, ...]`` buffer and the concatenated copy (as ``_AllGatherLastDim``'s forward)."""

    @staticmethod
    def forward(ctx, whole, degree):
        if whole.shape[-1] % degree:
            raise UsageError(f"a row-wise layer with a replicated input cuts its last dimension into tp={degree} "
                             f"parts, but it is {whole.shape[-1]}")
        ctx.degree = degree
        return torch.chunk(whole, degree, dim=-1)[0].clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        gathered = grad.new_empty((ctx.degree * grad.shape[0], *grad.shape[1:]))
        return torch.cat(torch.chunk(gathered, ctx.degree, dim=0), dim=-1), None


def _all_reduced_output(module, args, output):
    # AllReduceParallel.transform_output_post_forward (transformers/distributed/tensor_parallel.py:394-402):
    # DTensor.from_local(Partial) -> Replicate, funcol.all_reduce's copy; the backward passes the gradient.
    return _AllReduce.apply(output) if isinstance(output, torch.Tensor) else output


def _mla_kv_a_output(rope_dim, module, args, output):
    # MlaKvAProjParallel.transform_output_post_forward (transformers/distributed/tensor_parallel.py:432-442):
    # the output split into [.., -rope] and [.., rope] (views), the rope part through _AllReduceBackward
    # (transformers/distributed/parallel_utils.py:113-140: identity forward; backward grad.contiguous(), a
    # copy of the non-contiguous slice, then dist.all_reduce in place), and torch.cat of the two: a copy.
    passed, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([passed, _ContiguousGrad.apply(rope)], dim=-1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward ``grad.contiguous()`` (``_AllReduceBackward``, then an in-place all-reduce)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


# ---- loss parallelism (torch.distributed.tensor.parallel.loss_parallel) ------------------------------------


def _head_name(model: nn.Module) -> str | None:
    """The name of the model's LM head (``get_output_embeddings()``), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return None
    return next((name for name, module in model.named_modules() if module is head), None)


def _local_vocab_loss(loss_function, local_vocab, *args, **kwargs):
    if "vocab_size" in kwargs:
        kwargs["vocab_size"] = local_vocab
    return loss_function(*args, **kwargs)


def loss_parallel_context(model: nn.Module):
    """A factory of the context a loss-parallel rank's steps run in: ``F.cross_entropy`` on this rank's
    vocabulary shard of the logits (``[N, V/T]``, the sharded head's ``out_features``) computed as torch's
    ``loss_parallel()`` computes it (``_ParallelCrossEntropy``); other calls pass through. ``loss_parallel()``
    itself swaps DTensor's handlers of ``_log_softmax``, ``nll_loss_forward`` and their backwards
    (torch/distributed/tensor/parallel/loss.py:31-123, 598-614) for the whole step."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    local_vocab = getattr(head, "out_features", None)

    @contextlib.contextmanager
    def patched():
        original = torch.nn.functional.cross_entropy

        def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                          reduction="mean", label_smoothing=0.0):
            if (input.dim() == 2 and input.shape[1] == local_vocab and weight is None and size_average is None
                    and reduce is None and reduction in ("mean", "sum") and not label_smoothing):
                return _ParallelCrossEntropy.apply(input, target, ignore_index, reduction == "mean")
            return original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)

        torch.nn.functional.cross_entropy = cross_entropy
        try:
            yield
        finally:
            torch.nn.functional.cross_entropy = original

    return patched


class _ParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on this rank's ``[N, V/T]`` logits, the local ops of torch 2.13's loss parallelism.

    Forward: ``_log_softmax`` (torch/distributed/tensor/parallel/loss.py:197-221): the row max ``[N, 1]``
    all-reduced (``funcol.all_reduce``, a copy), ``shifted = x - max`` and ``exp(shifted)`` (two ``[N, V/T]``
    at once), their sum all-reduced, ``result = shifted - log(sumexp)``; autograd keeps ``result`` (the
    log-softmax output ``nll_loss`` reads and ``_log_softmax`` saved). ``_nll_loss_forward`` (:271-345): the
    targets masked to this rank's vocabulary (``_MaskPartial._partition_value``: a bool mask and shifted
    int64 targets), ``gather`` ``[N, 1]``, all-reduced (a copy), the mean over non-ignored targets.
    Backward: ``_nll_loss_and_log_softmax_backward`` (:451-518), both backwards fused: ``zeros_like(x)``,
    -1 scattered at the local targets, then ``(grad_input + exp(x)) * grad_output`` (three ``[N, V/T]``
    at once); ``_log_softmax_backward_handler`` (:259-266) passes it through (``.to`` its own dtype).
    """

    @staticmethod
    def forward(ctx, x, target, ignore_index, mean):
        dtype = x.dtype  # elementwise_dtypes: half and bfloat16 compute in float32, the result in their own
        x = x.to(dtype=torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype,
                 memory_format=torch.contiguous_format)
        x_max = torch.amax(x, 1, keepdim=True).clone()  # funcol.all_reduce(MAX) copies
        shifted = x - x_max
        sumexp = torch.sum(torch.exp(shifted), 1, keepdim=True).clone()  # all_reduce(SUM)
        result = (shifted - torch.log(sumexp)).to(dtype)
        del shifted
        valid = target != ignore_index
        safe = torch.where(valid, target, 0).unsqueeze(1)
        outside = (safe < 0) | (safe >= x.shape[1])  # noqa: F841 (_MaskPartial's mask, until the reduction)
        local = safe.clone() - 0  # shifted to this rank's first class; rank 0's offset is 0
        picked = torch.gather(result, 1, local).clone()  # _reduce_value: funcol.all_reduce's copy
        out = torch.where(valid, -picked.squeeze(1), 0)
        total = valid.sum().to(result)
        ctx.save_for_backward(result, target, total)
        ctx.ignore_index, ctx.mean = ignore_index, mean
        return out.sum() / total if mean else out.sum()

    @staticmethod
    def backward(ctx, grad):
        result, target, total = ctx.saved_tensors
        grad_output = grad / total if ctx.mean else grad
        safe = torch.where(target != ctx.ignore_index, target, 0)
        grad_input = torch.zeros_like(result)
        outside = (safe < 0) | (safe >= result.shape[1])
        local = safe.clone() - 0
        update = outside.to(grad_input.dtype) - 1.0
        rows = torch.arange(local.shape[0], device=local.device)
        grad_input[rows, local] = update
        grad_output = torch.where((target != ctx.ignore_index).unsqueeze(1), grad_output, 0)
        return (grad_input + torch.exp(result)) * grad_output, None, None, None
