"""The data-parallel engine's AdamW (core/fsdp.py: FSDPAdamW on FSDP2's shards, or plain tensors in one process),
gradient clipping and the lr schedules (core/training.py) against plain PyTorch: torch.optim.AdamW (its
single-tensor implementation) with the parameter groups written out here by name, torch.nn.utils.clip_grad_norm_
and torch's own LinearLR / CosineAnnealingLR / SequentialLR, on a small plain model. In one process, and on 4 gloo
ranks as dp=2 x ep=2 (shard_model's units: dense parameters sharded 4 ways by rows, the expert tensor split over ep
and sharded 2 ways over dp, with last shards short or empty), for 6 steps with a checkpoint round trip
(core/checkpoint.py, into freshly built objects) after step 3. Just before that checkpoint, one expert gets new
weights and part of a dense matrix keeps its weights, both with their Adam moments reset (FSDPAdamW.reinit_ on one
side, the same writes into torch's full tensors on the other), so the checkpoint carries the reset state. Two
experts are idle: one gets a gradient on one dp rank only, one on none, and one parameter gets none on any rank;
they step with g = 0 where it is missing, as torch's AdamW with a zero gradient. The expert tensor's name holds no
`experts` (`layers.0.mlp.routed.w`): the model declares it routed (Plain.parameter_rules), and that declaration alone
shards it over dp, reduces and clips it as an expert and checkpoints it per global expert id.

Both sides get the same gradients: the reference model's full-batch gradient, scaled so that the global norm
alternates below and above the clipping limit, and handed to the replicas as random parts that sum to it (each
rank's backward of sum(parameter x its part), which FSDP2 reduce-scatters). All values sit on a 2^-18 grid, so the
reduce-scatter sums them exactly in any order and the only differences left are the optimizers' own fp32
roundings."""

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR

from core.checkpoint import load_checkpoint, save_checkpoint
from core.fsdp import FSDPAdamW, local_rows, shard_model
from core.mesh import build_mesh, destroy_mesh
from core.training import ParamRule, default_rule, lr_factor
from tests.multiproc import run_ranks

E, STEPS, SAVE_AT, WARMUP, MIN_RATIO, DECAY_FRACTION = 6, 6, 3, 2, 0.1, 0.5
LR, WD, BETAS, EPS, MAX_NORM = 1e-2, 0.1, (0.9, 0.95), 1e-8, 1.0
NORMS = [0.5, 3.0, 0.8, 2.0, 0.3, 5.0]  # global gradient norm of each step: below and above MAX_NORM in turn
GRID = 2.0**-18
EXPERTS = "layers.0.mlp.routed.w"  # a routed expert by declaration, not by name
NO_DECAY = {"layers.0.fc1.bias", "layers.0.norm.weight", "layers.0.norm.bias", "fc2.bias"}  # norms and biases
# Reset after step SAVE_AT. At ep=2 an ep rank holds 3 experts [3, 10, 5], rows [0, 2) and [2, 3) over dp=2: expert 1
# (local 1 of ep rank 0) lies inside dp rank 0's shard. fc1.weight [10, 6] rows 2:5 over 4 ranks of 3 rows: rank 0
# holds the part's start (row 2), rank 1 its end (3, 4), ranks 2 and 3 none of it.
REVIVED, DENSE_RESET = 1, ("layers.0.fc1.weight", slice(2, 5))
HALF_IDLE, IDLE = 4, 5  # expert 4 gets a gradient on dp rank 1 only, expert 5 on no rank (both local to ep rank 1)


class Experts(nn.Module):
    def __init__(self, w_LHN: torch.Tensor, expert_ids: list[int]):
        super().__init__()
        self.w, self.expert_ids = nn.Parameter(w_LHN), expert_ids

    def forward(self, part_LHN):
        return (self.w * part_LHN).sum()


class Layer(nn.Module):
    moe = True

    def __init__(self, w_LHN: torch.Tensor, expert_ids: list[int]):
        super().__init__()
        self.fc1, self.norm, self.mlp = nn.Linear(6, 10), nn.LayerNorm(10), nn.Module()
        self.mlp.routed = Experts(w_LHN, expert_ids)
        self.unused = nn.Parameter(torch.randn(2, 10))  # no gradient on any rank: it steps with g = 0

    def forward(self, parts: dict):
        own = [(n, p) for n, p in self.named_parameters() if not n.startswith(("mlp.", "unused"))]
        return sum((p * parts[f"layers.0.{n}"]).sum() for n, p in own) + self.mlp.routed(parts[EXPERTS])


