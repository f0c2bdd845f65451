"""tools/prepare_data.py at scale: the same bytes for any --workers and equal to sentencepiece run on each document
read here; resumed after SIGKILLs at chosen and at random moments, byte for byte the uninterrupted run; --part I/N
together the single-machine dataset; malformed lines (--skip-bad); refusals before any work; the bounded read-ahead;
the progress line. Text runs with 2 workers and every killed run are subprocesses (started clean, killed as a process
group); the conversations' run with 2 workers forks pytest, which has imported transformers already."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from core.data import TokenLoader
from tools import prepare_data
from tools.prepare_data import main as prepare
from tools.prepare_data import render_conversation

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens to layers of mixture models".split()
UNIT_BYTES, FRACTION = 30_000, 0.05  # ~6 units of the ~160 KB corpus, each 2-4 batches of 8 KB (kill points)


def text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + ("\n" if seed % 3 else "")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(folder, its documents in the order the tool reads them, a sentencepiece model trained on them)."""
    root = tmp_path_factory.mktemp("corpus")
    files = {}
    for i in range(14):  # one document per file, 0.4-6 KB
        files[f"a/{i:02d}.txt"] = text(i, 60 + 70 * (i % 13))
    files["a/empty.txt"] = ""  # no document
    for j in range(6):  # a document per line, blank lines between some
        files[f"b/{j}.jsonl"] = "".join(json.dumps({"text": text(100 * j + k, 10 + k % 50)}) + "\n"
                                        + "\n" * (k % 7 == 0) for k in range(110))
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body)
    docs = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):  # find_files: a folder's files sorted
        if path.suffix == ".jsonl":
            docs += [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
        elif path.read_text():
            docs.append(path.read_text())
    model = tmp_path_factory.mktemp("sp") / "out"
    prepare(["--input", str(root), "--train-sp", "300", "--out", str(model), "--val-fraction", "0", "--workers", "1"])
    return root, docs, model / "tokenizer.model"


def flags(corpus, out, *more) -> list[str]:
    root, _, model = corpus
    return ["--input", str(root), "--sp-model", str(model), "--out", str(out), "--unit-bytes", str(UNIT_BYTES),
            "--batch-bytes", "8000", "--shard-tokens", "3000", "--val-fraction", str(FRACTION), *more]


def run(args: list[str], fault: str = "", **popen) -> subprocess.CompletedProcess | subprocess.Popen:
    """The tool as its own process group (a kill reaches its workers, as a scheduler's does); OMP and the fault
    injection set here, whatever the caller's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", prepare_data.FAULT: fault}
    cmd = [sys.executable, "-m", "tools.prepare_data", *args]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **popen)
    return subprocess.run(cmd, cwd=ROOT, env=env, start_new_session=True, capture_output=True, text=True, timeout=300)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder (a dataset, its records and plan) by relative path; temporary files left by a kill
    are not part of the output."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and ".tmp" not in p.name}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The uninterrupted one-worker run (in this process): its folder and files."""
    out = tmp_path_factory.mktemp("reference") / "data"
    prepare(flags(corpus, out, "--workers", "1"))
    return out, tree(out)


def streams(folder: Path) -> list[list[int]]:
    meta = json.loads((folder / "meta.json").read_text())
    stream = np.concatenate([np.fromfile(folder / s, dtype=meta["dtype"]) for s in meta["shards"]]).tolist()
    docs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == meta["eos_id"]:
            docs.append(cur)
            cur = []
    assert not cur
    return docs


def test_same_bytes_for_any_workers_and_sentencepiece_per_document(corpus, reference):
    """--workers 2 writes the bytes --workers 1 does. The documents are sentencepiece's encoding of each document
    read here, then eos, in input order; within each work unit (consecutive files up to --unit-bytes) every
    1/fraction-th document, counted from the unit's golden-ratio offset, is in val/, which holds each unit's share to
    within one document."""
    import sentencepiece as spm

    root, docs, model = corpus
    out, files = reference
    two = out.parent / "two_workers"
    res = run(flags(corpus, two, "--workers", "2"))
    assert res.returncode == 0, res.stderr
    assert tree(two) == files and len(files) > 10

    sizes, units, first, size = [p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()], [], 0, 0
    docs_per_file = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        docs_per_file.append(sum(bool(line.strip()) for line in lines) if path.suffix == ".jsonl"
                             else int(bool(lines[0])))
    for i, s in enumerate(sizes):  # units: [first, end) file ranges
        if i > first and size + s > UNIT_BYTES:
            units.append((first, i))
            first, size = i, 0
        size += s
    units.append((first, len(sizes)))
    assert len(units) >= 3
    held = []
    for u, (a, b) in enumerate(units):
        offset = (u * (math.sqrt(5) - 1) / 2) % 1.0 / FRACTION
        n = sum(docs_per_file[a:b])
        mine = [math.floor((i + offset + 1) * FRACTION) > math.floor((i + offset) * FRACTION) for i in range(n)]
        assert abs(sum(mine) - FRACTION * n) < 1
        held += mine
    sp = spm.SentencePieceProcessor(model_file=str(model))
    expected = [sp.encode(d) + [sp.eos_id()] for d in docs]
    assert len(held) == len(docs) and sum(held) > 3
    assert streams(out) == [e for e, h in zip(expected, held) if not h]
    assert streams(out / "val") == [e for e, h in zip(expected, held) if h]


def test_resume_after_sigkill_at_chosen_and_random_moments(corpus, reference):
    """SIGKILL (the tool and its workers) in the middle of a unit, then again between val/meta.json and meta.json;
    each rerun of the same command redoes only what was not finished and the last ends with the uninterrupted run's
    bytes. Then three kills at random moments of runs slowed down to last ~0.5 s, a rerun after each: the same."""
    out, files = reference
    resumed = out.parent / "resumed"
    res = run(flags(corpus, resumed, "--workers", "2"), fault="kill@5")  # 5 batches written: inside the 2nd unit
    assert res.returncode == -signal.SIGKILL, res.stderr
    done = {p.stem for p in (resumed / "units").glob("*.json")}
    partial = {p.name.split("_")[1] for p in resumed.glob("tokens_*.bin")} - done
    assert done and partial and not (resumed / "meta.json").exists()  # a unit half written, others finished
    res = run(flags(corpus, resumed, "--workers", "2"), fault="kill@finish")
    assert res.returncode == -signal.SIGKILL and (resumed / "val/meta.json").exists()
    assert not (resumed / "meta.json").exists()
    res = run(flags(corpus, resumed, "--workers", "2"))
    assert res.returncode == 0 and "units done before" in res.stdout, res.stderr
    assert tree(resumed) == files

    rng, again = random.Random(0), out.parent / "random_kills"
    for kill in range(3):  # each after one more unit is done (so inside the run), at a random moment of what follows
        proc = run(flags(corpus, again, "--workers", "2"), fault="pause@0.05", stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while len(list(again.glob("units/*.json"))) <= kill and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))  # >= 3 units (>= 6 batches of >= 0.05 s) to go: inside a unit or at its end
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL and not (again / "meta.json").exists()
    assert run(flags(corpus, again, "--workers", "2")).returncode == 0
    assert tree(again) == files


