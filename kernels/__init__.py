"""tta_kernels: Triton kernels with PyTorch fallbacks (installed from the kernels/ folder).

Kernels are added with the memory-side methods (DAF packed activations, SURGEON pruning);
every kernel ships with a PyTorch fallback so CPU-only machines run the same code.
"""
