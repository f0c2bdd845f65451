"""The loader every train.py uses, over the datasets of core/shards.py. Raw text (format 1): windows of seq_len+1 tokens
(stride seq_len). Documents with loss masks (format 2): never split, packed and shuffled as README "Conversations and
fine-tuning" says, padded with untrained eos_id tokens (their own document); label of t: token t+1 if trained and in t's
document, else -100. documents=True: next_batch also gives document ids (format 1: doc_ids_from_eos).
"""

import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist

from core.context import doc_ids_from_eos, document_starts
from core.shards import FORMAT, FORMAT_DOCUMENTS, MASK_DTYPE, load_tokenizer, token_dtype  # noqa: F401

PREPARE_HINT = "run `python -m tools.prepare_data --default` (or with --input FILES --out DIR) first"


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
    if meta.get("format") not in (FORMAT, FORMAT_DOCUMENTS):
        raise ValueError(f"{path} has format {meta.get('format')}, this loader reads {FORMAT} and {FORMAT_DOCUMENTS}; "
                         "rerun tools.prepare_data")
    missing = [k for k in ("masks", "documents", "max_document_tokens")
               if meta["format"] == FORMAT_DOCUMENTS and k not in meta]
    if missing:
        raise ValueError(f"{path} is a dataset of documents without {', '.join(missing)}; rerun tools.prepare_data --force")
    return meta


def _open_shards(data_dir, names: list[str], dtype: np.dtype, what: str) -> list[np.ndarray]:
    shards = []
    for name in names:  # memory-mapped: the OS pages in only the windows we touch (np.memmap refuses empty files)
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what} {path} listed in meta.json is missing; rerun tools.prepare_data --force")
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise ValueError(f"{what} {path} has {size} bytes, not a whole number of {dtype.itemsize}-byte values; "
                             "the dataset is corrupt, rerun tools.prepare_data --force")
        shards.append(np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype))
    return shards


def pack_documents(lengths: np.ndarray, seq_len: int, seed: int) -> list[np.ndarray]:
    """Document indices of each window: documents in a seeded order, packed while they fit in seq_len (next fit)."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).numpy()
    windows, first, fill = [], 0, 0
    for i, n in enumerate(lengths[order].tolist()):
        if fill + n > seq_len:
            windows.append(order[first:i])
            first, fill = i, 0
        fill += n
    windows.append(order[first:])
    return windows


def positions_in_documents(doc_ids_BK: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document [B, K] (rope restarts per document): index minus its document's start."""
    index_BK = torch.arange(doc_ids_BK.shape[1], device=doc_ids_BK.device).expand_as(doc_ids_BK)
    return index_BK - torch.where(document_starts(doc_ids_BK), index_BK, 0).cummax(1).values  # (index 0: 0)


