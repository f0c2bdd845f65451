"""Token data on disk and the loader every train.py uses.

A dataset is a directory written by `python -m tools.prepare_data`:
  meta.json          {"format", "dtype", "vocab_size", "eos_id", "num_tokens", "num_documents", "shards", "tokenizer"}
  tokens_00000.bin   raw little-endian uint16/uint32 token ids, ...
Documents are packed: concatenated, each followed by eos_id, so the shards are one token stream. The loader
cuts that stream into windows of seq_len+1 tokens (stride seq_len), shuffles them per epoch with a seeded
permutation and hands each data-parallel rank its slice of the global batch. Everything is a pure function of
(seed, step), which is what makes resume exact and lets the number of ranks change between runs.
"""

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

FORMAT = 1
PREPARE_HINT = "run `python -m tools.prepare_data --default` (or with --input FILES --out DIR) first"


def _dtype(name: str) -> np.dtype:
    # explicit little-endian so shards written on one machine read the same on any other
    return np.dtype({"uint16": "<u2", "uint32": "<u4"}[name])


def write_shards(token_docs: Iterable[list[int]], out_dir, vocab_size: int, eos_id: int, tokenizer: dict,
                 shard_tokens: int = 2**26, extra: dict | None = None) -> dict:
    """Pack documents (each followed by eos_id) into shards of shard_tokens tokens; return the meta written
    (with `extra`'s fields added)."""
    assert shard_tokens > 0 and 0 <= eos_id < vocab_size
    os.makedirs(out_dir, exist_ok=True)
    # drop the old meta.json first: while we overwrite shards the directory must not look complete
    for name in os.listdir(out_dir):
        if name == "meta.json" or (name.startswith("tokens_") and name.endswith(".bin")):
            os.remove(os.path.join(out_dir, name))
    dtype_name = "uint16" if vocab_size <= 2**16 else "uint32"
    buf = np.empty(shard_tokens, dtype=_dtype(dtype_name))  # one shard is filled in memory, then written
    fill, shards, num_tokens, num_docs = 0, [], 0, 0

    def flush():
        name = f"tokens_{len(shards):05d}.bin"
        buf[:fill].tofile(os.path.join(out_dir, name))
        shards.append(name)

    for doc in token_docs:
        ids = np.asarray(list(doc) + [eos_id], dtype=np.int64)
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if len(bad):
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); "
                             "pass the tokenizer's full vocab_size (len(tokenizer))")
        num_docs += 1
        num_tokens += len(ids)
        while len(ids):
            n = min(len(ids), shard_tokens - fill)
            buf[fill:fill + n] = ids[:n]
            fill, ids = fill + n, ids[n:]
            if fill == shard_tokens:
                flush()
                fill = 0
    if fill:
        flush()
    meta = {"format": FORMAT, "dtype": dtype_name, "vocab_size": int(vocab_size), "eos_id": int(eos_id),
            "num_tokens": num_tokens, "num_documents": num_docs, "shards": shards, "tokenizer": tokenizer, **(extra or {})}
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))  # atomic: the dataset exists only once this lands
    return meta


def read_meta(data_dir) -> dict:
    path = os.path.join(data_dir, "meta.json")
    if os.path.isfile(data_dir):
        raise FileNotFoundError(f"dataset {data_dir} is a file; pass the folder tools.prepare_data wrote (with meta.json)")
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"dataset directory {data_dir} does not exist; {PREPARE_HINT}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no dataset at {path}; {PREPARE_HINT}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is corrupt ({e}); rerun tools.prepare_data --force") from None
    missing = [k for k in ("format", "dtype", "vocab_size", "eos_id", "num_tokens", "shards", "tokenizer")
               if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{path} is not a dataset description (missing {', '.join(missing)}); rerun tools.prepare_data --force")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} has format {meta.get('format')}, this loader reads {FORMAT}; rerun tools.prepare_data")
    return meta


