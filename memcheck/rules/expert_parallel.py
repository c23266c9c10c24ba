"""Expert parallelism's one data-dependent question: how many routed rows each rank sends and receives.

torchtitan's ``ExpertParallel._token_dispatch`` (torchtitan/distributed/expert_parallel.py at
commit 5242bdf7151d, lines 150-179) exchanges each rank's tokens-per-expert counts with an
all-to-all and reads the per-rank sums back to the host (``.tolist()``): they are the
``input_splits`` (rows this rank sends to each rank) and ``output_splits`` (rows it receives
from each) of the all-to-all that moves the routed tokens (lines 181-187). The received
buffer's size is a value, so a meta trace needs an answer for it. ``exchange_counts`` is that
step, overridable through ``__torch_function__`` so the tracer's function mode reaches it; its
rule below answers from memcheck's routing choice point (``memcheck.choices``, ``routing``),
the same one the eager experts loop asks (``memcheck.rules.data_dependent``):

* ``routing=worst``: the first ``top_k`` experts take every token of every rank (each token
  picks an expert at most once), so rank 0, which holds experts ``0 .. E/ep - 1``, receives
  ``ep x tokens x min(top_k, E/ep)`` rows: the most any rank can receive. The traced rank is
  that rank.
* ``routing=balanced``: every expert gets ``tokens x top_k / E`` rows from every rank (the
  first ``remainder`` experts one more), so each rank receives ``tokens x top_k`` rows.

Each rank sends its ``tokens x top_k`` routed rows either way. Both answers are traced unless
one is pinned, and the larger peak is reported.
"""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

from memcheck.choices import ROUTING, ROUTING_BALANCED
from memcheck.rules.registry import register_op_rule

EP_WORST = ("expert parallel: routing=worst, the first top_k experts take every token of every rank, so rank 0 "
            "(experts 0 .. E/ep-1) receives ep x tokens x min(top_k, E/ep) rows; the figures are that rank's")
EP_BALANCED = ("expert parallel: routing=balanced, tokens x top_k / E rows from every rank to every expert, "
               "so each rank receives tokens x top_k rows")


def exchange_counts(top_k_index: torch.Tensor, num_experts: int, degree: int, group=None):
    """The all-to-all of the tokens-per-expert counts and the split sizes read back.

    Returns ``(input_splits, output_splits, counts_received)``: the rows this rank sends to
    and receives from each rank, and the received counts as ``[rank 0's for local expert
    0, 1, ..., rank 1's ...]`` (``ep * E/ep`` int64), as torchtitan's ``_token_dispatch``
    has them. A real run exchanges them over ``group``; a traced one asks the routing
    choice point (module docstring).
    """
    if has_torch_function_unary(top_k_index):
        return handle_torch_function(exchange_counts, (top_k_index,), top_k_index, num_experts, degree, group)
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # num_tokens_per_expert (torchtitan moe.py:314, histc)
    received = torch.empty_like(counts)
    all_to_all(received, counts, None, None, group)  # expert_parallel.py:152
    input_splits = counts.view(degree, -1).sum(dim=1).tolist()  # expert_parallel.py:167-171, 178
    output_splits = received.view(degree, -1).sum(dim=1).tolist()  # expert_parallel.py:173-179
    return input_splits, output_splits, received


def all_to_all(out: torch.Tensor, x: torch.Tensor, output_splits, input_splits, group) -> None:
    """``torch.distributed.all_to_all_single(out, x, ...)`` over ``group``; or the group's own
    ``all_to_all_single`` where it has one (``memcheck.measure.distributed``'s fenced gloo group)."""
    exchange = getattr(group, "all_to_all_single", None)
    if exchange is not None:
        exchange(out, x, output_splits, input_splits)
        return
    import torch.distributed as dist

    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)


def assumed_splits(tokens: int, top_k: int, num_experts: int, degree: int, balanced: bool):
    """``(input_splits, output_splits)`` of rank 0 under the routing answer (module docstring)."""
    local = num_experts // degree
    if balanced:
        base, extra = divmod(tokens * top_k, num_experts)
        per_expert = [base + (1 if e < extra else 0) for e in range(num_experts)]
        sent = [sum(per_expert[r * local:(r + 1) * local]) for r in range(degree)]
        return sent, [sent[0]] * degree
    sent = [tokens * sum(1 for e in range(top_k) if e // local == r) for r in range(degree)]
    return sent, [tokens * min(top_k, local)] * degree


@register_op_rule(exchange_counts)
def exchange_counts_rule(ctx, func, args, kwargs):
    """On meta: the splits of the routing answer (module docstring); the counts' bytes as allocated."""
    top_k_index, num_experts, degree = args[0], args[1], args[2]
    if top_k_index.device.type != "meta":
        return func(*args, **kwargs)
    tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1] if top_k_index.dim() > 1 else 1
    balanced = ctx.choices.answer(ROUTING) == ROUTING_BALANCED
    ctx.choices.consult(ROUTING, (ctx.step, ctx.phase))
    ctx.assume(EP_BALANCED if balanced else EP_WORST)
    counts = torch.zeros(num_experts, dtype=torch.long, device="meta")
    counts.scatter_add_(0, top_k_index.reshape(-1), torch.ones_like(top_k_index.reshape(-1)))
    received = torch.empty_like(counts)
    sent, got = assumed_splits(tokens, top_k, num_experts, degree, balanced)
    return sent, got, received
