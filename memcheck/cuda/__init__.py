"""The CUDA device, without a GPU: the GPU table (``gpus``), the caching allocator's
simulation (``allocator``) and what lives outside it (``overhead``: the CUDA context,
cuBLAS's and cuDNN's workspaces). Only ``gpus`` asks the machine anything (nvidia-smi);
nothing here initialises CUDA."""
