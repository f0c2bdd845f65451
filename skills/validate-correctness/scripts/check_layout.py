"""Train a recipe in one parallel layout and as one process on the same batches; print losses, grad norms and
the worst relative errors (losses, grad norms, every weight on every rank) against 1e-5. Exit code 1 on a FAIL.
For debugging one layout, with any train.py flags; validate.py runs a recipe's whole correctness set.

    python skills/validate-correctness/scripts/check_layout.py --recipe qwen3_30b_a3b --layout pp2xep2 \\
        [--data DIR] [--config FILE] [--steps 3] [-- extra train.py flags, e.g. --recompute layer]

The layout is `x`-joined pp/dp/cp/ep factors (pp2xep2 = 4 gloo ranks on CPU, spawned here). Both runs use the
recipe's check setup (the block at the end of its model.py: config and sequence length) and the flags of the
shared layout checks (tests/recipe_checks.py:check_args: global batch 8, micro-batch 1, Adam eps 1e-6, expert
bias on); the comparison is tests/test_train.py:assert_matches_single. Without --data the tests' counting
dataset is written to a temporary folder.
"""

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

from tests.multiproc import run_ranks  # noqa: E402
from tests.recipe_checks import check_args, data_vocab, load_recipe, write_config, write_counting_data  # noqa: E402
from tests.test_train import LAYOUT_TOLERANCE, assert_matches_single, run_train  # noqa: E402


def parse_layout(text: str) -> dict[str, int]:
    """'pp2xep2' -> {'pp': 2, 'ep': 2}."""
    parts = text.split("x") if text else []
    found = [re.fullmatch(r"(pp|dp|cp|ep)([1-9][0-9]*)", p) for p in parts]
    if not parts or not all(found) or len({m.group(1) for m in found}) != len(found):
        raise ValueError(f"--layout {text!r}: write x-joined factors of pp, dp, cp, ep, e.g. pp2xep2 or cp2")
    return {m.group(1): int(m.group(2)) for m in found}


def check_layout(recipe: str, layout: dict[str, int], data, out_dir, config="", steps: int = 3, extra=()):
    """(single-process result, every rank's result, worst errors or the assertion message, table lines)."""
    setup = load_recipe(recipe, data_vocab(data))
    config = config or write_config(Path(out_dir) / "check_config.json", setup.config)
    argv = lambda out, **flags: check_args(setup, config, data, Path(out_dir) / out, steps=steps, **flags) + list(extra)
    name = "x".join(f"{k}{v}" for k, v in layout.items())
    single = run_train(argv("single"), setup.train.main)
    ranks = run_ranks(math.prod(layout.values()), run_train, argv(name, **layout), setup.train.main)
    try:
        verdict = assert_matches_single(single, ranks)
    except AssertionError as e:
        verdict = f"FAIL: {str(e).splitlines()[0]}"
    lines = [f"layout {name} ({len(ranks)} ranks) vs one process: recipe {recipe}, {steps} steps",
             f"{'step':>4}  {'loss 1 proc':>12}  {'loss ' + name:>14}  {'grad norm 1 proc':>16}  {'grad norm ' + name:>18}"]
    for i, (loss, norm) in enumerate(zip(single[0], single[1])):
        lines.append(f"{i + 1:>4}  {loss:>12.6f}  {ranks[0][0][i]:>14.6f}  {norm:>16.6f}  {ranks[0][1][i]:>18.6f}")
    if isinstance(verdict, str):
        lines.append(verdict)
    else:
        lines += [f"{'worst relative error':<22}  {'value':>9}  tolerance  result"]
        lines += [f"{what:<22}  {err:>9.2e}  {LAYOUT_TOLERANCE:>9.0e}  PASS" for what, err in
                  zip(("losses", "grad norms", "weights (every rank)"), verdict)]
    return single, ranks, verdict, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="folder name under recipes/")
    parser.add_argument("--layout", required=True, help="e.g. pp2xep2, ep2, cp2, pp2xdp2")
    parser.add_argument("--data", default="", help="token shards (default: the tests' counting dataset)")
    parser.add_argument("--config", default="", help="HF config.json (default: the recipe's check_setup() config)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="after --: more train.py flags for both runs")
    args = parser.parse_args(argv)
    layout = parse_layout(args.layout)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or write_counting_data(Path(tmp) / "data")
        *_, verdict, lines = check_layout(args.recipe, layout, data, tmp, args.config, args.steps, args.extra)
    print("\n".join(lines))
    ok = not isinstance(verdict, str)
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
