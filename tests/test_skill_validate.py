"""The validate-correctness skill's scripts on every recipe's tiny config: the transformers parity table, one
2-rank layout against one process (ep2, pp2, cp2: one per recipe), and a copied recipe folder against its base
(identical losses; a copy made by add-new-architecture's copy_recipe.py with another norm epsilon passes as a
variant but fails --identical)."""

import importlib.util
import sys

import pytest

import recipes
from tests.test_launch import ROOT, copy_recipe

SKILLS = ROOT / "skills"
RECIPES = ["qwen3_30b_a3b", "deepseek_v2_lite", "gpt_oss_20b"]


def script(name: str, skill: str = "validate-correctness"):
    spec = importlib.util.spec_from_file_location(f"skill_{name}", SKILLS / skill / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("recipe", RECIPES)
def test_check_parity(recipe, capsys):
    assert script("check_parity").main(["--recipe", recipe, "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and "FAIL" not in out and out.rstrip().endswith("ALL PASS"), out


@pytest.mark.parametrize("recipe, layout", zip(RECIPES, ["ep2", "pp2", "cp2"]))
def test_check_layout(recipe, layout, tiny_train_setup, capsys):
    check_layout = script("check_layout")
    assert check_layout.main(["--recipe", recipe, "--layout", layout, "--data", str(tiny_train_setup[1]),
                              "--steps", "2"]) == 0
    out = capsys.readouterr().out
    table = out[out.index(f"layout {layout} (2 ranks) vs one process"):].splitlines()
    assert len(table) == 2 + 2 + 4 + 1 and table[-1] == "ALL PASS", out[-3000:]
    assert [line.split()[0] for line in table[2:4]] == ["1", "2"]
    assert all(line.endswith("PASS") and float(line.split()[-3]) <= 1e-5 for line in table[5:8]), table
    with pytest.raises(ValueError, match="x-joined factors"):
        check_layout.parse_layout("pp2xpp2")


def test_compare_variant_copied_folder(tiny_train_setup, tmp_path, monkeypatch, capsys):
    """cp -r of a recipe reproduces its losses bit for bit; a copy whose RMSNorm epsilon is 1e-2 trains (finite,
    decreasing) but is caught by --identical."""
    repo = copy_recipe("qwen3_30b_a3b", tmp_path).parents[2]
    copy_script = script("copy_recipe", "add-new-architecture")
    assert copy_script.main(["--base", "my_arch", "--name", "my_arch_eps", "--root", str(repo)]) == 0
    assert "--variant my_arch_eps --identical 0" in capsys.readouterr().out
    for name, error in [("my_arch_eps", "exists already"), ("my-arch", "identifier")]:
        with pytest.raises(ValueError, match=error):
            copy_script.copy_recipe("my_arch", name, repo)
    model = repo / "recipes/my_arch_eps/model.py"
    text = model.read_text()
    assert text.count("self.eps = eps") == 1
    model.write_text(text.replace("self.eps = eps", "self.eps = 1e-2"))
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(repo / "recipes")])
    compare = script("compare_variant").main
    data = str(tiny_train_setup[1])
    try:
        assert compare(["--base", "qwen3_30b_a3b", "--variant", "my_arch", "--data", data, "--steps", "4",
                        "--identical", "0"]) == 0
        out = capsys.readouterr().out
        assert "relative error of the loss curve 0.00e+00" in out and out.rstrip().endswith("ALL PASS"), out
        assert compare(["--base", "qwen3_30b_a3b", "--variant", "my_arch_eps", "--data", data, "--steps", "4"]) == 0
        assert compare(["--base", "qwen3_30b_a3b", "--variant", "my_arch_eps", "--data", data, "--steps", "4",
                        "--identical", "1e-6"]) == 1
        assert "FAIL: losses differ" in capsys.readouterr().out
    finally:
        for name in [m for m in sys.modules if m.startswith(("recipes.my_arch", "recipes.my_arch_eps"))]:
            del sys.modules[name]
