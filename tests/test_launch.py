"""launch.sh end to end on CPU: data preparation, torchrun with 4 gloo ranks (pp=2 x ep=2, the default), the first
loss of the fresh model at ln(vocab), validation, checkpoint, export, TensorBoard logs; a copied recipe folder
running unchanged under its new name on 2 ranks (ep=2, no pipeline), printing a sample that continues the prompt;
and a second launch into the same folder stopping with one line."""

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--steps", "4", "--seq-len", "64", "--ckpt-every", "2", "--eval-batches", "2"]


def lines_naming(folder: Path, recipe: str) -> list[str]:
    """'file:line' of every line in the files of `folder` that names recipe `recipe` as a module or a path:
    recipes.NAME or recipes/NAME (an import, a command) or runs/NAME (an output folder), NAME not the start of a
    longer name. Any other string that contains the name (a model_type, a docstring) is no path and passes."""
    named = re.compile(rf"\b(?:recipes[./]|runs/){re.escape(recipe)}(?!\w)")
    return [f"{f.name}:{i}" for f in sorted(folder.iterdir()) if f.is_file()
            for i, line in enumerate(f.read_text().splitlines(), 1) if named.search(line)]


def copy_recipe(recipe: str, tmp_path: Path) -> Path:
    """`cp -r recipes/<recipe> recipes/my_arch` in a scratch repository (core and tools linked): its launch.sh.
    The copy needs no edits: no file names the original folder as a module or path (lines_naming), and
    train.py's default --out is runs/my_arch."""
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    for name in ("core", "tools"):
        (repo / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "recipes/__init__.py", repo / "recipes/__init__.py")
    shutil.copytree(ROOT / "recipes" / recipe, repo / "recipes/my_arch", ignore=shutil.ignore_patterns("__pycache__"))
    named = lines_naming(repo / "recipes/my_arch", recipe)
    assert not named, f"the copy still imports or names the path of recipes/{recipe}: {named}"
    usage = subprocess.run(["python", "-m", "recipes.my_arch.train", "--help"], cwd=repo, capture_output=True,
                           text=True, timeout=300)
    assert "default: runs/my_arch" in " ".join(usage.stdout.split()), usage.stdout[-2000:] + usage.stderr[-2000:]
    return repo / "recipes/my_arch/launch.sh"


def launch_variables() -> set[str]:
    """Every environment variable a recipe's launch.sh reads ($NAME, ${NAME...}: OUT, DATA, NPROC, PP, EP,
    NNODES, SLURM_*, MAX_RESTARTS, ...) and every one train.py and core read (os.environ): what a caller's shell
    may have exported (launch.sh's own usage suggests OUT=...) and a test must not inherit."""
    names = set()
    for path in ROOT.glob("recipes/*/launch.sh"):
        names |= set(re.findall(r"\$\{?([A-Za-z_]\w*)", path.read_text()))
    for path in [*ROOT.glob("core/**/*.py"), *ROOT.glob("recipes/*/train.py")]:
        names |= set(re.findall(r"os\.environ(?:\.get\(|\.setdefault\(|\[)\s*[\"'](\w+)", path.read_text()))
    return names


def launch_env(**env: str) -> dict:
    """The environment a test runs launch.sh in: the caller's without launch_variables(), no GPU, plus env."""
    drop = launch_variables()
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "CUDA_VISIBLE_DEVICES": "", **env}


def launch(script: Path, env: dict, *args: str, returncode: int = 0) -> str:
    env = launch_env(**env)
    proc = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_launch_sh_and_a_copied_recipe(tmp_path):
    data = tmp_path / "data"
    out = launch(ROOT / "recipes/qwen3_30b_a3b/launch.sh", {"DATA": str(data), "OUT": str(tmp_path / "run")},
                 *FAST, "--export-hf", str(tmp_path / "hf"))
    assert (data / "meta.json").is_file() and (data / "tokenizer.model").is_file()
    assert "mesh pp=2 dp=1 cp=1 ep=2" in out and "a2a rows" in out and "trained steps 1-4" in out
    assert "--expert-bias-rate 1e-2" in out  # a CPU default the model accepts (Model.features)
    assert "FutureWarning" not in out and "DeprecationWarning" not in out  # e.g. a deprecated collective
    first_loss = float(re.search(r"step +1/4 \| loss ([0-9.]+)", out).group(1))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    assert abs(first_loss - math.log(vocab)) < 0.1, (first_loss, vocab)  # a fresh model predicts ~uniformly
    assert (data / "val/meta.json").is_file() and "step     4/4 | val loss" in out  # held-out split, evaluated
    assert (tmp_path / "run/checkpoints/step_00000004/.metadata").is_file()
    assert (tmp_path / "hf/config.json").is_file()
    assert list((tmp_path / "run/tensorboard").glob("events.out.tfevents.*"))

    # cp -r recipes/qwen3_30b_a3b recipes/my_arch gives a runnable recipe with no edits
    copy = copy_recipe("qwen3_30b_a3b", tmp_path)  # no OUT: the run goes to runs/my_arch
    out = launch(copy, {"DATA": str(data), "NPROC": "2", "PP": "1", "EP": "2"}, *FAST, "--sample-tokens", "8")
    assert "-m recipes.my_arch.train" in out and "mesh pp=1 dp=1 cp=1 ep=2" in out and "trained steps 1-4" in out
    sample = re.search(r"sample: '(.*)'", out).group(1)
    assert sample.startswith("def") and len(sample) > len("def "), sample  # the prompt, then generated text
    assert (copy.parents[2] / "runs/my_arch/checkpoints/step_00000004/.metadata").is_file()

    # a bad flag: launch.sh checks the flags once (train.py --dry-run) before torchrun starts a rank: one line, and
    # nothing else printed (torchrun, traced by set -x, never ran; no time limit here: a busy machine is slow)
    out = launch(ROOT / "recipes/qwen3_30b_a3b/launch.sh", {"DATA": str(data), "OUT": str(tmp_path / "bad"),
                 "NPROC": "2", "PP": "1", "EP": "2"}, "--expert-placement", "0,1", returncode=2)
    assert out.strip() == ("error: expert placement lists 2 experts but the model has 8 routed experts; give one ep "
                           "rank per expert"), out
    assert not (tmp_path / "bad/checkpoints").exists()

    # a second launch into the same folder: caught by the same check, before torchrun
    out = launch(ROOT / "recipes/qwen3_30b_a3b/launch.sh", {"DATA": str(data), "OUT": str(tmp_path / "run"),
                 "MAX_RESTARTS": "1"}, *FAST, returncode=2)
    assert out.strip().startswith("error: ") and "--resume auto" in out and len(out.strip().splitlines()) == 1, out


