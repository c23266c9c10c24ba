"""The README's callback example: a transformers Trainer whose job memcheck checks before step 1.

    python examples/trainer_callback.py

GPT-2 small at 32 x 1024 tokens in bf16 autocast would need about 48 GiB on an RTX 4090 (24 GiB):
the callback raises memcheck.WillNotFit with the fix before the Trainer runs a step. The model is
real (built from its config, random weights) and the Trainer runs on the CPU (use_cpu=True); the
callback traces a meta twin for the GPU named by gpu=, so no GPU is needed.
"""

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from memcheck.integrations.transformers import MemcheckCallback

model = GPT2LMHeadModel(GPT2Config())                 # GPT-2 small, 124M parameters
data = [{"input_ids": [1] * 1024, "labels": [1] * 1024}] * 64
args = TrainingArguments("out", per_device_train_batch_size=32, bf16=True, use_cpu=True, report_to="none")
trainer = Trainer(model=model, args=args, train_dataset=data,
                  callbacks=[MemcheckCallback(gpu="RTX-4090", max_length=1024)])
trainer.train()   # raises memcheck.WillNotFit before step 1 if the job will not fit on the GPU
