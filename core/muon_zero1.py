"""Muon for the weight matrices, ZeRO-1 AdamW (core/optimizer.py) for every other parameter, exact in every layout.

Muon (Moonlight's variant: torch.optim.Muon, adjust_lr_fn="match_rms_adamw") updates W (A x B) from its gradient G:

    M <- mu M + (1 - mu) G                          momentum (mu 0.95), kept in fp32; torch.optim.Muon's lerp form
    U <- (1 - mu) G + mu M                          Nesterov
    O <- NS5(U / ||U||_F)                           5 quintic Newton-Schulz steps (3.4445, -4.7750, 2.0315): ~U V^T
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O   decoupled weight decay; the update's RMS matched to AdamW's

so one learning rate and schedule serve both groups. The model splits tensors into matrices (`split(name, t)`, each
recipe's `Model.muon_matrices`: transformers' layout, so [L, H, 2I] experts are 2L matrices). Newton-Schulz runs in bf16
on GPU (as Moonlight and torch), in fp32 on CPU (matching torch.optim.Muon to rounding); weights and momentum stay fp32.

Distribution. Newton-Schulz needs whole matrices: in each ReplicaSet every matrix has one owner rank (balanced by
FLOPs). A bucket's send buffer is laid out owner by owner ([n, segment]): one reduce-scatter hands each owner its
matrices' summed gradients, an all-gather of the same layout returns the new weights. Owners batch matrices by shape.

Checkpoints: ShardedAdamW's, plus every matrix's momentum whole, written by its owner under
`muon_momentum.<parameter name>[.<kind>][.expert<global id>]`, which any other layout's owners read.

Tensor names: S matrices stacked (the experts of one parameter, or 1), k of them owned by this rank, A x B a matrix.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from core.optimizer import ReplicaSet, ShardedAdamW, all_gather_flat, reduce_scatter_flat

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7  # torch.optim.Muon's: the Frobenius norm is clamped to it before the division
RMS_MATCH = 0.2  # update scale 0.2 sqrt(max(A, B)): an orthogonal A x B matrix has RMS 1 / sqrt(max(A, B))


def newton_schulz(u_SAB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, A, B] -> each matrix orthogonalised in `dtype` (NS5 at the top), on its wide side as torch.optim.Muon."""
    a, b, c = NS_COEFFICIENTS
    x = u_SAB.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def newton_schulz_flops(a: int, b: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of newton_schulz on one a x b matrix: per step X X^T, G G and P X."""
    m, n = min(a, b), max(a, b)
    return NS_STEPS * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


@dataclass
class _Piece:
    """The matrices of one kind in one parameter: split(name, t)[kind] is a [S, A, B] view of t."""
    name: str
    kind: str  # '' for a plain 2-D weight, else e.g. 'gate', 'up', 'down'
    param: torch.nn.Parameter
    ids: list[int] | None  # routed experts: the global id of each stacked matrix (in checkpoint keys); else None

    def view(self, split, t: torch.Tensor) -> torch.Tensor:
        return split(self.name, t)[self.kind][0]

    def key(self, s: int) -> str:
        return self.name + (f".{self.kind}" if self.kind else "") + (f".expert{self.ids[s]}" if self.ids else "")


@dataclass
class _Block:
    """Matrices index_k of a piece owned by one rank; elements [offset, offset + numel) of its bucket segment."""
    piece: _Piece
    owner: int
    index_k: torch.Tensor  # long, which of the piece's S matrices
    offset: int
    shape: tuple[int, int, int]  # (k, A, B)
    grad_kAB: torch.Tensor | None = None  # the reduced gradient (owner only)
    momentum_kAB: torch.Tensor | None = None  # fp32 (owner only)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    pieces: list[_Piece]
    group: object  # ProcessGroup of the replicas, or None
    n: int
    rank: int
    blocks: list[_Block] = field(default_factory=list)  # owner by owner, each owner's in segment order
    segment: int = 0  # elements per owner (the largest owner's; the others are padded)


class MuonAdamW:
    """Muon on `split`'s matrices, ShardedAdamW (same calls) on the rest; one lr, scheduled via `self.optimizer`."""

    def __init__(self, replica_sets: list[ReplicaSet], split, lr: float, weight_decay: float, betas, eps: float,
                 momentum: float = 0.95, norm_group=None, ns_dtype: torch.dtype | None = None,
                 bucket_bytes: int = 256 << 20):
        """split(name, t) -> {kind: ([S, A, B] view of t, the S matrices' global expert ids or None)}, {} for an AdamW
        parameter; t: the parameter or one of its shape (the gradient). ns_dtype: default bf16 on GPU, fp32 on CPU."""
        self.split, self.momentum, self.weight_decay = split, momentum, weight_decay
        adamw_sets, self.buckets, self.pieces = [], [], []
        for rs in replica_sets:
            matrices = {name: p for name, p in rs.params.items() if split(name, p)}
            adamw_sets.append(ReplicaSet({n: p for n, p in rs.params.items() if n not in matrices}, rs.group, rs.mesh,
                                         rs.expert_ids))
            self._plan(rs, matrices, bucket_bytes)
        self.adamw = ShardedAdamW(adamw_sets, lr, weight_decay, betas, eps, norm_group, bucket_bytes)
        self.optimizer = self.adamw.optimizer
        self.replicas = {**{e.name: e.replicas for e in self.adamw.entries},
                         **{pc.name: rs for rs in replica_sets for pc in self.pieces if pc.name in rs.params}}
        self.owned = [b for bucket in self.buckets for b in bucket.blocks if b.owner == bucket.rank]
        for b in self.owned:
            b.momentum_kAB = torch.zeros(b.shape, dtype=torch.float32, device=b.piece.param.device)
        device = next(p for rs in replica_sets for p in rs.params.values()).device
        self.ns_dtype = ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)

    def _plan(self, rs: ReplicaSet, matrices: dict, bucket_bytes: int) -> None:
        """Buckets of whole parameters (at most bucket_bytes of fp32 gradients, at least one parameter) and an owner
        per matrix: largest cost first, to the rank with the least so far over the whole set (same on every replica)."""
        n = 1 if rs.group is None else dist.get_world_size(rs.group)
        rank = 0 if rs.group is None else dist.get_rank(rs.group)
        buckets = []
        for name, p in matrices.items():
            assert p.dtype == torch.float32 and p.is_contiguous(), name
            if not buckets or sum(q.numel() * 4 for q in buckets[-1].params) + p.numel() * 4 > bucket_bytes:
                buckets.append(_Bucket([], [], rs.group, n, rank))
            buckets[-1].params.append(p)
            buckets[-1].pieces += [_Piece(name, kind, p, ids) for kind, (_, ids) in self.split(name, p).items()]
        load = [0] * n
        for bucket in buckets:
            shapes = [tuple(pc.view(self.split, pc.param).shape) for pc in bucket.pieces]
            costs = [(newton_schulz_flops(A, B), i, s) for i, (S, A, B) in enumerate(shapes) for s in range(S)]
            owner = {}
            for cost, i, s in sorted(costs, key=lambda c: -c[0]):  # stable: ties keep parameter order
                r = min(range(n), key=lambda r: load[r])
                owner[i, s], load[r] = r, load[r] + cost
            for r in range(n):  # segment r: rank r's matrices, piece by piece
                offset = 0
                for i, (pc, (S, A, B)) in enumerate(zip(bucket.pieces, shapes)):
                    index = [s for s in range(S) if owner[i, s] == r]
                    if index:
                        block = _Block(pc, r, torch.tensor(index, device=pc.param.device), offset, (len(index), A, B))
                        bucket.blocks.append(block)
                        offset += block.numel
                bucket.segment = max(bucket.segment, offset)
        self.buckets += buckets
        self.pieces += [pc for bucket in buckets for pc in bucket.pieces]

    def describe(self) -> str:
        """Which parameters go to which optimizer (names with layer numbers as *), for the start-up line."""
        def names(params):
            return sorted({".".join("*" if part.isdigit() else part for part in n.split(".")) for n in params})
        muon = {pc.name for pc in self.pieces}
        matrices = sum(pc.view(self.split, pc.param).shape[0] for pc in self.pieces)
        adamw = [e.name for e in self.adamw.entries]
        return (f"muon: {matrices} matrices in {len(muon)} tensors ({', '.join(names(muon))}) | "
                f"adamw: {len(adamw)} tensors ({', '.join(names(adamw))})")

    # ------------------------------------------------------------------------------------------- the step

    def reduce_gradients(self) -> None:
        """AdamW's reduce-scatter, then one per bucket (segment r: what rank r owns, summed); frees full gradients."""
        self.adamw.reduce_gradients()
        for bucket in self.buckets:
            grads = {id(p): p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params}
            if bucket.group is None:
                for b in bucket.blocks:
                    b.grad_kAB = b.piece.view(self.split, grads[id(b.piece.param)]).index_select(0, b.index_k)
            else:
                send = bucket.params[0].new_zeros(bucket.n, bucket.segment)
                for b in bucket.blocks:
                    g_SAB = b.piece.view(self.split, grads[id(b.piece.param)])
                    send[b.owner, b.offset: b.offset + b.numel].view(b.shape).copy_(g_SAB.index_select(0, b.index_k))
                mine = send.new_empty(bucket.segment)
                reduce_scatter_flat(mine, send.view(-1), group=bucket.group)
                for b in bucket.blocks:
                    if b.owner == bucket.rank:
                        b.grad_kAB = mine[b.offset: b.offset + b.numel].view(b.shape)
            for p in bucket.params:
                p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global norm over the AdamW shards and the owned matrices (each element once); clips both."""
        return self.adamw.clip_grad_norm_(max_norm, extra=[b.grad_kAB for b in self.owned])

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on its shards; Muon on the owned matrices (batched by shape); then every bucket's all-gather."""
        self.adamw.step()
        lr, mu = self.param_groups[0]["lr"], self.momentum
        by_shape = {}  # (A, B) -> owned blocks of that shape: one batched Newton-Schulz each
        for b in self.owned:
            b.momentum_kAB.lerp_(b.grad_kAB, 1 - mu)
            by_shape.setdefault(b.shape[1:], []).append(b)
        new_weights = {}
        for (A, B), blocks in by_shape.items():
            u_kAB = torch.cat([b.grad_kAB.lerp(b.momentum_kAB, mu) for b in blocks])  # Nesterov
            o_kAB = newton_schulz(u_kAB, self.ns_dtype)
            for b, o in zip(blocks, o_kAB.split([b.shape[0] for b in blocks])):
                w = b.piece.view(self.split, b.piece.param).index_select(0, b.index_k)
                w.mul_(1 - lr * self.weight_decay)
                w.add_(o, alpha=-lr * RMS_MATCH * math.sqrt(max(A, B)))
                new_weights[id(b)] = w
        for bucket in self.buckets:
            if bucket.group is None:
                for b in bucket.blocks:
                    b.piece.view(self.split, b.piece.param).index_copy_(0, b.index_k, new_weights[id(b)])
                continue
            mine = bucket.params[0].new_zeros(bucket.segment)
            for b in bucket.blocks:
                if b.owner == bucket.rank:
                    mine[b.offset: b.offset + b.numel].view(b.shape).copy_(new_weights[id(b)])
            full = mine.new_empty(bucket.n, bucket.segment)
            all_gather_flat(full.view(-1), mine, group=bucket.group)
            for b in bucket.blocks:
                w_kAB = full[b.owner, b.offset: b.offset + b.numel].view(b.shape)
                b.piece.view(self.split, b.piece.param).index_copy_(0, b.index_k, w_kAB)

    def zero_grad(self) -> None:
        self.adamw.zero_grad()
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        for b in self.owned:
            b.grad_kAB = None

    @property
    def param_groups(self):
        return self.adamw.param_groups

    def state_bytes(self) -> tuple[int, int]:
        """(bytes of optimizer state on this rank, bytes unsharded): AdamW's moments plus the owned momentum."""
        held, full = self.adamw.state_bytes()
        return (held + sum(b.momentum_kAB.numel() * 4 for b in self.owned),
                full + sum(pc.param.numel() * 4 for pc in {id(pc.param): pc for pc in self.pieces}.values()))

    @torch.no_grad()
    def reinit_(self, name: str, index: int | slice, values: torch.Tensor | None = None) -> None:
        """ShardedAdamW.reinit_'s contract: param[index] = values, that part's Adam moments or Muon momentum reset."""
        if not any(pc.name == name for pc in self.pieces):
            return self.adamw.reinit_(name, index, values)  # (its error lists the parameters for an unknown name)
        p = next(pc.param for pc in self.pieces if pc.name == name)
        if not isinstance(index, (int, slice)) or isinstance(index, bool):
            raise ValueError(f"reinit_: index must be an int or a slice of dim 0 of {name}, got {index!r}")
        if isinstance(index, int) and not -p.shape[0] <= index < p.shape[0]:
            raise ValueError(f"reinit_: index {index} is out of range for dim 0 of {name} (size {p.shape[0]})")
        part = p[index]
        if values is not None:
            if not isinstance(values, torch.Tensor) or values.shape != part.shape:
                got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
                raise ValueError(f"reinit_: values for {name}[{index}] must have shape {tuple(part.shape)}, got {got}")
            part.copy_(values)
        reset = torch.zeros_like(p, dtype=torch.bool)
        reset[index] = True
        for b in self.owned:
            if b.piece.name == name:
                b.momentum_kAB[b.piece.view(self.split, reset).index_select(0, b.index_k)] = 0

    # ----------------------------------------------------------------------------------------- checkpoints

    def checkpoint_state(self, model: torch.nn.Module) -> dict:
        """ShardedAdamW's state + optim.muon_momentum: the owned momenta as [A, B] views (loaded in place)."""
        state = self.adamw.checkpoint_state(model, replicas=self.replicas)
        state["optim"]["muon_momentum"] = {b.piece.key(int(s)): m_AB for b in self.owned
                                           for s, m_AB in zip(b.index_k.tolist(), b.momentum_kAB)}
        return state

    def after_load(self, state: dict) -> None:
        self.adamw.after_load(state)
