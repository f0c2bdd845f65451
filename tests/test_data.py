"""Token shards, TokenLoader and tools.prepare_data: format, determinism, dp slices, resume, errors."""

import json

import numpy as np
import pytest
import torch

from core.data import TokenLoader, load_tokenizer
from tools.prepare_data import main as prepare
from tools.shards import write_shards

DUMMY_TOK = {"kind": "sentencepiece", "path": "/nonexistent.model"}


def make_dataset(path, n_tokens=301, shard_tokens=37, vocab=70_000):
    """One document 0..n_tokens-2 (+ eos): stream position p holds token p, so a window shows where it came from."""
    write_shards([list(range(n_tokens - 1))], path, vocab_size=vocab, eos_id=vocab - 1, tokenizer=DUMMY_TOK,
                 shard_tokens=shard_tokens)
    return path


def batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_write_shards_layout_and_dtype(tmp_path):
    meta = write_shards([[5, 6, 7], [8, 9]], tmp_path / "a", vocab_size=1000, eos_id=1, tokenizer=DUMMY_TOK, shard_tokens=4)
    assert meta == json.loads((tmp_path / "a" / "meta.json").read_text())
    assert (meta["dtype"], meta["num_tokens"], meta["num_documents"]) == ("uint16", 7, 2)
    assert meta["shards"] == ["tokens_00000.bin", "tokens_00001.bin"]
    stream = np.concatenate([np.fromfile(tmp_path / "a" / s, dtype="<u2") for s in meta["shards"]])
    assert stream.tolist() == [5, 6, 7, 1, 8, 9, 1]  # packed, eos after each document
    assert not list((tmp_path / "a").glob("*.tmp"))

    meta = write_shards([[65_535, 65_536, 69_999]], tmp_path / "b", vocab_size=70_000, eos_id=0, tokenizer=DUMMY_TOK)
    assert meta["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "b" / meta["shards"][0], dtype="<u4").tolist() == [65_535, 65_536, 69_999, 0]
    assert write_shards([[1]], tmp_path / "c", vocab_size=65_536, eos_id=0, tokenizer=DUMMY_TOK)["dtype"] == "uint16"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_shards([[1, 1000]], tmp_path / "d", vocab_size=1000, eos_id=0, tokenizer=DUMMY_TOK)


def test_windows_labels_and_epoch_coverage(tmp_path):
    seq_len, gb = 10, 5
    loader = TokenLoader(make_dataset(tmp_path), seq_len, gb)  # 301 tokens -> 30 samples, windows straddle shards
    assert loader.num_samples == 30 and loader.meta["num_tokens"] == 301
    stream = torch.arange(301)
    stream[-1] = 69_999  # the eos that ends the document
    starts = []
    for x, y in batches(loader, loader.num_samples // gb):  # exactly one epoch
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (gb, seq_len)
        assert torch.equal(x[:, 1:], y[:, :-1])  # every label is the next input token
        for row_x, row_y in zip(x, y):
            k = int(row_x[0]) // seq_len
            assert torch.equal(torch.cat([row_x, row_y[-1:]]), stream[k * seq_len : (k + 1) * seq_len + 1])
            starts.append(k)
    assert sorted(starts) == list(range(30))  # each window once per epoch
    assert starts != sorted(starts)  # and shuffled


def test_determinism(tmp_path):
    path = make_dataset(tmp_path)
    a = batches(TokenLoader(path, 8, 4, seed=3), 12)
    assert_same(a, batches(TokenLoader(path, 8, 4, seed=3), 12))
    b = batches(TokenLoader(path, 8, 4, seed=4), 12)
    assert any(not torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))


@pytest.mark.parametrize("world", [2, 4])
def test_dp_slices_partition_the_global_batch(tmp_path, world):
    path = make_dataset(tmp_path)
    full = TokenLoader(path, 8, 8, seed=1)
    ranks = [TokenLoader(path, 8, 8, rank=r, world=world, seed=1) for r in range(world)]
    for _ in range(10):  # 37 samples: crosses epoch boundaries too
        x, y = full.next_batch()
        parts = [rk.next_batch() for rk in ranks]
        assert all(px.shape == (8 // world, 8) for px, _ in parts)
        assert torch.equal(torch.cat([px for px, _ in parts]), x) and torch.equal(torch.cat([py for _, py in parts]), y)
        rows = [tuple(row.tolist()) for px, _ in parts for row in px]
        assert len(set(rows)) == len(rows)  # disjoint


def test_resume_across_epoch_boundary(tmp_path):
    path = make_dataset(tmp_path, n_tokens=101)  # 12 samples of seq_len 8, batch 5: epoch ends inside step 2
    ref = TokenLoader(path, 8, 5, seed=7)
    expected = batches(ref, 6)
    first = TokenLoader(path, 8, 5, seed=7)
    batches(first, 2)
    sd = first.state_dict()
    assert sd == {"step": 2, "seed": 7, "seq_len": 8, "global_batch": 5}
    resumed = TokenLoader(path, 8, 5, seed=7)
    resumed.load_state_dict(sd)
    assert_same(batches(resumed, 4), expected[2:])
    # the position is global, so a run may resume on a different number of data-parallel ranks
    sd = {"step": 3, "seed": 7, "seq_len": 8, "global_batch": 6}
    ref6 = TokenLoader(path, 8, 6, seed=7)
    want = batches(ref6, 4)[3]
    halves = []
    for r in range(2):
        rk = TokenLoader(path, 8, 6, rank=r, world=2, seed=7)
        rk.load_state_dict(sd)
        halves.append(rk.next_batch()[0])
    assert torch.equal(torch.cat(halves), want[0])


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*tools\.prepare_data"):
        TokenLoader(tmp_path / "nope", 8, 4)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match=r"meta\.json.*tools\.prepare_data"):
        TokenLoader(tmp_path / "empty_dir", 8, 4)
    write_shards([], tmp_path / "zero", vocab_size=100, eos_id=0, tokenizer=DUMMY_TOK)
    with pytest.raises(ValueError, match=r"has 0 tokens, fewer than one sample of seq_len\+1 = 9"):
        TokenLoader(tmp_path / "zero", 8, 4)
    short = make_dataset(tmp_path / "short", n_tokens=8)
    with pytest.raises(ValueError, match=r"has 8 tokens, fewer than one sample .*shorter --seq-len"):
        TokenLoader(short, 8, 4)
    assert TokenLoader(short, 7, 4).num_samples == 1  # exactly seq_len+1 tokens is enough
    path = make_dataset(tmp_path / "ok")
    with pytest.raises(ValueError, match="not divisible by 3"):
        TokenLoader(path, 8, 4, world=3)
    loader = TokenLoader(path, 8, 4, seed=0)
    for key, bad in [("seed", 1), ("seq_len", 16), ("global_batch", 8)]:
        sd = {**loader.state_dict(), key: bad}
        with pytest.raises(ValueError, match=f"saved with {key}={bad}"):
            loader.load_state_dict(sd)
    with open(path / "tokens_00001.bin", "ab") as f:
        f.write(b"\0")  # half a uint32
    with pytest.raises(ValueError, match="not a whole number"):
        TokenLoader(path, 8, 4)
    (path / "tokens_00001.bin").unlink()
    with pytest.raises(FileNotFoundError, match="tokens_00001.bin"):
        TokenLoader(path, 8, 4)


TEXTS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs!\n" * 20,
    "b.md": "# Notes\n\n  indented *markdown* with ünïcödé, 日本語 and tabs\there.\n" * 20,
    "sub/c.py": "def f(x):\n    return x * 2  # double\n\n\nclass A:\n    pass\n" * 20,
}
JSONL = [{"text": f"record {i}: sphinx of black quartz, judge my vow.", "id": i} for i in range(5)]


def make_corpus(root):
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in JSONL) + "\n\n")
    (root / "skip.bin").write_bytes(b"\xff\xfe not matched by --glob")
    (root / ".git").mkdir()
    (root / ".git" / "x.txt").write_text("hidden folders are not corpus")
    return root


