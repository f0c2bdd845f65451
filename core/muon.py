"""Muon for the weight matrices, AdamW (core/fsdp.py:FSDPAdamW) for every other parameter, on FSDP2's shards (one
process: on plain tensors), exact in every layout.

Muon (Moonlight's variant: torch.optim.Muon, adjust_lr_fn="match_rms_adamw") updates W (A x B) from its gradient G:

    M <- mu M + (1 - mu) G                          momentum (mu 0.95), kept in fp32; torch.optim.Muon's lerp form
    U <- (1 - mu) G + mu M                          Nesterov
    O <- NS5(U / ||U||_F)                           5 quintic Newton-Schulz steps (3.4445, -4.7750, 2.0315): ~U V^T
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O   decoupled weight decay; the update's RMS matched to AdamW's

so one learning rate and schedule serve both groups (matrices: `ParamRule.muon`). Which rank owns a matrix, how its
rows move (`assign_owners`, two all-to-alls per bucket), precisions and batching: README "Muon". An owner checkpoints
each matrix's momentum as `muon_momentum.<parameter name>[.<kind>][.expert<global id>]`.

Tensor names: S matrices stacked (the experts of one parameter, or 1), k of them in one entry, A x B a matrix.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from core.fsdp import FSDPAdamW, local_rows
from core.training import parameter_rules

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


def assign_owners(costs: list[int], load: list[int]) -> list[int]:
    """Owner of each cost: largest first (ties in list order), to the least-loaded rank (ties: the lowest), `load`
    (each rank's FLOPs so far) updated in place."""
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(range(len(load)), key=lambda r: load[r])
        load[owners[i]] += costs[i]
    return owners


def matrix_rows(name: str, kind: str, view_SAB: torch.Tensor, s: int, row: int) -> tuple[int, int]:
    """Dim-0 rows [first, last) of its parameter (`row` elements each) that matrix s of a [S, A, B] view covers;
    ValueError for a matrix covering part of several rows (FSDP2 shards whole rows)."""
    start = view_SAB.storage_offset() + s * view_SAB.stride(0)
    end = start + sum((n - 1) * st for n, st in zip(view_SAB.shape[1:], view_SAB.stride()[1:])) + 1
    first, last = start // row, (end - 1) // row + 1
    if last - first > 1 and (start % row or end % row or math.prod(view_SAB.shape[1:]) != end - start):
        raise ValueError(f"--optimizer muon: matrix {s} ({kind or 'whole'}) of {name} {tuple(view_SAB.shape[1:])} covers "
                         f"part of several dim-0 rows, which FSDP2 shards whole; declare it in Model.parameter_rules "
                         f"as whole rows (store the weight transposed, or split a fused weight along dim 0)")
    return first, last


@dataclass
class _Matrices:
    """k matrices of one kind of one parameter with one owner: as_strided(size, stride, offset) of the parameter's
    flattened elements. The owner keeps their momentum; the holders of their rows apply the update."""
    name: str
    keys: list[str]  # checkpoint key of each matrix
    size: tuple[int, int, int]  # (k, A, B)
    stride: tuple[int, int, int]
    offset: int  # flat element of the first matrix in the whole parameter
    rows: tuple[int, int]  # the dim-0 rows [first, last) they cover
    row: int  # elements per dim-0 row of the parameter
    chunk: int  # dim-0 rows per shard: rank r of the shard group holds rows [r chunk, (r + 1) chunk)
    owner: int  # rank in the parameter's shard group
    momentum_kAB: torch.Tensor | None = None  # fp32, owner only
    parts: list[tuple[int, int]] = field(default_factory=list)  # spanning ranks, owner: (offset, length) of its rows
    # in the bucket's received elements, source by source

    def alpha(self, lr: float) -> float:
        return -lr * RMS_MATCH * math.sqrt(max(self.size[1:]))

    def held(self, r: int) -> tuple[int, int]:
        """The rows of these matrices that rank r holds (empty: lo >= hi)."""
        return max(self.rows[0], r * self.chunk), min(self.rows[1], (r + 1) * self.chunk)

    def of(self, rows: torch.Tensor) -> torch.Tensor:
        """The [k, A, B] view of rows [first, last) of the parameter, flattened (a spanning matrix's, assembled)."""
        return rows.as_strided(self.size, self.stride, rows.storage_offset() + self.offset - self.rows[0] * self.row)


def _key(name: str, kind: str, ids: list[int] | None, s: int) -> str:
    return name + (f".{kind}" if kind else "") + (f".expert{ids[s]}" if ids else "")


@dataclass
class _Bucket:
    """Matrices spanning the ranks of one shard group, moved by one all-to-all each way."""
    group: object  # ProcessGroup of the shard group, or None (one rank)
    owned: list[_Matrices]  # those this rank owns
    send: list[tuple[_Matrices, int, int]]  # this rank's rows of each matrix (local flat range), by destination
    send_splits: list[int]
    recv_splits: list[int]


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    if group is None:
        return x
    out = x.new_empty(sum(out_splits))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class MuonAdamW(FSDPAdamW):
    """Muon on `split`'s matrices, FSDPAdamW (same calls) on the rest; one lr, scheduled via `self.optimizer`."""

    def __init__(self, model, units, lr: float, weight_decay: float, betas, eps: float, momentum: float = 0.95,
                 norm_group=None, once: bool = False, ns_dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20):
        """Muon on each parameter's ParamRule.muon matrices (views of a meta tensor of its shape). ns_dtype: default
        bf16 on GPU, fp32 on CPU."""
        params = dict(model.named_parameters())
        self.views = {n: rule.muon for n, rule in parameter_rules(model).items() if rule.muon}
        super().__init__(model, units, lr, weight_decay, betas, eps, norm_group, once, skip=self.views)
        self.momentum, self.weight_decay, self.buckets = momentum, weight_decay, []
        self.device = device = next(iter(self.local.values())).device
        self.ns_dtype = ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.owned, spanning = [], {}  # spanning: shard group's ranks -> (group, n, [matrix])
        for name, kinds in self.views.items():
            p = params[name]
            assert p.dtype == torch.float32 and self.local[name].is_contiguous(), name
            n, rank, _ = local_rows(p)
            chunk, row = math.ceil(p.shape[0] / n), p.numel() // p.shape[0]
            group = p.device_mesh.get_group() if n > 1 else None
            for kind, (v_SAB, ids) in kinds.items():
                mine = []  # (s, row) of the matrices inside one of this rank's rows
                for i in range(v_SAB.shape[0]):
                    first, last = matrix_rows(name, kind, v_SAB, i, row)
                    if last - first > 1:
                        ranks = tuple(p.device_mesh.mesh.flatten().tolist()) if n > 1 else ()
                        spanning.setdefault(ranks, (group, n, []))[2].append(_Matrices(
                            name, [_key(name, kind, ids, i)], (1, *v_SAB.shape[1:]), v_SAB.stride(),
                            v_SAB.storage_offset() + i * v_SAB.stride(0), (first, last), row, chunk, -1))
                    elif first // chunk == rank:
                        mine.append((i, first))
                runs = [[x] for x in mine[:1]]  # consecutive matrices: one strided view each run
                for x in mine[1:]:
                    runs[-1].append(x) if x[0] == runs[-1][-1][0] + 1 else runs.append([x])
                self.owned += [_Matrices(name, [_key(name, kind, ids, i) for i, _ in run], (len(run), *v_SAB.shape[1:]),
                                         v_SAB.stride(), v_SAB.storage_offset() + run[0][0] * v_SAB.stride(0),
                                         (run[0][1], run[-1][1] + 1), row, chunk, rank) for run in runs]
        mine_flops = sum(newton_schulz_flops(*m.size[1:]) * m.size[0] for m in self.owned)
        for group, n, found in spanning.values():
            load = [mine_flops] * n
            if group is not None:  # every rank's FLOPs in its own rows (its experts: they differ per ep rank)
                gathered = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(n)]
                dist.all_gather(gathered, torch.tensor(mine_flops, device=device), group=group)
                load = [int(t) for t in gathered]
            for m, owner in zip(found, assign_owners([newton_schulz_flops(*m.size[1:]) for m in found], load)):
                m.owner = owner
            self._plan_buckets(group, n, found, bucket_bytes)
        for m in self.owned:
            m.momentum_kAB = torch.zeros(m.size, dtype=torch.float32, device=device)

    def _plan_buckets(self, group, n: int, matrices: list[_Matrices], bucket_bytes: int) -> None:
        """Buckets of at most bucket_bytes of fp32 matrices (at least one), each rank's rows of a matrix sent to its
        owner: send laid out destination by destination, receive source by source, matrices in bucket order."""
        rank = 0 if group is None else dist.get_rank(group)
        buckets = []
        for m in matrices:
            if not buckets or 4 * sum(math.prod(x.size) for x in buckets[-1]) + 4 * math.prod(m.size) > bucket_bytes:
                buckets.append([])
            buckets[-1].append(m)
        for bucket in buckets:
            send, send_splits, recv_splits, received = [], [0] * n, [0] * n, 0
            for r in range(n):
                for m in bucket:
                    lo, hi = m.held(rank)
                    if m.owner == r and lo < hi:  # this rank's rows of m, to its owner r
                        send.append((m, (lo - rank * m.chunk) * m.row, (hi - rank * m.chunk) * m.row))
                        send_splits[r] += (hi - lo) * m.row
                    lo, hi = m.held(r)
                    if m.owner == rank and lo < hi:  # rank r's rows of m, to this rank
                        m.parts.append((received, (hi - lo) * m.row))
                        received += (hi - lo) * m.row
                        recv_splits[r] += (hi - lo) * m.row
            owned = [m for m in bucket if m.owner == rank]
            self.buckets.append(_Bucket(group, owned, send, send_splits, recv_splits))
            self.owned += owned

    def describe(self) -> str:
        """Which parameters go to which optimizer (names with layer numbers as *), for the start-up line."""
        def names(params):
            return sorted({".".join("*" if part.isdigit() else part for part in n.split(".")) for n in params})
        matrices = sum(v_SAB.shape[0] for kinds in self.views.values() for v_SAB, _ in kinds.values())
        return (f"muon: {matrices} matrices in {len(self.views)} tensors ({', '.join(names(self.views))}) | "
                f"adamw: {len(self.adamw)} tensors ({', '.join(names(self.adamw))})")

    # ------------------------------------------------------------------------------------------- the step

    def _view(self, t: torch.Tensor, m: _Matrices) -> torch.Tensor:
        """Matrices m (inside this rank's rows) in t: the local shard of their parameter or its gradient."""
        return t.as_strided(m.size, m.stride, t.storage_offset() + m.offset - m.owner * m.chunk * m.row)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on its shards; Muon on the owned matrices (a spanning one's gradient rows gathered to its owner),
        batched by shape; each update applied where its rows are (a spanning one's sent back)."""
        self.optimizer.step()
        lr, mu, decay = self.param_groups[0]["lr"], self.momentum, 1 - self.param_groups[0]["lr"] * self.weight_decay
        grads = {id(m): self._view(self.local[m.name].grad, m) for m in self.owned if not m.parts}
        received = []
        for b in self.buckets:  # gradient rows to the owners
            send = [self.local[m.name].grad.view(-1)[lo:hi] for m, lo, hi in b.send]
            recv = _all_to_all(torch.cat(send) if send else torch.zeros(0, device=self.device), b.recv_splits,
                               b.send_splits, b.group)
            received.append(recv)
            for m in b.owned:
                grads[id(m)] = m.of(torch.cat([recv[o: o + n] for o, n in m.parts]))
        by_shape, updates = {}, {}  # (A, B) -> owned matrices of that shape: one batched Newton-Schulz each
        for m in self.owned:
            m.momentum_kAB.lerp_(grads[id(m)], 1 - mu)
            by_shape.setdefault(m.size[1:], []).append(m)
        for blocks in by_shape.values():
            u_kAB = torch.cat([grads[id(m)].lerp(m.momentum_kAB, mu) for m in blocks])  # Nesterov
            for m, o_kAB in zip(blocks, newton_schulz(u_kAB, self.ns_dtype).split([m.size[0] for m in blocks])):
                updates[id(m)] = o_kAB
                if not m.parts:  # in this rank's rows
                    self._view(self.local[m.name], m).mul_(decay).add_(o_kAB, alpha=m.alpha(lr))
        for b, recv in zip(self.buckets, received):  # update rows back to their holders
            back = torch.empty_like(recv)
            for m in b.owned:
                rows = torch.empty(sum(n for _, n in m.parts), device=back.device)  # (covered exactly)
                m.of(rows).copy_(updates[id(m)])
                for (o, n), piece in zip(m.parts, rows.split([n for _, n in m.parts])):
                    back[o: o + n] = piece
            mine = _all_to_all(back, b.send_splits, b.recv_splits, b.group)
            for (m, lo, hi), o in zip(b.send, mine.split([hi - lo for _, lo, hi in b.send])):
                self.local[m.name].view(-1)[lo:hi].mul_(decay).add_(o, alpha=m.alpha(lr))
        self.gather()

    def state_bytes(self) -> tuple[int, int]:
        """(bytes of optimizer state on this rank, bytes unsharded): AdamW's moments plus the owned momentum."""
        held, full = super().state_bytes()
        return (held + sum(4 * m.momentum_kAB.numel() for m in self.owned),
                full + sum(4 * self.params[n].numel() for n in self.views))

    @torch.no_grad()
    def reinit_(self, name: str, index: int | slice, values: torch.Tensor | None = None) -> None:
        """FSDPAdamW.reinit_'s contract: param[index] = values, that part's Adam moments or Muon momentum reset."""
        if name not in self.views:
            return super().reinit_(name, index, values)  # (its error lists the parameters for an unknown name)
        first, last, _ = self._rows(name, index, values)
        reset = torch.zeros(self.params[name].shape, dtype=torch.bool)
        reset[first:last] = True
        for m in self.owned:
            if m.name == name:
                m.momentum_kAB[reset.view(-1).as_strided(m.size, m.stride, m.offset).to(m.momentum_kAB.device)] = 0

    def checkpoint_state(self, model=None) -> dict:
        """FSDPAdamW's state + optim.muon_momentum: the owned momenta as [A, B] views (loaded in place)."""
        state = super().checkpoint_state()
        state["optim"]["muon_momentum"] = {k: m_AB for m in self.owned for k, m_AB in zip(m.keys, m.momentum_kAB)}
        return state
