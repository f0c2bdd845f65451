"""A recipe's whole correctness set in one command, printed as one table (row id, check, worst error, its bound,
error / bound, PASS / FAIL / ERROR, where the worst error was). Exit code 0 only if every check passes; 1 on a FAIL;
2 on bad input (one line); 3 when a row could not be computed (ERROR: the row says why, runs.log has the traceback).

    python skills/validate-correctness/scripts/validate.py --recipe NAME [--only GROUP,... | --rows ID,...]
        [--data DIR] [--workdir DIR] [--near FRACTION]

The checks are tests/recipe_checks.py's, the ones tests/test_recipes.py runs for every recipe folder; what a recipe
declares for them is the block at the end of its model.py (TRANSFORMERS_CLASS, BASE_RECIPE, check_setup()).
Groups, all by default (--only picks some; --rows picks rows by the id in the table's first column, and only the
work those rows need runs, e.g. one layout's ranks):
  parity   logits, every gradient and the export against transformers' TRANSFORMERS_CLASS (if not None)
  base     a variant against BASE_RECIPE on check_setup()["base_config"], its feature switched off (if declared)
  export   a Hugging Face folder through train.py --lr 0 comes back bit for bit
  buffers  every buffer after a meta build + init_weights + load_hf_checkpoint equals a fresh build's
  documents packed documents under the document mask = each document alone (if the model takes documents)
  layouts  ep2, pp2, cp2, pp2xep2, cp2xep2 against one process; model-level cp2 and cp2xep2; resume at ep2;
           --recompute; pp2 in bf16; the export at pp2xep2 (2 and 4 gloo ranks on CPU, started first: they run
           while this process checks the other groups)
Every bound comes from the recipe's model (its float64 or bf16 noise). A row over its bound, or within 10% of it
(--near), gets a line saying what the same comparison gives in float64: rounding if it vanishes there (the row then
passes), a bug if it stays (a layout row's ranks run again in float64 for it).

The run reads a copy of recipes/ taken as it starts (every process, the ranks included), so the recipe can be
edited while it runs. Without --data the tiny counting dataset of the tests is written to the scratch folder;
--data takes token shards of any vocabulary (the check config's vocab_size is raised to the data's). Scratch files
and runs.log (the training runs' output) go to a new folder inside --workdir (any folder), else to a temporary
folder removed at the end."""

import argparse
import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository root
sys.path.insert(0, str(ROOT))

import recipes  # noqa: E402  (only recipes/__init__.py: tests.recipe_checks and torch are imported after the snapshot)


def snapshot_recipes(out: Path) -> Path:
    """Every recipe folder where `import recipes.<name>` looks (model.py, train.py, configs; a BASE_RECIPE's folder
    too), copied as it is now to out/recipes, with recipes/__init__.py. Returns out."""
    (out / "recipes").mkdir(parents=True)
    shutil.copy(recipes.__file__, out / "recipes" / "__init__.py")
    for root in recipes.__path__:
        for name in recipes.recipe_names(root):
            if not (out / "recipes" / name).exists():  # (the first folder of a name is the one imported)
                shutil.copytree(Path(root) / name, out / "recipes" / name, ignore=shutil.ignore_patterns("__pycache__"))
    return out