def test_only_a_module_or_path_names_the_base(tmp_path):
    """A string that contains the folder's name (a model_type "deepseek_v2" in a recipe named deepseek_v2, a
    longer recipe name) passes; an import, a module path in a command, a recipes/ or runs/ path does not."""
    folder = tmp_path / "my_arch"
    folder.mkdir()
    (folder / "model.py").write_text('config = {"model_type": "deepseek_v2"}  # like deepseek_v2 in transformers\n'
                                     'BASE_RECIPE = "deepseek_v2_lite"\n'
                                     "from .model import Model\n")
    assert lines_naming(folder, "deepseek_v2") == []
    (folder / "train.py").write_text("from recipes.deepseek_v2.model import Model\n"
                                     "import recipes.deepseek_v2\n"
                                     "OUT = 'runs/deepseek_v2'\n")
    (folder / "launch.sh").write_text("python -m recipes.deepseek_v2.train\nbash recipes/deepseek_v2/launch.sh\n")
    assert lines_naming(folder, "deepseek_v2") == ["launch.sh:1", "launch.sh:2", "train.py:1", "train.py:2",
                                                   "train.py:3"]


def test_the_callers_environment_does_not_change_a_launch(tiny_train_setup, tmp_path, monkeypatch):
    """Every variable launch.sh (and train.py) reads exported in the shell that runs the tests, OUT at a folder
    with a checkpoint among them: a copied recipe's launch still passes its check (train.py --dry-run) and starts
    torchrun (a stand-in that prints its flags) on 2 ranks writing to runs/my_arch, as in a clean shell."""
    caller_out = tmp_path / "caller_out"
    (caller_out / "checkpoints/step_00000001").mkdir(parents=True)
    (caller_out / "checkpoints/step_00000001/.metadata").write_text("")
    exported = {"OUT": str(caller_out), "DATA": str(tmp_path / "missing"), "NPROC": "3", "PP": "3", "EP": "3",
                "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "1", "MAX_RESTARTS": "7",
                "HF_CHECKPOINT": str(tmp_path / "missing_hf"), "SLURM_JOB_ID": "1", "WORLD_SIZE": "3", "RANK": "2",
                "MOE_TRAIN_FAULT": "crash:1", "OMP_NUM_THREADS": "1"}
    assert set(exported) <= launch_variables()
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    copy = copy_recipe("qwen3_30b_a3b", tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/torchrun").write_text('#!/bin/sh\necho "torchrun: $*"\n')
    (tmp_path / "bin/torchrun").chmod(0o755)
    out = launch(copy, {"DATA": str(tiny_train_setup[1]), "NPROC": "2", "PP": "1", "EP": "2",
                        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    torchrun = next(line for line in out.splitlines() if line.startswith("torchrun: "))
    assert "--standalone" in torchrun and "--nproc-per-node 2 --max-restarts 3" in torchrun, torchrun
    assert f"--data {tiny_train_setup[1]} --out runs/my_arch" in torchrun, torchrun
    assert not (copy.parents[2] / "runs/my_arch/checkpoints").exists()


def test_launch_passes_only_flags_the_model_accepts(tiny_train_setup, tmp_path):
    """launch.sh's CPU defaults ask the recipe's Model.features (the shipped recipe's turn on --expert-bias-rate:
    test_launch_sh_and_a_copied_recipe): once a copy's features depend on the config (a property declining
    expert_bias for 8 experts, the tiny config's) the flag is left out and the launch passes its dry run and starts
    torchrun (a stand-in that prints its flags)."""
    copy = copy_recipe("qwen3_30b_a3b", tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/torchrun").write_text('#!/bin/sh\necho "torchrun: $*"\n')
    (tmp_path / "bin/torchrun").chmod(0o755)
    env = {"DATA": str(tiny_train_setup[1]), "NPROC": "2", "PP": "1", "EP": "2", "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    torchrun = lambda out: next(line for line in out.splitlines() if line.startswith("torchrun: "))
    model_py = copy.with_name("model.py")
    line = '    features = frozenset({"expert_bias", "aux_loss", "recompute", "fp8", "muon", "document_mask"})\n'
    assert line in model_py.read_text()
    model_py.write_text(model_py.read_text().replace(line, (
        "    @property\n    def features(self):\n"
        '        return frozenset({"aux_loss", "recompute", "fp8", "muon", "document_mask"}'
        ' | ({"expert_bias"} if self.cfg.num_experts > 8 else set()))\n')))
    assert "--expert-bias-rate" not in torchrun(launch(copy, env))
