"""Per-head masks and per-head block selections in core.attention.attention, against a per-query loop written here:
for every (batch, head, query) the loop lists the keys that query may see (causal, window, document, and the
selection's cell of its query block and the key's block) and takes a float64 softmax over them. Checked: the CPU
path (the reference) with gradients, the CUDA path's flex BlockMask (its block tables per head, and flex's
forward, eager on CPU), cp=2 on gloo (a selection in global key blocks, keys gathered), and that a document
mask's BlockMask is built without a host sync (on the meta device, where any read of a value fails).

Legend: B batch, N query heads, G kv heads, L whole sequence, S a rank's queries, D head dim, Q query blocks,
J key blocks (of the selection's block size bs)."""

import warnings

import pytest
import torch
import torch.distributed as dist

from core.attention import attention, attention_reference, cp_attention_mask, flex_attend, select_from_indices
from core.context import split_for_cp
from core.mesh import build_mesh, destroy_mesh
from tests.multiproc import run_ranks
from tests.test_context import rel_err
from tests.test_context_masks import LargestTensor, doc_ids, effective_mask, rank_positions

B, L, D = 2, 32, 8


def loop_attention(q_BNSD, k_BGLD, v_BGLD, pos, visible, scale, sinks_N=None):
    """float64, query by query: the softmax over keys j with visible(b, h, i, j) (i = pos[s], the query's global
    position), plus the sink logit if any; a query that sees no key (and has no sink) outputs 0."""
    Bq, N, S, _ = q_BNSD.shape
    n = N // k_BGLD.shape[1]
    rows = []
    for b in range(Bq):
        for h in range(N):
            for s in range(S):
                js = [j for j in range(k_BGLD.shape[2]) if visible(b, h, pos[s], j)]
                logits = k_BGLD[b, h // n, js].double() @ q_BNSD[b, h, s].double() * scale
                if sinks_N is not None:
                    logits = torch.cat([logits, sinks_N[h].double().view(1)])
                if len(logits) == 0:
                    rows.append(torch.zeros(v_BGLD.shape[-1], dtype=torch.float64))
                    continue
                rows.append(logits.softmax(0)[: len(js)] @ v_BGLD[b, h // n, js].double())
    return torch.stack(rows).view(Bq, N, S, -1)


def rule(window, doc_BL, sel_BNQJ, bs):
    """visible(b, h, i, j) in global positions; sel_BNQJ over the whole sequence's query blocks."""
    def visible(b, h, i, j):
        return (j <= i and (window is None or i - j < window) and (doc_BL is None or doc_BL[b, i] == doc_BL[b, j])
                and bool(sel_BNQJ[b, h, i // bs, j // bs]))
    return visible


def selection(g, N, bs, index_form, empty_block=True):
    """A random selection over the whole sequence's blocks: bool [B, N, L/bs, L/bs] and, in index form, the
    [B, N, Q, 3] key block lists (some slots empty) the boolean one is built from here (not by core)."""
    Q = L // bs
    if index_form:
        idx = torch.randint(0, Q, (B, N, Q, 3), generator=g)
        idx[..., 0] = torch.where(torch.rand(B, N, Q, generator=g) < 0.5, 0, -1)  # the first block often, or none
        idx[..., 1:][torch.rand(B, N, Q, 2, generator=g) < 0.3] = -1
        sel = torch.zeros(B, N, Q, Q, dtype=torch.bool)
        for b, h, q, t in torch.cartesian_prod(*(torch.arange(n) for n in idx.shape)).tolist():
            if idx[b, h, q, t] >= 0:
                sel[b, h, q, idx[b, h, q, t]] = True
    else:
        idx, sel = None, torch.rand(B, N, Q, Q, generator=g) < 0.5
    if empty_block:  # one (batch, head, query block) attends nothing: its queries output 0
        sel[0, 1, Q // 2] = False
        if idx is not None:
            idx[0, 1, Q // 2] = -1
    return sel, idx


CASES = {  # name: (N, G, window, sinks, docs, bs, index form)
    "blocks_gqa": (4, 2, None, False, False, 4, True),
    "blocks_docs_window_sinks": (4, 2, 7, True, True, 2, True),
    "head_mask": (4, 4, None, False, True, 1, False),
    "big_blocks_window": (4, 1, 9, False, False, 8, False),
}


def inputs(name, seed):
    N, G, window, sinks, docs, bs, index_form = CASES[name]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, L, D, generator=g).requires_grad_() for n in (N, G, G))
    sink = torch.randn(N, generator=g).requires_grad_() if sinks else None
    doc_BL = doc_ids(L, 2, seed) if docs else None
    sel, idx = selection(g, N, bs, index_form)
    w = torch.randn(B, N, L, D, generator=g)  # loss = sum(out * w): a generic upstream gradient
    return q, k, v, sink, doc_BL, sel, idx, w


def core_selection(sel, idx, rank, cp, bs):
    """This rank's rows of the selection (its query blocks, split_for_cp order), from the index form through
    core's select_from_indices where the case has one."""
    rows = split_for_cp(sel if idx is None else idx, rank, cp, dim=2)
    return rows if idx is None else select_from_indices(rows, L // bs)


def errors(name, rank, cp, group, seed=0):
    """Relative errors of the output and every gradient of this rank's attention (cp ranks: keys gathered over
    group) against the float64 loop over the whole sequence."""
    N, G, window, sinks, docs, bs, _ = CASES[name]
    q, k, v, sink, doc_BL, sel, idx, w = inputs(name, seed)
    scale = 0.4
    ref = loop_attention(q, k, v, list(range(L)), rule(window, doc_BL, sel, bs), scale, sink)
    grads_ref = torch.autograd.grad((ref * w.double()).sum(), [t for t in (q, k, v, sink) if t is not None])
    local = [split_for_cp(t.detach(), rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    sink_l = sink.detach().clone().requires_grad_() if sinks else None
    mask = cp_attention_mask(L, rank, cp, window, doc_BL)
    out = attention(*local, mask, group, scale, sink_l, core_selection(sel, idx, rank, cp, bs), bs)
    grads = torch.autograd.grad((out * split_for_cp(w, rank, cp, dim=2)).sum(),
                                [t for t in (*local, sink_l) if t is not None])
    err = {"out": rel_err(out, split_for_cp(ref, rank, cp, dim=2))}
    for n, gr, gr_ref in zip(("dq", "dk", "dv", "dsink"), grads, grads_ref):
        if n == "dsink":  # a replicated parameter: each rank holds its queries' part, the sum is the gradient
            if group is not None:
                dist.all_reduce(gr, group=group)
            err[n] = rel_err(gr, gr_ref)
        elif group is None:
            err[n] = rel_err(gr, gr_ref)
        else:  # dk, dv: the gather's backward hands each owner the sum over ranks of its chunks
            err[n] = rel_err(gr, split_for_cp(gr_ref, rank, cp, dim=2))
    assert all(torch.isfinite(g).all() for g in grads), "a query without keys must not give NaN gradients"
    return err


# fp32 path vs float64 loop: each output is a softmax-weighted sum of <= 32 terms of dot products of 8 terms;
# fp32 rounds each of the ~ 50 steps by <= 6e-8 relative, so ~ sqrt(50) * 6e-8 = 4e-7 in norm; gradients take
# two more such passes. 2e-6 leaves margin on any CPU / thread count; a wrong key or block gives >= 1e-2.
TOL = 2e-6


@pytest.mark.parametrize("name", list(CASES))
def test_selection_matches_per_query_loop(name):
    """One process, CPU (the reference path): output and gradients of q, k, v and the sinks."""
    err = errors(name, 0, 1, None)
    print(name, {k: f"{e:.1e}" for k, e in err.items()})
    assert max(err.values()) <= TOL, err


def cp_worker(cp):
    mesh = build_mesh(cp=cp, device="cpu")
    out = {name: errors(name, mesh.coord("cp"), cp, mesh.group("cp")) for name in CASES}
    destroy_mesh()
    return out


def test_selection_under_cp2_matches_per_query_loop():
    """cp=2 on gloo: each rank's queries with its rows of the selection over the gathered keys equal the loop."""
    per_rank = run_ranks(2, cp_worker, 2)
    worst = {(c, k): max(r[c][k] for r in per_rank) for c in CASES for k in per_rank[0][c]}
    print("cp=2 max relative errors:", {f"{c} {k}": f"{e:.1e}" for (c, k), e in worst.items()})
    assert max(worst.values()) <= TOL, worst


def test_flex_block_tables_per_head_skip_unselected_blocks():
    """The CUDA path's BlockMask at cp=2's views: per head, the tables plus the mask function give exactly the
    loop's visible pairs (flex block 4 with selection blocks 2, 4 and 8: several cells per tile, one, and a cell
    over several tiles); without documents every listed tile holds a visible pair, so unselected blocks are
    never computed; and flex_attention's forward (eager on CPU) equals the loop."""
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    worst = 0.0
    for name in CASES:
        N, G, window, sinks, docs, bs, _ = CASES[name]
        q, k, v, sink, doc_BL, sel, idx, _ = inputs(name, seed=1)
        for rank in range(2):
            pos = rank_positions(L, rank, 2)
            mask = cp_attention_mask(L, rank, 2, window, doc_BL).with_selection(
                core_selection(sel, idx, rank, 2, bs), bs, B, N)
            visible = rule(window, doc_BL, sel, bs)
            expected = torch.tensor([[[[visible(b, h, i, j) for j in range(L)] for i in pos] for h in range(N)]
                                     for b in range(B)])
            for block in (4,) if bs == 1 else (4, 8):
                assert torch.equal(effective_mask(mask, block), expected), (name, rank, block)
                bm = mask.block_mask(block)
                assert bm.kv_num_blocks.shape[:2] == (B, N)
                if not docs and bs % block == 0:  # tiles inside one cell and one chunk: tight
                    tiles = torch.cartesian_prod(torch.arange(B), torch.arange(N), torch.arange(L // 2 // block))
                    for b, h, qb in tiles.tolist():
                        for kb in bm.kv_indices[b, h, qb, :bm.kv_num_blocks[b, h, qb]].tolist() + \
                                bm.full_kv_indices[b, h, qb, :bm.full_kv_num_blocks[b, h, qb]].tolist():
                            assert expected[b, h, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].any()
            q_l, k_d, v_d = split_for_cp(q.detach(), rank, 2, dim=2), k.detach(), v.detach()
            out = flex_attend(q_l, k_d, v_d, mask, 0.4, None if sink is None else sink.detach(), block=4)
            ref = loop_attention(q_l, k_d, v_d, pos, visible, 0.4, sink)
            worst = max(worst, rel_err(out, ref))
            assert rel_err(attention_reference(q_l, k_d, v_d, mask, 0.4, sink), ref) <= TOL
    print(f"flex forward vs loop, max relative error {worst:.1e}")
    assert worst <= TOL


def test_document_block_mask_builds_without_host_sync_and_once():
    """Documents + window + a selection at cp=2 built on the meta device: a tensor there has a shape and no
    values, so any .item(), .tolist(), nonzero or bool() on the way (a host sync on CUDA) would raise. Then on CPU
    the BlockMask is built once per CPMask (one per micro-batch, every layer reuses it)."""
    doc_BL = doc_ids(64, 2, seed=3).to("meta")
    mask = cp_attention_mask(64, 1, 2, 9, doc_BL)
    for block in (4, 16, 128):
        bm = mask.block_mask(block)
        assert bm.kv_num_blocks.device.type == "meta" and bm.q_indices is not None  # backward tables too
    sel = select_from_indices(torch.zeros(B, 4, 8, 2, dtype=torch.long, device="meta"), 16)
    assert mask.with_selection(sel, 4, B, 4).block_mask(16).kv_indices.shape == (B, 4, 2, 4)
    mask = cp_attention_mask(64, 1, 2, 9, doc_ids(64, 2, seed=3))
    assert mask.block_mask(128) is mask.block_mask(128)


def test_selection_block_mask_memory_is_per_block():
    """16k tokens at cp=2 (S = 8k queries), 4 heads, documents, a selection of 128-blocks: the BlockMask is built
    from [B, N, S/128, K/128] tables; no tensor of S x K (or S x K / 128) elements is ever created, and only the
    selected tiles are listed."""
    L_, N, bs = 16384, 4, 128
    g = torch.Generator().manual_seed(4)
    sel = torch.rand(B, N, L_ // 2 // bs, L_ // bs, generator=g) < 0.1
    doc_BL = torch.arange(L_).div(5000, rounding_mode="floor").expand(B, -1).contiguous()
    mask = cp_attention_mask(L_, 0, 2, None, doc_BL).with_selection(sel, bs, B, N)
    with LargestTensor() as largest:
        bm = mask.block_mask(128)
    tables = B * N * (L_ // 2 // bs) * (L_ // bs)
    assert "dense" not in mask._cache and largest.numel <= 2 * max(tables, B * L_), largest.numel
    listed = (bm.kv_num_blocks + bm.full_kv_num_blocks).sum().item()
    assert 0 < listed <= sel.sum().item()  # never a tile the selection skips


def test_bad_selection_and_keys_are_clear_errors():
    q, k = torch.randn(B, 4, 8, D), torch.randn(B, 2, 8, D)
    mask = cp_attention_mask(16, 0, 2)
    with pytest.raises(ValueError, match="pass the cp group"):
        attention(q, k, k, mask)
    with pytest.raises(ValueError, match=r"bool \[B or 1, N or 1.*\[2, 4, 2, 4\]"):
        attention(q, torch.randn(B, 2, 16, D), torch.randn(B, 2, 16, D), mask, select_BNQJ=torch.ones(B, 4, 2, 3,
                  dtype=torch.bool), select_block=4)
    with pytest.raises(ValueError, match="must divide the attention block"):
        mask.with_selection(torch.ones(1, 1, 3, 6, dtype=torch.bool), 3, B, 4).block_mask(4)


@pytest.mark.gpu
def test_gpu_selection_with_documents_trains_without_host_sync():
    """CUDA: the dispatcher (compiled flex, BlockMask [B, N] of 128-blocks) with documents, a window, sinks and a
    per-head selection of 128-blocks at a cp=2 rank's view, bf16 forward and backward against the fp32 reference;
    the BlockMask is built with CUDA's sync debug mode set to error."""
    g = torch.Generator().manual_seed(0)
    Lg, N, G, Dg, bs = 2048, 8, 2, 64, 128
    doc_BL = torch.arange(Lg).div(700, rounding_mode="floor").expand(B, -1).cuda()
    sel = (torch.rand(B, N, Lg // 2 // bs, Lg // bs, generator=g) < 0.3).cuda()
    q, k, v = (torch.randn(B, n, s, Dg, generator=g).cuda().requires_grad_()
               for n, s in ((N, Lg // 2), (G, Lg), (G, Lg)))
    sink = torch.randn(N, generator=g).cuda().requires_grad_()
    w = torch.randn(B, N, Lg // 2, Dg, generator=g).cuda()
    mask = cp_attention_mask(Lg, 1, 2, 512, doc_BL).with_selection(sel, bs, B, N)
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask.block_mask(128)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = attention(q, k, v, cp_attention_mask(Lg, 1, 2, 512, doc_BL), None, None, sink, sel, bs)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v, sink))
    ref = attention_reference(q, k, v, mask, None, sink)
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v, sink))
    # bf16 inputs (8 bits of mantissa, 4e-3 relative per element) in sums of ~ 1000 terms: 2e-2 / 3e-2 in norm
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 2e-2
    assert all(rel_err(a, b) < 3e-2 for a, b in zip(grads, grads_ref))
