"""Skills compare-runs, prepare-data and launch-multi-node: every script on every recipe's tiny config on CPU.

Per recipe one 2-rank launch.sh run (the mesh check, ep=2) and one in-process run with another lr are compared;
the printed tables are checked against what the runs returned (train.main's history) and against TensorBoard's own
event reader. prepare-data tokenizes text + jsonl with a sentencepiece model trained here and is checked against
sentencepiece itself."""

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from recipes import recipe_names
from tests.test_launch import launch_variables

ROOT = Path(__file__).resolve().parents[1]
RECIPES = recipe_names()
SMALL = ["--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--warmup-steps", "1", "--steps", "2"]


def script(skill: str, name: str):
    sys.path.insert(0, str(ROOT / "skills" / skill / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def table(out: str, title: str) -> dict[int, list[str]]:
    """{step: [cell per run]} of the printed table `## title`."""
    block = out.split(f"## {title}\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    return {int(row.split()[0]): row.split()[1:] for row in block}


def tensorboard_scalars(run: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


# the skills' scripts know no model: one recipe in the suite, every recipe under -m slow
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=() if r == "qwen3_30b_a3b" else pytest.mark.slow)
                                    for r in RECIPES])
def test_mesh_check_and_compare_runs(recipe, tiny_train_setup, tmp_path, capsys, monkeypatch):
    _, data = tiny_train_setup
    for name in launch_variables():  # the caller's shell must not steer launch.sh (OUT, NNODES, SLURM_*, ...)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # launch-multi-node: 2 local ranks through launch.sh, the printed mesh checked (and run A of the comparison)
    check_mesh = script("launch-multi-node", "check_mesh")
    run_a, run_b = tmp_path / "lr_1e-3", tmp_path / "lr_3e-3"
    res = check_mesh.main(["--recipe", recipe, "--cpu", "--nproc", "2", "--pp", "1", "--ep", "2", "--data", str(data),
                           "--out", str(run_a), "--", *SMALL, "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert (res["pp"], res["dp"], res["cp"], res["ep"]) == (1, 1, 1, 2) and "PASS" in out, out
    assert "mesh: pp=1 dp=1 cp=1 ep=2 on cpu (2 ranks)" in out
    # the verification flags a layout other than the one asked for, a world size torchrun did not start, a crash
    assert check_mesh.verify(res, 1, 1, 2) == []
    assert check_mesh.verify(res, 1, 1, 1) == ["ep=2, asked for 1"]
    assert check_mesh.verify(res, 2, None, None) == ["pp*dp*cp*ep = 2 but torchrun started 2 x 2 nodes"]
    bad = check_mesh.parse(res["log"].replace("step     1/2 | loss", "step     1/2 | loss nan ").replace("ep=2 on", "ep=3 on"))
    assert check_mesh.verify({**bad, "returncode": 1}, 1, None, None) == [
        "launch.sh exited with 1", "pp*dp*cp*ep = 3 but torchrun started 2 x 1 nodes", "step 1 loss is nan"]

    # run B: one process, another lr, validation every step (on the training data: the numbers only need to exist)
    train = importlib.import_module(f"recipes.{recipe}.train")
    history_b, _ = train.main(["--data", str(data), "--out", str(run_b), *SMALL, "--lr", "3e-3", "--ckpt-every", "0",
                               "--eval-data", str(data), "--eval-every", "1", "--eval-batches", "1"])
    capsys.readouterr()

    # compare-runs
    compare = script("compare-runs", "compare_runs")
    compare.main([str(run_a), str(run_b), "--png", str(tmp_path / "curves.png")])
    out = capsys.readouterr().out
    assert out.startswith("2 common steps (1-2) of lr_1e-3: 2, lr_3e-3: 2"), out
    tb = {run: tensorboard_scalars(run) for run in (run_a, run_b)}
    for col, run in enumerate((run_a, run_b)):
        for title, tag, fmt in [("loss", "train/loss", "{:.4f}"), ("grad norm", "train/grad_norm", "{:.4f}"),
                                ("tokens/s", "train/tokens_per_s", "{:,.0f}"), ("MFU %", "train/mfu", "{:.3%}")]:
            rows = table(out, title)
            for step in (1, 2):
                assert rows[step][col] == fmt.format(tb[run][tag][step]), (title, run.name, step, rows[step])
        layers = sorted(t for t in tb[run] if t.startswith("expert_load_max_over_mean/"))
        assert layers, tb[run].keys()
        for i, tag in enumerate(layers):
            rows = table(out, f"expert load max/mean, MoE layer {i}")
            assert [rows[s][col] for s in (1, 2)] == [f"{tb[run][tag][s]:.3f}" for s in (1, 2)]
    # exact against what train.main returned (TensorBoard keeps float32: 4 decimals agree either way)
    assert [table(out, "loss")[s][1] for s in (1, 2)] == [f"{h['loss']:.4f}" for h in history_b]
    assert [table(out, "val loss")[s] for s in (1, 2)] == [["-", f"{h['val_loss']:.4f}"] for h in history_b]
    assert table(out, "loss")[1][0] != table(out, "loss")[2][0]  # run A trained
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_runs_errors(tmp_path):
    compare = script("compare-runs", "compare_runs")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        compare.main([str(tmp_path / "a"), str(tmp_path / "b")])
    for name, steps in (("a", [1, 2]), ("b", [3])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps))
    with pytest.raises(ValueError, match="share no logged step"):
        compare.main([str(tmp_path / "a"), str(tmp_path / "b")])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text file (one document) and a jsonl file (a document per line), with the documents in file order."""
    d = tmp_path_factory.mktemp("corpus")
    words = "the quick brown fox jumps over a lazy dog while experts route tokens to layers of mixture models".split()
    docs = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 30)) for i in range(40)]
    (d / "a.txt").write_text("\n".join(docs[:10]))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[10:]))
    return d, ["\n".join(docs[:10])] + docs[10:]


@pytest.mark.parametrize("recipe", RECIPES)
def test_prepare_data(recipe, corpus, tmp_path, capsys):
    import numpy as np
    import sentencepiece as spm

    folder, docs = corpus
    prepare = script("prepare-data", "prepare")
    res = prepare.main(["--recipe", recipe, "--input", str(folder / "a.txt"), str(folder / "b.jsonl"), "--train-sp", "300",
                        "--out", str(tmp_path / "data"), "--val-fraction", "0.1"])
    out = capsys.readouterr().out
    assert "FAIL" not in out and f"train on it: DATA={tmp_path / 'data'} bash recipes/{recipe}/launch.sh" in out, out
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "data/tokenizer.model"))
    # every 10th document (the 10th, 20th, ...) is held out; each document's tokens are sentencepiece's, then eos
    val_idx = [i for i in range(len(docs)) if (i + 1) % 10 == 0]
    expect = {"train": [sp.encode(d) + [sp.eos_id()] for i, d in enumerate(docs) if i not in val_idx],
              "val": [sp.encode(docs[i]) + [sp.eos_id()] for i in val_idx]}
    for split, sub in (("train", ""), ("val", "val")):
        meta = json.loads((tmp_path / "data" / sub / "meta.json").read_text())
        tokens = np.concatenate([np.fromfile(tmp_path / "data" / sub / s, dtype=meta["dtype"]) for s in meta["shards"]])
        assert tokens.tolist() == [t for doc in expect[split] for t in doc], split
    assert res["first_text"] == docs[0] and res["model_vocab"] == 4096

    # a dataset whose vocabulary is bigger than the model's: FAIL, exit status 1
    config = tmp_path / "small.json"
    config.write_text(json.dumps({**json.loads((ROOT / f"recipes/{recipe}/config_tiny.json").read_text()), "vocab_size": 100}))
    with pytest.raises(SystemExit):
        prepare.main(["--recipe", recipe, "--config", str(config), "--input", str(folder / "b.jsonl"), "--sp-model",
                      str(tmp_path / "data/tokenizer.model"), "--out", str(tmp_path / "data2")])
    assert re.search(r"FAIL dataset vocab 300 <= model vocab 100", capsys.readouterr().out)


@pytest.mark.parametrize("suffix,package", [(".jsonl.zst", "zstandard"), (".parquet", "pyarrow")])
def test_prepare_data_optional_formats(suffix, package, tmp_path, monkeypatch):
    """zstd-compressed jsonl and parquet: read when the package is installed (checked against plain jsonl), one
    line naming the package before any work when it is not."""
    from tools import prepare_data

    docs = [f"document {i} " + "moe " * i for i in range(1, 12)]
    path = tmp_path / f"c{suffix}"
    try:
        if package == "zstandard":
            import zstandard

            path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
        else:
            import pyarrow
            import pyarrow.parquet

            pyarrow.parquet.write_table(pyarrow.table({"text": docs}), path)
    except ImportError:
        path.write_bytes(b"not read")
    else:
        plain = tmp_path / "c.jsonl"
        plain.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        assert [t for t, _ in prepare_data.read_documents([path], "text") if t] == docs
        a = prepare_data.main(["--input", str(plain), "--train-sp", "300", "--out", str(tmp_path / "a"), "--val-fraction", "0"])
        b = prepare_data.main(["--input", str(path), "--sp-model", str(tmp_path / "a/tokenizer.model"), "--out", str(tmp_path / "b"),
                               "--val-fraction", "0"])
        assert a["num_tokens"] == b["num_tokens"] and a["shards"] == b["shards"]
        assert all((tmp_path / "a" / s).read_bytes() == (tmp_path / "b" / s).read_bytes() for s in a["shards"])
        monkeypatch.setitem(sys.modules, package, None)  # now as if it were not installed
        monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=f"needs the {package} package, which is not installed: pip install {package}"):
        prepare_data.main(["--input", str(path), "--train-sp", "300", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()  # nothing done
