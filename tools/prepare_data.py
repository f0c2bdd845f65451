"""Tokenize text / jsonl / parquet files into the token shards that core.data.TokenLoader reads, in parallel.

  python -m tools.prepare_data --default       # demo corpus: this Python's stdlib sources, own 4096-piece tokenizer
  python -m tools.prepare_data --input corpus/ --hf-tokenizer /models/Qwen3-30B-A3B --out data/corpus
  python -m tools.prepare_data --input a.jsonl notes/ --train-sp 32000 --out data/mine
  python -m tools.prepare_data --chat --input chats.jsonl --hf-tokenizer DIR --seq-len 4096 --out data/chat
  python -m tools.prepare_data --input corpus/ --sp-model m.model --out data/c --part 3/8   # one of 8 machines

Inputs. A .jsonl line is one document (its --jsonl-key field), also in .jsonl.zst (needs `pip install zstandard`); a
.parquet row is one document (its --jsonl-key column; needs `pip install pyarrow`); any other file is one document.
Everything runs offline: Hugging Face tokenizers are read from a local folder, sentencepiece models from a file or
trained here.

Parallel and deterministic. The input files, in order, are grouped into work units of about --unit-bytes (a bigger
file is a unit of its own). The main process reads each unit's documents in order and hands them in batches to
--workers processes (`encode_batch`: JSON parsing, chat templates, tokenizing; a fast tokenizer encodes a batch in
one call), then appends the results in order to the unit's shards, tokens_<unit>_<k>.bin. Every 1/--val-fraction-th
document of a unit (`held_out`) goes to the held-out dataset <out>/val/ instead, which train.py evaluates and
tools/evaluate.py reads like any dataset. So the output, split included, is byte-identical for any --workers and
--part. Memory stays bounded whatever the input's size: the main process holds at most 4 x --workers + 2 batches in
flight (each --batch-bytes of input, 64 KB, or one document if longer), one parquet row group's text column (as the
file was written) and the file list; a worker holds one batch. No file is read whole but a plain text file, which is
one document.
Shapes: D documents of a batch, N their tokens.

Resumable. A unit is done when units/<unit>.json lands (an atomic rename, after its shards are written); meta.json,
written last, makes the folder a dataset. A run killed at any moment (SIGKILL included) and started again with the
same command redoes only the units without a record and ends with the same bytes as an uninterrupted run; a finished
dataset is not rebuilt (--force does that). prepare.json fingerprints the inputs (paths, sizes, modification
times), the tokenizer's files and the flags that shape the output: a run whose fingerprint differs stops with one
line instead of mixing two datasets.

Many machines. --part I/N (1 <= I <= N) takes the units a largest-first greedy balance gives part I (each unit to
the part with the fewest bytes so far), into the same --out on a shared filesystem. Every part writes the same plan,
its units' shards and their records; the part that finds every unit done (usually the last to finish) writes
meta.json, so the N parts together are the single-machine dataset, byte for byte, with no final step; a Slurm array
runs them (skills/prepare-data/SKILL.md). Without a shared filesystem: copy the parts' folders into one and rerun
the command without --part (it only writes meta.json).

Bad input. A malformed line (not JSON, no --jsonl-key string, with --chat a bad conversation) stops the run with one
error naming the file and line; --skip-bad counts such lines, names the first few at the end and goes on. No input
files, only empty ones, or a tokenizer without an end-of-text token stop in one line before any work.

--chat: each .jsonl line holds a conversation, {"messages": [{"role": ..., "content": ...}, ...]} (the Hugging
Face chat format), rendered with the tokenizer's chat template (render_conversation). The dataset holds whole
conversations with a loss mask that is on for the assistant's tokens, each assistant turn's end-of-turn token
included (core/shards.py format 2: train.py packs whole conversations and masks attention per conversation). A
conversation longer than --seq-len tokens is truncated to its first --seq-len tokens (what lies beyond could never
be trained, since the loader never splits a conversation); one whose assistant tokens all lie beyond, or that has
no assistant turn, is skipped. Both counts are printed. A line without a "messages" list, with an empty one, with
a message that is not {"role": str, "content": str}, or that the template rejects (a role it does not know) is a
malformed line.
"""

import argparse
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import signal
import sys
import sysconfig
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from fnmatch import fnmatch
from itertools import chain
from pathlib import Path

import numpy as np

