"""Routers that keep 0..k experts per token (expert id -1 = an empty slot): dispatch, combine, grouped GEMMs,
the DualPipeV overlap steps and the Qwen3 load statistics against the same computation done densely in one
process (every expert applied to every token, weighted by the kept weights, plain torch); rows moved against
the analytic count; host syncs of one MoE layer (idle experts in the optimizer: tests/test_optimizer.py). One
spawned process group per world size runs all of that world's checks."""

import contextlib
import itertools
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.mesh import build_mesh, destroy_mesh
from core.moe import DispatchPlan, expert_matmul, grouped_weight_grad, moe_forward, weight_grads
from recipes.qwen3_30b_a3b.model import Model, ModelConfig
from tests import test_pipeline as toy
from tests.conftest import TINY_TRAIN_CONFIG
from tests.multiproc import run_ranks
from tests.test_train import rel_err

H, I, E, K = 16, 8, 8, 3  # hidden, expert ffn, experts, slots: rows of 16-byte multiples (grouped GEMM path)
TOKENS = 12  # per rank


def dense_moe(x_TH, ids_Tk, weights_Tk, w1_EHI, w2_EIH):
    """Every expert on every token, summed with the kept slots' weights (masked slots contribute nothing)."""
    gate_TE = torch.zeros(x_TH.shape[0], w1_EHI.shape[0]).scatter_add(
        1, ids_Tk.clamp(min=0), torch.where(ids_Tk >= 0, weights_Tk, 0))
    y_ETH = torch.einsum("eti,eih->eth", F.silu(torch.einsum("th,ehi->eti", x_TH, w1_EHI)), w2_EIH)
    return torch.einsum("te,eth->th", gate_TE, y_ETH)


def routings(tokens: int):
    """(name, ids [tokens, K], weights): the same top-K choice with random masks, all masked and none masked.
    Masked slots carry NaN weights, which must be ignored."""
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=g)
    mask = torch.rand(tokens, K, generator=g) < 0.45
    mask[0], mask[1] = True, False  # one token with no expert, one with all K
    yield "random masks", ids.masked_fill(mask, -1), weights.masked_fill(mask, float("nan"))
    yield "all masked", torch.full_like(ids, -1), weights
    yield "none masked", ids, weights


