"""Conversations and documents: rendering with a chat template (tools/prepare_data.py --chat), bad lines and
over-long conversations, the whole-document packing loader (core/data.py format 2: exact resume, any dp size),
positions restarting per document, and the loss: the mean over the assistant's tokens only, against
transformers running each conversation alone. The packed-vs-alone exactness of every recipe and its layouts
are in the shared checks (tests/recipe_checks.py: document_results and the "documents + loss masks" rows)."""

import json
import re

import pytest
import torch

from core.data import TokenLoader, positions_in_documents
from recipes import recipe_names
from tests.test_train import train_args
from tools.chat_demo import CHAT_TEMPLATE, conversations, sentencepiece_to_hf
from tools.prepare_data import main as prepare
from tools.prepare_data import render_conversation
from tools.shards import write_shards

# Qwen-style ChatML: "<|im_start|>role\ncontent<|im_end|>\n" per message, generation prompt "<|im_start|>assistant\n"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What does len do?"},
        {"role": "assistant", "content": "It returns the number of items of a container."},
        {"role": "user", "content": "And abs?"},
        {"role": "assistant", "content": "The absolute value of a number, 2 for -2."}]
TEXT = "the quick brown fox jumps over the lazy dog; What does len do? It returns numbers of items 0123456789 -+"


def hf_tokenizer(path, template: str, specials: list[str], eos: str):
    """A small byte-level BPE tokenizer folder with a chat template, trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos)
    tok.chat_template = template
    tok.save_pretrained(path)
    return tok


@pytest.fixture
def chatml(tmp_path):
    return hf_tokenizer(tmp_path / "chatml", CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>"), \
        tmp_path / "chatml"


def assistant_text(messages, end: str) -> str:
    return "".join(m["content"] + end for m in messages if m["role"] == "assistant")


def test_rendering_masks_exactly_the_assistant_turns(chatml, tmp_path):
    """Decoding the trained tokens gives each assistant turn with its end-of-turn token, nothing else, for a
    ChatML template and the demo's (tools/chat_demo.py: <s> / </s> markers); the tokens are the whole
    rendered conversation's."""
    tok, _ = chatml
    ids, mask = render_conversation(tok, CHAT, "x:1")
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == assistant_text(CHAT, "<|im_end|>")
    demo = hf_tokenizer(tmp_path / "demo", CHAT_TEMPLATE, ["<unk>", "<s>", "</s>"], "</s>")
    ids, mask = render_conversation(demo, CHAT, "x:1")
    assert demo.decode([t for t, m in zip(ids, mask) if m]) == assistant_text(CHAT, "</s>")
    assert mask[-1] == 0 and demo.decode(ids[-1:]) == "\n"  # the separator after the last turn is not trained


