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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--steps", "4", "--seq-len", "64", "--ckpt-every", "2", "--eval-batches", "2"]


def copy_recipe(recipe: str, tmp_path: Path) -> Path:
    """`cp -r recipes/<recipe> recipes/my_arch` in a scratch repository (core and tools linked): its launch.sh.
    The copy needs no edits: no file names the original folder (commands, paths), and train.py's default --out
    is runs/my_arch."""
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    for name in ("core", "tools"):
        (repo / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "recipes/__init__.py", repo / "recipes/__init__.py")
    shutil.copytree(ROOT / "recipes" / recipe, repo / "recipes/my_arch", ignore=shutil.ignore_patterns("__pycache__"))
    named = [f"{f.name}:{i}" for f in sorted((repo / "recipes/my_arch").iterdir())
             for i, line in enumerate(f.read_text().splitlines(), 1) if recipe in line]
    assert not named, f"the copy still names {recipe}: {named}"
    usage = subprocess.run(["python", "-m", "recipes.my_arch.train", "--help"], cwd=repo, capture_output=True,
                           text=True, timeout=300)
    assert "default: runs/my_arch" in " ".join(usage.stdout.split()), usage.stdout[-2000:] + usage.stderr[-2000:]
    return repo / "recipes/my_arch/launch.sh"


def launch(script: Path, env: dict, *args: str, returncode: int = 0) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env}
    proc = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_launch_sh_and_a_copied_recipe(tmp_path):
    data = tmp_path / "data"
    out = launch(ROOT / "recipes/qwen3_30b_a3b/launch.sh", {"DATA": str(data), "OUT": str(tmp_path / "run")},
                 *FAST, "--export-hf", str(tmp_path / "hf"))
    assert (data / "meta.json").is_file() and (data / "tokenizer.model").is_file()
    assert "mesh pp=2 dp=1 cp=1 ep=2" in out and "a2a rows" in out and "trained steps 1-4" in out
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

    # a bad flag: launch.sh checks the flags once (train.py --dry-run) before torchrun starts a rank: one line
    start = time.time()
    out = launch(ROOT / "recipes/qwen3_30b_a3b/launch.sh", {"DATA": str(data), "OUT": str(tmp_path / "bad"),
                 "NPROC": "2", "PP": "1", "EP": "2"}, "--expert-placement", "0,1", returncode=2)
    assert out.strip() == ("error: expert placement lists 2 experts but the model has 8 routed experts; give one ep "
                           "rank per expert"), out
    assert time.time() - start < 15
    assert not (tmp_path / "bad/checkpoints").exists()

    # a second launch into the same folder: caught by the same check, before torchrun
    out = launch(ROOT / "recipes/qwen3_30b_a3b/launch.sh", {"DATA": str(data), "OUT": str(tmp_path / "run"),
                 "MAX_RESTARTS": "1"}, *FAST, returncode=2)
    assert out.strip().startswith("error: ") and "--resume auto" in out and len(out.strip().splitlines()) == 1, out
