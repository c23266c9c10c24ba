"""Real runs to check the estimates against: the CPU allocator through torch.profiler and
CUDA in this process (``local``), and real gloo ranks for the distributed strategies
(``distributed``)."""
