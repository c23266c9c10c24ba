"""flash-attn's ops on the CUDA target: bytes worked out by hand from flash_api.cpp.

flash-attn is a CUDA build that cannot be installed here, and no GPU is at hand, so
nothing here is measured. The tests build a stand-in ``flash_attn`` package in a
temporary directory: the four torch custom ops of flash-attn 2.8.3
(``flash_attn/flash_attn_interface.py``: ``flashattn::_flash_attn_forward``,
``_flash_attn_backward``, ``_flash_attn_varlen_forward``, ``_flash_attn_varlen_backward``)
with the same qualified names and argument lists, declared the same way
(``torch.library.custom_op``, ``device_types="cuda"``, q/k/v or dq/dk/dv mutated), a
fake kernel each, and the autograd functions that call them the way the package's
do (pad the head dim to 8, save q/k/v/out/lse/rng_state, allocate dq/dk/dv in Python).
Their CUDA kernels raise: on meta tensors memcheck's rules answer instead. Expected
bytes come from ``csrc/flash_attn/flash_api.cpp`` (mha_fwd, mha_bwd, their varlen twins).
"""

import importlib.util
import sys
import textwrap

import pytest
import torch

import memcheck
from memcheck.enums import Category, Device
from memcheck.errors import UnsupportedOpError, UsageError
from memcheck.trace.tracer import ALLOC, MemoryTracer

A100 = (8, 0)  # 108 SMs (memcheck.rules.cuda_attention.SM_COUNT): the split heuristic runs over 216

STAND_IN = '''
"""A stand-in for flash-attn 2.8.3's flash_attn_interface (memcheck tests): same op names
and arguments; the CUDA kernels are not here."""
from typing import Optional

import torch
import torch.nn.functional as F

__version__ = "2.8.3"


def _no_kernel(*args, **kwargs):
    raise RuntimeError("the flash-attn stand-in has no CUDA kernels")


def _rup(x, m):
    return (x + m - 1) // m * m


@torch.library.custom_op("flashattn::_flash_attn_forward", mutates_args=("q", "k", "v"), device_types="cuda")
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_kernel()


@_flash_attn_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
      return_softmax):
    b, lq, h, _ = q.shape
    p = (q.new_empty((b, h, _rup(lq, 128), _rup(k.shape[1], 128))) if return_softmax else q.new_empty((0,)))
    return (torch.empty_like(q), q.new_empty((b, h, lq), dtype=torch.float32), p,
            q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("flashattn::_flash_attn_varlen_forward", mutates_args=("q", "k", "v"), device_types="cuda")
def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                               block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                               seqused_k: Optional[torch.Tensor] = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_kernel()


@_flash_attn_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
      block_table=None, leftpad_k=None, seqused_k=None):
    total_q, h, _ = q.shape
    return (torch.empty_like(q), q.new_empty((h, total_q), dtype=torch.float32), q.new_empty((0,)),
            q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("flashattn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                         dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int, window_size_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _no_kernel()


@_flash_attn_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
      window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    b, lq, h, _ = q.shape
    return q.new_empty((b, h, _rup(lq, 128)), dtype=torch.float32)


@torch.library.custom_op("flashattn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cuda")
def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                                dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                                softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                                rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _no_kernel()


@_flash_attn_varlen_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
      deterministic, rng_state=None):
    total_q, h, _ = q.shape
    return q.new_empty((h, total_q + 128 * (cu_seqlens_q.numel() - 1)), dtype=torch.float32)


def _pad8(*tensors):
    d = tensors[0].shape[-1]
    return tensors if d % 8 == 0 else tuple(F.pad(t, (0, 8 - d % 8)) for t in tensors)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, causal, deterministic):
        d = q.shape[-1]
        q, k, v = _pad8(q, k, v)
        out, lse, _, rng = torch.ops.flashattn._flash_attn_forward(
            q, k, v, dropout_p, d ** -0.5, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.dropout_p, ctx.causal, ctx.deterministic = dropout_p, causal, deterministic
        return out[..., :d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flashattn._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, ctx.dropout_p, 1.0, ctx.causal, -1, -1, 0.0, None,
            ctx.deterministic, rng_state=rng)
        d = dout.shape[-1]
        return dq[..., :d], dk[..., :d], dv[..., :d], None, None, None


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, causal):
        q, k, v = qkv[:, :, 0].detach(), qkv[:, :, 1].detach(), qkv[:, :, 2].detach()
        out, lse, _, rng = torch.ops.flashattn._flash_attn_forward(
            q, k, v, 0.0, 1.0, causal, -1, -1, 0.0, None, False)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng = ctx.saved_tensors
        dqkv = torch.empty(q.shape[:-2] + (3, *q.shape[-2:]), dtype=q.dtype, device=q.device)
        torch.ops.flashattn._flash_attn_backward(
            dout, q, k, v, out, lse, dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2], 0.0, 1.0, ctx.causal, -1, -1,
            0.0, None, False, rng_state=rng)
        return dqkv, None


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        out, lse, _, rng = torch.ops.flashattn._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, 1.0, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng)
        ctx.max_q, ctx.max_k, ctx.causal = max_q, max_k, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flashattn._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, 1.0, ctx.causal, -1, -1,
            0.0, None, False, rng_state=rng)
        return dq, dk, dv, None, None, None, None, None


def flash_attn_func(q, k, v, dropout_p=0.0, causal=False, deterministic=False):
    return FlashAttnFunc.apply(q, k, v, dropout_p, causal, deterministic)


def flash_attn_qkvpacked_func(qkv, causal=False):
    return FlashAttnQKVPackedFunc.apply(qkv, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
'''

