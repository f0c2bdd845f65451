"""The DeepSeek-V2 recipe in every parallel layout: ep=2, pp=2, cp=2 (2 ranks) and pp2 x ep2, cp2 x ep2 (4 ranks)
each train exactly like one process running the same global batch and micro-batch split (losses, grad norms,
every weight after 3 steps); at cp=2 and cp2 x ep2 the model's loss, balance loss and every gradient equal one
process's (the MLA latent gathered over cp, the balance loss split over cp); --recompute changes no number; pp2
in bf16 equals one bf16 process; resume at ep=2 repeats the run; a copy of the recipe folder runs its launch.sh unchanged (4 ranks, pp=2 x ep=2, every stage holding layers).
One spawned process group per world size runs all its layouts."""

import json

import torch
import torch.distributed as dist

from core.pipeline import split_layers
from recipes.deepseek_v2_lite import train
from recipes.deepseek_v2_lite.model import ModelConfig, tiny_config_path
from tests import test_context_parallel
from tests.multiproc import run_ranks
from tests.test_context_parallel import model_grads_worker
from tests.test_launch import FAST, ROOT, copy_recipe, launch
from tests.test_train import assert_matches_single, rel_err, run_train, train_args

CONFIG = {  # 6 layers (the first dense; with pp=2 every stage holds some), 4 experts top-2 with 1 shared, YaRN
    "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "intermediate_size": 64, "first_k_dense_replace": 1, "aux_loss_alpha": 0.1, "seq_aux": True, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "mscale": 1.0,
                     "mscale_all_dim": 0.707}, "max_position_embeddings": 64,
}


def run_deepseek(argv):
    return run_train(argv, train.main)


def layouts_worker(jobs: dict):
    """Every job in turn on this rank, all in one process group (train.py's and the gradient worker's closing
    destroy_mesh are skipped: a new rendezvous per run races with slower ranks still leaving the previous one).
    ("train", argv) -> run_train's result, ("grads", (config, cp, ep)) -> errors per quantity."""
    dist.init_process_group("gloo")
    train.destroy_mesh = test_context_parallel.destroy_mesh = lambda: None
    results = {name: run_deepseek(arg) if kind == "train" else model_grads_worker(*arg, recipe="deepseek_v2_lite")
               for name, (kind, arg) in jobs.items()}
    dist.barrier()
    dist.destroy_process_group()
    return results


def args(config, data, out, steps=3, expert_bias_rate=1e-2, **extra):
    """3 steps of 8 micro-batches of 1 sequence (Adam eps 1e-6: see tests/test_train_pp.py), with the aux-loss-free
    expert bias on (its updates, from the global expert load, must be bit-identical in every layout)."""
    return train_args(config, data, out, steps=steps, micro_batch=1, adam_eps=1e-6, expert_bias_rate=expert_bias_rate,
                      **extra)


