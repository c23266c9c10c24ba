"""Op rules: what memcheck knows about particular ops, per target device.

``registry`` holds the tables and ``register_op_rule``, and imports no rule; ``tags`` keeps
what rules remember about a meta storage between ops. Each module below registers its own
rules when imported; importing this package imports them all:

* ``autograd``: the engine's in-place gradient accumulation, which a traced backward
  does not take by itself;
* ``sdpa``: ``scaled_dot_product_attention``'s kernel choice on each target, and the CPU
  flash-attention kernels' buffers;
* ``cpu_kernels``: CPU kernels whose buffers differ from the meta kernel's (oneDNN, LSTM, ...);
* ``cuda_kernels``, ``cuda_attention`` and ``cuda_norms``: CUDA kernels whose memory differs
  from the meta kernel's (softmax; flash / efficient / cuDNN attention and the math backend's
  fused dropout; the fused RMSNorm);
* ``cuda_conv``: the workspace blocks of cuDNN convolutions (``cpu_kernels``' convolution
  rules call it on the CUDA target);
* ``cuda_sort``: sort-based CUDA kernels' index arrays and cub temp storage (the backward of
  ``nn.Embedding`` and of ``x[idx]``, ``sort``);
* ``grouped_mm``: ``aten._grouped_mm``, the experts' grouped GEMM of mixture-of-experts
  layers, whose meta kernel accepts bf16 only;
* ``data_dependent``: ops whose output size depends on values take the worst case (and
  the routing masks of mixture-of-experts layers, tokens x top_k rows in all);
* ``dropout``: the fused CUDA dropout kernel (a bool mask) instead of the CPU's noise tensor;
* ``expert_parallel``: the split sizes of expert parallelism's all-to-all, from the routing
  choice point;
* ``autocast``: ``torch.autocast``'s casts, emulated on meta tensors;
* ``extensions``: flash-attn and bitsandbytes, by qualified op name.

``known_values`` registers no rule: the tracer follows with it the values the traced code
made itself (``torch.ones`` masks), and ``data_dependent``'s checks read them.
"""

from memcheck.rules import (  # noqa: F401  (each registers its rules)
    autocast,
    autograd,
    cpu_kernels,
    cuda_attention,
    cuda_conv,
    cuda_kernels,
    cuda_norms,
    cuda_sort,
    data_dependent,
    dropout,
    expert_parallel,
    extensions,
    grouped_mm,
    sdpa,
)