def check_prepared(meta, out, n_docs):
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["num_documents"] == n_docs
    tok = load_tokenizer(meta)
    assert (tok.vocab_size, tok.eos_id) == (meta["vocab_size"], meta["eos_id"])
    for text in [*TEXTS.values(), "Unseen: Zebra ✓ 🙂\n\tend", "a literal <eos> or </s> is text"]:
        assert tok.decode(tok.encode(text)) == text
    # the shards hold the documents in file order (a.txt first), each followed by eos
    stream = np.concatenate([np.fromfile(out / s, dtype=meta["dtype"]) for s in meta["shards"]])
    assert len(stream) == meta["num_tokens"] and (stream == meta["eos_id"]).sum() == n_docs
    assert meta["eos_id"] not in tok.encode("a literal <eos> or </s> is text")
    first = stream[: np.argmax(stream == meta["eos_id"])].tolist()
    assert tok.decode(first) == TEXTS["a.txt"]
    x, y = TokenLoader(out, 16, 4).next_batch()
    assert x.shape == (4, 16) and int(x.max()) < meta["vocab_size"]


def test_prepare_data_trains_sentencepiece(tmp_path):
    corpus, out = make_corpus(tmp_path / "corpus"), tmp_path / "out"
    meta = prepare(["--input", str(corpus), "--train-sp", "400", "--out", str(out), "--shard-tokens", "500"])
    assert meta["vocab_size"] == 400 and meta["tokenizer"]["path"] == str(out / "tokenizer.model")
    assert len(meta["shards"]) > 1
    check_prepared(meta, out, n_docs=len(TEXTS) + len(JSONL))
    # an existing model is reused with --sp-model; explicit files are taken whatever their extension
    meta2 = prepare(["--input", str(corpus / "a.txt"), str(corpus / "skip.bin"), "--sp-model", str(out / "tokenizer.model"),
                     "--out", str(tmp_path / "out2")])
    assert meta2["num_documents"] == 2 and meta2["tokenizer"] == meta["tokenizer"]


