"""--optimizer muon (core/muon.py): one process equals torch.optim.Muon + torch.optim.AdamW fed the same gradients, on
the matrices of the transformers checkpoint layout; parallel layouts (on FSDP2's shards) equal one process (every
layout for Qwen3: tests/test_fsdp.py); resume is exact and a checkpoint written at one (dp, ep) loads at another."""

import dataclasses
import inspect
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.optim._muon as torch_muon

from core.muon import MuonAdamW, newton_schulz
from core.training import parameter_rules
from recipes import recipe_names
from tests.model_variants import VARIANTS
from tests.multiproc import run_ranks
from tests.recipe_checks import PLACED, check_args, layout_errors, layouts_worker, load_recipe, write_config
from tests.test_train import LAYOUT_TOLERANCE, bitwise_error, rel_err, run_train, worst_error

LR, WD, BETAS, EPS, CLIP = 2e-2, 0.1, (0.9, 0.95), 1e-8, 0.5


def torch_newton_schulz_in(dtype: torch.dtype):
    """torch.optim.Muon's own Newton-Schulz, unchanged but for the dtype it casts to (bf16 there): its one
    `grad.bfloat16()` call is redirected to `dtype` while it runs."""
    source = inspect.getsource(torch_muon._zeropower_via_newtonschulz)
    assert source.count(".bfloat16()") == 1, "torch.optim.Muon changed: revisit this reference"
    original = torch_muon._zeropower_via_newtonschulz

    def newton_schulz_in_dtype(*args, **kwargs):
        with mock.patch.object(torch.Tensor, "bfloat16", lambda t, *a, **k: t.to(dtype)):
            return original(*args, **kwargs)
    return newton_schulz_in_dtype


def is_muon_matrix(hf_name: str, t: torch.Tensor) -> bool:
    """Moonlight's split, by transformers checkpoint name: weight matrices of attention (linear attention's
    projections too), dense MLPs and experts go to Muon; embeddings, the LM head, norms, biases, routers, gates of
    one row (shared_expert_gate), depthwise conv kernels, sinks, A_log and dt_bias to AdamW."""
    if t.ndim < 2 or "embed_tokens" in hf_name or "lm_head" in hf_name or hf_name.endswith("bias") or \
            "shared_head.head" in hf_name:  # (DeepSeek-V3's MTP layer stores a copy of the LM head)
        return False
    return not hf_name.endswith(("mlp.gate.weight", "mlp.router.weight", "shared_expert_gate.weight", "conv1d.weight"))


def declared_matrices(model, tensors: dict) -> dict[str, torch.Tensor]:
    """The matrices Model.parameter_rules declares Muon's, as [A, B] views of `tensors` (one per parameter, e.g. the
    gradients): what the reference optimizer steps (names: parameter.kind.index)."""
    return {f"{name}.{kind}.{s}": v_SAB[s] for name in tensors
            for kind, (v_SAB, _) in model.parameter_rules(name, tensors[name]).muon.items()
            for s in range(v_SAB.shape[0])}


