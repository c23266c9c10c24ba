"""``cp``: context parallelism, what one rank of torch's ``context_parallel`` holds and allocates.

torch 2.13's ``torch.distributed.tensor.experimental.context_parallel``
(torch/distributed/tensor/experimental/_context_parallel/_attention.py) does two things, and
memcheck emulates each on meta:

* it shards the buffers it is given (the batch, labels, position buffers) along their sequence
  dimension, in place: each of the ``C`` ranks keeps ``S / C`` tokens (``_attention.py``
  1515-1600). When ``S`` is a multiple of ``2C`` it first reorders them head-and-tail
  (``_HeadTailLoadBalancer``, ``_load_balancer.py``; ``_create_default_load_balancer`` at
  ``_load_balancer.py`` 470-478), so each rank holds two chunks of ``S / 2C`` tokens, one from
  each end; otherwise it shards without load balancing. ``shard_sequence`` cuts the batch: every
  tensor that has the sequence length on the sequence dimension keeps ``S / C`` of it.
* it patches ``F.scaled_dot_product_attention`` (``_enable_context_parallel_dispatcher_impl``,
  1029-1041, ``_DispatchMode.MONKEY_PATCH``) so that each attention call, on the local ``S / C``
  queries, runs the ring attention of ``_templated_ring_attention`` (317-485) and, in backward,
  ``_templated_ring_attention_backward`` (488-655). ``cp_attention`` patches it the same way, with
  ``RingAttention``, a line-by-line mirror of those two loops whose collectives only allocate
  their outputs (nothing is sent on meta).

What a rank holds in each attention call, per the source (``kv`` below is one rank's keys and
values, ``2 x B x H_kv x S/C x d`` elements):

* forward, default rotate method ``ALL_GATHER`` (``_ContextParallelOptions.rotate_method``, line
  77; ``set_rotate_method("alltoall")`` changes it): ``key``/``value`` made contiguous (a copy
  when they are transposed views, as in transformers), the local ``kv`` concatenated
  (``torch.cat``), then one ``all_gather_single`` of it (``_AllGatherRotater``, 273-300): **all C
  ranks' kv** live until the call returns; every later step concatenates the chunk it uses
  again (freed at once: ``exchange_buffers`` returns ``None``). A functional collective keeps its
  input until it is waited on (``wait_tensor``, at the next ``next_buffer``), so each sent
  concatenation lives until then (seen in the profiler's events of a real run). With ``ALL_TO_ALL``
  (``_AllToAllRotater``, 253-270) the received chunk replaces the sent one: two chunks live.
  Each step's output and logsumexp are merged in float32 (``_SDPAMerger``, 139-229,
  ``convert_to_f32=True``); under load balancing rank ``r`` runs, at steps ``i > r``, only the
  second half of its queries and splices the result in with ``torch.cat`` (``_partial_update``).
  Saved for backward: the local q, k, v, the merged output and logsumexp, as the op's autograd
  node saves them.
* backward: float32 accumulators for dq, dk, dv (``zeros_like``, 512-515); the keys and values
  all-gathered again (``kv_rotater``: all C chunks live through the loop); and the dk/dv ring,
  always ``ALL_TO_ALL`` (``dkv_rotater``, 520): at each step a float32 concatenation of the
  running dk/dv and the ``permute_tensor`` output that carries it to the next rank.

Load balancing needs ``S`` divisible by ``2C``; ``shard_sequence`` refuses an ``S`` that ``C``
does not divide, and ``RingAttention`` takes ``load_balance`` as torch decides it (``S % 2C == 0``).

Not modelled: the CUDA efficient and cuDNN kernels under CP (``cp_attention`` takes the CPU
flash kernel and CUDA flash); attention masks (torch's CP takes ``is_causal`` and no mask, and
raises otherwise); flex attention; the ``MODULE_WRAPPER`` dispatch mode (same memory).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from memcheck.compat import tree_leaves, tree_map
from memcheck.errors import UsageError, require_int

aten = torch.ops.aten
SEQ_DIM = 2  # q, k, v are (batch, heads, sequence, head dim): _attention.py "seq_dim = 2"
ROUND_ROBIN_CYCLE = 2


def load_balanced(seq_len: int, degree: int) -> bool:
    """Whether torch's ``context_parallel`` load-balances a sequence of ``seq_len`` over ``degree``
    ranks (``_create_default_load_balancer``, _load_balancer.py 470-478)."""
    return seq_len % (2 * degree) == 0


def shard_sequence(batch: Any, degree: int, *, seq_len: int | None = None, seq_dim: int = 1) -> Any:
    """One context-parallel rank's batch: every tensor whose ``seq_dim`` has ``seq_len`` elements
    keeps ``seq_len / degree`` of them (a new tensor on the same device); others are kept.

    ``seq_len`` defaults to the length of ``input_ids`` (a dict batch), else of the first tensor
    with a ``seq_dim``. Raises ``UsageError`` when ``degree`` does not divide it, naming both.
    """
    require_int(degree, "cp")
    if seq_len is None:
        seq_len = sequence_length(batch, seq_dim)
    if seq_len % degree:
        raise UsageError(f"cp={degree} does not divide the sequence length {seq_len}; "
                         f"choose a length that is a multiple of {degree} (of {2 * degree} for load balancing)")

    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() > seq_dim and t.shape[seq_dim] == seq_len:
            return t.narrow(seq_dim, 0, seq_len // degree).clone()
        return t

    return tree_map(cut, batch)


def sequence_length(batch: Any, seq_dim: int) -> int:
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].shape[seq_dim]
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() > seq_dim:
            return t.shape[seq_dim]
    raise UsageError("cp: the batch has no tensor with a sequence dimension to shard")


# ---- the kernels torch's CP calls (the _sdpa_handler's call_maps, _attention.py 917-924) ----------


class _CpuFlash:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (CPU target)."""

    @staticmethod
    def forward(q, k, v, is_causal, dropout_p, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
        return out, lse, ()

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, is_causal, dropout_p, scale, rest):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, dropout_p, is_causal, scale=scale)


