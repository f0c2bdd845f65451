"""Experts placed freely over the ep ranks (core/placement.py, train.py --expert-placement): any number per rank,
zero included, contiguous or not, and an expert count that ep does not divide. Against one process on the Qwen3
recipe: training runs under uneven placements (losses, grad norms, every weight, expert biases), a checkpoint
saved under one placement resuming under another (and the checkpoints compared key by key), an export from an
uneven placement loaded by transformers; and a copied DeepSeek-V2 recipe with 5 experts over ep=2 holding
exactly 3 + 2. The dispatch itself under placements: tests/test_expert_parallel.py; every recipe's uneven
layouts: tests/recipe_checks.py:layout_results."""

import json
import sys

import pytest
import torch

from core.placement import Placement
from core.training import parse_args
from recipes.qwen3_30b_a3b import train
from recipes.qwen3_30b_a3b.model import Model, ModelConfig, load_hf_checkpoint
from tests.conftest import TINY_TRAIN_CONFIG
from tests.multiproc import run_ranks
from tests.recipe_checks import layouts_worker, write_counting_data
from tests.test_launch import copy_recipe
from tests.test_train import assert_matches_single, assert_same_checkpoint, held_experts, rel_err, run_train, train_args

ZERO_RANK = "3,0,3,1,0,1"  # 6 experts over ep=4: rank 0 holds 1 and 4, rank 1 holds 3 and 5, rank 2 none, rank 3 0 and 2
ODD = "1,0,1,0,1"  # 5 experts over ep=2, not contiguous: rank 0 holds 1 and 3, rank 1 holds 0, 2 and 4


DOWN = "layers.1.mlp.experts.down_proj"  # one routed-expert tensor of the Qwen3 model these tests train


def ranks(table: str) -> list[int]:
    return [int(r) for r in table.split(",")]


def test_placement_tables_and_flag_errors(tmp_path):
    """The even split (as even as possible when ep does not divide E), a given table, and a one-line ValueError
    for each bad --expert-placement (train.py's check_run, before any process group)."""
    assert Placement.even(6, 4).experts == ((0, 1), (2, 3), (4,), (5,))
    assert Placement.even(8, 4).rank_of == (0, 0, 1, 1, 2, 2, 3, 3)  # divisible: rank d holds [d*E/ep, (d+1)*E/ep)
    p = Placement(ranks(ZERO_RANK), 4)
    assert p.experts == ((1, 4), (3, 5), (), (0, 2)) and p.local_index == (0, 0, 1, 0, 1, 1) and p.max_local == 2
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_TRAIN_CONFIG))  # 4 experts
    data = write_counting_data(tmp_path / "data")
    check = lambda world, **flags: train.check_run(parse_args(train.Args, train_args(config, data, tmp_path / "o",
                                                                                      **flags)), world)
    check(3, ep=3, global_batch=6)  # 4 experts over 3 ranks: 2, 1, 1 (it used to be an error)
    check(2, ep=2, expert_placement="1,1,1,1")
    for flags, message in [({"expert_placement": "0,1,1"}, "lists 3 experts but the model has 4 routed experts"),
                           ({"expert_placement": "0,1,2,1"}, "expert 2 is placed on rank 2, which is not an ep rank 0..1"),
                           ({"expert_placement": "0,1,x,1"}, "must be comma-separated ep ranks"),
                           ({"expert_placement": "0,-1,1,1"}, "expert 1 is placed on rank -1")]:
        with pytest.raises(ValueError, match=message):
            check(2, ep=2, **flags)


# ------------------------------------------------------------------------------ training under placements


