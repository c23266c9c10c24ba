"""A DistributedDataParallel script, unmodified, for ``memcheck run`` under ``torchrun``.

    torchrun --nproc-per-node 2 examples/scripts/train_ddp.py --max-steps 100
    memcheck run --max-len 256 -- torchrun --nproc-per-node 8 examples/scripts/train_ddp.py --max-steps 100

The decoder of ``train_loop.py`` in ``DistributedDataParallel``, one process a GPU (gloo on
the CPU), each rank reading its own part of the data through a ``DistributedSampler``.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from train_loop import TinyDecoder, arguments, pad_to_longest, sequences


def main(argv=None):
    args = arguments(argv, **{"--bucket-cap-mb": dict(type=float, default=None)})

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TinyDecoder(vocab=8000, width=256, layers=4, heads=4, max_len=args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank] if cuda else None, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = sequences(64 * args.batch_size, 8000, args.min_len, args.max_len)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data), collate_fn=pad_to_longest)

    model.train()
    step = 0
    while step < args.max_steps:
        for ids in loader:
            optimizer.zero_grad(set_to_none=True)
            ids = ids.to(device)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.max_steps:
                break
    if dist.get_rank() == 0:
        print(f"trained {step} steps, last loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
