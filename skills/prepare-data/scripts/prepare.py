"""Tokenize a corpus for a recipe and check the result fits it, then print the command that trains on it.

  python skills/prepare-data/scripts/prepare.py --recipe RECIPE --out DIR --input PATH ... (--hf-tokenizer DIR | --sp-model FILE
         | --train-sp VOCAB) [--config FILE] [--val-fraction 0.01] [other tools/prepare_data.py flags, --part I/N included]

Runs tools/prepare_data.py (text, .jsonl, .jsonl.zst, .parquet; a held-out split in DIR/val), then checks against
the model config the recipe will train (--config; default: the recipe's config.json with --hf-tokenizer, its
config_tiny.json otherwise): the dataset's vocabulary fits the model's embedding, the eos id is inside it, the
validation split exists when --val-fraction > 0, and the first training document decodes back to text (--chat:
the first conversation's trained tokens, its assistant turns; and some tokens are trained). Prints
OK lines and the launch command, or FAIL lines (exit status 1). With --part I/N the checks wait for the last part:
a part that leaves others to run prints which, and checks nothing.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from core.shards import load_tokenizer  # noqa: E402
from tools import prepare_data  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    p.add_argument("--recipe", required=True, help="folder name under recipes/")
    p.add_argument("--config", help="model config.json the data is for (default: see above)")
    args, rest = p.parse_known_args(argv)
    recipe = ROOT / "recipes" / args.recipe
    if not (recipe / "train.py").is_file():
        raise FileNotFoundError(f"{recipe}/train.py does not exist; name a folder under recipes/")
    config = Path(args.config) if args.config else recipe / ("config.json" if "--hf-tokenizer" in rest else "config_tiny.json")
    if not config.is_file():
        raise FileNotFoundError(f"model config {config} does not exist; pass --config FILE")
    model_vocab = json.loads(config.read_text())["vocab_size"]

    meta = prepare_data.main(rest)  # its own errors (bad flags, missing files/packages) come first, in one line
    if meta.get("complete") is False:  # --part: other parts still to run; the last one to finish gets the checks
        print(f"not checked yet: parts {', '.join(map(str, meta['waiting']))} still to run")
        return {"meta": meta}
    out = Path(rest[rest.index("--out") + 1]).resolve() if "--out" in rest else None
    val_fraction = meta.get("val_fraction", 0.0)
    checks = []
    checks.append((meta["vocab_size"] <= model_vocab,
                   f"dataset vocab {meta['vocab_size']:,} <= model vocab {model_vocab:,} ({config.name})"))
    checks.append((0 <= meta["eos_id"] < model_vocab, f"eos id {meta['eos_id']} inside the model vocab"))
    val_meta = out / "val" / "meta.json"
    if val_fraction > 0:
        val = json.loads(val_meta.read_text()) if val_meta.is_file() else None
        checks.append((val is not None and val["num_tokens"] > 0,
                       f"validation split {out / 'val'}: " + (f"{val['num_documents']:,} documents, {val['num_tokens']:,} tokens"
                                                              if val else "missing (too few documents for --val-fraction?)")))
    tokens = np.fromfile(out / meta["shards"][0], dtype=meta["dtype"])
    chat = meta.get("packing") == "documents"  # --chat: whole conversations with loss masks
    if chat:
        lo, hi = np.fromfile(out / meta["documents"], dtype="<i8")[:2]
        trained = np.fromfile(out / meta["masks"][0], dtype="u1")[lo:hi].astype(bool)
        checks.append((meta["trained_tokens"] > 0, f"{meta['num_documents']:,} conversations: {meta['trained_tokens']:,} "
                       f"of {meta['num_tokens']:,} tokens trained (the assistant's), longest {meta['max_document_tokens']}"))
        first = tokens[lo:hi][trained[:len(tokens[lo:hi])]]
    else:
        first = tokens[: int(np.argmax(tokens == meta["eos_id"]))]
    text = load_tokenizer(meta).decode(first.tolist())
    checks.append((len(text.strip()) > 0, f"first training {'answer' if chat else 'document'} decodes: {text[:60]!r}"))
    for ok, line in checks:
        print(f"{'OK  ' if ok else 'FAIL'} {line}")
    if not all(ok for ok, _ in checks):
        sys.exit(1)
    flag = f" --config {config}" if args.config else ""
    flag += f" --seq-len {meta['seq_len']}" if chat else ""  # the longest conversation kept whole
    print(f"train on it: DATA={out} bash recipes/{args.recipe}/launch.sh{flag}")
    return {"meta": meta, "first_text": text, "model_vocab": model_vocab}


if __name__ == "__main__":
    from core.reliability import run_main

    run_main(main)
