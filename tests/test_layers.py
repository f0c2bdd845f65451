"""The layers point one way: a recipe imports `core` (and its own files), never `tools` or `skills`, which are built
on the recipes. Every .py file under recipes/ is read as a syntax tree, not imported, so a file that fails to import
is still checked, and the folders are listed when the test runs, so a copied recipe is covered too."""

import ast
from collections import Counter
from pathlib import Path

from recipes import recipe_names

ROOT = Path(__file__).resolve().parents[1]
ABOVE_RECIPES = ("tools", "skills")


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import; relative imports (`from .model import`) stay in the recipe."""
    found = []
    for node in ast.walk(tree):  # walk, not body: an import inside a function counts too
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def upward_imports(recipes_dir: Path) -> list[str]:
    """'path:line: import module' for each import of a package above the recipes, in every recipe folder."""
    bad = []
    for path in sorted(recipes_dir.rglob("*.py")):
        for line, module in imported_modules(ast.parse(path.read_text(), filename=str(path))):
            if module.split(".")[0] in ABOVE_RECIPES:
                bad.append(f"{path.relative_to(recipes_dir.parent)}:{line}: import {module}")
    return bad


def test_recipes_import_neither_tools_nor_skills():
    recipes = [d for d in (ROOT / "recipes").iterdir() if d.is_dir() and (d / "train.py").is_file()]
    assert len(recipes) >= 3, recipes  # the check sees the recipes
    bad = upward_imports(ROOT / "recipes")
    assert not bad, "a recipe imports a layer above it (move what it needs into core/):\n" + "\n".join(bad)


def test_the_check_catches_every_form(tmp_path):
    """A copied recipe with each way of importing tools or skills is reported at each line; core and relative
    imports are not."""
    recipe = tmp_path / "recipes" / "my_arch"
    recipe.mkdir(parents=True)
    (recipe / "train.py").write_text(
        "import os\n"
        "import tools\n"
        "import skills.compare_runs as cr\n"
        "from tools.estimate_memory import check_train_args\n"
        "from core.memory import check_train_args\n"
        "from .model import Model\n"
        "def main():\n"
        "    from tools import evaluate\n")
    assert upward_imports(tmp_path / "recipes") == [
        "recipes/my_arch/train.py:2: import tools",
        "recipes/my_arch/train.py:3: import skills.compare_runs",
        "recipes/my_arch/train.py:4: import tools.estimate_memory",
        "recipes/my_arch/train.py:8: import tools",
    ]


def shares_train_py(recipe: Path) -> bool:
    """What the recipe-checks block of recipe/model.py says in SHARED_TRAIN_PY (read from its syntax tree; True
    where it says nothing, as in a copy of an older recipe)."""
    for node in ast.parse((recipe / "model.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHARED_TRAIN_PY" for t in node.targets):
            return bool(ast.literal_eval(node.value))
    return True


def diverging_train_py(recipes_dir: Path) -> list[str]:
    """'recipes/X/train.py differs from recipes/Y/train.py' for each recipe that shares train.py (shares_train_py)
    but whose file is not the one most of them hold, byte for byte."""
    texts = {name: (recipes_dir / name / "train.py").read_bytes() for name in recipe_names(recipes_dir)
             if shares_train_py(recipes_dir / name)}
    common = Counter(texts.values()).most_common(1)[0][0] if texts else b""
    holder = next((name for name, text in texts.items() if text == common), "")
    return [f"recipes/{name}/train.py differs from recipes/{holder}/train.py" for name, text in texts.items()
            if text != common]


def test_recipes_share_one_train_py():
    """train.py is shared by copy: every recipe's file is byte-identical, so an answer read from one holds for all;
    what differs between architectures lives in model.py. A copy whose train.py differs on purpose says
    SHARED_TRAIN_PY = False in its model.py's recipe-checks block (a seam is missing then)."""
    assert len([n for n in recipe_names() if shares_train_py(ROOT / "recipes" / n)]) >= 2  # the check compares some
    differing = diverging_train_py(ROOT / "recipes")
    assert not differing, "; ".join(differing) + ": make the change in all of them (or move what differs into " \
                          "model.py); a copy that diverges on purpose sets SHARED_TRAIN_PY = False in its model.py"


def test_the_train_py_check_reports_only_an_undeclared_divergence(tmp_path):
    for name, train, flag in [("a", "x = 1\n", ""), ("b", "x = 1\n", ""), ("c", "x = 2\n", ""),
                              ("d", "x = 3\n", "SHARED_TRAIN_PY = False\n"), ("e", "x = 1\n", "SHARED_TRAIN_PY = True\n")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.py").write_text(train)
        (tmp_path / name / "model.py").write_text("TRANSFORMERS_CLASS = None\n" + flag)
    assert diverging_train_py(tmp_path) == ["recipes/c/train.py differs from recipes/a/train.py"]