def test_prepare_data_holds_out_a_validation_split(tmp_path):
    """--val-fraction 0.25: every 4th document goes to <out>/val, a dataset of its own with the same tokenizer;
    together the two hold every document exactly once."""
    corpus = make_corpus(tmp_path / "corpus")
    whole = prepare(["--input", str(corpus), "--train-sp", "400", "--out", str(tmp_path / "whole"), "--val-fraction", "0"])
    assert not (tmp_path / "whole/val").exists()
    meta = prepare(["--input", str(corpus), "--sp-model", str(tmp_path / "whole/tokenizer.model"),
                    "--out", str(tmp_path / "split"), "--val-fraction", "0.25"])
    val = json.loads((tmp_path / "split/val/meta.json").read_text())
    n = whole["num_documents"]
    assert val["num_documents"] == n // 4 and meta["num_documents"] == n - n // 4
    assert val["tokenizer"] == meta["tokenizer"] and val["vocab_size"] == meta["vocab_size"]

    def docs(folder, m):  # the documents of a dataset, as token tuples
        stream = np.concatenate([np.fromfile(folder / s, dtype=m["dtype"]) for s in m["shards"]]).tolist()
        out, cur = [], []
        for t in stream:
            if t == m["eos_id"]:
                out.append(tuple(cur))
                cur = []
            else:
                cur.append(t)
        return out

    everything = docs(tmp_path / "whole", whole)
    held_out = docs(tmp_path / "split/val", val)
    assert held_out == everything[3::4] and sorted(docs(tmp_path / "split", meta) + held_out) == sorted(everything)
    assert TokenLoader(tmp_path / "split/val", 8, 2).next_batch()[0].shape == (2, 8)


def test_prepare_data_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    # a tiny byte-level BPE tokenizer built here: no download
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(TEXTS.values(), tokenizers.trainers.BpeTrainer(vocab_size=350, special_tokens=["<eos>"],
                                                                           initial_alphabet=alphabet))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(tmp_path / "hf")
    corpus, out = make_corpus(tmp_path / "corpus"), tmp_path / "out"
    meta = prepare(["--input", str(corpus), "--hf-tokenizer", str(tmp_path / "hf"), "--out", str(out), "--glob", "*.txt,*.py"])
    assert meta["tokenizer"] == {"kind": "hf", "path": str(tmp_path / "hf")} and meta["dtype"] == "uint16"
    check_prepared(meta, out, n_docs=2)


def test_prepare_data_default_is_cached(tmp_path, capsys):
    out = tmp_path / "stdlib"
    args = ["--default", "--out", str(out), "--max-bytes", "300000", "--train-sp", "600"]
    meta = prepare(args)
    assert meta["num_documents"] > 5 and meta["vocab_size"] == 600
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert prepare(args) == meta and "is ready" in capsys.readouterr().out
    assert (out / "meta.json").stat().st_mtime_ns == mtime


def test_prepare_data_errors(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="no input files found"):
        prepare(["--input", str(tmp_path / "nothing"), "--train-sp", "300", "--out", str(tmp_path / "o")])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(["--input", str(tmp_path / "missing.txt"), "--train-sp", "300", "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="no string field 'body'"):
        prepare(["--input", str(corpus / "d.jsonl"), "--train-sp", "300", "--jsonl-key", "body",
                 "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="cannot train a 100000-piece vocabulary"):
        prepare(["--input", str(corpus), "--train-sp", "100000", "--out", str(tmp_path / "o")])
    for bad in (["--sp-model", "m.model", "--train-sp", "300"], []):  # both / neither tokenizer option
        with pytest.raises(SystemExit):
            prepare(["--input", str(corpus), "--out", str(tmp_path / "o"), *bad])