@contextlib.contextmanager
def importing_from(snapshot: Path):
    """Inside: `import recipes.<name>` reads the snapshot in this process (recipes.import_from; recipe modules
    imported before are set aside and put back after) and in the layout ranks: tests/recipe_checks.py:layouts_worker
    follows this process's recipes.__path__, and their forkserver, which imports the checks (recipes included) once
    when it starts, finds the snapshot first on its path (PYTHONPATH without the working directory for Python 3.11's
    forkserver, sys.path for later ones, which copy it)."""
    saved = {name: module for name, module in sys.modules.items() if name.startswith("recipes.")}
    before = recipes.import_from([str(snapshot / "recipes")])
    env = {"PYTHONPATH": os.pathsep.join([str(snapshot), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONSAFEPATH": "1"}
    env_before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    sys.path.insert(0, str(snapshot))
    try:
        yield
    finally:
        sys.path.remove(str(snapshot))
        for name, value in env_before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        recipes.import_from(before)
        sys.modules.update(saved)


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


def selection(only: str, rows: str, groups: tuple, row_ids: tuple) -> tuple[list[str], list[str] | None]:
    """(groups, row ids or None) from --only and --rows; a ValueError names the valid ones."""
    if only and rows:
        raise ValueError("give --only (groups) or --rows (row ids), not both")
    flag, text, what, known = ("rows", rows, "rows", row_ids) if rows else ("only", only, "groups", groups)
    names = [name for name in text.split(",") if name]
    if text and (not names or set(names) - set(known)):
        raise ValueError(f"--{flag} {text!r}: name {what} of {', '.join(known)}, comma-separated")
    return (list(groups), names) if rows else (names or list(groups), None)


def validate(recipe: str, groups: list[str], rows, near: float, data, workdir: Path) -> list:
    """Run the checks (a progress line as each group starts; the layouts' ranks run while this process checks the
    others), their output into workdir/runs.log; on an error the log's last lines are printed before it is raised."""
    from tests.recipe_checks import run_checks, write_counting_data

    data = Path(data) if data else write_counting_data(workdir / "data")
    log = workdir / "runs.log"
    try:
        with output_to(log) as say:
            return run_checks(recipe, data, workdir / "checks", groups, lambda group: say(f"checking {group} ..."),
                              rows=rows, near=near)
    except Exception:
        print("".join(log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="folder name under recipes/")
    parser.add_argument("--only", default="", help="comma-separated groups (above; default: all)")
    parser.add_argument("--rows", default="", help="comma-separated row ids (the table's first column): only these")
    parser.add_argument("--data", default="", help="token shards (default: the tests' counting dataset, written here)")
    parser.add_argument("--workdir", default="", help="a folder (any) in which a new folder keeps the runs and runs.log")
    parser.add_argument("--near", type=float, default=None, help="a row over its bound or within this fraction of "
                        "it gets its float64 comparison (a layout's ranks run again in float64; default 0.1)")
    args = parser.parse_args(argv)
    recipes.check_recipe_name(args.recipe)
    if args.data and not (Path(args.data) / "meta.json").is_file():
        raise FileNotFoundError(f"--data {args.data} holds no meta.json; write shards with python -m tools.prepare_data "
                                f"or leave --data out for the tests' counting dataset")
    if args.workdir and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
        raise ValueError(f"--workdir {args.workdir} is a file; name a folder (a new folder is made inside it)")
    # removed when this process exits: a layout ranks' forkserver started by this run keeps importing from it
    snapshot = snapshot_recipes(Path(tempfile.mkdtemp(prefix="validate-snapshot-")))
    atexit.register(shutil.rmtree, snapshot, True)
    print(f"validate-correctness: recipes/ copied to {snapshot}; this run reads the copy, so edit on", flush=True)
    with importing_from(snapshot):
        # imported now: torch and the checks take seconds to import, while the recipe may already be edited
        from tests.recipe_checks import GROUPS, NEAR_BOUND, ROW_IDS, format_table, load_recipe

        near = NEAR_BOUND if args.near is None else args.near
        groups, rows = selection(args.only, args.rows, GROUPS, ROW_IDS)
        recipe = load_recipe(args.recipe)  # an incomplete check block fails here, before any run
        if args.workdir:  # a new folder inside: no earlier run's checkpoints to resume, other files left alone
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            scratch = contextlib.nullcontext(tempfile.mkdtemp(prefix=f"validate-{args.recipe}-", dir=args.workdir))
        else:
            scratch = tempfile.TemporaryDirectory()
        with scratch as workdir:
            results = validate(args.recipe, groups, rows, near, args.data, Path(workdir))
        references = [f"transformers {recipe.transformers_class}"] * bool(recipe.transformers_class) + \
            [f"base recipe {recipe.base}"] * bool(recipe.base)
        chosen = f"rows {', '.join(rows)}" if rows else f"checks {', '.join(groups)}"
        print(f"validate-correctness: recipe {args.recipe}, {chosen}; numerics against {' and '.join(references)}"
              + (f"; runs and runs.log in {workdir}" if args.workdir else ""))
        if not results:
            print(f"no check of {', '.join(rows or groups)} applies: parity needs TRANSFORMERS_CLASS, base needs "
                  f"BASE_RECIPE, documents and some layout rows need the model's features")
            return 1
        print(format_table(results, near))
    ok, errors = all(r.ok for r in results), sum(bool(r.failed) for r in results)
    print("ALL PASS" if ok else f"SOME CHECKS FAILED ({sum(not r.ok for r in results)} of {len(results)}"
          + (f"; {errors} could not be computed: ERROR)" if errors else ")"))
    return 0 if ok else 3 if errors else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
