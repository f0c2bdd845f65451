"""The layers point one way: a recipe imports `core` (and its own files), never `tools` or `skills`, which are built
on the recipes. Every .py file under recipes/ is read as a syntax tree, not imported, so a file that fails to import
is still checked, and the folders are listed when the test runs, so a copied recipe is covered too."""

import ast
from pathlib import Path

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


SHIPPED = ("qwen3_30b_a3b", "deepseek_v2_lite", "gpt_oss_20b", "qwen3_5_35b_a3b", "deepseek_v3")


def test_shipped_recipes_share_one_train_py():
    """train.py is shared by copy: the shipped recipes' files are byte-identical, so an answer read from one holds for
    all; what differs between architectures lives in model.py (a copied recipe may diverge on purpose)."""
    texts = {name: (ROOT / "recipes" / name / "train.py").read_bytes() for name in SHIPPED}
    differing = [name for name in SHIPPED[1:] if texts[name] != texts[SHIPPED[0]]]
    assert not differing, f"recipes/{differing[0]}/train.py differs from recipes/{SHIPPED[0]}/train.py: make the " \
                          f"change in all of them (or move what differs into model.py)"