from core.shards import load_tokenizer
from tools.shards import ShardWriter, token_array, write_atomic, write_meta

# stdlib folders that are tests, demos, generated tables or third-party code rather than ordinary library source
STDLIB_SKIP = {"test", "tests", "idlelib", "turtledemo", "encodings", "pydoc_data", "site-packages", "dist-packages",
               "__pycache__"}
SHOWN_BAD_LINES = 5  # --skip-bad: the first few are named at the end, the rest counted
PROGRESS_EVERY_S = {True: 0.5, False: 30.0}  # the progress line: redrawn on a terminal, a new line in a log
FAULT = "MOE_TRAIN_PREPARE_FAULT"  # tests only: inject_fault


class BadLine(ValueError):
    """A malformed input line: stops the run, or is counted and skipped with --skip-bad."""


# ------------------------------------------------------------------------------------------ inputs


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
    paths = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in STDLIB_SKIP]  # never walked (site-packages is large)
        paths += [Path(folder, n) for n in names if n.endswith(".py")]
    paths.sort(key=lambda p: p.relative_to(root).as_posix())  # sorted so every machine builds the same corpus
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


def is_jsonl(path: Path) -> bool:
    return path.suffix == ".jsonl" or path.name.endswith(".jsonl.zst")


def read_raw(path: Path, key: str):
    """Yield (line or row number, raw document or None, input bytes consumed) through a file, streaming: a .jsonl
    (.zst) line as bytes (None: blank), a .parquet row's `key` column as text, any other file whole as bytes."""
    if path.name.endswith(".parquet"):
        pa = optional_import("pyarrow", "pyarrow", path)
        pa.set_memory_pool(pa.system_memory_pool())  # freed buffers go back (arrow's default pool keeps them)
        pf = optional_import("pyarrow.parquet", "pyarrow", path).ParquetFile(path)
        if key not in pf.schema_arrow.names:
            raise ValueError(f"{path} has no column {key!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                             "name the text column with --jsonl-key")
        row, per_row = 0, path.stat().st_size / max(1, pf.metadata.num_rows)  # progress: compressed bytes per row
        for group in range(pf.num_row_groups):  # one row group's column in memory (iter_batches reads further ahead)
            column = pf.read_row_group(group, columns=[key], use_threads=False).column(0)
            for first in range(0, len(column), 1024):  # as Python strings, 1024 rows at a time
                for text in column.slice(first, 1024).to_pylist():
                    if text is not None and not isinstance(text, str):
                        raise ValueError(f"{path} column {key!r} holds {type(text).__name__}, not text; name the "
                                         "text column with --jsonl-key")
                    row += 1
                    yield row, text or None, int(row * per_row) - int((row - 1) * per_row)
    elif is_jsonl(path):
        with open(path, "rb") as raw:
            zst = path.name.endswith(".zst")
            zstd = optional_import("zstandard", "zstandard", path) if zst else None
            f = io.BufferedReader(zstd.ZstdDecompressor().stream_reader(raw)) if zst else raw  # streamed, not read whole
            done = 0
            for lineno, line in enumerate(f, 1):
                at = raw.tell() if zst else done + len(line)  # progress: compressed bytes read so far
                yield lineno, line if line.strip() else None, at - done
                done = at
    else:
        yield 0, path.read_bytes() or None, path.stat().st_size


def json_line(path, lineno: int, raw: bytes):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadLine(f"{path}:{lineno} is not valid JSON ({getattr(e, 'msg', e)}); one JSON object per line") from None


def document_text(path: str, lineno: int, raw, key: str) -> str:
    if isinstance(raw, str):  # a parquet row's text
        return raw
    if not is_jsonl(Path(path)):
        return raw.decode("utf-8", errors="replace")
    doc = json_line(path, lineno, raw)
    if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
        raise BadLine(f"{path}:{lineno} has no string field {key!r}; name the text field with --jsonl-key")
    return doc[key]


def read_documents(files: list[Path], key: str, skip_bad: bool = False):
    """Yield (text, input bytes consumed) of every document, in this process (sentencepiece training reads these)."""
    for path in files:
        for lineno, raw, nbytes in read_raw(path, key):
            try:
                yield ("" if raw is None else document_text(str(path), lineno, raw, key)), nbytes
            except BadLine:
                if not skip_bad:
                    raise
                yield "", nbytes


def held_out(unit: int, first: int, n: int, fraction: float) -> np.ndarray:
    """Which of a unit's documents first .. first+n-1 go to val/: every 1/fraction-th, counted from an offset of the
    unit's own (golden-ratio steps; unit 0: none, so a one-unit corpus holds out its 1/f-th, 2/f-th, ... documents).
    Each unit holds out its share to within one document, by its documents alone: the same for any --workers, --part."""
    if fraction == 0:
        return np.zeros(n, dtype=bool)
    x = np.arange(first, first + n) + (unit * 0.6180339887498949 % 1.0) / fraction
    return np.floor((x + 1) * fraction) > np.floor(x * fraction)


# ------------------------------------------------------------------------------------------ conversations


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


def conversation(tok, path: str, lineno: int, raw: bytes) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one .jsonl line of --chat; a BadLine names the file and line."""
    where = f"{path}:{lineno}"
    doc = json_line(path, lineno, raw)
    if not isinstance(doc, dict) or "messages" not in doc:
        raise BadLine(f"{where} has no \"messages\" field; each line must be {{\"messages\": [{{\"role\": "
                      "..., \"content\": ...}, ...]}")
    try:
        ids, mask = render_conversation(tok, doc["messages"], where)
    except ValueError as e:
        raise BadLine(str(e)) from None
    return ids, mask


# ------------------------------------------------------------------------------------------ workers


class Encoder:
    """What a worker holds (the tokenizer, the flags that shape documents) and does to a batch (encode_batch)."""

    def __init__(self, tok_meta: dict, jsonl_key: str, seq_len: int | None, skip_bad: bool):
        self.tok = load_tokenizer({"tokenizer": tok_meta})
        self.key, self.seq_len, self.skip_bad = jsonl_key, seq_len, skip_bad
        if seq_len:  # --chat: the chat template renders each conversation
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(tok_meta["path"], local_files_only=True)

    def __call__(self, batch: tuple) -> dict:
        """(unit, last, input bytes, [(path, line, raw document)]) -> the batch's documents in order, "docs": (ids [N]
        in the shards' dtype, lengths, loss mask [N] or None), the counts and the bad lines."""
        unit, last, nbytes, items = batch
        out = {"unit": unit, "last": last, "bytes": nbytes, "bad": [], "truncated": 0, "skipped": 0}
        docs, texts = [], []  # ids (+eos), or (ids, mask) with --chat
        for path, lineno, raw in items:
            try:
                if not self.seq_len:
                    texts.append(document_text(path, lineno, raw, self.key))
                    continue
                ids, mask = conversation(self.hf, path, lineno, raw)
            except BadLine as e:
                if not self.skip_bad:
                    raise
                out["bad"].append(str(e))
                continue
            if not any(mask[1:self.seq_len]):  # nothing trained within --seq-len (the first token is never a label)
                out["skipped"] += 1
                continue
            out["truncated"] += len(ids) > self.seq_len
            docs.append((ids[:self.seq_len], mask[:self.seq_len]))
        texts = [t for t in texts if t]  # an empty document would be a lone eos
        docs += [ids + [self.tok.eos_id] for ids in (self.tok.encode_batch(texts) if texts else [])]
        ids = [d[0] for d in docs] if self.seq_len else docs  # flat arrays: cheap to send
        out["docs"] = (token_array(list(chain.from_iterable(ids)), self.tok.vocab_size),
                       np.array([len(d) for d in ids], np.int64),
                       np.array(list(chain.from_iterable(d[1] for d in docs)), np.uint8) if self.seq_len else None)
        return out


ENCODER: Encoder | None = None  # this process's, set by start_worker


def start_worker(encoder_args: tuple, child: bool) -> None:
    global ENCODER
    if child:  # one thread per worker: --workers sets the parallelism (a fast tokenizer would start its own)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process stops the pool
    ENCODER = Encoder(*encoder_args)


def encode_batch(batch: tuple) -> dict:
    return ENCODER(batch)


def ordered_map(batches, workers: int, encoder_args: tuple):
    """encode_batch over the batches, results in order, with at most 4 x workers + 2 batches in flight (a pool's
    map would read the whole input ahead). One worker: in this process. A worker that dies (out of memory) fails
    the run (BrokenProcessPool) instead of hanging it."""
    if workers == 1:
        start_worker(encoder_args, child=False)
        yield from map(encode_batch, batches)
        return
    start = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"  # fork: no imports again
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context(start), start_worker, (encoder_args, True))
    try:
        pending = deque()
        for batch in batches:
            pending.append(pool.submit(encode_batch, batch))
            if len(pending) >= 4 * workers + 2:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)  # on an error: the batches started finish, the rest never start


