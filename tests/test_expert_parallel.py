"""Expert parallelism: the deduplicated all-to-all dispatch/combine against a single-process computation, the
rows it moves, the Qwen3 model's gradients at ep=2/4 and dp2 x ep2, training parity, resharding checkpoints,
export from a sharded run, the optimizer state per rank and the aux-loss-free bias."""

import functools
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from core.fsdp import FSDPAdamW, shard_model
from core.mesh import build_mesh, destroy_mesh
from core.moe import grouped_mm, moe_forward, update_expert_bias
from core.placement import Placement
from recipes.qwen3_30b_a3b.model import Model, ModelConfig
from tests.multiproc import run_ranks
from tests.test_train import (
    assert_matches_single,
    assert_same_checkpoint,
    held_experts,
    rel_err,
    run_train,
    train_args,
)

H, I, E = 8, 6, 4  # hidden, expert ffn, experts for the core-level checks


def expert_mlp(w1, w2):
    def experts(x_QH, row_R, counts, w_R):
        return grouped_mm(F.silu(grouped_mm(x_QH[row_R], w1, counts)), w2, counts) * w_R[:, None]

    return experts


def routings(tokens: int, k_max: int):
    """(name, topk_ids, k) routings of `tokens` tokens, extreme ones included."""
    g = torch.Generator().manual_seed(1)
    rand2 = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
    yield "top2", rand2
    yield "top1", rand2[:, :1]
    yield "topk=E", torch.stack([torch.randperm(E, generator=g) for _ in range(tokens)])
    yield "all to expert 0", torch.stack([torch.tensor([0, 1 + t % (E - 1)]) for t in range(tokens)])[:, :1]
    yield "all to the last rank's experts", torch.full((tokens, 1), E - 1)


PLACEMENTS = {2: [None, [1, 0, 1, 1], [0, 0, 0, 0]], 4: [None, [3, 0, 0, 1]]}  # even; uneven and non-contiguous;
# a rank without experts (the ep rank of each expert, as --expert-placement gives it)


