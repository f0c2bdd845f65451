"""Training-script behaviour: data-parallel parity with one process, exact resume, clear errors."""

import math
import warnings
from pathlib import Path

import pytest
import torch

from core.checkpoint import resolve_resume
from core.fsdp import expert_checkpoint_entries
from core.mesh import resolve_layout
from core.training import parameter_rules
from recipes.qwen3_30b_a3b import train
from tests.multiproc import run_ranks
from tools.hf_parity import NOISE_FACTOR, NOISE_FLOOR, noise_bound

# Layouts against one process, fp32: the same sums in another order (reduce-scatter, stage boundaries, cp chunks)
# round differently, ~1e-7 relative, which 3 Adam steps (eps 1e-6) grow to ~1e-6 in the weights (measured worst
# 3.1e-6, DeepSeek-V2 at cp2); a wrong reduction (a contribution missing or counted twice) moves them far more
# (the bugs tried on the shared checks moved them by 0.3 to 1.3).
LAYOUT_TOLERANCE = 1e-5
# The shared recipe checks (tests/recipe_checks.py) hold each tensor to its own rounding noise instead, measured in
# the same run: the fp32 one-process run's distance from a float64 run of the same process from the same weights
# (noise_bound). A layout's fp32 run differs from the one-process fp32 run by its own rounding error plus that
# one's: both are sums of ~1e-7 roundings in other orders, of one size, so |layout - fp32| ~ sqrt(2) x noise for a
# tensor of many elements; a near-cancelling one (a differential attention's lambda gradient) has a large noise
# and so a large bound, which the fixed 1e-5 did not give. Measured over every tensor of every fp32 layout of
# the three recipes (weights after 3 steps, model-level gradients at cp2 and cp2xep2): noise 0 to 3.5e-6, error /
# noise at most 3.0 for a whole tensor (GPT-OSS down_proj_bias at cp2xep2, 4.8e-6) and 4 for 3 grad norms (1 ulp
# of noise, 4 ulps of error). NOISE_FACTOR = 16 (tools/hf_parity.py: one rule for every fp32 row) leaves 4x above that. Tensors of few elements (losses, grad norms,
# the aux loss) err by whole fp32 ulps and their fp32 value may even land on the float64 one (noise ~0): measured
# at most 2.6e-7 (4 ulps); NOISE_FLOOR = 2e-6 leaves 8x. A lost reduction or a wrong rank's chunk moves a tensor by
# 0.1 to 1 (tests/recipe_checks.py:layout_results' docstring), 1e3 and more above any of these bounds.


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def bitwise_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """0 when a and b are bit for bit equal, else their relative error (inf when that rounds to 0)."""
    return 0.0 if torch.equal(a, b) else rel_err(a, b) or math.inf


def worst_error(errors) -> tuple[float, str]:
    """The largest (error, where) pair, NaN counting as the largest; (0.0, "") when there is none or all are 0."""
    error, where = max(errors, key=lambda e: (math.isnan(e[0]), e[0]), default=(0.0, ""))
    return (error, where) if error != 0 else (0.0, "")


def train_args(config, data, out, steps=5, **extra):
    args = ["--config", str(config), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--lr", "1e-2",
            "--warmup-steps", "2", "--grad-clip", "0.05", "--ckpt-every", "0"]
    for key, value in extra.items():  # value True: a bare flag (--no-overlap)
        args += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    return args


def run_train(argv, main=train.main):
    """(losses, grad norms, state) of a train.py run. state: every parameter and buffer the run's model holds, by
    name; a routed-expert tensor (Model.parameter_rules' expert_ids) as one entry per global expert, `name[e]` (as
    checkpoints hold them, core/fsdp.py:expert_checkpoint_entries), so that each ep rank's experts meet one
    process's by id under any placement."""
    history, model = main(argv)
    rules, state = parameter_rules(model), {}
    for name, t in model.state_dict().items():
        ids = rules[name].expert_ids if name in rules else None
        state.update({name: t} if ids is None else expert_checkpoint_entries(name, t, ids))
    return [h["loss"] for h in history], [h["grad_norm"] for h in history], {k: v.detach().clone() for k, v in state.items()}


