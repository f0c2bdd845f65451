"""Copy a recipe folder to start a new architecture (`cp -r recipes/BASE recipes/NAME`, checked), then print the
command that validates it before and after model.py changes.

    python skills/add-new-architecture/scripts/copy_recipe.py --base qwen3_30b_a3b --name my_arch [--root .]

Refuses a name that is not a Python identifier or already exists. The copy runs unchanged: no file in a recipe
names its own folder (train.py imports its model relatively; launch.sh and --out follow the folder name), and
tests/test_recipes.py checks it with no test file added.
"""

import argparse
import shutil
import sys
from pathlib import Path


def copy_recipe(base: str, name: str, root) -> Path:
    src, dst = Path(root) / "recipes" / base, Path(root) / "recipes" / name
    if not (src / "model.py").is_file():
        raise FileNotFoundError(f"{src} is not a recipe (no model.py); pick a folder under {Path(root) / 'recipes'}")
    if not name.isidentifier():
        raise ValueError(f"--name {name!r} must be a Python identifier (it is imported as recipes.{name})")
    if dst.exists():
        raise ValueError(f"{dst} exists already; pick another --name or remove it")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    named = [f"{f.name}:{i}" for f in sorted(dst.iterdir()) if f.is_file() and f.suffix in (".py", ".sh", ".json")
             for i, line in enumerate(f.read_text().splitlines(), 1) if f"recipes.{base}" in line or f"recipes/{base}" in line]
    if named:
        raise ValueError(f"the copy still names recipes/{base} at {named}: make those lines follow the folder name")
    return dst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="recipe to copy (folder name under recipes/)")
    parser.add_argument("--name", required=True, help="the new recipe's folder name")
    parser.add_argument("--root", default=".", help="repository root")
    args = parser.parse_args(argv)
    dst = copy_recipe(args.base, args.name, args.root)
    validate = f"python skills/validate-correctness/scripts/validate.py --recipe {args.name}"
    print(f"copied recipes/{args.base} -> {dst}\nnext, from the repository root:\n"
          f"  {validate}   # the copy as is: every check passes\n"
          f"  (edit recipes/{args.name}/model.py, its recipe-checks block at the end included:\n"
          f"   TRANSFORMERS_CLASS = None and BASE_RECIPE = {args.base!r} once it departs from transformers;\n"
          f"   its docstring's first paragraph documents it: README and AGENTS.md list it from there)\n"
          f"  {validate}   # again, until ALL PASS (--rows ID,... reruns some rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