def dispatch_worker(tokens_per_rank: int):
    """Every rank builds the same global problem, runs its token slice through its experts with the ep group,
    and returns errors against the single-process computation plus rows moved vs the analytic count; for each
    expert placement of PLACEMENTS (a rank's experts: tests/test_train.py:held_experts)."""
    mesh = build_mesh(dp=1, ep=int(os.environ["WORLD_SIZE"]))
    group, n, me = mesh.group("ep"), mesh.ep, mesh.coord("ep")
    results = []
    for table in PLACEMENTS[n]:
        mine_E = held_experts(E, n, me, table)
        rank_E = [next(r for r in range(n) if e in held_experts(E, n, r, table)) for e in range(E)]
        placement = None if table is None else Placement(table, n)
        for name, ids_all in routings(n * tokens_per_rank, E):
            k = ids_all.shape[1]
            g = torch.Generator().manual_seed(2)
            x_all = torch.randn(n * tokens_per_rank, H, generator=g, requires_grad=True)
            w_all = torch.rand(n * tokens_per_rank, k, generator=g, requires_grad=True)
            w1 = torch.randn(E, H, I, generator=g, requires_grad=True)
            w2 = torch.randn(E, I, H, generator=g, requires_grad=True)
            probe = torch.randn(n * tokens_per_rank, H, generator=g)
            ref, _ = moe_forward(x_all, ids_all, w_all, E, None, expert_mlp(w1, w2))
            (ref * probe).sum().backward()

            mine = slice(me * tokens_per_rank, (me + 1) * tokens_per_rank)
            dest = [[rank_E[e] for e in t] for t in ids_all[mine].tolist()]  # analytic: one row per (token, other
            expected = [sum(len(set(d) - {me}) for d in dest), sum(r != me for d in dest for r in d)]  # rank) vs slot
            for recompute in (False, True):  # the experts checkpointed, their received rows dispatched again
                x = x_all.detach()[mine].clone().requires_grad_(True)
                w = w_all.detach()[mine].clone().requires_grad_(True)
                w1_local = w1.detach()[mine_E].clone().requires_grad_(True)
                w2_local = w2.detach()[mine_E].clone().requires_grad_(True)
                experts = expert_mlp(w1_local, w2_local)
                if recompute:
                    experts = functools.partial(checkpoint, experts, use_reentrant=False)
                out, rows = moe_forward(x, ids_all[mine], w, E, group, experts, placement, recompute)
                (out * probe[mine]).sum().backward()
                errors = {"out": rel_err(out, ref[mine]), "dx": rel_err(x.grad, x_all.grad[mine]),
                          "dweights": rel_err(w.grad, w_all.grad[mine])}
                if mine_E:  # (a rank without experts has no weights)
                    errors.update({"dw1": rel_err(w1_local.grad, w1.grad[mine_E]),
                                   "dw2": rel_err(w2_local.grad, w2.grad[mine_E])})
                results.append((f"{name}, placement {table}" + (", recompute_dispatch" if recompute else ""),
                                errors, rows.tolist(), expected))
    destroy_mesh()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_equals_single_process(world):
    for rank_results in run_ranks(world, dispatch_worker, 6):
        for name, errors, rows, expected in rank_results:
            assert max(errors.values()) <= 1e-5, (world, name, errors)
            assert rows == expected, (world, name, rows, expected)
            if name == "topk=E, placement None":  # a token goes to each other rank once, not once per expert there
                assert rows == [6 * (world - 1), 6 * (world - 1) * (E // world)]


# ----------------------------------------------------------------------------- model-level gradients


def model_grads_worker(config_path, dp: int, ep: int):
    """Gradients of the ep-sharded Qwen3 model, each rank on its own 2 sequences, against one process running
    the same per-rank micro-batches over the full model: losses and every parameter's gradient."""
    mesh = build_mesh(dp=dp, ep=ep)
    cfg = ModelConfig.from_hf(config_path)
    torch.manual_seed(0)
    model = Model(cfg, ep_group=mesh.group("ep"))
    torch.manual_seed(0)
    full = Model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (mesh.world * 2, 16), generator=torch.Generator().manual_seed(3))
    ref_losses = []
    for r in range(mesh.world):  # one process, the same micro-batches
        out = full.forward_train(ids[2 * r:2 * r + 2], ids[2 * r:2 * r + 2])
        ref_losses.append(out.loss_sum / ids.numel() + 0.01 * out.aux_loss)
        ref_losses[-1].backward()
    r = mesh.data_rank
    out = model.forward_train(ids[2 * r:2 * r + 2], ids[2 * r:2 * r + 2])
    loss = out.loss_sum / ids.numel() + 0.01 * out.aux_loss
    loss.backward()
    errors = {"loss": rel_err(loss.detach(), ref_losses[r].detach())}
    sharded = Model(cfg, ep_group=mesh.group("ep"))  # FSDP2 over the same mesh: the optimizer's state
    state_bytes = FSDPAdamW(sharded, shard_model(sharded, mesh, bf16=False, once=False), 1e-3, 0.0, (0.9, 0.95), 1e-8).state_bytes()
    full_params = dict(full.named_parameters())
    for name, p in model.named_parameters():
        experts = ".mlp.experts." in name
        grad = p.grad.clone()
        group = mesh.group("dp") if experts else mesh.group("dp", "ep")
        if group is not None:
            dist.all_reduce(grad, group=group)
        ref = full_params[name].grad
        if experts:
            mine = held_experts(cfg.num_experts, ep, mesh.coord("ep"))
            ref = ref[mine]
            errors["init " + name] = rel_err(p.detach(), full_params[name].detach()[mine])
        errors[name] = rel_err(grad, ref)
    destroy_mesh()
    return errors, state_bytes


@pytest.mark.parametrize("dp,ep", [(1, 2), (1, 4), (2, 2)])
def test_model_gradients_equal_single_process(tiny_train_setup, dp, ep):
    """...and Adam state per rank falls as 1/(dp*ep) (FSDP2: dense parameters sharded over dp*ep, experts split
    over ep and sharded over dp)."""
    config, _ = tiny_train_setup
    one_process = 8 * sum(p.numel() for p in Model(ModelConfig.from_hf(config)).parameters())  # fp32 exp_avg(_sq)
    for errors, (held, _) in run_ranks(dp * ep, model_grads_worker, config, dp, ep):
        assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}
        assert held <= one_process / (dp * ep) * 1.02, (dp, ep, held, one_process)  # rows of last shards only


# ------------------------------------------------------------------------------------- training runs


def test_training_at_dp2_ep2_equals_single_process(tiny_train_setup, tmp_path):
    """With aux-loss-free balancing on: the expert biases (updated from the global load) are bit-identical on every
    rank and equal one process's; they moved, and so did the routing (the losses differ from a run without).
    (ep=2 alone runs for every recipe in tests/test_recipes.py.)"""
    config, data = tiny_train_setup
    args = lambda out, **extra: train_args(config, data, tmp_path / out, expert_bias_rate=0.01, **extra)
    single_losses, single_norms, single_weights = run_train(args("single"))
    assert max(single_norms) > 0.05, "clipping should be active so that the global norm is exercised"
    biases = [w for name, w in single_weights.items() if name.endswith("expert_bias")]
    assert len(biases) == 2 and all(b.any() for b in biases)
    assert run_train(train_args(config, data, tmp_path / "no_bias", steps=2))[0][1] != single_losses[1]
    results = run_ranks(4, run_train, args("dp2ep2", ep=2, dp=2))
    assert_matches_single((single_losses, single_norms, single_weights), results)