@pytest.fixture(scope="module")
def placed_runs(tmp_path_factory):
    """One process (6 and 5 experts, 4 steps, --expert-bias-rate on), then one spawn of 4 ranks running: 6 experts
    at ep=4 with a rank holding none (A, checkpoints, export) and at dp2 x ep2 evenly (B, checkpoints); A's step-2
    checkpoint resumed at dp2 x ep2 (C) and B's at ep=4 under the default uneven split 2, 2, 1, 1 (D); 5 experts
    at pp2 x ep2 (3 + 2)."""
    tmp = tmp_path_factory.mktemp("placed")
    data = write_counting_data(tmp / "data")
    configs = {}
    for e in (6, 5):
        configs[e] = tmp / f"config{e}.json"
        configs[e].write_text(json.dumps({**TINY_TRAIN_CONFIG, "num_experts": e}))
    args = lambda e, out, **extra: train_args(configs[e], data, tmp / out, steps=4, micro_batch=1, adam_eps=1e-6,
                                              expert_bias_rate=0.01, **extra)  # eps: tests/recipe_checks.py:check_args
    single = {e: run_train(args(e, f"single{e}", export_hf=tmp / f"hf_single{e}")) for e in (6, 5)}
    ckpt = lambda run: tmp / run / "checkpoints/step_00000002"
    jobs = {"A": ("train", args(6, "A", ep=4, expert_placement=ZERO_RANK, ckpt_every=2, export_hf=tmp / "hf_A")),
            "B": ("train", args(6, "B", ep=2, dp=2, ckpt_every=2)),
            "C": ("train", args(6, "C", ep=2, dp=2, ckpt_every=2, resume=ckpt("A"))),
            "D": ("train", args(6, "D", ep=4, ckpt_every=2, resume=ckpt("B"))),
            "5 pp2xep2": ("train", args(5, "F", pp=2, ep=2))}
    per_rank = run_ranks(4, layouts_worker, "qwen3_30b_a3b", jobs)
    return tmp, configs, single, {name: [rank[name] for rank in per_rank] for name in jobs}


def test_uneven_placements_equal_one_process(placed_runs):
    """6 experts at ep=4 with a rank holding none (and not contiguous), 6 evenly at dp2 x ep2, 5 at pp2 x ep2
    (3 + 2): losses, grad norms, every weight and expert bias as one process (tests/test_train.py's
    LAYOUT_TOLERANCE), each routed expert by its global id; and each rank holds the experts of the table as written
    here (held_experts), so a wrong local index or a wrong owner fails."""
    _, _, single, runs = placed_runs
    assert_matches_single(single[6], runs["A"])
    assert_matches_single(single[6], runs["B"])
    assert_matches_single(single[5], runs["5 pp2xep2"])
    # each rank's experts by global id (run_train's state: `name[e]`), against the table as written here
    held = lambda run: [sorted(int(k[len(DOWN) + 1:-1]) for k in w if k.startswith(DOWN + "[")) for _, _, w in runs[run]]
    # (pp rank 0 holds stages 0 and 3, which get no layer of 2: its ranks hold no experts)
    assert held("5 pp2xep2") == [[], [], held_experts(5, 2, 0), held_experts(5, 2, 1)]
    assert held("A") == [held_experts(6, 4, r, ranks(ZERO_RANK)) for r in range(4)] and held("A")[2] == []


def test_checkpoint_resumes_under_another_placement(placed_runs):
    """Saved at ep=4 with a rank holding none, resumed at dp2 x ep2 (even); saved at dp2 x ep2, resumed at ep=4 under
    the split 2, 2, 1, 1: the next steps equal the uninterrupted runs' and one process's, and the step-4
    checkpoints hold the same keys and values (weights and Adam moments per expert, step counts, lr, scheduler,
    data position) as the uninterrupted run of the other placement, within layout rounding."""
    tmp, _, single, runs = placed_runs
    resumed_part = (single[6][0][2:], single[6][1][2:], single[6][2])
    assert_matches_single(resumed_part, runs["C"])
    assert_matches_single(resumed_part, runs["D"])
    for resumed, uninterrupted in (("C", "B"), ("D", "A")):
        assert_same_checkpoint(tmp / resumed / "checkpoints/step_00000004",
                               tmp / uninterrupted / "checkpoints/step_00000004", tmp, tol=1e-5)