LEGACY = '''
"""A stand-in for flash-attn 2.5's flash_attn_interface: the CUDA extension called directly."""
import torch
import flash_attn_2_cuda as flash_attn_cuda


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal):
    return flash_attn_cuda.fwd(q, k, v, None, None, dropout_p, softmax_scale, causal)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return _flash_attn_forward(q, k, v, 0.0, 1.0, False)[0]


def flash_attn_func(q, k, v):
    return FlashAttnFunc.apply(q, k, v)
'''


_STAND_IN_MODULES: dict = {}  # torch registers the ops once per process: the modules are kept


@pytest.fixture(scope="module")
def fa(tmp_path_factory):
    names = ("flash_attn", "flash_attn.flash_attn_interface")
    if not _STAND_IN_MODULES and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a real flash_attn is installed; the stand-in would register the same ops")
    saved = {name: sys.modules.get(name) for name in names}
    if not _STAND_IN_MODULES:
        root = tmp_path_factory.mktemp("standin")
        (root / "flash_attn").mkdir()
        (root / "flash_attn" / "__init__.py").write_text(
            '__version__ = "2.8.3"\nfrom flash_attn.flash_attn_interface import *  # noqa\n')
        (root / "flash_attn" / "flash_attn_interface.py").write_text(STAND_IN)
        sys.path.insert(0, str(root))
        try:
            importlib.import_module("flash_attn")
        finally:
            sys.path.remove(str(root))
        _STAND_IN_MODULES.update((name, sys.modules[name]) for name in names)
    sys.modules.update(_STAND_IN_MODULES)
    yield sys.modules["flash_attn.flash_attn_interface"]
    for name, module in saved.items():  # the stand-in leaves no flash_attn behind for other tests
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def leaves(*shape, dtype=torch.float16, grad=True):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def scratch_sizes(tracer, start=0):
    return [e[2] for e in tracer.log.events[start:] if e[0] == ALLOC and e[1] < 0]


def allocs(tracer, start=0):
    return [e[2] for e in tracer.log.events[start:] if e[0] == ALLOC]


def live_by_category(tracer):
    totals = {}
    for sid, n in tracer._sizes.items():
        totals[tracer._cats[sid]] = totals.get(tracer._cats[sid], 0) + n
    return totals


def test_forward_and_backward_bytes_follow_mha_fwd_and_mha_bwd(fa):
    # B=2, L=200, H=4, D=64 fp16 on an A100; q, k, v are (B, L, H, D) leaves of
    # 2*200*4*64*2 = 204,800 B each.
    q, k, v = (leaves(2, 200, 4, 64) for _ in range(3))
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        tracer.watch(batch=(q, k, v))
        start = len(tracer.log.events)
        out = fa.flash_attn_func(q, k, v, causal=True)
        # mha_fwd: out (B, L, H, D) 204,800, softmax_lse (B, H, L) fp32 2*4*200*4 = 6,400,
        # S_dmask empty (no return_softmax), rng_state 2 int64 = 16. No split-KV: the grid is
        # 2*4*ceil(200/64) = 32 blocks, and the keys are one block of 256 (D <= 64).
        assert allocs(tracer, start) == [204_800, 6_400, 0, 16]
        saved = live_by_category(tracer)
        assert saved == {Category.INPUT: 3 * 204_800, Category.ACTIVATION: 204_800 + 6_400 + 16}
        start = len(tracer.log.events)
        out.sum().backward()
    # Backward: out.sum()'s gradient (2 B, fp16 scalar) expands to (B, L, H, D) with last
    # stride 0; FlashAttnFunc allocates dq, dk, dv (3 * 204,800); the op returns softmax_d
    # (B, H, round128(L)) fp32 = 2*4*256*4 = 8,192; inside it: maybe_contiguous(dout)
    # 204,800 and dq_accum (B, round128(L), H, round32(D)) fp32 = 2*256*4*64*4 = 524,288.
    assert scratch_sizes(tracer, start) == [204_800, 524_288]
    assert [n for n in allocs(tracer, start) if n >= 8_192] == [204_800] * 3 + [8_192, 204_800, 524_288]