# as Qwen3's template does without reasoning content: an empty think block for the last assistant turn only
LAST_THINKS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
               "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
               "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_rendering_when_earlier_turns_render_differently(tmp_path):
    """A template that renders an assistant turn differently once later turns follow: the earlier turns' spans are
    their content and end-of-turn token, the last one's its whole rendered turn (think block included, as the
    model generates it after the generation prompt)."""
    tok = hf_tokenizer(tmp_path / "t", LAST_THINKS, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>")
    ids, mask = render_conversation(tok, CHAT, "x:1")
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == \
        CHAT[2]["content"] + "<|im_end|>" + "<think>\n\n</think>\n\n" + CHAT[4]["content"] + "<|im_end|>"


def test_demo_tokenizer_equals_its_sentencepiece_model(tmp_path):
    """tools/chat_demo.py's Hugging Face folder encodes and decodes as the sentencepiece model it converts (one
    trained here as tools/prepare_data.py trains the demo's), and its chat template renders the demo's form."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x  # twice\n\n" * 50 + TEXT + "\n\tTabs and  two  spaces, ünïcode\n")
    prepare(["--input", str(corpus), "--train-sp", "400", "--out", str(tmp_path / "sp"), "--val-fraction", "0"])
    sentencepiece_to_hf(tmp_path / "sp/tokenizer.model", tmp_path / "hf", CHAT_TEMPLATE, check_files=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp/tokenizer.model"))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "class A:\n  def g(self):  # comment, ünïcode and € signs\n\treturn  None\n" + TEXT
    assert hf.encode(text, add_special_tokens=False) == sp.encode(text) and hf.decode(sp.encode(text)) == text
    assert len(hf) == sp.get_piece_size() and hf.eos_token_id == sp.eos_id()
    ids, mask = render_conversation(hf, CHAT[1:3], "x:1")
    assert hf.decode(ids) == "<s>user\nWhat does len do?</s>\n<s>assistant\nIt returns the number of items of a container.</s>\n"
    assert hf.decode([t for t, m in zip(ids, mask) if m]) == assistant_text(CHAT[1:3], "</s>")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_bad_lines_name_file_and_line(tmp_path):
    demo = tmp_path / "demo"
    hf_tokenizer(demo, CHAT_TEMPLATE, ["<unk>", "<s>", "</s>"], "</s>")  # this template rejects unknown roles
    good = {"messages": CHAT[1:3]}
    cases = {"no \"messages\" field": {"text": "hi"}, "empty conversation": {"messages": []},
             "the chat template rejects": {"messages": [{"role": "tool", "content": "x"}]},
             "is not {\"role\": str": {"messages": [{"role": "user"}]}, "not valid JSON": "{oops"}
    for i, (expected, bad) in enumerate(cases.items()):
        path = write_jsonl(tmp_path / f"bad{i}.jsonl", [good, "", bad])
        with pytest.raises(ValueError, match=re.escape(f"{path}:3") + ".*" + re.escape(expected)):
            prepare(["--chat", "--input", str(path), "--hf-tokenizer", str(demo), "--seq-len", "64",
                     "--out", str(tmp_path / f"out{i}")])


def test_over_long_conversations_truncated_or_skipped(chatml, tmp_path):
    """A conversation longer than --seq-len keeps its first --seq-len tokens; one whose first trained token lies
    beyond is skipped; both counted (printed and in meta.json)."""
    tok, folder = chatml
    short = {"messages": CHAT[1:3]}
    n_short = len(render_conversation(tok, short["messages"], "")[0])
    long_answer = {"messages": [CHAT[1], {"role": "assistant", "content": "items " * 200}]}
    long_question = {"messages": [{"role": "user", "content": "why " * 200}, CHAT[2]]}
    path = write_jsonl(tmp_path / "c.jsonl", [short, long_answer, long_question, short])
    meta = prepare(["--chat", "--input", str(path), "--hf-tokenizer", str(folder), "--seq-len", str(n_short + 4),
                    "--out", str(tmp_path / "out"), "--val-fraction", "0"])
    assert (meta["truncated"], meta["skipped"], meta["num_documents"]) == (1, 1, 3)
    assert meta["conversations"] == {"truncated": 1, "skipped": 1}
    assert meta["max_document_tokens"] == n_short + 4
    with pytest.raises(ValueError, match=r"longer than --seq-len .* train with --seq-len >= \d+"):
        TokenLoader(tmp_path / "out", n_short - 1, 1)


def test_loader_packs_whole_conversations(chatml, tmp_path):
    """Every window holds whole conversations plus untrained padding; over an epoch every conversation appears
    once; the labels that are trained decode to exactly the assistant turns of the window's conversations."""
    tok, folder = chatml
    chats = conversations([(f"f{i}", "answer " * (i % 5 + 1) + str(i)) for i in range(24)])  # 1 or 2 turns each
    path = write_jsonl(tmp_path / "c.jsonl", chats)
    prepare(["--chat", "--input", str(path), "--hf-tokenizer", str(folder), "--seq-len", "512",
             "--out", str(tmp_path / "out"), "--val-fraction", "0"])
    rendered = {tuple(render_conversation(tok, c["messages"], "")[0]): c for c in chats}
    loader = TokenLoader(tmp_path / "out", 512, 2)
    seen = []
    for _ in range(loader.num_samples // 2):
        for ids, labels, docs in zip(*loader.next_batch(documents=True)):
            assert ids.shape == labels.shape == docs.shape == (512,)
            for d in docs.unique().tolist():
                doc_ids, doc_labels = ids[docs == d].tolist(), labels[docs == d]
                if tuple(doc_ids) not in rendered:  # the padding: last, never trained
                    assert d == docs.max() and (doc_labels == -100).all()
                    continue
                seen.append(tuple(doc_ids))
                assert doc_labels[-1] == -100  # nothing predicted across the boundary
                trained = tok.decode(doc_labels[doc_labels != -100].tolist())
                assert trained == assistant_text(rendered[tuple(doc_ids)]["messages"], "<|im_end|>")
    assert len(seen) == len(set(seen)) and set(seen) <= set(rendered)  # each at most once in the epoch
    assert len(seen) == len(chats) or loader.num_samples % 2  # all of them when the epoch is whole batches


def chat_dataset(path, n=40, seed=0, vocab=256, max_len=30):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        length = int(torch.randint(3, max_len + 1, (), generator=g))
        docs.append((torch.randint(3, vocab, (length,), generator=g).tolist(),
                     (torch.rand(length, generator=g) > 0.4).int().tolist()))
    write_shards(docs, path, vocab_size=vocab, eos_id=2, tokenizer={"kind": "none"}, shard_tokens=97, loss_masks=True)
    return path, docs


def test_packing_loader_resume_and_ranks(tmp_path):
    """A pure function of (seed, step): a resumed loader continues exactly, and dp ranks' rows together are the
    one-rank batch, at any dp size; another seed packs and orders differently."""
    path, _ = chat_dataset(tmp_path / "d")
    full = TokenLoader(path, 32, 4, seed=3)
    ref = [full.next_batch(documents=True) for _ in range(12)]  # several epochs
    first = TokenLoader(path, 32, 4, seed=3)
    for _ in range(5):
        first.next_batch()
    resumed = TokenLoader(path, 32, 4, seed=3)
    resumed.load_state_dict(first.state_dict())
    for step in range(5, 12):
        got = resumed.next_batch(documents=True)
        assert all(torch.equal(a, b) for a, b in zip(got, ref[step]))
    ranks = [TokenLoader(path, 32, 4, rank=r, world=2, seed=3) for r in range(2)]
    for step in range(12):
        parts = [rk.next_batch(documents=True) for rk in ranks]
        assert all(torch.equal(torch.cat([p[i] for p in parts]), ref[step][i]) for i in range(3))
    other = TokenLoader(path, 32, 4, seed=4).next_batch()[0]
    assert not torch.equal(other, ref[0][0])


def test_positions_restart_per_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    assert positions_in_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 0, 0, 1]]


