"""The data-parallel engine (core/fsdp.py: FSDP2, every run of more than one rank) against one process: every
layout's losses, grad norms and weights with AdamW and with Muon (core/muon.py), and each rank's bytes of weights,
gradients, optimizer state and weight cache after a step against core/memory.py's estimate; --fp8 row-wise and
block-wise against the same FP8 run in one process (tests/test_fp8.py's bounds); reinit_ in a sharded run; pp > 1
sums its micro-batches' bf16 gradients in fp32; checkpoints written by the ZeRO-1 engine this repository ran
before resume (tests/data/zero1_checkpoints) at their layout and at others.

One process group per world size runs every job of that size (tests/recipe_checks.py:layouts_worker's reason);
VARIANTS are the flag sets each layout runs under, each against its own one-process run."""

import importlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from core import fp8, fsdp, memory, muon
from core.training import ParamRule, normal
from tests.multiproc import one_thread, start_ranks
from tests.recipe_checks import write_counting_data
from tests.test_fp8 import FP8_STEPS, fp8_layout_errors
from tests.test_train import LAYOUT_TOLERANCE, assert_matches_single, rel_err, run_train, train_args

# At pp = 1 gathered per micro-batch, the GPU's default (on CPU --fsdp-gather auto gathers once per step, so the
# shared recipe checks run that): this file is where the per-micro-batch path is checked, for one recipe
MICRO = {"fsdp_gather": "micro-batch"}
TWO_RANKS = {"dp2": {"dp": 2, **MICRO}, "ep2": {"ep": 2, **MICRO}, "pp2": {"pp": 2}, "cp2": {"cp": 2, **MICRO},
             "dp2 gathered once": {"dp": 2, "fsdp_gather": "step"}}  # (as pp > 1 runs, at pp = 1)
# 3 and 1 of the 4 experts per ep rank: FSDP2 pads the dp2 shards (ceil(3 / 2) = 2 rows, and 1 row and none), as
# the estimate counts
FOUR_RANKS = {"pp2xep2": {"pp": 2, "ep": 2}, "cp2xep2": {"cp": 2, "ep": 2, **MICRO},
              "dp2xep2 placed": {"dp": 2, "ep": 2, "expert_placement": "0,1,0,0", **MICRO}}
# train.py flags each layout runs under (name -> flags), each compared with one process under the same flags
VARIANTS = {"adamw": {}, "muon": {"optimizer": "muon"}}
# --fp8 under FSDP2, its weights gathered in the compute dtype and quantised per use (pp = 1) or once per step (pp2)
FP8 = {f"fp8 {scaling}": {"fp8": True, "fp8_recipe": scaling, "steps": FP8_STEPS} for scaling in ("rowwise", "blockwise")}
FP8_TWO_RANKS = {"dp2": {"dp": 2, **MICRO}, "ep2": {"ep": 2, **MICRO}, "pp2": {"pp": 2}, "cp2": {"cp": 2, **MICRO},
                 "ep2 placed": {"ep": 2, "expert_placement": "1,0,1,1", **MICRO}}  # expert 1 alone on ep rank 0
OLD = Path(__file__).parent / "data/zero1_checkpoints"  # written by the ZeRO-1 engine (its make.py says how)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (FSDP2 pads shards and may share one buffer)."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _unsharded_grads(opt) -> list:
    """Gradients still on the gathered parameters (gathered once per step: before reduce_gradients)."""
    out = []
    for unit in opt.units:
        for group in fully_shard.state(unit)._fsdp_param_groups:
            for p in group.fsdp_params:
                out += [p.unsharded_accumulated_grad, p._unsharded_param.grad]
    return out


def reinit_after_step(after_step):
    """Model.after_step that, after step 2, re-initialises local expert 1 of layer 0 (new weights) and rows 1:3 of a
    dense matrix (optimizer state only) through the run's optimizer, the way a router replacing a dead expert would."""
    def run(model, done):
        after_step(model, done)
        if done.step == 2:
            experts = "layers.0.mlp.experts.gate_up_proj"
            done.optimizer.reinit_(experts, 1, torch.full(model.get_parameter(experts).shape[1:], 0.01))
            done.optimizer.reinit_("layers.1.self_attn.q_proj.weight", slice(1, 3))
    return run