@pytest.mark.parametrize("name", [n for n in recipe_names() if load_recipe(n).model.TRANSFORMERS_CLASS])
def test_declared_matrices_are_moonlights(name, tmp_path):
    """A recipe that equals a transformers class (TRANSFORMERS_CLASS) declares Moonlight's matrices on transformers'
    checkpoint layout (is_muon_matrix), each whole: every declared matrix numbered in place, the export
    (hf_state_dict, checked against transformers by the parity tests) must carry each of Moonlight's matrices as
    one number and nothing else. GPT-OSS keeps each layer's experts as one [E, H, 2I] tensor with gate and up
    interleaved (transformers' GptOssExperts: gate = [..., ::2], up = [..., 1::2]): one matrix per expert and half.
    A copy that departs from transformers (TRANSFORMERS_CLASS None) declares its own split, which
    test_one_process_equals_torch_muon_and_adamw steps as declared."""
    recipe = load_recipe(name)
    model = recipe.model.Model(recipe.model.ModelConfig.from_hf(write_config(tmp_path / "config.json", recipe.config)))
    numbered = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    for i, v_AB in enumerate(declared_matrices(model, numbered).values()):
        v_AB.fill_(i + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(numbered[n])
    hf = recipe.model.hf_state_dict(model)
    found = []
    for hf_name, t in hf.items():
        if not is_muon_matrix(hf_name, t):
            assert not t.any(), f"{hf_name} is declared (part of) a Muon matrix; Moonlight's split gives it AdamW"
            continue
        halves = [t[e][:, 0::2] for e in range(t.shape[0])] + [t[e][:, 1::2] for e in range(t.shape[0])] \
            if hf_name.endswith("gate_up_proj") else list(t) if t.ndim == 3 else [t]
        for m in halves:
            assert m.unique().numel() == 1 and m.flatten()[0] > 0, f"{hf_name}: not one whole declared matrix"
            found.append(int(m.flatten()[0]))
    assert sorted(found) == list(range(1, len(found) + 1)) and len(found) == len(declared_matrices(model, numbered))


def momentum_like_params(opt: MuonAdamW, model) -> dict[str, torch.Tensor]:
    """The optimizer's momentum laid out like the parameters (zeros where AdamW trains)."""
    out = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for m in opt.owned:  # (one process: every matrix, at its place in the whole parameter)
        out[m.name].view(-1).as_strided(m.size, m.stride, m.offset).copy_(m.momentum_kAB)
    return out


def run_against_torch(mod, config: dict, seq_len: int, workdir: Path, steps: int = 4, adamw: tuple = (),
                      no_decay: tuple = ()) -> dict[str, tuple[float, str]]:
    """`steps` steps of MuonAdamW (one process) and of torch.optim.Muon(adjust_lr_fn="match_rms_adamw", Newton-Schulz
    in fp32) + torch.optim.AdamW on copies, both fed the gradients of MuonAdamW's model at each step, clipped by
    torch.nn.utils.clip_grad_norm_ on the reference side, with a changing learning rate. The reference's split is
    what Model.parameter_rules declares: Muon's matrices (declared_matrices), AdamW's tensors with and without
    weight decay (ParamRule.decay). Returns the worst relative errors of the weight changes, the momentum and the
    grad norm. mod: the recipe's model module; adamw, no_decay: name endings this test's copy of the model declares
    AdamW's, or without weight decay (its Model.parameter_rules overridden to say so)."""

    class Declared(mod.Model):
        def parameter_rules(self, name, t):
            rule = super().parameter_rules(name, t)
            rule = dataclasses.replace(rule, muon={}) if name.endswith(adamw) else rule
            return dataclasses.replace(rule, decay=False) if name.endswith(no_decay) else rule

    torch.manual_seed(0)
    model = Declared(mod.ModelConfig.from_hf(write_config(workdir / "config.json", config)))
    params = dict(model.named_parameters())
    opt = MuonAdamW(model, None, LR, WD, BETAS, EPS)
    start = {n: p.detach().clone() for n, p in params.items()}
    matrices = lambda tensors: declared_matrices(model, tensors)
    ref_matrices = {k: v.clone().requires_grad_() for k, v in matrices(start).items()}
    rules = parameter_rules(model)
    ref_other = {n: start[n].clone().requires_grad_() for n in params if not rules[n].muon}
    ref_muon = torch.optim.Muon(list(ref_matrices.values()), lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([{"params": [t for n, t in ref_other.items() if rules[n].decay == decay],
                                    "weight_decay": WD if decay else 0.0} for decay in (True, False)],
                                  lr=LR, betas=BETAS, eps=EPS, foreach=True)
    norm_errors = []
    original_ns = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = torch_newton_schulz_in(torch.float32)
    try:
        for step in range(steps):
            lr = LR * (step + 1) / steps
            for g in ref_muon.param_groups + ref_adamw.param_groups + opt.param_groups:
                g["lr"] = lr
            ids = torch.randint(0, config["vocab_size"], (2, seq_len))
            out = model.forward_train(ids, torch.roll(ids, -1, 1))
            # every term the model trains (DeepSeek-V3's MTP term reaches parameters the others do not)
            (sum(t / ids.numel() for n, t in out.terms.items() if n != "aux") + 0.01 * out.aux_loss).backward()
            grads = {n: p.grad.clone() for n, p in params.items()}
            for k, g in matrices(grads).items():
                ref_matrices[k].grad = g.clone()
            for n, t in ref_other.items():
                t.grad = grads[n].clone()
            ref_norm = torch.nn.utils.clip_grad_norm_([*ref_matrices.values(), *ref_other.values()], CLIP)
            opt.reduce_gradients()
            norm = opt.clip_grad_norm_(CLIP)
            norm_errors.append(abs(norm.item() - ref_norm.item()) / ref_norm.item())
            assert ref_norm > CLIP, "clipping should be active"
            opt.step()
            opt.zero_grad()
            ref_muon.step()
            ref_adamw.step()
            if step == 1:  # reinit_: a routed expert gets new weights, 3 rows of a dense matrix keep theirs; both
                # lose their momentum (torch's: zeroed where the parts meet the checkpoint layout's matrices)
                expert = next(n for n, rule in rules.items() if rule.expert_ids is not None and rule.muon)
                dense = next(n for n, rule in rules.items() if rule.expert_ids is None and rule.muon and
                             params[n].shape[0] >= 5)
                opt.reinit_(expert, 1, 0.02 * torch.randn(params[expert][1].shape))
                opt.reinit_(dense, slice(2, 5))
                reset = {n: torch.zeros_like(p) for n, p in params.items()}  # 1 where reset
                reset[expert][1], reset[dense][2:5] = 1, 1
                for n, t in ref_other.items():  # a part AdamW trains (declared so): its moments zeroed there
                    for moments in (ref_adamw.state[t]["exp_avg"], ref_adamw.state[t]["exp_avg_sq"]):
                        moments[reset[n].bool()] = 0
                now = matrices({n: p.detach() for n, p in params.items()})
                for k, mask in matrices(reset).items():
                    mask = mask.bool()
                    ref_muon.state[ref_matrices[k]]["momentum_buffer"][mask] = 0
                    ref_matrices[k].data[mask] = now[k][mask]
    finally:
        torch_muon._zeropower_via_newtonschulz = original_ns
    now = {n: p.detach() for n, p in params.items()}
    mine = matrices({n: now[n] - start[n] for n in params})
    ref_start = matrices(start)
    errors = {"muon weight change": worst_error((rel_err(mine[k], t.detach() - ref_start[k]), k)
                                                for k, t in ref_matrices.items()),
              "adamw weight change": worst_error((rel_err(now[n] - start[n], t.detach() - start[n]), n)
                                                 for n, t in ref_other.items()),
              "grad norm": (max(norm_errors), "")}
    momentum = matrices(momentum_like_params(opt, model))
    errors["momentum"] = worst_error((rel_err(momentum[k], ref_muon.state[t]["momentum_buffer"]), k)
                                     for k, t in ref_matrices.items())
    return errors


BOUNDS = {"momentum": 1e-6, "grad norm": 1e-6, "adamw weight change": 1e-5, "muon weight change": 3e-5}


def assert_equals_torch(errors: dict) -> None:
    """Bounds. Momentum and grad norm 1e-6: the same gradients, clipped by a norm summed in another order (~1e-7).
    AdamW 1e-5: tests/test_train.py:LAYOUT_TOLERANCE's reason (Adam's division turns the clip factor's ~1e-7 into
    ~1e-6 where a gradient is ~eps). Muon 3e-5: batched and per-matrix GEMMs round differently (~6e-8 per op), and
    Newton-Schulz grows a perturbation of the small singular values by up to a = 3.4445 per step, 3.4445^5 ~ 485 over
    5 steps: 485 x 6e-8 ~ 3e-5 (measured 1e-6 to 4e-6). The planted bugs (no RMS scaling, a declared-AdamW matrix
    stepped by Muon, a no-decay matrix decayed) moved the weights by O(1) or by lr x wd (1e-3 of each weight)."""
    failed = {what: errors[what] for what, bound in BOUNDS.items() if not errors[what][0] <= bound}
    assert not failed, f"differ from torch.optim.Muon + AdamW (error, where): {failed}"


@pytest.mark.parametrize("name", recipe_names())
def test_one_process_equals_torch_muon_and_adamw(name, tmp_path):
    recipe = load_recipe(name)
    assert_equals_torch(run_against_torch(recipe.model, recipe.config, recipe.seq_len, tmp_path))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_equal_torch_muon_and_adamw(variant, tmp_path):
    """The Qwen3 copies of tests/model_variants.py (other names, a mixing matrix declared AdamW's without decay):
    the reference takes their split from what they declare, as for any recipe."""
    recipe = load_recipe("qwen3_30b_a3b")
    assert_equals_torch(run_against_torch(VARIANTS[variant](), recipe.config, recipe.seq_len, tmp_path))


def test_a_matrix_declared_adamw_is_stepped_by_adamw(tmp_path):
    """A copy that declares a 2-D weight AdamW's (here every o_proj, by overriding Model.parameter_rules) gets it
    stepped by AdamW and the rest unchanged: torch.optim.AdamW on o_proj, torch.optim.Muon on the other matrices;
    and one that declares it AdamW's without weight decay (ParamRule.decay False) gets AdamW without decay.
    Bounds as above; a Muon step of o_proj differs from AdamW's by O(1), a decayed step by lr x wd."""
    recipe = load_recipe("qwen3_30b_a3b")
    for no_decay in ((), ("o_proj.weight",)):
        assert_equals_torch(run_against_torch(recipe.model, recipe.config, recipe.seq_len, tmp_path,
                                              adamw=("o_proj.weight",), no_decay=no_decay))


def test_bf16_newton_schulz_equals_torch_muons():
    """On GPU Newton-Schulz runs in bf16: the batched stack equals torch.optim.Muon's own per-matrix bf16 iteration.
    Bound 1e-3: the same bf16 operations in the same order (bitwise equal on the CPUs tried, AVX2 and
    ATEN_CPU_CAPABILITY=default), with room for a GEMM kernel that splits its fp32 sums differently and flips a few
    last bf16 bits; fp32 instead of bf16 differs by ~1.5e-2, a wrong iteration by O(1)."""
    torch.manual_seed(0)
    for shape in [(8, 64, 32), (4, 32, 64), (2, 96, 96)]:
        g = torch.randn(shape)
        ref = torch.stack([torch_muon._zeropower_via_newtonschulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7) for m in g])
        got = newton_schulz(g, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and rel_err(got, ref) <= 1e-3, shape


LAYOUTS = {"ep2": {"ep": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "dp2": {"dp": 2}, "pp2xep2": {"pp": 2, "ep": 2},
           "cp2xep2": {"cp": 2, "ep": 2}, "dp2xep2": {"dp": 2, "ep": 2}, "dp2xep2 placed": {"dp": 2, "ep": 2}}
# in CI: both owner sets split (dense over 4, experts over 2) and the checkpoint resharded; every layout runs for
# Qwen3 in tests/test_fsdp.py (its VARIANTS), the rest of these under -m slow
CI_LAYOUTS = ("dp2xep2",)


def layout_runs(name: str, layouts, tmp_path) -> dict:
    """4 steps of --optimizer muon in one process and in each layout (every rank's losses, grad norms, weights), all
    of a world size in one spawned process group; with dp2xep2 among them, it saves at step 2 and three runs resume
    from there: at dp2xep2 again, at dp2 (ep 1) and in one process."""
    from tests.recipe_checks import data_vocab, write_counting_data

    data = write_counting_data(tmp_path / "data")
    recipe = load_recipe(name, data_vocab(data))
    config = write_config(tmp_path / "config.json", recipe.config)
    args = lambda out, **extra: check_args(recipe, config, data, tmp_path / out, optimizer="muon", steps=4, **extra)
    saved = tmp_path / "dp2xep2/checkpoints/step_00000002"
    # the shared checks' uneven ep2 placement for this recipe's expert count
    runs = {"placement": PLACED["ep2 placed"](recipe.model.ModelConfig.from_hf(config).num_experts),
            "single": run_train(args("single"), recipe.train.main)}
    jobs = {4: {}, 2: {}}
    for layout in layouts:
        extra = {"ckpt_every": 2} if layout == "dp2xep2" else {}
        if layout.endswith(" placed"):
            extra["expert_placement"] = ",".join(map(str, runs["placement"]))
        jobs[math.prod(LAYOUTS[layout].values())][layout] = ("train", args(layout, **LAYOUTS[layout], **extra))
    if "dp2xep2" in layouts:
        jobs[4]["dp2xep2 resumed"] = ("train", args("resumed", dp=2, ep=2, resume=saved))
        jobs[2]["dp2 from dp2xep2"] = ("train", args("dp2_from", dp=2, resume=saved))
    for world in (4, 2):  # the dp2xep2 checkpoint first
        per_rank = run_ranks(world, layouts_worker, name, jobs[world])
        runs.update({job: [rank[job] for rank in per_rank] for job in jobs[world]})
    if "dp2xep2" in layouts:
        runs["1 process from dp2xep2"] = [run_train(args("single_from", resume=saved), recipe.train.main)]
    return runs


@pytest.mark.parametrize("name,layouts", [
    pytest.param("deepseek_v2_lite", CI_LAYOUTS, id="ci"),  # MLA, shared experts, a dense layer: every kind of matrix
    pytest.param("deepseek_v2_lite", [k for k in LAYOUTS if k not in CI_LAYOUTS], id="rest", marks=pytest.mark.slow),
    *(pytest.param(other, list(LAYOUTS), id=other, marks=pytest.mark.slow) for other in recipe_names() if other != "deepseek_v2_lite")])
def test_layouts_equal_one_process_and_resume(name, layouts, tmp_path):
    """DeepSeek-V2-Lite in CI (dp2xep2: both owner sets split, dense over 4 ranks and experts over 2, MLA's and the
    shared experts' matrices; resume bit for bit and resharded), the other layouts and recipes under -m slow."""
    runs = layout_runs(name, layouts, tmp_path)
    single = runs["single"]
    assert max(single[1]) > 0.05, "clipping should be active so that the global norm is exercised"
    for layout in layouts:  # (every weight and buffer, the expert biases too; routed experts by global id)
        errors = layout_errors(single, runs[layout])
        print(layout, errors)
        assert all(errors[what][0] <= LAYOUT_TOLERANCE for what in errors), (layout, errors)
    if "dp2xep2" in layouts:  # resharded (ep 2 -> 1, dp 2 -> 2 and 1): another layout, so LAYOUT_TOLERANCE
        tail = (single[0][2:], single[1][2:], single[2])
        for job in ("dp2 from dp2xep2", "1 process from dp2xep2"):
            errors = layout_errors(tail, runs[job])
            print(job, errors)
            assert all(e <= LAYOUT_TOLERANCE for e, _, _ in errors.values()), (job, errors)
        # the same layout: bit for bit
        full = [(losses[2:], norms[2:], weights) for losses, norms, weights in runs["dp2xep2"]]
        for reference, resumed in zip(full, runs["dp2xep2 resumed"]):
            errors = layout_errors(reference, [resumed], error=bitwise_error)
            assert all(e == 0 for e, _, _ in errors.values()), errors
