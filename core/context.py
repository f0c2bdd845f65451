"""How a sequence is split and gathered over context parallelism (cp), model-agnostic (AGENTS.md's design): chunks
r and 2*cp-1-r to cp rank r (`split_for_cp`). A layer that needs the whole sequence all-gathers it in global order
(`gather_sequence`, `gather_kv`), backward reduce-scatters; cp = 1 skips the collective. Every cp rank reads the whole
sequence before splitting it, so document ids and starts (`doc_ids_from_eos`, `document_starts`) cost nothing.

Legend: B batch, S local sequence (= K / cp), K whole sequence, G key/value heads, D / E head dims of k / v.
"""

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------------------- sequence split


def _check_seq_len(seq_len: int, cp_size: int) -> int:
    """Length of one of the 2*cp chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp_size} (context parallelism "
                         f"cuts it into 2*cp chunks); make --seq-len a multiple of {2 * cp_size} or change --cp")
    return seq_len // (2 * cp_size)


def split_for_cp(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor (token ids, labels, position ids, doc ids, ...): chunks
    cp_rank and 2*cp_size-1-cp_rank of the 2*cp_size along `dim`, in that order."""
    assert 0 <= cp_rank < cp_size
    c = _check_seq_len(x.shape[dim], cp_size)
    return torch.cat([x.narrow(dim, cp_rank * c, c), x.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)], dim)


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions [S] of this rank's tokens (for rope and the mask): split_for_cp of arange(seq_len); any
    length at cp = 1 (a sliding window or documents without cp)."""
    positions = torch.arange(seq_len, device=device)
    return positions if cp_size == 1 else split_for_cp(positions, cp_rank, cp_size, dim=0)


def _global_order(parts: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """Rank r's part holds chunks (r, 2cp-1-r): first halves in rank order, then second halves reversed."""
    halves = [p.chunk(2, dim) for p in parts]
    return [h[0] for h in halves] + [h[1] for h in reversed(halves)]


def merge_from_cp(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of split_for_cp: the whole sequence from every rank's part (given in cp rank order)."""
    return torch.cat(_global_order(parts, dim), dim)


# ------------------------------------------------------------------------------------------ the gather


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the cp ranks' parts in global order. Backward: each rank's gradient covers the whole
    sequence; a chunk's owner needs the sum over ranks: a reduce-scatter (gloo has it too on torch 2.13)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(_global_order(parts, dim), dim)

    @staticmethod
    def backward(ctx, grad):
        cp = dist.get_world_size(ctx.group)
        chunks = grad.chunk(2 * cp, ctx.dim)
        owned = [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], ctx.dim) for r in range(cp)]  # rank r's gradient
        out = torch.empty_like(owned[0])
        dist.reduce_scatter(out, owned, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


def gather_sequence(x: torch.Tensor, cp_group=None, dim: int = 1) -> torch.Tensor:
    """The whole sequence, in global order, of a per-token tensor split with split_for_cp (any dtype; grads flow
    back to the owners). cp_group None (cp = 1): x itself."""
    return x if cp_group is None else _GatherSequence.apply(x, cp_group, dim)


def on_whole_sequence(fn, x: torch.Tensor, cp_group=None, dim: int = 1):
    """fn on whole sequences under cp, for a decision coupling a sequence's tokens (e.g. expert choice: top-C tokens
    by score). x: this rank's split_for_cp part of a per-token tensor; fn gets the gathered sequences (every cp rank
    computes the same) and returns a tensor or tuple, of which this rank's part (along dim) comes back: equal to one
    process's result under any cp, gradients flowing to every token's owner. cp_group None: fn(x)."""
    if cp_group is None:
        return fn(x)
    out = fn(gather_sequence(x, cp_group, dim))
    mine = lambda t: split_for_cp(t, dist.get_rank(cp_group), dist.get_world_size(cp_group), dim)
    return tuple(mine(t) for t in out) if isinstance(out, tuple) else mine(out)


def whole_sequence(x: torch.Tensor, seq_len: int, cp_group=None, dim: int = 1, what: str = "tensors") -> torch.Tensor:
    """x if it holds the whole sequence (seq_len positions along dim), else this rank's part gathered over cp_group
    (core/attention.py: K and V, and the per-token tensors of score and mask functions)."""
    if x.shape[dim] == seq_len:
        return x
    if cp_group is None or x.shape[dim] * dist.get_world_size(cp_group) != seq_len:
        raise ValueError(f"{what} hold {x.shape[dim]} positions but the mask covers {seq_len}: pass the cp group "
                         f"they are split over (cp_group), or {what} of the whole sequence")
    return gather_sequence(x, cp_group, dim)


def gather_kv(k_BGSD, v_BGSE, cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """K [B, G, K, D] and V [B, G, K, E] of the whole sequence from this rank's parts, in one all-gather. `attention`
    calls it; a variant that needs the whole keys first (e.g. to score key blocks) calls it and passes the result."""
    D = k_BGSD.shape[-1]
    kv_BGKX = gather_sequence(torch.cat([k_BGSD, v_BGSE], -1), cp_group, dim=2)
    return kv_BGKX[..., :D], kv_BGKX[..., D:]


# MLA (recipes/deepseek_v2_lite/model.py) gathers its latent + rope key (512 + 64 per token) and expands them on every
# cp rank (a matmul small next to attention; its weight gradient partial per rank, summed with the dense gradients).


# ------------------------------------------------------------------------------------------- documents


def document_starts(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: token t starts a new document (its id differs from token t-1's); token 0 never does, so an
    initial state passed with the row reaches its first document."""
    reset_BS = torch.zeros(doc_ids_BS.shape, dtype=torch.bool, device=doc_ids_BS.device)
    reset_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    return reset_BS


def doc_ids_from_eos(input_ids_BK: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index [B, K] of each token of packed sequences, each document ended by (and holding) eos."""
    is_eos = (input_ids_BK == eos_id).long()
    return is_eos.cumsum(1) - is_eos