def test_export_from_uneven_placement_loads_in_transformers(placed_runs):
    """The folder exported at ep=4 with a rank holding none is complete, and transformers' Qwen3MoeForCausalLM
    computes from it the one-process model's logits."""
    from transformers import Qwen3MoeForCausalLM

    from tools.hf_parity import folder_tensors

    tmp, configs, single, _ = placed_runs
    exported, reference = folder_tensors(tmp / "hf_A"), folder_tensors(tmp / "hf_single6")
    assert exported.keys() == reference.keys()
    for name, t in reference.items():
        assert rel_err(exported[name], t) <= 1e-5, name  # LAYOUT_TOLERANCE: the weights after 4 steps
    torch.manual_seed(0)
    model = Model(ModelConfig.from_hf(configs[6]))
    load_hf_checkpoint(model, tmp / "hf_single6")  # (holds no expert bias: transformers' router has none)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = Qwen3MoeForCausalLM.from_pretrained(tmp / "hf_A")(input_ids=ids).logits
        # transformers sums in another order (tools/hf_parity.py's 1e-4), on weights within 1e-5 of one process's
        assert (logits - model(ids)).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_uneven_placements_on_eight_ranks_and_at_ep2(tmp_path):
    """The rest of the placement matrix: 6 experts (2, 2, 1, 1) at pp2 x ep4 and dp2 x ep4, with a rank holding none
    at dp2 x ep4; 5 experts at ep=2 alone and at dp2 x ep2, 3 + 2 and not contiguous."""
    data = write_counting_data(tmp_path / "data")
    configs = {}
    for e in (6, 5):
        configs[e] = tmp_path / f"config{e}.json"
        configs[e].write_text(json.dumps({**TINY_TRAIN_CONFIG, "num_experts": e}))
    args = lambda e, out, **extra: train_args(configs[e], data, tmp_path / out, steps=3, micro_batch=1, global_batch=16,
                                              adam_eps=1e-6, expert_bias_rate=0.01, **extra)  # pp2 x ep4: 4 micro-batches
    single = {e: run_train(args(e, f"single{e}")) for e in (6, 5)}
    eight = {"pp2xep4": ("train", args(6, "a", pp=2, ep=4)), "dp2xep4": ("train", args(6, "b", dp=2, ep=4)),
             "dp2xep4 zero": ("train", args(6, "c", dp=2, ep=4, expert_placement=ZERO_RANK))}
    two = {"ep2": ("train", args(5, "d", ep=2)), "ep2 odd": ("train", args(5, "e", ep=2, expert_placement=ODD))}
    four = {"dp2xep2 odd": ("train", args(5, "f", dp=2, ep=2, expert_placement=ODD))}
    for world, jobs, experts in ((8, eight, 6), (2, two, 5), (4, four, 5)):
        per_rank = run_ranks(world, layouts_worker, "qwen3_30b_a3b", jobs)
        for name in jobs:
            assert_matches_single(single[experts], [rank[name] for rank in per_rank])


# ------------------------------------------------------------------------- done: 5 experts over ep=2 hold 3 + 2


def count_worker(repo: str, argv: list[str]) -> dict:
    """Train the copied recipe recipes/my_arch (in the scratch repository `repo`) for one step on this rank; its
    routed-expert parameters: name -> shape, and the Experts modules' expert_ids."""
    import recipes

    recipes.__path__.append(f"{repo}/recipes")
    sys.path.insert(0, repo)
    from recipes.my_arch import train as copied

    _, model = copied.main(argv)
    experts = {n: tuple(p.shape) for n, p in model.named_parameters() if ".mlp.experts." in n}
    ids = {n: list(m.expert_ids) for n, m in model.named_modules() if hasattr(m, "expert_ids")}
    return {"shapes": experts, "expert_ids": ids, "numel": sum(p.numel() for n, p in model.named_parameters()
                                                                if ".mlp.experts." in n)}


def test_copied_recipe_with_five_experts_over_ep2_holds_3_plus_2(tmp_path):
    """The issue's case: a copy of the DeepSeek-V2-Lite recipe with 5 routed FFN experts, trained at ep=2 (the even
    split, as even as possible): ep rank 0 holds experts 0-2 and rank 1 experts 3-4, each exactly as many expert
    weights as that (3 x (gate, up, down) of H x I per MoE layer), none unused."""
    from recipes.deepseek_v2_lite.model import check_setup

    repo = copy_recipe("deepseek_v2_lite", tmp_path).parents[2]
    config = {**check_setup()["config"], "n_routed_experts": 5, "num_hidden_layers": 2}
    path = tmp_path / "config5.json"
    path.write_text(json.dumps(config))
    data = write_counting_data(tmp_path / "data")
    argv = train_args(path, data, tmp_path / "run", steps=1, ep=2, micro_batch=1, seq_len=check_setup()["seq_len"])
    per_rank = run_ranks(2, count_worker, str(repo), argv)
    H, I = config["hidden_size"], config["moe_intermediate_size"]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    for rank, held in zip(per_rank, ([0, 1, 2], [3, 4])):
        assert set(map(tuple, rank["expert_ids"].values())) == {tuple(held)}
        assert all(shape[0] == len(held) for shape in rank["shapes"].values()), rank["shapes"]
        assert rank["numel"] == moe_layers * len(held) * 3 * H * I  # gate_up [H, 2I] + down [I, H] per expert
