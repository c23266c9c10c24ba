"""An ensemble of 128 small MLP heads on shared features, in two forms.

    ENSEMBLE_FORM=loop memcheck examples/ensemble.py --batch-size 256 --device cpu
    ENSEMBLE_FORM=vmap memcheck examples/ensemble.py --batch-size 256 --device cpu

Both forms train the same heads, Linear(256, 256) - GELU - Linear(256, 10), on
the same input and the same loss; compare the two peaks to see what batching
the heads costs or saves:

* ``loop`` (``LoopEnsemble``): a Python loop over an ``nn.ModuleList``, one
  small matmul per head, outputs stacked to (heads, batch, classes).
* ``vmap`` (``VmapEnsemble``, the default): the heads' parameters stacked with
  ``torch.func.stack_module_state`` into (heads, ...) ``nn.Parameter``s that the
  optimizer trains, and the forward ``vmap(functional_call)`` over one template
  head. The template lives on the meta device, in a plain list, so it is
  neither a submodule nor a second copy of the parameters.
"""

import os

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

ENSEMBLE_FORM = os.environ.get("ENSEMBLE_FORM", "vmap")
FORMS = ("loop", "vmap")

N_HEADS = 128
N_FEATURES = 256
HIDDEN = 256
N_CLASSES = 10


def make_head() -> nn.Module:
    return nn.Sequential(nn.Linear(N_FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, N_CLASSES))


class LoopEnsemble(nn.Module):
    """Heads in an ``nn.ModuleList``, run one after another; logits (heads, batch, classes)."""

    def __init__(self, n_heads: int = N_HEADS):
        super().__init__()
        self.heads = nn.ModuleList(make_head() for _ in range(n_heads))

    def forward(self, x):
        return torch.stack([head(x) for head in self.heads])


class VmapEnsemble(nn.Module):
    """Heads as stacked parameters, run at once with ``vmap``; logits (heads, batch, classes)."""

    def __init__(self, n_heads: int = N_HEADS):
        super().__init__()
        heads = [make_head() for _ in range(n_heads)]
        stacked, buffers = stack_module_state(heads)
        if buffers:
            raise ValueError("VmapEnsemble stacks parameters only; these heads have buffers")
        # register_parameter forbids dots: "0.weight" is stored as "0_weight".
        self._names = list(stacked)
        self.stacked = nn.ParameterDict(
            {name.replace(".", "_"): nn.Parameter(t) for name, t in stacked.items()}
        )
        # The template: shapes and code only, no storage, outside the module's registry.
        self._base = [make_head().to("meta")]

    def forward(self, x):
        base = self._base[0]
        params = {name: self.stacked[name.replace(".", "_")] for name in self._names}

        def one_head(p, x):
            return functional_call(base, p, (x,))

        return vmap(one_head, in_dims=(0, None))(params, x)


def build_model(form: str | None = None) -> nn.Module:
    form = form or ENSEMBLE_FORM
    if form not in FORMS:
        raise ValueError(f"ENSEMBLE_FORM must be one of {', '.join(FORMS)}, got {form!r}")
    return LoopEnsemble() if form == "loop" else VmapEnsemble()


def make_batch(batch_size, max_len=None):
    return torch.randn(batch_size, N_FEATURES), torch.randint(0, N_CLASSES, (batch_size,))


def compute_loss(model, batch):
    """Every head is trained on the same labels: cross entropy over heads x batch."""
    features, labels = batch
    logits = model(features)
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.repeat(logits.shape[0]))


def make_optimizer(params):
    return torch.optim.AdamW(params)
