"""An accelerate script, unmodified, for ``memcheck run``.

    python examples/scripts/train_accelerate.py --max-steps 100
    memcheck run --max-len 256 -- python examples/scripts/train_accelerate.py --max-steps 100

The decoder of ``train_loop.py`` with its optimizer and DataLoader handed to
``accelerate.Accelerator.prepare``, which moves each batch to the device; the loss goes
through ``accelerator.backward`` and gradients are clipped with ``accelerator.clip_grad_norm_``.
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from train_loop import TinyDecoder, arguments, pad_to_longest, sequences


def main(argv=None):
    args = arguments(argv)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = TinyDecoder(vocab=8000, width=256, layers=4, heads=4, max_len=args.max_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = sequences(64 * args.batch_size, 8000, args.min_len, args.max_len)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=pad_to_longest)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    step = 0
    while step < args.max_steps:
        for ids in loader:
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.max_steps:
                break
    accelerator.print(f"trained {step} steps")


if __name__ == "__main__":
    main()
