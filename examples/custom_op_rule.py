"""A model with a custom op memcheck cannot trace, and the rule that teaches it.

    python examples/custom_op_rule.py                                     # the error, then the fix
    memcheck examples/custom_op_rule.py --device cpu --max-len 16          # as a model file

``mylib::fused_rms_norm`` is a custom op (``torch.library.custom_op``) with a CPU kernel
and a backward, but no fake (meta) kernel, like many fused kernels in extensions. memcheck
traces on the meta device, so it stops there and names the op. A rule, registered with
``memcheck.register_op_rule``, says what the op returns: meta tensors of the right shapes
and dtypes, whose bytes memcheck counts. Anything the kernel allocates and frees inside
(a workspace) can be added with ``ctx.scratch(nbytes, ...)``.

Imported as a model file (not run as a script), the file registers the rule at import.
"""

import torch
from torch import nn

import memcheck

NAME = "mylib::fused_rms_norm"


def _define_op():
    """Define the op once per process (a model file may be imported more than once)."""
    if hasattr(torch.ops.mylib, "fused_rms_norm"):
        return

    @torch.library.custom_op(NAME, mutates_args=())
    def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm returning the output and the fp32 reciprocal RMS per row (saved for backward)."""
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        return (x.float() * rstd.unsqueeze(-1)).to(x.dtype) * weight, rstd

    def setup_context(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output[1])

    def backward(ctx, grad_y, grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd.unsqueeze(-1)
        grad_normed = grad_y.float() * weight.float()
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = (grad_normed - normed * dot) * rstd.unsqueeze(-1)
        grad_w = (grad_y.float() * normed).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None

    fused_rms_norm.register_autograd(backward, setup_context=setup_context)


_define_op()


def fused_rms_norm_rule(ctx, func, args, kwargs):
    """What ``mylib::fused_rms_norm`` returns: ``y`` like ``x``, and ``rstd``, one fp32 per row.

    Inside, the CPU kernel above also holds ``x * rstd`` (an fp32 copy of ``x``) while it
    multiplies by the weight: ``ctx.scratch`` records it on top of the outputs, then frees it.
    """
    x = args[0]
    out = torch.empty_like(x), torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    ctx.track(out)  # the outputs first, then the scratch that is live with them
    ctx.scratch(x.numel() * 4)
    return out


def register_rule():
    memcheck.register_op_rule(torch.ops.mylib.fused_rms_norm.default, fused_rms_norm_rule)


class Block(nn.Module):
    def __init__(self, dim=256, vocab=1000):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        normed, _ = torch.ops.mylib.fused_rms_norm(h, self.norm_weight, 1e-6)
        return self.head(h + self.mlp(normed))


def build_model():
    return Block()


def make_batch(batch_size, max_len=None):
    return torch.randint(0, 1000, (batch_size, max_len or 128))


def compute_loss(model, batch):
    logits = model(batch)
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())


def main():
    from memcheck.measure.local import measure_cpu

    with torch.device("meta"):
        model, batch = build_model(), make_batch(8, 128)
    try:
        memcheck.estimate(model, batch, device="cpu", loss_fn=compute_loss)
    except memcheck.UnsupportedOpError as exc:
        print(f"Without a rule:\n  {exc}\n")
    register_rule()
    est = memcheck.estimate(model, batch, device="cpu", loss_fn=compute_loss)
    print(f"With a rule for {NAME} (memcheck.register_op_rule):\n\n{est}\n")

    def build():
        torch.manual_seed(0)
        return build_model(), make_batch(8, 128)

    real = measure_cpu(build, torch.optim.AdamW, loss_fn=compute_loss).steady_peak_bytes
    print(f"A real CPU run of the same steps peaks at {real:,} B; the estimate is {est.peak_bytes:,} B.")


if __name__ == "__main__":
    main()
else:  # imported as a model file: the rule is part of the model
    register_rule()
