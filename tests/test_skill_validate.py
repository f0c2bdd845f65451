"""The validate-correctness skill's scripts. validate.py: one table for a recipe (the cheap groups here; every group
on each recipe with -m slow, since tests/test_recipes.py runs the same checks for every recipe in CI),
bad input in one line, and a copied recipe declared a variant of its base: equal to it bit for bit, while a copy
with another norm epsilon fails (exit code 1). check_parity.py's table, and check_layout.py in a layout the shared
checks do not run (dp2)."""

import importlib.util
import subprocess
import sys

import pytest

import recipes
from tests.test_launch import ROOT, copy_recipe

SKILLS = ROOT / "skills"


def script(name: str, skill: str = "validate-correctness"):
    spec = importlib.util.spec_from_file_location(f"skill_{name}", SKILLS / skill / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_rows(out: str, recipe: str) -> list[str]:
    """The rows of validate.py's table (between its ruler and the verdict)."""
    lines = out[out.index(f"validate-correctness: recipe {recipe}"):].rstrip().splitlines()
    assert lines[1].split() == ["check", "worst", "error", "tolerance", "result", "where"], lines
    return lines[3:-1]


def test_validate_prints_one_table(tmp_path, capsys):
    """parity (4 rows in fp32, 3 in float64), export (2), buffers on GPT-OSS; the training runs' output goes to the log,
    not the table."""
    assert script("validate").main(["--recipe", "gpt_oss_20b", "--only", "parity,export,buffers",
                                    "--workdir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out, "gpt_oss_20b")
    assert len(rows) == 4 + 3 + 2 + 1 and all("PASS" in row.split() for row in rows) and out.rstrip().endswith("ALL PASS"), out
    assert "step " not in out and "trained steps 1-1" in (tmp_path / "work/runs.log").read_text()


def test_validate_bad_input_is_one_line(tmp_path):
    validate = script("validate").main
    with pytest.raises(ValueError, match="unknown recipe 'my_arch'.*qwen3_30b_a3b"):
        validate(["--recipe", "my_arch"])
    with pytest.raises(ValueError, match="--only 'layout'"):
        validate(["--recipe", "qwen3_30b_a3b", "--only", "layout"])
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        validate(["--recipe", "qwen3_30b_a3b", "--data", str(tmp_path)])
    proc = subprocess.run([sys.executable, str(SKILLS / "validate-correctness/scripts/validate.py"), "--recipe", "nope"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: unknown recipe 'nope'")


def test_a_copied_variant_equals_its_base(tmp_path, monkeypatch, capsys):
    """copy_recipe.py's copies of Qwen3 declared variants (no transformers class, BASE_RECIPE, base_config): the
    copy equals its base bit for bit, and its export round trip and buffers pass from a folder its own
    save_hf_checkpoint wrote; a copy whose RMSNorm epsilon is 1e-2 fails; a recipe with neither reference is
    refused."""
    repo = copy_recipe("qwen3_30b_a3b", tmp_path).parents[2]  # recipes/my_arch in a scratch repository
    copy_script = script("copy_recipe", "add-new-architecture")
    assert copy_script.main(["--base", "my_arch", "--name", "my_arch_eps", "--root", str(repo)]) == 0
    assert "validate.py --recipe my_arch_eps" in capsys.readouterr().out
    for name, error in [("my_arch_eps", "exists already"), ("my-arch", "identifier")]:
        with pytest.raises(ValueError, match=error):
            copy_script.copy_recipe("my_arch", name, repo)
    for name in ("my_arch", "my_arch_eps"):
        model = repo / "recipes" / name / "model.py"
        text = model.read_text()
        edits = [('TRANSFORMERS_CLASS = "Qwen3MoeForCausalLM"', "TRANSFORMERS_CLASS = None"),
                 ("BASE_RECIPE = None", 'BASE_RECIPE = "qwen3_30b_a3b"'),
                 ('"base_config": None', '"base_config": config')]
        edits += [("self.eps = eps", "self.eps = 1e-2")] if name == "my_arch_eps" else []
        for old, new in edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        model.write_text(text)
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(repo / "recipes")])
    validate = script("validate").main
    try:
        assert validate(["--recipe", "my_arch", "--only", "base,export,buffers"]) == 0
        rows = table_rows(capsys.readouterr().out, "my_arch")
        assert len(rows) == 4 + 2 + 3 and all(" 0.00e+00 " in row and row.endswith("PASS") for row in rows), rows
        assert validate(["--recipe", "my_arch_eps", "--only", "base"]) == 1
        out = capsys.readouterr().out
        assert "FAIL" in table_rows(out, "my_arch_eps")[0].split() and "SOME CHECKS FAILED" in out, out
        monkeypatch.setattr(sys.modules["recipes.my_arch.model"], "BASE_RECIPE", None)
        with pytest.raises(ValueError, match="TRANSFORMERS_CLASS and BASE_RECIPE are both None"):
            validate(["--recipe", "my_arch"])
    finally:
        for name in [m for m in sys.modules if m.startswith("recipes.my_arch")]:
            del sys.modules[name]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", recipes.recipe_names())
def test_validate_runs_every_check(recipe, capsys):
    assert script("validate").main(["--recipe", recipe]) == 0
    out = capsys.readouterr().out
    # parity fp32 + float64, export, buffers, documents, layouts (a recipe with a transformers class, every feature)
    assert len(table_rows(out, recipe)) == 4 + 3 + 2 + 1 + 3 + 25 and out.rstrip().endswith("ALL PASS"), out


def test_check_parity(capsys):
    assert script("check_parity").main(["--recipe", "qwen3_30b_a3b", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and "FAIL" not in out and out.rstrip().endswith("ALL PASS"), out


def test_check_layout_dp2(tiny_train_setup, capsys):
    check_layout = script("check_layout")
    assert check_layout.main(["--recipe", "deepseek_v2_lite", "--layout", "dp2", "--data", str(tiny_train_setup[1]),
                              "--steps", "2"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("layout dp2 (2 ranks) vs one process"):].splitlines()
    assert len(table) == 2 + 2 + 4 + 1 and table[-1] == "ALL PASS", out[-3000:]
    assert [line.split()[0] for line in table[2:4]] == ["1", "2"]
    assert all(line.endswith("PASS") and float(line.split()[-3]) <= 1e-5 for line in table[5:8]), table
    with pytest.raises(ValueError, match="x-joined factors"):
        check_layout.parse_layout("pp2xpp2")