def test_loss_is_the_mean_over_trained_tokens(tmp_path):
    """train.py's step-1 loss on conversations (4 micro-batches, whole documents one per window) equals the
    cross-entropy of transformers' Qwen3-MoE over the trained tokens of each conversation run alone, summed and
    divided by their count: prompts and padding contribute nothing, and micro-batches are weighted by trained
    tokens, not averaged."""
    from transformers import AutoModelForCausalLM

    from recipes.qwen3_30b_a3b import train
    from tests.conftest import TINY_TRAIN_CONFIG
    from tools.hf_parity import make_tiny_hf_model

    path, docs = chat_dataset(tmp_path / "d", n=8, max_len=10)
    docs = [(ids + [5] * 30, mask + [1] * 30) for ids, mask in docs]  # 33-40 tokens: one per window of 40
    write_shards(docs, path, vocab_size=256, eos_id=2, tokenizer={"kind": "none"}, loss_masks=True)
    hf = make_tiny_hf_model(TINY_TRAIN_CONFIG, tmp_path / "hf")
    history, _ = train.main(train_args("unused", path, tmp_path / "run", steps=1, lr=0.0, hf_checkpoint=hf,
                                       seq_len=40, global_batch=8, micro_batch=2, grad_clip=0.0))
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    total, count = 0.0, 0
    for ids, mask in docs:
        logits_SV = ref(torch.tensor([ids])).logits[0, :-1]
        targets = torch.tensor(ids[1:])
        keep = torch.tensor(mask[1:]).bool()
        total += torch.nn.functional.cross_entropy(logits_SV[keep], targets[keep], reduction="sum").item()
        count += int(keep.sum())
    assert history[0]["trained_tokens"] == count
    # fp32 sums over ~200 tokens in another order than transformers' (fused experts, sdpa): ~1e-7 relative
    assert abs(history[0]["loss"] - total / count) <= 1e-5 * total / count


def test_raw_text_documents_end_at_each_eos(tmp_path):
    """Raw text keeps its stream windows; with documents=True each token's document counts the eos tokens before
    it in its window (an eos belongs to the document it ends), which --document-mask masks by."""
    write_shards([[5, 6, 7], [8, 9], [10, 11, 12, 13]], tmp_path / "t", vocab_size=100, eos_id=1,
                 tokenizer={"kind": "none"})
    loader = TokenLoader(tmp_path / "t", 5, 2)
    assert not loader.documents and loader.num_samples == 2
    ids, labels, docs = loader.next_batch(documents=True)
    for row_ids, row_labels, row_docs in zip(ids.tolist(), labels.tolist(), docs.tolist()):
        assert row_labels[:-1] == row_ids[1:]  # the stream: every label trained, across documents too
        expected, d = [], 0
        for t in row_ids:
            expected.append(d)
            d += t == 1
        assert row_docs == expected


def test_documents_dataset_missing_fields(tmp_path):
    path, _ = chat_dataset(tmp_path / "d", n=4)
    meta = json.loads((path / "meta.json").read_text())
    del meta["masks"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="without masks; rerun tools.prepare_data --force"):
        TokenLoader(path, 32, 1)


def test_prepare_data_skill_checks_conversations(chatml, tmp_path, capsys):
    """skills/prepare-data on --chat data: the trained tokens and the first answer in its table, --seq-len in
    the printed command."""
    import importlib.util

    from tests.test_launch import ROOT

    spec = importlib.util.spec_from_file_location("prepare_skill", ROOT / "skills/prepare-data/scripts/prepare.py")
    skill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(skill)
    tok, folder = chatml
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}] * 3)
    skill.main(["--recipe", "qwen3_30b_a3b", "--config", str(ROOT / "recipes/qwen3_30b_a3b/config_tiny.json"), "--chat",
                "--input", str(path), "--hf-tokenizer", str(folder), "--seq-len", "200", "--out", str(tmp_path / "o"),
                "--val-fraction", "0"])
    out = capsys.readouterr().out
    assert f"OK   first training answer decodes: {assistant_text(CHAT, '<|im_end|>')[:60]!r}" in out
    assert "OK   3 conversations:" in out and out.rstrip().endswith("--seq-len 200")


def test_document_mask_cost_tool_runs():
    from tools import bench

    res = bench.main(["--document-mask-cost", "--seq-len", "32", "--micro-batch", "1", "--steps", "1", "--rounds", "1",
                      "--warmup", "0"])
    assert set(res) == set(recipe_names()) and all(r["ratio"] > 0 for r in res.values())
