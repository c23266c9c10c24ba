"""``ep``: expert parallelism for mixture-of-experts models, what one rank holds and allocates.

``shard_experts(model, degree)`` turns a model (a meta copy, for tracing) into what one
expert-parallel rank runs: each MoE layer keeps ``E / ep`` of its ``E`` experts, and its experts
module reaches them through the token dispatch of torchtitan's ``ExpertParallel``
(torchtitan/distributed/expert_parallel.py and torchtitan/models/common/moe.py at commit
5242bdf7151d, the last before torchtitan moved the dispatch into ``token_dispatcher``):

1. sort the ``tokens x top_k`` (token, expert) pairs by expert (``TokenReorderer``, moe.py
   314-328: a stable ``argsort``, the scores gathered in that order) and gather the routed
   rows, ``x[token_indices_experts_sorted]`` (moe.py:447): the **permutation buffer**,
   ``tokens x top_k`` rows of ``hidden``;
2. exchange the per-expert counts and read the split sizes back (expert_parallel.py 150-179;
   ``memcheck.rules.expert_parallel.exchange_counts``, whose trace-time answer is the routing
   assumption);
3. all-to-all the routed rows (expert_parallel.py 181-187, ``all_to_all_single_autograd``):
   the **received buffer**, as many rows as the other ranks route to this rank's experts;
4. ``_permute`` them from rank-major to expert-major order (expert_parallel.py 26-74: a second
   gather, ``x[permuted_indices]``), and run the local experts on them: the model's own experts
   forward, with local expert ids, top-1 and unit weights, as transformers' ``AllToAllEP``
   does (transformers/distributed/expert_parallel.py 226-236);
5. ``_unpermute`` (expert_parallel.py 77-80: ``new_empty`` and an index-put) and all-to-all the
   outputs back (208-221): the **combine** buffer, ``tokens x top_k`` rows again;
6. weight them by the sorted scores and ``scatter_add`` them into the tokens
   (moe.py 467-477; torchtitan's ``deterministic_scatter_add`` is ``out.scatter_add``).

The backward of each all-to-all is the reverse all-to-all (torch/distributed/
_functional_collectives.py, ``_AllToAllSingle.backward``): a gradient buffer of the other side's
size. The same code runs for real on gloo ranks (``memcheck.measure.distributed.measure_ep_cpu``),
where ``_AllToAll`` calls ``torch.distributed.all_to_all_single``: memcheck's own small EP layer,
written after torchtitan's, not torchtitan's code.

Experts modules recognised: transformers' fused experts (``@use_experts_implementation``:
``num_experts`` and 3-D ``gate_up_proj``/``up_proj``/``down_proj`` parameters with experts on
dimension 0, and their biases), which every MoE model of transformers 5.23 uses (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss ...). Per-expert module lists (``nn.ModuleList`` of
MLPs, older transformers and Switch Transformers' ``ModuleDict``) are refused: their loop over
the experts is model code that a dispatch cannot wrap without rewriting it.

Not modelled here: the gradient synchronisation of the dense (non-expert) parameters and of the
experts across data-parallel replicas (DDP/FSDP over the EP mesh, torchtitan's ``efsdp``), which
the layout composes; torchtitan's padding of each expert's rows to the grouped GEMM's alignment
(float8/MXFP8 only since fe80b63cf); DeepEP/HybridEP dispatchers.
"""

from __future__ import annotations

import torch
from torch import nn

from memcheck.errors import UsageError, require_int
from memcheck.rules.expert_parallel import all_to_all, exchange_counts

_EXPERT_DIM_PARAMS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The fused experts modules of ``model``: transformers' ``@use_experts_implementation`` classes."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int):
            found.append((name, module))
    return found


def _per_expert_lists(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] == "experts" and isinstance(m, (nn.ModuleList, nn.ModuleDict))]