class TokenLoader:
    """Deterministic, resumable, data-parallel batches of packed token windows."""

    def __init__(self, data_dir, seq_len: int, global_batch: int, rank: int = 0, world: int = 1, seed: int = 0):
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be positive")
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} data-parallel ranks; "
                             f"choose a global batch that is a multiple of {world}")
        assert 0 <= rank < world
        self.meta = read_meta(data_dir)
        self.seq_len, self.global_batch, self.rank, self.world, self.seed = seq_len, global_batch, rank, world, seed
        dtype = _dtype(self.meta["dtype"])
        self.shards = []
        for name in self.meta["shards"]:
            path = os.path.join(data_dir, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"shard {path} listed in meta.json is missing; rerun tools.prepare_data --force")
            size = os.path.getsize(path)
            if size % dtype.itemsize:
                raise ValueError(f"shard {path} has {size} bytes, not a whole number of {self.meta['dtype']} tokens; "
                                 "the dataset is corrupt, rerun tools.prepare_data --force")
            # np.memmap refuses empty files; the OS pages in only the windows we touch
            self.shards.append(np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype))
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # stream offset of each shard
        n = int(self.starts[-1])
        if n != self.meta["num_tokens"]:
            raise ValueError(f"dataset {data_dir} has {n} tokens in its shards but meta.json says "
                             f"{self.meta['num_tokens']}; rerun tools.prepare_data --force")
        if n < seq_len + 1:
            raise ValueError(f"dataset {data_dir} has {n} tokens, fewer than one sample of seq_len+1 = {seq_len + 1}; "
                             "use more text or a shorter --seq-len")
        # the last token of a window is the first input of the next, so every token except the last is predicted
        self.num_samples = (n - 1) // seq_len
        self.step = 0
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        # consecutive batches almost always share an epoch, so caching one permutation is enough
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_samples, generator=g), epoch
        return self._perm

    def _window(self, start: int) -> np.ndarray:
        # a window may straddle shards: gather it piece by piece
        end, parts = start + self.seq_len + 1, []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            lo = start - int(self.starts[i])
            piece = self.shards[i][lo:lo + end - start]
            parts.append(piece)
            start += len(piece)
            i += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), int64 [global_batch // world, seq_len]: this rank's rows of global step `step`."""
        local = self.global_batch // self.world
        first = self.step * self.global_batch + self.rank * local  # position in the endless shuffled sequence
        rows = []
        for g in range(first, first + local):
            epoch, pos = divmod(g, self.num_samples)
            rows.append(self._window(int(self._order(epoch)[pos]) * self.seq_len))
        self.step += 1
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        # rank and world are deliberately absent: position is global, so resuming on a different dp size works
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("seed", "seq_len", "global_batch"):
            if sd[key] != getattr(self, key):
                raise ValueError(f"data state was saved with {key}={sd[key]} but this loader has {key}="
                                 f"{getattr(self, key)}; resume with the same --{key.replace('_', '-')}")
        self.step = int(sd["step"])


@dataclass
class Tokenizer:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab_size: int
    eos_id: int


def load_tokenizer(meta: dict) -> Tokenizer:
    """The tokenizer a dataset was made with (meta["tokenizer"]), behind one small interface."""
    kind, path = meta["tokenizer"]["kind"], meta["tokenizer"]["path"]
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path} named in the dataset's meta.json is missing; rerun tools.prepare_data")
    if kind == "sentencepiece":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=path)
        return Tokenizer(lambda text: sp.encode(text), lambda ids: sp.decode(list(ids)), sp.get_piece_size(), sp.eos_id())
    if kind == "hf":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if tok.eos_token_id is None:
            raise ValueError(f"Hugging Face tokenizer {path} has no eos token; documents need one to be packed")
        # no BOS/EOS added per call: the packer puts exactly one eos after each document; and a literal
        # "<|endoftext|>" inside a document is text, not a document boundary (split_special_tokens)
        return Tokenizer(lambda text: tok.encode(text, add_special_tokens=False, split_special_tokens=True),
                         lambda ids: tok.decode(list(ids)), len(tok), tok.eos_token_id)
    raise ValueError(f"unknown tokenizer kind {kind!r} in meta.json; expected 'sentencepiece' or 'hf'")