def test_checkpoint_reshards_across_dp_and_ep(tiny_train_setup, tmp_path):
    """Saved at ep=2, resumed at dp=2 (ep=1) and at one process: the same losses as the uninterrupted run, and the
    same state at the end (weights, Adam state, lr, scheduler, data position; within layout rounding)."""
    config, data = tiny_train_setup
    full = run_ranks(2, run_train, train_args(config, data, tmp_path / "a", steps=4, ckpt_every=2, ep=2))
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000002"
    at_dp2 = run_ranks(2, run_train, train_args(config, data, tmp_path / "b", steps=4, ckpt_every=2, resume=checkpoint))
    at_one = run_train(train_args(config, data, tmp_path / "c", steps=4, ckpt_every=2, resume=checkpoint))
    for resumed in (*at_dp2, at_one):  # losses, grad norms, and each ep rank's weights vs the resumed full model
        assert_matches_single(resumed, [(losses[2:], norms[2:], w) for losses, norms, w in full])
    for run in ("b", "c"):
        assert_same_checkpoint(tmp_path / run / "checkpoints/step_00000004", tmp_path / "a/checkpoints/step_00000004",
                               tmp_path, tol=1e-5)


def test_export_from_expert_sharded_run(tiny_train_setup, tmp_path):
    """--hf-checkpoint in at ep=2 (each rank reads only its experts), export out: the complete model, identical."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.conftest import TINY_TRAIN_CONFIG
    from tools.hf_parity import folder_tensors

    _, data = tiny_train_setup
    fields = {k: v for k, v in TINY_TRAIN_CONFIG.items() if k != "model_type"}
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).save_pretrained(tmp_path / "hf_in")
    run_ranks(2, run_train, train_args("unused", data, tmp_path / "run", steps=1, lr=0.0, ep=2,
                                       hf_checkpoint=tmp_path / "hf_in", export_hf=tmp_path / "hf_out"))
    before, after = folder_tensors(tmp_path / "hf_in"), folder_tensors(tmp_path / "hf_out")
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    files = set(json.loads((tmp_path / "hf_out" / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) == 2  # each ep rank wrote its own experts
    Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf_out")  # transformers loads it


def test_expert_bias_balances_load():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10.0, 2.0, 4.0, 0.0]), rate=0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])  # mean 4: above goes down, below up


def test_expert_bias_changes_the_choice_not_the_weights():
    """The router picks top-k of softmax(logits) + bias (DeepSeek-V3's rule) but weights the chosen experts by the
    unbiased softmax (renormalised over the k), with gradients through the unbiased probabilities; the aux-loss
    statistics ignore the bias. Checked against the rule written out here in plain torch."""
    from recipes.qwen3_30b_a3b.model import MoE

    cfg = ModelConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I)
    g = torch.Generator().manual_seed(0)
    moe = MoE(cfg, range(E), None, None)
    router_w = torch.randn(E, H, generator=g)
    x = torch.randn(64, H, generator=g)
    probe = torch.randn(64, 2, generator=g)
    results = {}
    for bias in (torch.zeros(E), torch.tensor([0.2, -0.1, 0.0, -0.15])):
        moe.gate.weight = torch.nn.Parameter(router_w.clone())
        moe.gate.expert_bias.copy_(bias)
        xi = x.clone().requires_grad_()
        weights, ids, aux = moe.route(xi, torch.zeros(2, E))
        (weights * probe).sum().backward()
        w_ref, x_ref = router_w.clone().requires_grad_(), x.clone().requires_grad_()
        probs = (x_ref @ w_ref.T).softmax(-1)
        ids_ref = (probs + bias).topk(2, dim=-1).indices
        weights_ref = probs.gather(1, ids_ref)
        weights_ref = weights_ref / weights_ref.sum(-1, keepdim=True)
        (weights_ref * probe).sum().backward()
        assert torch.equal(ids, ids_ref)
        for a, b in ((weights, weights_ref), (moe.gate.weight.grad, w_ref.grad), (xi.grad, x_ref.grad)):
            assert rel_err(a.detach(), b.detach()) <= 1e-6
        results[bias.any().item()] = weights.detach(), ids, aux
    (w0, ids0, aux0), (w1, ids1, aux1) = results[False], results[True]
    same = (ids0 == ids1).all(-1)
    assert 0 < same.sum() < 64  # the bias changed the choice of some tokens...
    assert torch.equal(w0[same], w1[same])  # ...and nothing else about the tokens it did not move
    assert torch.equal(aux0, aux1)  # the aux loss (transformers' definition) sees the unbiased top-k
