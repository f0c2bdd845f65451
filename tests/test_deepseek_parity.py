"""DeepSeek-V2 recipe against transformers' DeepseekV2ForCausalLM (tiny random models, fp32, CPU), the
sequence-wise balance loss against the formula, and the released config's size."""

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from recipes.deepseek_v2_lite import model as deepseek
from recipes.deepseek_v2_lite.model import Model, ModelConfig, load_hf_checkpoint, real_config_path, save_hf_checkpoint
from tests.conftest import config_with
from tests.recipe_checks import assert_partial_model_reads_only_its_tensors
from tools.hf_parity import check_recipe, format_table, grads_by_checkpoint_name

BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
            max_position_embeddings=1024, rope_theta=10000.0)
# YaRN changes the rope frequencies at every length; with 256 and 16 rope dims the ramp is [0.2, 3.2] before the
# truncation to whole dims
YARN = dict(type="yarn", factor=4, original_max_position_embeddings=256, beta_fast=32, beta_slow=1)

CONFIGS = {
    # YaRN with mscale != mscale_all_dim: cos/sin scaled, softmax scale mscale^2; 16 rope dims
    "yarn_2shared_1dense": dict(rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707}, qk_rope_head_dim=16),
    # plain rope, top-1, routed_scaling_factor 2.5, one shared expert, 2 dense layers
    "top1_scaled_1shared_2dense": dict(num_experts_per_tok=1, routed_scaling_factor=2.5, n_shared_experts=1,
                                       first_k_dense_replace=2, num_hidden_layers=4),
    # group-limited top-3 over 4 groups of 2 (best 2 groups), q compression, biases, Lite's YaRN (mscale equal)
    "group_limited_qlora_bias": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3,
                                     q_lora_rank=20, attention_bias=True, mlp_bias=True,
                                     rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
}


def save_tiny(tmp_path, seed=0, **overrides) -> str:
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(DeepseekV2Config(**{**BASE, **overrides})).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_grads_and_export_match_transformers(tmp_path, name):
    rows = check_recipe("deepseek_v2_lite", save_tiny(tmp_path, **CONFIGS[name]))
    print("\n" + name + "\n" + format_table(rows))
    assert all(r.ok for r in rows), "\n" + format_table(rows)


def balance_loss_formula(router_logits, k: int, batch: int):
    """DeepSeek-V2's sequence-wise balance loss, written out: for each MoE layer and sequence, sum over experts of
    f_e = E/(k*T) * (slots routed to e) times P_e = mean router probability of e; mean over sequences; summed
    over layers. Greedy top-k of the softmax, from transformers' router logits [B*T, E] per layer."""
    total = 0.0
    for logits in router_logits:
        probs = logits.float().softmax(-1).view(batch, -1, logits.shape[-1])
        T, E = probs.shape[1], probs.shape[2]
        chosen = torch.zeros_like(probs).scatter(2, probs.topk(k, -1).indices, 1.0)  # [B, T, E] one per slot
        f = E / (k * T) * chosen.sum(1)
        total = total + (f * probs.mean(1)).sum(1).mean()
    return total


def test_balance_loss_and_its_gradient_match_the_formula(tmp_path):
    path = save_tiny(tmp_path, num_hidden_layers=4, num_experts_per_tok=3, first_k_dense_replace=1)
    ref = DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = Model(ModelConfig.from_hf(path))
    load_hf_checkpoint(model, path)
    ids = torch.randint(0, BASE["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(1))
    router_logits = ref(input_ids=ids, output_router_logits=True).router_logits
    assert len(router_logits) == 3  # MoE layers 1..3
    ref_aux = balance_loss_formula(router_logits, k=3, batch=3)
    aux = model.forward_train(ids, ids).aux_loss
    torch.testing.assert_close(aux, ref_aux, rtol=1e-6, atol=0)
    ref_aux.backward()
    aux.backward()  # every parameter upstream of a router gets this gradient, not only the router weights
    ref_grads = grads_by_checkpoint_name(ref, lambda m, d: m.save_pretrained(d))
    grads = grads_by_checkpoint_name(model, save_hf_checkpoint)
    assert grads.keys() == ref_grads.keys()
    worst = max(((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp(min=1e-30)).item()
                for n, g in grads.items() if ref_grads[n].norm() > 0)
    assert worst <= 1e-5, worst
    assert ref_grads["model.layers.2.mlp.gate.weight"].norm() > 0 and ref_grads["model.embed_tokens.weight"].norm() > 0


def test_partial_model_reads_only_its_tensors(tmp_path):
    # attention (q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o) + 2 layer norms + router + 3 shared + 2 experts x 3
    assert_partial_model_reads_only_its_tensors(deepseek, save_tiny(tmp_path, q_lora_rank=20), 7 + 2 + 1 + 3 + 3 * 2)


def test_released_config_parameter_count():
    with torch.device("meta"):
        model = Model(ModelConfig.from_hf(real_config_path()))
    assert sum(p.numel() for p in model.parameters()) == 15_706_484_224
    cfg = model.cfg
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.num_experts, cfg.first_k_dense_replace) == (None, 512, 64, 1)
    mscale = 0.1 * 0.707 * math.log(40) + 1  # YaRN factor 40, mscale_all_dim 0.707
    assert model.layers["1"].self_attn.scale == pytest.approx(192**-0.5 * mscale**2)


def test_config_errors(tmp_path):
    path = save_tiny(tmp_path / "ckpt")

    with pytest.raises(ValueError, match="num_key_value_heads must equal"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", num_key_value_heads=2))
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", topk_method="noaux_tc"))
    with pytest.raises(ValueError, match="group_limited_greedy needs n_group"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", topk_method="group_limited_greedy", n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="model_type is 'qwen3_moe'"):
        ModelConfig.from_hf(config_with(tmp_path / "ckpt", model_type="qwen3_moe"))
    wrong = ModelConfig.from_hf(path)
    wrong.kv_lora_rank = 32
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa.weight has shape \[24, 48\] but the model config "
                                         r"expects \[40, 48\]"):
        load_hf_checkpoint(Model(wrong), path)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_expert_bias_moves_the_choice_not_the_weights(method):
    """Aux-loss-free balancing: a large bias on expert 5 puts it in every token's top-k (also through the group
    limit), and the routing weights stay the unbiased probabilities times routed_scaling_factor."""
    from recipes.deepseek_v2_lite.model import Router

    cfg = ModelConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
                      topk_method=method, n_group=4, topk_group=1)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x_TH = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    probs, _, ids = router(x_TH)
    assert (ids != 5).all(1).any()
    router.expert_bias[5] = 10.0
    biased_probs, weights, biased_ids = router(x_TH)
    assert (biased_ids == 5).any(1).all() and torch.equal(biased_probs, probs)
    torch.testing.assert_close(weights, 2.0 * probs.gather(1, biased_ids), rtol=0, atol=0)
    if method == "group_limited_greedy":  # one group: the other pick is expert 5's group mate, 4
        assert set(biased_ids.flatten().tolist()) == {4, 5}