class _CudaFlash:
    """``aten._scaled_dot_product_flash_attention`` and its backward (``_scaled_dot_product_ring_flash_attention``)."""

    @staticmethod
    def forward(q, k, v, is_causal, dropout_p, scale):
        out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)
        return out, lse, tuple(rest)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, is_causal, dropout_p, scale, rest):
        cum_q, cum_k, max_q, max_k, seed, offset, _ = rest
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset,
            scale=scale)


KERNELS = {"cpu-flash": _CpuFlash, "cuda-flash": _CudaFlash}


# ---- the ring: _templated_ring_attention and its backward, on meta -------------------------------


def _all_gather(buffer: torch.Tensor, degree: int) -> torch.Tensor:
    """``ft_c.all_gather_single(buffer.contiguous(), gather_dim=0)``: the C ranks' buffers, one output."""
    buffer = buffer.contiguous()
    return buffer.new_empty((degree * buffer.shape[0],) + tuple(buffer.shape[1:]))


def _permute(buffer: torch.Tensor) -> torch.Tensor:
    """``ft_c.permute_tensor``: an ``all_to_all_single`` whose output is the neighbour's buffer."""
    buffer = buffer.contiguous()
    return buffer.new_empty(buffer.shape)


class _Rotater:
    """``_AllGatherRotater`` (273-300) or ``_AllToAllRotater`` (253-270), with the exchange on meta."""

    def __init__(self, method: str, rank: int, degree: int):
        self.method, self.rank, self.degree = method, rank, degree
        self.buffer = None
        self.idx = 0
        self.in_flight = None  # the sent buffer: a functional collective keeps its input until waited on

    def exchange_buffers(self, curr: torch.Tensor) -> None:
        if self.method == "allgather":
            self.idx += 1
            if self.buffer is None:
                self.buffer = _all_gather(curr, self.degree)
                self.in_flight = curr
        else:
            self.buffer = _permute(curr)
            self.in_flight = curr

    def next_buffer(self) -> torch.Tensor:
        self.in_flight = None  # _maybe_wait: wait_tensor lets go of the collective's input
        if self.method == "allgather":
            return self.buffer.chunk(self.degree)[self.rank - self.idx]
        return self.buffer


def _causal_behavior(rank: int, degree: int, i: int, is_causal: bool, load_balance: bool):
    """``_is_causal_behavior`` (83-100): True (causal), False (full) or None (skip)."""
    if not is_causal:
        return False
    if i == 0:
        return True
    source = (rank - i) % degree
    return False if source < rank or load_balance else None


def _partial_update(original, new, dim, n_chunks, idx, add):
    """``_partial_update`` (113-137)."""
    chunks = list(original.chunk(n_chunks, dim=dim))
    if add:
        chunks[idx] += new
    else:
        chunks[idx] = new
    return torch.cat(chunks, dim=dim)


