"""ZeRO-1 AdamW: gradients reduce-scattered and state sharded over a parameter's replicas, weights all-gathered.

Why not FSDP2 (core/fsdp.py, --shard fsdp): every rank keeps its full fp32 weights, so nothing is gathered per
micro-batch and the pipeline can run forwards, backwards and delayed weight gradients in any order without hooks;
the sharding work is three calls per step (`reduce_gradients`, `clip_grad_norm_`, `step`). Adam's moments shrink
by the replica count for one reduce-scatter and one all-gather per step (an all-reduce's traffic).

A `ReplicaSet` is a set of parameters replicated over the same ranks: dense parameters over (dp, cp, ep), routed
experts over (dp, cp). Rank i of n owns elements [i*c, (i+1)*c) of each flattened parameter, c = ceil(numel / n)
(DTensor's Shard(0) split); the shard is a view into the parameter, so AdamW updates the weights in place.
Checkpoints (`checkpoint_state`) reshard to any (dp, ep) layout and expert placement. `reinit_` resets part of a
parameter (a dead expert) and its Adam moments.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch 2.13 renamed the flat collectives (the old names warn with a FutureWarning on every call); the oldest torch
# pyproject admits (2.11) has only the old names
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class ReplicaSet:
    params: dict[str, torch.nn.Parameter]
    group: object  # ProcessGroup of the replicas, or None when this rank is the only copy
    mesh: DeviceMesh | None  # checkpoint layout of the dense parameters: a 1-D mesh of the replicas (None: plain)
    expert_ids: dict[str, list[int]] | None = None  # routed experts: name -> global expert id of each row of dim 0;
    # checkpointed per expert (expert_checkpoint_entries), whatever the placement


@dataclass
class _Entry:
    name: str
    param: torch.nn.Parameter
    replicas: ReplicaSet
    n: int  # ranks in the replica group
    chunk: int  # c: elements per shard before truncation
    start: int  # where the shard begins in the flattened parameter (i*c, or numel for an empty last shard)
    shard: torch.Tensor  # this rank's slice of the flattened parameter (a view)


def _split(numel: int, n: int, i: int) -> tuple[int, int]:
    chunk = math.ceil(numel / n)
    lo = min(i * chunk, numel)
    return lo, min(lo + chunk, numel)


def _contiguous_stride(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def expert_checkpoint_entries(name: str, full_LX: torch.Tensor, expert_ids: list[int]) -> dict[str, torch.Tensor]:
    """Rows of the local experts [L, ...] (weight or optimizer state) as checkpoint entries '{name}[{e}]' -> row (a
    view a load fills in place), one per global expert e: they load under any placement and ep size."""
    assert full_LX.shape[0] == len(expert_ids), (name, full_LX.shape, expert_ids)
    return {f"{name}[{e}]": full_LX[j] for j, e in enumerate(expert_ids)}


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, norm_group) -> torch.Tensor:
    """Scale `grads` (every rank's own elements; each element of the model on one rank) so that their global L2
    norm over norm_group is at most max_norm (0: no clipping); returns the norm before clipping."""
    # squares summed in fp64: layouts split this sum differently, and in fp32 its last bit depended on the layout,
    # moving the clip factor and every weight by ~3e-8, which bf16 weight copies amplified into ~1e-5 loss
    # differences. In fp64 every layout's norm rounds to the same fp32 value.
    sq = torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()
    if norm_group is not None:
        dist.all_reduce(sq, group=norm_group)
    norm = sq.sqrt().float()
    if max_norm > 0:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return norm


def reinit_rows(name: str, shape, index: int | slice, values: torch.Tensor | None) -> tuple[int, int]:
    """ShardedAdamW.reinit_'s rows first:last of dim 0 of a parameter of `shape`, its arguments checked."""
    rows = shape[0] if len(shape) else 0
    if isinstance(index, int) and not isinstance(index, bool):
        if not -rows <= index < rows:
            raise ValueError(f"reinit_: index {index} is out of range for dim 0 of {name} (size {rows})")
        first = index % rows
        last, part, where = first + 1, tuple(shape[1:]), f"{name}[{first}]"
    elif isinstance(index, slice):  # negative bounds count from the end, as in Python
        first = 0 if index.start is None else index.start + rows * (index.start < 0)
        last = rows if index.stop is None else index.stop + rows * (index.stop < 0)
        if index.step not in (None, 1) or not 0 <= first < last <= rows:
            raise ValueError(f"reinit_: {index} must select rows first:last (step 1) with 0 <= first < last <= "
                             f"{rows}, dim 0 of {name} {tuple(shape)}")
        part, where = (last - first, *shape[1:]), f"{name}[{first}:{last}]"
    else:
        raise ValueError(f"reinit_: index must be an int or a slice of dim 0 of {name}, got {index!r}")
    if values is not None and (not isinstance(values, torch.Tensor) or tuple(values.shape) != part):
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"reinit_: values for {where} must have shape {part}, got {got}")
    return first, last


