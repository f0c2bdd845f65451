"""Attention, model-agnostic: every recipe calls `attention` (end of the file), whose table says which kernel runs.

Masks come from global positions, once per forward for every layer (`cp_attention_mask` -> a `CPMask`): causal, sliding
window (GPT-OSS), packed documents (`attention_mask`); GPT-OSS's sinks (`sink_rescale`) apply over the gathered keys.

On CUDA flex_attention (compiled) reads the CPMask as a BlockMask (empty key blocks skipped, full ones unmasked):
O(S + K) memory per head plus an int32 [S/128, K/128] block table, not the [B, N, S, K] fp32 scores of SDPA's math
kernel (used for a boolean mask with GQA). Elsewhere a dense boolean [B, S, K] (SDPA or `attention_reference`): flex has
no CPU backward (torch 2.13). Not per-chunk SDPA merged by log-sum-exp: public SDPA returns none, and window or document
blocks need a mask. A per-head mask (block selection) adds a head dimension: unselected tiles are never loaded.

Legend: B batch, S local sequence (this rank's queries, = K / cp), K whole sequence (gathered keys), N query heads, G
key/value heads, n = N / G query heads per kv head, D head dim of q and k, E head dim of v.
"""

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.context import cp_positions, gather_kv, split_for_cp
from core.precision import upcast

# ------------------------------------------------------------------------------------------------ masks


def attention_mask(q_pos_S, k_pos_K, window: int | None = None, q_doc_BS=None, k_doc_BK=None) -> torch.Tensor:
    """Boolean [B or 1, S, K], True where query i sees key j: j <= i, i - window < j, the same document."""
    i, j = q_pos_S[:, None], k_pos_K[None, :]
    mask_SK = j <= i
    if window is not None:
        mask_SK = mask_SK & (j > i - window)
    if q_doc_BS is None:
        return mask_SK[None]
    return mask_SK & (q_doc_BS[:, :, None] == k_doc_BK[:, None, :])