class Plain(nn.Module):
    """Linear -> LayerNorm -> a stack of 'expert' matrices -> Linear: 2-D, 3-D and 1-D parameters of uneven sizes,
    as core/fsdp.py:shard_model's units (one MoE layer with its experts, the root). `forward` is the reference's
    loss; `forward_train(parts)` sums each parameter times its gradient part, so that backward hands it that part."""

    def __init__(self, lo=0, hi=E, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleDict({"0": Layer(torch.randn(E, 10, 5)[lo:hi].clone() * 0.3, list(range(lo, hi)))})
        self.fc2, self.embed_tokens = nn.Linear(5, 3), None

    def forward(self, x):
        layer = self.layers["0"]
        h = layer.norm(F.gelu(layer.fc1(x)))
        return self.fc2(torch.tanh(torch.einsum("bh,ehn->bn", h, layer.mlp.routed.w)))

    def parameter_rules(self, name: str, t: torch.Tensor) -> ParamRule:
        """The names' default (core/training.py:default_rule), but for the routed experts named `routed`."""
        rule = default_rule(self, name, t, std=0.3)
        return replace(rule, expert_ids=self.layers["0"].mlp.routed.expert_ids) if name == EXPERTS else rule

    def forward_train(self, parts: dict):
        return self.layers["0"](parts) + sum((p * parts[f"fc2.{n}"]).sum() for n, p in self.fc2.named_parameters())


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().clamp(min=1e-30).item() if b.numel() else 0.0


def on_grid(t: torch.Tensor) -> torch.Tensor:
    return (t / GRID).round() * GRID


def reference_schedule(opt, schedule: str):
    """torch's schedulers for lr_factor's warmup + cosine / wsd (written independently of core/training.py)."""
    warmup = LinearLR(opt, 1 / WARMUP, 1.0, total_iters=WARMUP - 1)
    if schedule == "cosine":
        return SequentialLR(opt, [warmup, CosineAnnealingLR(opt, STEPS - WARMUP, eta_min=LR * MIN_RATIO)], [WARMUP])
    decay = int(DECAY_FRACTION * STEPS)
    return SequentialLR(opt, [warmup, ConstantLR(opt, 1.0, total_iters=0),
                              LinearLR(opt, 1 - (1 - MIN_RATIO) / decay, MIN_RATIO, total_iters=decay - 1)],
                        [WARMUP, STEPS - decay])


def optimizer_worker(ckpt_dir: str, schedule: str):
    """6 steps of FSDPAdamW next to torch.optim.AdamW; returns per-step (lr, norm) pairs, weight errors, Adam state
    errors right after loading the checkpoint and at the end, and how the reset parts met the shards."""
    mesh = build_mesh(ep=2 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 1)
    ep, ep_rank = mesh.ep, mesh.coord("ep")
    lo, hi = ep_rank * E // ep, (ep_rank + 1) * E // ep
    dense_group, expert_group = mesh.group("dp", "cp", "ep"), mesh.group("dp", "cp")
    gen = torch.Generator().manual_seed(7)  # the same on every rank: every rank builds every replica's part

    ref = Plain()
    params = dict(ref.named_parameters())
    ref_opt = torch.optim.AdamW([{"params": [p for n, p in params.items() if n not in NO_DECAY], "weight_decay": WD},
                                 {"params": [p for n, p in params.items() if n in NO_DECAY], "weight_decay": 0.0}],
                                lr=LR, betas=BETAS, eps=EPS, foreach=False)
    ref_sched = reference_schedule(ref_opt, schedule)
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)

    def build(seed):
        model = Plain(lo, hi, seed)
        units = shard_model(model, mesh, bf16=False, once=False) if mesh.world > 1 else None
        opt = FSDPAdamW(model, units, LR, WD, BETAS, EPS, norm_group=torch.distributed.group.WORLD if mesh.world > 1
                        else None)
        sched = LambdaLR(opt.optimizer, lambda s: lr_factor(s, schedule, WARMUP, STEPS, MIN_RATIO, DECAY_FRACTION))
        return model, opt, sched

    def my_part(g, group, expert=False):
        """This rank's part of gradient g for a parameter replicated over `group`: random parts summing to g; the
        idle experts' rows all on the last rank of the group (zero for IDLE)."""
        n = 1 if group is None else torch.distributed.get_world_size(group)
        me = 0 if group is None else torch.distributed.get_rank(group)
        parts = [on_grid(g * (3 * torch.rand(g.shape, generator=gen) - 1)) for _ in range(n - 1)]
        parts.append(g - sum(parts, torch.zeros_like(g)))  # exact: everything is on the grid
        for e in (HALF_IDLE, IDLE) if expert and lo <= IDLE < hi else ():
            for part in parts:
                part[e - lo] = 0
            parts[-1][e - lo] = g[e - lo]
        return parts[me]

    def mine(name, t):
        """This rank's rows of the reference's tensor t of parameter `name` (its ep rank's experts, its shard)."""
        local, first = opt.local[name], local_rows(opt.params[name])[2]
        return (t[lo:hi] if name == EXPERTS else t)[first: first + local.shape[0]]

    def state_errors(opt):
        """Worst max_abs_diff / max_abs of this rank's Adam shards against the rows of torch's state (and the step
        counts must be equal)."""
        worst = 0.0
        for n, local in opt.local.items():
            ref_state, state = ref_opt.state[params[n]], opt.optimizer.state[local]
            assert float(state["step"]) == float(ref_state["step"]), n
            worst = max([worst] + [max_rel_diff(state[k], mine(n, ref_state[k])) for k in ("exp_avg", "exp_avg_sq")])
        return worst

    def overlap(opt, name, first, last):
        """(part, shard): rows first:last of `name` and the rows of this rank's shard."""
        start = local_rows(opt.params[name])[2]
        return (first, last), (start, start + opt.local[name].shape[0])

    def weight_error(opt):
        return max(max_rel_diff(local, mine(n, params[n].detach())) for n, local in opt.local.items())

    model, opt, sched = build(seed=0)
    steps, weight_errors, state_after_load, overlaps = [], [], None, []
    for step in range(STEPS):
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y, reduction="sum").backward()
        params["layers.0.unused"].grad = torch.zeros_like(params["layers.0.unused"])
        grads = {n: p.grad for n, p in params.items()}
        grads[EXPERTS][IDLE] = 0  # no rank has a gradient for it
        scale = NORMS[step] / torch.stack([g.norm() for g in grads.values()]).norm()
        for n, p in params.items():
            p.grad = on_grid(grads[n] * scale)
        assert max(p.grad.abs().max() for p in params.values()) < 4  # grid sums stay exact in fp32
        parts = {n: my_part(p.grad[lo:hi], expert_group, expert=True) if n == EXPERTS else my_part(p.grad, dense_group)
                 for n, p in params.items()}
        model.forward_train(parts).backward()

        ref_lr = ref_sched.get_last_lr()[0]
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_sched.step()
        lr = sched.get_last_lr()[0]
        opt.reduce_gradients()
        norm = opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        steps.append((lr, ref_lr, norm.item(), ref_norm.item()))
        weight_errors.append(weight_error(opt))
        if step + 1 == SAVE_AT:  # reset an expert (new weights) and part of a dense matrix (same weights) ...
            new_expert = torch.randn(10, 5, generator=gen) * 0.3  # drawn on every rank: gen stays in step
            name, rows = DENSE_RESET
            with torch.no_grad():
                params[EXPERTS][REVIVED] = new_expert
            for key in ("exp_avg", "exp_avg_sq"):
                ref_opt.state[params[EXPERTS]][key][REVIVED] = 0
                ref_opt.state[params[name]][key][rows] = 0
            if lo <= REVIVED < hi:  # the ranks holding the expert (all its dp replicas) reset it
                opt.reinit_(EXPERTS, REVIVED - lo, new_expert)
                overlaps.append(overlap(opt, EXPERTS, REVIVED - lo, REVIVED - lo + 1))
            opt.reinit_(name, rows, None)
            overlaps.append(overlap(opt, name, rows.start, rows.stop))
            # ... then checkpoint, and continue with new objects built from another seed
            state = opt.checkpoint_state(model)
            saved_experts = sorted(k for k in state["model"] if k.startswith(EXPERTS))  # name[global id] per row
            save_checkpoint(ckpt_dir, step + 1, state, {"scheduler": sched.state_dict()}, mesh.rank)
            model, opt, sched = build(seed=1)
            extra = load_checkpoint(f"{ckpt_dir}/step_{step + 1:08d}", opt.checkpoint_state(model),
                                    {"scheduler": sched.state_dict()}, mesh.rank)
            opt.after_load(extra)
            sched.load_state_dict(extra["scheduler"])
            state_after_load = state_errors(opt)
            weight_errors.append(weight_error(opt))  # the new expert came back from the checkpoint
    result = steps, weight_errors, state_after_load, state_errors(opt), saved_experts, overlaps
    destroy_mesh()
    return result