def test_split_kv_and_grouped_query_attention(fa):
    # B=1, L=1024, H=8 query heads, 2 key/value heads, D=128, bf16, A100 (108 SMs).
    # set_params_splitkv: 8 heads * ceil(1024/64) = 128 blocks < 0.8*216; keys in blocks of
    # 128 (D <= 128): 8 blocks. Efficiency waves/ceil(waves) with waves = 128n/216:
    # n=1 .593, 2 .593, 3 .889, 4 .790, 5-7 ineligible (ceil(8/n) = 2 as for n-1), 8 .948;
    # the first n >= 0.85*.948 = .806 is 3 splits:
    #   softmax_lse_accum 3*1*8*1024*4 = 98,304 B; out_accum 3*1*8*1024*128*4 = 12,582,912 B.
    q = leaves(1, 1024, 8, 128, dtype=torch.bfloat16)
    k, v = (leaves(1, 1024, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        out = fa.flash_attn_func(q, k, v, causal=True)
        assert scratch_sizes(tracer) == [98_304, 12_582_912]
        start = len(tracer.log.events)
        out.sum().backward()
    # mha_bwd: dout copy 1*1024*8*128*2 = 2,097,152; dq_accum 1*1024*8*128*4 = 4,194,304;
    # dk_expanded and dv_expanded (B, L_k, H=8, D) bf16, 2,097,152 each.
    assert scratch_sizes(tracer, start) == [2_097_152, 4_194_304, 2_097_152, 2_097_152]
    assert k.grad.shape == (1, 1024, 2, 128)


def test_deterministic_backward_keeps_one_accumulator_per_split(fa):
    # mha_bwd with deterministic: nsplits = ceil(SMs / (B*H)) = ceil(108 / 8) = 14 zeroed
    # dq_accum copies: 14 * 2*256*4*64*4 = 7,340,032 B (B=2, L=200, H=4, D=64).
    q, k, v = (leaves(2, 200, 4, 64) for _ in range(3))
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        out = fa.flash_attn_func(q, k, v, deterministic=True)
        start = len(tracer.log.events)
        out.sum().backward()
    assert scratch_sizes(tracer, start) == [204_800, 7_340_032]


def test_qkv_packed_backward_writes_into_one_buffer(fa):
    # qkv (B, L, 3, H, D) = (2, 128, 3, 4, 64) fp16: q, k, v are views (last stride 1, no
    # copies); backward allocates dqkv once (3*131,072 = 393,216 B) and passes its views.
    # Inside the op: dout copy 131,072; dq_accum 2*128*4*64*4 = 262,144.
    qkv = leaves(2, 128, 3, 4, 64)
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        out = fa.flash_attn_qkvpacked_func(qkv)
        start = len(tracer.log.events)
        out.sum().backward()
    assert scratch_sizes(tracer, start) == [131_072, 262_144]
    assert 393_216 in allocs(tracer, start)


def test_varlen_forward_and_backward_bytes(fa):
    # Two sequences of 100 and 200 tokens packed: total 300, H=4, D=64, fp16.
    # mha_varlen_fwd: out (300, 4, 64) 153,600; softmax_lse (H, total_q) fp32 4*300*4 = 4,800;
    # rng_state 16. No split-KV (only for one-query decoding).
    q, k, v = (leaves(300, 4, 64) for _ in range(3))
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    tracer = MemoryTracer(Device.CUDA, arch=A100)
    with tracer:
        tracer.watch(batch=(q, k, v, cu))
        start = len(tracer.log.events)
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True)
        assert allocs(tracer, start) == [153_600, 4_800, 0, 16]
        start = len(tracer.log.events)
        out.sum().backward()
    # mha_varlen_bwd: softmax_d (H, total_q + 128*B) fp32 = 4*556*4 = 8,896 (the output);
    # dout copy 153,600; dq_accum (total_q + 128*B, H, 64) fp32 = 556*4*64*4 = 569,344.
    assert scratch_sizes(tracer, start) == [153_600, 569_344]
    assert 8_896 in allocs(tracer, start)


def test_an_estimate_of_a_model_with_flash_attn(fa):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(256, 256) for _ in range(3))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (proj(x).view(b, s, 4, 64) for proj in (self.q, self.k, self.v))
            return fa.flash_attn_func(q, k, v, causal=True).reshape(b, s, 256)

    with torch.device("meta"):
        model = Block()
        x = torch.empty(2, 512, 256)
    est = memcheck.estimate(model, x, device="cuda", gpu="A100-80GB", precision="bf16")
    assert est.peak_bytes > 0
    with pytest.raises(UsageError, match="flash_attn .* runs on CUDA GPUs only"):
        memcheck.estimate(model, x, device="cpu", precision="bf16")


def test_flash_attn_that_calls_its_cuda_extension_directly_is_named(tmp_path, monkeypatch):
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text('__version__ = "2.5.9"\n')
    (tmp_path / "flash_attn" / "flash_attn_interface.py").write_text(LEGACY)
    (tmp_path / "flash_attn_2_cuda.py").write_text(textwrap.dedent('''
        def fwd(q, *args):
            raise RuntimeError("q must be on CUDA")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_2_cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from flash_attn.flash_attn_interface import flash_attn_func

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, x):
            q = self.proj(x).view(2, 16, 1, 64)
            return flash_attn_func(q, q, q)

    with torch.device("meta"):
        model = Attention()
        x = torch.empty(2, 16, 64)
    with pytest.raises(UnsupportedOpError, match=r"flash_attn 2\.5\.9 calls its CUDA extension .* directly"):
        memcheck.estimate(model, x, device="cuda")
