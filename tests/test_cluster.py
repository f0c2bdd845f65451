"""Long runs on shared clusters: a signal (SIGTERM to torchrun, SIGTERM / SIGUSR1 to one rank) or --time-limit
stops every rank at one step boundary with one checkpoint, and --resume auto then ends equal to an uninterrupted
run; asynchronous checkpoints equal synchronous ones and stay atomic when a rank dies mid-write; a damaged
checkpoint (truncated or deleted shard) is skipped by --resume auto and refused by name; dataset mixtures
(proportions, determinism, data ranks, document masks per kind, per-source losses against plain PyTorch)."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core.data import MixtureLoader, TokenLoader, mixture_counts, parse_mixture
from recipes.qwen3_30b_a3b import train
from tests.multiproc import run_ranks
from tests.recipe_checks import write_counting_chats, write_counting_data
from tests.test_launch import launch_env
from tests.test_reliability import checkpoint_tensors, flat, records
from tests.test_train import run_train, train_args
from tools.shards import write_shards

ROOT = Path(__file__).resolve().parents[1]


def run_logged(argv):
    """train.main on a rank: (losses, grad norms, weights) as run_train, plus the per-source losses."""
    history, model = train.main(argv)
    return [h["loss"] for h in history], [{k: v for k, v in h.items() if k.startswith("loss_")} for h in history], \
        {k: v.detach().clone() for k, v in model.state_dict().items()}


def torchrun(nproc: int, argv: list[str], faults: str, restarts: int = 0) -> subprocess.CompletedProcess:
    env = launch_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MOE_TRAIN_FAULT=faults)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "-m", "recipes.qwen3_30b_a3b.train", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)


def test_sigterm_to_torchrun_at_pp2xep2_then_resume(tiny_train_setup, tmp_path):
    """4 ranks, pp=2 x ep=2, periodic checkpoints off: rank 0 sends SIGTERM to torchrun after step 7 of 16;
    torchrun forwards it, every rank finishes the step it is in and stops after the same one, one checkpoint holds
    it, one line says so. The relaunch with --resume auto logs every later step's loss equal to an uninterrupted
    run's, the last one included."""
    config, data = tiny_train_setup
    flags = dict(steps=16, pp=2, ep=2, micro_batch=1)
    reference = run_ranks(4, run_train, train_args(config, data, tmp_path / "ref", **flags))[0][0]
    proc = torchrun(4, train_args(config, data, tmp_path / "run", **flags), "sigterm-launcher@7:0")
    out = proc.stdout + proc.stderr
    stopped = re.findall(r"stopped after step (\d+) of 16 \(SIGTERM received\); checkpoint (\S+) holds every rank's "
                         r"state: relaunch with --resume auto to continue", out)
    assert len(stopped) == 1, out[-4000:]  # one line (rank 0)
    step = int(stopped[0][0])
    assert 7 <= step < 16 and Path(stopped[0][1]).name == f"step_{step:08d}", out[-4000:]
    assert [p.name for p in (tmp_path / "run/checkpoints").iterdir()] == [f"step_{step:08d}"]
    assert [r[0]["loss"] for _, r in sorted(records(tmp_path / "run").items())] == reference[:step]
    resumed = run_ranks(4, run_train, train_args(config, data, tmp_path / "run", **flags, resume="auto"))[0][0]
    assert resumed == reference[step:] and resumed[-1] == reference[-1]


def test_three_preemptions_at_random_steps(tiny_train_setup, tmp_path, monkeypatch):
    """ep=2 on 2 ranks, asynchronous checkpoints every 3 steps: SIGUSR1 to rank 1 only after a random step, SIGTERM
    to rank 0 only after a later one, then a --time-limit that stops the next relaunch after its first step; both
    ranks stop after the same step each time (the all-reduced flag), and the fourth launch finishes. Every step's
    loss, and the final weights, equal an uninterrupted run's exactly."""
    config, data = tiny_train_setup
    first = random.randint(1, 5)
    second = random.randint(first + 1, 9)
    flags = dict(steps=12, ep=2, ckpt_every=3, async_checkpoint=True)
    reference = run_ranks(2, run_train, train_args(config, data, tmp_path / "ref", **flags))
    argv = train_args(config, data, tmp_path / "run", **flags, resume="auto")
    losses = []
    for faults, extra in ((f"sigusr1@{first}:1", {}), (f"sigterm@{second}:0", {}), ("", dict(time_limit=1e-4)),
                          ("", {})):
        monkeypatch.setenv("MOE_TRAIN_FAULT", faults)
        run = run_ranks(2, run_train, argv + [f"--{k.replace('_', '-')}={v}" for k, v in extra.items()])
        assert run[0][0] == run[1][0]  # both ranks ran the same steps
        losses.append(run[0][0])
    assert [len(x) for x in losses] == [first, second - first, 1, 12 - second - 1], (first, second)
    assert sum(losses, []) == reference[0][0], (first, second)
    assert all(torch.equal(reference[0][2][k], run[0][2][k]) for k in reference[0][2])


