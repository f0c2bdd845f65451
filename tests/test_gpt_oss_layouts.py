"""The GPT-OSS recipe trains identically under every parallel layout: ep=2, pp=2 (DualPipeV), cp=2 (sliding
windows reaching across the cp chunk boundaries), pp2 x ep2 and cp2 x ep2 each equal one process running the
same global batch and micro-batch split (losses, grad norms, every weight after 3 steps, sinks and biases
included; pp2 with --recompute layer, cp2 with --recompute attention, and pp2 in bf16 against one bf16 process);
at cp2 and cp2 x ep2 the model's loss, aux loss and every gradient equal one process's; resume at ep=2 continues
exactly; the released MXFP4 layout loads at ep=2; an export at pp2 x ep2 equals the one-process export; and a
copy of the recipe folder runs its launch.sh unchanged under its new name. One spawned process group per world
size runs all its jobs."""

import json

import torch
import torch.distributed as dist

from recipes.gpt_oss_20b import train
from tests import test_context_parallel
from tests.multiproc import run_ranks
from tests.test_context_parallel import model_grads_worker
from tests.test_gpt_oss_parity import write_released_layout
from tests.test_launch import copy_recipe, launch
from tests.test_precision import errors
from tests.test_train import assert_matches_single, rel_err, run_train, train_args
from tools.hf_parity import folder_tensors, make_tiny_hf_model