@dataclass(eq=False)
class CPMask:
    """Which of the K gathered keys (positions 0..K-1) this rank's queries see: dense() (reference) and block_mask()
    (flex), both cached. select_BNQJ (with_selection): per (batch, query head, `select_block` local queries) the key
    blocks it may attend, the rule applying within them; select_block 1: a per-head mask [B, N, S, K]."""

    q_pos_S: torch.Tensor  # global positions of this rank's queries
    seq_len: int  # K
    window: int | None = None
    q_doc_BS: torch.Tensor | None = None  # document ids of this rank's queries / of the whole sequence
    k_doc_BK: torch.Tensor | None = None
    select_BNQJ: torch.Tensor | None = None  # bool [B, N, ceil(S/select_block), ceil(K/select_block)]
    select_block: int = 1
    _cache: dict = field(default_factory=dict, repr=False)

    def with_selection(self, select_BNQJ: torch.Tensor, block: int, batch: int, heads: int) -> "CPMask":
        """This mask restricted to a per-head block selection (bool [B or 1, N or 1, Q, J], broadcast here to
        [batch, heads, Q, J] as a view); a new CPMask with its own cache (the selection changes every layer)."""
        S, K = self.q_pos_S.numel(), self.seq_len
        want = (-(-S // block), -(-K // block))
        if select_BNQJ.dtype != torch.bool or select_BNQJ.dim() != 4 or tuple(select_BNQJ.shape[2:]) != want \
                or select_BNQJ.shape[0] not in (1, batch) or select_BNQJ.shape[1] not in (1, heads):
            raise ValueError(f"a block selection must be bool [B or 1, N or 1, ceil(S/block), ceil(K/block)] = "
                             f"[{batch}, {heads}, {want[0]}, {want[1]}] for {S} queries over {K} keys in blocks of "
                             f"{block}; got {select_BNQJ.dtype} {list(select_BNQJ.shape)} (index form: "
                             f"core.attention.select_from_indices)")
        return replace(self, select_BNQJ=select_BNQJ.expand(batch, heads, -1, -1), select_block=block, _cache={})

    def dense(self) -> torch.Tensor:
        """Boolean [B or 1, S, K], or [B, N, S, K] with a selection."""
        if "dense" not in self._cache:
            k_pos_K = torch.arange(self.seq_len, device=self.q_pos_S.device)
            mask = attention_mask(self.q_pos_S, k_pos_K, self.window, self.q_doc_BS, self.k_doc_BK)
            if self.select_BNQJ is not None:  # each selection cell over its block x block (query, key) pairs
                S, K, bs = self.q_pos_S.numel(), self.seq_len, self.select_block
                sel_BNSK = self.select_BNQJ.repeat_interleave(bs, 2)[:, :, :S].repeat_interleave(bs, 3)[..., :K]
                mask = mask[:, None] & sel_BNSK
            self._cache["dense"] = mask
        return self._cache["dense"]

    def mask_mod(self):
        """flex_attention's mask function: the rule of dense(), one (query, key) index pair at a time (a closure
        over tensors, which torch.compile takes as graph inputs: a new mask does not recompile)."""
        q_pos_S, window, q_doc_BS, k_doc_BK = self.q_pos_S, self.window, self.q_doc_BS, self.k_doc_BK
        select_BNQJ, bs = self.select_BNQJ, self.select_block

        def visible(b, h, q_idx, kv_idx):
            i = q_pos_S[q_idx]
            ok = kv_idx <= i
            if window is not None:
                ok = ok & (kv_idx > i - window)
            if q_doc_BS is not None:
                ok = ok & (q_doc_BS[b, q_idx] == k_doc_BK[b, kv_idx])
            if select_BNQJ is not None:
                ok = ok & select_BNQJ[b, h, q_idx // bs, kv_idx // bs]
            return ok

        return visible

    def _selection_blocks(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(any, all) of the selection over each block x block tile: bool [B, N, ceil(S/block), ceil(K/block)]."""
        sel, bs = self.select_BNQJ, self.select_block
        Q, J = -(-self.q_pos_S.numel() // block), -(-self.seq_len // block)
        if bs % block == 0:  # a selection cell covers whole tiles
            sel = sel.repeat_interleave(bs // block, 2)[:, :, :Q].repeat_interleave(bs // block, 3)[..., :J]
            return sel, sel
        if block % bs:
            raise ValueError(f"select_block {bs} must divide the attention block {block} or be a multiple of it")
        r = block // bs  # a tile covers r x r cells; cells past the end: False for any, True for all (no pair)

        def pool(fill, reduce):
            pad = (0, J * r - sel.shape[3], 0, Q * r - sel.shape[2])
            cells = F.pad(sel, pad, value=fill).unflatten(3, (J, r)).unflatten(2, (Q, r))  # [B, N, Q, r, J, r]
            return reduce(reduce(cells, 5), 3)

        return pool(False, torch.any), pool(True, torch.all)

    def block_kinds(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full), bool [B or 1, N or 1, ceil(S/block), ceil(K/block)], from each block's extreme positions
        and document ids (and the selection's cells), never an [S, K] tensor, with no host sync. full: every pair
        visible (exact); partial: some pair may be visible and not full (a superset is harmless: mask_mod decides)."""
        S, K = self.q_pos_S.numel(), self.seq_len
        dev = self.q_pos_S.device

        def ranges(x_BL):  # per block of the last dim: min, max (the last block padded with its last value)
            pad = -x_BL.shape[-1] % block
            x_BL = torch.cat([x_BL, x_BL[..., -1:].expand(*x_BL.shape[:-1], pad)], -1).unflatten(-1, (-1, block))
            return x_BL.amin(-1), x_BL.amax(-1)

        def padded(length):  # [blocks]: reaches past the end; never full, so that the padding meets mask_mod
            return torch.arange(0, length, block, device=dev) + block > length

        q_lo, q_hi = ranges(self.q_pos_S.long())
        k_lo, k_hi = ranges(torch.arange(K, device=dev))
        q_lo, q_hi, k_lo, k_hi = q_lo[:, None], q_hi[:, None], k_lo[None], k_hi[None]
        any_QK, full_QK = k_lo <= q_hi, k_hi <= q_lo
        if self.window is not None:
            any_QK, full_QK = any_QK & (k_hi > q_lo - self.window), full_QK & (k_lo > q_hi - self.window)
        full_QK = full_QK & ~padded(S)[:, None] & ~padded(K)[None]
        any_BQK, full_BQK = any_QK[None], full_QK[None]
        if self.q_doc_BS is not None:
            dq_lo, dq_hi = ranges(self.q_doc_BS.long())
            dk_lo, dk_hi = ranges(self.k_doc_BK.long())
            dq_lo, dq_hi, dk_lo, dk_hi = dq_lo[:, :, None], dq_hi[:, :, None], dk_lo[:, None], dk_hi[:, None]
            any_BQK = any_BQK & (dk_lo <= dq_hi) & (dq_lo <= dk_hi)
            full_BQK = full_BQK & (dq_lo == dq_hi) & (dk_lo == dk_hi) & (dq_lo == dk_lo)
        any_BNQK, full_BNQK = any_BQK[:, None], full_BQK[:, None]
        if self.select_BNQJ is not None:
            sel_any, sel_all = self._selection_blocks(block)
            any_BNQK, full_BNQK = any_BNQK & sel_any, full_BNQK & sel_all
        return any_BNQK & ~full_BNQK, full_BNQK

    def block_mask(self, block: int = 128):
        """flex_attention's BlockMask [B or 1, N or 1, S, K] of blocks of block x block (query x key), built once
        (cached) without a host sync: one per micro-batch serves every layer."""
        if ("block", block) not in self._cache:
            from torch.nn.attention.flex_attention import BlockMask

            def table(m_BNQK):  # (count [B, N, Q], indices [B, N, Q, Kb]: the listed key blocks first, in order)
                order = torch.argsort(m_BNQK.to(torch.int32), dim=-1, descending=True, stable=True)  # as flex's own
                return m_BNQK.sum(-1, dtype=torch.int32), order.to(torch.int32)

            partial, full = self.block_kinds(block)
            partial, full = torch.broadcast_tensors(partial, full)
            self._cache[("block", block)] = BlockMask.from_kv_blocks(
                *table(partial), *table(full), BLOCK_SIZE=block, mask_mod=self.mask_mod(),
                seq_lengths=(self.q_pos_S.numel(), self.seq_len))
        return self._cache[("block", block)]


def select_from_indices(key_blocks_BNQk: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
    """Block selection in index form -> bool [B, N, Q, J]: key_blocks_BNQk[b, h, q] lists the key blocks (global,
    in [0, J)) that query block q of head h attends; negative entries are empty slots. One scatter, no host sync."""
    J = num_key_blocks
    slot_BNQk = torch.where(key_blocks_BNQk < 0, J, key_blocks_BNQk)  # empty slots land in an extra column
    sel = torch.zeros(*key_blocks_BNQk.shape[:-1], J + 1, dtype=torch.bool, device=key_blocks_BNQk.device)
    return sel.scatter_(-1, slot_BNQk.long(), True)[..., :J]


def cp_attention_mask(seq_len: int, cp_rank: int = 0, cp_size: int = 1, window: int | None = None,
                      doc_ids_BK=None, device=None) -> CPMask | None:
    """The mask of this rank's queries over the whole (gathered) sequence of length seq_len. doc_ids_BK: document
    ids of the WHOLE sequence (known on every cp rank, core/context.py:doc_ids_from_eos); positions cannot mark
    documents (they run on across them, global for rope). None for plain causal attention without cp (is_causal)."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be >= 1 (a query always sees itself) or None for no window")
    if cp_size == 1 and window is None and doc_ids_BK is None:
        return None
    device = device if doc_ids_BK is None else doc_ids_BK.device
    q_doc_BS = None if doc_ids_BK is None else split_for_cp(doc_ids_BK, cp_rank, cp_size, dim=1)
    return CPMask(cp_positions(seq_len, cp_rank, cp_size, device), seq_len, window, q_doc_BS, doc_ids_BK)


# -------------------------------------------------------------------------------------------- attention


def attention_reference(q_BNSD, k_BGKD, v_BGKE, mask_BSK=None, scale=None, sinks_N=None) -> torch.Tensor:
    """Attention [B, N, S, E] (trains on CPU): logits in the input dtype, fp32 softmax as transformers. mask: None
    (causal), a CPMask, bool [B or 1, S, K] or per head [B or 1, N or 1, S, K] (no visible key: output 0, as flex)."""
    B, N, S, D = q_BNSD.shape
    G, K = k_BGKD.shape[1], k_BGKD.shape[2]
    if isinstance(mask_BSK, CPMask):
        mask_BSK = mask_BSK.dense()
    if mask_BSK is None:
        assert S == K, "mask None means plain causal over the same positions"
        mask_BSK = torch.ones(S, K, dtype=torch.bool, device=q_BNSD.device).tril()[None]
    per_head = mask_BSK.dim() == 4
    if per_head:  # [B, N or 1, S, K] -> [B, G, n or 1, S, K]: query head h = g * n + i, as q is viewed below
        mask_BGnSK = mask_BSK.unflatten(1, (G, N // G)) if mask_BSK.shape[1] == N else mask_BSK[:, :, None]
    else:
        mask_BGnSK = mask_BSK[:, None, None]
    scale = D**-0.5 if scale is None else scale
    q_BGnSD = q_BNSD.view(B, G, N // G, S, D)  # no GQA copies: head h reads kv head h // n (transformers' repeat_kv)
    logits_BGnSK = (q_BGnSD @ k_BGKD[:, :, None].transpose(-1, -2)) * scale
    logits_BGnSK = upcast(logits_BGnSK).masked_fill(~mask_BGnSK, float("-inf"))
    if sinks_N is not None:  # one more column per head: the sink logit, softmaxed with the keys, then dropped
        sink_BGnS1 = upcast(sinks_N).view(1, G, N // G, 1, 1).expand(B, G, N // G, S, 1)
        probs_BGnSK = torch.cat([logits_BGnSK, sink_BGnS1], -1).softmax(-1)[..., :-1]
    else:
        probs_BGnSK = logits_BGnSK.softmax(-1)
    if per_head and sinks_N is None:  # rows without a visible key are NaN (0/0): their output is 0, no gradient
        probs_BGnSK = probs_BGnSK.masked_fill(~mask_BGnSK.any(-1, keepdim=True), 0.0)
    out_BGnSE = probs_BGnSK.to(v_BGKE.dtype) @ v_BGKE[:, :, None]
    return out_BGnSE.reshape(B, N, S, v_BGKE.shape[-1])


def sink_rescale(out_BNSE, lse_BNS, sinks_N) -> torch.Tensor:
    """Attention with sinks from attention without: the sink logit joins the softmax denominator, so every
    probability, and the output, shrinks by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)."""
    keep_BNS = torch.sigmoid(upcast(lse_BNS) - upcast(sinks_N)[:, None])
    return out_BNSE * keep_BNS[..., None].to(out_BNSE.dtype)


_compiled_flex = None


def flex_attend(q_BNSD, k_BGKD, v_BGKE, mask: CPMask, scale=None, sinks_N=None, block: int = 128) -> torch.Tensor:
    """flex_attention [B, N, S, E] over mask.block_mask(block): compiled on CUDA (fused), eager elsewhere (forward
    only, for tests); under autocast in the autocast dtype, like SDPA."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # torch >= 2.9

    dev = q_BNSD.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q_BNSD.dtype
    if dev == "cuda" and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    with torch.autocast(dev, enabled=False):
        out_BNSE, aux = (_compiled_flex if dev == "cuda" else flex_attention)(
            q_BNSD.to(dtype), k_BGKD.to(dtype), v_BGKE.to(dtype), block_mask=mask.block_mask(block), scale=scale,
            enable_gqa=q_BNSD.shape[1] != k_BGKD.shape[1], return_aux=AuxRequest(lse=True))
        return out_BNSE if sinks_N is None else sink_rescale(out_BNSE, aux.lse, sinks_N)


_causal_masks: dict = {}  # (S, device) -> CPMask of plain causal attention, for the flex path and selections


def _causal_mask(S: int, device) -> CPMask:
    key = (S, str(device))
    if key not in _causal_masks:
        _causal_masks[key] = CPMask(torch.arange(S, device=device), S)
    return _causal_masks[key]


def attention(q_BNSD, k_BGSD, v_BGSE, mask=None, cp_group=None, scale=None, sinks_N=None,
              select_BNQJ=None, select_block: int = 1) -> torch.Tensor:
    """Every recipe's attention: this rank's queries over the keys of the whole sequence -> [B, N, S, E].

    q [B, N, S, D]; k [B, G, S or K, D], v [B, G, S or K, E] (GQA: query head h reads kv head h // (N / G)). mask: None
    (causal, same positions), a CPMask (cp_attention_mask) or bool [B or 1, S, K]. cp_group: K and V are gathered over
    it (gather_kv) when they hold fewer positions than the mask's K; whole-sequence keys (e.g. an MLA latent the caller
    gathered) are used as given. scale: None = D**-0.5. sinks_N: GPT-OSS's sink logits. select_BNQJ: a per-head block
    selection (CPMask.with_selection; select_from_indices); a query that sees no key outputs 0.

    Which kernel runs (the one place that decides):

    | device | mask                                   | sinks | select | kernel                                   |
    |--------|----------------------------------------|-------|--------|------------------------------------------|
    | any    | None                                   | no    | no     | SDPA is_causal (flash on CUDA)           |
    | CUDA   | CPMask; None with sinks or a selection | any   | any    | flex_attention, BlockMask of 128-blocks  |
    | CPU    | CPMask                                 | no    | no     | SDPA with the dense boolean mask         |
    | CPU    | None or CPMask                         | yes   | any    | attention_reference (fp32 softmax)       |
    | CPU    | None or CPMask                         | any   | yes    | attention_reference                      |
    | any    | boolean tensor                         | no    | no     | SDPA with that mask                      |
    | any    | boolean tensor                         | yes   | no     | attention_reference                      |

    cp changes only K: the gather, then the same table (a selection's key blocks are global, its query blocks local)."""
    B, N, S, _ = q_BNSD.shape
    G = k_BGSD.shape[1]
    if N % G:
        raise ValueError(f"{N} query heads cannot share {G} key/value heads; num_attention_heads must be a "
                         f"multiple of num_key_value_heads")
    K = mask.seq_len if isinstance(mask, CPMask) else S if mask is None else mask.shape[-1]
    if k_BGSD.shape[2] != K:
        if cp_group is None or k_BGSD.shape[2] * dist.get_world_size(cp_group) != K:
            raise ValueError(f"keys hold {k_BGSD.shape[2]} positions but the mask covers {K}: pass the cp group "
                             f"the keys are split over (cp_group), or keys of the whole sequence")
        k_BGSD, v_BGSE = gather_kv(k_BGSD, v_BGSE, cp_group)
    if select_BNQJ is not None:
        if mask is not None and not isinstance(mask, CPMask):
            raise ValueError("a block selection combines with a CPMask or None (causal), not a boolean mask")
        mask = (mask or _causal_mask(S, q_BNSD.device)).with_selection(select_BNQJ, select_block, B, N)
    if q_BNSD.is_cuda and (isinstance(mask, CPMask) or (mask is None and sinks_N is not None)):
        return flex_attend(q_BNSD, k_BGSD, v_BGSE, mask or _causal_mask(S, q_BNSD.device), scale, sinks_N)
    dense = mask.dense() if isinstance(mask, CPMask) else mask
    if sinks_N is not None or (dense is not None and dense.dim() == 4):
        return attention_reference(q_BNSD, k_BGSD, v_BGSE, dense, scale, sinks_N)
    attn_mask = None if dense is None else dense[:, None]  # broadcast over heads
    return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSE, attn_mask=attn_mask, is_causal=dense is None,
                                          scale=scale, enable_gqa=N != G)

