"""Low-precision weight copies made once per optimizer step for every micro-batch (core/fp8.py's pairs, bf16 casts).

An entry is keyed by storage address, shape, dtype and kind of copy (torch.compile may hand an op an alias; aliases
share the version counter) and keeps the parameter alive. It is stale when the version counter moved or after
`invalidate()`, which the training loop calls after each optimizer.step() (updates through `.data` do not move the
counter). Autocast caches nn.Linear casts only within one region, so train.py runs a whole step in one.
"""

from collections import Counter

import torch


class WeightCache:
    def __init__(self):
        self.entries: dict[tuple, tuple] = {}  # key -> (weight, version, copy)
        self.made = Counter()  # copies made so far, per kind (the tests count them)

    def get(self, w: torch.Tensor, kind, make):
        """make(w detached), or the copy made earlier from the same weight if it has not changed since."""
        key = (w.data_ptr(), w.dtype, tuple(w.shape), kind)
        entry = self.entries.get(key)
        if entry is None or entry[1] != w._version:
            entry = self.entries[key] = (w, w._version, make(w.detach()))
            self.made[kind] += 1
        return entry[2]

    @property
    def quantizations(self) -> int:
        """FP8 copies made so far (core/fp8.py's kinds: "fp8" + its recipe)."""
        return sum(n for kind, n in self.made.items() if str(kind).startswith("fp8"))

    def invalidate(self) -> None:
        """Call after optimizer.step(): the next use of each weight makes its copies again."""
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