def test_parts_together_are_the_single_machine_dataset(corpus, reference, capsys):
    """--part 3/3, 1/3, 2/3 into one folder: the first two say which parts are missing, the last writes meta.json;
    the folder then holds the one-machine run's bytes. Units go to parts largest first, each to the lightest part."""
    out, files = reference
    parts = out.parent / "parts"
    assert prepare(flags(corpus, parts, "--part", "3/3", "--workers", "1")) == {"complete": False, "waiting": [1, 2]}
    assert prepare(flags(corpus, parts, "--part", "1/3", "--workers", "1")) == {"complete": False, "waiting": [2]}
    assert "parts 2 of 3 have run" in capsys.readouterr().out
    meta = prepare(flags(corpus, parts, "--part", "2/3", "--workers", "1"))
    assert meta == json.loads((out / "meta.json").read_text()) and tree(parts) == files
    assert TokenLoader(parts, 16, 4).next_batch()[0].shape == (4, 16)
    # largest first to the part with the fewest bytes so far: 9 -> A, 7 -> B, 5 -> B (7 < 9), 4 -> A, 2 -> B (12 < 13)
    assert prepare_data.part_units([4, 9, 2, 7, 5], 2) == [[0, 1], [2, 3, 4]]
    for bad in ("0/3", "4/3", "two"):
        with pytest.raises(SystemExit):
            prepare(flags(corpus, parts, "--part", bad))
    with pytest.raises(SystemExit):  # every part must tokenize alike: no tokenizer trained per part
        prepare(["--input", str(corpus[0]), "--train-sp", "300", "--out", str(parts), "--part", "1/2"])