def check(results):
    # every global expert on exactly one rank (its ep rank's, the dp shard holding its row), under its id: the
    # declared expert tensor is checkpointed per expert
    assert sorted(k for r in results for k in r[4]) == sorted(f"{EXPERTS}[{e}]" for e in range(E))
    for steps, weight_errors, state_after_load, state_at_end, *_ in results:
        for lr, ref_lr, norm, ref_norm in steps:
            assert lr == pytest.approx(ref_lr, rel=1e-12)
            assert norm == pytest.approx(ref_norm, rel=1e-6)
        ref_norms = [s[3] for s in steps]
        assert min(ref_norms) < MAX_NORM < max(ref_norms)  # clipped and unclipped steps both happened
        assert max(weight_errors) <= 1e-6, weight_errors  # fp32 rounding (eps 1.2e-7) of a few operations
        assert state_after_load <= 1e-6 and state_at_end <= 1e-6, (state_after_load, state_at_end)


def reset_cases(results) -> set[str]:
    """How the reset parts met the ranks' shards (rows): 'start' (the shard holds the part's start but not its
    end), 'end' (its end but not its start), 'empty', 'inside' (the shard holds the whole part), 'over' (the part
    covers the shard)."""
    cases = set()
    for (a, b), (s, t) in [o for result in results for o in result[-1]]:
        cases.add("empty" if min(b, t) <= max(a, s) else "inside" if s <= a and b <= t else
                  "over" if a <= s and t <= b else "start" if a >= s else "end")
    return cases


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_one_process_equals_torch_adamw(schedule, tmp_path):
    results = [optimizer_worker(str(tmp_path), schedule)]
    check(results)
    assert reset_cases(results) == {"inside"}