def test_async_checkpoints_equal_sync_and_survive_a_killed_writer(tiny_train_setup, tmp_path):
    """2 ranks (ep=2), a checkpoint every 2 of 6 steps, all kept. Asynchronous: rank 1 is SIGKILLed after its part
    of checkpoint 4 is written, before every rank finished; torchrun restarts the job, which resumes from
    checkpoint 2 (4 stayed step_4.tmp) and finishes. Checkpoints 2, 4 and 6 equal a synchronous run's tensor for
    tensor (model, Adam state, scheduler, data position, every rank's RNG)."""
    config, data = tiny_train_setup
    flags = dict(steps=6, ep=2, ckpt_every=2, keep_checkpoints=0)
    run_ranks(2, run_train, train_args(config, data, tmp_path / "sync", **flags))
    proc = torchrun(2, train_args(config, data, tmp_path / "async", **flags, async_checkpoint=True),
                    "kill-in-save@4:1:0", restarts=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert [int(s) for s in re.findall(r"resumed from \S+step_(\d+) at step", out)] == [2], out[-4000:]
    assert "(written in the background)" in out
    for run in ("s", "a"):
        (tmp_path / run).mkdir()
    for step in (2, 4, 6):
        name = f"checkpoints/step_{step:08d}"
        sync = flat(checkpoint_tensors(tmp_path / "sync" / name, tmp_path / "s"))
        async_ = flat(checkpoint_tensors(tmp_path / "async" / name, tmp_path / "a"))
        assert sync.keys() == async_.keys() and any(k.startswith("rng_rank1") for k in sync), step
        for key in sync:
            same = torch.equal(sync[key], async_[key]) if isinstance(sync[key], torch.Tensor) else sync[key] == async_[key]
            assert same, (step, key)
    assert not list((tmp_path / "async/checkpoints").glob("*.tmp"))


def test_damaged_checkpoints(tiny_train_setup, tmp_path, capfd):
    """Checkpoints 1-3; one shard of 3 truncated: --resume auto warns in one line naming that file and resumes from
    2; a shard of 2 deleted too: it warns for both and resumes from 1; --resume of either folder is an error
    naming the file."""
    config, data = tiny_train_setup
    run_train(train_args(config, data, tmp_path, steps=3, ckpt_every=1, keep_checkpoints=0))
    ckpt = tmp_path / "checkpoints"
    truncated = sorted((ckpt / "step_00000003").glob("*.distcp"))[0]
    truncated.write_bytes(truncated.read_bytes()[:-7])
    capfd.readouterr()

    def resume_auto() -> tuple[int, list[str]]:
        run_train(train_args(config, data, tmp_path, steps=4, resume="auto"))
        log = capfd.readouterr().out
        return int(re.search(r"resumed from \S+step_(\d+) at step", log).group(1)), \
            [line for line in log.splitlines() if line.startswith("warning: checkpoint")]

    step, warnings = resume_auto()
    assert step == 2 and len(warnings) == 1, warnings
    assert re.fullmatch(rf"warning: checkpoint \S+step_00000003 is damaged: its shard {re.escape(str(truncated))} has "
                        r"\d+ bytes, \d+ expected \(truncated\); .*; trying the previous checkpoint", warnings[0])
    deleted = sorted((ckpt / "step_00000002").glob("*.distcp"))[0]
    deleted.unlink()
    step, warnings = resume_auto()
    assert step == 1 and len(warnings) == 2 and f"its shard {deleted} is missing" in warnings[1], warnings
    for folder, why in (("step_00000003", f"shard {truncated} has"), ("step_00000002", f"shard {deleted} is missing")):
        with pytest.raises(ValueError, match=re.escape(why)):
            train.main(train_args(config, data, tmp_path / "other", steps=4, resume=ckpt / folder))


# ---------------------------------------------------------------------------------------------- mixtures


def write_numbered(out, tokens: int, vocab: int = 1 << 16) -> Path:
    """Raw text whose token i is i (as uint32 when needed): a window is known by its first token."""
    write_shards([list(range(3, tokens))], out, vocab_size=vocab, eos_id=2, tokenizer={"kind": "none"})
    return Path(out)


def test_mixture_proportions_determinism_and_data_ranks(tmp_path):
    """Counts per step within 1 of weight x global batch (the systematic rounding's bound), the mean over 600
    steps within 1/600 of it (the low-discrepancy offsets), the batches' sources as counted; no window of a source
    twice within its epoch; the same batches again (pure function of seed and step), also rebuilt at step 9 from
    the state and read by 1, 2 or 4 data ranks; document ids of raw rows 0 and of conversation rows their own."""
    weights, batch = [0.55, 0.3, 0.15], 8
    counts = mixture_counts(weights, batch, np.arange(600), seed=3)
    assert (counts.sum(1) == batch).all()
    assert np.abs(counts - np.multiply(weights, batch)).max() < 1
    assert np.abs(counts.mean(0) - np.multiply(weights, batch)).max() <= 1 / 600 + 1e-9

    a, b = write_numbered(tmp_path / "a", 4000), write_numbered(tmp_path / "b", 2000)
    chats = write_counting_chats(tmp_path / "chats", 16)
    for meta_dir in (a, b, chats):  # one tokenizer for all (the check compares meta.json's)
        meta = json.loads((meta_dir / "meta.json").read_text())
        (meta_dir / "meta.json").write_text(json.dumps({**meta, "vocab_size": 1 << 16}))
    sources = parse_mixture(f"a={a}:0.55,b={b}:0.3,chats={chats}:0.15")
    assert [(n, w) for n, _, w in sources] == [("a", pytest.approx(0.55)), ("b", pytest.approx(0.3)),
                                               ("chats", pytest.approx(0.15))]

    def batches(world: int, steps: range, state=None) -> list:
        loaders = [MixtureLoader(sources, 16, batch, rank, world, seed=3) for rank in range(world)]
        out = []
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        for _ in steps:
            parts = [(*loader.next_batch(documents=True), loader.sources) for loader in loaders]  # per rank
            out.append([torch.cat(x) for x in zip(*parts)])  # ids, labels, docs, sources of the global batch
        return out

    first = batches(1, range(30))
    seen = {0: [], 1: []}
    for step, (ids, labels, docs, src) in enumerate(first):
        assert torch.bincount(src, minlength=3).tolist() == counts[step].tolist()
        for s in (0, 1):
            seen[s] += ids[src == s, 0].tolist()
        assert (docs[src < 2] == 0).all()  # raw text: plain causal under a document mask
        assert (labels[src < 2, :-1] == ids[src < 2, 1:]).all()  # raw text: every token trained
    assert (first[0][2][first[0][3] == 2] > 0).any() or any((b[2][b[3] == 2] > 0).any() for b in first)
    for s, folder in ((0, a), (1, b)):  # each window once per epoch of its source
        per_epoch = TokenLoader(folder, 16, batch).num_samples
        assert len(set(seen[s][:per_epoch])) == min(per_epoch, len(seen[s])), s
    state = {"step": 9, "seed": 3, "seq_len": 16, "global_batch": batch, "mixture": {n: w for n, _, w in sources}}
    for world in (1, 2, 4):
        again = batches(world, range(9, 30), state)
        assert all(all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(first[9:], again)), world
    with pytest.raises(ValueError, match="saved with the mixture"):
        batches(1, range(1), {**state, "mixture": {"a": 0.5, "b": 0.5}})


def test_mixture_bad_input_is_one_line(tiny_train_setup, tmp_path):
    config, data = tiny_train_setup
    other = write_counting_data(tmp_path / "other")
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "tokenizer": {"kind": "sentencepiece", "path": "x.model"}}))
    cases = [(f"{data}:0.7,{data}:x", "is not FOLDER:WEIGHT with a weight > 0"),
             (f"{data}:0.7,{data}:-1", "is not FOLDER:WEIGHT with a weight > 0"),
             (f"{data}:0.7,{data}:0.3", "two sources are named 'data'"),
             (f"{data}:0.7,{tmp_path / 'missing'}:0.3", "dataset directory .*missing does not exist"),
             (f"{data}:0.7,{other}:0.3", "source other .* has tokenizer .* a mixture needs datasets made with one")]
    for spec, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            train.main(train_args(config, spec, tmp_path / "run", dry_run=True))


