"""Context-parallel masks against a per-position loop written here (not the code that builds them): the mask
function both paths evaluate and flex_attention's block tables (which blocks are skipped, which run unmasked), for
causal, sliding windows, sinks and packed documents at cp = 1, 2, 4, over several windows, lengths, block sizes and
document boundaries on and off chunk edges. Then the flex path's numbers: its forward (eager on CPU; CPU has no flex
backward) against the explicit reference for every mask kind, the sink rescaling's gradients against the reference,
the memory the GPU path builds (no [S, K] tensor) and the CPU reference's (one block of queries at a time)."""

import functools
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.attention import CPMask, attention, attention_reference, cp_attention_mask, flex_attend, sink_rescale
from tests.test_context import naive_attention, randn, rel_err

B, EOS = 2, 2


def rank_positions(seq_len: int, rank: int, cp: int) -> list[int]:
    """Global positions held by a cp rank: chunk `rank` and chunk 2cp-1-rank of 2cp equal chunks."""
    c = seq_len // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def loop_mask(seq_len, rank, cp, window, doc_BK) -> torch.Tensor:
    """[B, S, K] by direct enumeration: key j is seen from the query at global position i iff j <= i, i - j <
    window (if any) and both tokens are in the same document (if any)."""
    pos = rank_positions(seq_len, rank, cp)
    m = torch.zeros(B, len(pos), seq_len, dtype=torch.bool)
    for b in range(B):
        for s, i in enumerate(pos):
            for j in range(seq_len):
                same_doc = doc_BK is None or doc_BK[b][i] == doc_BK[b][j]
                m[b, s, j] = j <= i and (window is None or i - j < window) and same_doc
    return m


