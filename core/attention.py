"""Attention, model-agnostic: every recipe calls `attention` (end of the file), whose table says which kernel runs.

A mask is a function of (batch, head, query, key) and a score bias one of (score, batch, head, query, key), in
flex_attention's signatures: a CPMask's rule (causal, sliding window, packed documents, a per-head block selection;
built once per forward by `cp_attention_mask`) and a recipe's own `mask_mod` / `score_mod` over global positions.
GPT-OSS's sinks join the softmax over the gathered keys (`sink_rescale`). CUDA: flex_attention in the CPMask's
BlockMask (empty key blocks skipped); CPU: `attention_reference` (flex has no CPU backward in torch 2.13).

Legend: B batch, S local sequence (this rank's queries, = K / cp), K whole sequence (gathered keys), N query heads, G
key/value heads, n = N / G query heads per kv head, D head dim of q and k, E head dim of v, s queries of one block.
"""

import copy
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from core.context import cp_positions, split_for_cp, whole_sequence
from core.precision import upcast

# ------------------------------------------------------------------------------------------------ masks


@dataclass(eq=False)
class CPMask:
    """Which of the K gathered keys (positions 0..K-1) this rank's queries see, as flex's functions (`mods`) and
    block tables (`block_mask`, cached). select_BNQJ (with_selection): per (batch, query head, block of
    select_block[0] local queries) the blocks of select_block[1] keys it may attend, the rule applying within them."""

    q_pos_S: torch.Tensor  # global positions of this rank's queries
    seq_len: int  # K
    window: int | None = None
    q_doc_BS: torch.Tensor | None = None  # document ids of this rank's queries / of the whole sequence
    k_doc_BK: torch.Tensor | None = None
    select_BNQJ: torch.Tensor | None = None  # bool [B, N, ceil(S/query block), ceil(K/key block)]
    select_block: tuple[int, int] = (1, 1)  # (queries, keys) per selection cell
    _cache: dict = field(default_factory=dict, repr=False)

    def with_selection(self, select_BNQJ: torch.Tensor, block, batch: int, heads: int) -> "CPMask":
        """This mask restricted to a per-head block selection (bool [B or 1, N or 1, Q, J], broadcast here to
        [batch, heads, Q, J] as a view) of cells of block = (queries, keys), or block x block; a new CPMask with its
        own cache (the selection changes every layer)."""
        bq, bk = (block, block) if isinstance(block, int) else block
        S, K = self.q_pos_S.numel(), self.seq_len
        want = (-(-S // bq), -(-K // bk))
        if select_BNQJ.dtype != torch.bool or select_BNQJ.dim() != 4 or tuple(select_BNQJ.shape[2:]) != want \
                or select_BNQJ.shape[0] not in (1, batch) or select_BNQJ.shape[1] not in (1, heads):
            raise ValueError(f"a block selection must be bool [B or 1, N or 1, ceil(S/{bq}), ceil(K/{bk})] = "
                             f"[{batch}, {heads}, {want[0]}, {want[1]}] for {S} queries over {K} keys in blocks of "
                             f"({bq}, {bk}); got {select_BNQJ.dtype} {list(select_BNQJ.shape)} (index form: "
                             f"core.attention.select_from_indices)")
        return replace(self, select_BNQJ=select_BNQJ.expand(batch, heads, -1, -1), select_block=(bq, bk), _cache={})

    def mods(self, score_mod=None, mask_mod=None):
        """(score function or None, mask function) over this rank's query indices 0..S-1, as flex calls them: this
        mask's rule and a recipe's functions, which get global query positions. Closures over tensors, which
        torch.compile takes as graph inputs (a new mask does not recompile); indices may be broadcast tensors."""
        q_pos_S, window, q_doc_BS, k_doc_BK = self.q_pos_S, self.window, self.q_doc_BS, self.k_doc_BK
        select_BNQJ, (bq, bk) = self.select_BNQJ, self.select_block

        def visible(b, h, q_idx, kv_idx):
            i = q_pos_S[q_idx]
            ok = kv_idx <= i
            if window is not None:
                ok = ok & (kv_idx > i - window)
            if q_doc_BS is not None:
                ok = ok & (q_doc_BS[b, q_idx] == k_doc_BK[b, kv_idx])
            if select_BNQJ is not None:
                ok = ok & select_BNQJ[b, h, q_idx // bq, kv_idx // bk]
            if mask_mod is not None:
                ok = ok & mask_mod(b, h, i, kv_idx)
            return ok

        if score_mod is None:
            return None, visible
        return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_pos_S[q_idx], kv_idx), visible

    def _selection_blocks(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(any, all) of the selection over each block x block tile: bool [B, N, ceil(S/block), ceil(K/block)]."""

        def tiles(sel, dim, cell, length, fill, reduce):  # selection cells -> tiles along one dim
            count = -(-length // block)
            if cell % block == 0:  # a cell covers whole tiles
                return sel.repeat_interleave(cell // block, dim).narrow(dim, 0, count)
            if block % cell:
                raise ValueError(f"selection block {cell} must divide the attention block {block} or be a multiple")
            r = block // cell  # a tile covers r cells; cells past the end: False for any, True for all (no pair)
            pad = [0, 0] * (3 - dim) + [0, count * r - sel.shape[dim]]
            return reduce(F.pad(sel, pad, value=fill).unflatten(dim, (count, r)), dim + 1)

        (bq, bk), S, K = self.select_block, self.q_pos_S.numel(), self.seq_len
        return tuple(tiles(tiles(self.select_BNQJ, 2, bq, S, fill, reduce), 3, bk, K, fill, reduce)
                     for fill, reduce in ((False, torch.any), (True, torch.all)))

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

    def block_mask(self, block: int = 128, mask_mod=None):
        """flex_attention's BlockMask [B or 1, N or 1, S, K] of blocks of block x block (query x key). Its tables
        are built once (cached) without a host sync: one per micro-batch serves every layer. A recipe's mask_mod
        (global positions) runs inside every listed block, so none of them counts as full then."""
        key = ("block", block, mask_mod is None)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import BlockMask

            def table(m_BNQK):  # (count [B, N, Q], indices [B, N, Q, Kb]: the listed key blocks first, in order)
                order = torch.argsort(m_BNQK.to(torch.int32), dim=-1, descending=True, stable=True)  # as flex's own
                return m_BNQK.sum(-1, dtype=torch.int32), order.to(torch.int32)

            partial, full = torch.broadcast_tensors(*self.block_kinds(block))
            tables = (*table(partial), *table(full)) if mask_mod is None else table(partial | full)
            self._cache[key] = BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block, mask_mod=self.mods()[1],
                                                        seq_lengths=(self.q_pos_S.numel(), self.seq_len))
        if mask_mod is None:
            return self._cache[key]
        with_mod = copy.copy(self._cache[key])  # the cached tables, this call's function
        with_mod.mask_mod = self.mods(None, mask_mod)[1]
        return with_mod


def select_from_indices(key_blocks_BNQk: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
    """Block selection in index form -> bool [B, N, Q, J]: key_blocks_BNQk[b, h, q] lists the key blocks (global,
    in [0, J)) that query block q of head h attends (query and key blocks of any sizes, with_selection's block);
    negative entries are empty slots. One scatter, no host sync."""
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


_causal_masks: dict = {}  # (S, device) -> CPMask of plain causal attention, when None needs the general path


def _causal_mask(S: int, device) -> CPMask:
    key = (S, str(device))
    if key not in _causal_masks:
        _causal_masks[key] = CPMask(torch.arange(S, device=device), S)
    return _causal_masks[key]


# -------------------------------------------------------------------------------------------- attention


def attention_reference(q_BNSD, k_BGKD, v_BGKE, mask=None, scale=None, sinks_N=None, score_mod=None, mask_mod=None,
                        block: int = 128) -> torch.Tensor:
    """Attention [B, N, S, E] (trains on CPU) of `block` queries at a time, each recomputed in backward: [B, N, block,
    K] while it runs, none of it kept (as flex: per-token memory at any length, as core/memory.py calibrates). mask:
    None (causal) or a CPMask; without a score_mod or sinks SDPA takes the block's mask, else logits in the input
    dtype, score_mod and the fp32 softmax as flex and transformers compute them. No key visible: 0, as flex."""
    B, N, S, D = q_BNSD.shape
    G, K, E = k_BGKD.shape[1], k_BGKD.shape[2], v_BGKE.shape[-1]
    n, dev = N // G, q_BNSD.device
    score_fn, visible = (mask or _causal_mask(S, dev)).mods(score_mod, mask_mod)
    scale = D**-0.5 if scale is None else scale
    b, h = torch.arange(B, device=dev).view(B, 1, 1, 1), torch.arange(N, device=dev).view(1, N, 1, 1)
    kv_idx = torch.arange(K, device=dev)[None]  # indices broadcast over [B, N, s, K]

    def rows(q_BNsD, q_idx):  # one block of s queries (local indices q_idx [s, 1]) over every key
        s, seen_BNsK = q_BNsD.shape[2], visible(b, h, q_idx, kv_idx)
        if score_fn is None and sinks_N is None:
            return F.scaled_dot_product_attention(q_BNsD, k_BGKD, v_BGKE, seen_BNsK, scale=scale, enable_gqa=n > 1)
        # the n query heads of kv head g side by side: one matmul per kv head, no GQA copies
        logits_BNsK = (q_BNsD.reshape(B, G, n * s, D) @ k_BGKD.transpose(-1, -2)).view(B, N, s, K)
        logits_BNsK = upcast(logits_BNsK * scale)
        if score_fn is not None:
            logits_BNsK = score_fn(logits_BNsK, b, h, q_idx, kv_idx)
        logits_BNsK = logits_BNsK.masked_fill(~seen_BNsK, float("-inf"))
        if sinks_N is not None:  # one more column per head: the sink logit, softmaxed with the keys, then dropped
            sink_BNs1 = upcast(sinks_N).view(1, N, 1, 1).expand(B, N, s, 1)
            probs_BNsK = torch.cat([logits_BNsK, sink_BNs1], -1).softmax(-1)[..., :-1]
        else:  # rows without a visible key are NaN (0/0): their output is 0, no gradient
            probs_BNsK = logits_BNsK.softmax(-1).masked_fill(~seen_BNsK.any(-1, keepdim=True), 0.0)
        return (probs_BNsK.to(v_BGKE.dtype).reshape(B, G, n * s, K) @ v_BGKE).view(B, N, s, E)

    run = lambda *a: checkpoint(rows, *a, use_reentrant=False) if torch.is_grad_enabled() else rows(*a)
    return torch.cat([run(q_BNsD, torch.arange(s, s + q_BNsD.shape[2], device=dev)[:, None])
                      for s, q_BNsD in zip(range(0, S, block), q_BNSD.split(block, 2))], 2)


def sink_rescale(out_BNSE, lse_BNS, sinks_N) -> torch.Tensor:
    """Attention with sinks from attention without: the sink logit joins the softmax denominator, so every
    probability, and the output, shrinks by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)."""
    keep_BNS = torch.sigmoid(upcast(lse_BNS) - upcast(sinks_N)[:, None])
    return out_BNSE * keep_BNS[..., None].to(out_BNSE.dtype)


_compiled_flex = None


def flex_attend(q_BNSD, k_BGKD, v_BGKE, mask: CPMask, scale=None, sinks_N=None, score_mod=None, mask_mod=None,
                block: int = 128) -> torch.Tensor:
    """flex_attention [B, N, S, E] over mask.block_mask(block) with the recipe's functions (attention's): compiled
    on CUDA (fused; its backward reaches the tensors score_mod captures), eager elsewhere (forward only, for tests);
    under autocast in the autocast dtype, like SDPA."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # torch >= 2.9

    dev = q_BNSD.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q_BNSD.dtype
    if dev == "cuda" and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    with torch.autocast(dev, enabled=False):
        out_BNSE, aux = (_compiled_flex if dev == "cuda" else flex_attention)(
            q_BNSD.to(dtype), k_BGKD.to(dtype), v_BGKE.to(dtype), mask.mods(score_mod)[0],
            mask.block_mask(block, mask_mod), scale, enable_gqa=q_BNSD.shape[1] != k_BGKD.shape[1],
            return_aux=AuxRequest(lse=True))
        return out_BNSE if sinks_N is None else sink_rescale(out_BNSE, aux.lse, sinks_N)


def attention(q_BNSD, k_BGSD, v_BGSE, mask=None, cp_group=None, scale=None, sinks_N=None, select_BNQJ=None,
              select_block=1, score_mod=None, mask_mod=None, per_token=()) -> torch.Tensor:
    """Every recipe's attention: this rank's queries over the keys of the whole sequence -> [B, N, S, E].

    q [B, N, S, D]; k [B, G, S or K, D], v [B, G, S or K, E] (GQA: query head h reads kv head h // (N / G)). mask: None
    (causal) or a CPMask (cp_attention_mask). K and V are gathered over cp_group (one all-gather) when they hold fewer
    positions than the mask's K (whole-sequence keys: used as given). scale: None = D**-0.5. sinks_N: GPT-OSS's sinks.
    select_BNQJ: a per-head block selection in cells of select_block = (queries, keys) (CPMask.with_selection).

    score_mod(score, b, h, q_idx, kv_idx) -> score (fp32) and mask_mod(b, h, q_idx, kv_idx) -> bool: flex's
    functions, q_idx and kv_idx GLOBAL positions, h the query head (mask_mod skips no block: a selection does).
    per_token: tensors [B, S or K, ...] gathered over cp_group; score_mod / mask_mod are then builders called once
    with the whole-sequence tensors. Gradients reach every tensor the functions use; no key visible: output 0.

    Which kernel runs (the one place that decides):

    | device | mask | sinks, selection, functions | kernel                                                       |
    |--------|------|-----------------------------|--------------------------------------------------------------|
    | any    | None | none                        | SDPA is_causal (flash on CUDA)                               |
    | CUDA   | any  | any                         | flex_attention, BlockMask of 128-blocks of the CPMask        |
    | CPU    | any  | any                         | attention_reference, 128 queries at a time: SDPA with the    |
    |        |      |                             | block's mask, or the explicit softmax with score_mod / sinks |

    cp changes only K: the gather, then the same table (a selection's key blocks are global, its query blocks local)."""
    B, N, S, _ = q_BNSD.shape
    G = k_BGSD.shape[1]
    if N % G:
        raise ValueError(f"{N} query heads cannot share {G} key/value heads; num_attention_heads must be a "
                         f"multiple of num_key_value_heads")
    if mask is not None and not isinstance(mask, CPMask):
        raise ValueError(f"mask must be a CPMask (core.attention.cp_attention_mask) or None (causal), not "
                         f"{type(mask).__name__}; a mask of your own is a mask_mod(b, h, q_idx, kv_idx)")
    K = S if mask is None else mask.seq_len
    if k_BGSD.shape[2] != K:  # K and V in one all-gather
        kv_BGKX = whole_sequence(torch.cat([k_BGSD, v_BGSE], -1), K, cp_group, dim=2, what="keys")
        k_BGSD, v_BGSE = kv_BGKX.split([k_BGSD.shape[-1], v_BGSE.shape[-1]], -1)
    if per_token:  # builders of the functions, given the whole sequence's tensors
        whole = [whole_sequence(t, K, cp_group, dim=1, what="per_token tensors") for t in per_token]
        score_mod = score_mod(*whole) if score_mod else None
        mask_mod = mask_mod(*whole) if mask_mod else None
    if mask is None and sinks_N is None and select_BNQJ is None and score_mod is None and mask_mod is None:
        D, E = q_BNSD.shape[-1], v_BGSE.shape[-1]
        if not q_BNSD.is_cuda and D != E and torch.is_grad_enabled():  # CPU SDPA's fused kernel takes one head dim
            # (its fallback keeps [B, N, S, S] for backward): zero columns to the widest, changing no score or output
            q_BNSD, k_BGSD, v_BGSE = (F.pad(t, (0, max(D, E) - t.shape[-1])) for t in (q_BNSD, k_BGSD, v_BGSE))
        return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSE, is_causal=True, enable_gqa=N != G,
                                              scale=D**-0.5 if scale is None else scale)[..., :E]
    mask = mask or _causal_mask(S, q_BNSD.device)
    if select_BNQJ is not None:
        mask = mask.with_selection(select_BNQJ, select_block, B, N)
    attend = flex_attend if q_BNSD.is_cuda else attention_reference
    return attend(q_BNSD, k_BGSD, v_BGSE, mask, scale, sinks_N, score_mod, mask_mod)
