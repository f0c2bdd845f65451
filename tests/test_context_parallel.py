"""Context parallelism in the Qwen3 recipe: the model's loss, aux loss and every gradient at cp=2 and cp2 x ep2
equal one process; training at cp=2 and at dp1 x cp2 x ep2 equals one process (losses, grad norms, weights
after 5 steps); a sequence length not divisible by 2*cp is a clear error. (The attention op: test_context.py.)"""

import importlib

import pytest
import torch
import torch.distributed as dist

from core.context import cp_positions, split_for_cp
from core.mesh import build_mesh, destroy_mesh
from recipes.qwen3_30b_a3b import train
from tests.multiproc import run_ranks
from tests.test_train import assert_matches_single, rel_err, run_train, train_args

AUX_COEF = 0.1  # large enough that the aux loss's gradient is visible in the router's


def model_grads_worker(config_path, cp: int, ep: int, recipe: str = "qwen3_30b_a3b"):
    """Each (ep) data rank has its own 2 sequences (one micro-batch) and each cp rank its 2 of their 2*cp chunks;
    one process runs the same micro-batches whole over the full model. Losses, aux losses, expert load, whole-
    sequence logits and every parameter's gradient."""
    mod = importlib.import_module(f"recipes.{recipe}.model")
    mesh = build_mesh(dp=1, cp=cp, ep=ep)
    cp_group, cp_rank, r = mesh.group("cp"), mesh.coord("cp"), mesh.data_rank
    cfg = mod.ModelConfig.from_hf(config_path)
    torch.manual_seed(0)
    model = mod.Model(cfg, ep_group=mesh.group("ep"), cp_group=cp_group)
    torch.manual_seed(0)
    full = mod.Model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2 * ep, 32), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    labels[0, 5:9] = -100  # ignored labels inside a chunk
    n_labels = (labels != -100).sum()

    refs, ref_loads = [], []  # per micro-batch: TrainOutput, expert load [MoE layers, E]
    for d in range(ep):
        refs.append(full.forward_train(ids[2 * d:2 * d + 2], labels[2 * d:2 * d + 2]))
        ref_loads.append(full.take_expert_load())
    sum(o.loss_sum / n_labels + AUX_COEF * o.aux_loss / ep for o in refs).backward()
    ref = refs[r]
    positions_BS = cp_positions(32, cp_rank, cp)[None].expand(2, -1)
    mine = [split_for_cp(t[2 * r:2 * r + 2], cp_rank, cp) for t in (ids, labels)]
    out = model.forward_train(*mine, positions_BS)
    (out.loss_sum / n_labels + AUX_COEF * out.aux_loss / ep).backward()

    parts = torch.stack([out.loss_sum.detach(), out.aux_loss.detach()])  # each cp rank's part of the sums
    load = model.take_expert_load()
    for t in (parts, load):
        dist.all_reduce(t, group=cp_group)
    errors = {"loss": rel_err(parts[0], ref.loss_sum.detach()), "aux": rel_err(parts[1], ref.aux_loss.detach()),
              "load": rel_err(load, ref_loads[r])}
    with torch.no_grad():  # whole sequences on every cp rank (sampling, evaluation)
        errors["logits (whole sequences)"] = rel_err(model(ids[2 * r:2 * r + 2]), full(ids[2 * r:2 * r + 2]))
    full_params = dict(full.named_parameters())
    for name, p in model.named_parameters():
        experts = ".mlp.experts." in name
        grad = p.grad.clone()  # summed over the ranks replicating it: (cp) for experts, (cp, ep) for the rest
        dist.all_reduce(grad, group=mesh.group("dp", "cp") if experts else mesh.group("dp", "cp", "ep"))
        ref_grad = full_params[name].grad
        if experts:
            lo = model.get_submodule(name.rsplit(".", 1)[0]).lo
            ref_grad = ref_grad[lo:lo + p.shape[0]]
        errors[name] = rel_err(grad, ref_grad)
    destroy_mesh()
    return errors


@pytest.mark.parametrize("cp,ep", [(2, 1), (2, 2)])
def test_model_gradients_at_cp2_and_cp2_ep2_equal_single_process(tiny_train_setup, cp, ep):
    config, _ = tiny_train_setup
    for errors in run_ranks(cp * ep, model_grads_worker, config, cp, ep):
        assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}


def test_training_at_cp2_and_cp2_ep2_equals_single_process(tiny_train_setup, tmp_path):
    """Adam eps 1e-6: cp splits each sequence, so the matmuls run on other shapes and gradients differ from one
    process by ~3e-7 (float rounding; the model-level test above). With eps 1e-8, the few elements whose clipped
    gradient is ~eps turn that into ~1e-5 weight differences after 5 steps (measured: grad norm 1.8e-5, weights
    9.5e-6); dp splits whole sequences, keeps the shapes and is not affected."""
    config, data = tiny_train_setup
    single_losses, single_norms, single_weights = run_train(train_args(config, data, tmp_path / "single",
                                                                       adam_eps=1e-6))
    assert max(single_norms) > 0.05, "clipping should be active so that the global norm is exercised"
    for world, extra in ((2, {"cp": 2}), (4, {"dp": 1, "cp": 2, "ep": 2})):
        results = run_ranks(world, run_train, train_args(config, data, tmp_path / f"w{world}", adam_eps=1e-6, **extra))
        assert_matches_single((single_losses, single_norms, single_weights), results, ep=extra.get("ep", 1))


def test_seq_len_not_divisible_by_2cp_is_a_clear_error(tiny_train_setup, tmp_path):
    config, data = tiny_train_setup
    with pytest.raises(ValueError, match=r"--seq-len 30 is not divisible by 2\*cp = 4"):
        train.main(train_args(config, data, tmp_path, seq_len=30, cp=2))
