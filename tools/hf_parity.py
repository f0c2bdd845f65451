"""Hugging Face parity check of a recipe: logits, the gradient of a loss, and an export round trip.

    python -m tools.hf_parity --recipe qwen3_30b_a3b                 # tiny random model from config_tiny.json
    python -m tools.hf_parity --recipe qwen3_30b_a3b --hf-dir DIR    # an existing checkpoint folder
    python -m tools.hf_parity --recipe qwen3_30b_a3b --float64       # both in float64, ~1e-14 apart

The reference is transformers' AutoModelForCausalLM, in fp32 on CPU. Gradients are compared under the
checkpoint's own tensor names: ours through the recipe's save_hf_checkpoint, transformers' through its
save_pretrained (which also splits its fused in-memory expert tensors back into per-expert keys).

In float64 (`check_recipe(..., dtype=torch.float64)`, `--float64`) both models run in float64 end to end, and
transformers' own fp32 islands (RMSNorm statistics, rope angles, router and attention softmax, which it computes
in fp32 whatever the model's dtype) are widened to float64 by KeepFloat64, so that both sides round at ~1e-16.
"""

import argparse
import contextlib
import copy
import importlib
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from core.hf_io import CheckpointReader


@dataclass
class Row:
    check: str
    max_abs: float
    rel: float
    tol: float
    metric: str  # which of max_abs / rel is held to tol

    @property
    def ok(self) -> bool:
        return (self.max_abs if self.metric == "max_abs" else self.rel) <= self.tol


def compare(check: str, ours: torch.Tensor, ref: torch.Tensor, tol: float, metric: str = "max_abs") -> Row:
    ours, ref = ours.detach().double(), ref.detach().double()
    if ours.shape != ref.shape:
        raise AssertionError(f"{check}: shape {tuple(ours.shape)} vs reference {tuple(ref.shape)}")
    diff = (ours - ref).norm() / ref.norm().clamp(min=1e-30)
    return Row(check, (ours - ref).abs().max().item(), diff.item(), tol, metric)


def folder_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder (small test models only)."""
    reader = CheckpointReader(path)
    return {name: reader.get(name) for name in reader.weight_map}


def grads_by_checkpoint_name(model: torch.nn.Module, save) -> dict[str, torch.Tensor]:
    """Write a copy of `model` whose weights are its gradients with `save(copy, dir)`, read it back."""
    shadow = copy.deepcopy(model)
    with torch.no_grad():
        for p_shadow, p in zip(shadow.parameters(), model.parameters()):
            p_shadow.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    with tempfile.TemporaryDirectory() as tmp:
        save(shadow, tmp)
        return folder_tensors(tmp)


FLOAT64_TOLERANCE = 1e-10  # float64 logits and gradients, relative: both sides round at 2^-53 = 1.1e-16 per op;
# through a few layers, softmaxes and sums of ~1e3 terms that grows to ~1e-14 (measured 1e-15 to 3e-14). One fp32
# step anywhere (an upcast left at .float(), fp32 rope angles) shows as >= 1e-8, so 1e-10 sits 100x from each side


class KeepFloat64(TorchFunctionMode):
    """transformers computes norms, rope and softmaxes in fp32 even in a float64 model (x.to(torch.float32),
    x.float(), softmax(dtype=torch.float32), arange(dtype=torch.float)): inside this mode every fp32 requested
    by a torch call becomes float64, so a float64 model is float64 throughout (no fp32 rounding, ~1e-7, left)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        widen = lambda a: torch.float64 if a is torch.float32 else a
        args, kwargs = tuple(map(widen, args)), {k: widen(v) for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*args, **kwargs)


def make_tiny_hf_model(config_json, out_dir, seed: int = 0) -> Path:
    """A random transformers model built from a config.json or a dict of its fields (nothing downloaded),
    saved with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = dict(config_json) if isinstance(config_json, dict) else json.loads(Path(config_json).read_text())
    hf_cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return Path(out_dir)


# fp32 rows' bounds follow the model under test: NOISE_FACTOR x transformers' own fp32 rounding of the quantity (its
# fp32 run against its float64 run from the same weights), at least NOISE_FLOOR. Both models round at that size
# (other kernels, other sum orders: ours ~ sqrt(2) x theirs from each other), so 16x leaves room for a model that
# rounds 10x more than transformers; a quantity that is a sum of cancelling terms (a Gated DeltaNet's A_log and
# dt_bias where the decay saturates: 2.5e-4 between transformers in fp32 and in float64, its true value ~0) is
# noise on both sides and gets a bound as large; a quantity fp32 represents almost exactly (noise ~0) may still
# differ by a few ulps: the floor, 2e-6 (~30 ulps of 6e-8). A wrong formula moves a quantity by O(1e-3) or more.
NOISE_FACTOR = 16.0
NOISE_FLOOR = 2e-6


def float64_reference(hf_dir, ids, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits and gradients of the same loss with the model in float64 (KeepFloat64), by checkpoint
    name: where the fp32 rows take their bounds from."""
    from transformers import AutoModelForCausalLM

    with KeepFloat64():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, experts_implementation="eager")
        ref.train()
        logits = ref(input_ids=ids).logits
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    return logits.detach(), grads_by_checkpoint_name(ref, lambda m, d: m.save_pretrained(d))


def noise_bound(noise: float) -> float:
    """The bound of a quantity whose fp32 run is `noise` (relative) from its float64 run: NOISE_FACTOR times that,
    at least NOISE_FLOOR (also the shared checks' layout rows: tests/test_train.py)."""
    return max(NOISE_FLOOR, NOISE_FACTOR * noise)