# ------------------------------------------------------------------------------------------ units and parts


def group_units(sizes: list[int], unit_bytes: int) -> list[tuple[int, int]]:
    """[first, end) file ranges: consecutive files while they stay within unit_bytes (a bigger file alone)."""
    units, first, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > first and total + size > unit_bytes:
            units.append((first, i))
            first, total = i, 0
        total += size
    return units + [(first, len(sizes))] if sizes else []


def part_units(unit_sizes: list[int], parts: int) -> list[list[int]]:
    """The units of each part: largest first, each to the part with the fewest bytes so far (the lowest on ties)."""
    load, owned = [0] * parts, [[] for _ in range(parts)]
    for u in sorted(range(len(unit_sizes)), key=lambda u: (-unit_sizes[u], u)):
        p = min(range(parts), key=lambda p: (load[p], p))
        load[p] += unit_sizes[u]
        owned[p].append(u)
    return [sorted(o) for o in owned]


def batches(files: list[Path], units: list[tuple[int, int]], todo: list[int], key: str, batch_bytes: int):
    """(unit, last, input bytes, [(path, line, raw document)]) in input order: each unit's documents in batches of
    about batch_bytes, its last batch (maybe empty) flagged."""
    for u in todo:
        items, size, nbytes = [], 0, 0
        for path in files[units[u][0]:units[u][1]]:
            for lineno, raw, n in read_raw(path, key):
                nbytes += n
                if raw is not None:
                    items.append((str(path), lineno, raw))
                    size += len(raw)
                if size >= batch_bytes:
                    yield u, False, nbytes, items
                    items, size, nbytes = [], 0, 0
        yield u, True, nbytes, items


