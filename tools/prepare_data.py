"""Tokenize text / jsonl files into the token shards that core.data.TokenLoader reads.

  python -m tools.prepare_data --default       # demo corpus: this Python's stdlib sources, own 4096-piece tokenizer
  python -m tools.prepare_data --input corpus/ --hf-tokenizer /models/Qwen3-30B-A3B --out data/corpus
  python -m tools.prepare_data --input a.jsonl notes/ --train-sp 32000 --out data/mine
  python -m tools.prepare_data --chat --input chats.jsonl --hf-tokenizer DIR --seq-len 4096 --out data/chat

A .jsonl line is one document (its --jsonl-key field), also in .jsonl.zst (needs `pip install zstandard`); a .parquet
row is one document (its --jsonl-key column; needs `pip install pyarrow`); any other file is one document. --val-fraction of the
documents (evenly spread: every 1/fraction-th) go to a held-out dataset in <out>/val/ instead, which train.py
evaluates (--eval-every) and tools/evaluate.py reads like any dataset. Everything runs
offline: Hugging Face tokenizers are read from a local folder, sentencepiece models from a file or trained here.

--chat: each .jsonl line holds a conversation, {"messages": [{"role": ..., "content": ...}, ...]} (the Hugging
Face chat format), rendered with the tokenizer's chat template (render_conversation). The dataset holds whole
conversations with a loss mask that is on for the assistant's tokens, each assistant turn's end-of-turn token
included (core/data.py format 2: train.py packs whole conversations and masks attention per conversation). A
conversation longer than --seq-len tokens is truncated to its first --seq-len tokens (what lies beyond could never
be trained, since the loader never splits a conversation); one whose assistant tokens all lie beyond, or that has
no assistant turn, is skipped. Both counts are printed. A line without a "messages" list, with an empty one, with
a message that is not {"role": str, "content": str}, or that the template rejects (a role it does not know)
stops the run with one error naming the file and line.
"""

import argparse
import io
import json
import os
import shutil
import sysconfig
import time
from fnmatch import fnmatch
from pathlib import Path

from core.data import load_tokenizer, write_shards
from core.reliability import run_main

# stdlib folders that are tests, demos, generated tables or third-party code rather than ordinary library source
STDLIB_SKIP = {"test", "tests", "idlelib", "turtledemo", "encodings", "pydoc_data", "site-packages", "dist-packages",
               "__pycache__"}


def find_files(inputs: list[str], globs: list[str]) -> list[Path]:
    files = []
    for inp in map(Path, inputs):
        if inp.is_file():
            files.append(inp)  # named explicitly: taken whatever its extension
        elif inp.is_dir():
            # hidden folders (.git, .venv) are never corpus
            files += sorted(p for p in inp.rglob("*") if p.is_file() and any(fnmatch(p.name, g) for g in globs)
                            and not any(part.startswith(".") for part in p.relative_to(inp).parts))
        else:
            raise FileNotFoundError(f"input {inp} does not exist")
    return list(dict.fromkeys(files))  # a file given twice is read once


def stdlib_files(max_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted((p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())  # sorted so every machine builds the same corpus
    files, total = [], 0
    for p in paths:
        total += p.stat().st_size
        if total > max_bytes and files:
            break
        files.append(p)
    return files


def optional_import(module: str, package: str, path: Path):
    """A reader that only some inputs need (not a dependency of the project): one line saying what to install."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(f"reading {path} needs the {package} package, which is not installed: pip install {package}") from None


def read_parquet(path: Path, key: str):
    """Yield (text, bytes consumed) for each row's `key` column (--jsonl-key) of a .parquet file."""
    pq = optional_import("pyarrow.parquet", "pyarrow", path)
    pf = pq.ParquetFile(path)
    if key not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no column {key!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                         "name the text column with --jsonl-key")
    for batch in pf.iter_batches(columns=[key]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path} column {key!r} holds {type(text).__name__}, not text; name the text column with --jsonl-key")
            yield text or "", 0
    yield "", path.stat().st_size  # progress by file: parquet is compressed


def is_jsonl(path: Path) -> bool:
    return path.suffix == ".jsonl" or path.name.endswith(".jsonl.zst")


def read_jsonl(path: Path):
    """Yield (line number, parsed object, bytes consumed) of each non-empty line of a .jsonl or .jsonl.zst file."""
    zst = path.name.endswith(".zst")
    if zst:
        zstandard = optional_import("zstandard", "zstandard", path)
    with open(path, "rb") as raw:
        f = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw)) if zst else raw
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({e.msg}); one JSON object per line") from None
            yield lineno, doc, 0 if zst else len(line)
    if zst:
        yield 0, None, path.stat().st_size  # progress by compressed size


