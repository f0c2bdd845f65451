"""The DeepSeek-V2 recipe in every parallel layout: ep=2, pp=2, cp=2 (2 ranks) and pp2 x ep2, cp2 x ep2 (4 ranks)
each train exactly like one process running the same global batch and micro-batch split (losses, grad norms,
every weight after 3 steps); at cp=2 and cp2 x ep2 the model's loss, balance loss and every gradient equal one
process's (the MLA latent gathered over cp, the balance loss split over cp); resume at ep=2 repeats the run;
a copy of the recipe folder runs its launch.sh unchanged (4 ranks, pp=2 x ep=2, every stage holding layers).
One spawned process group per world size runs all its layouts."""

import json
import os
import shutil

import torch

from core.pipeline import split_layers
from recipes.deepseek_v2_lite import train
from recipes.deepseek_v2_lite.model import ModelConfig, tiny_config_path
from tests.multiproc import _free_port, run_ranks
from tests.test_context_parallel import model_grads_worker
from tests.test_launch import FAST, ROOT, launch
from tests.test_train import assert_matches_single, run_train, train_args

CONFIG = {  # 6 layers (the first dense; with pp=2 every stage holds some), 4 experts top-2 with 1 shared, YaRN
    "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "intermediate_size": 64, "first_k_dense_replace": 1, "aux_loss_alpha": 0.1, "seq_aux": True, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "mscale": 1.0,
                     "mscale_all_dim": 0.707}, "max_position_embeddings": 64,
}
LAYOUTS = {2: [{"ep": 2}, {"pp": 2}, {"cp": 2}], 4: [{"pp": 2, "ep": 2}, {"dp": 1, "cp": 2, "ep": 2}]}


def run_deepseek(argv):
    return run_train(argv, train.main)


def layouts_worker(jobs, ports):
    """Each job in turn on this rank, each with a process group of its own (a new rendezvous port: a destroyed
    group's port stays taken): ("train", argv) -> run_train's result, ("grads", (config, cp, ep)) -> errors."""
    results = []
    for (kind, arg), port in zip(jobs, ports):
        os.environ["MASTER_PORT"] = str(port)
        results.append(run_deepseek(arg) if kind == "train" else model_grads_worker(*arg, recipe="deepseek_v2_lite"))
    return results


def args(config, data, out, steps=3, **extra):
    """3 steps of 8 micro-batches of 1 sequence (Adam eps 1e-6: see tests/test_train_pp.py)."""
    return train_args(config, data, out, steps=steps, micro_batch=1, adam_eps=1e-6, **extra)


def test_layouts_equal_single_process_and_resume(tiny_train_setup, tmp_path):
    _, data = tiny_train_setup
    config = tmp_path / "deepseek.json"
    config.write_text(json.dumps(CONFIG))
    single = run_deepseek(args(config, data, tmp_path / "single"))
    assert single[0][-1] < single[0][0]
    for world, layouts in LAYOUTS.items():
        jobs = [("train", args(config, data, tmp_path / f"w{world}_{i}", **layout)) for i, layout in enumerate(layouts)]
        jobs += [("grads", (config, 2, world // 2))]
        if world == 2:  # resume at ep=2: 4 steps with a checkpoint at 2, then again from that checkpoint
            jobs += [("train", args(config, data, tmp_path / "full", ep=2, steps=4, ckpt_every=2)),
                     ("train", args(config, data, tmp_path / "resumed", ep=2, steps=4,
                                    resume=tmp_path / "full/checkpoints/step_00000002"))]
        ports = [_free_port() for _ in jobs]
        results = list(zip(*run_ranks(world, layouts_worker, jobs, ports)))  # per job: every rank's result
        for layout, ranks in zip(layouts, results):
            worst = assert_matches_single(single, ranks, ep=layout.get("ep", 1))
            print(f"{layout}: losses / grad norms / worst weight {worst[0]:.1e} / {worst[1]:.1e} / {worst[2]:.1e}")
        for errors in results[len(layouts)]:
            assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}
        print(f"model at cp2 x ep{world // 2}: worst of loss, balance loss, gradients "
              f"{max(max(e.values()) for e in results[len(layouts)]):.1e}")
        if world == 2:
            (full, _, full_weights), (resumed, _, resumed_weights) = results[-2][0], results[-1][0]
            assert resumed == full[2:]
            for name, w in full_weights.items():
                assert torch.equal(resumed_weights[name], w), name


def test_copied_recipe_folder_runs_its_launch_sh(tmp_path):
    """cp -r recipes/deepseek_v2_lite recipes/my_arch: the copy trains its own model with the CPU defaults
    (pp=2 x ep=2 on the tiny config, whose 6 layers leave every one of the 4 stages some) and exports."""
    assert all(split_layers(ModelConfig.from_hf(tiny_config_path()).num_hidden_layers, 2))
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    for name in ("core", "tools"):
        (repo / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "recipes/__init__.py", repo / "recipes/__init__.py")
    shutil.copytree(ROOT / "recipes/deepseek_v2_lite", repo / "recipes/my_arch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    data = ROOT / "data/stdlib" if (ROOT / "data/stdlib/meta.json").is_file() else tmp_path / "data"
    out = launch(repo / "recipes/my_arch/launch.sh", {"DATA": str(data), "OUT": str(tmp_path / "run")}, *FAST,
                 "--export-hf", str(tmp_path / "hf"))
    assert "-m recipes.my_arch.train" in out and "mesh pp=2 dp=1 cp=1 ep=2" in out and "trained steps 1-4" in out
    assert (tmp_path / "run/checkpoints/step_00000004/.metadata").is_file()
    assert json.loads((tmp_path / "hf/config.json").read_text())["architectures"] == ["DeepseekV2ForCausalLM"]
