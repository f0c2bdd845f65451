"""Per-head masks, per-head block selections and score / mask functions in core.attention.attention, against a
per-query loop written here: for every (batch, head, query) the loop lists the keys that query may see (causal,
window, document, the selection's cell of its query block and the key's block, a case's own key rule), applies the
case's score rule to their logits written in its own way, and takes a float64 softmax over them. Checked: the CPU
path (the reference) with gradients into q, k, v, sinks and the side tensors, the CUDA path's flex BlockMask (its
block tables per head, and flex's forward, eager on CPU; torch's flex_attention with the functions alone), cp=2 on
gloo (a selection in global key blocks, keys and per-token tensors gathered), that a document mask's BlockMask is
built without a host sync (on the meta device, where any read of a value fails), and that the compiled flex keeps
one graph while every layer brings new functions.

Legend: B batch, N query heads, G kv heads, L whole sequence, S a rank's queries, D head dim, Q query blocks,
J key blocks (of the selection's cells: bq queries x bk keys)."""

import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.attention import attention, attention_reference, cp_attention_mask, flex_attend, select_from_indices
from core.context import split_for_cp
from core.mesh import build_mesh, destroy_mesh
from tests.multiproc import run_ranks
from tests.test_context import rel_err
from tests.test_context_masks import LargestTensor, doc_ids, effective_mask, rank_positions

B, L, D = 2, 32, 8
CAP = 4.0  # soft-capping of the alibi_softcap case: |logits + bias| reaches it, so tanh bends


