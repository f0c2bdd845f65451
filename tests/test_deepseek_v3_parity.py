"""DeepSeek-V3 recipe against transformers' DeepseekV3ForCausalLM (tiny random models, fp32 and float64, CPU):
logits, every gradient and the export round trip; the released configs' sizes (DeepSeek-V3, Moonlight-16B-A3B,
Kimi K2) against transformers' on meta; FP8 block-quantized checkpoints against a hand dequantization; the
router's group limit and expert bias."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from recipes.deepseek_v3 import model as deepseek
from recipes.deepseek_v3.model import Model, ModelConfig, Router, load_hf_checkpoint
from tests.conftest import config_with
from tests.recipe_checks import assert_partial_model_reads_only_its_tensors
from tools.hf_parity import check_recipe, format_table

BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=1024)
# YaRN changes the rope frequencies at every length (V3's mscale = mscale_all_dim: attention factor 1, softmax
# scale times mscale^2); with 256 and 16 rope dims the ramp is [0.2, 3.2] before the truncation to whole dims
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4, original_max_position_embeddings=256, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)

CONFIGS = {
    # groups: top-3 from the best 2 of 4 groups of 2, q LoRA, 2 shared experts, YaRN with 16 rope dims
    "groups_qlora_yarn": dict(num_experts_per_tok=3, qk_rope_head_dim=16, rope_parameters=YARN),
    # no q LoRA, top-1 unnormalised (normalised, its weight is 1 exactly and the router's gradient 0), one group,
    # 2 dense layers, rope not interleaved
    "top1_noqlora_2dense": dict(q_lora_rank=None, num_experts_per_tok=1, norm_topk_prob=False, n_group=1,
                                topk_group=1, first_k_dense_replace=2, num_hidden_layers=4, rope_interleave=False),
    # 8 groups of 2 (the smallest), best 3, top-4, attention biases, mscale != mscale_all_dim
    "8groups_bias": dict(n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=4,
                                      attention_bias=True, n_shared_experts=1,
                                      rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707}),
}


def save_tiny(tmp_path, seed=0, bias=True, **overrides) -> str:
    """A random transformers model; with bias, e_score_correction_bias random too (transformers starts it at 0),
    large enough to change the choice of some tokens."""
    torch.manual_seed(seed)
    ref = DeepseekV3ForCausalLM(DeepseekV3Config(**{**BASE, **overrides}))
    if bias:
        with torch.no_grad():
            for layer in ref.model.layers[ref.config.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    ref.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "float64"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_grads_and_export_match_transformers(tmp_path, name, dtype):
    rows = check_recipe("deepseek_v3", save_tiny(tmp_path, **CONFIGS[name]), dtype=dtype)
    print("\n" + name + "\n" + format_table(rows))
    assert all(r.ok for r in rows), "\n" + format_table(rows)


def test_partial_model_reads_only_its_tensors(tmp_path):
    # attention (q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o) + 2 layer norms + router + its bias + 3 shared
    # + 2 experts x 3
    assert_partial_model_reads_only_its_tensors(deepseek, save_tiny(tmp_path), 7 + 2 + 2 + 3 + 3 * 2)


@pytest.mark.parametrize("file,expected", [("config.json", 671_026_404_352), ("config_moonlight.json", None),
                                           ("config_kimi_k2.json", None)])
def test_released_config_parameter_count(file, expected):
    """On meta, MTP off (transformers has no MTP module): the recipe's count equals transformers' for the same
    config.json fields, and DeepSeek-V3's is the published 671B (685B with its MTP module)."""
    path = deepseek.real_config_path().with_name(file)
    hf = json.loads(path.read_text())
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        ref = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in hf.items() if k != "model_type"}))
        mtp = Model(cfg)
        cfg.num_nextn_predict_layers = 0
        model = Model(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in ref.parameters())
    assert expected is None or count == expected
    if hf.get("num_nextn_predict_layers"):
        # V3's MTP module: one MoE layer 11,507,286,016 + eh_proj 2H x H 102,760,448 + 3 norms of H; with the stored
        # copies of the embedding and head (2 x 926,679,040) the checkpoint's 684.5B, published as "685B"
        assert sum(p.numel() for p in mtp.parameters()) - count == 11_610_067_968
    if file == "config.json":
        mscale = 0.1 * math.log(40) + 1  # YaRN factor 40, mscale_all_dim 1
        assert model.layers["3"].self_attn.scale == pytest.approx(192**-0.5 * mscale**2)


