"""Training, emulated: the loop that is traced (``loop``), optimizers as torch builds them
for the target (``optimizers``), gradient checkpointing (``checkpointing``) and how a step
is spread over GPUs (``strategies``: a written contract and one module per family)."""
