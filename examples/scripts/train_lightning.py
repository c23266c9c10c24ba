"""A Lightning script, unmodified, for ``memcheck run``.

    python examples/scripts/train_lightning.py --max-steps 100
    memcheck run --max-len 256 -- python examples/scripts/train_lightning.py --max-steps 100

The decoder of ``train_loop.py`` in a LightningModule, trained by ``lightning.Trainer`` on the
CPU (``precision="32-true"``, Adam, gradient clipping at 1.0) on synthetic token sequences
of varying length, padded per batch to the longest.
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from train_loop import TinyDecoder, arguments, pad_to_longest, sequences


class LitDecoder(pl.LightningModule):
    def __init__(self, max_len: int):
        super().__init__()
        self.model = TinyDecoder(vocab=8000, width=256, layers=4, heads=4, max_len=max_len)

    def training_step(self, ids, batch_idx):
        logits = self.model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-4)


def main(argv=None):
    args = arguments(argv)

    torch.manual_seed(0)
    data = sequences(64 * args.batch_size, 8000, args.min_len, args.max_len)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=pad_to_longest)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.max_steps, precision="32-true",
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitDecoder(args.max_len), loader)
    print(f"trained {trainer.global_step} steps")


if __name__ == "__main__":
    main()
