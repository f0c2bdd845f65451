"""DeepSeek-V3's multi-token prediction (recipes/deepseek_v3/model.py: MTP, Model.prepare_batch, the "mtp" term
of Model.loss_sums) against the paper's formula (section 2.2) computed here in float64 from transformers' parts:
the main model is transformers' DeepseekV3ForCausalLM and the MTP block one transformers DeepseekV3DecoderLayer,
both loaded from the recipe's export (the released layout: model.layers.{num_hidden_layers}.*), combined by hand:
    h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]),   g = shared_head.norm(Layer(h')),
    L_MTP = -1/T' sum_i log softmax(lm_head(g_i))[t_{i+2}]
over the targets t_{i+2} that exist inside the document of i and are trained (loss mask); each document runs alone.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from core.data import positions_in_documents
from recipes.deepseek_v3.model import Model, ModelConfig, check_setup, load_hf_checkpoint, save_hf_checkpoint
from tools.hf_parity import KeepFloat64

FLOAT64 = 1e-10  # both sides float64 (tools/hf_parity.py:FLOAT64_TOLERANCE): a wrong order of the halves, a
# missing norm or a target shifted by one changes the loss by O(1)


def mtp_config(tmp_path, **overrides):
    config = {**check_setup()["config"], "num_nextn_predict_layers": 1, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_hf(tmp_path / "config.json")


def reference(folder, cfg):
    """transformers' main model and MTP parts from the recipe's export, float64."""
    with KeepFloat64():
        main = DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")
    hf_cfg, L = main.config, cfg.num_hidden_layers
    layer = DeepseekV3DecoderLayer(hf_cfg, L).double()
    import glob

    from safetensors.torch import load_file

    tensors = {k: v for f in glob.glob(f"{folder}/*.safetensors") for k, v in load_file(f).items()}
    prefix = f"model.layers.{L}."
    own = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    # the released layout stores each expert apart; transformers' layer fuses them as it does on load
    E, fused = cfg.num_experts, {}
    gate_up = [torch.cat([own[f"mlp.experts.{e}.gate_proj.weight"], own[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(E)]
    fused["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    fused["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    state = {k: v for k, v in own.items() if ".experts." not in k} | fused
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not missing and sorted(unexpected) == ["eh_proj.weight", "embed_tokens.weight", "enorm.weight",
                                                  "hnorm.weight", "shared_head.head.weight", "shared_head.norm.weight"]
    norms = {name: DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).double() for name in ("enorm", "hnorm", "shared_head.norm")}
    for name, norm in norms.items():
        norm.weight.data.copy_(own[f"{name}.weight"])
    assert torch.equal(own["embed_tokens.weight"], tensors["model.embed_tokens.weight"])  # the shared copies
    assert torch.equal(own["shared_head.head.weight"], tensors["lm_head.weight"])
    return main, layer, norms, own["eh_proj.weight"]


def mtp_loss_alone(ref, ids_S, labels_S):
    """Sum over i of -log p(t_{i+2}) for one document alone, targets labels[i + 1] (labels[j] = t_{j+1}, -100
    untrained), and the number of targets."""
    main, layer, norms, eh_proj = ref
    S = ids_S.shape[0]
    with KeepFloat64():
        h = main.model(input_ids=ids_S[None]).last_hidden_state  # after the final norm
        emb = main.model.embed_tokens(ids_S[None, 1:])  # Emb(t_{i+1}) for i = 0..S-2
        x = torch.cat([norms["enorm"](emb), norms["hnorm"](h[:, :-1])], -1) @ eh_proj.T
        positions = torch.arange(S - 1)[None]
        mask = torch.full((S - 1, S - 1), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        g = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=main.model.rotary_emb(x, positions))
        logits = main.lm_head(norms["shared_head.norm"](g))[0]
    targets = labels_S[1:]
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), int((targets != -100).sum())


def test_mtp_loss_equals_the_paper_formula_with_documents_and_loss_masks(tmp_path):
    torch.set_default_dtype(torch.float64)
    try:
        cfg = mtp_config(tmp_path)
        torch.manual_seed(0)
        model = Model(cfg)
        save_hf_checkpoint(model, tmp_path / "hf")
        ref = reference(tmp_path / "hf", cfg)
        S, lengths = 32, [[10, 5, 17], [20, 9, 3]]  # packed documents; the last of row 1 is padding
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, cfg.vocab_size, (2, S), generator=g)
        labels = torch.roll(ids, -1, 1)
        docs = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in lengths])
        spans = [(b, sum(row[:d]), sum(row[:d + 1])) for b, row in enumerate(lengths) for d in range(3)]
        for b, _, hi in spans:
            labels[b, hi - 1] = -100  # a document's last token predicts nothing (core/data.py)
        labels[1, S - 3:] = -100  # padding
        labels[0, 2] = labels[0, 13] = labels[1, 0] = -100  # untrained (prompt) tokens: 51 - 2 MTP targets (labels[1, 0]
        # is only a main-head label)
        extras = model.prepare_batch(ids, labels, docs, positions_in_documents(docs))
        loss = model.forward_train(ids, labels, positions_in_documents(docs), docs, extras).terms["mtp"]
        expected, count = 0.0, 0
        for b, lo, hi in spans[:-1]:
            part, n = mtp_loss_alone(ref, ids[b, lo:hi], labels[b, lo:hi])
            expected, count = expected + part, count + n
        assert count == 49 and extras["mtp_targets"].sum() == count
        torch.testing.assert_close(loss, expected, rtol=FLOAT64, atol=0)
        # every parameter the MTP loss reaches gets transformers' gradient (main trunk, shared embedding and head)
        loss.backward()
        expected.backward()
        main, layer, _, _ = ref
        pairs = [(model.embed_tokens.weight, main.model.embed_tokens.weight), (model.lm_head.weight, main.lm_head.weight),
                 (model.layers["0"].self_attn.kv_b_proj.weight, main.model.layers[0].self_attn.kv_b_proj.weight),
                 (model.mtp.layer.self_attn.o_proj.weight, layer.self_attn.o_proj.weight)]
        for ours, theirs in pairs:
            assert theirs.grad.norm() > 0
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=FLOAT64, atol=1e-14)
    finally:
        torch.set_default_dtype(torch.float32)


def test_mtp_weights_load_and_export_where_the_release_keeps_them(tmp_path):
    """The export's MTP tensors sit at layer num_hidden_layers and come back; transformers loads the export (and
    drops them); a folder without MTP tensors (transformers' own) leaves the module at its start values."""
    cfg = mtp_config(tmp_path)
    torch.manual_seed(0)
    model = Model(cfg)
    save_hf_checkpoint(model, tmp_path / "hf")
    torch.manual_seed(1)
    other = Model(cfg)
    load_hf_checkpoint(other, tmp_path / "hf")
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    ref = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    torch.testing.assert_close(ref(input_ids=ids).logits, model(ids), rtol=1e-4, atol=1e-5)
    ref.save_pretrained(tmp_path / "transformers")
    fresh = Model(cfg)
    start = {n: p.clone() for n, p in fresh.named_parameters() if n.startswith("mtp.")}
    load_hf_checkpoint(fresh, tmp_path / "transformers")
    assert all(torch.equal(p, start[n]) for n, p in fresh.named_parameters() if n.startswith("mtp."))
    assert len(start) == 4 + 7 + 2 + 1 + 3 + 2  # enorm, hnorm, eh_proj, norm; attention; layer norms; router; shared; experts


def test_flops_by_layer_counts_the_mtp_module():
    """The last stage's entry of flops_by_layer holds the MTP module (its layer, eh_proj, its head): the whole list
    equals torch's FLOP counter over forward_train with MTP x 3 (GEMMs exactly, attention half the counted S x S as
    tests/test_plan.py counts it), and the MTP part is the counter's difference with MTP switched off."""
    from recipes.deepseek_v3 import model as mod
    from tests.test_plan import counted_flops

    seq, batch = 16, 2
    totals = {}
    for mtp in (1, 0):
        cfg = ModelConfig.from_hf(mod.tiny_config_path())
        cfg.num_nextn_predict_layers = mtp
        torch.manual_seed(0)
        counted = counted_flops(mod, cfg, seq, batch, training_only=True)
        parts = mod.flops_by_layer(cfg, seq)
        assert len(parts) == cfg.num_hidden_layers + 2 and (set(parts[-1]) > {"head"}) == bool(mtp)
        # with gradients on (the MTP module runs only then) CPU attention pads the values' head dim to q's (SDPA's
        # fused kernel takes one; core/attention.py:attention), and the counter counts the zero columns too
        D, E = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        padding = 2 * batch * cfg.num_attention_heads * seq * seq * (D - E) * (cfg.num_hidden_layers + mtp)
        totals[mtp] = 3 * (counted["gemm"] + (counted["attention"] - padding) / 2)
        assert seq * batch * sum(sum(p.values()) for p in parts) == pytest.approx(totals[mtp], rel=1e-9)
    mtp_part = sum(v for k, v in mod.flops_by_layer(ModelConfig.from_hf(mod.tiny_config_path()), seq)[-1].items()
                   if k.startswith("mtp_"))
    assert seq * batch * mtp_part == pytest.approx(totals[1] - totals[0], rel=1e-9)
