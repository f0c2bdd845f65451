"""The validate-correctness skill's scripts. validate.py: one table for a recipe (the cheap groups here; every group
on each recipe with -m slow, since tests/test_recipes.py runs the same checks for every recipe in CI),
bad input in one line, and a copied recipe declared a variant of its base: equal to it bit for bit, while a copy
with another norm epsilon fails (exit code 1); --rows runs only the work of its rows; a run reads the recipes as
they were when it started; a row near its bound is told rounding (float64 agrees) or a bug (it does not).
check_parity.py's table, and check_layout.py in a layout the shared checks do not run (dp2)."""

import importlib.util
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import recipes
from tests import recipe_checks
from tests.test_launch import ROOT, copy_recipe
from tests.test_recipes import clone_checkout

SKILLS = ROOT / "skills"


def script(name: str, skill: str = "validate-correctness"):
    spec = importlib.util.spec_from_file_location(f"skill_{name}", SKILLS / skill / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_rows(out: str, recipe: str) -> list[str]:
    """The rows of validate.py's table (between its ruler and the verdict; not the lines under a row near its
    bound, which start with spaces)."""
    lines = out[out.index(f"validate-correctness: recipe {recipe}"):].rstrip().splitlines()
    assert lines[1].split() == ["row", "check", "error", "bound", "error/bound", "result", "where"], lines
    return [line for line in lines[3:-1] if not line.startswith(" ")]


def notes(out: str) -> dict[str, str]:
    """{row id: the line under it} of the rows near their bound."""
    lines = out.splitlines()
    return {lines[i - 1].split()[0]: line.strip() for i, line in enumerate(lines) if line.lstrip().startswith("^ ")}


def test_validate_prints_one_table(tmp_path, capsys):
    """parity (4 rows in fp32, 3 in float64), export (2), buffers on GPT-OSS, each with its id, bound and error /
    bound; the training runs' output goes to the log in a new folder of the (not empty) work folder, not the table."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work/notes.txt").write_text("kept")
    assert script("validate").main(["--recipe", "gpt_oss_20b", "--only", "parity,export,buffers",
                                    "--workdir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out, "gpt_oss_20b")
    assert len(rows) == 4 + 3 + 2 + 1 and all("PASS" in row.split() for row in rows) and out.rstrip().endswith("ALL PASS"), out
    assert [row.split()[0] for row in rows] == list(recipe_checks.ROWS["parity"] + recipe_checks.ROWS["export"]
                                                    + recipe_checks.ROWS["buffers"])
    logits = rows[0].split()  # parity-logits: error <= bound, and error / bound printed as their ratio; the bound is
    # 16x transformers' own fp32 rounding of the logits (tools/hf_parity.py), at least its floor
    error, bound, ratio = float(logits[-5]), float(logits[-3]), float(logits[-2])
    assert logits[-4] == "<=" and 2e-6 <= bound < 1e-4 and ratio == pytest.approx(error / bound, abs=0.006), rows[0]
    [run] = (tmp_path / "work").glob("validate-gpt_oss_20b-*")
    assert (tmp_path / "work/notes.txt").read_text() == "kept" and f"runs and runs.log in {run}" in out
    assert "step " not in out and "trained steps 1-1" in (run / "runs.log").read_text()


def test_validate_bad_input_is_one_line(tmp_path):
    validate = script("validate").main
    with pytest.raises(ValueError, match="unknown recipe 'my_arch'.*qwen3_30b_a3b"):
        validate(["--recipe", "my_arch"])
    with pytest.raises(ValueError, match="--only 'layout': name groups of parity"):
        validate(["--recipe", "qwen3_30b_a3b", "--only", "layout"])
    with pytest.raises(ValueError, match="--rows 'ep2,ep3': name rows of parity-logits, .*, ep2, "):
        validate(["--recipe", "qwen3_30b_a3b", "--rows", "ep2,ep3"])
    with pytest.raises(ValueError, match="--only .* or --rows .*, not both"):
        validate(["--recipe", "qwen3_30b_a3b", "--only", "layouts", "--rows", "ep2"])
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        validate(["--recipe", "qwen3_30b_a3b", "--data", str(tmp_path)])
    proc = subprocess.run([sys.executable, str(SKILLS / "validate-correctness/scripts/validate.py"), "--recipe", "nope"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: unknown recipe 'nope'")


def test_a_copied_variant_equals_its_base(tmp_path, monkeypatch, capsys):
    """copy_recipe.py's copies of Qwen3 declared variants (no transformers class, BASE_RECIPE, base_config): the
    copy equals its base bit for bit, and its export round trip and buffers pass from a folder its own
    save_hf_checkpoint wrote; a copy whose RMSNorm epsilon is 1e-2 fails (in float64 too: not rounding); a variant
    whose feature cannot be switched off (BASE_RECIPE, no base_config) gets the rows that need none; a recipe with
    neither reference is refused."""
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
        assert len(rows) == 3 + 2 + 2 + 1 and all(" 0.00e+00 " in row and row.endswith("PASS") for row in rows), rows
        assert validate(["--recipe", "my_arch_eps", "--only", "base"]) == 1
        out = capsys.readouterr().out
        assert "FAIL" in table_rows(out, "my_arch_eps")[0].split() and "SOME CHECKS FAILED" in out, out
        assert notes(out)["base-losses"].endswith("not rounding, a bug"), out
        model = repo / "recipes/my_arch/model.py"  # (each run reads the files as they are when it starts)
        model.write_text(model.read_text().replace('"base_config": config', '"base_config": None'))
        assert validate(["--recipe", "my_arch", "--only", "base,export,buffers"]) == 0  # no base rows, the rest
        assert [row.split()[0] for row in table_rows(capsys.readouterr().out, "my_arch")] == [
            "export", "export-model-type", "buffers"]
        model.write_text(model.read_text().replace('BASE_RECIPE = "qwen3_30b_a3b"', "BASE_RECIPE = None"))
        with pytest.raises(ValueError, match="TRANSFORMERS_CLASS and BASE_RECIPE are both None"):
            validate(["--recipe", "my_arch"])
    finally:
        for name in [m for m in sys.modules if m.startswith("recipes.my_arch")]:
            del sys.modules[name]


def test_rows_run_only_their_work(monkeypatch, capsys):
    """--rows export-model-type,cp2-model: the export's train.py run in this process and one group of 2 ranks with the
    model-level cp2 job alone; no one-process reference run, no other rank group."""
    started, trained = [], []
    start_ranks = recipe_checks.start_ranks
    monkeypatch.setattr(recipe_checks, "start_ranks", lambda world, fn, recipe, jobs, *args, **kwargs: started.append(
        (world, sorted(jobs))) or start_ranks(world, fn, recipe, jobs, *args, **kwargs))
    monkeypatch.setattr(recipe_checks, "run_train", lambda *args: trained.append(args))
    assert script("validate").main(["--recipe", "qwen3_30b_a3b", "--rows", "export-model-type,cp2-model"]) == 0
    rows = table_rows(capsys.readouterr().out, "qwen3_30b_a3b")
    assert [row.split()[0] for row in rows] == ["export-model-type", "cp2-model"], rows
    assert started == [(2, ["grads cp2"])] and trained == []


def test_validate_reads_the_recipes_as_they_were_at_its_start(tmp_path):
    """copy_recipe.py's copy of Qwen3 in a scratch clone, no other edit, validated on the model-level cp2 row (2
    ranks) while every .py file under the clone's recipes/ raises on import from the moment validate.py says it
    copied them: it passes, so neither its process (which imports the checks and the recipe after that line), nor
    the ranks, nor their forkserver read the live files. The runs go to a new folder in a work folder that holds
    other files."""
    clone = clone_checkout(tmp_path / "clone")
    copied = subprocess.run([sys.executable, "skills/add-new-architecture/scripts/copy_recipe.py", "--base",
                             "qwen3_30b_a3b", "--name", "my_copy"], cwd=clone, capture_output=True, text=True)
    assert copied.returncode == 0, copied.stderr
    (tmp_path / "work").mkdir()
    (tmp_path / "work/other.txt").write_text("kept")
    run = subprocess.Popen([sys.executable, "skills/validate-correctness/scripts/validate.py", "--recipe", "my_copy",
                            "--rows", "cp2-model", "--workdir", str(tmp_path / "work")], cwd=clone, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = run.stdout.readline()
    for path in (clone / "recipes").rglob("*.py"):
        path.write_text("raise RuntimeError('edited while validate.py runs')\n")
    out, err = run.communicate(timeout=900)
    out = first + out
    assert "this run reads the copy" in first and run.returncode == 0 and out.rstrip().endswith("ALL PASS"), \
        out + err[-5000:]
    assert [row.split()[0] for row in table_rows(out, "my_copy")] == ["cp2-model"]
    [folder] = (tmp_path / "work").glob("validate-my_copy-*")
    assert (tmp_path / "work/other.txt").read_text() == "kept" and (folder / "runs.log").is_file()


def test_a_row_near_its_bound_is_told_rounding_or_bug(tmp_path, monkeypatch, capsys):
    """--near 1e6 puts every row near its bound, so each gets its float64 comparison. A copy of Qwen3 whose routed
    experts' output is scaled by 1 + 1e-4 under ep only (a small ep bug): the model-level cp2 row is rounding (its
    ranks, run again in float64, agree with one process in float64), cp2xep2 fails and is a bug (in float64 it stays
    off)."""
    folder = tmp_path / "recipes/my_epbug"
    shutil.copytree(ROOT / "recipes/qwen3_30b_a3b", folder, ignore=shutil.ignore_patterns("__pycache__"))
    code = "h_BSH + out_TH.view_as(h_BSH)"
    text = (folder / "model.py").read_text()
    assert text.count(code) == 1
    (folder / "model.py").write_text(text.replace(code, f"{code} * (1 + 1e-4 * (self.ep_group is not None))"))
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(tmp_path / "recipes")])
    assert script("validate").main(["--recipe", "my_epbug", "--rows", "cp2-model,cp2xep2-model", "--near", "1e6"]) == 1
    out = capsys.readouterr().out
    rows = {row.split()[0]: row.split() for row in table_rows(out, "my_epbug")}
    assert "PASS" in rows["cp2-model"] and "FAIL" in rows["cp2xep2-model"] and len(rows) == 2, out
    verdicts = notes(out)
    assert verdicts["cp2-model"].endswith("rounding, not a bug"), out
    assert verdicts["cp2xep2-model"].endswith("not rounding, a bug"), out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", recipes.recipe_names())
def test_validate_runs_every_check(recipe, capsys):
    assert script("validate").main(["--recipe", recipe]) == 0
    out = capsys.readouterr().out
    # every row but the base ones (a recipe with a transformers class and every feature)
    assert len(table_rows(out, recipe)) == len(recipe_checks.ROW_IDS) - len(recipe_checks.ROWS["base"]), out
    assert out.rstrip().endswith("ALL PASS"), out


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


# What the bounds taken from the model must still catch: each bug planted in a copy of Qwen3 (lines of its model.py
# replaced), the rows that must fail for it (the rest of the table is not run)
PLANTS = {
    "a wrong dtype at a stage hand-off (a received bf16 hidden state carried on in fp32)": (
        [("return self.model.initial_state(self.input_ids[mb], self.extras[mb]) if self.first else inputs",
          "return self.model.initial_state(self.input_ids[mb], self.extras[mb]) if self.first else "
          "[inputs[0].float(), *inputs[1:]]"),
         ("        if not self.last:\n            return state",
          "        if not self.last:\n            return [state[0].to(torch.get_autocast_dtype('cpu')) if "
          "torch.is_autocast_enabled('cpu') else state[0], *state[1:]]")], ["pp2-bf16-loss", "pp2-bf16-grad-norm"]),
    "a dropped gradient term (the last pipeline stage detaches the balance loss)": (
        [("return [self.loss_fn(terms)]", 'return [self.loss_fn({**terms, "aux": terms["aux"].detach()})]')], ["pp2"]),
    "a missed cp reduction (the router's expert counts not summed over the cp ranks)": (
        [("dist.all_reduce(counts_E, group=self.cp_group)", "pass")], ["cp2-model"]),
    "an fp32 cast in a float64 path (the router's softmax)": (
        [("softmax(dim=-1, dtype=compute_dtype(logits_TE.dtype))", "softmax(dim=-1, dtype=torch.float32)")],
        ["parity64-logits", "parity64-grads"]),
}


def test_planted_bugs_fail_their_rows(tmp_path, monkeypatch, capsys):
    """Each of PLANTS in its own copy of Qwen3 fails at least one of its rows, and a fp32 row that fails is a bug
    in float64 too (not excused as rounding): the bounds that follow the model still catch what fixed ones did."""
    validate = script("validate").main
    for i, (edits, _) in enumerate(PLANTS.values()):
        folder = tmp_path / "recipes" / f"my_plant{i}"
        shutil.copytree(ROOT / "recipes/qwen3_30b_a3b", folder, ignore=shutil.ignore_patterns("__pycache__"))
        text = (folder / "model.py").read_text()
        for old, new in edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        (folder / "model.py").write_text(text)
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(tmp_path / "recipes")])
    try:
        for i, (bug, (_, rows)) in enumerate(PLANTS.items()):
            assert validate(["--recipe", f"my_plant{i}", "--rows", ",".join(rows)]) == 1, bug
            out = capsys.readouterr().out
            table = {row.split()[0]: row.split() for row in table_rows(out, f"my_plant{i}")}
            assert table.keys() == set(rows) and any("FAIL" in table[row] for row in rows), (bug, out)
            assert all(note.endswith("not rounding, a bug") for row, note in notes(out).items()
                       if "FAIL" in table[row] and "no float64" not in note), (bug, out)
            print(f"{bug}:", *[" ".join(table[row][:1] + table[row][-6:]) for row in rows], sep="\n  ", file=sys.stderr)
    finally:
        for name in [m for m in sys.modules if m.startswith("recipes.my_plant")]:
            del sys.modules[name]


def test_every_layout_row_compares_in_fp32_and_in_float64(tmp_path):
    """Every row of tests/recipe_checks.py:layout_rows (all of a recipe's features on), fed runs of the right form
    made up here (no training: two ranks each, equal to one process), makes its comparison on the fp32 runs with
    their bounds and, where it has one, on the float64 twins: the path every row over or near its bound takes, so
    that no row can crash there; a row without a float64 form says why. LAYOUT_ROWS lists every row, in order."""
    from safetensors.torch import save_file

    recipe = recipe_checks.load_recipe("qwen3_30b_a3b")
    features = recipe_checks.model_features(recipe)
    placements = {name: table(4) for name, table in recipe_checks.PLACED.items()}
    rows = recipe_checks.layout_rows(recipe, tmp_path, features, placements)
    assert [row.id for row in rows] == list(recipe_checks.LAYOUT_ROWS)
    state = {"w": torch.ones(3), "experts.w[0]": torch.ones(2), "expert_bias": torch.zeros(4)}
    run = ([5.0, 4.0, 3.0], [1.0, 0.9, 0.8], state)  # losses, grad norms, state (tests/test_train.py:run_train)
    for folder in ("hf_single", "hf_pp2xep2", "hf_ep4_placed"):
        for name in (folder, folder + "_64"):
            (tmp_path / name).mkdir()
            save_file({"model.w": torch.ones(3)}, tmp_path / name / "model.safetensors")
    reads = set().union(*(row.reads for row in rows))
    single = {name for name in reads if name.startswith(("single", "docs single", "docs unmasked"))}
    made = {name: run if name in single else [{"loss": (1e-8, 1e-9)}] * 2 if name.startswith("grads ") else [run] * 2
            for name in reads}
    get = made.__getitem__
    get64 = lambda name: made[recipe_checks.FLOAT64_OF.get(name, name)]
    # a float64 twin's flags: the float64 references' weights, its own folders, a resume from the twin's checkpoint
    twin = recipe_checks.in_float64(["--out", "w/full", "--resume", "w/full/checkpoints/step_2"], tmp_path / "init")
    assert twin[-6:] == ["--hf-checkpoint", str(tmp_path / "init"), "--out", "w/full_64", "--resume",
                         "w/full_64/checkpoints/step_2"]
    for row in rows:
        error, where, bound = row.compare(get, False)
        assert math.isfinite(error) and bound >= 0 and isinstance(where, str), row.id
        if not row.no_float64:
            assert math.isfinite(row.compare(get64, True)[0]), row.id
