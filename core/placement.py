"""Expert placement: which expert-parallel (ep) rank holds each routed expert, and at which local index.

A table over a model's E routed experts, shared by every MoE layer: `rank_of[e]` the ep rank holding expert e, rank
r's local experts `experts[r]` in ascending global id, `local_index[e]` e's place there; any number per rank, 0 too.

    Placement.even(6, 4)            ranks [0, 0, 1, 1, 2, 3]: contiguous, as even as possible (the default)
    Placement([0, 1, 0, 1, 1], 2)   rank 0 holds experts 0, 2 (local 0, 1); rank 1 holds 1, 3, 4
    Placement.parse("0,0,1,1,2,3", 6, 4)   the --expert-placement flag; "" is the even split
"""

import functools

import torch
import torch.distributed as dist


class Placement:
    def __init__(self, rank_of, ep: int):
        """rank_of: the ep rank of each routed expert (E ints in [0, ep)); a bad table raises a ValueError."""
        rank_of = list(rank_of)
        if ep < 1:
            raise ValueError(f"expert placement: ep must be >= 1, got {ep}")
        if not rank_of:
            raise ValueError("expert placement: the table is empty; give one ep rank per routed expert")
        for e, r in enumerate(rank_of):
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < ep:
                raise ValueError(f"expert placement: expert {e} is placed on rank {r!r}, which is not an ep rank "
                                 f"0..{ep - 1} (--ep {ep})")
        self.rank_of, self.ep, self.num_experts = tuple(rank_of), ep, len(rank_of)
        self.experts = tuple(tuple(e for e, r in enumerate(rank_of) if r == d) for d in range(ep))
        self.local_index = tuple(self.experts[r].index(e) for e, r in enumerate(rank_of))
        self._tables = {}  # device -> (rank_E, local_E) as int64 tensors

    @staticmethod
    @functools.cache
    def even(num_experts: int, ep: int) -> "Placement":
        """Contiguous blocks, as even as possible: the first E % ep ranks hold one expert more."""
        if num_experts < 1 or ep < 1:
            raise ValueError(f"expert placement: need >= 1 expert and ep >= 1, got {num_experts} experts, ep {ep}")
        sizes = [num_experts // ep + (d < num_experts % ep) for d in range(ep)]
        return Placement([d for d in range(ep) for _ in range(sizes[d])], ep)

    @staticmethod
    def parse(text: str, num_experts: int, ep: int) -> "Placement":
        """The --expert-placement flag: '' for the even split, else one ep rank per expert, comma-separated."""
        if not text.strip():
            return Placement.even(num_experts, ep)
        items = [s.strip() for s in text.strip().strip("[]").split(",")]
        if not all(s.lstrip("-").isdigit() for s in items):
            raise ValueError(f"--expert-placement {text!r} must be comma-separated ep ranks, one per routed expert "
                             f"(e.g. 0,0,1,1,2,3 for 6 experts over --ep 4)")
        placement = Placement([int(s) for s in items], ep)
        placement.check(num_experts, ep)
        return placement

    def check(self, num_experts: int, ep: int) -> None:
        """One line if this table does not fit a model of num_experts routed experts over ep ranks."""
        if self.num_experts != num_experts:
            raise ValueError(f"expert placement lists {self.num_experts} experts but the model has {num_experts} "
                             f"routed experts; give one ep rank per expert")
        if self.ep != ep:
            raise ValueError(f"expert placement is for ep={self.ep} but the run has --ep {ep}")

    @property
    def max_local(self) -> int:
        """Experts on the most loaded rank (what its memory holds)."""
        return max(len(x) for x in self.experts)

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank_E, local_E): rank_of and local_index as int64 tensors on `device` (made once per device)."""
        key = torch.device(device)
        if key not in self._tables:
            self._tables[key] = (torch.tensor(self.rank_of, device=key), torch.tensor(self.local_index, device=key))
        return self._tables[key]

    def __eq__(self, other):
        return isinstance(other, Placement) and (self.rank_of, self.ep) == (other.rank_of, other.ep)

    def __hash__(self):
        return hash((self.rank_of, self.ep))

    def __repr__(self):
        return f"Placement({list(self.rank_of)}, ep={self.ep})"


def gather_experts(local_LX: torch.Tensor, placement: Placement, group, dst: int) -> torch.Tensor | None:
    """Collective over the ep group: every rank's local experts [L_rank, ...] into one [E, ...] tensor in global
    order on ep rank `dst` (None on the others); each sends its rows padded to the largest count."""
    if group is None:
        return local_LX
    me, pad = dist.get_rank(group), placement.max_local
    send = local_LX.new_zeros(pad, *local_LX.shape[1:])
    send[: local_LX.shape[0]] = local_LX
    parts = [torch.empty_like(send) for _ in range(placement.ep)] if me == dst else None
    dist.gather(send, parts, dst=dist.get_global_rank(group, dst), group=group)
    if me != dst:
        return None
    full = local_LX.new_empty(placement.num_experts, *local_LX.shape[1:])
    for rank, ids in enumerate(placement.experts):
        full[list(ids)] = parts[rank][: len(ids)]
    return full