class _Merger:
    """``_SDPAMerger`` (139-229) with ``convert_to_f32=True``."""

    def __init__(self):
        self.out = self.lse = None
        self.squeeze = False
        self.out_dtype = self.lse_dtype = torch.float32

    def step(self, out, lse, partial):
        self.out_dtype, self.lse_dtype = out.dtype, lse.dtype
        out, lse = out.to(torch.float32), lse.to(torch.float32)
        if lse.dim() < out.dim():
            lse = lse.unsqueeze(dim=-1)
            self.squeeze = True
        if self.lse is None:
            self.lse, self.out = lse, out
            return
        old_lse = self.lse.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[1] if partial else self.lse
        old_out = self.out.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[1] if partial else self.out
        merged_out = old_out - F.sigmoid(lse - old_lse) * (old_out - out)
        merged_lse = old_lse - F.logsigmoid(old_lse - lse)
        if partial:
            self.lse = _partial_update(self.lse, merged_lse, SEQ_DIM, ROUND_ROBIN_CYCLE, 1, False)
            self.out = _partial_update(self.out, merged_out, SEQ_DIM, ROUND_ROBIN_CYCLE, 1, False)
        else:
            self.lse, self.out = merged_lse, merged_out

    def results(self):
        out = self.out.to(self.out_dtype)
        lse = self.lse.squeeze(-1).to(self.lse_dtype) if self.squeeze else self.lse.to(self.lse_dtype)
        return out, lse


def ring_forward(kernel, query, key, value, *, rank, degree, is_causal, load_balance, rotate, dropout_p, scale):
    """``_templated_ring_attention`` (317-485): the merged output, its logsumexp and the kernel's rest."""
    key, value = key.contiguous(), value.contiguous()
    merger = _Merger()
    rotater = _Rotater(rotate, rank, degree)
    rest = ()
    for i in range(degree):
        if i > 0:
            next_kv = rotater.next_buffer()
            key = next_kv[: key.numel()].reshape(key.shape)
            value = next_kv[key.numel():].reshape(value.shape)
        if i < degree - 1:
            next_kv = torch.cat([key.flatten(), value.flatten()])
            next_kv = rotater.exchange_buffers(next_kv)
        behavior = _causal_behavior(rank, degree, i, is_causal, load_balance)
        if behavior is None:
            continue
        if i == 0 or not load_balance or not is_causal:
            q, k, v, partial = query, key, value, False
        elif i <= rank:
            q, k, v, partial = (query, key.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[0],
                                value.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[0], False)
        else:
            q, k, v, partial = query.chunk(2, dim=SEQ_DIM)[1], key, value, True
        out, lse, rest = kernel.forward(q, k, v, behavior, dropout_p, scale)
        merger.step(out, lse, partial)
    out, lse = merger.results()
    return out, lse, rest