class Progress:
    """documents, tokens, tokens/s and ETA on stderr: in place on a terminal, else a line every 30 s (logs)."""

    def __init__(self, total_bytes: int):
        self.total, self.bytes, self.docs, self.tokens = total_bytes, 0, 0, 0
        self.tty, self.t0 = sys.stderr.isatty(), time.time()
        self.shown, self.width = self.t0, 0  # the first line after the first interval

    def update(self, res: dict) -> None:
        self.bytes += res["bytes"]
        self.docs += len(res["docs"][1])
        self.tokens += len(res["docs"][0])
        now = time.time()
        if now - self.shown < PROGRESS_EVERY_S[self.tty]:
            return
        self.shown, seconds = now, now - self.t0
        eta = (self.total - self.bytes) * seconds / max(self.bytes, 1)
        line = (f"tokenizing: {self.docs:,} documents, {self.tokens:,} tokens, {self.tokens / seconds:,.0f} tokens/s, "
                f"{100 * self.bytes / max(self.total, 1):.0f}% of {self.total / 1e6:,.1f} MB, "
                f"ETA {eta // 60:.0f}:{eta % 60:02.0f}")
        print("\r" + line.ljust(self.width) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)
        self.width = len(line)  # the next redraw covers this one

    def close(self) -> None:
        if self.tty and self.shown > self.t0:
            print(file=sys.stderr)


def inject_fault(point: str) -> None:
    """Tests only ($MOE_TRAIN_PREPARE_FAULT, comma-separated): kill@POINT SIGKILLs this run, its workers included (as
    a scheduler kills a job) at POINT, the number of batches written or `finish`; pause@S sleeps S seconds after
    each batch, so that a kill at a random moment lands inside the run."""
    for fault in os.environ.get(FAULT, "").split(","):
        if fault == f"kill@{point}":
            if os.getpgrp() == os.getpid():  # a process group of its own (a job): the workers too
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.startswith("pause@") and point.isdigit():
            time.sleep(float(fault[len("pause@"):]))


# ------------------------------------------------------------------------------------------ the output folder


def tokenizer_fingerprint(tok_meta: dict, train_sp: int | None) -> dict:
    """What identifies the tokenizer: its files' hash (a Hugging Face folder: the tokenizer's files only)."""
    if train_sp:
        return {"train_sp": train_sp}  # trained here, from the inputs the plan already holds
    path = Path(tok_meta["path"])
    names = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and p.name.startswith(names))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    return {**tok_meta, "sha256": digest.hexdigest()[:16]}


