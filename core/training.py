"""What every train.py needs around the model: flags from a dataclass, AdamW, the lr schedule, gradient
reduction over the ranks that replicate a parameter, and gradient clipping by the global norm."""

import argparse
import dataclasses
import math

import torch
import torch.distributed as dist


def parse_args(cls, argv=None):
    """argparse flags mapped 1:1 onto the fields of a dataclass (`max_steps` -> `--max-steps`)."""
    parser = argparse.ArgumentParser(description=cls.__doc__)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=f.type, default=f.default, help=f"default: {f.default}")
    return cls(**vars(parser.parse_args(argv)))


def build_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float):
    """AdamW with weight decay on matrices only (norm weights and biases are not decayed, as in Megatron)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    on_gpu = params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_gpu, foreach=not on_gpu)


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_ratio: float, decay_fraction: float) -> float:
    """Multiplier of the peak lr at a 0-based optimizer step: linear warmup, then
    cosine: half a cosine down to min_ratio at `total`;
    wsd:    warmup-stable-decay, flat until the last `decay_fraction` of the steps, then linear to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_start = total - int(decay_fraction * total)
        if step < decay_start:
            return 1.0
        return 1.0 - (1 - min_ratio) * min(1.0, (step - decay_start + 1) / max(1, total - decay_start))
    raise ValueError(f"unknown --lr-schedule {schedule!r}; use cosine or wsd")


def grads_of(params) -> list[torch.Tensor]:
    """Gradients, with zeros for a parameter that got none, so every rank reduces the same buffers."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def all_reduce_grads(params, group, bucket_bytes: int = 64 << 20) -> None:
    """Sum gradients over `group` (the ranks replicating these parameters), in flat buckets to issue few
    collectives. Losses are pre-divided by the global token count, so a sum is the right reduction."""
    if group is None:
        return
    buckets, size = [], 0
    for g in grads_of(params):
        nbytes = g.numel() * g.element_size()
        if not buckets or g.dtype != buckets[-1][0].dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        for g, chunk in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(chunk.view_as(g))


def clip_grad_norm_(params, max_norm: float, shard_group=None) -> torch.Tensor:
    """Scale gradients so that their global L2 norm is at most max_norm; returns the norm before clipping.

    Gradients must already be reduced (identical on the ranks replicating a parameter), so each parameter is
    counted once: `shard_group` spans the ranks holding *different* parameters (pipeline stages, expert
    shards) whose squared norms are summed; None when this rank holds the whole model."""
    grads = grads_of(params)
    sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    if shard_group is not None:
        dist.all_reduce(sq, group=shard_group)
    norm = sq.sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return norm
