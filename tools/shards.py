"""Writers of core/shards.py's token datasets (tools/prepare_data.py writes a ShardWriter per work unit; tests and
tools/bench.py write small datasets with write_shards); numpy only, like the format, no torch."""

import json
import os
from collections.abc import Iterable

import numpy as np

from core.shards import FORMAT, FORMAT_DOCUMENTS, MASK_DTYPE, token_dtype


def dtype_name(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def token_array(ids, vocab_size: int) -> np.ndarray:
    """ids in the shards' dtype, or one error naming an id outside [0, vocab_size)."""
    ids = np.asarray(ids, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if len(bad):
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); "
                         "pass the tokenizer's full vocab_size (len(tokenizer))")
    return ids.astype(token_dtype(dtype_name(vocab_size)))


def write_atomic(path, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"  # per process: parts of one dataset may finish it at the same time
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class ShardWriter:
    """Whole documents appended to <out_dir>/tokens_<prefix>00000.bin, tokens_<prefix>00001.bin, ... (mask_... with
    loss masks) of shard_tokens tokens each but the last, written as they come; close() gives write_meta's record."""

    def __init__(self, out_dir, prefix: str, vocab_size: int, shard_tokens: int, loss_masks: bool = False):
        self.out_dir, self.prefix, self.vocab_size, self.shard_tokens = out_dir, prefix, vocab_size, shard_tokens
        self.loss_masks, self.files, self.fill, self.lengths = loss_masks, [], shard_tokens, []  # full: open one first
        self.shards, self.masks, self.num_tokens, self.num_docs, self.longest, self.trained = [], [], 0, 0, 0, 0

    def add(self, ids, lengths, mask=None) -> None:
        """Documents back to back: ids [N], their lengths (> 0, summing to N), with loss masks their 0/1 mask [N]."""
        ids, lengths = token_array(ids, self.vocab_size), np.asarray(lengths, dtype=np.int64)
        assert lengths.sum() == len(ids) and (lengths > 0).all() and (mask is None or len(mask) == len(ids))
        self.num_tokens, self.num_docs = self.num_tokens + len(ids), self.num_docs + len(lengths)
        self.longest = max(self.longest, int(lengths.max(initial=0)))
        if self.loss_masks:  # format 2 keeps its documents' lengths (8 bytes each) for documents.bin
            mask = np.asarray(mask, dtype=MASK_DTYPE)
            self.trained += int(mask.sum())
            self.lengths.append(lengths)
        at = 0
        while at < len(ids):
            if self.fill == self.shard_tokens:  # the next shard (and its mask); close() closes the open ones
                self.close()
                self.shards.append(f"tokens_{self.prefix}{len(self.shards):05d}.bin")
                self.masks += [self.shards[-1].replace("tokens_", "mask_")] * self.loss_masks
                os.makedirs(self.out_dir, exist_ok=True)
                names = self.shards[-1:] + self.masks[-1:]
                self.files, self.fill = [open(os.path.join(self.out_dir, n), "wb") for n in names], 0
            n = min(len(ids) - at, self.shard_tokens - self.fill)
            for f, values in zip(self.files, (ids, mask)):
                values[at:at + n].tofile(f)
            at, self.fill = at + n, self.fill + n

    def close(self) -> dict:
        for f in self.files:
            f.close()
        record = {"shards": self.shards, "num_tokens": self.num_tokens, "num_documents": self.num_docs,
                  "max_document_tokens": self.longest}
        if self.loss_masks:
            lengths = np.concatenate([np.zeros(0, np.int64), *self.lengths])
            record.update(masks=self.masks, trained_tokens=self.trained, lengths=lengths)
        return record


def write_meta(out_dir, records: list[dict], vocab_size: int, eos_id: int, tokenizer: dict, extra: dict | None = None,
               loss_masks: bool = False) -> dict:
    """meta.json (format 2: and documents.bin) of the records' shards in order, written last, atomically; returned."""
    assert 0 <= eos_id < vocab_size
    meta = {"format": FORMAT, "dtype": dtype_name(vocab_size), "vocab_size": int(vocab_size), "eos_id": int(eos_id),
            **{key: sum(r[key] for r in records) for key in ("num_tokens", "num_documents")},
            "shards": [s for r in records for s in r["shards"]], "tokenizer": tokenizer}
    if loss_masks:
        starts = np.cumsum(np.concatenate([[0], *(r["lengths"] for r in records)]))
        write_atomic(os.path.join(out_dir, "documents.bin"), starts.astype("<i8").tobytes())
        meta.update({"format": FORMAT_DOCUMENTS, "packing": "documents", "masks": [m for r in records for m in r["masks"]],
                     "documents": "documents.bin", "trained_tokens": sum(r["trained_tokens"] for r in records),
                     "max_document_tokens": max([0] + [r["max_document_tokens"] for r in records])})
    meta.update(extra or {})
    write_atomic(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=1).encode())
    return meta


def write_shards(token_docs: Iterable, out_dir, vocab_size: int, eos_id: int, tokenizer: dict,
                 shard_tokens: int = 2**26, extra: dict | None = None, loss_masks: bool = False) -> dict:
    """One dataset in one call (tools/prepare_data.py writes a ShardWriter per work unit): token id lists, each then
    followed by eos_id (format 1); with loss_masks, (ids, 0/1 mask) pairs as they are (format 2)."""
    writer = ShardWriter(out_dir, "", vocab_size, shard_tokens, loss_masks)
    for doc in token_docs:
        ids = list(doc[0]) if loss_masks else list(doc) + [eos_id]
        writer.add(ids, [len(ids)], doc[1] if loss_masks else None)
    os.makedirs(out_dir, exist_ok=True)
    return write_meta(out_dir, [writer.close()], vocab_size, eos_id, tokenizer, extra, loss_masks)
