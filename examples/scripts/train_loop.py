"""A plain PyTorch training loop, unmodified, for ``memcheck run``.

    python examples/scripts/train_loop.py --max-steps 100
    memcheck run --max-len 256 -- python examples/scripts/train_loop.py --max-steps 100

A small decoder (token embedding, 4 pre-norm blocks of nn.TransformerEncoderLayer with a
causal mask, tied output head) trained on synthetic token sequences of varying length,
padded per batch to the longest, as ``padding=True`` does. The loop clips gradients and
calls ``zero_grad`` at the top of each step, as many scripts do.
"""

import argparse
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 does

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def sequences(count: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def pad_to_longest(samples):
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = torch.tensor(s)
    return ids


def arguments(argv=None, **extra):
    """The examples' command line: batch size, sample lengths, steps; ``extra`` adds options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=100)
    for flag, options in extra.items():
        parser.add_argument(flag, **options)
    return parser.parse_args(argv)


def main(argv=None):
    args = arguments(argv, **{"--width": dict(type=int, default=256)})

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyDecoder(vocab=8000, width=args.width, layers=4, heads=4, max_len=args.max_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = sequences(64 * args.batch_size, 8000, args.min_len, args.max_len)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=pad_to_longest)

    model.train()
    step = 0
    while step < args.max_steps:
        for ids in loader:
            optimizer.zero_grad(set_to_none=True)
            ids = ids.to(device)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step == args.max_steps:
                break
    print(f"trained {step} steps, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