def ring_backward(kernel, grad_out, query, key, value, out, logsumexp, rest, *, rank, degree, is_causal,
                  load_balance, rotate, dropout_p, scale):
    """``_templated_ring_attention_backward`` (488-655): dq, dk, dv."""
    accum = torch.float32
    grad_query = torch.zeros_like(query, dtype=accum)
    grad_key = torch.zeros_like(key, dtype=accum)
    grad_value = torch.zeros_like(value, dtype=accum)
    key, value = key.contiguous(), value.contiguous()
    kv_rotater = _Rotater(rotate, rank, degree)
    dkv_rotater = _Rotater("alltoall", rank, degree)
    grad_key_ = None
    for i in range(degree):
        if i > 0:
            buffer = kv_rotater.next_buffer()
            key = buffer[: key.numel()].reshape(key.shape)
            value = buffer[key.numel(): key.numel() + value.numel()].reshape(value.shape)
        if i != degree - 1:
            next_kv = torch.cat([key.flatten(), value.flatten()])
            kv_rotater.exchange_buffers(next_kv)
        behavior = _causal_behavior(rank, degree, i, is_causal, load_balance)
        if behavior is not None:
            if i == 0 or not load_balance or not is_causal:
                q, k, v, out_, dout, lse = query, key, value, out, grad_out, logsumexp
            elif i <= rank:
                q, k, v, out_, dout, lse = (query, key.chunk(2, dim=SEQ_DIM)[0], value.chunk(2, dim=SEQ_DIM)[0],
                                            out, grad_out, logsumexp)
            else:
                q, k, v, out_, dout, lse = (query.chunk(2, dim=SEQ_DIM)[1], key, value,
                                            out.chunk(2, dim=SEQ_DIM)[1], grad_out.chunk(2, dim=SEQ_DIM)[1],
                                            logsumexp.chunk(2, dim=SEQ_DIM)[1].contiguous())
            grad_query_, grad_key_, grad_value_ = kernel.backward(dout, q, k, v, out_, lse, behavior, dropout_p,
                                                                  scale, rest)[:3]
        else:
            grad_query_ = torch.zeros_like(query, dtype=accum)
            grad_key_ = torch.zeros_like(key, dtype=accum)
            grad_value_ = torch.zeros_like(value, dtype=accum)
        if i == 0:
            grad_key += grad_key_
            grad_value += grad_value_
        else:
            next_grad_kv = dkv_rotater.next_buffer()
            grad_key = next_grad_kv[: grad_key.numel()].reshape(grad_key.shape)
            grad_value = next_grad_kv[grad_key.numel():].reshape(grad_value.shape)
            if i <= rank and load_balance:
                grad_key = _partial_update(grad_key, grad_key_, SEQ_DIM, ROUND_ROBIN_CYCLE, 0, True)
                grad_value = _partial_update(grad_value, grad_value_, SEQ_DIM, ROUND_ROBIN_CYCLE, 0, True)
            else:
                grad_key += grad_key_
                grad_value += grad_value_
        next_grad_kv = torch.cat([grad_key.flatten(), grad_value.flatten()])
        dkv_rotater.exchange_buffers(next_grad_kv)
        if i <= rank or not load_balance:
            grad_query += grad_query_
        else:
            grad_query = _partial_update(grad_query, grad_query_, SEQ_DIM, ROUND_ROBIN_CYCLE, 1, True)
    grad_query = grad_query.to(query.dtype)
    next_grad_kv = dkv_rotater.next_buffer().to(key.dtype)
    grad_key = next_grad_kv[: grad_key.numel()].reshape(grad_key.shape)
    grad_value = next_grad_kv[grad_key.numel():].reshape(grad_value.shape)
    return grad_query, grad_key, grad_value


class RingAttention(torch.autograd.Function):
    """One context-parallel attention call: ``ring_forward``, and ``ring_backward`` as its backward.
    Saves what the kernel op's autograd node saves: q, k, v, the merged output and logsumexp."""

    @staticmethod
    def forward(ctx, query, key, value, options):
        out, lse, rest = ring_forward(options["kernel"], query, key, value, **options["ring"])
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.options, ctx.rest = options, rest
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        grads = ring_backward(ctx.options["kernel"], grad_out, query, key, value, out, lse, ctx.rest,
                              **ctx.options["ring"])
        return (*grads, None)


@contextlib.contextmanager
def cp_attention(degree: int, *, seq_len: int, rank: int = 0, kernel: str = "cpu-flash",
                 rotate: str = "allgather"):
    """Patch ``F.scaled_dot_product_attention`` as torch's ``context_parallel`` does, with
    ``RingAttention`` for rank ``rank`` of ``degree`` over a sequence of ``seq_len`` tokens
    (the full length: it decides load balancing). Use it around the traced steps, on the
    batch ``shard_sequence`` cut. The attention calls must be causal with no mask, as torch's
    CP requires."""
    require_int(degree, "cp")
    if not isinstance(rank, int) or not 0 <= rank < degree:
        raise UsageError(f"rank must be an integer from 0 to cp - 1 = {degree - 1}, got {rank!r}")
    if kernel not in KERNELS:
        raise UsageError(f"cp kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if rotate not in ("allgather", "alltoall"):
        raise UsageError(f"cp rotate method must be 'allgather' or 'alltoall' (set_rotate_method), got {rotate!r}")
    if seq_len % degree:
        raise UsageError(f"cp={degree} does not divide the sequence length {seq_len}")
    original = F.scaled_dot_product_attention
    balance = load_balanced(seq_len, degree)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None:
            raise UsageError("context parallelism takes causal attention with no mask (torch's context_parallel "
                             "raises on one); the model passed an attention mask")
        if not is_causal and balance:
            raise UsageError("context parallelism with load balancing needs is_causal=True attention "
                             "(_templated_ring_attention: 'Load balancing requires `is_causal=True`')")
        options = {"kernel": KERNELS[kernel], "ring": dict(rank=rank, degree=degree, is_causal=is_causal,
                                                           load_balance=balance, rotate=rotate,
                                                           dropout_p=dropout_p, scale=scale)}
        return RingAttention.apply(query, key, value, options)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