def test_malformed_lines_stop_or_are_skipped(corpus, tmp_path, capsys):
    """A line that is not JSON, or lacks the text field, stops the run naming its file and line (in a worker too,
    exit status 2 and one `error:` line); --skip-bad counts them, names them and keeps every other document."""
    import sentencepiece as spm

    model = corpus[2]
    path = tmp_path / "c.jsonl"
    good = [text(i, 12) for i in range(6)]
    lines = [json.dumps({"text": good[0]}), json.dumps({"text": good[1]}), "{not json", json.dumps({"text": good[2]}),
             json.dumps({"body": "no text field"}), *(json.dumps({"text": g}) for g in good[3:])]
    path.write_text("\n".join(lines) + "\n")
    args = ["--input", str(path), "--sp-model", str(model), "--val-fraction", "0"]
    with pytest.raises(ValueError, match=f"^{path}:3 is not valid JSON"):
        prepare([*args, "--out", str(tmp_path / "a"), "--workers", "1"])
    res = run([*args, "--out", str(tmp_path / "b"), "--workers", "2"])
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith(f"error: {path}:3 is not valid JSON")
    meta = prepare([*args, "--out", str(tmp_path / "c"), "--workers", "1", "--skip-bad"])
    out = capsys.readouterr().out
    assert meta["bad_lines"] == 2 and "skipped 2 malformed lines (--skip-bad)" in out
    assert f"{path}:3 is not valid JSON" in out and f"{path}:5 has no string field 'text'" in out
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert streams(tmp_path / "c") == [sp.encode(g) + [sp.eos_id()] for g in good]


