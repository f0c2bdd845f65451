"""The inputs of the CPU fine-tuning demo, made here from this Python and the stdlib demo's tokenizer (nothing
downloaded):

  python -m tools.chat_demo            # -> data/chat_demo/tokenizer/ and data/chat_demo/chats.jsonl

- tokenizer/: a Hugging Face tokenizer folder equal to data/stdlib/tokenizer.model (the 4096-piece sentencepiece
  model `python -m tools.prepare_data --default` trains, which the tiny demo model is pretrained with), token for
  token (checked on stdlib sources before it is written), plus a chat template in ChatML form that reuses the
  model's own special pieces, so the vocabulary stays 4096: `<s>` opens a turn, then the role and a newline, the
  content, `</s>` (the eos) ends it and a newline follows; the generation prompt is `<s>assistant\n`.
- chats.jsonl: one conversation per line ({"messages": [...]}), questions about functions of the standard library
  ("What does json.dumps do?") answered by the first paragraph of the function's docstring; every fourth
  conversation asks about two functions in two turns.

Then `python -m tools.prepare_data --chat --input data/chat_demo/chats.jsonl --hf-tokenizer
data/chat_demo/tokenizer --seq-len 256 --out data/chat_demo/data` and train.py --hf-checkpoint on the pretrained
export (README: Fine-tuning).
"""

import argparse
import importlib
import inspect
import json
import sysconfig
from pathlib import Path

from core.reliability import run_main

# ChatML-like, with the sentencepiece model's <s> / </s> as the turn markers; an unknown role is an error
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role'] + ': this template knows system, user and assistant') }}"
    "{% endif %}"
    "{{ '<s>' + m['role'] + '\\n' + m['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")
MODULES = ("os", "os.path", "shutil", "json", "re", "string", "textwrap", "itertools", "functools", "collections",
           "math", "statistics", "random", "heapq", "bisect", "operator", "pathlib", "glob", "fnmatch", "tempfile",
           "csv", "base64", "binascii", "hashlib", "zlib", "gzip", "datetime", "time", "calendar", "copy", "pprint",
           "inspect", "typing", "dataclasses", "enum", "contextlib", "difflib", "html", "urllib.parse", "uuid",
           "socket", "struct", "array", "decimal", "fractions", "keyword", "unicodedata", "locale", "platform", "sys")
QUESTIONS = ("What does {} do?", "Explain {}.", "What is {} for?", "Describe the function {}.")


def sentencepiece_to_hf(model_path: Path, out: Path, chat_template: str, check_files: int = 20) -> None:
    """A Hugging Face tokenizer folder that encodes and decodes exactly as the sentencepiece BPE model (built as
    tools/prepare_data.py trains it: identity normalisation, no dummy prefix, byte fallback, "\\n" a piece)."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    # sentencepiece BPE merges whole pieces in score order, which is id order: the merges follow from the vocab
    tk = Tokenizer(models.BPE(vocab, generate_merges(vocab), unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")  # sentencepiece's visible space; no whitespace pre-split
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_tokens([AddedToken("\n", normalized=False, special=False)])  # a user-defined piece: matched first
    specials = [sp.id_to_piece(i) for i in (sp.unk_id(), sp.bos_id(), sp.eos_id())]
    tk.add_special_tokens([AddedToken(t, special=True) for t in specials])
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py"))[:check_files]:  # the same ids as sentencepiece, or no folder
        text = path.read_text(encoding="utf-8", errors="replace")
        if tk.encode(text, add_special_tokens=False).ids != sp.encode(text):
            raise ValueError(f"the converted tokenizer encodes {path} differently from {model_path}; "
                             "it was not trained by tools.prepare_data")
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token=specials[0], bos_token=specials[1],
                                 eos_token=specials[2])
    hf.chat_template = chat_template
    hf.save_pretrained(out)


def first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def stdlib_answers(max_chars: int = 400) -> list[tuple[str, str]]:
    """(qualified name, first docstring paragraph) of the public functions of MODULES, in a fixed order; the
    paragraph must say something (>= 20 characters) and not be a signature line."""
    found = {}
    for mod_name in MODULES:
        module = importlib.import_module(mod_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            answer = first_paragraph(inspect.getdoc(obj))
            if 20 <= len(answer) <= max_chars and "(" not in answer[:len(name) + 1]:
                found.setdefault(answer, f"{mod_name}.{name}")  # an alias (os.path.join twice) once
    return sorted((name, answer) for answer, name in found.items())


def conversations(pairs: list[tuple[str, str]]) -> list[dict]:
    out, i = [], 0
    while i < len(pairs):
        turns = 2 if len(out) % 4 == 3 and i + 1 < len(pairs) else 1
        messages = []
        for name, answer in pairs[i:i + turns]:
            messages += [{"role": "user", "content": QUESTIONS[len(out) % len(QUESTIONS)].format(name)},
                         {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
        i += turns
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.chat_demo", description=__doc__.split("\n")[0])
    p.add_argument("--sp-model", default="data/stdlib/tokenizer.model", help="the stdlib demo's tokenizer")
    p.add_argument("--out", default="data/chat_demo")
    args = p.parse_args(argv)
    sp_model, out = Path(args.sp_model), Path(args.out)
    if not sp_model.is_file():
        raise FileNotFoundError(f"{sp_model} does not exist; run `python -m tools.prepare_data --default` first")
    sentencepiece_to_hf(sp_model, out / "tokenizer", CHAT_TEMPLATE)
    chats = conversations(stdlib_answers())
    with open(out / "chats.jsonl", "w") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    print(f"{out / 'tokenizer'}: the tokenizer of {sp_model} with a chat template; {out / 'chats.jsonl'}: "
          f"{len(chats)} conversations about {sum(len(c['messages']) // 2 for c in chats)} stdlib functions")


if __name__ == "__main__":
    run_main(main)