def test_per_source_losses_and_validation(tmp_path):
    """A mixture of raw text and conversations (plain causal attention: the reference's), one step at lr 0 (the
    weights stay the initial ones): each
    source's logged loss equals plain F.cross_entropy of the model's logits on that source's rows of the batch,
    the step's loss their label-weighted mean, under one process and under pp=2 alike; validation reports each
    source's own split and their mean by weight."""
    from tests.conftest import TINY_TRAIN_CONFIG

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_TRAIN_CONFIG))
    text = write_counting_data(tmp_path / "text")
    chats = write_counting_chats(tmp_path / "chats", 32)
    write_counting_data(text / "val")
    write_counting_chats(chats / "val", 32)
    spec = f"text={text}:0.6,chats={chats}:0.4"
    flags = dict(steps=1, lr=0, weight_decay=0, eval_every=1, eval_batches=1, no_document_mask=True)
    history, model = train.main(train_args(config, spec, tmp_path / "one", **flags))
    loader = MixtureLoader(parse_mixture(spec), 32, 8, seed=0)
    ids, labels = loader.next_batch()
    with torch.no_grad():
        ce = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="none").view(8, 32)
    logged = history[0]
    for s, name in enumerate(("text", "chats")):
        rows = loader.sources == s
        assert logged[f"loss_{name}"] == pytest.approx((ce[rows].sum() / (labels[rows] != -100).sum()).item(), rel=1e-5)
    assert logged["loss"] == pytest.approx((ce.sum() / (labels != -100).sum()).item(), rel=1e-5)
    assert logged["val_loss"] == pytest.approx(0.6 * logged["val_loss_text"] + 0.4 * logged["val_loss_chats"])
    pp = run_ranks(2, run_logged, train_args(config, spec, tmp_path / "pp", **flags, pp=2))
    for name in ("text", "chats"):  # fp32 sums of the same per-token losses in another order: ~1e-7 relative
        assert pp[0][1][0][f"loss_{name}"] == pytest.approx(logged[f"loss_{name}"], rel=1e-5)
