"""Training-script behaviour: data-parallel parity with one process, exact resume, clear errors."""

import math
import warnings
from pathlib import Path

import pytest
import torch

from core.checkpoint import resolve_resume
from core.mesh import resolve_layout
from recipes.qwen3_30b_a3b import train
from tests.multiproc import run_ranks

# Layouts against one process, fp32: the same sums in another order (reduce-scatter, stage boundaries, cp chunks)
# round differently, ~1e-7 relative, which 3 Adam steps (eps 1e-6) grow to ~1e-6 in the weights (measured worst
# 3.1e-6, DeepSeek-V2 at cp2); a wrong reduction (a contribution missing or counted twice) moves them far more
# (the bugs tried on the shared checks moved them by 0.3 to 1.3).
LAYOUT_TOLERANCE = 1e-5


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
    history, model = main(argv)
    return [h["loss"] for h in history], [h["grad_norm"] for h in history], {k: v.detach().clone() for k, v in model.state_dict().items()}


def held_experts(num_experts: int, ep: int, ep_rank: int, placement=None) -> list[int]:
    """Global ids of the routed experts ep rank `ep_rank` holds, in local order, written out here apart from
    core/placement.py: `placement` (the ep rank of each expert, --expert-placement) or, for None, contiguous
    blocks with the first E % ep ranks holding one more."""
    if placement is None:
        base, extra = divmod(num_experts, ep)
        first = ep_rank * base + min(ep_rank, extra)
        return list(range(first, first + base + (ep_rank < extra)))
    return [e for e, rank in enumerate(placement) if rank == ep_rank]


def layout_errors(reference, results, ep: int = 1, error=rel_err, placement=None) -> dict[str, tuple[float, str]]:
    """The worst error of every rank's losses, grad norms and weights against one process's, and where it was:
    {"losses", "grad norms", "weights", "expert bias": (error, where)}. A rank's routed experts are those of its ep
    rank (ep is the innermost mesh dim, so ep rank = rank % ep) under `placement` (held_experts); all ranks
    together must hold every weight (a weight none holds: inf). Expert-selection biases (--expert-bias-rate) are
    compared bit for bit, the rest by `error`."""
    ref_losses, ref_norms, ref_weights = reference
    found = {"losses": [], "grad norms": [], "weights": [], "expert bias": []}
    held = set()
    for rank, (losses, norms, weights) in enumerate(results):
        found["losses"].append((error(torch.tensor(losses), torch.tensor(ref_losses)), f"rank {rank}"))
        found["grad norms"].append((error(torch.tensor(norms), torch.tensor(ref_norms)), f"rank {rank}"))
        for name, w in weights.items():
            ref = ref_weights[name]
            if ".mlp.experts." in name:
                ref = ref[held_experts(ref.shape[0], ep, rank % ep, placement)]
            held.add(name)
            bias = name.endswith("expert_bias")
            found["expert bias" if bias else "weights"].append(
                ((bitwise_error if bias else error)(w, ref), f"rank {rank} {name}"))
    found["weights"] += [(math.inf, f"held by no rank: {name}") for name in sorted(set(ref_weights) - held)]
    return {what: worst_error(errors) for what, errors in found.items()}


def assert_matches_single(reference, results, ep: int = 1, placement=None) -> list[float]:
    """Every rank's (losses, grad norms, weights) equal one process's within LAYOUT_TOLERANCE (relative), the
    expert biases bit for bit (layout_errors). Returns the worst relative errors [losses, grad norms, weights]."""
    errors = layout_errors(reference, results, ep, placement=placement)
    bounds = {"losses": LAYOUT_TOLERANCE, "grad norms": LAYOUT_TOLERANCE, "weights": LAYOUT_TOLERANCE, "expert bias": 0}
    failed = {what: errors[what] for what, bound in bounds.items() if not errors[what][0] <= bound}
    assert not failed, f"differ from one process (error, where): {failed}"
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