def core_checks(group) -> dict:
    """moe_forward at the ep group `group` (None: one process) against dense_moe over all ranks' tokens: errors of
    outputs and every gradient, and rows moved (measured, analytic), per routing."""
    n, me = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    L, mine = E // n, slice(me * TOKENS, (me + 1) * TOKENS)
    results = {}
    for name, ids_all, weights_all in routings(n * TOKENS):
        g = torch.Generator().manual_seed(2)
        x_all = torch.randn(n * TOKENS, H, generator=g)
        w1, w2 = torch.randn(E, H, I, generator=g), torch.randn(E, I, H, generator=g)
        probe = torch.randn(n * TOKENS, H, generator=g)
        ref_inputs = [t.clone().requires_grad_() for t in (x_all, weights_all, w1, w2)]
        ref = dense_moe(ref_inputs[0], ids_all, ref_inputs[1], ref_inputs[2], ref_inputs[3])
        (ref * probe).sum().backward()
        x, weights = x_all[mine].clone().requires_grad_(), weights_all[mine].clone().requires_grad_()
        w1_local, w2_local = (w[me * L:(me + 1) * L].clone().requires_grad_() for w in (w1, w2))
        def experts(x_QH, row_R, counts, weights, w1=w1_local, w2=w2_local):
            return expert_matmul(F.silu(expert_matmul(x_QH[row_R], w1, counts)), w2, counts) * weights[:, None]

        out, rows = moe_forward(x, ids_all[mine], weights, E, group, experts)
        (out * probe[mine]).sum().backward()
        assert not out[(ids_all[mine] < 0).all(1)].any(), name  # no expert: exactly zero routed output
        _, d_weights, d_w1, d_w2 = (t.grad for t in ref_inputs)
        errors = {"out": rel_err(out, ref[mine]), "dx": rel_err(x.grad, ref_inputs[0].grad[mine]),
                  "dweights": rel_err(weights.grad, d_weights[mine]),
                  "dw1": rel_err(w1_local.grad, d_w1[me * L:(me + 1) * L]),
                  "dw2": rel_err(w2_local.grad, d_w2[me * L:(me + 1) * L])}
        slots = ids_all[mine].tolist()  # analytic rows to other ranks: one per (token, rank), one per kept slot
        expected = [sum(len({e // L for e in t if e >= 0} - {me}) for t in slots),
                    sum(e >= 0 and e // L != me for t in slots for e in t)]
        results[name] = (errors, rows.tolist(), expected)
    bad_ids = torch.full((2, K), -1)
    bad_ids[0, 0] = E if me == 0 else 0  # only rank 0's router is wrong: every rank stops, none waits
    with pytest.raises(ValueError, match=f"expert ids must be < num_experts={E} .* 1 ids in this ep group are not"):
        DispatchPlan(bad_ids, E, group)
    return results


def toy_dense_reference(num_micro: int, drops):
    """tests/test_pipeline.py's ToyModel in one process, written out with dense_moe: (losses, grads, kept slots
    per token seen in each layer)."""
    model, ids = toy.ToyModel(), toy.batches(num_micro)
    stage = toy.ToyStage(model, [], True, True, ids, ids.numel())  # embedding, head and loss
    losses, kept = [], [set() for _ in model.layers]
    for mb in range(num_micro):
        [h] = stage.pre([], mb)
        for i, layer in enumerate(model.layers):
            h = h + torch.tanh(layer.mix(h))
            x_TH = h.flatten(0, 1)
            weights, top = layer.router(x_TH).softmax(-1).topk(toy.K, dim=-1)
            top = top.masked_fill(weights < drops[i % len(drops)], -1)
            kept[i] |= set((top >= 0).sum(1).tolist())
            h = h + dense_moe(x_TH, top, weights, layer.w1, layer.w2).view_as(h)
        [loss] = stage.post([h], mb)
        loss.backward()
        losses.append(loss.detach())
    return (torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}), kept


TOY_DROPS = (0.0, 0.3, 2.0)  # per layer: keep every slot, random masks, mask every slot


# ---------------------------------------------------------------------------------- host-sync counting

SYNC_METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "bincount", "unique",
                "masked_select", "repeat_interleave", "cpu", "numpy")
SYNC_FUNCTIONS = ("nonzero", "argwhere", "bincount", "unique", "masked_select", "repeat_interleave")


@contextlib.contextmanager
def count_host_syncs():
    """Names of the calls that read a tensor on the host (device-to-host syncs on a GPU), made inside the block:
    torch.Tensor methods and torch functions patched with a counting wrapper; indexing by a boolean mask counts
    too, repeat_interleave only without output_size."""
    calls, saved = [], []

    def patch(owner, name, counts):
        fn, own = getattr(owner, name), owner.__dict__.get(name)

        def counted(*args, **kwargs):
            if counts(*args, **kwargs):
                calls.append(name)
            return fn(*args, **kwargs)
        saved.append((owner, name, own))
        setattr(owner, name, counted)

    always = lambda *args, **kwargs: True  # noqa: E731
    sized = lambda *args, output_size=None, **kwargs: output_size is None  # noqa: E731
    for owner, names in ((torch.Tensor, SYNC_METHODS), (torch, SYNC_FUNCTIONS)):
        for name in names:
            patch(owner, name, sized if name == "repeat_interleave" else always)
    is_mask = lambda i: isinstance(i, torch.Tensor) and i.dtype == torch.bool  # noqa: E731
    patch(torch.Tensor, "__getitem__",  # x[mask] runs a nonzero
          lambda self, index: any(map(is_mask, index if isinstance(index, tuple) else [index])))
    try:
        yield calls
    finally:
        for owner, name, own in reversed(saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


@contextlib.contextmanager
def cuda_sync_warnings():
    """The synchronizing CUDA calls made inside the block, as torch.cuda.set_sync_debug_mode reports them."""
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode(0)
            calls += [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def qwen3_layer_checks(ep_group, device="cpu", counter=count_host_syncs):
    """One Qwen3 MoE layer whose router masks slots (0..k kept per token), on CUDA under bf16 autocast: the host
    syncs of its forward and backward (after one uncounted warm-up), and its expert load (take_expert_load)
    against the kept slots counted here."""
    cfg = ModelConfig(**{k: v for k, v in TINY_TRAIN_CONFIG.items() if k != "model_type"})
    torch.manual_seed(0)
    model = Model(cfg, layers=[0], embed=False, head=False, ep_group=ep_group).to(device)
    model.set_positions(torch.arange(16, device=device).expand(2, 16))
    layer, routed = model.layers["0"], []
    forward = layer.mlp.gate.forward

    def masking_router(x_TH):
        logits, weights, ids = forward(x_TH)
        routed.append(ids.masked_fill(torch.arange(ids.numel(), device=device).view_as(ids) % 5 % 4 == 0, -1))
        return logits, weights, routed[-1]
    layer.mlp.gate.forward = masking_router
    g = torch.Generator().manual_seed(0 if ep_group is None else dist.get_rank())

    def run(forward_counter, backward_counter):
        x = torch.randn(2, 16, cfg.hidden_size, generator=g).to(device).requires_grad_()
        with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"), forward_counter as forward_syncs:
            h, aux = layer([x, torch.zeros(2, cfg.num_experts, device=device)])
        with backward_counter as backward_syncs:
            (h.float().pow(2).sum() + aux.sum()).backward()
        return forward_syncs, backward_syncs

    run(contextlib.nullcontext(), contextlib.nullcontext())  # warm-up: kernels compile, caches fill
    model.take_expert_load()
    syncs = run(counter(), counter())
    kept = routed[-1][routed[-1] >= 0]
    return {"syncs": syncs, "load": model.take_expert_load()[0].tolist(),
            "kept load": torch.bincount(kept, minlength=cfg.num_experts).float().tolist(),
            "slots": routed[-1].numel(), "kept": kept.numel()}


# ------------------------------------------------------------------------------------------- workers


def world_worker():
    """Every check of one world size (2 or 4) on one process group: core dispatch at ep = world, DualPipeV with
    masking routers at pp=2 x ep=world/2, and at world 2 the Qwen3 layer at ep=2."""
    world = int(os.environ["WORLD_SIZE"])
    mesh = build_mesh(pp=2, ep=world // 2, dp=1)
    out = {"core": core_checks(dist.group.WORLD)}
    out["pipeline"] = toy.run_pipeline(mesh, 4, overlap=True, delay=True, drops=TOY_DROPS)
    if world == 2:
        out["qwen3"] = qwen3_layer_checks(dist.group.WORLD)
    destroy_mesh()
    return out


# --------------------------------------------------------------------------------------------- tests

TOL = 1e-5


def check_core(results):
    for name, (errors, rows, expected) in results.items():
        assert max(errors.values()) <= TOL, (name, errors)
        assert rows == expected, (name, rows, expected)


def check_pipeline(results, ep):
    ref, kept = toy_dense_reference(4, TOY_DROPS)
    assert kept[0] == {toy.K} and kept[1] == set(range(toy.K + 1)) and kept[2] == {0}, kept  # masks as meant
    return toy.check([r["pipeline"] for r in results], 4, ep, ref)


def test_one_process():
    check_core(core_checks(None))
    q = qwen3_layer_checks(None)
    assert q["load"] == q["kept load"] and 0 < q["kept"] < q["slots"], q
    assert q["syncs"] == (["tolist"], []), q["syncs"]  # one host sync: the plan's sizes; none in the backward


@pytest.mark.gpu
def test_gpu_one_sync_per_layer():
    q = qwen3_layer_checks(None, "cuda", cuda_sync_warnings)
    assert q["load"] == q["kept load"], q
    assert [len(s) for s in q["syncs"]] == [1, 0], q["syncs"]


def test_world_2_ep2_and_pp2():
    results = run_ranks(2, world_worker)
    for r in results:
        check_core(r["core"])
        q = r["qwen3"]
        assert q["load"] == q["kept load"] and 0 < q["kept"] < q["slots"], q
        assert q["syncs"] == (["tolist"], []), q["syncs"]
    check_pipeline(results, ep=1)


def test_world_4_ep4_and_pp2_ep2():
    results = run_ranks(4, world_worker)
    for r in results:
        check_core(r["core"])
    check_pipeline(results, ep=2)


def test_grouped_weight_gradient_equals_the_loop():
    """dW = grouped_mm(x^T, dy, offs) (the transposed-A form) against a per-expert loop written here, with empty
    experts (first, middle, last, all), fp32 and bf16, immediate and delayed (accumulated into an fp32 .grad);
    rows of 16-byte multiples (torch's grouped GEMM) and not (the loop inside core)."""
    g = torch.Generator().manual_seed(5)
    for (dtype, tol), (Kd, N) in itertools.product(((torch.float32, 1e-6), (torch.bfloat16, 1e-2)), ((16, 24), (6, 10))):
        for counts in ([0, 5, 0, 9, 2, 0], [0] * 6, [16, 0, 0, 0, 0, 0]):
            counts = torch.tensor(counts)
            x = torch.randn(int(counts.sum()), Kd, generator=g).to(dtype)
            dy = torch.randn(int(counts.sum()), N, generator=g).to(dtype)
            loop = torch.stack([x_e.double().T @ dy_e.double() for x_e, dy_e in
                                zip(x.split(counts.tolist()), dy.split(counts.tolist()))])
            dw = grouped_weight_grad(x, dy, counts)
            assert dw.dtype == dtype and dw.shape == (6, Kd, N)
            assert rel_err(dw, loop) <= tol if loop.any() else not dw.any()
            assert not dw[counts == 0].any()
            w = torch.nn.Parameter(torch.randn(6, Kd, N, generator=g))  # fp32 parameter, compute in dtype
            for delayed in (False, True):
                w.grad = None
                weight_grads.enabled = delayed
                expert_matmul(x, w, counts).backward(dy)
                weight_grads.enabled = False
                if delayed:
                    assert w.grad is None
                    weight_grads.flush()
                    weight_grads.pop()
                assert w.grad.dtype == torch.float32 and torch.equal(w.grad, dw.float()), (dtype, delayed)
