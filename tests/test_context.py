"""Context-parallel attention: cp=2 and cp=4 on gloo give the single-device outputs and gradients (fp32, relative
error <= 1e-5) for causal, sliding window + sinks, packed documents, GQA and the MLA latent form; the split
round-trips; the single-device reference itself matches PyTorch's SDPA and a naive loop."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.attention import attention, attention_reference, cp_attention_mask
from core.context import cp_positions, doc_ids_from_eos, gather_sequence, merge_from_cp, split_for_cp
from core.mesh import build_mesh, destroy_mesh
from tests.multiproc import run_ranks
from tools.cp_traffic import cp_bytes_received_per_layer

B, S, EOS = 2, 32, 2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).requires_grad_()


def packed_doc_ids(g):
    """Doc ids [B, S] of packed sequences with a few documents each, from eos tokens as the data holds them."""
    ids = torch.randint(3, 50, (B, S), generator=g)
    ids[0, [4, 13, 14, 27]] = EOS  # a one-token document in the middle, boundaries inside cp chunks
    ids[1, [9, 21]] = EOS
    return doc_ids_from_eos(ids, EOS)


# ------------------------------------------------------------------------------- cp workers (spawned)

CASES = {  # name: (N, G, window, sinks, docs, scale)
    "causal": (4, 4, None, False, False, None),
    "gqa": (4, 2, None, False, False, None),
    "window_sinks": (4, 2, 8, True, False, None),
    "docs": (4, 4, None, False, True, 0.3),
    "docs_window_sinks_gqa": (4, 2, 8, True, True, None),
}


def check_case(rank, cp, group, N, G, window, sinks, docs, scale, D=8):
    g = torch.Generator().manual_seed(0)  # the same whole-sequence inputs on every rank
    q, k, v = randn(g, B, N, S, D), randn(g, B, G, S, D), randn(g, B, G, S, D)
    sink = randn(g, N) if sinks else None
    w_out = torch.randn(B, N, S, D, generator=g)  # loss = sum(out * w_out): a generic upstream gradient
    doc_ids = packed_doc_ids(g) if docs else None

    out = attention(q, k, v, cp_attention_mask(S, 0, 1, window, doc_ids), scale=scale, sinks_N=sink)  # one device, whole sequence
    (out * w_out).sum().backward()

    local = [split_for_cp(t.detach(), rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    sink_l = sink.detach().clone().requires_grad_() if sinks else None
    out_l = attention(*local, cp_attention_mask(S, rank, cp, window, doc_ids), group, scale, sink_l)
    (out_l * split_for_cp(w_out, rank, cp, dim=2)).sum().backward()

    err = {"out": rel_err(out_l, split_for_cp(out.detach(), rank, cp, dim=2))}
    for name, t_l, t in zip("qkv", local, (q, k, v)):
        err["d" + name] = rel_err(t_l.grad, split_for_cp(t.grad, rank, cp, dim=2))
    if sinks:  # a replicated parameter: each rank holds the part from its queries; the sum is the gradient
        dist.all_reduce(sink_l.grad, group=group)
        err["dsink"] = rel_err(sink_l.grad, sink.grad)
    return err


def mla_expand(latent_BKX, w_kv, N, C, Dn, E):
    """DeepSeek-style expansion: latent [c_kv | k_rope] -> per-head k = [k_nope | k_rope] [B, N, K, Dn+R] and
    v [B, N, K, E]; the rope key is shared by all heads."""
    Bk, K, _ = latent_BKX.shape
    c_BKC, rope_BKR = latent_BKX[..., :C], latent_BKX[..., C:]
    k_nope_BKND, v_BKNE = (c_BKC @ w_kv.T).view(Bk, K, N, Dn + E).split([Dn, E], -1)
    k_BKND = torch.cat([k_nope_BKND, rope_BKR[:, :, None].expand(-1, -1, N, -1)], -1)
    return k_BKND.transpose(1, 2), v_BKNE.transpose(1, 2)


def check_mla(rank, cp, group, N=4, C=16, R=4, Dn=8, E=6, scale=0.2):
    g = torch.Generator().manual_seed(1)
    latent, w_kv = randn(g, B, S, C + R), randn(g, N * (Dn + E), C, scale=C**-0.5)
    q = randn(g, B, N, S, Dn + R)
    w_out = torch.randn(B, N, S, E, generator=g)

    out = attention(q, *mla_expand(latent, w_kv, N, C, Dn, E), scale=scale)
    (out * w_out).sum().backward()

    latent_l, q_l = (split_for_cp(t.detach(), rank, cp, dim).requires_grad_() for t, dim in ((latent, 1), (q, 2)))
    w_kv_l = w_kv.detach().clone().requires_grad_()
    latent_BKX = gather_sequence(latent_l, group, dim=1)  # what travels: C + R numbers per token
    out_l = attention(q_l, *mla_expand(latent_BKX, w_kv_l, N, C, Dn, E), cp_attention_mask(S, rank, cp), group, scale)
    (out_l * split_for_cp(w_out, rank, cp, dim=2)).sum().backward()
    dist.all_reduce(w_kv_l.grad, group=group)  # replicated weight: sum of the ranks' parts
    return {"out": rel_err(out_l, split_for_cp(out.detach(), rank, cp, dim=2)),
            "dq": rel_err(q_l.grad, split_for_cp(q.grad, rank, cp, dim=2)),
            "dlatent": rel_err(latent_l.grad, split_for_cp(latent.grad, rank, cp, dim=1)),
            "dw_kv": rel_err(w_kv_l.grad, w_kv.grad)}


def cp_worker(cp: int) -> dict:
    mesh = build_mesh(cp=cp, device="cpu")
    group, rank = mesh.group("cp"), mesh.coord("cp")
    errors = {name: check_case(rank, cp, group, *args) for name, args in CASES.items()}
    errors["mla_latent"] = check_mla(rank, cp, group)
    doc_ids = packed_doc_ids(torch.Generator().manual_seed(3))  # integer tensors gather too (no grad)
    gathered = gather_sequence(split_for_cp(doc_ids, rank, cp), group)
    errors["gather_int"] = {"mismatch": float(not torch.equal(gathered, doc_ids))}
    destroy_mesh()
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_single_device(cp):
    per_rank = run_ranks(cp, cp_worker, cp)
    worst = {case: {k: max(r[case][k] for r in per_rank) for k in errs} for case, errs in per_rank[0].items()}
    print(f"cp={cp} max relative errors:", {c: {k: f"{e:.1e}" for k, e in errs.items()} for c, errs in worst.items()})
    for case, errs in worst.items():
        for name, e in errs.items():
            assert e <= 1e-5, f"cp={cp} {case} {name}: relative error {e:.2e}"


# ---------------------------------------------------------------------------------------- in process


def test_split_merge_round_trip_and_positions():
    x_BS = torch.arange(B * 16).view(B, 16)
    for cp in (1, 2, 4):
        parts = [split_for_cp(x_BS, r, cp) for r in range(cp)]
        assert torch.equal(merge_from_cp(parts), x_BS)
        for r in range(cp):  # positions are the global ones, and split like tokens
            assert torch.equal(cp_positions(16, r, cp), split_for_cp(torch.arange(16), r, cp, dim=0))
    assert cp_positions(8, 0, 2).tolist() == [0, 1, 6, 7] and cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    x_BNSD = torch.randn(B, 3, 16, 4)
    assert torch.equal(merge_from_cp([split_for_cp(x_BNSD, r, 4, dim=2) for r in range(4)], dim=2), x_BNSD)


def test_sequence_not_divisible_raises():
    with pytest.raises(ValueError, match=r"not divisible by 2\*cp = 8.*--seq-len"):
        split_for_cp(torch.zeros(B, 30), 0, 4)
    with pytest.raises(ValueError, match=r"2\*cp"):
        cp_positions(30, 1, 4)
    with pytest.raises(ValueError, match=r"2\*cp"):
        cp_bytes_received_per_layer(30, 4, 576)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        attention(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


def naive_attention(q, k, v, scale, visible, sinks=None):
    """Row by row in float64: softmax over the visible keys (+ the sink logit) of q . k * scale."""
    Bq, N, Sq, _ = q.shape
    n = N // k.shape[1]
    out = torch.zeros(Bq, N, Sq, v.shape[-1], dtype=torch.float64)
    for b in range(Bq):
        for h in range(N):
            for i in range(Sq):
                js = [j for j in range(k.shape[2]) if visible(b, i, j)]
                logits = k[b, h // n, js].double() @ q[b, h, i].double() * scale
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h].double().view(1)])
                out[b, h, i] = logits.softmax(0)[: len(js)] @ v[b, h // n, js].double()
    return out


def test_reference_matches_pytorch_and_naive_loop():
    g = torch.Generator().manual_seed(2)
    N, G, D, Sq = 4, 2, 8, 16
    q, k, v = randn(g, B, N, Sq, D), randn(g, B, G, Sq, D), randn(g, B, G, Sq, D)
    # plain causal: explicit form == PyTorch SDPA (outputs and gradients) == naive loop; attention's fast path too
    ref = attention_reference(q, k, v)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_err(ref, sdpa) <= 1e-6 and rel_err(attention(q, k, v), sdpa) <= 1e-6
    assert rel_err(ref, naive_attention(q, k, v, D**-0.5, lambda b, i, j: j <= i)) <= 1e-6
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    grads_sdpa = torch.autograd.grad(sdpa.square().sum(), (q, k, v))
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(grads_ref, grads_sdpa))
    # window + documents + sinks + GQA + custom scale: explicit form == naive loop
    window, sinks, scale = 5, randn(g, N), 0.3
    doc = packed_doc_ids(g)[:, :Sq]
    mask = cp_attention_mask(Sq, window=window, doc_ids_BK=doc)
    visible = lambda b, i, j: i - window < j <= i and doc[b, i] == doc[b, j]
    assert rel_err(attention(q, k, v, mask, scale=scale, sinks_N=sinks), naive_attention(q, k, v, scale, visible, sinks)) <= 1e-6
    # the same without sinks: equal to PyTorch's SDPA given the boolean mask of the rule, outputs and gradients
    # (both fp32 over <= 16 keys of 8 numbers: a few roundings of 6e-8 apart, ~ 1e-7; a wrong key gives >= 1e-2)
    dense_BSK = torch.tensor([[[visible(b, i, j) for j in range(Sq)] for i in range(Sq)] for b in range(B)])
    sdpa = F.scaled_dot_product_attention(q, k, v, dense_BSK[:, None], scale=scale, enable_gqa=True)
    out = attention(q, k, v, mask, scale=scale)
    assert rel_err(out, sdpa) <= 1e-6
    grads, grads_sdpa = (torch.autograd.grad(o.square().sum(), (q, k, v)) for o in (out, sdpa))
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(grads, grads_sdpa))


def test_bytes_received():
    assert cp_bytes_received_per_layer(32768, 1, 1024) == 0
    assert cp_bytes_received_per_layer(32768, 2, 4 * (128 + 128)) == 16384 * 1024 * 2
    assert cp_bytes_received_per_layer(32768, 8, 512 + 64, bytes_per_element=4) == 7 * 4096 * 576 * 4
