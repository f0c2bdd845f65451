"""Reliability: torchrun restarts after a killed rank (also in the middle of a save) and a hung one resume
exactly; a non-finite step is skipped everywhere and too many stop the run; bad input is one line; validation
loss under any layout and in tools/evaluate.py; deterministic reruns; no unsafe loading anywhere."""

import ast
import json
import math
import os
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from core.data import TokenLoader
from core.reliability import StopRun
from recipes.qwen3_30b_a3b import train
from tests.conftest import TINY_TRAIN_CONFIG
from tests.multiproc import run_ranks
from tests.test_launch import launch_env
from tests.test_train import run_train, train_args
from tools.hf_parity import folder_tensors
from tools.shards import write_shards

ROOT = Path(__file__).resolve().parents[1]


def records(out) -> dict[int, list[dict]]:
    """metrics.jsonl of a run: every record of each step (a step replayed after a restart appears again)."""
    found = {}
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        found.setdefault(r["step"], []).append(r)
    return found


def test_restarts_resume_exactly(tiny_train_setup, tmp_path):
    """torchrun --max-restarts with three failures: rank 1 SIGKILLed while writing checkpoint 4 (attempt 0),
    rank 0 SIGKILLed at a random step after the first checkpoint (attempt 1), rank 1 hung in step 8 (attempt 2,
    --step-timeout 5 s). DualPipeV over the 2 ranks (pp=2). The run finishes; every step's loss, replays
    included, and the final weights equal an uninterrupted run's exactly."""
    config, data = tiny_train_setup
    kill_step = random.randint(3, 8)
    flags = dict(steps=8, ckpt_every=2, grad_clip=1.0, pp=2)
    reference = run_ranks(2, run_train, train_args(config, data, tmp_path / "ref", **flags, export_hf=tmp_path / "ref_hf"))
    env = launch_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",  # none of the caller's RANK, OUT, MOE_TRAIN_*, ...
                     MOE_TRAIN_FAULT=f"kill-in-save@4:1:0,kill@{kill_step}:0:1,hang@8:1:2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           "-m", "recipes.qwen3_30b_a3b.train",
           *train_args(config, data, tmp_path / "run", **flags, export_hf=tmp_path / "hf", step_timeout=5)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"kill_step {kill_step}\n" + out[-4000:]

    # attempt 1 resumed from checkpoint 2 (4 was never completed), attempt 2 from the last one before the kill
    resumed = [int(s) for s in re.findall(r"resumed from \S+step_(\d+) at step", out)]
    assert resumed == [2, 2 * ((kill_step - 1) // 2), 6], (kill_step, resumed)
    # the hung rank's peer stopped within the limit, naming itself, the step, the phase and the collective
    stuck = re.search(r"watchdog: rank 0 of 2 stuck ([\d.]+) s \(limit 5.0 s, --step-timeout\) in step 8, phase "
                      r"DualPipeV schedule, at core/pipeline.py:\d+ _commit \(pipeline phase \d\)", out)
    assert stuck and float(stuck.group(1)) < 60, out[-4000:]  # (5 s and the 0.2 s polling; a busy machine adds)
    assert "Current thread" in out or "Thread 0x" in out  # the Python stacks were dumped

    ref_losses = reference[0][0]
    for step, recs in records(tmp_path / "run").items():
        assert [r["loss"] for r in recs] == [ref_losses[step - 1]] * len(recs), (kill_step, step)
    assert sorted(records(tmp_path / "run")) == list(range(1, 9))
    ref_w, w = folder_tensors(tmp_path / "ref_hf"), folder_tensors(tmp_path / "hf")
    assert ref_w.keys() == w.keys() and all(torch.equal(ref_w[k], w[k]) for k in ref_w)


def train_with_faults(faults: str, argv: list[str]) -> str:
    os.environ["MOE_TRAIN_FAULT"] = faults
    try:
        train.main(argv)
    except StopRun as e:
        return str(e)
    return ""


def checkpoint_tensors(step_dir: Path, tmp_path: Path) -> dict:
    """A DCP checkpoint as one plain dict (model, optim, scheduler, ...), loaded without unpickling code."""
    file = tmp_path / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, file)
    return torch.load(file, weights_only=True)


def flat(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix: tree}


def test_nonfinite_steps_are_skipped_then_stop(tiny_train_setup, tmp_path, capfd):
    """ep=2 on 2 ranks with aux-loss-free bias; rank 1's gradient turns NaN at steps 3, 5 and 6. Step 3 changes
    nothing on any rank (weights, expert bias, Adam state, lr schedule: checkpoint 3 == checkpoint 2); step 4
    trains; steps 5-6 are two in a row = --max-bad-steps, so the run stops with a message, checkpoint 5 intact."""
    config, data = tiny_train_setup
    argv = train_args(config, data, tmp_path, steps=8, ckpt_every=1, keep_checkpoints=0, ep=2, max_bad_steps=2,
                      expert_bias_rate=0.01, warmup_steps=4)
    messages = run_ranks(2, train_with_faults, "nan@3:1,nan@5:1,nan@6:1", argv)
    assert messages[0] == messages[1] and "2 steps in a row (5-6)" in messages[0] and "ranks [1]" in messages[0]
    assert "step_00000005 holds the last good weights" in messages[0]
    log = capfd.readouterr().out
    assert re.search(r"warning: step 3 skipped .* on ranks \[1\]; parameters with non-finite gradients: "
                     r"embed_tokens.weight \[1 in a row", log), log[-2000:]

    ckpts = {s: flat(checkpoint_tensors(tmp_path / f"checkpoints/step_{s:08d}", tmp_path)) for s in (2, 3, 4, 5)}
    assert not (tmp_path / "checkpoints/step_00000006").exists()
    state = [k for k in ckpts[2] if k.startswith(("model.", "optim.", "scheduler."))]
    assert any("expert_bias" in k for k in state) and any("exp_avg_sq" in k for k in state)

    def same(a, b):
        return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                   for x, y in ((ckpts[a][k], ckpts[b][k]) for k in state))

    assert same(3, 2) and same(5, 4) and not same(4, 3)
    recs = records(tmp_path)
    assert math.isnan(recs[3][0]["grad_norm"]) and recs[3][0]["skipped_steps"] == 1 and recs[6][0]["skipped_steps"] == 3
    assert recs[4][0]["lr"] == recs[3][0]["lr"] != recs[2][0]["lr"]  # the schedule did not advance at step 3


