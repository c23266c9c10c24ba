"""The job of Lightning's FSDP guide: its demo Transformer of about 1B parameters on WikiText2.

    memcheck examples/lightning_fsdp_guide.py --strategy fsdp1 --gpus 2 --gpu A100-40GB \
        --step-order lightning --optimizer adam --offload params

Lightning's guide (``docs/source-pytorch/advanced/model_parallel/fsdp.rst``, "Numbers were produced
with A100 40GB GPUs, Lightning 2.1 and PyTorch 2.1") trains ``lightning.pytorch.demos.Transformer
(vocab_size=33278, nlayers=32, nhid=4096, ninp=1024, nhead=64)`` with ``torch.optim.Adam(lr=0.1)``
on ``DataLoader(WikiText2())`` (batch 1 of ``block_size=35`` tokens, the input and the target each
a (1, 35) row of ids), under ``Trainer(devices=2, strategy=FSDPStrategy(auto_wrap_policy=
{nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}, ...))`` in fp32 (the Trainer's default
``32-true``), and reads ``torch.cuda.memory_summary()``'s peak. Published rows (MB): DDP 23,125;
NO_SHARD 19,296; SHARD_GRAD_OP 11,772; FULL_SHARD 9,627; FULL_SHARD with ``cpu_offload=True`` 2,790.

The model is Lightning's own, built on meta (``lightning`` must be installed); the loss is the
guide's ``F.nll_loss(model(input, target), target.view(-1))``.
"""

import torch
import torch.nn.functional as F

VOCAB = 33_278  # WikiText2().vocab_size, the demo's default
BLOCK = 35  # WikiText2(block_size=35): tokens per sample


def build_model():
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=VOCAB, nlayers=32, nhid=4096, ninp=1024, nhead=64)


def make_batch(batch_size, max_len=None):
    length = max_len or BLOCK
    return (torch.randint(0, VOCAB, (batch_size, length)), torch.randint(0, VOCAB, (batch_size, length)))


def compute_loss(model, batch):
    inputs, target = batch
    return F.nll_loss(model(inputs, target), target.view(-1))


def make_optimizer(params):
    return torch.optim.Adam(params, lr=0.1)
