"""A TRL ``SFTTrainer`` script, unmodified, for ``memcheck run`` (needs ``pip install trl``).

    python examples/scripts/train_sft.py --max-steps 100
    memcheck run --max-len 256 -- python examples/scripts/train_sft.py --max-steps 100

The GPT-2-shaped model of train_hf_trainer.py (4 layers, width 256, vocabulary 8,000) fine-tuned
by TRL's ``SFTTrainer`` with its defaults on pre-tokenized synthetic sequences of varying
length (``max_length`` = ``--max-len``), padded per batch to the longest. ``SFTTrainer``
computes the loss with its own fused LM head: per-token log-probabilities, entropy and
whether each label is the top-1 token, projected in vocabulary tiles without the full
logits (trl/trainer/utils.py, ``add_fused_lm_head``), for the ``entropy`` and
``mean_token_accuracy`` it logs every step. The tokenizer is a word-level one built here
(``t0`` .. ``t7999``), so nothing is downloaded.
"""

import random
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from train_loop import arguments

VOCAB = 8000


def tokenizer(max_len: int) -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", model_max_length=max_len)


def sequences(count: int, min_len: int, max_len: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_dict({"input_ids": [[rng.randrange(2, VOCAB) for _ in range(rng.randint(min_len, max_len))]
                                            for _ in range(count)]})


def trainer(argv=None, callbacks=()) -> SFTTrainer:
    """The script's trainer, built from its command line (``callbacks`` for a caller that adds its own)."""
    args = arguments(argv, **{"--output-dir": dict(default=None), "--width": dict(type=int, default=256)})
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=args.max_len, n_embd=args.width, n_layer=4, n_head=4)
    training = SFTConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="sft-"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        max_length=args.max_len,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    return SFTTrainer(model=GPT2LMHeadModel(config), args=training, processing_class=tokenizer(args.max_len),
                      train_dataset=sequences(64 * args.batch_size, args.min_len, args.max_len),
                      callbacks=list(callbacks))


def main(argv=None):
    result = trainer(argv).train()
    print(f"trained {result.global_step} steps")


if __name__ == "__main__":
    main()