def quantize_fp8_blocks(w_NK, block):
    """Hand quantization to DeepSeek's format: per block x block tile, scale_inv = amax / 448, q = w / scale_inv."""
    N, K = w_NK.shape
    scale = torch.zeros(-(-N // block), -(-K // block))
    q = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w_NK[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max() / 448
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_checkpoint_is_dequantized_on_load(tmp_path):
    """A transformers checkpoint rewritten in the released format: every matrix but the embedding, head and routers
    as float8_e4m3fn with weight_scale_inv per 128x128 block (sizes 200, 300, 136: partial last blocks); loading
    gives, element by element, q * the scale of its block, computed here by a loop over the tiles. The experts as
    the release stores them, one key per expert and matrix."""
    path = save_tiny(tmp_path / "hf", hidden_size=200, intermediate_size=300, moe_intermediate_size=136,
                     num_attention_heads=2, num_key_value_heads=2, q_lora_rank=136, kv_lora_rank=136)
    from safetensors.torch import load_file

    tensors, expected = load_file(f"{path}/model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t, prefix = tensors.pop(name), name.rsplit(".", 1)[0]
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):  # [E, 2I, H]: gate rows first
                gate, up = t[e].chunk(2)
                tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"] = gate, up
            else:
                tensors[f"{prefix}.{e}.down_proj.weight"] = t[e]
    for name in list(tensors):
        t = tensors[name]
        if t.dim() == 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight")):
            q, scale = quantize_fp8_blocks(t, 128)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            expected[name] = torch.stack([torch.stack([q[n, k].float() * scale[n // 128, k // 128]
                                                       for k in range(0, t.shape[1], 7)]) for n in range(0, t.shape[0], 5)])
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    model = Model(ModelConfig.from_hf(path))
    load_hf_checkpoint(model, path)
    state = deepseek.hf_state_dict(model)
    assert len(expected) == 8 + 2 * (5 + 3 + 8 * 3)  # dense layer: 5 attention + 3 MLP; MoE: + 3 shared, 8 x 3 experts
    for name, want in expected.items():
        got = state[name][::5, ::7].contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_config_errors(tmp_path):
    save_tiny(tmp_path / "ckpt")

    with pytest.raises(ValueError, match="num_key_value_heads must equal"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", num_key_value_heads=2))
    with pytest.raises(ValueError, match="scoring_func='softmax' is not supported"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", scoring_func="softmax"))
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", n_group=3))
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds the experts of topk_group groups"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", num_experts_per_tok=5))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=2"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", num_nextn_predict_layers=2))
    with pytest.raises(ValueError, match="model_type is 'deepseek_v2'"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", model_type="deepseek_v2"))


def test_group_limit_and_expert_bias_move_the_choice_not_the_weights():
    """Groups ranked by the sum of their two best biased scores: a large bias on expert 5 puts it (and, top-2 within
    one kept group, its group mate 4) in every token's choice; the weights stay the unbiased sigmoid scores,
    normalised over the chosen, times routed_scaling_factor."""
    cfg = ModelConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0, n_group=4,
                      topk_group=1)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x_TH = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    _, _, ids = router(x_TH)
    assert (ids != 5).all(1).any()
    router.expert_bias[5] = 10.0
    _, weights, biased_ids = router(x_TH)
    assert set(biased_ids.flatten().tolist()) == {4, 5}
    scores = torch.sigmoid(x_TH @ router.weight.T).gather(1, biased_ids)
    torch.testing.assert_close(weights, 2.0 * scores / scores.sum(1, keepdim=True), rtol=1e-6, atol=0)
