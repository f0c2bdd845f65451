"""Train a variant recipe and its base on the same data, seed and flags (one process each); print the loss curves
side by side; check both are finite and decreasing (last loss below the first), and with --identical TOL that
the variant's losses equal the base's within TOL (relative, over the whole curve). Exit code 1 on a FAIL.

    python skills/validate-correctness/scripts/compare_variant.py --base qwen3_30b_a3b --variant my_arch \\
        --data data/stdlib [--steps 8] [--config FILE] [--identical 1e-6] [-- extra train.py flags]

Use --identical when the change should not move a number (a refactor, another kernel, a copied folder); leave it
out for a real architecture change (a new attention or norm), where only finite and decreasing are required.
"""

import argparse
import importlib
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

from tests.test_train import rel_err, run_train, train_args  # noqa: E402


def compare_variant(base: str, variant: str, data, out_dir, config="", steps: int = 8, identical=None, extra=()):
    """(base losses, variant losses, failures, table lines)."""
    losses = {}
    for name in (base, variant):
        train = importlib.import_module(f"recipes.{name}.train")
        cfg = config or Path(importlib.import_module(f"recipes.{base}.train").__file__).with_name("config_tiny.json")
        argv = train_args(cfg, data, Path(out_dir) / name, steps=steps) + list(extra)
        losses[name] = run_train(argv, train.main)[0]
    a, b = losses[base], losses[variant]
    lines = [f"variant {variant} vs base {base}: {steps} steps, same data, seed and flags",
             f"{'step':>4}  {'loss ' + base:>{max(12, len(base) + 5)}}  {'loss ' + variant:>{max(12, len(variant) + 5)}}"
             f"  {'difference':>11}"]
    lines += [f"{i + 1:>4}  {x:>{max(12, len(base) + 5)}.6f}  {y:>{max(12, len(variant) + 5)}.6f}  {y - x:>11.3e}"
              for i, (x, y) in enumerate(zip(a, b))]
    failures = [f"{name}: non-finite loss" for name in (base, variant) if not all(map(math.isfinite, losses[name]))]
    failures += [f"{name}: loss did not decrease ({losses[name][0]:.4f} -> {losses[name][-1]:.4f})"
                 for name in (base, variant) if not losses[name][-1] < losses[name][0]]
    if identical is not None:
        err = rel_err(torch.tensor(b), torch.tensor(a))
        lines.append(f"relative error of the loss curve {err:.2e} (tolerance {identical:.0e})")
        if not err <= identical:
            failures.append(f"losses differ: relative error {err:.2e} > {identical:.0e}")
    return a, b, failures, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="recipe folder name under recipes/ (the original)")
    parser.add_argument("--variant", required=True, help="recipe folder name under recipes/ (the changed copy)")
    parser.add_argument("--data", default="data/stdlib", help="token shards (python -m tools.prepare_data --default)")
    parser.add_argument("--config", default="", help="HF config.json for both (default: the base's config_tiny.json)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--identical", type=float, default=None, metavar="TOL",
                        help="the variant must reproduce the base's losses within TOL (relative)")
    parser.add_argument("extra", nargs="*", help="after --: more train.py flags for both runs")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise ValueError("--steps must be >= 2 to see the loss decrease")
    with tempfile.TemporaryDirectory() as tmp:
        *_, failures, lines = compare_variant(args.base, args.variant, args.data, tmp, args.config, args.steps,
                                              args.identical, args.extra)
    print("\n".join(lines + [f"FAIL: {f}" for f in failures]))
    print("SOME CHECKS FAILED" if failures else "ALL PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
