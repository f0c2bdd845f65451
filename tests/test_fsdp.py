"""--shard fsdp (core/fsdp.py: FSDP2 fully_shard) against one process: every layout's losses, grad norms and
weights, with --fp8 too; resume from a ZeRO-1 checkpoint; each rank's bytes of weights, gradients, Adam state and
weight cache after a step against core/memory.py's estimate."""

import importlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from core import fp8, fsdp, memory
from tests.multiproc import one_thread, start_ranks
from tests.test_fp8 import FP8_STEPS, fp8_layout_errors
from tests.test_train import LAYOUT_TOLERANCE, assert_matches_single, rel_err, run_train, train_args

FOUR_RANKS = {"pp2xdp2": {"pp": 2, "dp": 2}, "pp2xep2": {"pp": 2, "ep": 2}, "dp2xep2": {"dp": 2, "ep": 2},
              "cp2xep2": {"cp": 2, "ep": 2},
              # 3 and 1 of the 4 experts per ep rank: FSDP2 pads the dp2 shards (ceil(3 / 2) = 2 rows, and 1 row
              # and none), as the estimate counts
              "dp2xep2 placed": {"dp": 2, "ep": 2, "expert_placement": "0,1,0,0"}}


# --fp8 (row-wise and block-wise) under FSDP2: the gathered weights quantised per use (pp = 1) or once per step (pp2)
FP8_TWO_RANKS = {"dp2": {"dp": 2}, "ep2": {"ep": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2},
                 "ep2 placed": {"ep": 2, "expert_placement": "1,0,1,1"}}  # expert 1 alone on ep rank 0
FP8_FOUR_RANKS = {"pp2xep2": {"pp": 2, "ep": 2}, "cp2xep2": {"cp": 2, "ep": 2},
                  "dp2xep2 placed": {"dp": 2, "ep": 2, "expert_placement": "0,1,0,0"}}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (FSDP2 pads shards and may share one buffer)."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _unsharded_grads(opt) -> list:
    """Gradients still on the gathered parameters (pp > 1: before reduce_gradients)."""
    out = []
    for unit in opt.units:
        for group in fully_shard.state(unit)._fsdp_param_groups:
            for p in group.fsdp_params:
                out += [p.unsharded_accumulated_grad, p._unsharded_param.grad]
    return out


def reinit_after_step(after_step):
    """Model.after_step that, after step 2, re-initialises local expert 1 of layer 0 (new weights) and rows 1:3 of a
    dense matrix (moments only) through the run's optimizer, the way a router replacing a dead expert would."""
    def run(model, done):
        after_step(model, done)
        if done.step == 2:
            experts = "layers.0.mlp.experts.gate_up_proj"
            done.optimizer.reinit_(experts, 1, torch.full(model.get_parameter(experts).shape[1:], 0.01))
            done.optimizer.reinit_("layers.1.self_attn.q_proj.weight", slice(1, 3))
    return run


def measure_worker(jobs: dict) -> dict:
    """Each job's train.py run on this rank with FSDPAdamW's calls wrapped to record, at the first step, the bytes
    of weights (shards, plus the gathered copies at pp > 1), gradients (sharded, plus unsharded before the
    reduction) and Adam state; returns {job: (run_train's result, bytes)}."""
    dist.init_process_group("gloo")
    train = importlib.import_module("recipes.qwen3_30b_a3b.train")
    train.destroy_mesh = lambda: None  # one process group for all jobs (tests/recipe_checks.py:layouts_worker)
    reduce, step = fsdp.FSDPAdamW.reduce_gradients, fsdp.FSDPAdamW.step
    results = {}
    after_step = train.Model.after_step
    for name, argv in jobs.items():
        seen = {}
        fp8.CACHE.invalidate()  # (an earlier run's operands)
        train.Model.after_step = reinit_after_step(after_step) if name.startswith("reinit") else after_step

        def reduce_gradients(opt, seen=seen):
            if not seen:  # the gathered stage (pp > 1) and the FP8 operands kept (none at pp = 1)
                gathered = [p for n, p in opt.model.named_parameters()] if opt.pp > 1 else []
                operands = [t for _, _, operand in fp8.CACHE.entries.values() for t in operand]
                seen.update(cache=_storage_bytes(gathered + operands), unsharded=_storage_bytes(_unsharded_grads(opt)))
            reduce(opt)

        def opt_step(opt, seen=seen):
            step(opt)
            if "weights" not in seen:
                seen.update(weights=_storage_bytes(opt.local.values()),
                            gradients=_storage_bytes([t.grad for t in opt.local.values()]) + seen["unsharded"],
                            optimizer=_storage_bytes([v for s in opt.optimizer.state.values() for v in s.values()
                                                      if v.ndim]))
        fsdp.FSDPAdamW.reduce_gradients, fsdp.FSDPAdamW.step = reduce_gradients, opt_step
        results[name] = (run_train(argv, train.main), dict(seen), dist.get_rank())
    fsdp.FSDPAdamW.reduce_gradients, fsdp.FSDPAdamW.step = reduce, step
    train.Model.after_step = after_step
    dist.barrier()
    dist.destroy_process_group()
    return results