def run_history(argv):
    history, _ = train.main(argv)
    return history


def test_validation_loss_any_layout_and_evaluate_tool(tmp_path):
    """Validation loss at steps 2 and 4 is the same under pp=2 (DualPipeV forward-only) as in one process;
    tools/evaluate.py gives the logged number for the DCP checkpoint and for the exported folder; transformers'
    Qwen3MoeForCausalLM on that folder gives the same cross-entropy on the same windows."""
    from transformers import Qwen3MoeForCausalLM

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_TRAIN_CONFIG, "num_hidden_layers": 4}))
    rng = random.Random(1)
    docs = [[3 + (rng.randrange(3, 256) + i * s) % 253 for i in range(rng.randrange(20, 200))]
            for s in [rng.randrange(1, 5) for _ in range(140)]]
    write_shards(docs[:120], tmp_path / "data", vocab_size=256, eos_id=2, tokenizer={"kind": "none"})
    write_shards(docs[120:], tmp_path / "data/val", vocab_size=256, eos_id=2, tokenizer={"kind": "none"})
    val = tmp_path / "data/val"
    flags = dict(steps=4, eval_every=2, eval_batches=3)
    single = run_history(train_args(config, tmp_path / "data", tmp_path / "one", **flags, ckpt_every=4,
                                    export_hf=tmp_path / "hf"))
    pp = run_ranks(2, run_history, train_args(config, tmp_path / "data", tmp_path / "pp", **flags, pp=2))
    for step in (2, 4):
        assert abs(pp[0][step - 1]["val_loss"] / single[step - 1]["val_loss"] - 1) < 1e-5, step
    logged = single[3]
    assert logged["val_ppl"] == pytest.approx(math.exp(logged["val_loss"]))

    from tools import evaluate

    same = ["--config", str(config), "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--eval-batches", "3"]
    from_dcp = evaluate.main(["--checkpoint", str(tmp_path / "one/checkpoints/step_00000004"), "--data", str(val), *same])
    from_hf = evaluate.main(["--hf", str(tmp_path / "hf"), "--data", str(val), *same[2:]])
    assert from_dcp["val_loss"] == logged["val_loss"] and from_dcp["val_tokens"] == logged["val_tokens"] == 3 * 8 * 32
    assert from_hf["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-6)

    hf_model = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    loader, total = TokenLoader(val, 32, 8), 0.0
    with torch.no_grad():
        for _ in range(3):
            x, y = loader.next_batch()
            total += F.cross_entropy(hf_model(x).logits.flatten(0, 1), y.flatten(), reduction="sum").item()
    assert total / (3 * 8 * 32) == pytest.approx(logged["val_loss"], rel=1e-5)


def test_deterministic_reruns_are_bit_identical(tiny_train_setup, tmp_path):
    config, data = tiny_train_setup
    try:
        runs = [run_train(train_args(config, data, tmp_path / name, steps=3, deterministic=True)) for name in "ab"]
    finally:
        torch.use_deterministic_algorithms(False)
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(torch.equal(runs[0][2][k], runs[1][2][k]) for k in runs[0][2])


class RunsCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_bad_input_is_one_line(tiny_train_setup, tmp_path):
    """What a new user gets wrong fails as a ValueError / FileNotFoundError saying what to do; from the command
    line that is exactly one line, `error: ...`, and exit code 2."""
    config, data = tiny_train_setup
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt/meta.json").write_text("{not json")
    (tmp_path / "topk.json").write_text(json.dumps({**TINY_TRAIN_CONFIG, "num_experts_per_tok": 9}))
    cases = [  # (flags, message)
        (dict(lr_schedule="linear"), "invalid choice: 'linear'"),
        (dict(steps=0), "--steps must be >= 1"),
        (dict(aux_loss_coef="nan"), "not a finite number"),
        (dict(eval_every=1), "evaluation needs validation data"),
        (dict(data=tmp_path / "corrupt"), "meta.json is corrupt"),
        (dict(config=tmp_path / "topk.json"), "num_experts_per_tok \\(9\\) must be in 1..num_experts \\(4\\)"),
    ]
    for flags, message in cases:
        argv = train_args(flags.pop("config", config), flags.pop("data", data), tmp_path / "run", **flags)
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            train.main(argv)

    # checkpoints: a second fresh run into the same folder, a truncated and a corrupt checkpoint
    run_train(train_args(config, data, tmp_path / "a", steps=2, ckpt_every=1))
    with pytest.raises(ValueError, match="already holds checkpoints .* pass --resume auto"):
        train.main(train_args(config, data, tmp_path / "a", steps=3))
    newest = tmp_path / "a/checkpoints/step_00000002"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step_00000002 is damaged: its shard .*distcp has 100 bytes, \d+ expected"):
        train.main(train_args(config, data, tmp_path / "b", steps=3, resume=newest))
    losses, _, _ = run_train(train_args(config, data, tmp_path / "a", steps=3, resume="auto"))  # falls back to 1
    assert len(losses) == 2
    # a .metadata that would run a command when unpickled is refused, not run
    (tmp_path / "a/checkpoints/step_00000001/.metadata").write_bytes(pickle.dumps(RunsCommand(tmp_path / "ran")))
    with pytest.raises(ValueError, match="is corrupt: its .metadata cannot be read"):
        train.main(train_args(config, data, tmp_path / "c", steps=3, resume=tmp_path / "a/checkpoints/step_00000001"))
    assert not (tmp_path / "ran").exists()

    proc = subprocess.run([sys.executable, "-m", "recipes.qwen3_30b_a3b.train", "--config", str(config),
                           "--data", str(data), "--lr-schedule", "linear"], capture_output=True, text=True, cwd=ROOT,
                          env=launch_env(PYTHONPATH=str(ROOT)), timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: argument --lr-schedule: invalid choice: 'linear' (choose from 'cosine', 'wsd') (see --help)\n"




def unsafe_calls(source: str) -> list[str]:
    """Calls that could run code from a file: torch.load without weights_only=True, pickle/marshal/dill loads
    (a restricted pickle.Unpickler subclass, as core/checkpoint.py uses for DCP's .metadata, is not a call here),
    numpy loads with allow_pickle=True, trust_remote_code=True, eval/exec."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
        kw = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
        if owner == "torch" and name == "load" and kw.get("weights_only") is not True:
            found.append(f"line {node.lineno}: torch.load without weights_only=True")
        elif owner in ("pickle", "marshal", "dill", "cloudpickle", "joblib") and name in ("load", "loads", "Unpickler"):
            found.append(f"line {node.lineno}: {owner}.{name}")
        elif owner == "np" and name == "load" and kw.get("allow_pickle") is True:
            found.append(f"line {node.lineno}: np.load(allow_pickle=True)")
        elif kw.get("trust_remote_code") is True:
            found.append(f"line {node.lineno}: trust_remote_code=True")
        elif isinstance(f, ast.Name) and name in ("eval", "exec"):
            found.append(f"line {node.lineno}: {name}()")
    return sorted(found, key=lambda hit: int(hit.split()[1].rstrip(":")))


def test_no_unsafe_loading_anywhere():
    assert unsafe_calls("import torch, pickle\ntorch.load(f)\ntorch.load(f, weights_only=False)\npickle.Unpickler(f).load()\n"
                        "AutoModel.from_pretrained(p, trust_remote_code=True)\ntorch.load(f, weights_only=True)\n") == [
        "line 2: torch.load without weights_only=True", "line 3: torch.load without weights_only=True",
        "line 4: pickle.Unpickler", "line 5: trust_remote_code=True"]
    files = [p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    found = {str(p.relative_to(ROOT)): hits for p in files if (hits := unsafe_calls(p.read_text()))}
    assert found == {}, found