class TokenLoader:
    """Deterministic, resumable, data-parallel batches of format 1 or 2 windows (see the top of this file)."""

    def __init__(self, data_dir, seq_len: int, global_batch: int, rank: int = 0, world: int = 1, seed: int = 0):
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be positive")
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} data-parallel ranks; "
                             f"choose a global batch that is a multiple of {world}")
        assert 0 <= rank < world
        self.meta = read_meta(data_dir)
        self.seq_len, self.global_batch, self.rank, self.world, self.seed = seq_len, global_batch, rank, world, seed
        self.shards = _open_shards(data_dir, self.meta["shards"], token_dtype(self.meta["dtype"]), "shard")
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # stream offset of each shard
        n = int(self.starts[-1])
        if n != self.meta["num_tokens"]:
            raise ValueError(f"dataset {data_dir} has {n} tokens in its shards but meta.json says "
                             f"{self.meta['num_tokens']}; rerun tools.prepare_data --force")
        self.documents = self.meta["format"] == FORMAT_DOCUMENTS  # whole documents with loss masks
        if self.documents:
            self.masks = _open_shards(data_dir, self.meta["masks"], MASK_DTYPE, "loss mask shard")
            if [len(m) for m in self.masks] != [len(s) for s in self.shards]:
                raise ValueError(f"dataset {data_dir}: the loss mask shards do not match the token shards; "
                                 "rerun tools.prepare_data --force")
            self.doc_starts = np.fromfile(os.path.join(data_dir, self.meta["documents"]), dtype="<i8")
            if len(self.doc_starts) != self.meta["num_documents"] + 1 or self.doc_starts[-1] != n:
                raise ValueError(f"dataset {data_dir}: {self.meta['documents']} does not match meta.json; "
                                 "rerun tools.prepare_data --force")
            if self.meta["max_document_tokens"] > seq_len:
                raise ValueError(f"dataset {data_dir} holds documents of up to {self.meta['max_document_tokens']} "
                                 f"tokens, longer than --seq-len {seq_len}, and documents are never split; train with "
                                 f"--seq-len >= {self.meta['max_document_tokens']} or rerun tools.prepare_data --chat "
                                 f"--seq-len {seq_len}")
            if self.meta["num_documents"] == 0:
                raise ValueError(f"dataset {data_dir} holds no documents; rerun tools.prepare_data with more input")
            self.windows = pack_documents(np.diff(self.doc_starts), seq_len, seed + (1 << 40))  # not an epoch's seed
            self.num_samples = len(self.windows)
        else:
            if n < seq_len + 1:
                raise ValueError(f"dataset {data_dir} has {n} tokens, fewer than one sample of seq_len+1 = "
                                 f"{seq_len + 1}; use more text or a shorter --seq-len")
            self.num_samples = (n - 1) // seq_len  # windows overlap by one token: all but the last are predicted
        self.step, self._perm_epoch, self._perm = 0, -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:  # one cached permutation: consecutive batches almost always share an epoch
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_samples, generator=g), epoch
        return self._perm

    def _read(self, shards: list[np.ndarray], start: int, end: int) -> np.ndarray:
        parts = []  # a range may straddle shards: gather it piece by piece
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            lo = start - int(self.starts[i])
            piece = shards[i][lo:lo + end - start]
            parts.append(piece)
            start += len(piece)
            i += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _stream_window(self, sample: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        start = sample * self.seq_len
        window = self._read(self.shards, start, start + self.seq_len + 1).astype(np.int64)
        return window[:-1], window[1:], doc_ids_from_eos(torch.from_numpy(window[None, :-1]), self.meta["eos_id"])[0].numpy()

    def _document_window(self, sample: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, labels, docs = [], [], []
        for d, doc in enumerate(self.windows[sample]):
            lo, hi = int(self.doc_starts[doc]), int(self.doc_starts[doc + 1])
            tokens = self._read(self.shards, lo, hi).astype(np.int64)
            trained = self._read(self.masks, lo, hi).astype(bool)
            ids.append(tokens)
            labels.append(np.append(np.where(trained[1:], tokens[1:], -100), -100))  # the last predicts nothing
            docs.append(np.full(hi - lo, d))
        pad = self.seq_len - sum(len(t) for t in ids)  # the padding: one more document, never trained
        ids.append(np.full(pad, self.meta["eos_id"]))
        labels.append(np.full(pad, -100))
        docs.append(np.full(pad, len(docs)))
        return tuple(np.concatenate(x).astype(np.int64) for x in (ids, labels, docs))

    def row(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, labels, document ids) [seq_len] of draw g of the endless shuffled sequence of windows."""
        epoch, pos = divmod(g, self.num_samples)
        return (self._document_window if self.documents else self._stream_window)(int(self._order(epoch)[pos]))

    def next_batch(self, documents: bool = False) -> tuple[torch.Tensor, ...]:
        """(input_ids, labels[, doc ids if documents]) int64 [global_batch // world, seq_len]: this rank's next rows."""
        local = self.global_batch // self.world
        first = self.step * self.global_batch + self.rank * local  # position in the endless shuffled sequence
        rows = [self.row(g) for g in range(first, first + local)]
        self.step += 1
        ids, labels, docs = (torch.from_numpy(np.stack(x)) for x in zip(*rows))
        return (ids, labels, docs) if documents else (ids, labels)

    def state_dict(self) -> dict:  # no rank or world: the position is global, so resume works on another dp size
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("seed", "seq_len", "global_batch"):
            if sd[key] != getattr(self, key):
                raise ValueError(f"data state was saved with {key}={sd[key]} but this loader has {key}="
                                 f"{getattr(self, key)}; resume with the same --{key.replace('_', '-')}")
        self.step = int(sd["step"])


# ------------------------------------------------------------------------------------------ mixtures


def parse_mixture(spec: str) -> list[tuple[str, str, float]]:
    """--data: one dataset folder, or a mixture `[NAME=]FOLDER:WEIGHT,...` (weights > 0, normalised to sum 1;
    NAME defaults to the folder's name). Returns [(name, folder, weight)]; a single folder has weight 1."""
    if "," not in spec and not spec.rpartition(":")[2].replace(".", "", 1).isdigit():
        return [(os.path.basename(os.path.normpath(spec)), spec, 1.0)]
    sources = []
    for item in spec.split(","):
        folder, _, weight = item.rpartition(":")
        name, _, folder = folder.rpartition("=") if "=" in folder else ("", "", folder)
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not folder or not w > 0 or not math.isfinite(w):
            raise ValueError(f"--data {spec}: {item!r} is not FOLDER:WEIGHT with a weight > 0 (a mixture is "
                             f"[NAME=]FOLDER:WEIGHT,..., e.g. web=data/web:0.7,code=data/code:0.3)")
        sources.append((name or os.path.basename(os.path.normpath(folder)), folder, w))
    names = [n for n, _, _ in sources]
    if len(set(names)) < len(names):
        raise ValueError(f"--data {spec}: two sources are named {max(names, key=names.count)!r}; name them "
                         f"apart with NAME=FOLDER:WEIGHT")
    total = sum(w for _, _, w in sources)
    return [(n, f, w / total) for n, f, w in sources]


def mixture_counts(weights: list[float], global_batch: int, steps: np.ndarray, seed: int) -> np.ndarray:
    """Sequences of each source in each of `steps` [len(steps), sources]: floor(weight x global_batch), the other slots
    by systematic sampling over the fractional parts (golden-ratio offsets): within 1 of the quota, no step's state."""
    quota = np.asarray(weights, dtype=np.float64) * global_batch
    floor = np.floor(quota)
    edges = np.concatenate([[0.0], np.cumsum(quota - floor)])  # the fractional parts laid end to end
    edges[-1] = round(edges[-1])  # a whole number of slots (no rounding error may add one)
    start = torch.rand((), generator=torch.Generator().manual_seed(seed + (1 << 42))).item()
    offset = (start + np.asarray(steps, dtype=np.float64)[:, None] * 0.6180339887498949) % 1.0  # [steps, 1]
    extra = np.ceil(edges[None, 1:] - offset) - np.ceil(edges[None, :-1] - offset)  # points offset + i in each part
    return (floor[None] + extra).astype(np.int64)


class MixtureLoader:
    """Weighted batches of several TokenLoaders (one tokenizer) used as one (README, "Dataset mixtures"): step t has
    mixture_counts(t) rows of each source; `sources`: each row's source in the last batch [local batch]."""

    def __init__(self, sources: list[tuple[str, str, float]], seq_len: int, global_batch: int, rank: int = 0,
                 world: int = 1, seed: int = 0):
        self.names, self.weights = [n for n, _, _ in sources], [w for _, _, w in sources]
        self.loaders = [TokenLoader(folder, seq_len, global_batch, rank, world, seed + i) for i, (_, folder, _) in
                        enumerate(sources)]
        first = self.loaders[0].meta
        for (name, folder, _), loader in zip(sources[1:], self.loaders[1:]):
            for key in ("tokenizer", "vocab_size", "eos_id"):
                if loader.meta[key] != first[key]:
                    raise ValueError(f"--data: source {name} ({folder}) has {key} {loader.meta[key]} but "
                                     f"{sources[0][1]} {first[key]}; a mixture needs datasets made with one tokenizer")
        self.meta, self.seq_len, self.global_batch, self.rank, self.world, self.seed = \
            first, seq_len, global_batch, rank, world, seed
        self.documents = any(loader.documents for loader in self.loaders)
        self.num_samples = sum(loader.num_samples for loader in self.loaders)
        self.step, self.sources, self._drawn = 0, None, (0, np.zeros(len(sources), dtype=np.int64))

    def next_batch(self, documents: bool = False) -> tuple[torch.Tensor, ...]:
        """As TokenLoader.next_batch; also sets `sources`."""
        if self._drawn[0] != self.step:  # sequences of each source before this step (sequential steps: carried)
            self._drawn = (self.step, mixture_counts(self.weights, self.global_batch, np.arange(self.step),
                                                     self.seed).sum(0))
        counts = mixture_counts(self.weights, self.global_batch, np.array([self.step]), self.seed)[0]
        slots = np.repeat(np.arange(len(counts)), counts)  # the step's sources, then shuffled
        slots = slots[torch.randperm(len(slots), generator=torch.Generator().manual_seed(
            self.seed + (1 << 43) + self.step)).numpy()]
        draws, seen = np.empty(len(slots), dtype=np.int64), self._drawn[1].copy()
        for slot, s in enumerate(slots):  # the draw number of each slot within its source
            draws[slot], seen[s] = seen[s], seen[s] + 1
        local = self.global_batch // self.world
        rows, sources = [], slots[self.rank * local:(self.rank + 1) * local]
        for slot in range(self.rank * local, (self.rank + 1) * local):
            s = int(slots[slot])
            ids, labels, docs = self.loaders[s].row(int(draws[slot]))
            rows.append((ids, labels, docs if self.loaders[s].documents else np.zeros_like(docs)))
        self.step, self._drawn = self.step + 1, (self.step + 1, seen)
        self.sources = torch.from_numpy(sources.astype(np.int64))
        ids, labels, docs = (torch.from_numpy(np.stack(x)) for x in zip(*rows))
        return (ids, labels, docs) if documents else (ids, labels)

    def state_dict(self) -> dict:
        return {**self.loaders[0].state_dict(), "step": self.step, "seed": self.seed,
                "mixture": dict(zip(self.names, self.weights))}

    def load_state_dict(self, sd: dict) -> None:
        mixture = dict(zip(self.names, self.weights))
        if sd.get("mixture") != mixture:
            raise ValueError(f"data state was saved with the mixture {sd.get('mixture')} but --data gives {mixture}; "
                             f"resume with the same --data")
        self.loaders[0].load_state_dict({**sd, "seed": self.loaders[0].seed})
        self.step = int(sd["step"])


def source_losses(names: list[str], sums_G: torch.Tensor, labels_BS: torch.Tensor, sources_B: torch.Tensor,
                  data_group) -> dict[str, float]:
    """{"loss_<name>": cross-entropy per trained label of that source in the global batch}: this rank's loss sums
    (LossGroups; zeros where pp > 0) summed over all ranks, its label counts over data_group (None: this rank alone)."""
    counts_G = torch.zeros(len(names), dtype=torch.float64, device=labels_BS.device)
    counts_G.index_add_(0, sources_B, (labels_BS != -100).sum(1).double())
    if dist.is_initialized():
        dist.all_reduce(sums_G)
    if data_group is not None:
        dist.all_reduce(counts_G, group=data_group)
    return {f"loss_{name}": (s / c).item() for name, s, c in zip(names, sums_G, counts_G) if c > 0}


def open_dataset(spec: str, seq_len: int, global_batch: int, rank: int = 0, world: int = 1, seed: int = 0):
    """--data: a TokenLoader for one folder, a MixtureLoader for a mixture (parse_mixture)."""
    sources = parse_mixture(spec)
    if len(sources) == 1:
        return TokenLoader(sources[0][1], seq_len, global_batch, rank, world, seed)
    return MixtureLoader(sources, seq_len, global_batch, rank, world, seed)
