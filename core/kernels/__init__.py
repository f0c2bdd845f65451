"""Triton kernels, each with its PyTorch reference in the same file (used off-GPU and by the tests)."""