# window 6 over sequences of 32: at cp=2 the 4 chunks hold 8 tokens each, so a query early in a chunk sees keys of
# the chunk before it, held by the other cp rank (chunks 0, 3 on rank 0 and 1, 2 on rank 1)
CONFIG = {"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
          "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 6, "router_aux_loss_coef": 0.01}


def layout_args(config, data, out, **extra):
    """3 steps of 8 micro-batches of 1 sequence of 32 tokens, clipping active, the aux-loss-free expert bias on (its
    updates, from the global expert load, must be identical in every layout). Adam eps 1e-6, as in
    tests/test_train_pp.py: stage and chunk boundaries sum gradients in another order."""
    return train_args(config, data, out, **{"steps": 3, "micro_batch": 1, "adam_eps": 1e-6, "expert_bias_rate": 1e-2,
                                            **extra})


def runs_worker(jobs: list):
    """Every job in turn on this rank, all in one process group (train.py's and the gradient worker's closing
    destroy_mesh are skipped: a new rendezvous per run races with slower ranks still leaving the previous one, as
    in tests/test_precision.py). An argv list -> run_train's result; (config, cp, ep) -> model_grads_worker's
    errors (loss, aux loss, expert load, whole-sequence logits, every gradient at cp, sinks included)."""
    dist.init_process_group("gloo")
    train.destroy_mesh = test_context_parallel.destroy_mesh = lambda: None
    out = [run_train(job, train.main) if isinstance(job, list) else model_grads_worker(*job, recipe="gpt_oss_20b")
           for job in jobs]
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_layouts_equal_single_process(tiny_train_setup, tmp_path):
    _, data = tiny_train_setup
    config = tmp_path / "gpt_oss.json"
    config.write_text(json.dumps(CONFIG))
    single = run_train(layout_args(config, data, tmp_path / "single", export_hf=tmp_path / "hf_single"), train.main)
    assert max(single[1]) > 0.05, "clipping should be active so that the global norm is exercised"
    assert single[0][-1] < single[0][0]

    resume_from = tmp_path / "ep2_a" / "checkpoints" / "step_00000002"
    released = write_released_layout(make_tiny_hf_model(CONFIG, tmp_path / "hf_fp32"), tmp_path / "hf_mxfp4")
    single_bf16 = run_train(layout_args(config, data, tmp_path / "single_bf16", dtype="bf16"), train.main)
    two = run_ranks(2, runs_worker, [layout_args(config, data, tmp_path / "ep2", ep=2),
                                     layout_args(config, data, tmp_path / "pp2", pp=2, recompute="layer"),
                                     layout_args(config, data, tmp_path / "cp2", cp=2, recompute="attention"),
                                     layout_args(config, data, tmp_path / "ep2_a", ep=2, steps=4, ckpt_every=2),
                                     layout_args(config, data, tmp_path / "ep2_b", ep=2, steps=4, resume=resume_from),
                                     (config, 2, 1),
                                     layout_args("unused", data, tmp_path / "ep2_mxfp4", ep=2, steps=1, lr=0.0,
                                                 hf_checkpoint=tmp_path / "hf_mxfp4", export_hf=tmp_path / "hf_out",
                                                 expert_bias_rate=0.0),
                                     layout_args(config, data, tmp_path / "pp2_bf16", pp=2, dtype="bf16")])
    four = run_ranks(4, runs_worker, [layout_args(config, data, tmp_path / "pp2ep2", pp=2, ep=2,
                                                  export_hf=tmp_path / "hf_pp2ep2"),
                                      layout_args(config, data, tmp_path / "cp2ep2", cp=2, ep=2), (config, 2, 2)])
    layouts = {"ep2": ([r[0] for r in two], 2), "pp2": ([r[1] for r in two], 1), "cp2": ([r[2] for r in two], 1),
               "pp2ep2": ([r[0] for r in four], 2), "cp2ep2": ([r[1] for r in four], 2), "pp2 bf16": ([r[7] for r in two], 1)}
    for name, (ranks, ep) in layouts.items():
        reference = single_bf16 if "bf16" in name else single
        print(f"{name}: losses / grad norms / worst weight vs one process " + " / ".join(
            f"{e:.1e}" for e in errors(ranks, reference, ep)))
        assert_matches_single(reference, ranks, ep=ep)
    for errors_by_name in [rank[5] for rank in two] + [rank[2] for rank in four]:  # model level, cp2 and cp2 x ep2
        assert max(errors_by_name.values()) <= 1e-5, {k: v for k, v in errors_by_name.items() if v > 1e-5}
    worst_cp2, worst_cp2ep2 = max(max(r[5].values()) for r in two), max(max(r[2].values()) for r in four)
    print(f"model level, worst of every quantity: cp2 {worst_cp2:.1e}, cp2 x ep2 {worst_cp2ep2:.1e}")
    for rank in two:  # resumed at step 2: the same losses and, bit for bit, the same weights
        (full_losses, _, full_weights), (resumed_losses, _, resumed_weights) = rank[3], rank[4]
        assert resumed_losses == full_losses[2:]
        assert all(torch.equal(resumed_weights[k], w) for k, w in full_weights.items())

    # the released layout (MXFP4 experts) read at ep=2 and exported after a step of lr 0: transformers'
    # dequantised experts and the bf16 dense tensors, exactly
    exported, source = folder_tensors(tmp_path / "hf_out"), folder_tensors(tmp_path / "hf_mxfp4")
    assert exported.keys() == released.keys() | {k for k in source if "_blocks" not in k and "_scales" not in k}
    for name, t in exported.items():
        assert torch.equal(t, released[name] if name in released else source[name].float()), name

    exported, reference = folder_tensors(tmp_path / "hf_pp2ep2"), folder_tensors(tmp_path / "hf_single")
    assert exported.keys() == reference.keys()
    for name, t in reference.items():
        assert rel_err(exported[name], t) <= 1e-5, name


def test_copied_recipe_runs_its_launch_sh(tiny_train_setup, tmp_path):
    """cp -r recipes/gpt_oss_20b recipes/my_arch: launch.sh trains the copy (pp=2 x ep=2 on 4 CPU ranks)."""
    _, data = tiny_train_setup
    copy = copy_recipe("gpt_oss_20b", tmp_path)  # no OUT: the run goes to runs/my_arch
    out = launch(copy, {"DATA": str(data)}, "--steps", "2", "--seq-len", "64", "--ckpt-every", "2")
    assert "-m recipes.my_arch.train" in out and "mesh pp=2 dp=1 cp=1 ep=2" in out and "trained steps 1-2" in out
    assert (copy.parents[2] / "runs/my_arch/checkpoints/step_00000002/.metadata").is_file()