def held_experts(num_experts: int, ep: int, ep_rank: int, placement=None) -> list[int]:
    """Global ids of the routed experts ep rank `ep_rank` holds, in local order, written out here apart from
    core/placement.py: `placement` (the ep rank of each expert, --expert-placement) or, for None, contiguous
    blocks with the first E % ep ranks holding one more."""
    if placement is None:
        base, extra = divmod(num_experts, ep)
        first = ep_rank * base + min(ep_rank, extra)
        return list(range(first, first + base + (ep_rank < extra)))
    return [e for e, rank in enumerate(placement) if rank == ep_rank]


def layout_items(results):
    """(what, where, rank's tensor, name) of every rank's losses, grad norms and state (run_train's: parameters,
    buffers, each routed expert by its global id); what: "losses", "grad norms" or "weights"."""
    for rank, (losses, norms, weights) in enumerate(results):
        yield "losses", f"rank {rank}", torch.tensor(losses), ""
        yield "grad norms", f"rank {rank}", torch.tensor(norms), ""
        for name, w in weights.items():
            yield "weights", f"rank {rank} {name}", w, name


def one_process_part(run, what: str, name: str) -> torch.Tensor | None:
    """One process's losses, grad norms or state entry `name` (None: it has no such entry)."""
    losses, norms, weights = run
    return torch.tensor(losses if what == "losses" else norms) if what != "weights" else weights.get(name)


def layout_errors(reference, results, error=rel_err, reference64=None,
                  tolerance: float = LAYOUT_TOLERANCE) -> dict[str, tuple[float, str, float]]:
    """Every rank's losses, grad norms and state (parameters, buffers, routed experts by global id: run_train's)
    against one process's `reference`, the worst of each kind with where it was and its bound: {"losses", "grad
    norms", "weights": (error, where, bound)}. The bound is `tolerance`, or, given the float64 run of the same one
    process (reference64), each tensor's own: noise_bound of its fp32 run's distance from the float64 run; the worst
    is the tensor with the largest error / bound. All ranks together must hold every entry of the reference, and
    none it lacks (either: inf)."""
    found = {"losses": [], "grad norms": [], "weights": []}
    held = set()
    for what, where, got, name in layout_items(results):
        ref = one_process_part(reference, what, name)
        held.add(name)
        if ref is None:
            found[what].append((math.inf, f"{where}: not in one process's run", 0.0))
            continue
        bound = tolerance if reference64 is None else noise_bound(rel_err(ref, one_process_part(reference64, what, name)))
        found[what].append((error(got, ref), where, bound))
    found["weights"] += [(math.inf, f"held by no rank: {name}", 0.0) for name in sorted(set(reference[2]) - held)]
    return {what: worst_bounded(errors) for what, errors in found.items()}


def worst_bounded(errors) -> tuple[float, str, float]:
    """The (error, where, bound) of largest error / bound (NaN the largest, an error above a bound 0 infinite);
    (0.0, "", the smallest bound) when every error is 0, (0.0, "", 0.0) when there is none."""
    errors = list(errors)
    def excess(e):
        return math.inf if math.isnan(e[0]) else e[0] / e[2] if e[2] else (math.inf if e[0] else 0.0)
    worst = max(errors, key=excess, default=(0.0, "", 0.0))
    return worst if worst[0] != 0 else (0.0, "", min((e[2] for e in errors), default=0.0))


def assert_matches_single(reference, results) -> list[float]:
    """Every rank's (losses, grad norms, state) equal one process's within LAYOUT_TOLERANCE (relative; layout_errors).
    Returns the worst relative errors [losses, grad norms, weights]."""
    errors = layout_errors(reference, results)
    failed = {what: errors[what] for what in errors if not errors[what][0] <= errors[what][2]}
    assert not failed, f"differ from one process (error, where, bound): {failed}"
    return [errors[what][0] for what in ("losses", "grad norms", "weights")]