def unit_record(out: Path, u: int, key: str, loss_masks: bool) -> dict | None:
    """The record of a unit done under this plan (None: to do), with its documents' lengths for format 2."""
    path = out / "units" / f"{u:05d}.json"
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if record.get("plan") != key:
        return None
    for split in ("train", "val") if loss_masks else ():
        record[split]["lengths"] = np.fromfile(out / "units" / f"{u:05d}.{split}.bin", dtype="<i8")
    return record


def commit_unit(out: Path, u: int, key: str, writers: tuple, counts: dict) -> None:
    """Close the unit's shards, then its record: the unit is done once the record lands (atomic rename)."""
    record = {"plan": key, **counts}
    for split, writer in zip(("train", "val"), writers):
        record[split] = writer.close()
        lengths = record[split].pop("lengths", None)
        if lengths is not None:
            write_atomic(out / "units" / f"{u:05d}.{split}.bin", lengths.astype("<i8").tobytes())
    write_atomic(out / "units" / f"{u:05d}.json", json.dumps(record).encode())


def remove_outputs(out: Path, units: list[int] | None) -> None:
    """meta.json first (the folder must not look complete), then the given units' shards and records (None: all)."""
    for folder in (out, out / "val"):
        for name in ("meta.json", "documents.bin"):
            (folder / name).unlink(missing_ok=True)
    for folder in (out, out / "val", out / "units"):
        for name in os.listdir(folder) if folder.is_dir() else []:  # tokens_U_K.bin, mask_U_K.bin, units/U.json, ...
            if folder.name == "units" or name.startswith(("tokens_", "mask_")):
                owner = name.split(".")[0] if folder.name == "units" else name.split("_")[1]
                if units is None or (owner.isdigit() and int(owner) in units):
                    (folder / name).unlink(missing_ok=True)


def open_plan(out: Path, plan: dict, force: bool, mine: list[int] | None) -> bool:
    """Check out against the plan and write it; True if the dataset is already complete. --force removes this run's
    units (mine; None: all) and meta.json; a dataset or a finished unit of another plan stops the run with one line
    (without --part, a run that stopped before finishing a unit left nothing to keep: replaced; a part never
    replaces what another part may be writing)."""
    old = json.loads((out / "prepare.json").read_text()) if (out / "prepare.json").is_file() else None
    units = list((out / "units").glob("*.json")) if (out / "units").is_dir() else []
    kept = (out / "meta.json").exists() or any(json.loads(u.read_text()).get("plan") == (old or {}).get("key")
                                                for u in units)
    if force or (old is not None and old["key"] != plan["key"] and not kept and mine is None):
        remove_outputs(out, set(mine) if force and mine is not None else None)
    elif old is None and kept:
        raise ValueError(f"{out} holds a dataset without prepare.json (an earlier tools.prepare_data, or another "
                         "tool): pass --force to replace it, or choose another --out")
    elif old is not None and old["key"] != plan["key"]:
        differ = [k for k in plan if k != "key" and old.get(k) != plan[k]]
        raise ValueError(f"{out} holds a dataset made with other {', '.join(differ)}; rerun with the same inputs and "
                         "flags to finish it, pass --force to rebuild it, or choose another --out")
    elif (out / "meta.json").exists():
        return True
    (out / "units").mkdir(parents=True, exist_ok=True)
    write_atomic(out / "prepare.json", json.dumps(plan, indent=1).encode())
    return False