def shard_experts(model: nn.Module, degree: int, *, rank: int = 0, group=None) -> nn.Module:
    """Make ``model`` (in place) what expert-parallel rank ``rank`` of ``degree`` holds and runs.

    Each experts module keeps experts ``rank * E/degree .. (rank + 1) * E/degree - 1`` (a copy of
    that slice of each expert-dimension parameter, so the full tensors can be freed) and its
    forward becomes the dispatch of the module docstring over ``group`` (a real run) or, traced
    on meta, the routing choice point's splits. Rank 0 is the traced rank: under
    ``routing=worst`` it receives the most. ``degree`` 1 changes nothing.

    Raises:
        UsageError: ``degree`` is not a positive integer, the model has no experts, or
            ``degree`` does not divide a layer's number of experts (each names the value).
    """
    require_int(degree, "ep")
    if not isinstance(rank, int) or not 0 <= rank < degree:
        raise UsageError(f"rank must be an integer from 0 to ep - 1 = {degree - 1}, got {rank!r}")
    found = experts_modules(model)
    if not found:
        lists = _per_expert_lists(model)
        if lists:
            raise UsageError(f"ep={degree}: {type(model).__name__}'s experts are a per-expert module list "
                             f"({lists[0]}); memcheck's expert parallelism takes transformers' fused experts "
                             "(3-D expert weights) only")
        raise UsageError(f"ep={degree} needs a mixture-of-experts model; {type(model).__name__} has no experts")
    for name, module in found:
        if module.num_experts % degree:
            raise UsageError(f"ep={degree} does not divide the {module.num_experts} experts of {name} "
                             f"({type(module).__name__}); choose a divisor of {module.num_experts}")
    if degree == 1:
        return model
    for name, module in found:
        total = module.num_experts
        local = total // degree
        for pname in _EXPERT_DIM_PARAMS:
            p = module._parameters.get(pname)
            if p is None:
                continue
            if p.shape[0] != total:
                raise UsageError(f"ep={degree}: {name}.{pname} has shape {tuple(p.shape)}, not {total} experts "
                                 "on its first dimension")
            with torch.no_grad():
                shard = p.detach()[rank * local:(rank + 1) * local].clone()
            module._parameters[pname] = nn.Parameter(shard, requires_grad=p.requires_grad)
        module.num_experts = local
        module.forward = ExpertParallelDispatch(module.forward, total, degree, rank, group)
    return model


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with the reverse exchange as its backward (as torch's
    ``_functional_collectives._AllToAllSingle``). The output is a fresh buffer of the
    received rows; on meta nothing is sent."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    if x.device.type != "meta":
        all_to_all(out, x.contiguous(), output_splits, input_splits, group)
    return out


def permute_indices(counts_received: torch.Tensor, local: int, degree: int, total: int):
    """torchtitan's ``_generate_permute_indices`` (expert_parallel.py 26-67): for each row of the
    expert-major layout, its row in the received (rank-major) buffer; and the rows per local
    expert. ``total`` is the received rows (``output_size`` of ``repeat_interleave``: known from
    the splits, so a trace needs no value)."""
    device = counts_received.device
    t_mat = counts_received.view(degree, local)
    input_starts = (counts_received.cumsum(0) - counts_received).view(degree, local)
    segment_lens = t_mat.t().reshape(-1)
    input_starts = input_starts.t().reshape(-1)
    seg_ids = torch.arange(segment_lens.shape[0], device=device).repeat_interleave(segment_lens, output_size=total)
    output_starts = segment_lens.cumsum(0) - segment_lens
    permuted = input_starts[seg_ids] + torch.arange(total, device=device) - output_starts[seg_ids]
    return permuted, t_mat.sum(0)


class ExpertParallelDispatch:
    """The experts module's forward under expert parallelism (module docstring, steps 1-6)."""

    def __init__(self, experts_forward, num_experts: int, degree: int, rank: int, group):
        self.experts_forward = experts_forward  # the module's own forward, on local expert ids
        self.num_experts, self.degree, self.rank, self.group = num_experts, degree, rank, group
        self.local = num_experts // degree

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, dim = hidden_states.shape
        top_k = top_k_index.shape[-1]
        # 1. TokenReorderer (moe.py 323-328) and the routed rows (moe.py:447)
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        scores_sorted = top_k_weights.reshape(-1)[order]
        token_indices = order // top_k
        routed_input = hidden_states[token_indices]
        # 2. the counts and splits (expert_parallel.py 150-179)
        input_splits, output_splits, counts_received = exchange_counts(
            top_k_index, self.num_experts, self.degree, self.group)
        # 3. the routed rows to the experts' ranks (expert_parallel.py 182-187)
        received = _AllToAll.apply(routed_input, output_splits, input_splits, self.group)
        del routed_input
        # 4. rank-major -> expert-major (expert_parallel.py 197-204, _permute at 70-74), the local experts
        rows = sum(output_splits)
        permuted_indices, per_expert = permute_indices(counts_received, self.local, self.degree, rows)
        permuted = received[permuted_indices]
        del received
        local_ids = torch.arange(self.local, device=hidden_states.device).repeat_interleave(
            per_expert, output_size=rows).unsqueeze(-1)
        expert_out = self.experts_forward(permuted, local_ids, permuted.new_ones((rows, 1)))
        del permuted
        # 5. _unpermute (expert_parallel.py 77-80) and the combine all-to-all (208-221)
        unpermuted = expert_out.new_empty((rows, expert_out.shape[-1]))
        unpermuted[permuted_indices, :] = expert_out
        del expert_out
        routed_output = _AllToAll.apply(unpermuted, input_splits, output_splits, self.group)
        del unpermuted
        # 6. scores and scatter-add into the tokens (moe.py 467-477)
        routed_output = (routed_output.to(torch.float32) * scores_sorted.reshape(-1, 1)).to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        return out.scatter_add(0, token_indices.reshape(-1, 1).expand(-1, dim), routed_output)