def measure_worker(jobs: dict) -> dict:
    """Each job's train.py run on this rank with the optimizer's calls wrapped to record, at the first step, the
    bytes of weights (shards, plus the gathered copies once per step), gradients (sharded, plus unsharded before the
    reduction), Adam state and Muon momentum, and the reduced gradients (this rank's rows); returns {job:
    (run_train's result, what was recorded, rank)}."""
    dist.init_process_group("gloo")
    train = importlib.import_module("recipes.qwen3_30b_a3b.train")
    train.destroy_mesh = lambda: None  # one process group for all jobs (tests/recipe_checks.py:layouts_worker)
    reduce, steps = fsdp.FSDPAdamW.reduce_gradients, {c: c.step for c in (fsdp.FSDPAdamW, muon.MuonAdamW)}
    results = {}
    after_step = train.Model.after_step
    for name, argv in jobs.items():
        seen = {}
        train.Model.after_step = reinit_after_step(after_step) if name.startswith("reinit") else after_step

        def reduce_gradients(opt, seen=seen):
            if not seen:  # the gathered stage (once per step) and the FP8 operands kept (none per micro-batch)
                gathered = [p for n, p in opt.model.named_parameters()] if opt.once else []
                operands = [t for _, _, operand in fp8.CACHE.entries.values() for t in operand]
                seen.update(cache=_storage_bytes(gathered + operands), unsharded=_storage_bytes(_unsharded_grads(opt)))
            reduce(opt)
            seen.setdefault("grads", {n: (fsdp.local_rows(opt.params[n])[2], t.grad.clone()) for n, t in opt.local.items()})

        def wrap(step, seen=seen):
            def opt_step(opt, seen=seen):
                step(opt)
                if "weights" not in seen:
                    momentum = [m.momentum_kAB for m in getattr(opt, "owned", [])]
                    seen.update(weights=_storage_bytes(opt.local.values()), momentum=_storage_bytes(momentum),
                                gradients=_storage_bytes([t.grad for t in opt.local.values()]) + seen["unsharded"],
                                optimizer=_storage_bytes([v for s in opt.optimizer.state.values() for v in s.values()
                                                          if v.ndim]))
            return opt_step
        fsdp.FSDPAdamW.reduce_gradients = reduce_gradients
        for c, step in steps.items():
            c.step = wrap(step)
        results[name] = (run_train(argv, train.main), dict(seen), dist.get_rank())
    fsdp.FSDPAdamW.reduce_gradients = reduce
    for c, step in steps.items():
        c.step = step
    train.Model.after_step = after_step
    dist.barrier()
    dist.destroy_process_group()
    return results


def estimated(layout: dict, rank: int, cfg, flags: dict) -> tuple[dict, int, list[int]]:
    """core/memory.py's weights, gradients, weight cache and Adam bytes of this rank's model (fp32, CPU), and Muon's
    momentum bytes on each rank of its pp rank's dense shard group (muon_bytes of the ep rank holding the most
    experts, as the estimate builds it; [0] without Muon)."""
    mod = importlib.import_module("recipes.qwen3_30b_a3b.model")
    L = memory.Layout(**layout, seq_len=32, bf16=False, fp8=bool(flags.get("fp8")),
                      fp8_recipe=flags.get("fp8_recipe", "rowwise"), optimizer=flags.get("optimizer", "adamw"))
    ep_rank, pp_rank = rank % L.ep, rank // (L.dp * L.cp * L.ep)
    parts = memory.rank_parts(cfg, L, pp_rank, mod.flops_by_layer(cfg, 32))
    muon = (lambda model: memory.muon_bytes(model, L)[0]) if L.optimizer == "muon" else (lambda model: [0])
    momentum = muon(memory.meta_model(mod, cfg, **parts))
    parts["expert_ids"] = memory.Placement.parse(L.expert_placement, cfg.num_experts, L.ep).experts[ep_rank]
    model = memory.meta_model(mod, cfg, L.fp8, **parts)  # (its param_bytes' optimizer: Adam + the most momentum it sees)
    est = memory.param_bytes(mod, model, L)
    return est, est["optimizer"] - max(muon(model)), momentum


