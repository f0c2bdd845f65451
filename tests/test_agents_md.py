"""AGENTS.md agrees with the code: every `path` and `path:name` / `path:Class.method` it cites exists (names looked up
in the file's syntax tree, not imported), every `python -m module` it shows is a file, and README points to it."""

import ast
import re
from pathlib import Path

from tools.docs import defines

ROOT = Path(__file__).resolve().parents[1]
REF = re.compile(r"`([\w./-]+\.(?:py|sh|md|json|toml))(?::([\w.]+))?`")
MODULE = re.compile(r"python -m ((?:core|recipes|tools)(?:\.\w+)+)")
# A budget with headroom, not a target: AGENTS.md is read whole before every change, so it stays short (~200 lines
# now); the ~20 lines above that are for what the next changes document (python -m tools.docs adds one line per
# recipe folder, a copy's too), so no single added line fails the suite.
MAX_LINES = 220


def resolve(path: Path, dotted: str) -> bool:
    return defines(ast.parse(path.read_text()), dotted)


def references(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in REF.finditer(text)]


def missing(text: str) -> list[str]:
    bad = []
    for path, name in references(text):
        file = ROOT / path
        if not file.is_file():
            bad.append(path)
        elif name and not (file.suffix == ".py" and resolve(file, name)):
            bad.append(f"{path}:{name}")
    for module in MODULE.findall(text):
        if not (ROOT / (module.replace(".", "/") + ".py")).is_file():
            bad.append(f"python -m {module}")
    return bad


def test_every_reference_in_agents_md_exists():
    text = (ROOT / "AGENTS.md").read_text()
    refs = references(text)
    assert len(refs) > 50 and sum(name is not None for _, name in refs) > 40, len(refs)  # the map is there
    assert missing(text) == []
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"AGENTS.md has {lines} lines, over its budget of {MAX_LINES}: trim what is verbose " \
                               f"(the map cites, the design states), do not raise the budget"


def test_the_checker_catches_a_wrong_name():
    wrong = "`core/moe.py:DispatchPlan.dedup` `core/mesh.py:Mesh.group` `core/nowhere.py` `python -m tools.nothing`"
    assert missing(wrong) == ["core/moe.py:DispatchPlan.dedup", "core/nowhere.py", "python -m tools.nothing"]


def test_readme_points_to_the_design_in_agents_md():
    readme = (ROOT / "README.md").read_text()
    assert "AGENTS.md" in readme.split("## Quick start")[0]
    assert "## Design" in (ROOT / "AGENTS.md").read_text()