def test_refusals_before_any_work_and_a_foreign_dataset(corpus, tmp_path):
    """Only empty inputs, or a sentencepiece model without an end-of-text piece, stop in one line before --out is
    made; inputs with no document stop before meta.json; another plan's finished dataset is refused, --force
    rebuilds it."""
    import sentencepiece as spm

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty/a.txt").write_text("")
    with pytest.raises(ValueError, match="input files are all empty"):
        prepare(["--input", str(tmp_path / "empty"), "--sp-model", str(corpus[2]), "--out", str(tmp_path / "o")])
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus[1]), model_prefix=str(tmp_path / "noeos"),
                                   vocab_size=40, eos_id=-1, minloglevel=2)
    with pytest.raises(ValueError, match="has no end-of-text piece"):
        prepare(["--input", str(corpus[0]), "--sp-model", str(tmp_path / "noeos.model"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    with pytest.raises(ValueError, match="the inputs hold no documents"):
        prepare(["--input", str(tmp_path / "blank.jsonl"), "--sp-model", str(corpus[2]), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o/meta.json").exists()
    prepare(flags(corpus, tmp_path / "d", "--workers", "1"))
    with pytest.raises(ValueError, match="holds a dataset made with other val_fraction; .* --force"):
        prepare(flags(corpus, tmp_path / "d", "--workers", "1", "--val-fraction", "0.2"))
    rebuilt = prepare(flags(corpus, tmp_path / "d", "--workers", "1", "--val-fraction", "0.2", "--force"))
    assert rebuilt["val_fraction"] == 0.2


def test_read_ahead_is_bounded_and_results_in_order(corpus):
    """ordered_map with 2 workers has consumed at most 4 x 2 + 2 batches when it yields its first result (memory
    bound: the input is never read ahead further), and yields what one process computes, in order."""
    model = corpus[2]
    consumed = []

    def batches():
        for i in range(40):
            consumed.append(i)
            yield 0, i == 39, 10, [("x.txt", 0, f"batch {i} {text(i, 30)}".encode())]

    encoder_args = ({"kind": "sentencepiece", "path": str(model)}, "text", None, False)
    parallel = prepare_data.ordered_map(batches(), 2, encoder_args)
    first = next(parallel)
    assert len(consumed) <= 10
    got = [first, *parallel]
    serial = list(prepare_data.ordered_map(batches(), 1, encoder_args))
    assert len(got) == len(serial) == 40
    assert all(np.array_equal(a["docs"][0], b["docs"][0]) and a["last"] == b["last"] for a, b in zip(got, serial))


def test_progress_line_and_totals(corpus, tmp_path, capsys, monkeypatch):
    """The progress line (stderr) counts documents and tokens, with tokens/s and an ETA, and ends at the dataset's
    totals (train + val); the final line (stdout) gives the totals and the time."""
    monkeypatch.setitem(prepare_data.PROGRESS_EVERY_S, False, 0.0)  # a line per batch
    meta = prepare(flags(corpus, tmp_path / "p", "--workers", "1"))
    val = json.loads((tmp_path / "p/val/meta.json").read_text())
    captured = capsys.readouterr()
    last = [line for line in captured.err.splitlines() if line.startswith("tokenizing:")][-1]
    docs, tokens = meta["num_documents"] + val["num_documents"], meta["num_tokens"] + val["num_tokens"]
    assert last.startswith(f"tokenizing: {docs:,} documents, {tokens:,} tokens, ") and "tokens/s" in last
    assert "100% of" in last and "ETA 0:00" in last
    assert f"{meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens (uint16, {len(meta['shards'])} shards)" \
        in captured.out and "tokens/s with 1 worker" in captured.out


def test_conversations_over_units_parts_and_workers(tmp_path):
    """--chat over several work units (format 2: documents.bin spans the units): --part 2/2 then 1/2, and --workers 2
    (the chat template in worker processes), write the one-process bytes; the documents are each conversation
    rendered alone (render_conversation), every one once over train and val; a malformed line is skipped."""
    from tests.test_documents import CHATML, hf_tokenizer, write_jsonl
    from tools.chat_demo import conversations

    tok = hf_tokenizer(tmp_path / "tok", CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>")
    chats = conversations([(f"f{i}", "answer " * (i % 5 + 1) + str(i)) for i in range(45)])
    (tmp_path / "c").mkdir()
    for k in range(3):  # ~4 KB each: three units of --unit-bytes 3000
        write_jsonl(tmp_path / f"c/{k}.jsonl", chats[k * 12:(k + 1) * 12] + ["{bad"] * (k == 1) + chats[36:] * (k == 2))
    args = ["--chat", "--input", str(tmp_path / "c"), "--hf-tokenizer", str(tmp_path / "tok"), "--seq-len", "512",
            "--unit-bytes", "3000", "--val-fraction", "0.1", "--skip-bad"]
    meta = prepare([*args, "--out", str(tmp_path / "one"), "--workers", "1"])
    assert meta["bad_lines"] == 1 and json.loads((tmp_path / "one/prepare.json").read_text())["units"] == 3
    assert prepare([*args, "--out", str(tmp_path / "parts"), "--part", "2/2", "--workers", "1"])["complete"] is False
    prepare([*args, "--out", str(tmp_path / "parts"), "--part", "1/2", "--workers", "1"])
    prepare([*args, "--out", str(tmp_path / "two"), "--workers", "2"])  # workers forked from pytest: no imports again
    assert tree(tmp_path / "parts") == tree(tmp_path / "one") == tree(tmp_path / "two")

    def documents(folder):
        m = json.loads((folder / "meta.json").read_text())
        ids = np.concatenate([np.fromfile(folder / s, dtype=m["dtype"]) for s in m["shards"]]).tolist()
        starts = np.fromfile(folder / "documents.bin", dtype="<i8").tolist()
        return [tuple(ids[a:b]) for a, b in zip(starts[:-1], starts[1:])]

    train, val = documents(tmp_path / "one"), documents(tmp_path / "one/val")
    rendered = [tuple(render_conversation(tok, c["messages"], "")[0]) for c in chats[:36] + chats[36:]]
    assert sorted(train + val) == sorted(rendered) and len(val) in (3, 4, 5)  # 45 conversations: ~0.1 per unit
    loader = TokenLoader(tmp_path / "one", 512, 2)
    assert loader.documents and loader.next_batch(documents=True)[0].shape == (2, 512)


def test_skill_checks_once_the_last_part_is_done(corpus, tmp_path, capsys):
    """skills/prepare-data with --part: a part that leaves another to run says so and checks nothing; the last part
    runs the checks on the whole dataset."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_skill", ROOT / "skills/prepare-data/scripts/prepare.py")
    skill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(skill)
    args = ["--recipe", "qwen3_30b_a3b", *flags(corpus, tmp_path / "s", "--workers", "1")]
    assert skill.main([*args, "--part", "1/2"])["meta"] == {"complete": False, "waiting": [2]}
    assert "not checked yet: parts 2 still to run" in capsys.readouterr().out
    res = skill.main([*args, "--part", "2/2"])
    out = capsys.readouterr().out
    assert "FAIL" not in out and "OK   validation split" in out and res["first_text"] == corpus[1][0]
