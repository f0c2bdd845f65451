"""The shared correctness checks (tests/recipe_checks.py) for every recipe folder found under recipes/ when the
tests are collected: `cp -r recipes/deepseek_v2_lite recipes/my_arch` is tested with no test file added.

Per recipe: parity with transformers (or equality with its base recipe), the export round trip and every buffer;
every parallel layout against one process with resume, recompute, bf16 and a sharded export (one spawned process
group per world size); the copied folder's launch.sh (train.py being the same file in every recipe is tests/test_layers.py's). And
the copy itself: a copy of a shipped recipe in a scratch clone of the repository is collected and passes, and
python -m tools.docs lists it in README.md and AGENTS.md from its model.py docstring, nothing written by hand."""

import os
import shutil
import subprocess
import sys

import pytest

from recipes import recipe_names
from tests.recipe_checks import GROUPS, format_table, run_checks
from tests.test_launch import ROOT, copy_recipe, launch

RECIPES = recipe_names()
SHARED_TESTS = ("test_numerics_export_and_buffers", "test_layouts_equal_one_process", "test_copied_folder_runs_its_launch_sh")


def assert_all_pass(results) -> None:
    print("\n" + format_table(results))
    assert results and all(r.ok for r in results), "\n" + format_table([r for r in results if not r.ok])


