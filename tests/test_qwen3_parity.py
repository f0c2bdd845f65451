"""Qwen3-MoE recipe against transformers' Qwen3MoeForCausalLM (tiny random models, fp32, CPU)."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from recipes.qwen3_30b_a3b import model as qwen3
from recipes.qwen3_30b_a3b.model import Model, ModelConfig, load_hf_checkpoint, real_config_path
from tests.recipe_checks import assert_aux_loss_matches, assert_partial_model_reads_only_its_tensors
from tools.hf_parity import check_recipe, format_table

BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
            max_position_embeddings=256, rope_theta=10000.0)

CONFIGS = {
    # head_dim 16 != hidden/heads 12, top-k 2, renormalised
    "topk2_norm": dict(norm_topk_prob=True),
    # top-1 without renormalisation, 3 layers with a dense MLP layer in the middle
    "top1_dense_layer": dict(num_experts_per_tok=1, norm_topk_prob=False, num_hidden_layers=3, mlp_only_layers=[1]),
    # k = E, MHA (no GQA), attention biases, decoder_sparse_step 2 (odd layers dense)
    "topk_all_bias_sparse_step": dict(num_experts_per_tok=6, num_key_value_heads=4, attention_bias=True,
                                      decoder_sparse_step=2, num_hidden_layers=4),
}


def save_tiny(tmp_path, seed=0, **overrides) -> str:
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**BASE, **overrides})).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_grads_and_export_match_transformers(tmp_path, name):
    rows = check_recipe("qwen3_30b_a3b", save_tiny(tmp_path, **CONFIGS[name]))
    assert all(r.ok for r in rows), "\n" + format_table(rows)


def test_aux_loss_and_its_gradient_match_transformers(tmp_path):
    path = save_tiny(tmp_path, num_hidden_layers=3, norm_topk_prob=True)
    assert_aux_loss_matches(Qwen3MoeForCausalLM, qwen3, path, BASE["vocab_size"], lambda model, ref: [
        (model.layers[str(i)].mlp.gate.weight, ref.model.layers[i].mlp.gate.weight) for i in range(3)])


def test_partial_model_reads_only_its_tensors(tmp_path):
    # attention (4 projections + 2 norms) + 2 layer norms + router + 2 experts x 3
    assert_partial_model_reads_only_its_tensors(qwen3, save_tiny(tmp_path, num_hidden_layers=3), 9 + 3 * 2)


def test_released_config_parameter_count():
    with torch.device("meta"):
        model = Model(ModelConfig.from_hf(real_config_path()))
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624


def test_checkpoint_errors(tmp_path):
    path = save_tiny(tmp_path / "ckpt")
    wrong = ModelConfig.from_hf(path)
    wrong.moe_intermediate_size = 32
    with pytest.raises(ValueError, match=r"has shape \[24, 48\] but the model config expects \[32, 48\]"):
        load_hf_checkpoint(Model(wrong), path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(Model(ModelConfig.from_hf(path)), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither"):
        load_hf_checkpoint(Model(ModelConfig.from_hf(path)), tmp_path / "empty")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_hf_checkpoint(Model(ModelConfig.from_hf(path)), path)
    with pytest.raises(FileNotFoundError, match="no Hugging Face config"):
        ModelConfig.from_hf(tmp_path / "empty")


def test_sharded_index_round_trip(tmp_path):
    """A multi-file checkpoint with model.safetensors.index.json: transformers and our loader both read it."""
    from core.hf_io import INDEX_NAME, write_hf_folder
    from recipes.qwen3_30b_a3b.model import hf_state_dict

    path = save_tiny(tmp_path / "single")
    model = Model(ModelConfig.from_hf(path))
    load_hf_checkpoint(model, path)
    write_hf_folder(tmp_path / "sharded", hf_state_dict(model), model.cfg.to_hf(), max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / INDEX_NAME).is_file() and len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    reloaded = Model(ModelConfig.from_hf(tmp_path / "sharded"))
    load_hf_checkpoint(reloaded, tmp_path / "sharded")
    ids = torch.randint(0, BASE["vocab_size"], (1, 10))
    ref = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))
        assert (ref(input_ids=ids).logits - model(ids)).abs().max() <= 1e-4


def test_fused_expert_layout_loads_a_slice(tmp_path):
    """Checkpoints with fused experts ([E, 2I, H] gate_up_proj, transformers' in-memory layout) load too, and an
    expert shard reads only its rows."""
    from core.hf_io import write_hf_folder

    path = save_tiny(tmp_path / "per_expert")
    ref = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref.state_dict()
    write_hf_folder(tmp_path / "fused", dict(ref.state_dict()), ModelConfig.from_hf(path).to_hf())
    full, fused = Model(ModelConfig.from_hf(path)), Model(ModelConfig.from_hf(path))
    load_hf_checkpoint(full, path)
    load_hf_checkpoint(fused, tmp_path / "fused")
    for key, value in full.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    shard = Model(ModelConfig.from_hf(path), layers=[0], expert_ids=[4, 5], embed=False, head=False)
    load_hf_checkpoint(shard, tmp_path / "fused")
    assert torch.equal(shard.layers["0"].mlp.experts.down_proj, full.layers["0"].mlp.experts.down_proj[4:6])
