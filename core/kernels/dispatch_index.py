"""Index kernels of expert dispatch: group (row, slot) pairs by expert, stably, by a counting sort.

Legend: N = Q*k flattened (row, slot) pairs, Q rows (tokens, or rows received by an all-to-all), k slots per
row, E experts (local to this rank), R pairs kept (id >= 0), NB blocks of BLOCK pairs. group_by_expert(ids_Qk, E)
-> order_R, counts_E (ids < 0 skipped; order stable, the reference's argsort): x[order // k] grouped by expert, for
a plain MoE layer (ids = topk_ids) or the receiver of the deduplicated all-to-all (local ids, -1 for elsewhere).

Triton path (CUDA, or TRITON_INTERPRET=1): per-block histograms hist[NB, E], exclusive cumsums for each (block,
expert)'s first slot, then each block writes its pairs at base + rank among its earlier equal ids (no atomics:
deterministic). R sizes the output: `num_kept` when the caller knows it (core/moe.py), else one host sync.
"""

import os

import torch
import triton
import triton.language as tl

BLOCK = 64  # pairs per program; the rank step compares [BLOCK, BLOCK] ids


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many of `ids` (any shape) name each expert in [0, E), others not counted. No host sync (unlike
    torch.bincount on CUDA)."""
    flat_N = ids.reshape(-1).long()
    slot_N = torch.where((flat_N >= 0) & (flat_N < num_experts), flat_N, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, slot_N, torch.ones_like(slot_N))[:num_experts]


def group_by_expert_ref(ids: torch.Tensor, num_experts: int, num_kept: int | None = None):
    flat_N = ids.reshape(-1)
    keep_N = flat_N >= 0
    R = int(keep_N.sum()) if num_kept is None else num_kept
    order_R = torch.argsort(torch.where(keep_N, flat_N, num_experts), stable=True)[:R]
    return order_R, expert_counts(flat_N, num_experts)


@triton.jit
def _hist_kernel(ids_ptr, hist_ptr, N, E, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    experts = tl.arange(0, E_PAD)
    counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # [E_PAD]; ids < 0 match nothing
    tl.store(hist_ptr + b * E + experts, counts, mask=experts < E)


@triton.jit
def _scatter_kernel(ids_ptr, base_ptr, order_ptr, N, E, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    offs = b * BLOCK + i
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    keep = ids >= 0
    # rank of pair i among the pairs j < i of this block with the same expert (keeps the sort stable)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    base = tl.load(base_ptr + b * E + tl.where(keep, ids, 0), mask=keep, other=0)  # first slot of (block, expert)
    tl.store(order_ptr + base + rank, offs.to(tl.int64), mask=keep)


def group_by_expert(ids: torch.Tensor, num_experts: int, num_kept: int | None = None):
    """ids [Q, k] (or any shape) expert ids in [0, E), or < 0 for 'not here' -> (order [R] int64: flat indices of
    the kept pairs grouped by expert, stable; counts [E] int64: pairs per expert). num_kept: R, when the caller
    knows it (then no host sync, and the ids are trusted to be < E)."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"group_by_expert: ids must be int64 or int32, got {ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"group_by_expert: num_experts must be >= 1, got {num_experts}")
    E, flat_N = num_experts, ids.reshape(-1).contiguous()
    N = flat_N.numel()
    if not (ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        if num_kept is None and N and int(flat_N.max()) >= E:
            raise ValueError(f"group_by_expert: expert id {int(flat_N.max())} is out of range for {E} experts")
        return group_by_expert_ref(ids, E, num_kept)
    NB = triton.cdiv(N, BLOCK)
    hist_BE = torch.zeros(NB, E, dtype=torch.int32, device=ids.device)
    if NB:
        _hist_kernel[(NB,)](flat_N, hist_BE, N, E, BLOCK=BLOCK, E_PAD=triton.next_power_of_2(E))
    counts_E = hist_BE.sum(0, dtype=torch.int64)
    if num_kept is None:
        R, kept = torch.stack([counts_E.sum(), (flat_N >= 0).sum()]).tolist()  # the one host sync
        if R != kept:
            raise ValueError(f"group_by_expert: {kept - R} expert ids are >= num_experts={E}")
    else:
        R = num_kept
    order_R = torch.empty(R, dtype=torch.int64, device=ids.device)
    if R:
        # slot of the first pair of (block b, expert e): pairs of all experts < e, then of expert e in blocks < b
        hist64 = hist_BE.to(torch.int64)
        base_BE = (counts_E.cumsum(0) - counts_E) + (hist64.cumsum(0) - hist64)
        _scatter_kernel[(NB,)](flat_N, base_BE, order_R, N, E, BLOCK=BLOCK)
    return order_R, counts_E