def finish(out: Path, n_units: int, key: str, tok, tok_meta: dict, args) -> tuple[dict, list[str]] | None:
    """meta.json of val/ and of the dataset from the units' records, if every unit is done under this plan (else
    None); returns the meta and the first bad lines skipped."""
    records = [unit_record(out, u, key, args.chat) for u in range(n_units)]
    if any(r is None for r in records):
        return None
    total = {name: sum(r[name] for r in records) for name in ("bad_lines", "truncated", "skipped")}
    if not sum(r["train"]["num_documents"] + r["val"]["num_documents"] for r in records):
        raise ValueError(f"the inputs hold no documents (only blank lines, empty texts, {total['bad_lines']} bad "
                         f"lines or {total['skipped']} conversations with nothing to train); nothing written to {out}")
    for split, folder in (("val", out / "val"), ("train", out)):  # another plan's shards are not listed: removed
        keep = {n for r in records for n in r[split]["shards"] + r[split].get("masks", [])}
        for name in os.listdir(folder) if folder.is_dir() else []:
            if name.startswith(("tokens_", "mask_")) and name not in keep:
                (folder / name).unlink(missing_ok=True)
    extra = {"val_fraction": args.val_fraction, **({"bad_lines": total["bad_lines"]} if args.skip_bad or
                                                    total["bad_lines"] else {})}
    val_extra = {"kind": "chat", "seq_len": args.seq_len} if args.chat else {}
    if args.chat:
        extra.update(val_extra, conversations={"truncated": total["truncated"], "skipped": total["skipped"]})
    if sum(r["val"]["num_documents"] for r in records):
        write_meta(out / "val", [r["val"] for r in records], tok.vocab_size, tok.eos_id, tok_meta, val_extra, args.chat)
    else:
        shutil.rmtree(out / "val", ignore_errors=True)
    inject_fault("finish")
    meta = write_meta(out, [r["train"] for r in records], tok.vocab_size, tok.eos_id, tok_meta, extra, args.chat)
    return meta, [e for r in records for e in r["bad"]][:SHOWN_BAD_LINES]


# ------------------------------------------------------------------------------------------ main