def read_documents(files: list[Path], jsonl_key: str):
    """Yield (text, bytes consumed); bytes drive the progress bar."""
    for path in files:
        if path.name.endswith(".parquet"):
            yield from read_parquet(path, jsonl_key)
        elif is_jsonl(path):
            for lineno, doc, nbytes in read_jsonl(path):
                if doc is None:
                    yield "", nbytes
                    continue
                if not isinstance(doc, dict) or not isinstance(doc.get(jsonl_key), str):
                    raise ValueError(f"{path}:{lineno} has no string field {jsonl_key!r}; name the text field with --jsonl-key")
                yield doc[jsonl_key], nbytes
        else:
            yield path.read_text(encoding="utf-8", errors="replace"), path.stat().st_size


def render_conversation(tok, messages, where: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation through a Hugging Face tokenizer's chat template. The assistant
    spans are found prefix by prefix, which works for any template (return_assistant_tokens_mask needs templates
    with {% generation %} markers): assistant turn i spans from the end of the prompt rendered for it (messages
    before it + the generation prompt) to the end of the conversation rendered up to and including it, minus the
    whitespace that separates turns, so its end-of-turn token is in and the newline after it is not. A template
    that renders a turn differently once later turns follow (Qwen3's gives only the last assistant turn an empty
    <think></think> block) fails that test for the turns before; for those the span is the turn's content, found
    in the whole rendering after the previous span, and the end-of-turn text that follows it (what follows the
    content in the turn's own rendering, or the eos token). Each piece is tokenized on its own (special tokens
    such as <|im_end|> parsed), so the mask falls exactly on token boundaries."""
    if not isinstance(messages, list):
        raise ValueError(f"{where} has no \"messages\" list of {{\"role\", \"content\"}} objects (the Hugging Face chat format)")
    if not messages:
        raise ValueError(f"{where} is an empty conversation (\"messages\": []); remove the line")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {m!r} is not {{\"role\": str, \"content\": str}}")

    def render(msgs, prompt=False):
        try:
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        except Exception as e:  # jinja's raise_exception (an unknown role, a wrong order), or a template bug
            raise ValueError(f"{where}: the chat template rejects this conversation ({type(e).__name__}: {e}); "
                             f"roles used: {', '.join(dict.fromkeys(m['role'] for m in msgs))}") from None

    text, spans = render(messages), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt, turn = render(messages[:i], prompt=True), render(messages[:i + 1]).rstrip()
        lo, hi, after = len(prompt), len(turn), spans[-1][1] if spans else 0
        if not (text.startswith(prompt) and text.startswith(turn) and after <= lo <= hi):
            lo = text.find(m["content"], after) if m["content"] else -1
            if lo < 0:
                raise ValueError(f"{where}: the chat template renders turn {i} differently once later turns follow "
                                 "and does not show its content verbatim, so its assistant tokens cannot be located; "
                                 "use a template that renders each turn the same whatever comes after it")
            hi = lo + len(m["content"])
            end = turn[turn.rfind(m["content"]) + len(m["content"]):]  # the end-of-turn text in its own rendering
            for tail in (end, tok.eos_token or ""):
                if tail and text.startswith(tail, hi):
                    hi += len(tail)
                    break
        spans.append((lo, hi))
    ids, mask, at = [], [], 0
    for lo, hi in spans + [(len(text), len(text))]:
        for piece, trained in ((text[at:lo], 0), (text[lo:hi], 1)):
            if piece:
                piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
                ids += piece_ids
                mask += [trained] * len(piece_ids)
        at = hi
    return ids, mask


def chat_documents(files: list[Path], tok, seq_len: int, counts: dict, bar):
    """Yield (ids, mask) of every conversation of the .jsonl files, after the over-length rule (top of the
    file); counts["truncated"] and counts["skipped"] count what it did."""
    for path in files:
        if not is_jsonl(path):
            raise ValueError(f"--chat reads .jsonl / .jsonl.zst files of conversations, not {path}")
        for lineno, doc, nbytes in read_jsonl(path):
            bar.update(nbytes)
            if doc is None:
                continue
            where = f"{path}:{lineno}"
            if not isinstance(doc, dict) or "messages" not in doc:
                raise ValueError(f"{where} has no \"messages\" field; each line must be {{\"messages\": [{{\"role\": "
                                 "..., \"content\": ...}, ...]}")
            ids, mask = render_conversation(tok, doc["messages"], where)
            if not any(mask[1:seq_len]):  # nothing trained within --seq-len (the first token is never a label)
                counts["skipped"] += 1
                continue
            if len(ids) > seq_len:
                ids, mask = ids[:seq_len], mask[:seq_len]
                counts["truncated"] += 1
            yield ids, mask


def train_sentencepiece(files: list[Path], jsonl_key: str, vocab_size: int, model_path: Path) -> None:
    import sentencepiece as spm

    # sentencepiece learns from lines; it keeps a random sample of them, so training time stays bounded
    lines = (line for text, _ in read_documents(files, jsonl_key) for line in text.split("\n") if line.strip())
    model = io.BytesIO()
    spm.set_random_generator_seed(0)  # the line sample (large inputs) is otherwise different every run
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type="bpe",  # bpe: ~10x faster to train than unigram here
            input_sentence_size=300_000, shuffle_input_sentence=True, num_threads=os.cpu_count(), minloglevel=2,
            byte_fallback=True,  # any byte sequence encodes, nothing becomes <unk>
            # keep text verbatim (code indentation, newlines) so decode(encode(text)) == text
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, user_defined_symbols=["\n"],  # lines never contain \n: add it as one piece
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1)  # eos must exist: it separates packed documents
    except RuntimeError as e:  # e.g. "Vocabulary size too high (N). Please set it to a value <= M."
        raise ValueError(f"sentencepiece cannot train a {vocab_size}-piece vocabulary on this text: "
                         f"{str(e).split('] ')[-1].strip()} (change --train-sp)") from None
    tmp = model_path.with_suffix(".tmp")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, model_path)


class Progress:
    """tqdm if available, else a line every few seconds."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing")
        except ImportError:
            self.bar, self.total, self.done, self.last = None, total, 0, time.time()

    def update(self, n: int):
        if self.bar is not None:
            return self.bar.update(n)
        self.done += n
        if time.time() - self.last > 5:
            print(f"tokenizing: {self.done / 1e6:.1f} / {self.total / 1e6:.1f} MB", flush=True)
            self.last = time.time()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.prepare_data", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", help="text/jsonl/jsonl.zst/parquet files or folders (searched recursively for --glob)")
    p.add_argument("--default", action="store_true", help="demo corpus: the .py files of this Python's standard library")
    p.add_argument("--out", help="output folder (default data/stdlib with --default)")
    p.add_argument("--glob", default="*.txt,*.jsonl,*.jsonl.zst,*.parquet,*.md,*.py", help="comma-separated file patterns for folders")
    p.add_argument("--jsonl-key", default="text", help="field of each .jsonl line that holds the text")
    tok_group = p.add_mutually_exclusive_group()
    tok_group.add_argument("--hf-tokenizer", metavar="DIR", help="local Hugging Face tokenizer folder")
    tok_group.add_argument("--sp-model", metavar="FILE", help="sentencepiece .model file")
    tok_group.add_argument("--train-sp", metavar="VOCAB", type=int, help="train a sentencepiece model of this vocab size")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="size cap of the --default corpus")
    p.add_argument("--shard-tokens", type=int, default=2**26, help="tokens per shard file")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of the documents held out in <out>/val")
    p.add_argument("--force", action="store_true", help="rebuild even if --out already holds this dataset")
    p.add_argument("--chat", action="store_true", help="jsonl lines of conversations ({\"messages\": [...]}) rendered "
                   "with --hf-tokenizer's chat template; loss on the assistant's tokens only")
    p.add_argument("--seq-len", type=int, help="--chat: longest conversation kept whole, in tokens (train with this "
                   "--seq-len or more); longer ones are truncated")
    args = p.parse_args(argv)
    if args.chat and not (args.input and args.hf_tokenizer and args.out and args.seq_len):
        p.error("--chat needs --input FILES, --hf-tokenizer DIR (a tokenizer with a chat template), --seq-len N and --out DIR")
    if args.chat and args.seq_len < 2:
        p.error(f"--seq-len must be >= 2, got {args.seq_len}")
    if not 0 <= args.val_fraction < 1:
        p.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.default == bool(args.input):
        p.error("give either --input PATH ... or --default")
    if args.default:
        args.out = args.out or "data/stdlib"
        if not (args.hf_tokenizer or args.sp_model or args.train_sp):
            args.train_sp = 4096
    elif not args.out:
        p.error("--out DIR is required with --input")
    elif not (args.hf_tokenizer or args.sp_model or args.train_sp):
        p.error("choose a tokenizer: --hf-tokenizer DIR, --sp-model FILE or --train-sp VOCAB")

    out = Path(args.out).resolve()
    sp_path = out / "tokenizer.model"
    if args.hf_tokenizer:
        tok_meta = {"kind": "hf", "path": str(Path(args.hf_tokenizer).resolve())}
    else:
        tok_meta = {"kind": "sentencepiece", "path": str(sp_path if args.train_sp else Path(args.sp_model).resolve())}
    if not Path(tok_meta["path"]).exists() and not args.train_sp:
        raise FileNotFoundError(f"tokenizer {tok_meta['path']} does not exist")

    meta_path = out / "meta.json"
    if args.default and not args.force and meta_path.exists() and Path(tok_meta["path"]).exists():
        meta = json.loads(meta_path.read_text())
        if (meta["tokenizer"] == tok_meta and (not args.train_sp or meta["vocab_size"] == args.train_sp)
                and meta.get("val_fraction", 0.0) == args.val_fraction):
            print(f"{out} is ready: {meta['num_tokens']:,} tokens (use --force to rebuild)")
            return meta

    t0 = time.time()
    files = stdlib_files(args.max_bytes) if args.default else find_files(args.input, args.glob.split(","))
    if not files:
        raise ValueError(f"no input files found in {' '.join(args.input or [])} matching --glob {args.glob}")
    for suffix, module, package in ((".jsonl.zst", "zstandard", "zstandard"), (".parquet", "pyarrow.parquet", "pyarrow")):
        needing = [f for f in files if f.name.endswith(suffix)]
        if needing:  # before any work: a missing reader fails now, not after hours of tokenizing
            optional_import(module, package, needing[0])
    out.mkdir(parents=True, exist_ok=True)
    if args.train_sp:
        print(f"training a {args.train_sp}-piece sentencepiece model on {len(files)} files -> {sp_path}")
        train_sentencepiece(files, args.jsonl_key, args.train_sp, sp_path)
    tok = load_tokenizer({"tokenizer": tok_meta})
    if args.chat:
        return prepare_chat(args, files, tok, tok_meta, out, t0)

    bar = Progress(sum(f.stat().st_size for f in files))

    val_docs = []

    def token_docs():
        i = 0
        for text, nbytes in read_documents(files, args.jsonl_key):
            bar.update(nbytes)
            if text:  # an empty document would be a lone eos
                ids = tok.encode(text)
                if int((i + 1) * args.val_fraction) > int(i * args.val_fraction):  # every 1/fraction-th
                    val_docs.append(ids)
                else:
                    yield ids
                i += 1

    meta = write_shards(token_docs(), out, tok.vocab_size, tok.eos_id, tok_meta, args.shard_tokens,
                        {"val_fraction": args.val_fraction})
    shutil.rmtree(out / "val", ignore_errors=True)
    if val_docs:
        val = write_shards(val_docs, out / "val", tok.vocab_size, tok.eos_id, tok_meta, args.shard_tokens)
        print(f"held out {val['num_documents']:,} documents, {val['num_tokens']:,} tokens -> {out / 'val'}")
    bar.close()
    print(f"{meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens ({meta['dtype']}, "
          f"{len(meta['shards'])} shards) -> {out} in {time.time() - t0:.1f}s")
    return meta


