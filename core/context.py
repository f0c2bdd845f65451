"""Context parallelism (CP): the cp ranks of a group share one sequence, each keeps 2 of its 2*cp chunks,
gathers every key/value of the sequence and attends with its own queries. Model-agnostic.

Load balance: the sequence is cut into 2*cp chunks and cp rank r keeps chunks r and 2*cp-1-r, so every rank
holds one early chunk (few visible keys under the causal mask) and one late chunk (many): equal work per rank.

What travels is whatever the model passes to `gather_sequence`: K and V side by side for GQA models (one
collective per layer), the compressed latent + shared rope key for MLA (576 numbers per token for
DeepSeek-V2-Lite instead of 5120), expanded afterwards on every rank. Backward hands each rank the sum of all
ranks' gradients for its own chunks (a reduce-scatter): on gloo and nccl alike `dist.reduce_scatter`.

Masks are built from global positions, once per forward and reused by every layer: causal (key j visible from
query i iff j <= i), optional sliding window (i - window < j <= i, GPT-OSS) and optional document boundaries of
packed sequences (same document only). Attention sinks (GPT-OSS: one logit per head in the softmax denominator,
with no value) are applied over the gathered keys. World size / cp = 1 runs the same code, collective skipped.

Legend: B batch, S local sequence (this rank's queries, = K / cp), K whole sequence (gathered keys), N query
heads, G key/value heads, n = N / G query heads per kv head, D head dim of q and k, E head dim of v,
C numbers per token of an MLA latent.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
    """Global positions [S] of this rank's tokens (for rope and the mask): split_for_cp of arange(seq_len)."""
    return split_for_cp(torch.arange(seq_len, device=device), cp_rank, cp_size, dim=0)