@pytest.mark.parametrize("recipe", RECIPES)
def test_numerics_export_and_buffers(recipe, tiny_train_setup, tmp_path):
    """transformers parity (logits, every gradient, export) where the recipe has a counterpart, equality with its
    base recipe where it is a variant; an HF folder through train.py --lr 0 unchanged; every buffer after a meta
    build + init_weights + load equal to a fresh build's; packed documents under the document mask equal to each
    document alone."""
    assert_all_pass(run_checks(recipe, tiny_train_setup[1], tmp_path, [g for g in GROUPS if g != "layouts"]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_layouts_equal_one_process(recipe, tiny_train_setup, tmp_path):
    """ep2, pp2, cp2, pp2xep2, cp2xep2, and ep2 / ep4 under uneven expert placements against one process;
    model-level cp2 and cp2xep2; resume at ep2; recompute
    at pp2 and cp2; pp2 in bf16; export at pp2xep2 and ep4 placed (tests/recipe_checks.py:layout_results)."""
    assert_all_pass(run_checks(recipe, tiny_train_setup[1], tmp_path, ["layouts"]))


# launch.sh differs between recipes in its comments only; what is each recipe's own (pp2 x ep2 training, a
# checkpoint, the export) runs in its shared checks, and tests/test_launch.py runs Qwen3's launch.sh and a copy's
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_copied_folder_runs_its_launch_sh(recipe, tiny_train_setup, tmp_path):
    """cp -r recipes/<recipe> recipes/my_arch: the copy's launch.sh trains its own model with the CPU defaults
    (4 ranks, pp=2 x ep=2, the tiny config) and exports."""
    copy = copy_recipe(recipe, tmp_path)  # no OUT: the run goes to runs/my_arch
    out = launch(copy, {"DATA": str(tiny_train_setup[1])}, "--steps", "2", "--seq-len", "64", "--ckpt-every", "2",
                 "--export-hf", str(tmp_path / "hf"))
    assert "-m recipes.my_arch.train" in out and "mesh pp=2 dp=1 cp=1 ep=2" in out and "trained steps 1-2" in out
    assert (copy.parents[2] / "runs/my_arch/checkpoints/step_00000002/.metadata").is_file()
    assert (tmp_path / "hf/config.json").is_file()


def clone_checkout(dest):
    """The files git sees in this checkout (tracked, and new ones not ignored), as they are now, copied to dest;
    outside a git checkout, the tree without what .gitignore names (data, runs, caches)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "__pycache__", ".*_cache", "*.egg-info",
                                                                  "data", "runs", "build"))
        return dest
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():  # (a tracked file deleted in the working tree is not)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def pytest_in(clone, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1200)


# -m slow: a copy of a recipe is the same code under another folder name, whose shared checks the default suite runs
# under the original name; what the name changes is covered there: the collection of every shared check for the copy
# (test_a_copy_needs_no_list_or_doc_edited), a copy's ranks importing it by its name (tests/test_skill_validate.py:
# validate.py on a fresh copy) and its launch.sh (tests/test_launch.py)
@pytest.mark.slow
@pytest.mark.parametrize("base", RECIPES)
def test_a_copied_recipe_is_checked_with_no_test_file_added(base, tmp_path):
    """cp -r recipes/<base> recipes/my_arch in a scratch clone: the clone's suite collects every shared check for
    my_arch, and my_arch's numerics and layouts pass there (launch.sh: tests/test_launch.py runs a copy's)."""
    clone = clone_checkout(tmp_path / "clone")
    shutil.copytree(clone / "recipes" / base, clone / "recipes/my_arch", ignore=shutil.ignore_patterns("__pycache__"))
    collected = pytest_in(clone, "--collect-only", "tests/test_recipes.py")
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    ids = collected.stdout.split()
    assert all(f"tests/test_recipes.py::{test}[my_arch]" in ids for test in SHARED_TESTS), collected.stdout
    run = pytest_in(clone, "tests/test_recipes.py", "-k", "my_arch and not launch_sh")
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-5000:] + run.stderr[-3000:]


# the files whose tests iterate over the recipe folders (each must collect my_arch with no list edited)
ITERATING = ("test_recipes", "test_training_flags", "test_skill_estimate_memory", "test_plan", "test_muon",
             "test_skill_ops", "test_skill_plots", "test_skill_profile", "test_skill_validate")
LISTED_BY_TOOLS = """
import contextlib, io
from recipes import recipe_names
from tools import estimate_memory, plan
print("recipe_names:", " ".join(recipe_names()))
for tool in (estimate_memory, plan):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        tool.main(["--help"])
    print(tool.__name__, "lists my_arch" if "my_arch" in out.getvalue() else "does not list my_arch")
"""


def test_a_copy_needs_no_list_or_doc_edited(tmp_path):
    """copy_recipe.py's copy of Qwen3 in a scratch clone, nothing else edited: python -m tools.docs writes its line
    into AGENTS.md's recipe list and its row into README's recipe table from its model.py docstring (a second run
    changes nothing). Every test file that iterates over recipes collects my_arch, the tools list it, and the cheap
    checks pass with it (AGENTS.md's references, the copy's line included, and length budget, the layers and the
    shared train.py, the --help of its flags, its memory estimate, its FLOP count, its --profile-steps errors)."""
    clone = clone_checkout(tmp_path / "clone")
    copied = subprocess.run([sys.executable, "skills/add-new-architecture/scripts/copy_recipe.py", "--base",
                             "qwen3_30b_a3b", "--name", "my_arch"], cwd=clone, capture_output=True, text=True)
    assert copied.returncode == 0, copied.stderr
    docs = [subprocess.run([sys.executable, "-m", "tools.docs"], cwd=clone, capture_output=True, text=True)
            for _ in range(2)]
    assert docs[0].stdout.count("rewritten") == 2 and docs[1].stdout.count("unchanged") == 2, docs
    line = next(line for line in (clone / "AGENTS.md").read_text().splitlines() if line.startswith("  - `my_arch`: "))
    assert "`recipes/my_arch/model.py:Attention.forward`" in line and line.endswith("`Qwen3MoeForCausalLM`."), line
    assert "| `recipes/my_arch` | Qwen3-MoE" in (clone / "README.md").read_text()

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    tools = subprocess.run([sys.executable, "-c", LISTED_BY_TOOLS], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=600)
    assert "my_arch" in tools.stdout.split("recipe_names:")[1].split("\n")[0].split(), tools.stdout + tools.stderr
    assert tools.stdout.count("lists my_arch") == 2, tools.stdout + tools.stderr
    files = [f"tests/{name}.py" for name in ITERATING]
    collected = pytest_in(clone, "--collect-only", *files)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    with_copy = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line and "my_arch" in line}
    assert with_copy == set(files), sorted(set(files) - with_copy)
    ids = collected.stdout.split()  # every shared check, for the copy too
    assert all(f"tests/test_recipes.py::{test}[my_arch]" in ids for test in SHARED_TESTS), collected.stdout[-3000:]
    run = pytest_in(clone, "tests/test_agents_md.py", "tests/test_layers.py", "tests/test_training_flags.py",
                    "tests/test_skill_estimate_memory.py", "tests/test_plan.py", "tests/test_skill_profile.py",
                    "-k", "test_agents_md or test_layers or (my_arch and (help or one_process or script or "
                    "flop_counter or bad_profile))")
    assert run.returncode == 0 and "failed" not in run.stdout, run.stdout[-5000:] + run.stderr[-3000:]