def estimated(layout: dict, rank: int, cfg, scaling: str | None = None) -> dict:
    """core/memory.py's weights, gradients, optimizer and weight cache of this rank's model (fp32, CPU; scaling: the
    --fp8-recipe of an FP8 run)."""
    mod = importlib.import_module("recipes.qwen3_30b_a3b.model")
    L = memory.Layout(**layout, seq_len=32, bf16=False, shard="fsdp", fp8=scaling is not None,
                      fp8_recipe=scaling or "rowwise")
    ep_rank, pp_rank = rank % L.ep, rank // (L.dp * L.cp * L.ep)
    parts = memory.rank_parts(cfg, L, pp_rank, mod.flops_by_layer(cfg, 32))
    parts["expert_ids"] = memory.Placement.parse(L.expert_placement, cfg.num_experts, L.ep).experts[ep_rank]
    return memory.param_bytes(memory.meta_model(mod, cfg, L.fp8, **parts), L)


def assert_estimated_bytes(name: str, layout: dict, per_rank, cfg, scaling: str | None = None) -> None:
    """Each rank's measured bytes (measure_worker) against the estimate."""
    for _, seen, rank in per_rank:
        est = estimated(layout, rank, cfg, scaling)
        # FSDP2 pads a shard to ceil(d0 / n) rows, as the estimate counts for the first rank of each shard group
        # (the largest shards: equal on the ranks of dp = cp = 0); a later rank's shard may be shorter (an ep
        # rank's 3 experts over dp2: 2 rows and 1) or empty (1 expert: 1 row and none), so at most the estimate.
        # Adam's moments follow the unpadded local shard: equal on the first rank of every group only
        ep, replicas = layout.get("ep", 1), layout.get("dp", 1) * layout.get("cp", 1) * layout.get("ep", 1)
        got, want = (seen["weights"], seen["gradients"], seen["cache"]), \
            (est["weights"], est["gradients"], est["weight_cache"])
        first_dp_cp = (rank // ep) % (replicas // ep) == 0
        assert got == want if first_dp_cp else all(g <= w for g, w in zip(got, want)), (name, rank, seen, est)
        assert seen["optimizer"] == est["optimizer"] if rank % replicas == 0 else \
            seen["optimizer"] <= est["optimizer"], (name, rank, seen, est)


def check_layouts(tiny_train_setup, tmp_path, world: int, layouts: dict, more: dict | None = None,
                  fp8_layouts: dict | None = None) -> dict:
    """Each layout under --shard fsdp against one process (3 steps), each of `fp8_layouts` with --fp8 row-wise and
    block-wise against the same FP8 run in one process (tests/test_fp8.py:fp8_layout_errors), and every run's bytes
    against the estimate; `more`: other runs (name -> argv) in the same process group, whose results are returned
    (name -> per rank). The one-process runs go while the ranks run."""
    config, data = tiny_train_setup
    # Adam eps 1e-6 as in the shared checks: FSDP2 sums each micro-batch's gradients over the ranks, then over the
    # micro-batches (one process: the other way round), ~1e-7 apart, which eps 1e-8 lets Adam amplify in
    # near-zero gradients beyond LAYOUT_TOLERANCE (measured 1.5e-5 in one k_proj at 4 ranks)
    args = lambda out, **extra: train_args(config, data, tmp_path / out.replace(" ", "_"),
                                           **{"steps": 3, "global_batch": 16, "adam_eps": 1e-6, **extra})
    fp8_args = lambda out, scaling, **extra: args(out, fp8=True, fp8_recipe=scaling, steps=FP8_STEPS, **extra)
    fp8_jobs = {f"fp8 {scaling} {name}": (scaling, layout) for scaling in ("rowwise", "blockwise")
                for name, layout in (fp8_layouts or {}).items()}
    jobs = {**{name: args(name, shard="fsdp", **layout) for name, layout in layouts.items()},
            **{name: fp8_args(name, scaling, shard="fsdp", **layout) for name, (scaling, layout) in fp8_jobs.items()}}
    ranks = start_ranks(world, measure_worker, {**jobs, **(more or {})})
    try:
        with one_thread():  # as the ranks run: the FP8 references round (and flip e4m3 steps) as theirs would
            single = run_train(args("single"))
            fp8_single = {scaling: run_train(fp8_args(f"single {scaling}", scaling)) for scaling in ("rowwise", "blockwise")
                          if fp8_jobs}
    except BaseException:
        ranks.kill()
        raise
    runs = ranks.join()
    cfg = importlib.import_module("recipes.qwen3_30b_a3b.model").ModelConfig.from_hf(config)
    for name, layout in layouts.items():
        try:
            placement = [int(r) for r in layout["expert_placement"].split(",")] if "expert_placement" in layout else None
            worst = assert_matches_single(single, [rank[name][0] for rank in runs], ep=layout.get("ep", 1),
                                          placement=placement)
        except AssertionError as e:
            raise AssertionError(f"--shard fsdp {name}: {e}") from None
        print(f"--shard fsdp {name} vs one process: losses / grad norms / weights {' / '.join(f'{e:.1e}' for e in worst)}")
        assert_estimated_bytes(name, layout, [rank[name] for rank in runs], cfg)
    for name, (scaling, layout) in fp8_jobs.items():
        placement = [int(r) for r in layout["expert_placement"].split(",")] if "expert_placement" in layout else None
        errors = fp8_layout_errors(fp8_single[scaling], [rank[name][0] for rank in runs], scaling,
                                   ep=layout.get("ep", 1), placement=placement)
        print(f"--shard fsdp --{name}: " + ", ".join(f"{what} {e:.1e} (<= {b:.0e})" for what, (e, _, b) in errors.items()))
        failed = {what: found for what, found in errors.items() if not found[0] <= found[2]}
        assert not failed, f"--shard fsdp --{name} differs from one process (error, where, bound): {failed}"
        assert_estimated_bytes(name, layout, [rank[name] for rank in runs], cfg, scaling)
    return {name: [rank[name][0] for rank in runs] for name in more or {}}


def test_fsdp_two_ranks_equal_one_process(tiny_train_setup, tmp_path):
    """dp2, ep2 and pp2 (DualPipeV with its W slots, gathered once per step) under FSDP2 equal one process (ZeRO-1
    code, nothing to shard), and each rank holds the bytes core/memory.py estimates. A ZeRO-1 checkpoint (ep2,
    step 2 of 4: flat Adam moments) resumes under FSDP2 at ep2: steps 3-4 equal the ZeRO-1 run's; reinit_ after
    step 2 at dp2 (an expert's new weights, dense rows' moments) gives the ZeRO-1 run's steps 3-4. --fp8 row-wise
    and block-wise at dp2, ep2, pp2, cp2 and ep2 with expert 1 alone equals the same FP8 run in one process
    (tests/test_fp8.py's bounds), each rank's weight cache holding the estimated bytes (nothing at pp = 1)."""
    config, data = tiny_train_setup
    zero1 = train_args(config, data, tmp_path / "zero1", steps=4, ckpt_every=2, global_batch=16, ep=2, adam_eps=1e-6)
    resumed = train_args(config, data, tmp_path / "resumed", steps=4, global_batch=16, ep=2, adam_eps=1e-6, shard="fsdp",
                         resume=tmp_path / "zero1/checkpoints/step_00000002")
    reinit = {f"reinit {shard}": train_args(config, data, tmp_path / f"reinit_{shard}", steps=4, global_batch=16,
                                            dp=2, adam_eps=1e-6, shard=shard) for shard in ("zero1", "fsdp")}
    runs = check_layouts(tiny_train_setup, tmp_path, 2, {"dp2": {"dp": 2}, "ep2": {"ep": 2}, "pp2": {"pp": 2}},
                         {"zero1": zero1, "resumed": resumed, **reinit}, FP8_TWO_RANKS)
    for (losses, _, weights), (z_losses, _, z_weights) in zip(runs["reinit fsdp"], runs["reinit zero1"]):
        # reinit_ of an expert's weights and moments and of dense rows' moments after step 2, as ShardedAdamW's
        assert rel_err(torch.tensor(losses), torch.tensor(z_losses)) <= LAYOUT_TOLERANCE
        assert max(rel_err(weights[k], w) for k, w in z_weights.items()) <= LAYOUT_TOLERANCE
    for (losses, norms, weights), (z_losses, z_norms, z_weights) in zip(runs["resumed"], runs["zero1"]):
        assert len(losses) == 2
        # the same sums as ZeRO-1 in another order (reduce-scatter per micro-batch): LAYOUT_TOLERANCE's rounding
        assert rel_err(torch.tensor(losses), torch.tensor(z_losses[2:])) <= LAYOUT_TOLERANCE
        assert rel_err(torch.tensor(norms), torch.tensor(z_norms[2:])) <= LAYOUT_TOLERANCE
        assert max(rel_err(weights[k], w) for k, w in z_weights.items()) <= LAYOUT_TOLERANCE


@pytest.mark.slow
def test_fsdp_four_ranks_equal_one_process(tiny_train_setup, tmp_path):
    """FOUR_RANKS under FSDP2, and FP8_FOUR_RANKS with --fp8 row-wise and block-wise, as the two-rank test."""
    check_layouts(tiny_train_setup, tmp_path, 4, FOUR_RANKS, fp8_layouts=FP8_FOUR_RANKS)
