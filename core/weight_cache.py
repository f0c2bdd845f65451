"""Low-precision weight copies made once per optimizer step for every micro-batch (core/fp8.py's operands, bf16 casts).

An entry is keyed by storage address, shape, dtype and kind of copy (aliases from torch.compile share the version
counter). It is stale when the counter moved, when its weight no longer lies at that address (FSDP2 gathers a weight
again, maybe elsewhere, counter unmoved; another may take the address), or after `invalidate()` (train.py, each
optimizer step). `keep` False (FSDP2 gathering per micro-batch): a copy per use, none kept (the memory FSDP2 saves).
"""

from collections import Counter

import torch


class WeightCache:
    def __init__(self):
        self.entries: dict[tuple, tuple] = {}  # key -> (weight, version, copy)
        self.made = Counter()  # copies made so far, per kind (the tests count them)
        self.keep = True

    def get(self, w: torch.Tensor, kind, make):
        """make(w detached), or the copy made earlier from the same weight if it has not changed since."""
        key = (w.data_ptr(), w.dtype, tuple(w.shape), kind)
        entry = self.entries.get(key)
        if entry is None or entry[1] != w._version or entry[0].data_ptr() != key[0]:
            entry = (w, w._version, make(w.detach()))
            self.made[kind] += 1
            if self.keep:
                self.entries[key] = entry
        return entry[2]

    @property
    def quantizations(self) -> int:
        """FP8 operands made so far (core/fp8.py's kinds start with "fp8")."""
        return sum(n for kind, n in self.made.items() if str(kind).startswith("fp8"))

    def invalidate(self) -> None:  # after each optimizer step: the next use of each weight makes its copies again
        self.entries.clear()


CACHE = WeightCache()  # this process's weight copies (entries are per parameter)


class _CachedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dtype):
        ctx.dtype = w.dtype
        copy = CACHE.get(w, dtype, lambda w: w.to(dtype))
        return copy.view_as(copy)  # a new tensor object per call: autograd attaches this call's node to it

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def cast_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype`, cast once per optimizer step (w itself if it has it); the gradient reaches w in w's dtype."""
    if w.dtype == dtype:
        return w
    if torch.is_grad_enabled() and w.requires_grad:
        return _CachedCast.apply(w, dtype)
    return CACHE.get(w, dtype, lambda w: w.to(dtype))