def _global_order(parts: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """Rank r's part holds chunks (r, 2cp-1-r): first halves in rank order, then second halves reversed."""
    halves = [p.chunk(2, dim) for p in parts]
    return [h[0] for h in halves] + [h[1] for h in reversed(halves)]


def merge_from_cp(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of split_for_cp: the whole sequence from every rank's part (given in cp rank order)."""
    return torch.cat(_global_order(parts, dim), dim)


# ------------------------------------------------------------------------------------------ the gather


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the cp ranks' parts, lay them out in global order. Backward: every rank holds a
    gradient for the whole sequence (its queries looked at all keys); the owner of a chunk needs the sum over
    ranks, so cut the gradient back into per-owner parts and reduce-scatter them. gloo has reduce_scatter
    (checked on torch 2.13), so CPU and GPU run the same two collectives."""

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


# ------------------------------------------------------------------------------------------------ masks


def attention_mask(q_pos_S, k_pos_K, window: int | None = None, q_doc_BS=None, k_doc_BK=None) -> torch.Tensor:
    """Boolean [B or 1, S, K], True where query i may see key j: j <= i, i - window < j (if window), and
    the same document (if doc ids are given)."""
    i, j = q_pos_S[:, None], k_pos_K[None, :]
    mask_SK = j <= i
    if window is not None:
        mask_SK = mask_SK & (j > i - window)
    if q_doc_BS is None:
        return mask_SK[None]
    return mask_SK & (q_doc_BS[:, :, None] == k_doc_BK[:, None, :])


def cp_attention_mask(seq_len: int, cp_rank: int = 0, cp_size: int = 1, window: int | None = None,
                      doc_ids_BK=None, device=None) -> torch.Tensor | None:
    """The mask of this rank's queries over the whole (gathered) sequence of length seq_len.

    doc_ids_BK are the document ids of the WHOLE sequence: every cp rank reads the whole sequence before it
    splits it, so they are known locally and cost no communication (see doc_ids_from_eos). Positions are not
    used for this because they run on across documents here (global positions for rope).
    Returns None for plain causal attention without cp: attend then takes SDPA's is_causal path."""
    if cp_size == 1 and window is None and doc_ids_BK is None:
        return None
    device = device if doc_ids_BK is None else doc_ids_BK.device
    q_pos_S, k_pos_K = cp_positions(seq_len, cp_rank, cp_size, device), torch.arange(seq_len, device=device)
    q_doc_BS = None if doc_ids_BK is None else split_for_cp(doc_ids_BK, cp_rank, cp_size, dim=1)
    return attention_mask(q_pos_S, k_pos_K, window, q_doc_BS, doc_ids_BK)


def doc_ids_from_eos(input_ids_BK: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index [B, K] of each token of packed sequences, each document ended by eos (eos belongs to the
    document it ends)."""
    is_eos = (input_ids_BK == eos_id).long()
    return is_eos.cumsum(1) - is_eos


# -------------------------------------------------------------------------------------------- attention


def attention_reference(q_BNSD, k_BGKD, v_BGKE, mask_BSK=None, scale=None, sinks_N=None) -> torch.Tensor:
    """Explicit attention (trains on CPU, any mask, sinks): logits in the input dtype, softmax in fp32 as
    transformers does. mask None = causal with queries and keys at the same positions. Returns [B, N, S, E]."""
    B, N, S, D = q_BNSD.shape
    G, K = k_BGKD.shape[1], k_BGKD.shape[2]
    if mask_BSK is None:
        assert S == K, "mask None means plain causal over the same positions"
        mask_BSK = torch.ones(S, K, dtype=torch.bool, device=q_BNSD.device).tril()[None]
    scale = D**-0.5 if scale is None else scale
    # GQA without copies: query head h uses kv head h // n (transformers' repeat_kv order)
    q_BGnSD = q_BNSD.view(B, G, N // G, S, D)
    logits_BGnSK = (q_BGnSD @ k_BGKD[:, :, None].transpose(-1, -2)) * scale
    logits_BGnSK = logits_BGnSK.float().masked_fill(~mask_BSK[:, None, None], float("-inf"))
    if sinks_N is not None:  # one more column per head: the sink logit, softmaxed with the keys, then dropped
        sink_BGnS1 = sinks_N.float().view(1, G, N // G, 1, 1).expand(B, G, N // G, S, 1)
        probs_BGnSK = torch.cat([logits_BGnSK, sink_BGnS1], -1).softmax(-1)[..., :-1]
    else:
        probs_BGnSK = logits_BGnSK.softmax(-1)
    out_BGnSE = probs_BGnSK.to(v_BGKE.dtype) @ v_BGKE[:, :, None]
    return out_BGnSE.reshape(B, N, S, v_BGKE.shape[-1])


def attend(q_BNSD, k_BGKD, v_BGKE, mask_BSK=None, scale=None, sinks_N=None) -> torch.Tensor:
    """Attention of local queries over (gathered) keys: SDPA (with is_causal when mask is None, else the boolean
    mask) where it applies, the explicit form when there are sinks. Returns [B, N, S, E]."""
    N, G = q_BNSD.shape[1], k_BGKD.shape[1]
    if N % G:
        raise ValueError(f"{N} query heads cannot share {G} key/value heads; num_attention_heads must be a "
                         f"multiple of num_key_value_heads")
    if sinks_N is not None:
        return attention_reference(q_BNSD, k_BGKD, v_BGKE, mask_BSK, scale, sinks_N)
    attn_mask = None if mask_BSK is None else mask_BSK[:, None]  # broadcast over heads
    return F.scaled_dot_product_attention(q_BNSD, k_BGKD, v_BGKE, attn_mask=attn_mask, is_causal=mask_BSK is None,
                                          scale=scale, enable_gqa=N != G)


def cp_attention(q_BNSD, k_BGSD, v_BGSE, mask_BSK=None, cp_group=None, scale=None, sinks_N=None) -> torch.Tensor:
    """Context-parallel attention: gather K and V of the whole sequence (one collective, K and V side by side),
    attend with this rank's queries under mask_BSK from cp_attention_mask. Returns [B, N, S, E]."""
    D = k_BGSD.shape[-1]
    kv_BGKX = gather_sequence(torch.cat([k_BGSD, v_BGSE], -1), cp_group, dim=2)
    k_BGKD, v_BGKE = kv_BGKX[..., :D], kv_BGKX[..., D:]
    return attend(q_BNSD, k_BGKD, v_BGKE, mask_BSK, scale, sinks_N)


# MLA (DeepSeek-V2): gather the latent instead of the expanded K/V, then expand on every rank:
#   latent_BKC = gather_sequence(torch.cat([c_kv_BSC, k_rope_BSR], -1), cp_group, dim=1)   # 512 + 64 per token
#   k_nope, v = kv_b_proj(kv_a_layernorm(latent[..., :512])) ...; k = cat(k_nope, k_rope broadcast over heads)
#   out = attend(q_BNSD, k_BNKD, v_BNKE, mask_BSK, scale)
# The expansion of the whole sequence is repeated on each cp rank (a [K, 512] x [512, N*(128+128)] matmul, small
# next to attention); its weight gradient is partial per rank and summed with the other dense gradients.


# ------------------------------------------------------------------------------------- communication


def cp_bytes_received_per_layer(seq_len: int, cp: int, numbers_per_token: int, bytes_per_element: int = 2) -> int:
    """Bytes one cp rank receives per layer in forward: the other ranks' (cp-1)/cp of the sequence, each token
    carrying numbers_per_token values (G * (D + E) for K and V, or the MLA latent width). Backward's
    reduce-scatter sends the same amount back."""
    _check_seq_len(seq_len, cp)
    return (cp - 1) * (seq_len // cp) * numbers_per_token * bytes_per_element


def print_cp_bytes_table(seq_len: int = 32768, cps=(2, 4, 8), bytes_per_element: int = 2) -> None:
    models = [  # (name, numbers gathered per token per layer)
        ("Qwen3-30B-A3B     K,V: 4 x (128+128)", 4 * (128 + 128)),
        ("GPT-OSS-20B       K,V: 8 x (64+64)", 8 * (64 + 64)),
        ("DeepSeek-V2-Lite  K,V: 16 x (192+128)", 16 * (192 + 128)),
        ("DeepSeek-V2-Lite  latent: 512+64", 512 + 64),
    ]
    print(f"MiB received per cp rank per layer (forward), {seq_len} tokens, {8 * bytes_per_element}-bit")
    print(f"{'model / what is gathered':38s} {'numbers/token':>13s}" + "".join(f"{'cp=' + str(c):>10s}" for c in cps))
    for name, per_token in models:
        mib = [cp_bytes_received_per_layer(seq_len, c, per_token, bytes_per_element) / 2**20 for c in cps]
        print(f"{name:38s} {per_token:13d}" + "".join(f"{m:10.2f}" for m in mib))


if __name__ == "__main__":
    print_cp_bytes_table()
