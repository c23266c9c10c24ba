"""An HF Trainer script, unmodified, for ``memcheck run``.

    python examples/scripts/train_hf_trainer.py --max-steps 100
    memcheck run --max-len 256 -- python examples/scripts/train_hf_trainer.py --max-steps 100

A GPT-2-shaped model built from its config (4 layers, width 256, vocabulary 8,000), trained
by ``transformers.Trainer`` with its defaults (``adamw_torch_fused``, ``max_grad_norm`` 1.0)
on synthetic token sequences of varying length, padded per batch to the longest.
"""

import random
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from train_loop import arguments


def sequences(count: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len))]}
            for _ in range(count)]


def pad_to_longest(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = labels[row, :n] = torch.tensor(s["input_ids"])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main(argv=None):
    args = arguments(argv, **{"--output-dir": dict(default=None),
                              "--bf16": dict(action="store_true", help="mixed precision (autocast, bfloat16)")})

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8000, n_positions=args.max_len, n_embd=256, n_layer=4, n_head=4)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf-trainer-"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        bf16=args.bf16,
    )
    data = sequences(64 * args.batch_size, 8000, args.min_len, args.max_len)
    trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=pad_to_longest)
    result = trainer.train()
    print(f"trained {result.global_step} steps")


if __name__ == "__main__":
    main()