def test_fsdp2_sharded_over_dp2_ep2_equals_torch_adamw(tmp_path):
    results = run_ranks(4, optimizer_worker, str(tmp_path), "cosine")
    check(results)
    assert reset_cases(results) == {"start", "end", "empty", "inside"}  # partial on both sides, ranks with none


def test_reinit_rejects_bad_arguments():
    """One line naming what to change for each bad argument; a reinit before the first step (no Adam state yet)
    only writes the weights."""
    model = Plain()
    opt = FSDPAdamW(model, None, LR, WD, BETAS, EPS)
    for args, message in [(("expert", 0, None), r"no parameter 'expert' in this optimizer; it has 8, e\.g\. 'layers"),
                          ((EXPERTS, E, None), f"index {E} is out of range for dim 0 of {EXPERTS} \\(size {E}\\)"),
                          ((EXPERTS, -E - 1, None), "out of range"),
                          (("fc2.bias", slice(1, 4), None), "0 <= first < last <= 3"),
                          (("fc2.bias", slice(2, 2), None), "must select rows"),
                          (("fc2.bias", slice(0, 3, 2), None), "step 1"),
                          ((EXPERTS, "0", None), "must be an int or a slice"),
                          ((EXPERTS, 0, torch.zeros(1, 10, 5)), r"w\[0\] must have shape \(10, 5\), got \(1, "),
                          (("layers.0.fc1.weight", slice(-2, None), torch.zeros(2, 5)), r"weight\[8:10\] must have shape")]:
        with pytest.raises(ValueError, match=message):
            opt.reinit_(*args)
    opt.reinit_(EXPERTS, -1, torch.ones(10, 5))
    assert bool((model.layers["0"].mlp.routed.w[E - 1] == 1).all()) and not opt.optimizer.state