def train_sentencepiece(files: list[Path], jsonl_key: str, vocab_size: int, model_path: Path, skip_bad: bool) -> None:
    import sentencepiece as spm

    # sentencepiece learns from lines; it keeps a random sample of them, so training time stays bounded
    lines = (line for text, _ in read_documents(files, jsonl_key, skip_bad) for line in text.split("\n") if line.strip())
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
    write_atomic(model_path, model.getvalue())


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tools.prepare_data", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", help="text/jsonl/jsonl.zst/parquet files or folders (searched recursively for --glob)")
    p.add_argument("--default", action="store_true", help="demo corpus: the .py files of this Python's standard library")
    p.add_argument("--out", help="output folder (default data/stdlib with --default)")
    p.add_argument("--glob", default="*.txt,*.jsonl,*.jsonl.zst,*.parquet,*.md,*.py", help="comma-separated file patterns for folders")
    p.add_argument("--jsonl-key", default="text", help="field of each .jsonl line (column of a .parquet) that holds the text")
    tok_group = p.add_mutually_exclusive_group()
    tok_group.add_argument("--hf-tokenizer", metavar="DIR", help="local Hugging Face tokenizer folder")
    tok_group.add_argument("--sp-model", metavar="FILE", help="sentencepiece .model file")
    tok_group.add_argument("--train-sp", metavar="VOCAB", type=int, help="train a sentencepiece model of this vocab size")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="size cap of the --default corpus")
    p.add_argument("--shard-tokens", type=int, default=2**26, help="tokens per shard file, at most")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of the documents held out in <out>/val")
    p.add_argument("--force", action="store_true", help="rebuild even if --out already holds this dataset (or part)")
    p.add_argument("--chat", action="store_true", help="jsonl lines of conversations ({\"messages\": [...]}) rendered "
                   "with --hf-tokenizer's chat template; loss on the assistant's tokens only")
    p.add_argument("--seq-len", type=int, help="--chat: longest conversation kept whole, in tokens (train with this "
                   "--seq-len or more); longer ones are truncated")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count(), help="tokenizing processes (default: this machine's cores; 1: in this process)")
    p.add_argument("--part", metavar="I/N", help="this machine's share of the work units, 1 <= I <= N (a Slurm array "
                   "task: --part $SLURM_ARRAY_TASK_ID/N with --array=1-N); the same --out for every part")
    p.add_argument("--unit-bytes", type=int, default=2**28, help="input bytes per work unit (the resume and --part "
                   "granularity; a bigger file is one unit)")
    p.add_argument("--batch-bytes", type=int, default=2**16, help="input bytes per batch handed to a worker (small: even "
                   "ends and little memory; big: less to send per byte)")
    p.add_argument("--skip-bad", action="store_true", help="count malformed lines, name the first few at the end, "
                   "go on (default: stop at the first, naming its file and line)")
    args = p.parse_args(argv)
    if args.chat and not (args.input and args.hf_tokenizer and args.out and args.seq_len):
        p.error("--chat needs --input FILES, --hf-tokenizer DIR (a tokenizer with a chat template), --seq-len N and --out DIR")
    if args.chat and args.seq_len < 2:
        p.error(f"--seq-len must be >= 2, got {args.seq_len}")
    if not 0 <= args.val_fraction < 1:
        p.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if min(args.workers, args.shard_tokens, args.unit_bytes, args.batch_bytes) < 1:
        p.error("--workers, --shard-tokens, --unit-bytes and --batch-bytes must be >= 1")
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
    args.part_index, args.parts = 0, 1
    if args.part:
        i, _, n = args.part.partition("/")
        if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
            p.error(f"--part takes I/N with 1 <= I <= N (e.g. 3/8), got {args.part}")
        args.part_index, args.parts = int(i) - 1, int(n)
        if args.train_sp:
            p.error("--part needs a tokenizer every part shares: train it once (a run with --train-sp, or "
                    "--max-bytes of the corpus) and pass --sp-model FILE or --hf-tokenizer DIR")
    return args


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    out = Path(args.out).resolve()
    sp_path = out / "tokenizer.model"
    if args.hf_tokenizer:
        tok_meta = {"kind": "hf", "path": str(Path(args.hf_tokenizer).resolve())}
    else:
        tok_meta = {"kind": "sentencepiece", "path": str(sp_path if args.train_sp else Path(args.sp_model).resolve())}
    if not Path(tok_meta["path"]).exists() and not args.train_sp:
        raise FileNotFoundError(f"tokenizer {tok_meta['path']} does not exist")

    # ---- the plan: files, units, fingerprint; every check before any work
    files = stdlib_files(args.max_bytes) if args.default else find_files(args.input, args.glob.split(","))
    if not files:
        raise ValueError(f"no input files found in {' '.join(args.input or [])} matching --glob {args.glob}")
    stats = [f.stat() for f in files]
    if not sum(s.st_size for s in stats):
        raise ValueError(f"the {len(files)} input files are all empty ({files[0]}, ...); nothing to tokenize")
    for suffix, module, package in ((".jsonl.zst", "zstandard", "zstandard"), (".parquet", "pyarrow.parquet", "pyarrow")):
        needing = [f for f in files if f.name.endswith(suffix)]
        if needing:  # before any work: a missing reader fails now, not after hours of tokenizing
            optional_import(module, package, needing[0])
    if args.chat and not all(map(is_jsonl, files)):
        other = next(f for f in files if not is_jsonl(f))
        raise ValueError(f"--chat reads .jsonl / .jsonl.zst files of conversations, not {other}")
    if not args.train_sp:
        tok = load_tokenizer({"tokenizer": tok_meta})  # no end-of-text token: one line here
    if args.chat:
        from transformers import AutoTokenizer

        if not AutoTokenizer.from_pretrained(tok_meta["path"], local_files_only=True).chat_template:
            raise ValueError(f"tokenizer {tok_meta['path']} has no chat template (tokenizer_config.json "
                             "\"chat_template\" or chat_template.jinja); use the instruct model's tokenizer folder")
    units = group_units([s.st_size for s in stats], args.unit_bytes)
    unit_sizes = [sum(s.st_size for s in stats[a:b]) for a, b in units]
    inputs = [(str(f.absolute()), s.st_size, s.st_mtime_ns) for f, s in zip(files, stats)]
    inputs = hashlib.sha256(json.dumps(inputs).encode())
    plan = {"inputs": inputs.hexdigest()[:16], "files": len(files), "bytes": sum(unit_sizes), "units": len(units),
            "unit_bytes": args.unit_bytes, "tokenizer": tokenizer_fingerprint(tok_meta, args.train_sp),
            "jsonl_key": args.jsonl_key, "val_fraction": args.val_fraction, "chat": args.chat,
            "seq_len": args.seq_len if args.chat else None, "shard_tokens": args.shard_tokens}
    plan["key"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    mine = part_units(unit_sizes, args.parts)[args.part_index]
    if open_plan(out, plan, args.force, mine if args.part else None):
        meta = json.loads((out / "meta.json").read_text())
        print(f"{out} is ready: {meta['num_tokens']:,} tokens (use --force to rebuild)")
        return meta
    if args.train_sp:
        if args.force or not sp_path.is_file():  # else: resumed, the model this plan trained
            print(f"training a {args.train_sp}-piece sentencepiece model on {len(files)} files -> {sp_path}")
            train_sentencepiece(files, args.jsonl_key, args.train_sp, sp_path, args.skip_bad)
        tok = load_tokenizer({"tokenizer": tok_meta})

    # ---- tokenize the units of this run not done yet, in order, each into its shards and then its record
    todo = [u for u in mine if unit_record(out, u, plan["key"], False) is None]
    pending_bytes = sum(unit_sizes[u] for u in todo)
    progress, writers, counts, written = Progress(pending_bytes), None, None, 0
    t_tokenize = time.time()
    encoder_args = (tok_meta, args.jsonl_key, args.seq_len if args.chat else None, args.skip_bad)
    for res in ordered_map(batches(files, units, todo, args.jsonl_key, args.batch_bytes), args.workers, encoder_args):
        u = res["unit"]
        if writers is None:
            writers = tuple(ShardWriter(folder, f"{u:05d}_", tok.vocab_size, args.shard_tokens, args.chat)
                            for folder in (out, out / "val"))
            counts = {"documents": 0, "bad_lines": 0, "bad": [], "truncated": 0, "skipped": 0}
        ids, lengths, mask = res["docs"]
        val_D = held_out(u, counts["documents"], len(lengths), args.val_fraction)  # D: this batch's documents
        val_N = np.repeat(val_D, lengths)  # N: their tokens
        for writer, keep_D, keep_N in zip(writers, (~val_D, val_D), (~val_N, val_N)):
            if keep_D.any():
                writer.add(ids[keep_N], lengths[keep_D], None if mask is None else mask[keep_N])
        counts["documents"] += len(lengths)
        for name in ("truncated", "skipped"):
            counts[name] += res[name]
        counts["bad_lines"] += len(res["bad"])
        counts["bad"] = (counts["bad"] + res["bad"])[:SHOWN_BAD_LINES]
        progress.update(res)
        written += 1
        inject_fault(str(written))
        if res["last"]:
            commit_unit(out, u, plan["key"], writers, counts)
            writers = None
    progress.close()
    seconds = time.time() - t_tokenize

    # ---- the dataset's meta.json, once every unit (of every part) is done
    finished = finish(out, len(units), plan["key"], tok, tok_meta, args)
    here = (f"tokenized here: {progress.docs:,} {'conversations' if args.chat else 'documents'} in {seconds:.1f}s, "
            f"{progress.tokens / max(seconds, 1e-9):,.0f} tokens/s with {args.workers} "
            f"worker{'s' * (args.workers > 1)}")
    if finished is None:
        owners = part_units(unit_sizes, args.parts)
        waiting = [p + 1 for p, owned in enumerate(owners) if any(unit_record(out, u, plan["key"], False) is None
                                                                    for u in owned)]
        print(f"part {args.part}: its {len(mine)} units are done ({here}); {out} is a dataset once parts "
              f"{', '.join(map(str, waiting))} of {args.parts} have run (the last to finish writes meta.json)")
        return {"complete": False, "waiting": waiting}
    meta, bad = finished
    if meta.get("bad_lines"):
        more = "\n  ..." if meta["bad_lines"] > len(bad) else ""
        print(f"skipped {meta['bad_lines']:,} malformed lines (--skip-bad):" + "".join(f"\n  {e}" for e in bad) + more)
    if (out / "val" / "meta.json").exists():
        val = json.loads((out / "val" / "meta.json").read_text())
        print(f"held out {val['num_documents']:,} {'conversations' if args.chat else 'documents'}, "
              f"{val['num_tokens']:,} tokens -> {out / 'val'}")
    resumed = f", {len(mine) - len(todo)} of {len(mine)} units done before" if len(todo) < len(mine) else ""
    if args.chat:
        c = meta["conversations"]
        print(f"{meta['num_documents']:,} conversations, {meta['num_tokens']:,} tokens of which {meta['trained_tokens']:,} "
              f"trained (assistant), longest {meta['max_document_tokens']} -> {out} in {time.time() - t0:.1f}s "
              f"({here}{resumed}); {c['truncated']} truncated to --seq-len {args.seq_len}, {c['skipped']} skipped "
              f"(nothing to train within --seq-len)", flush=True)
        return {**meta, **c}
    print(f"{meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens ({meta['dtype']}, "
          f"{len(meta['shards'])} shards) -> {out} in {time.time() - t0:.1f}s ({here}{resumed})", flush=True)
    return meta


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # bad input: one line (core/reliability.py:run_main, without torch)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