class ShardedAdamW:
    def __init__(self, replica_sets: list[ReplicaSet], lr: float, weight_decay: float, betas, eps: float,
                 norm_group=None, bucket_bytes: int = 256 << 20):
        """norm_group spans every rank (all pipeline stages): the gradient norm sums all ranks' shards."""
        self.norm_group, self.bucket_bytes = norm_group, bucket_bytes
        self.entries: list[_Entry] = []
        for rs in replica_sets:
            n = 1 if rs.group is None else dist.get_world_size(rs.group)
            rank = 0 if rs.group is None else dist.get_rank(rs.group)
            for name, p in rs.params.items():
                assert p.is_contiguous(), name
                lo, hi = _split(p.numel(), n, rank)
                self.entries.append(_Entry(name, p, rs, n, math.ceil(p.numel() / n), lo, p.detach().view(-1)[lo:hi]))
        self.by_name = {e.name: e for e in self.entries}
        on_gpu = self.entries[0].param.device.type == "cuda"
        # weight decay on matrices only (norm weights and biases are not decayed, as in Megatron)
        groups = [{"params": [e.shard for e in self.entries if e.param.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [e.shard for e in self.entries if e.param.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_gpu, foreach=not on_gpu)

    def _buckets(self):
        """Entries of one replica set, in flat buckets of at most bucket_bytes, to issue few collectives."""
        buckets = []
        for e in self.entries:
            nbytes = e.n * e.chunk * e.param.element_size()
            last = buckets[-1] if buckets else None
            if last is None or last[0].replicas is not e.replicas or last[0].param.dtype != e.param.dtype or \
                    sum(x.n * x.chunk * x.param.element_size() for x in last) + nbytes > self.bucket_bytes:
                buckets.append([])
            buckets[-1].append(e)
        return buckets

    def reduce_gradients(self) -> None:
        """Sum each parameter's gradient over its replicas; this rank keeps only its shard's part (reduce-scatter),
        and the full gradient is freed. Losses are pre-divided by the global token count, so a sum is right."""
        for bucket in self._buckets():
            grads = [e.param.grad if e.param.grad is not None else torch.zeros_like(e.param) for e in bucket]
            group, n = bucket[0].replicas.group, bucket[0].n
            if group is None:
                for e, g in zip(bucket, grads):
                    e.shard.grad = g.view(-1)
            else:  # [n, sum of chunks]: row i holds every parameter's shard i, so shard i lands on rank i
                send = torch.cat([torch.nn.functional.pad(g.reshape(-1), (0, n * e.chunk - g.numel())).view(n, e.chunk)
                                  for e, g in zip(bucket, grads)], dim=1)
                mine = send.new_empty(send.shape[1])
                reduce_scatter_flat(mine, send.reshape(-1), group=group)
                for e, g in zip(bucket, mine.split([e.chunk for e in bucket])):
                    e.shard.grad = g[: e.shard.numel()]
            for e in bucket:
                e.param.grad = None

    def clip_grad_norm_(self, max_norm: float, extra: list[torch.Tensor] = ()) -> torch.Tensor:
        """Clip the reduced gradients to global L2 norm max_norm (0: none); returns the norm before. Each element counts
        once (shards partition parameters); extra: reduced gradients this rank alone holds (core/muon.py's), too."""
        return clip_grad_norm_([e.shard.grad for e in self.entries] + list(extra), max_norm, self.norm_group)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shards, then all-gather so that every replica holds the updated weights."""
        self.optimizer.step()
        for bucket in self._buckets():
            group, n = bucket[0].replicas.group, bucket[0].n
            if group is None:
                continue
            mine = torch.cat([torch.nn.functional.pad(e.shard, (0, e.chunk - e.shard.numel())) for e in bucket])
            full = mine.new_empty(n * mine.numel())
            all_gather_flat(full, mine, group=group)
            offset = 0
            for e in bucket:
                e.param.view(-1).copy_(full.view(n, -1)[:, offset: offset + e.chunk].reshape(-1)[: e.param.numel()])
                offset += e.chunk

    def zero_grad(self) -> None:
        for e in self.entries:
            e.param.grad = e.shard.grad = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_bytes(self) -> tuple[int, int]:
        """(bytes of Adam state on this rank, bytes it would take unsharded): the memory ZeRO-1 saves."""
        self._init_state()
        held = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values() if t.ndim)
        return held, sum(2 * e.param.numel() * e.param.element_size() for e in self.entries)

    # ----------------------------------------------------------------------------------- re-initialisation

    @torch.no_grad()
    def reinit_(self, name: str, index: int | slice, values: torch.Tensor | None = None) -> None:
        """param[index] = values (e.g. a dead routed expert replaced mid-run) and exp_avg = exp_avg_sq = 0 for the
        elements of that part in this rank's shard (possibly none). name: as in the ReplicaSets; index: an int or
        a slice (step 1) of dim 0 of the local parameter (e.g. local expert j of [L, H, J]); values: of shape
        param[index].shape (cast), or None to reset only the moments. Call it between steps on every replica with
        the same arguments (no collective). AdamW's `step` is per shard and not reset: its bias corrections are ~1,
        so the part's first update is (1 - beta1) / sqrt(1 - beta2) * lr (0.45 lr at betas (0.9, 0.95))."""
        e = self.by_name.get(name)
        if e is None:
            known = list(self.by_name)
            raise ValueError(f"reinit_: no parameter {name!r} in this optimizer; it has {len(known)}, e.g. "
                             f"{', '.join(map(repr, known[:4]))}")
        p = e.param
        first, last = reinit_rows(name, p.shape, index, values)
        if values is not None:
            p[first:last].copy_(values.reshape(last - first, *p.shape[1:]))  # the shard is a view: it sees them too
        rows = p.shape[0]
        # rows first:last of the contiguous parameter are flattened elements [first*row, last*row); this rank's
        # shard holds [start, start + shard numel); their intersection, relative to the shard, is what to zero
        row = p.numel() // rows
        lo = max(first * row, e.start) - e.start
        hi = min(last * row, e.start + e.shard.numel()) - e.start
        state = self.optimizer.state.get(e.shard)  # none before the first step: torch will start from zeros
        if state and lo < hi:
            state["exp_avg"][lo:hi].zero_()
            state["exp_avg_sq"][lo:hi].zero_()

    # ----------------------------------------------------------------------------------- checkpoints

    def _init_state(self) -> None:
        """Adam state as torch creates it at the first step, so that a checkpoint can be loaded into it."""
        fused = self.optimizer.defaults["fused"]
        for e in self.entries:
            if e.shard not in self.optimizer.state:
                step = torch.zeros((), device=e.shard.device) if fused else torch.tensor(0.0)
                self.optimizer.state[e.shard] = {"step": step, "exp_avg": torch.zeros_like(e.shard),
                                                 "exp_avg_sq": torch.zeros_like(e.shard)}

    def full_state(self, e: _Entry, key: str) -> torch.Tensor:
        """Adam state `key` of a whole parameter, all-gathered over its replicas (collective), on the CPU."""
        shard = self.optimizer.state[e.shard][key]
        if e.replicas.group is None:
            return shard.view(e.param.shape).cpu()
        full = shard.new_empty(e.n * e.chunk)
        all_gather_flat(full, torch.nn.functional.pad(shard, (0, e.chunk - shard.numel())), group=e.replicas.group)
        return full[: e.param.numel()].view(e.param.shape).cpu()

    def checkpoint_state(self, model: torch.nn.Module, replicas: dict[str, ReplicaSet] | None = None) -> dict:
        """{'model', 'optim'} for torch.distributed.checkpoint (collective over the experts' replicas). Dense: the
        live tensors (a load fills them in place), as DTensors over the set's mesh, Adam moments split over the
        replicas. Routed experts: one entry per global expert (expert_checkpoint_entries), moments all-gathered on
        the CPU (`after_load` puts this rank's shard back). replicas: each parameter's ReplicaSet, when some are
        trained by another optimizer (core/muon.py)."""
        self._init_state()
        replicas = replicas or {e.name: e.replicas for e in self.entries}
        model_sd = {}
        for name, t in model.state_dict().items():
            rs = replicas.get(name)
            if rs is not None and rs.expert_ids is not None:
                model_sd.update(expert_checkpoint_entries(name, t, rs.expert_ids[name]))
                continue
            mesh = None if rs is None else rs.mesh
            if mesh is None:
                model_sd[name] = t
                continue
            outer = math.prod(mesh.shape[:-1])
            shape = (t.shape[0] * outer, *t.shape[1:])
            model_sd[name] = DTensor.from_local(t, mesh, [Shard(0)] * (mesh.ndim - 1) + [Replicate()], run_check=False,
                                                shape=torch.Size(shape), stride=_contiguous_stride(shape))
        optim_sd = {"lr": torch.tensor([g["lr"] for g in self.param_groups], dtype=torch.float64)}
        for e in self.entries:
            state, mesh = self.optimizer.state[e.shard], e.replicas.mesh
            optim_sd[e.name] = {"step": state["step"]}
            if e.replicas.expert_ids is not None:
                for key in ("exp_avg", "exp_avg_sq"):
                    for entry, row in expert_checkpoint_entries(e.name, self.full_state(e, key),
                                                                e.replicas.expert_ids[e.name]).items():
                        optim_sd.setdefault(entry, {})[key] = row
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if mesh is None:
                    optim_sd[e.name][key] = state[key]
                else:
                    numel = e.param.numel() * math.prod(mesh.shape[:-1])
                    optim_sd[e.name][key] = DTensor.from_local(state[key], mesh, [Shard(0)] * mesh.ndim, run_check=False,
                                                               shape=torch.Size([numel]), stride=(1,))
        return {"model": model_sd, "optim": optim_sd}

    def after_load(self, state: dict) -> None:
        """Apply what torch.distributed.checkpoint cannot load in place: the learning rates, and this rank's shard
        of each routed expert's Adam moments (loaded whole, per expert)."""
        for g, lr in zip(self.param_groups, state["optim"]["lr"].tolist()):
            g["lr"] = lr
        for e in self.entries:
            if e.replicas.expert_ids is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                rows = [state["optim"][f"{e.name}[{x}]"][key] for x in e.replicas.expert_ids[e.name]]
                full = torch.stack(rows) if rows else torch.zeros(0)
                shard = self.optimizer.state[e.shard][key]
                shard.copy_(full.view(-1)[e.start: e.start + shard.numel()])