def doc_ids(seq_len: int, cp: int, seed: int) -> torch.Tensor:
    """Packed documents ended by eos: one ends exactly at a chunk edge, one is a single token, the rest random."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (B, seq_len), generator=g)
    c = seq_len // (2 * cp)
    ids[0, [c - 1, c + 2, c + 3, seq_len - c]] = EOS  # chunk edge, one-token document, edge of the last chunk
    ids[1, torch.randint(0, seq_len, (3,), generator=g)] = EOS
    is_eos = (ids == EOS).long()  # doc index written out here rather than taken from core.context.doc_ids_from_eos
    return is_eos.cumsum(1) - is_eos


def effective_mask(mask: CPMask, block: int, mask_mod=None) -> torch.Tensor:
    """[B, H, S, K] (H: the tables' heads, 1 without a per-head selection) of what flex_attention computes from
    the block tables: keys of listed full blocks all visible, keys of listed partial blocks as the BlockMask's
    mask function says (with a recipe's mask_mod, given in global positions), every other key skipped."""
    bm = mask.block_mask(block, mask_mod)
    S, K = mask.q_pos_S.numel(), mask.seq_len
    mod = bm.mask_mod
    H = bm.kv_num_blocks.shape[1]
    out = torch.zeros(max(bm.kv_num_blocks.shape[0], B), H, S, K, dtype=torch.bool)
    for b in range(out.shape[0]):
        bb = min(b, bm.kv_num_blocks.shape[0] - 1)
        for h in range(H):
            for qb in range(bm.kv_num_blocks.shape[2]):
                rows = torch.arange(qb * block, min((qb + 1) * block, S))
                for full, num, idx in ((False, bm.kv_num_blocks, bm.kv_indices),
                                       (True, bm.full_kv_num_blocks, bm.full_kv_indices)):
                    for kb in [] if num is None else idx[bb, h, qb, :num[bb, h, qb]].tolist():  # None: no full
                        cols = torch.arange(kb * block, min((kb + 1) * block, K))
                        seen = True if full else mod(torch.tensor(b), torch.tensor(h), rows[:, None], cols[None])
                        assert not out[b, h][rows[:, None], cols[None]].any(), "a key block listed twice"
                        out[b, h][rows[:, None], cols[None]] = seen
    return out


CASES = [(seq_len, window, docs) for seq_len in (16, 48) for window in (None, 1, 3, 6, 13, 64)
         for docs in (False, True)]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_masks_match_a_per_position_loop(cp):
    """Mask function and block tables (block sizes dividing a chunk, straddling two, and padded) equal the loop; without documents and with blocks inside one chunk the tables list no block that is empty."""
    checked = 0
    for seq_len, window, docs in CASES:
        if seq_len % (2 * cp):
            continue
        doc_BK = doc_ids(seq_len, cp, seed=seq_len + (window or 0)) if docs else None
        for rank in range(cp):
            mask = cp_attention_mask(seq_len, rank, cp, window, doc_BK)
            if mask is None:  # plain causal without cp: SDPA's own causal path
                assert cp == 1 and window is None and not docs
                continue
            expected = loop_mask(seq_len, rank, cp, window, None if doc_BK is None else doc_BK.tolist())
            S = len(rank_positions(seq_len, rank, cp))
            i, j = torch.arange(S)[:, None], torch.arange(seq_len)[None]
            by_mod = torch.stack([mask.mods()[1](torch.tensor(b), torch.tensor(0), i, j).expand(S, seq_len)
                                  for b in range(B)])
            assert torch.equal(by_mod, expected)
            c = seq_len // (2 * cp)
            for block in sorted({2, 3, c, 8}):
                assert torch.equal(effective_mask(mask, block)[:, 0], expected), (seq_len, window, docs, rank, block)
                if not docs and c % block == 0:  # tight: every listed partial block has a visible pair
                    bm = mask.block_mask(block)
                    for qb in range(bm.kv_num_blocks.shape[2]):
                        for kb in bm.kv_indices[0, 0, qb, :bm.kv_num_blocks[0, 0, qb]].tolist():
                            assert expected[0, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].any()
                checked += 1
    assert checked > 20


# ------------------------------------------------------------------------------------------ numerics

KINDS = {  # name: (N, G, window, sinks, docs)
    "causal": (4, 4, None, False, False),
    "gqa": (4, 2, None, False, False),
    "window_sinks": (4, 2, 5, True, False),
    "docs": (4, 4, None, False, True),
    "docs_window_sinks_gqa": (4, 2, 7, True, True),
}


def test_flex_forward_matches_reference_for_every_mask_kind():
    """Each rank's view at cp=2 and 4 (its queries over the whole sequence's keys, block 4 so that blocks are
    full, partial and skipped): flex_attend's output equals the explicit reference; one case also equals the
    float64 loop. The MLA latent form: per-head keys of width 12 and values of width 6."""
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    L, D = 32, 8
    worst = {}
    for cp in (2, 4):
        for name, (N, G, window, sinks, docs) in KINDS.items():
            g = torch.Generator().manual_seed(cp)
            doc_BK = doc_ids(L, cp, seed=1) if docs else None
            k, v = torch.randn(B, G, L, D, generator=g), torch.randn(B, G, L, D, generator=g)
            sink = torch.randn(N, generator=g) if sinks else None
            for rank in range(cp):
                q = torch.randn(B, N, L // cp, D, generator=g)
                mask = cp_attention_mask(L, rank, cp, window, doc_BK)
                out, ref = flex_attend(q, k, v, mask, 0.3, sink, block=4), attention_reference(q, k, v, mask, 0.3, sink)
                worst[(name, cp)] = max(worst.get((name, cp), 0.0), rel_err(out, ref))
                if name == "docs_window_sinks_gqa" and rank == cp - 1:
                    pos = rank_positions(L, rank, cp)
                    def visible(b, s, j, pos=pos, w=window, doc=doc_BK):
                        return pos[s] - w < j <= pos[s] and doc[b, pos[s]] == doc[b, j]
                    worst[("loop", cp)] = rel_err(out, naive_attention(q, k, v, 0.3, visible, sink))
        latent_k, latent_v = torch.randn(B, 4, L, 12, generator=g), torch.randn(B, 4, L, 6, generator=g)
        q = torch.randn(B, 4, L // cp, 12, generator=g)
        mask = cp_attention_mask(L, 1, cp)
        worst[("mla_latent", cp)] = rel_err(flex_attend(q, latent_k, latent_v, mask, 0.2, block=4),
                                            attention_reference(q, latent_k, latent_v, mask, 0.2))
    print("flex vs reference, max relative error:", {f"{n} cp={c}": f"{e:.1e}" for (n, c), e in worst.items()})
    assert max(worst.values()) <= 1e-6, worst


def test_sink_rescale_gradients_match_reference():
    """The flex path's only code in the backward: out * sigmoid(lse - sink). Fed with softmax attention and its
    log-sum-exp computed here, it gives the reference's output and gradients for q, k, v and the sinks."""
    g = torch.Generator().manual_seed(5)
    N, G, L, D, cp, rank = 4, 2, 24, 8, 2, 1
    q, k, v, sink = randn(g, B, N, L // cp, D), randn(g, B, G, L, D), randn(g, B, G, L, D), randn(g, N)
    mask = cp_attention_mask(L, rank, cp, 5, doc_ids(L, cp, seed=2))
    allowed = torch.as_tensor(loop_mask(L, rank, cp, 5, doc_ids(L, cp, seed=2).tolist()))[:, None]
    logits = (q @ k.repeat_interleave(N // G, 1).transpose(-1, -2)) * D**-0.5
    logits = logits.masked_fill(~allowed, float("-inf"))
    plain = logits.softmax(-1) @ v.repeat_interleave(N // G, 1)
    out = sink_rescale(plain, logits.logsumexp(-1), sink)
    ref = attention_reference(q, k, v, mask, None, sink)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, sink))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v, sink))
    errors = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
    assert max(errors) <= 1e-6, errors


# -------------------------------------------------------------------------------------------- memory


class LargestTensor(TorchDispatchMode):
    """Records the number of elements of the largest tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the tensors autograd saves for the backward of fn(*inputs)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return total


def test_gpu_path_mask_memory_does_not_grow_with_s_times_k():
    """At cp=2 with documents and a window, the GPU path's mask (block tables of 128 x 128 blocks) never creates
    a tensor of S x K elements: at 8k and 32k tokens its largest tensors are per token ([B, K] document ids) or the
    [B, S/128, K/128] table, 1/16384 of S x K."""
    sizes = {}
    for seq_len in (8192, 32768):
        doc_BK = torch.arange(seq_len).div(3000, rounding_mode="floor").expand(B, -1).contiguous()
        mask = cp_attention_mask(seq_len, 0, 2, 4096, doc_BK)
        with LargestTensor() as largest:
            bm = mask.block_mask(128)
        S = seq_len // 2
        # per-token tensors (positions, document ids: B x K) and block tables (torch's own adds a column): no S x K
        assert largest.numel <= 2 * max(B * seq_len, B * (S // 128) * (seq_len // 128))
        table_bytes = sum(t.numel() * t.element_size() for t in (bm.kv_num_blocks, bm.kv_indices,
                                                                  bm.full_kv_num_blocks, bm.full_kv_indices))
        sizes[seq_len] = (largest.numel, table_bytes)
    print(f"GPU-path mask: largest tensor / table bytes {sizes}")
    assert sizes[32768][1] <= 16 * sizes[8192][1]


def test_reference_memory_is_one_block_of_queries():
    """The CPU path at a cp=2 rank's view (S = 1024 queries over K = 2048 keys, documents, a window, sinks and a
    forget-gate score function over a per-token tensor): every tensor it creates, forward and backward, and what it
    saves for backward are bounded by one block of 128 queries ([B, N, 128, K] scores), not [B, N, S, K]: 1/8 here.
    The same call with one block of all queries crosses the first bound (what the measure would catch) but saves
    no more (every block is recomputed in backward), and its output and gradients equal the blocked ones."""
    g = torch.Generator().manual_seed(6)
    N, G, S, K, Dh = 2, 1, 1024, 2048, 8
    q, k, v = randn(g, 1, N, S, Dh), randn(g, 1, G, K, Dh), randn(g, 1, G, K, Dh)
    sink, logf_BK = randn(g, N), randn(g, 1, K, scale=0.1)
    mask = cp_attention_mask(K, 1, 2, 700, torch.arange(K).div(300, rounding_mode="floor")[None])
    c_BK = logf_BK.cumsum(1)
    gate = lambda score, b, h, i, j: score + c_BK[b, i] - c_BK[b, j]
    scores = N * S * K * 4  # bytes of one fp32 [B, N, S, K]
    results = {}
    for block in (128, S):
        run = lambda block=block: attention_reference(q, k, v, mask, None, sink, gate, block=block)
        with LargestTensor() as forward:
            out = run()
        with LargestTensor() as backward:
            grads = torch.autograd.grad(out.square().sum(), (q, k, v, sink, logf_BK))
        results[block] = (forward.numel, backward.numel, saved_bytes(run), out, grads)
    largest_fwd, largest_bwd, saved, out, grads = results[128]
    print(f"largest tensor forward / backward {largest_fwd} / {largest_bwd} elements, saved {saved} B; one block "
          f"of all queries: {results[S][:3]}; [B, N, S, K] = {N * S * K} elements, {scores} B")
    assert max(largest_fwd, largest_bwd) <= N * 128 * (K + 1)  # the block's scores and the sink column
    assert saved <= scores / 8  # the inputs q, k, v (views) and the block's indices: ~ q's 64 KiB here
    assert min(results[S][:2]) >= N * S * K and results[S][2] <= scores / 8  # created, not saved
    # one call in blocks vs one call whole: the same products per query row, summed in the same order: ~1e-7
    assert rel_err(out, results[S][3]) <= 1e-6
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(grads, results[S][4]))


def test_cpu_attention_saves_per_token_bytes_at_any_length():
    """core/attention.py:attention on CPU keeps bytes per token for backward at every length, one block of queries
    (S <= 128) included, as flex keeps on CUDA (core/memory.py calibrates at 64 tokens and scales per token): with a
    score_mod, with sinks, and plain causal with a value head dim other than q's (DeepSeek's MLA: SDPA's fused CPU
    kernel refuses it, its fallback kept [B, N, S, S]), 128 and 256 queries save exactly 2x and 4x the bytes of 64
    (the inputs and the blocks' indices). Kept S x S scores grew 3.5-3.7x per doubling (measured before)."""
    g = torch.Generator().manual_seed(7)
    N, G, Dh = 4, 2, 16
    sink = randn(g, N)
    for what, kwargs, Ev in (("score_mod", dict(score_mod=lambda score, b, h, i, j: score / 2), Dh),
                             ("sinks", dict(sinks_N=sink), Dh), ("value head dim", {}, 8)):
        saved = {}
        for S in (64, 128, 256):
            q, k, v = randn(g, B, N, S, Dh), randn(g, B, G, S, Dh), randn(g, B, G, S, Ev)
            saved[S] = saved_bytes(functools.partial(attention, **kwargs), q, k, v)
        assert saved[128] == 2 * saved[64] and saved[256] == 4 * saved[64], (what, saved)


def test_bad_window_is_a_clear_error():
    with pytest.raises(ValueError, match="window 0 must be >= 1"):
        cp_attention_mask(16, 0, 2, window=0)


@pytest.mark.gpu
def test_gpu_flex_attention_trains_and_fits():
    """CUDA: flex_attend (compiled) forward and backward in bf16 against the fp32 reference for window + sinks +
    documents + GQA at cp=2's view; then 32k tokens at cp=2 (S=16k queries, 32 heads) run within 2 GiB of
    activations where the math kernel would need 64 GiB of scores."""
    g = torch.Generator().manual_seed(0)
    L, N, G, D = 1024, 8, 2, 64
    doc_BK = torch.arange(L).div(300, rounding_mode="floor").expand(B, -1).cuda()
    mask = cp_attention_mask(L, 1, 2, 256, doc_BK)
    q, k, v = (torch.randn(B, n, s, D, generator=g).cuda().requires_grad_() for n, s in ((N, L // 2), (G, L), (G, L)))
    sink = torch.randn(N, generator=g).cuda().requires_grad_()
    w = torch.randn(B, N, L // 2, D, generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = flex_attend(q, k, v, mask, None, sink)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v, sink))
    ref = attention_reference(q, k, v, mask, None, sink)
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v, sink))
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 2e-2
    assert all(rel_err(a, b) < 3e-2 for a, b in zip(grads, grads_ref))
    L, N, G, D = 32768, 32, 4, 128
    q = torch.randn(1, N, L // 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, G, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    flex_attend(q, k, v, cp_attention_mask(L, 0, 2, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 2 * 2**30
