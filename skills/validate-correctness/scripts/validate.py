"""A recipe's whole correctness set in one command, printed as one table (check, worst error, tolerance, PASS/FAIL,
where the worst error was). Exit code 0 only if every check passes; 1 on a FAIL; 2 on bad input (one line).

    python skills/validate-correctness/scripts/validate.py --recipe NAME [--data DIR] [--only GROUP,...] [--workdir DIR]

The checks are tests/recipe_checks.py's, the ones tests/test_recipes.py runs for every recipe folder; what a recipe
declares for them is the block at the end of its model.py (TRANSFORMERS_CLASS, BASE_RECIPE, check_setup()).
Groups, all by default (--only picks some):
  parity   logits, every gradient and the export against transformers' TRANSFORMERS_CLASS (if not None)
  base     a variant against BASE_RECIPE on check_setup()["base_config"], its feature switched off (if declared)
  export   a Hugging Face folder through train.py --lr 0 comes back bit for bit
  buffers  every buffer after a meta build + init_weights + load_hf_checkpoint equals a fresh build's
  documents packed documents under the document mask = each document alone (if the model takes documents)
  layouts  ep2, pp2, cp2, pp2xep2, cp2xep2 against one process; model-level cp2 and cp2xep2; resume at ep2;
           --recompute; pp2 in bf16; the export at pp2xep2 (2 and 4 gloo ranks on CPU, started first: they run
           while this process checks the other groups)
Without --data the tiny counting dataset of the tests is written to the scratch folder (no data/stdlib needed);
--data takes token shards of any vocabulary (the check config's vocab_size is raised to the data's). The training
runs' own output goes to WORKDIR/runs.log (WORKDIR: --workdir, else a temporary folder removed at the end)."""

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

from tests.recipe_checks import GROUPS, format_table, load_recipe, run_checks, write_counting_data  # noqa: E402


@contextlib.contextmanager
def output_to(log_path: Path):
    """This process's stdout and stderr, and those of the ranks it starts (file descriptors 1 and 2), into log_path;
    yields a function that prints a line to the stdout of before."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield lambda line: os.write(saved[0], (line + "\n").encode())
        finally:
            log.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def parse_groups(text: str) -> list[str]:
    groups = [g for g in text.split(",") if g] if text else list(GROUPS)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ValueError(f"--only {text!r}: name groups from {', '.join(GROUPS)}, comma-separated")
    return groups


def validate(recipe: str, groups: list[str], data, workdir: Path) -> list:
    """Run the groups (a progress line as each starts; the layouts' ranks run while this process checks the
    others), their output into workdir/runs.log; on an error the log's last lines are printed before it is raised."""
    data = Path(data) if data else write_counting_data(workdir / "data")
    log = workdir / "runs.log"
    try:
        with output_to(log) as say:
            return run_checks(recipe, data, workdir / "checks", groups, lambda group: say(f"checking {group} ..."))
    except Exception:
        print("".join(log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="folder name under recipes/")
    parser.add_argument("--data", default="", help="token shards (default: the tests' counting dataset, written here)")
    parser.add_argument("--only", default="", help=f"comma-separated groups of {', '.join(GROUPS)} (default: all)")
    parser.add_argument("--workdir", default="", help="an empty or new folder for the runs and runs.log (kept)")
    args = parser.parse_args(argv)
    groups = parse_groups(args.only)
    recipe = load_recipe(args.recipe)  # an unknown recipe or an incomplete check block fails here, before any run
    if args.data and not (Path(args.data) / "meta.json").is_file():
        raise FileNotFoundError(f"--data {args.data} holds no meta.json; write shards with python -m tools.prepare_data "
                                f"or leave --data out for the tests' counting dataset")
    if args.workdir and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        raise ValueError(f"--workdir {args.workdir} is not empty (train.py would resume what it finds); name a new folder")
    with contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory() as workdir:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        results = validate(args.recipe, groups, args.data, Path(workdir))
    references = [f"transformers {recipe.transformers_class}"] * bool(recipe.transformers_class) + \
        [f"base recipe {recipe.base}"] * bool(recipe.base)
    print(f"validate-correctness: recipe {args.recipe}, checks {', '.join(groups)}; numerics against "
          f"{' and '.join(references)}" + (f"; logs in {Path(args.workdir) / 'runs.log'}" if args.workdir else ""))
    if not results:
        print(f"no check of {', '.join(groups)} applies: parity needs TRANSFORMERS_CLASS, base needs BASE_RECIPE")
        return 1
    print(format_table(results))
    ok = all(r.ok for r in results)
    print("ALL PASS" if ok else f"SOME CHECKS FAILED ({sum(not r.ok for r in results)} of {len(results)})")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