def checkpoint_contents(path, tmp_path) -> dict:
    """Everything a DCP checkpoint holds, as one flat {dotted key: value} dict of whole (unsharded) tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "whole.pt")
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value
    walk("", torch.load(tmp_path / "whole.pt", weights_only=True))
    return flat


def assert_same_checkpoint(path, ref_path, tmp_path, tol: float = 0.0) -> None:
    """Two checkpoints hold the same state: model, Adam moments and step counts, learning rates, scheduler, data
    position, step (and each rank's RNG when tol is 0). tol 0: bit-identical; else tensors within tol (relative)."""
    got, ref = checkpoint_contents(path, tmp_path), checkpoint_contents(ref_path, tmp_path)
    if tol:  # another layout: another number of ranks, so other RNG keys
        got, ref = ({k: v for k, v in d.items() if not k.startswith("rng_rank")} for d in (got, ref))
    assert got.keys() == ref.keys() and any(".exp_avg_sq" in k for k in ref) and "data.step" in ref
    for key, value in ref.items():
        if isinstance(value, torch.Tensor) and tol:
            assert rel_err(got[key], value) <= tol, key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


ROOT = Path(__file__).resolve().parents[1]


def run_train_noting_warnings(argv):
    """run_train, plus the deprecation warnings raised from this repository's own code (file:line: message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_train(argv)
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning)) and w.filename.startswith(str(ROOT))]
    return result, ours


def test_dp2_equals_single_process(tiny_train_setup, tmp_path):
    """...and no deprecated call (torch's FutureWarning on e.g. all_gather_into_tensor) from the project's code."""
    config, data = tiny_train_setup
    single_losses, single_norms, single_weights = run_train(train_args(config, data, tmp_path / "single"))
    results = run_ranks(2, run_train_noting_warnings, train_args(config, data, tmp_path / "dp2"))
    assert [deprecated for _, deprecated in results] == [[], []]
    results = [result for result, _ in results]
    assert max(single_norms) > 0.05, "clipping should be active so that the global norm is exercised"
    for losses, norms, weights in results:  # both replicas
        assert rel_err(torch.tensor(losses), torch.tensor(single_losses)) <= 1e-5
        assert rel_err(torch.tensor(norms), torch.tensor(single_norms)) <= 1e-5
        for name, w in single_weights.items():
            assert rel_err(weights[name], w) <= 1e-5, name
    assert single_losses[-1] < single_losses[0]


def test_resume_gives_the_same_losses(tiny_train_setup, tmp_path):
    """...and the same state at the end: weights, and the final checkpoints (Adam state, lr, scheduler, data
    position, RNG) bit-identical to the uninterrupted run's."""
    config, data = tiny_train_setup
    full, _, full_weights = run_train(train_args(config, data, tmp_path / "a", steps=6, ckpt_every=3))
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000003"
    assert (checkpoint / ".metadata").is_file()
    resumed, _, resumed_weights = run_train(train_args(config, data, tmp_path / "b", steps=6, ckpt_every=3,
                                                       resume=checkpoint))
    assert resumed == full[3:]
    for name, w in full_weights.items():
        assert torch.equal(resumed_weights[name], w), name
    assert_same_checkpoint(tmp_path / "b/checkpoints/step_00000006", tmp_path / "a/checkpoints/step_00000006", tmp_path)


def test_resume_at_dp2(tiny_train_setup, tmp_path):
    """Every rank's losses and weights after resuming equal the uninterrupted run's, and so does the final state."""
    config, data = tiny_train_setup
    full = run_ranks(2, run_train, train_args(config, data, tmp_path / "a", steps=4, ckpt_every=2))
    resumed = run_ranks(2, run_train, train_args(config, data, tmp_path / "b", steps=4, ckpt_every=2,
                                                 resume=tmp_path / "a" / "checkpoints" / "step_00000002"))
    for (losses, _, weights), (full_losses, _, full_weights) in zip(resumed, full):
        assert losses == full_losses[2:]
        assert all(torch.equal(weights[name], w) for name, w in full_weights.items())
    assert_same_checkpoint(tmp_path / "b/checkpoints/step_00000004", tmp_path / "a/checkpoints/step_00000004", tmp_path)


def test_interrupted_save_keeps_last_good_checkpoint(tiny_train_setup, tmp_path):
    config, data = tiny_train_setup
    run_train(train_args(config, data, tmp_path, steps=2, ckpt_every=1))
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_00000003.tmp").mkdir()  # what a crash in the middle of a save leaves behind
    (ckpts / "step_00000003.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert resolve_resume("auto", ckpts).name == "step_00000002"
    resumed, _, _ = run_train(train_args(config, data, tmp_path, steps=3, resume="auto"))
    assert len(resumed) == 1  # continued from step 2


def test_mesh_must_match_world_size():
    with pytest.raises(ValueError, match=r"= 6 ranks, but the world size is 4"):
        resolve_layout(4, pp=1, dp=3, cp=2, ep=1)
    with pytest.raises(ValueError, match="not divisible by pp\\*cp\\*ep"):
        resolve_layout(4, pp=3)
    assert resolve_layout(8, pp=2, cp=2) == (2, 2, 2, 1)


def test_clear_errors(tiny_train_setup, tmp_path):
    config, data = tiny_train_setup
    with pytest.raises(ValueError, match="world size is 1"):
        train.main(train_args(config, data, tmp_path, dp=2))
    with pytest.raises(FileNotFoundError, match="no DCP checkpoint"):
        train.main(train_args(config, data, tmp_path, resume=tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="prepare_data"):
        train.main(train_args(config, tmp_path / "no_data", tmp_path))
    with pytest.raises(ValueError, match="divisible"):
        train.main(train_args(config, data, tmp_path, micro_batch=3))


def test_bf16_autocast_path_trains(tiny_train_setup, tmp_path):
    """The GPU precision path (bf16 autocast, fp32 master weights and router softmax) runs on CPU too."""
    config, data = tiny_train_setup
    losses, _, _ = run_train(train_args(config, data, tmp_path, steps=8, dtype="bf16", grad_clip=1.0))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_schedules(schedule):
    from core.training import lr_factor

    f = [lr_factor(s, schedule, warmup=10, total=100, min_ratio=0.1, decay_fraction=0.2) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warmup
    assert f[-1] == pytest.approx(0.1, abs=0.02) and min(f) >= 0.1 - 1e-9
    assert all(a >= b - 1e-12 for a, b in zip(f[9:], f[10:]))  # never rises after warmup
    if schedule == "wsd":
        assert f[10:80] == [1.0] * 70  # stable until the last 20%


def test_each_tensor_is_held_to_its_own_noise():
    """layout_errors with a float64 run: a tensor whose fp32 run is far from float64 (a near-cancelling sum) may
    differ by up to NOISE_FACTOR times that, one that is not by no more than NOISE_FLOOR; routed experts by global
    id, wherever a rank holds them; an entry no rank holds, or one the reference lacks, fails."""
    ones = torch.ones(4, 3)
    noisy, quiet = ones.clone(), ones.clone()
    noisy[0, 0] += 2e-4  # the fp32 run's rounding, seen against float64: relative noise 2e-4 / sqrt(12) = 5.8e-5
    experts = lambda t, ids: {f"experts.w[{e}]": t[e] for e in ids}
    reference64 = ([1.0], [1.0], {"lam": ones, "w": ones, **experts(ones, range(4))})
    reference = ([1.0], [1.0], {"lam": noisy, "w": quiet, **experts(quiet, range(4))})
    layout = lambda lam, w, held: ([1.0], [1.0], {"lam": lam, "w": w, **held})
    within = [layout(noisy + 5e-4, quiet, experts(quiet, ids)) for ids in ([0, 1], [2, 3])]
    errors = layout_errors(reference, within, reference64=reference64)
    assert errors["weights"][0] == pytest.approx(5e-4, rel=1e-3)  # every element off by 5e-4: 9 x the floor
    assert errors["weights"][2] == pytest.approx(NOISE_FACTOR * 2e-4 / math.sqrt(12), rel=1e-3)
    assert errors["weights"][0] <= errors["weights"][2] and errors["losses"] == (0.0, "", NOISE_FLOOR)
    above_floor = layout_errors(reference, [layout(noisy, quiet * (1 + 3e-6), experts(quiet, range(4)))],
                                reference64=reference64)
    assert above_floor["weights"][1:] == ("rank 0 w", NOISE_FLOOR)  # 3e-6 > NOISE_FLOOR: fails
    wrong_expert = quiet.clone()
    wrong_expert[3] += 1e-5  # rank 1's expert 3 (held second): compared with expert 3 of one process's
    errors = layout_errors(reference, [within[0], layout(noisy, quiet, experts(wrong_expert, [3, 2]))],
                           reference64=reference64)
    assert errors["weights"][1] == "rank 1 experts.w[3]" and errors["weights"][0] > NOISE_FLOOR
    unheld = layout_errors(reference, [within[0], layout(noisy, quiet, experts(quiet, [2]))])
    assert unheld["weights"][:2] == (math.inf, "held by no rank: experts.w[3]")
    extra = layout_errors(reference, [layout(noisy, quiet, {**experts(quiet, range(4)), "bias": ones})])
    assert extra["weights"][:2] == (math.inf, "rank 0 bias: not in one process's run")
