"""The recipe lists of README.md and AGENTS.md, written from the recipes themselves: one entry per folder under
recipes/ (recipes.recipe_names), made of the first paragraph of its model.py docstring and what its recipe-checks
block checks its numerics against (TRANSFORMERS_CLASS, else BASE_RECIPE), read from the source without importing
it. A recipe, a copy included, documents itself in that paragraph; this command rewrites what lies between the
MARKERS in both files, and nothing else.

    python -m tools.docs [--root .]

In AGENTS.md a name in backticks that model.py defines (`Attention.forward`) is written as the reference
`recipes/<folder>/model.py:Attention.forward`, which tests/test_agents_md.py checks like every other.
"""

import argparse
import ast
import re
from pathlib import Path

from recipes import recipe_names

MARKERS = ("<!-- recipes: written by python -m tools.docs from each recipes/*/model.py; edit those docstrings -->",
           "<!-- end of recipes -->")
NAME = re.compile(r"`([A-Za-z_]\w*(?:\.\w+)*)`")


def defined_names(body) -> dict:
    """{name: node} of the functions, classes and assigned names of a module or class body."""
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def defines(tree: ast.Module, dotted: str) -> bool:
    """Whether the module `tree` defines `dotted` (a function, class, assigned name or Class.method)."""
    node = tree
    for part in dotted.split("."):
        node = defined_names(getattr(node, "body", [])).get(part)
        if node is None:
            return False
    return True


def describe(folder: Path) -> tuple[str, str]:
    """(the first paragraph of model.py's docstring on one line, what its numerics are checked against)."""
    tree = ast.parse((folder / "model.py").read_text())
    paragraph = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
    constants = {name: node.value.value for name, node in defined_names(tree.body).items()
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    if constants.get("TRANSFORMERS_CLASS"):
        return paragraph, f"transformers `{constants['TRANSFORMERS_CLASS']}`"
    return paragraph, f"`{constants.get('BASE_RECIPE')}` with the feature off"


def as_references(text: str, name: str, root: Path) -> str:
    """`Attention.forward` -> `recipes/<name>/model.py:Attention.forward` for each name in backticks that
    recipes/<name>/model.py defines; other backticks stay."""
    tree = ast.parse((root / "recipes" / name / "model.py").read_text())
    return NAME.sub(lambda m: f"`recipes/{name}/model.py:{m[1]}`" if defines(tree, m[1]) else m[0], text)


def agents_lines(root: Path) -> list[str]:
    """AGENTS.md's list: one line per recipe, the names its model.py defines written as references to it."""
    lines = []
    for name in recipe_names(root / "recipes"):
        paragraph, checked = describe(root / "recipes" / name)
        lines.append(f"  - `{name}`: {as_references(paragraph, name, root)} Numerics checked against {checked}.")
    return lines


def readme_lines(root: Path) -> list[str]:
    """README.md's table: one row per recipe, with its config files (config.json: the released model's)."""
    rows = []
    for name in recipe_names(root / "recipes"):
        configs = ", ".join(sorted(path.name for path in (root / "recipes" / name).glob("config*.json")))
        rows.append(f"| `recipes/{name}` | {' | '.join(describe(root / 'recipes' / name))} | {configs} |")
    return ["| recipe | what it is (the first paragraph of its model.py docstring) | numerics checked against | configs |",
            "|---|---|---|---|", *rows]


def rewrite(path: Path, lines: list[str]) -> bool:
    """Replaces the lines between the MARKERS in `path`; whether anything changed."""
    text = path.read_text()
    if text.count(MARKERS[0]) != 1 or text.count(MARKERS[1]) != 1:
        raise ValueError(f"{path} must hold each of these lines once, the list between them: {MARKERS[0]} {MARKERS[1]}")
    head, rest = text.split(MARKERS[0] + "\n")
    _, tail = rest.split(MARKERS[1])
    new = head + MARKERS[0] + "\n" + "".join(line + "\n" for line in lines) + MARKERS[1] + tail
    path.write_text(new)
    return new != text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=".", help="repository root")
    root = Path(parser.parse_args(argv).root)
    for file, lines in (("AGENTS.md", agents_lines(root)), ("README.md", readme_lines(root))):
        print(f"{file}: {'rewritten' if rewrite(root / file, lines) else 'unchanged'} ({len(lines)} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
