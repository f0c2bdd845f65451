"""Token datasets on disk (tools/shards.py writes them, core/data.py reads them) and the tokenizer a dataset
names; numpy only, no torch: the data tool starts in a fraction of a second. meta.json: {"format", "dtype",
"vocab_size", "eos_id", "num_tokens", "num_documents", "shards", "tokenizer"}; tokens_*.bin: uint16/uint32 token ids
(little-endian), the dataset being the shards in order. Raw text (format 1): documents, each followed by eos_id.
Documents with loss masks (format 2, --chat): no eos; meta.json adds "packing": "documents", "masks" (mask_*.bin: a
uint8 per token, 1 = trained), "documents" (documents.bin: int64 document starts, then the end), "max_document_tokens".
"""

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FORMAT = 1  # raw text: one token stream
FORMAT_DOCUMENTS = 2  # whole documents with per-token loss masks
MASK_DTYPE = np.dtype("u1")


def token_dtype(name: str) -> np.dtype:
    return np.dtype({"uint16": "<u2", "uint32": "<u4"}[name])  # little-endian: shards read the same on any machine


@dataclass
class Tokenizer:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab_size: int
    eos_id: int
    chat_prompt: Callable[[list[dict]], list[int]] | None = None  # HF chat template: messages -> generation prompt ids
    encode_batch: Callable[[list[str]], list[list[int]]] | None = None  # many texts in one call, one thread


def load_tokenizer(meta: dict) -> Tokenizer:
    """The tokenizer a dataset was made with (meta["tokenizer"]), behind one small interface."""
    kind, path = meta["tokenizer"]["kind"], meta["tokenizer"]["path"]
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path} named in the dataset's meta.json is missing; rerun tools.prepare_data")
    if kind == "sentencepiece":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=path)
        if sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model {path} has no end-of-text piece (eos_id -1), which separates packed "
                             "documents; train one with it (tools.prepare_data --train-sp does)")
        return Tokenizer(lambda text: sp.encode(text), lambda ids: sp.decode(list(ids)), sp.get_piece_size(),
                         sp.eos_id(), encode_batch=lambda texts: sp.encode(texts, num_threads=1))
    if kind == "hf":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if tok.eos_token_id is None:
            raise ValueError(f"Hugging Face tokenizer {path} has no eos token; documents need one to be packed")
        # no BOS/EOS per call (the packer adds one eos per document); a literal "<|endoftext|>" is text, not a boundary
        chat = (lambda messages: list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                                return_dict=True)["input_ids"])) \
            if tok.chat_template else None
        return Tokenizer(lambda text: tok.encode(text, add_special_tokens=False, split_special_tokens=True),
                         lambda ids: tok.decode(list(ids)), len(tok), tok.eos_token_id, chat,
                         lambda texts: tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    raise ValueError(f"unknown tokenizer kind {kind!r} in meta.json; expected 'sentencepiece' or 'hf'")