def test_layouts_equal_single_process_and_resume(tiny_train_setup, tmp_path):
    """Also: --recompute (layer at pp2, attention at cp2) changes no number; pp2 in bf16 is within 1e-6 of one
    bf16 process (the same bf16 ops; the stage hand-off is bf16, the carried balance loss fp32)."""
    _, data = tiny_train_setup
    config = tmp_path / "deepseek.json"
    config.write_text(json.dumps(CONFIG))
    single = run_deepseek(args(config, data, tmp_path / "fp32"))
    # bf16 without the bias: with it, pp2's grad norms differed from one process's by 1.3e-5 at step 3 (measured)
    single_bf16 = run_deepseek(args(config, data, tmp_path / "bf16", dtype="bf16", expert_bias_rate=0))
    assert single[0][-1] < single[0][0] and single_bf16[0] != single[0]
    layouts = {"ep2": {"ep": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "pp2xep2": {"pp": 2, "ep": 2},
               "cp2xep2": {"dp": 1, "cp": 2, "ep": 2}}
    jobs = {2: {"pp2 recompute": ("train", args(config, data, tmp_path / "pp2r", pp=2, recompute="layer")),
                "cp2 recompute": ("train", args(config, data, tmp_path / "cp2r", cp=2, recompute="attention")),
                "pp2 bf16": ("train", args(config, data, tmp_path / "pp2bf16", pp=2, dtype="bf16", expert_bias_rate=0)),
                # resume at ep=2: 4 steps with a checkpoint at 2, then again from that checkpoint
                "full": ("train", args(config, data, tmp_path / "full", ep=2, steps=4, ckpt_every=2)),
                "resumed": ("train", args(config, data, tmp_path / "resumed", ep=2, steps=4,
                                          resume=tmp_path / "full/checkpoints/step_00000002"))},
            4: {}}
    for name, layout in layouts.items():
        world = 2 if len(layout) == 1 else 4
        jobs[world][name] = ("train", args(config, data, tmp_path / name, **layout))
    for world in (2, 4):
        jobs[world][f"grads cp2 x ep{world // 2}"] = ("grads", (config, 2, world // 2))
    results = {}
    for world, world_jobs in jobs.items():  # per job: every rank's result
        per_rank = run_ranks(world, layouts_worker, world_jobs)
        results.update({name: [rank[name] for rank in per_rank] for name in world_jobs})
    for name, layout in layouts.items():
        worst = assert_matches_single(single, results[name], ep=layout.get("ep", 1))
        print(f"{name}: losses / grad norms / worst weight {worst[0]:.1e} / {worst[1]:.1e} / {worst[2]:.1e}")
    for name in ("grads cp2 x ep1", "grads cp2 x ep2"):
        worst = max(max(errors.values()) for errors in results[name])
        print(f"{name}: worst of loss, balance loss, expert load, logits, every gradient {worst:.1e}")
        assert worst <= 1e-5, [{k: v for k, v in errors.items() if v > 1e-5} for errors in results[name]]
    for name in ("pp2", "cp2"):  # recompute: bitwise the same
        for (losses, norms, weights), recomputed in zip(results[name], results[name + " recompute"]):
            assert (losses, norms) == recomputed[:2], name
            assert all(torch.equal(w, recomputed[2][n]) for n, w in weights.items()), name
    for losses, norms, weights in results["pp2 bf16"]:
        assert rel_err(torch.tensor(losses), torch.tensor(single_bf16[0])) <= 1e-6
        assert rel_err(torch.tensor(norms), torch.tensor(single_bf16[1])) <= 1e-6
        assert all(rel_err(w, single_bf16[2][n]) <= 1e-6 for n, w in weights.items())
    (full, _, full_weights), (resumed, _, resumed_weights) = results["full"][0], results["resumed"][0]
    assert resumed == full[2:]
    for name, w in full_weights.items():
        assert torch.equal(resumed_weights[name], w), name


def test_copied_recipe_folder_runs_its_launch_sh(tmp_path):
    """cp -r recipes/deepseek_v2_lite recipes/my_arch: the copy trains its own model with the CPU defaults
    (pp=2 x ep=2 on the tiny config, whose 6 layers leave every one of the 4 stages some) and exports."""
    assert all(split_layers(ModelConfig.from_hf(tiny_config_path()).num_hidden_layers, 2))
    data = ROOT / "data/stdlib" if (ROOT / "data/stdlib/meta.json").is_file() else tmp_path / "data"
    copy = copy_recipe("deepseek_v2_lite", tmp_path)  # no OUT: the run goes to runs/my_arch
    out = launch(copy, {"DATA": str(data)}, *FAST, "--export-hf", str(tmp_path / "hf"))
    assert "-m recipes.my_arch.train" in out and "mesh pp=2 dp=1 cp=1 ep=2" in out and "trained steps 1-4" in out
    assert "step     4/4 | val loss" in out or not (data / "val").is_dir()  # evaluated under DualPipeV
    assert (copy.parents[2] / "runs/my_arch/checkpoints/step_00000004/.metadata").is_file()
    assert json.loads((tmp_path / "hf/config.json").read_text())["architectures"] == ["DeepseekV2ForCausalLM"]