def prepare_chat(args, files: list[Path], tok, tok_meta: dict, out: Path, t0: float) -> dict:
    """--chat: conversations -> a dataset of whole documents with loss masks (+ val/), as main does for text."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_meta["path"], local_files_only=True)
    if not hf.chat_template:
        raise ValueError(f"tokenizer {tok_meta['path']} has no chat template (tokenizer_config.json \"chat_template\" or "
                         "chat_template.jinja); use the instruct model's tokenizer folder")
    bar, counts, val_docs = Progress(sum(f.stat().st_size for f in files)), {"truncated": 0, "skipped": 0}, []

    def docs():
        for i, doc in enumerate(chat_documents(files, hf, args.seq_len, counts, bar)):
            if int((i + 1) * args.val_fraction) > int(i * args.val_fraction):  # every 1/fraction-th
                val_docs.append(doc)
            else:
                yield doc

    # counts is filled while write_shards reads docs(), and its meta.json is written after that: the final counts
    extra = {"val_fraction": args.val_fraction, "kind": "chat", "seq_len": args.seq_len, "conversations": counts}
    meta = write_shards(docs(), out, tok.vocab_size, tok.eos_id, tok_meta, args.shard_tokens, extra, loss_masks=True)
    shutil.rmtree(out / "val", ignore_errors=True)
    if val_docs:
        val = write_shards(val_docs, out / "val", tok.vocab_size, tok.eos_id, tok_meta, args.shard_tokens,
                           {"kind": "chat", "seq_len": args.seq_len}, loss_masks=True)
        print(f"held out {val['num_documents']:,} conversations, {val['num_tokens']:,} tokens -> {out / 'val'}")
    bar.close()
    print(f"{meta['num_documents']:,} conversations, {meta['num_tokens']:,} tokens of which {meta['trained_tokens']:,} "
          f"trained (assistant), longest {meta['max_document_tokens']} -> {out} in {time.time() - t0:.1f}s; "
          f"{counts['truncated']} truncated to --seq-len {args.seq_len}, {counts['skipped']} skipped (nothing to train "
          f"within --seq-len)", flush=True)
    return {**meta, **counts}


if __name__ == "__main__":
    run_main(main)
