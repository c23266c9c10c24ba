"""Backward runs under memcheck's function modes (memcheck.trace.engine_modes): a gradient-checkpointing
recomputation takes the target device's kernels as the forward did.

Before, the recomputation ran with no function mode at all: on the CUDA target ``F.dropout``
in a checkpointed block's own ``forward`` was traced as the meta device's ``_dropout_impl`` (a float
noise tensor) where the forward had traced ``native_dropout`` (a bool mask), and every BART,
mBART, Pegasus and Marian job with checkpointing on the CUDA target ended in ``CheckpointError``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.variable import Variable
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

import memcheck
from memcheck.enums import ALLOC, Device
from memcheck.trace.tracer import MemoryTracer

ROWS, COLS = 32, 64
X_BYTES = ROWS * COLS * 4  # fp32: 2,048 elements x 4 B = 8,192 B
MASK_BYTES = ROWS * COLS  # native_dropout's bool mask: 2,048 x 1 B


def _block(x):
    # the dropout runs in the checkpointed function itself, outside any module: as in a BART layer
    return F.dropout(x * 2, 0.1, True)


def _trace_checkpointed(reentrant: bool) -> list[int]:
    """The sizes of every allocation of a forward and backward through the checkpointed ``_block``
    traced for the CUDA target."""
    x = torch.empty(ROWS, COLS, device="meta", requires_grad=True)
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        checkpoint(_block, x, use_reentrant=reentrant).sum().backward()
    return [e[2] for e in tracer.log.events if e[0] == ALLOC]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_recomputed_dropout_takes_the_fused_kernel_as_the_forward_did(reentrant):
    # Forward: x * 2 (8,192 B), then native_dropout's output (8,192 B) and bool mask (2,048 B).
    # The recomputation in backward runs the same ops: a second 2,048 B mask. Before the fix the
    # non-reentrant recomputation raised CheckpointError (saved bool, recomputed float32), and the
    # reentrant one, which checks nothing, traced a 4 B-an-element noise tensor (8,192 B) instead.
    sizes = _trace_checkpointed(reentrant)
    assert sizes.count(MASK_BYTES) == 2, sizes


def test_the_device_modes_are_in_force_during_a_recomputation():
    seen = []

    def block(x):
        seen.append(list(_get_current_function_mode_stack()))
        return x.sin()  # saves x: the backward recomputes the block

    x = torch.empty(4, device="meta", requires_grad=True)
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    forward, recompute = seen
    assert tracer._kernel_mode in forward and tracer._kernel_mode in recompute
    assert [type(m) for m in recompute] == [type(m) for m in forward]


def test_the_engine_is_given_back_when_tracing_ends():
    engine = Variable._execution_engine
    with MemoryTracer(Device.CUDA):
        assert Variable._execution_engine is not engine
    assert Variable._execution_engine is engine


def _tiny(config_cls, **extra):
    return config_cls(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                      **extra)


@pytest.mark.slow
@pytest.mark.parametrize("family, checkpointing", [
    ("bart", "full"), ("mbart", "full"), ("pegasus", "full"), ("marian", "full"),
    ("bart", "half"), ("bart", "every:2"), ("bart", "selective-op"),
])
def test_bart_family_with_checkpointing_traces_on_the_cuda_target(family, checkpointing):
    from memcheck.enums import Task
    from memcheck.workloads import hf
    from transformers import BartConfig, MarianConfig, MBartConfig, PegasusConfig

    config_cls = {"bart": BartConfig, "mbart": MBartConfig, "pegasus": PegasusConfig, "marian": MarianConfig}[family]
    extra = {"decoder_start_token_id": 0, "pad_token_id": 1} if family == "marian" else {}
    config = _tiny(config_cls, **extra)
    with torch.device("meta"):
        model = hf.build_model(config, Task.SEQ2SEQ, device=torch.device("meta"))
        batch = hf.make_batch(model, config, Task.SEQ2SEQ, 2, 32, 16, device=torch.device("meta"))
    est = memcheck.estimate(model, batch, device="cuda", gpu="T4", checkpointing=checkpointing)
    assert est.peak_bytes > 0


@pytest.mark.slow
def test_the_seed_scenario_s_pegasus_with_checkpointing_on_a_24_gib_card_answers(tmp_path):
    # The seed scenario's shape at tiny size: a Pegasus config with pegasus-large's published settings (relu,
    # scaled embeddings, dropout 0.1 everywhere) through the CLI on an RTX-4090 with checkpointing half, the
    # option plan traces for it (pegasus-large itself, 16 + 16 layers at 1024 tokens, plans in about 9 min on
    # 2 cores). It ended in CheckpointError, exit 2, before the device modes were carried into backward.
    from click.testing import CliRunner
    from transformers import PegasusConfig

    from memcheck.cli import main

    _tiny(PegasusConfig, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, activation_function="relu",
          scale_embedding=True).save_pretrained(tmp_path)
    result = CliRunner().invoke(main, [f"hf:{tmp_path}", "--max-len", "64", "--target-len", "16", "--gpu",
                                       "RTX-4090", "--checkpointing", "half", "--precision", "amp-bf16"])
    assert result.exit_code == 0, result.output
    assert "FITS" in result.output