def whole_grads(ranks) -> dict:
    """The reduced gradients of a job at its first step, every rank's rows put together (dp or pp layouts)."""
    rows = {}
    for _, seen, _ in ranks:
        for n, (first, g) in seen["grads"].items():
            rows.setdefault(n, {})[first] = g
    return {n: torch.cat([parts[first] for first in sorted(parts)]) for n, parts in rows.items()}


def check_layouts(tiny_train_setup, tmp_path, world: int, layouts: dict, more: dict | None = None,
                  fp8_layouts: dict | None = None) -> dict:
    """Each layout under each of VARIANTS against one process (3 steps), each of `fp8_layouts` under each of FP8
    against the same FP8 run in one process, and its bytes against the estimate; `more`: other runs (name -> argv)
    in the same process group. The one-process runs go while the ranks run. Returns every job's measure_worker
    result per rank (job -> [(run_train's result, what was recorded, rank)])."""
    config, data = tiny_train_setup
    # Adam eps 1e-6 as in the shared checks: FSDP2 sums each micro-batch's gradients over the ranks, then over the
    # micro-batches (one process: the other way round), ~1e-7 apart, which eps 1e-8 lets Adam amplify in
    # near-zero gradients beyond LAYOUT_TOLERANCE (measured 1.5e-5 in one k_proj at 4 ranks)
    args = lambda out, **extra: train_args(config, data, tmp_path / out, **{"steps": 3, "global_batch": 16,
                                                                            "adam_eps": 1e-6, **extra})
    variants = {**VARIANTS, **(FP8 if fp8_layouts else {})}
    checked = {f"{v} {name}": (v, layout) for v in variants for name, layout in (layouts.items() if v in VARIANTS
                                                                                 else fp8_layouts.items())}
    jobs = {job: args(job.replace(" ", "_"), **variants[v], **layout) for job, (v, layout) in checked.items()}
    ranks = start_ranks(world, measure_worker, {**jobs, **(more or {})})
    try:
        with one_thread():  # as each rank runs: the FP8 references round (and flip e4m3 steps) as the ranks do
            single = {v: run_train(args(f"single_{v}".replace(" ", "_"), **flags)) for v, flags in variants.items()}
    except BaseException:
        ranks.kill()
        raise
    runs = ranks.join()
    cfg = importlib.import_module("recipes.qwen3_30b_a3b.model").ModelConfig.from_hf(config)
    for job, (v, layout) in checked.items():
        flags = variants[v]
        results = [rank[job][0] for rank in runs]
        if v in FP8:
            errors = fp8_layout_errors(single[v], results, flags["fp8_recipe"])
            print(f"{job}: " + ", ".join(f"{what} {e:.1e} (<= {b:.0e})" for what, (e, _, b) in errors.items()))
            failed = {what: found for what, found in errors.items() if not found[0] <= found[2]}
            assert not failed, f"{job} differs from one process (error, where, bound): {failed}"
        else:
            try:
                worst = assert_matches_single(single[v], results)
            except AssertionError as e:
                raise AssertionError(f"{job}: {e}") from None
            print(f"{job} vs one process: losses / grad norms / weights {' / '.join(f'{e:.1e}' for e in worst)}")
        for _, seen, rank in (rank[job] for rank in runs):
            est, adam, momentum = estimated(layout, rank, cfg, flags)
            # FSDP2 pads a shard to ceil(d0 / n) rows, as the estimate counts for the first rank of each shard group
            # (the largest shards: equal on the ranks of dp = cp = 0); a later rank's shard may be shorter (an ep
            # rank's 3 experts over dp2: 2 rows and 1) or empty (1 expert: 1 row and none), so at most the estimate.
            # Adam's moments follow the unpadded local shard: equal on the first rank of every group only. Muon's
            # momentum: exactly what muon_bytes places on this rank (its index in the pp rank's dense group)
            ep, replicas = layout.get("ep", 1), layout.get("dp", 1) * layout.get("cp", 1) * layout.get("ep", 1)
            got, want = (seen["weights"], seen["gradients"], seen["cache"]), \
                (est["weights"], est["gradients"], est["weight_cache"])
            first_dp_cp = (rank // ep) % (replicas // ep) == 0
            assert got == want if first_dp_cp else all(g <= w for g, w in zip(got, want)), (job, rank, seen, est)
            assert seen["optimizer"] == adam if rank % replicas == 0 else seen["optimizer"] <= adam, (job, rank, seen, est)
            assert seen["momentum"] == momentum[rank % replicas] if v == "muon" else not seen["momentum"], (job, rank)
    return {name: [rank[name] for rank in runs] for name in runs[0]}


def old_checkpoint_runs(tmp_path) -> tuple[dict, dict]:
    """(jobs for 2 ranks, one-process runs): each ZeRO-1 checkpoint (step 2 of 6) resumed at ep2 (its own layout)
    and dp2, and in one process, with the flags it was written with."""
    data = write_counting_data(tmp_path / "old_data")  # the same tokens (a fixed seed)
    reference = json.loads((OLD / "reference.json").read_text())
    args = lambda name, out, **layout: train_args(OLD / "config.json", data, tmp_path / out, steps=6, global_batch=16,
                                                  adam_eps=1e-6, resume=OLD / name, **{**reference[name]["flags"],
                                                                                      "ep": 1, **layout})
    jobs = {f"{name} at {layout}": args(name, f"{name}_{layout}", **dims) for name in reference
            for layout, dims in (("ep2", {"ep": 2}), ("dp2", {"dp": 2, **MICRO}))}
    return jobs, {f"{name} in 1 process": [run_train(args(name, f"{name}_1"))] for name in reference}


def test_two_ranks_equal_one_process(tiny_train_setup, tmp_path):
    """dp2, ep2, cp2 gathered per micro-batch, pp2 (DualPipeV with its W slots) and dp2 gathered once per step, AdamW
    and Muon, equal one process, and each rank holds the bytes core/memory.py estimates; --fp8 row-wise and
    block-wise at dp2, ep2, pp2, cp2 and ep2 with expert 1 alone equal the same FP8 run in one process. reinit_ after step 2 at dp2
    (an expert's new weights, dense rows' state) equals it in one process. pp2 in bf16 sums its micro-batches in fp32: its gradients equal
    dp2's (where FSDP2 reduce-scatters each micro-batch in fp32). The ZeRO-1 checkpoints (AdamW and Muon at ep2,
    step 2 of 6) resume at ep2, at dp2 and in one process: steps 3-6 give the uninterrupted ZeRO-1 run's losses and
    grad norms."""
    config, data = tiny_train_setup
    run = lambda out, **extra: train_args(config, data, tmp_path / out, steps=3 if "reinit" not in out else 4,
                                          global_batch=16, adam_eps=1e-6, **extra)
    # reinit_ writes the shards and, gathered once per step, the gathered copy too: AdamW's per micro-batch, Muon's
    # once per step (CPU's default)
    reinit = {f"reinit {v}": run(f"reinit_{v}", dp=2, **flags, **(MICRO if v == "adamw" else {}))
              for v, flags in VARIANTS.items()}
    bf16 = {f"bf16 {name}": run(f"bf16_{name}", dtype="bf16", **dims) for name, dims in (("pp2", {"pp": 2}),
                                                                                        ("dp2", {"dp": 2, **MICRO}))}
    old_jobs, old_single = old_checkpoint_runs(tmp_path)
    runs = check_layouts(tiny_train_setup, tmp_path, 2, TWO_RANKS, {**reinit, **bf16, **old_jobs}, FP8_TWO_RANKS)
    train = importlib.import_module("recipes.qwen3_30b_a3b.train")
    after_step, train.Model.after_step = train.Model.after_step, reinit_after_step(train.Model.after_step)
    try:  # reinit_ of an expert's weights and state and of dense rows' state, sharded: as in one process
        single = {v: run_train(run(f"reinit_{v}_single", **flags)) for v, flags in VARIANTS.items()}
    finally:
        train.Model.after_step = after_step
    for v in VARIANTS:
        assert_matches_single(single[v], [r[0] for r in runs[f"reinit {v}"]])
    # pp2 sums 8 micro-batches' bf16 gradients in fp32, dp2 4 on each rank (their fp32 reduce-scatters): the same
    # bf16 numbers summed in another order, apart by fp32 rounding (2^-24 = 6e-8 per addition, at most ~5e-7 over 8;
    # measured worst 3e-10). Summed in bf16 (FSDP2's upcast hook off), each addition rounds to 8 bits (2^-9 = 2e-3
    # relative per element): measured worst 7.9e-4 (a norm weight). 1e-5 sits between the two. Both runs differ
    # from the fp32 run (the "adamw pp2" job) by bf16's rounding of the compute (measured >= 6.7e-3): the bf16
    # path is on
    pp2, dp2, fp32 = (whole_grads(runs[job]) for job in ("bf16 pp2", "bf16 dp2", "adamw pp2"))
    worst = max((rel_err(g, dp2[n]), n) for n, g in pp2.items())
    least = min(rel_err(g, fp32[n]) for n, g in pp2.items())
    assert pp2.keys() == dp2.keys() == fp32.keys() and worst[0] <= 1e-5 < 1e-3 <= least, (worst, least)
    print(f"bf16 pp2 vs dp2 gradients at step 1 (fp32 sums): worst {worst[0]:.1e} ({worst[1]}); vs fp32 >= {least:.1e}")
    worst = (0.0, "")
    for old in [*old_jobs, *old_single]:  # FSDP2 sums in another order than ZeRO-1 did: LAYOUT_TOLERANCE
        name = old.split(" ")[0]
        ref = json.loads((OLD / "reference.json").read_text())[name]
        for losses, norms, _ in [r[0] for r in runs[old]] if old in old_jobs else old_single[old]:
            assert len(losses) == 4, (old, losses)
            worst = max(worst, (rel_err(torch.tensor(losses), torch.tensor(ref["losses"][2:])), f"{old} losses"),
                        (rel_err(torch.tensor(norms), torch.tensor(ref["grad_norms"][2:])), f"{old} grad norms"))
    print(f"ZeRO-1 checkpoints resumed, steps 3-6 vs the uninterrupted ZeRO-1 run: worst {worst[0]:.1e} ({worst[1]})")
    assert worst[0] <= LAYOUT_TOLERANCE, worst


def test_four_ranks_equal_one_process(tiny_train_setup, tmp_path):
    """pp2 x ep2, cp2 x ep2 and dp2 x ep2 with 3 + 1 experts (padded and empty shards), AdamW, Muon and --fp8."""
    check_layouts(tiny_train_setup, tmp_path, 4, FOUR_RANKS, fp8_layouts=FOUR_RANKS)


def test_muon_refuses_column_splits():
    """A Muon matrix covering part of several dim-0 rows (a column split of a 2-D weight), which FSDP2 cannot hand
    one owner whole, is refused at construction in one line naming the parameter and what to declare."""
    class Declared(torch.nn.Linear):  # a model whose parameter_rules gives weight these Muon matrices
        def parameter_rules(self, name, t):
            return ParamRule(None, self.split(name, t) if name == "weight" else {}, normal(0.02))

    model = Declared(8, 6)
    model.split = lambda name, t: {"left": (t[:, :4].unsqueeze(0), None)}
    try:
        muon.MuonAdamW(model, None, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    except ValueError as e:
        assert "\n" not in str(e) and "matrix 0 (left) of weight (6, 4) covers part of several dim-0 rows" in str(e)
        assert "store the weight transposed, or split a fused weight along dim 0" in str(e)
    else:
        raise AssertionError("a column split was accepted")
    model.split = lambda name, t: {"top": (t[:3].unsqueeze(0), None), "bottom": (t[3:].unsqueeze(0), None)}
    assert len(muon.MuonAdamW(model, None, 1e-3, 0.1, (0.9, 0.95), 1e-8).owned) == 2  # a row split: accepted


def test_routed_experts_beside_dense_parameters_are_refused():
    """A module FSDP2 would have to shard over two meshes (a parameter declared routed next to a dense one) is
    refused before any collective, in one line naming both and what to do."""
    class Mixed(torch.nn.Module):  # mlp.weight declared a routed-expert tensor (2 experts), mlp.bias dense
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(3, 2)

        def parameter_rules(self, name, t):
            return ParamRule([0, 1] if name == "mlp.weight" else None, {}, normal(0.02))

    model = Mixed()
    try:
        fsdp.shard_model(model, None, bf16=False, once=False)
    except ValueError as e:
        assert "\n" not in str(e) and "mlp holds routed experts and dense mlp.bias" in str(e), e
        assert "into a module of their own" in str(e)
    else:
        raise AssertionError("a module mixing routed-expert and dense parameters was sharded")
