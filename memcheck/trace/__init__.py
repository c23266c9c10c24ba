"""Tracing on the meta device: the ``TorchDispatchMode`` that records every storage's
allocation and free (``tracer``), and the redirect that keeps a model's CUDA calls off the
GPU while memcheck runs its code (``device_redirect``)."""
