"""The dtype a model computes its sensitive parts in (norm statistics, rope angles, router softmax, attention
softmax, the loss): fp32 for bf16, fp16 and fp32 activations, as transformers does, and float64 kept for a float64
model, so that a whole model runs in float64 on CPU (the reference of the tests: rounding ~1e-16, not ~1e-7)."""

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or float64 for float64 (the wider of dtype and fp32)."""
    return torch.promote_types(dtype, torch.float32)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in compute_dtype(x.dtype); an integer tensor (positions) in fp32. Where bf16 code says x.float()."""
    return x.to(compute_dtype(x.dtype) if x.is_floating_point() else torch.float32)