def check_recipe(recipe: str, hf_dir, batch: int = 2, seq_len: int = 24, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> list[Row]:
    """Rows of logits, gradients (together and the worst tensor) and, in fp32, the export round trip, each fp32 row
    within noise_bound of transformers' own fp32 rounding of it (its float64 run); in float64 (dtype) every row is a
    relative error held to FLOAT64_TOLERANCE, transformers run inside KeepFloat64."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    mod = importlib.import_module(f"recipes.{recipe}.model")
    float64 = dtype == torch.float64
    logits_metric = "rel" if float64 else "max_abs"
    torch.manual_seed(seed)
    with KeepFloat64() if float64 else contextlib.nullcontext():
        # float64: transformers' per-expert loop (torch's grouped GEMM refuses float64)
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, **{"experts_implementation": "eager"} if float64 else {})
    ref.train()  # dropout is 0 in these configs; train() matches how the recipe is used
    cfg = mod.ModelConfig.from_hf(hf_dir)
    model = mod.Model(cfg)
    mod.load_hf_checkpoint(model, hf_dir)
    model.to(dtype)

    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    labels = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    with KeepFloat64() if float64 else contextlib.nullcontext():
        ref_logits = ref(input_ids=ids).logits
    logits = model(ids)
    if float64:
        bound = lambda name, ref_value: FLOAT64_TOLERANCE
    else:  # each row's bound from transformers' own fp32 rounding of the same quantity
        ref64_logits, ref64_grads = float64_reference(hf_dir, ids, labels)
        ref64 = lambda name: ref64_logits if name == "logits" else ref64_grads[name] if name in ref64_grads else \
            torch.cat([ref64_grads[n].flatten() for n in names])
        bound = lambda name, ref_value: noise_bound(getattr(compare(name, ref_value, ref64(name), 0), "max_abs" if
                                                            name == "logits" else "rel"))
    rows = [compare("logits", logits, ref_logits, bound("logits", ref_logits), logits_metric)]

    # gradient of the same loss on both models
    with KeepFloat64() if float64 else contextlib.nullcontext():
        F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    ref_grads = grads_by_checkpoint_name(ref, lambda m, d: m.save_pretrained(d))
    grads = grads_by_checkpoint_name(model, mod.save_hf_checkpoint)
    # a tensor transformers lacks (it drops it on load: a training-only module) must not reach the logits, unless
    # it is a copy of one it has (DeepSeek-V3's MTP layer stores the shared embedding and head again)
    copy_of = lambda n: any(grads[m].shape == grads[n].shape and torch.equal(grads[m], grads[n]) for m in ref_grads)
    reaching = [n for n in set(grads) - set(ref_grads) if grads[n].any() and not copy_of(n)]
    if set(ref_grads) - set(grads) or reaching:
        raise AssertionError(f"tensor names differ: only ours and reaching the logits {sorted(reaching)[:5]}, "
                             f"only transformers' {sorted(set(ref_grads) - set(grads))[:5]}")
    grads = {n: g for n, g in grads.items() if n in ref_grads}
    names = sorted(grads)
    ref_all = torch.cat([ref_grads[n].flatten() for n in names])
    rows.append(compare("grad (all tensors)", torch.cat([grads[n].flatten() for n in names]), ref_all,
                        bound("all", ref_all), "rel"))
    bounds = {n: bound(n, ref_grads[n]) for n in names}
    worst = max(names, key=lambda n: compare(n, grads[n], ref_grads[n], 0).rel / bounds[n])
    rows.append(compare(f"grad worst: {worst}", grads[worst], ref_grads[worst], bounds[worst], "rel"))
    if float64:
        return rows

    # export round trip: transformers loads what save_hf_checkpoint wrote and gives the same logits
    with tempfile.TemporaryDirectory() as tmp:
        mod.save_hf_checkpoint(model, tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        with torch.no_grad():
            rows.append(compare("export -> transformers logits", reloaded(input_ids=ids).logits, logits, rows[0].tol))
    return rows


def format_table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  {'max abs err':>11}  {'rel err':>9}  {'tolerance':>16}  result",
             "-" * (width + 54)]
    for r in rows:
        lines.append(f"{r.check:<{width}}  {r.max_abs:>11.3e}  {r.rel:>9.3e}  {r.metric + ' <= ' + f'{r.tol:.0e}':>16}  "
                     f"{'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="qwen3_30b_a3b", help="folder name under recipes/")
    parser.add_argument("--hf-dir", default="", help="Hugging Face checkpoint folder; default: a tiny random one")
    parser.add_argument("--config", default="", help="config.json for the tiny random model (default: the recipe's config_tiny.json)")
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float64", action="store_true", help="both models in float64 (bound FLOAT64_TOLERANCE)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir
        if not hf_dir:
            config = args.config or Path(__file__).resolve().parents[1] / "recipes" / args.recipe / "config_tiny.json"
            hf_dir = make_tiny_hf_model(config, Path(tmp) / "hf", args.seed)
        rows = check_recipe(args.recipe, hf_dir, seq_len=args.seq_len, seed=args.seed,
                            dtype=torch.float64 if args.float64 else torch.float32)
    print(f"Hugging Face parity: recipe {args.recipe}, checkpoint {args.hf_dir or 'tiny random'}")
    print(format_table(rows))
    ok = all(r.ok for r in rows)
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