def loop_attention(q_BNSD, k_BGLD, v_BGLD, pos, visible, scale, sinks_N=None, score=None):
    """float64, query by query: the softmax over keys j with visible(b, h, i, j) (i = pos[s], the query's global
    position) of the logits, through score(logits, b, h, i, js) if any, plus the sink logit if any; a query that
    sees no key (and has no sink) outputs 0."""
    Bq, N, S, _ = q_BNSD.shape
    n = N // k_BGLD.shape[1]
    rows = []
    for b in range(Bq):
        for h in range(N):
            for s in range(S):
                js = [j for j in range(k_BGLD.shape[2]) if visible(b, h, pos[s], j)]
                logits = k_BGLD[b, h // n, js].double() @ q_BNSD[b, h, s].double() * scale
                if score is not None and js:
                    logits = score(logits, b, h, pos[s], torch.tensor(js))
                if sinks_N is not None:
                    logits = torch.cat([logits, sinks_N[h].double().view(1)])
                if len(logits) == 0:
                    rows.append(torch.zeros(v_BGLD.shape[-1], dtype=torch.float64))
                    continue
                rows.append(logits.softmax(0)[: len(js)] @ v_BGLD[b, h // n, js].double())
    return torch.stack(rows).view(Bq, N, S, -1)


class Case(NamedTuple):
    N: int
    G: int
    window: int | None
    sinks: bool
    docs: bool
    cells: tuple[int, int] | None  # a selection's (queries, keys) per cell; None: no selection
    index_form: bool = False
    mods: str | None = None  # score / mask functions: core_mods, loop_mods


CASES = {
    "blocks_gqa": Case(4, 2, None, False, False, (4, 4), True),
    "blocks_docs_window_sinks": Case(4, 2, 7, True, True, (2, 2), True),
    "head_mask": Case(4, 4, None, False, True, (1, 1)),
    "big_blocks_window": Case(4, 1, 9, False, False, (8, 8)),
    "one_query_cells_of_4_keys_docs": Case(4, 2, None, False, True, (1, 4), True),
    "cells_4x2_window_sinks": Case(4, 2, 5, True, False, (4, 2)),
    "forget_gate_docs": Case(4, 2, None, False, True, None, mods="forget_gate"),
    "alibi_softcap_window_sinks": Case(4, 2, 7, True, False, None, mods="alibi_softcap"),
    "key_subset_cells_2x8": Case(4, 4, None, False, False, (2, 8), True, mods="key_subset"),
    "forget_gate_key_subset_cells_1x8_docs": Case(4, 2, None, False, True, (1, 8), mods="forget_gate+key_subset"),
}


# ------------------------------------------------------------------ score and mask functions of the cases
# side tensors: logf [B, L, N] a per-token, per-head log forget gate; slopes [N] a per-head parameter; keep [B, L]
# a per-token subset of keys. core_mods writes them as a recipe would (global positions, whole-sequence tensors
# from per_token, a cumsum over the gathered sequence); loop_mods per (query, key), in its own formulation.


def forget_gate(logf_BKN):  # the seam table's example: bias c_i - c_j, c the cumulative log gate of the sequence
    c_BNK = logf_BKN.cumsum(1).transpose(1, 2)
    return lambda score, b, h, i, j: score + c_BNK[b, h, i] - c_BNK[b, h, j]


def key_subset(keep_BK):  # keys of a per-token subset, and not those at a distance of 1 mod 3
    return lambda b, h, i, j: keep_BK[b, j] & ((i - j) % 3 != 1)


def side_tensors(g, N):
    return {"logf": F.logsigmoid(torch.randn(B, L, N, generator=g) + 2).requires_grad_(),  # gates near 1
            "slopes": (torch.rand(N, generator=g) * 0.3).requires_grad_(),
            "keep": torch.rand(B, L, generator=g) < 0.7}


def core_mods(mods, side, local):
    """attention's keywords for a case; local: this rank's parts of the per-token side tensors."""
    if mods == "forget_gate":
        return {"score_mod": forget_gate, "per_token": (local["logf"],)}
    if mods == "alibi_softcap":
        slopes_N = side["slopes"]
        return {"score_mod": lambda s, b, h, i, j: CAP * torch.tanh((s + slopes_N[h] * (j - i)) / CAP)}
    if mods == "key_subset":
        return {"mask_mod": key_subset, "per_token": (local["keep"],)}
    if mods == "forget_gate+key_subset":  # two per-token tensors: each builder gets both
        return {"score_mod": lambda logf, keep: forget_gate(logf), "mask_mod": lambda logf, keep: key_subset(keep),
                "per_token": (local["logf"], local["keep"])}
    return {}


def functions(mods, side):
    """(score_mod, mask_mod) of a case over the whole sequence, as flex takes them (builders applied)."""
    kw = core_mods(mods, side, side)
    whole = kw.get("per_token", ())
    return tuple(kw[k](*whole) if k in kw and whole else kw.get(k) for k in ("score_mod", "mask_mod"))


def loop_mods(mods, side):
    """(score(logits, b, h, i, js), visible(b, h, i, j)) of a case for the loop; None where it has none."""
    if mods == "forget_gate":  # sum of the log gates of tokens j+1..i
        logf = side["logf"]
        return lambda x, b, h, i, js: x + torch.stack([logf[b, j + 1:i + 1, h].double().sum() for j in js]), None
    if mods == "alibi_softcap":
        slopes = side["slopes"]
        return lambda x, b, h, i, js: CAP * torch.tanh((x - slopes[h].double() * (i - js)) / CAP), None
    if mods == "key_subset":
        keep = side["keep"]
        return None, lambda b, h, i, j: bool(keep[b, j]) and (i - j) % 3 != 1
    if mods == "forget_gate+key_subset":
        return loop_mods("forget_gate", side)[0], loop_mods("key_subset", side)[1]
    return None, None


def rule(case, doc_BL, sel_BNQJ, extra=None):
    """visible(b, h, i, j) in global positions; sel_BNQJ over the whole sequence's query blocks."""
    bq, bk = case.cells or (1, 1)

    def visible(b, h, i, j):
        return (j <= i and (case.window is None or i - j < case.window) and (doc_BL is None or doc_BL[b, i] ==
                doc_BL[b, j]) and (sel_BNQJ is None or bool(sel_BNQJ[b, h, i // bq, j // bk]))
                and (extra is None or extra(b, h, i, j)))
    return visible


def selection(g, N, cells, index_form, empty_block=True):
    """A random selection over the whole sequence's cells: bool [B, N, L/bq, L/bk] and, in index form, the
    [B, N, Q, 3] key block lists (some slots empty) the boolean one is built from here (not by core)."""
    if cells is None:
        return None, None
    Q, J = L // cells[0], L // cells[1]
    if index_form:
        idx = torch.randint(0, J, (B, N, Q, 3), generator=g)
        idx[..., 0] = torch.where(torch.rand(B, N, Q, generator=g) < 0.5, 0, -1)  # the first block often, or none
        idx[..., 1:][torch.rand(B, N, Q, 2, generator=g) < 0.3] = -1
        sel = torch.zeros(B, N, Q, J, dtype=torch.bool)
        for b, h, q, t in torch.cartesian_prod(*(torch.arange(n) for n in idx.shape)).tolist():
            if idx[b, h, q, t] >= 0:
                sel[b, h, q, idx[b, h, q, t]] = True
    else:
        idx, sel = None, torch.rand(B, N, Q, J, generator=g) < 0.5
    if empty_block:  # one (batch, head, query block) attends nothing: its queries output 0
        sel[0, 1, Q // 2] = False
        if idx is not None:
            idx[0, 1, Q // 2] = -1
    return sel, idx


def inputs(name, seed):
    case = CASES[name]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, L, D, generator=g).requires_grad_() for n in (case.N, case.G, case.G))
    sink = torch.randn(case.N, generator=g).requires_grad_() if case.sinks else None
    doc_BL = doc_ids(L, 2, seed) if case.docs else None
    sel, idx = selection(g, case.N, case.cells, case.index_form)
    w = torch.randn(B, case.N, L, D, generator=g)  # loss = sum(out * w): a generic upstream gradient
    return q, k, v, sink, doc_BL, sel, idx, w, side_tensors(g, case.N)


def core_selection(case, sel, idx, rank, cp):
    """This rank's rows of the selection (its query blocks, split_for_cp order), from the index form through
    core's select_from_indices where the case has one."""
    if sel is None:
        return None
    rows = split_for_cp(sel if idx is None else idx, rank, cp, dim=2)
    return rows if idx is None else select_from_indices(rows, L // case.cells[1])


def errors(name, rank, cp, group, seed=0):
    """Relative errors of the output and every gradient of this rank's attention (cp ranks: keys and per-token
    tensors gathered over group) against the float64 loop over the whole sequence."""
    case = CASES[name]
    q, k, v, sink, doc_BL, sel, idx, w, side = inputs(name, seed)
    scale = 0.4
    score, extra = loop_mods(case.mods, side)
    ref = loop_attention(q, k, v, list(range(L)), rule(case, doc_BL, sel, extra), scale, sink, score)
    learned = {n: side[n] for n in {"forget_gate": ["logf"], "forget_gate+key_subset": ["logf"],
                                    "alibi_softcap": ["slopes"]}.get(case.mods, [])}
    leaves = {"q": q, "k": k, "v": v, **({"sink": sink} if case.sinks else {}), **learned}
    grads_ref = dict(zip(leaves, torch.autograd.grad((ref * w.double()).sum(), list(leaves.values()),
                                                     allow_unused=True)))
    local = {n: split_for_cp(t.detach(), rank, cp, dim=2).requires_grad_() for n, t in (("q", q), ("k", k), ("v", v))}
    mine = {n: t.detach().clone().requires_grad_() for n, t in (("sink", sink), ("slopes", side["slopes"]))
            if t is not None}
    mine["logf"] = split_for_cp(side["logf"].detach(), rank, cp, dim=1).requires_grad_()
    tokens = {"logf": mine["logf"], "keep": split_for_cp(side["keep"], rank, cp, dim=1)}
    mask = cp_attention_mask(L, rank, cp, case.window, doc_BL)
    out = attention(*local.values(), mask, group, scale, mine.get("sink"), core_selection(case, sel, idx, rank, cp),
                    case.cells or 1, **core_mods(case.mods, {"slopes": mine["slopes"]}, tokens))
    ours = {**local, **mine}
    grads = dict(zip(leaves, torch.autograd.grad((out * split_for_cp(w, rank, cp, dim=2)).sum(),
                                                 [ours[n] for n in leaves], allow_unused=True)))
    err = {"out": rel_err(out, split_for_cp(ref, rank, cp, dim=2))}
    for n in leaves:
        gr, gr_ref = grads[n], grads_ref[n]
        assert gr is not None and torch.isfinite(gr).all(), f"{name}: no or NaN gradient for {n}"
        if n in ("sink", "slopes"):  # a replicated parameter: each rank holds its queries' part, the sum is it
            if group is not None:
                dist.all_reduce(gr, group=group)
            err["d" + n] = rel_err(gr, gr_ref)
        else:  # per token: the gathers' backward hands each owner the sum over ranks of its chunks
            err["d" + n] = rel_err(gr, split_for_cp(gr_ref, rank, cp, dim=1 if n == "logf" else 2))
    return err


# fp32 path vs float64 loop: each output is a softmax-weighted sum of <= 32 terms of dot products of 8 terms;
# fp32 rounds each of the ~ 50 steps by <= 6e-8 relative, so ~ sqrt(50) * 6e-8 = 4e-7 in norm; gradients take
# two more such passes. The score functions add O(1) terms (|bias| <= 5: gates near 1, cumsum differences over
# shared prefixes round only the ~ |i - j| adds between them) at the same relative rounding. 2e-6 leaves margin
# on any CPU / thread count; a wrong key, block, gate index or position gives >= 1e-2.
TOL = 2e-6


@pytest.mark.parametrize("name", list(CASES))
def test_selection_matches_per_query_loop(name):
    """One process, CPU (the reference path): output and gradients of q, k, v, the sinks and the side tensors."""
    err = errors(name, 0, 1, None)
    print(name, {k: f"{e:.1e}" for k, e in err.items()})
    assert max(err.values()) <= TOL, err


def cp_worker(cp):
    mesh = build_mesh(cp=cp, device="cpu")
    out = {name: errors(name, mesh.coord("cp"), cp, mesh.group("cp")) for name in CASES}
    destroy_mesh()
    return out


def test_selection_under_cp2_matches_per_query_loop():
    """cp=2 on gloo: each rank's queries with its rows of the selection over the gathered keys, and score / mask
    functions over the gathered per-token tensors (the forget gate's cumsum over the whole sequence), equal the
    loop; the side tensors' gradients reach their owners."""
    per_rank = run_ranks(2, cp_worker, 2)
    worst = {(c, k): max(r[c][k] for r in per_rank) for c in CASES for k in per_rank[0][c]}
    print("cp=2 max relative errors:", {f"{c} {k}": f"{e:.1e}" for (c, k), e in worst.items()})
    assert max(worst.values()) <= TOL, worst


def test_flex_block_tables_per_head_skip_unselected_blocks():
    """The CUDA path's BlockMask at cp=2's views: per head, the tables plus the mask function give exactly the
    loop's visible pairs (flex blocks 4 and 8 with selection cells of 1 to 8 queries and 2 to 8 keys: several cells
    per tile, one, and a cell over several tiles; a case's mask_mod inside the tiles); without documents or a
    mask_mod every listed tile holds a visible pair, so unselected blocks are never computed; and flex_attention's
    forward (eager on CPU) with the cases' score functions equals the loop at rank 1's view (global positions
    8-23 at local indices 0-15)."""
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    worst = 0.0
    for name, case in CASES.items():
        q, k, v, sink, doc_BL, sel, idx, _, side = inputs(name, seed=1)
        side = {n: t.detach() for n, t in side.items()}
        score_mod, mask_mod = functions(case.mods, side)
        score, extra = loop_mods(case.mods, side)
        visible = rule(case, doc_BL, sel, extra)
        for rank in range(2):
            pos = rank_positions(L, rank, 2)
            mask = cp_attention_mask(L, rank, 2, case.window, doc_BL)
            if sel is not None:
                mask = mask.with_selection(core_selection(case, sel, idx, rank, 2), case.cells, B, case.N)
            expected = torch.tensor([[[[visible(b, h, i, j) for j in range(L)] for i in pos] for h in range(case.N)]
                                     for b in range(B)])
            for block in (4, 8):
                assert torch.equal(effective_mask(mask, block, mask_mod).expand_as(expected), expected), \
                    (name, rank, block)
                bm = mask.block_mask(block, mask_mod)
                assert bm.kv_num_blocks.shape[1] == (case.N if sel is not None else 1)  # heads only with a selection
                if not case.docs and mask_mod is None and sel is not None and min(case.cells) % block == 0:
                    tiles = torch.cartesian_prod(torch.arange(B), torch.arange(case.N), torch.arange(L // 2 // block))
                    for b, h, qb in tiles.tolist():  # tiles inside one cell and one chunk: tight
                        for kb in bm.kv_indices[b, h, qb, :bm.kv_num_blocks[b, h, qb]].tolist() + \
                                bm.full_kv_indices[b, h, qb, :bm.full_kv_num_blocks[b, h, qb]].tolist():
                            assert expected[b, h, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].any()
            if rank == 0:  # flex's forward traces its functions anew for each case (seconds); rank 1's view suffices
                continue
            q_l, k_d, v_d = split_for_cp(q.detach(), rank, 2, dim=2), k.detach(), v.detach()
            sink_d = None if sink is None else sink.detach()
            out = flex_attend(q_l, k_d, v_d, mask, 0.4, sink_d, score_mod, mask_mod, block=4)
            ref = loop_attention(q_l, k_d, v_d, pos, visible, 0.4, sink, score)
            worst = max(worst, rel_err(out, ref))
            assert rel_err(attention_reference(q_l, k_d, v_d, mask, 0.4, sink_d, score_mod, mask_mod), ref) <= TOL
    print(f"flex forward vs loop, max relative error {worst:.1e}")
    assert worst <= TOL


def test_functions_match_torch_flex_attention():
    """One process: attention with each case's score / mask functions equals torch's flex_attention (eager CPU
    forward) given the same functions and a block mask torch builds from the rule alone (create_block_mask), so
    that global positions are flex's own indices and a function sees what it sees under flex."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    worst = {}
    for name, case in CASES.items():
        if case.mods is None:
            continue
        q, k, v, _, doc_BL, _, _, _, side = inputs(name, seed=2)
        q, k, v = q.detach(), k.detach(), v.detach()
        side = {n: t.detach() for n, t in side.items()}
        score_mod, mask_mod = functions(case.mods, side)
        window = case.window or L

        def rule_mod(b, h, i, j, doc_BL=doc_BL, window=window, mask_mod=mask_mod):
            ok = (j <= i) & (i - j < window) & (True if doc_BL is None else doc_BL[b, i] == doc_BL[b, j])
            return ok if mask_mod is None else ok & mask_mod(b, h, i, j)

        theirs = flex_attention(q, k, v, score_mod, create_block_mask(rule_mod, B, case.N, L, L, device="cpu",
                                                                      BLOCK_SIZE=8), 0.4, enable_gqa=True)
        mask = cp_attention_mask(L, 0, 1, case.window, doc_BL) if case.window or case.docs else None
        ours = attention(q, k, v, mask, None, 0.4, **core_mods(case.mods, side, side))
        worst[name] = rel_err(ours, theirs)
    print("attention vs torch flex_attention:", {n: f"{e:.1e}" for n, e in worst.items()})
    assert len(worst) == 4 and max(worst.values()) <= TOL, worst  # both fp32, the same ops: ~ 1e-7


def test_compiled_flex_keeps_one_graph_as_layers_bring_new_functions():
    """The CUDA path compiles flex_attention once (dynamic=False) and every layer calls it with new closures (the
    CPMask's rule and the recipe's functions over new tensors: its gate, its key subset), as flex_attend passes
    them. torch.compile takes captured tensors as graph inputs: one graph for all. Checked on CPU with the aot_eager
    backend (dynamo's guards are the same as under inductor; CPU flex has no compiled backward)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_attention, backend="aot_eager", dynamic=False)
    g = torch.Generator().manual_seed(3)
    mask = cp_attention_mask(L, 1, 2, 9)
    for _ in range(3):  # three layers: new q, k, v, gate, subset and closures
        side = {n: t.detach() for n, t in side_tensors(g, 4).items()}
        score_mod, mask_mod = functions("forget_gate", side)[0], functions("key_subset", side)[1]
        q, k, v = torch.randn(B, 4, L // 2, D, generator=g), *(torch.randn(B, 4, L, D, generator=g) for _ in "kv")
        compiled(q, k, v, mask.mods(score_mod)[0], mask.block_mask(8, mask_mod))  # flex_attend's arguments
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


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
    assert largest.numel <= 2 * max(tables, B * L_), largest.numel
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


@pytest.mark.gpu
def test_gpu_score_and_mask_functions_train():
    """CUDA: the dispatcher (compiled flex) with a forget gate and a key subset over per-token tensors, documents, a
    window, sinks and a selection of 64-query x 128-key cells at a cp=2 rank's view (whole-sequence keys and
    per-token tensors), bf16 forward and backward against the fp32 reference: gradients reach q, k, v, the sinks
    and the gate through flex's backward of the captured tensor."""
    g = torch.Generator().manual_seed(0)
    Lg, N, G, Dg = 2048, 8, 2, 64
    doc_BL = torch.arange(Lg).div(700, rounding_mode="floor").expand(B, -1).cuda()
    sel = (torch.rand(B, N, Lg // 2 // 64, Lg // 128, generator=g) < 0.3).cuda()
    q, k, v = (torch.randn(B, n, s, Dg, generator=g).cuda().requires_grad_()
               for n, s in ((N, Lg // 2), (G, Lg), (G, Lg)))
    sink = torch.randn(N, generator=g).cuda().requires_grad_()
    logf = F.logsigmoid(torch.randn(B, Lg, N, generator=g) + 3).cuda().requires_grad_()
    keep = (torch.rand(B, Lg, generator=g) < 0.9).cuda()
    w = torch.randn(B, N, Lg // 2, Dg, generator=g).cuda()
    mask = cp_attention_mask(Lg, 1, 2, 512, doc_BL)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = attention(q, k, v, mask, None, None, sink, sel, (64, 128), score_mod=lambda logf, keep: forget_gate(logf),
                        mask_mod=lambda logf, keep: lambda b, h, i, j: keep[b, j], per_token=(logf, keep))
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v, sink, logf))
    ref = attention_reference(q, k, v, mask.with_selection(sel, (64, 128), B, N), None, sink, forget_gate(logf),
                              lambda b, h, i, j: keep[b, j])
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v, sink, logf))
    # bf16 inputs (8 bits of mantissa, 4e-3 relative per element) in sums of ~ 1000 terms: 2e-2 / 3e-2 in norm;
    # the output's error per element is that rounding, so below 1e-4 the run was not in bf16 (fp32 flex: ~ 1e-6)
    # (not the gradients': the sinks' and the gate's are sums over ~ 2000 queries, averaging it down)
    assert out.dtype == torch.bfloat16 and 1e-4 < rel_err(out, ref) < 2e-2
    assert all(rel_err(a, b) < 3e-2 for a, b in zip(grads, grads_ref)), [rel_err(a, b) for a, b in zip(grads, grads_ref)]
