"""Qwen3.5-MoE recipe against transformers' Qwen3_5MoeForCausalLM (tiny random models, fp32, CPU): logits, every
gradient and the export round trip over several layer patterns; the released checkpoint's layout (multimodal
config, model.language_model. prefix, fused experts, MTP and vision tensors beside); the released config's
parameter count. (What every recipe shares, layouts included, is tests/test_recipes.py.)"""

import json

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from core.context import cp_positions, split_for_cp
from core.hf_io import write_hf_folder
from core.mesh import build_mesh
from recipes.qwen3_5_35b_a3b import model as qwen35
from recipes.qwen3_5_35b_a3b.model import (
    GatedDeltaNet,
    Model,
    ModelConfig,
    check_setup,
    load_config,
    load_hf_checkpoint,
    real_config_path,
)
from tests.multiproc import run_ranks
from tests.recipe_checks import assert_aux_loss_matches, assert_partial_model_reads_only_its_tensors
from tests.test_train import rel_err
from tools.hf_parity import check_recipe, format_table

LIN, FULL = "linear_attention", "full_attention"
BASE = dict(vocab_size=96, hidden_size=48, num_hidden_layers=3, layer_types=[LIN, LIN, FULL], num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, moe_intermediate_size=24,
            shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2, max_position_embeddings=256)

CONFIGS = {  # (config overrides, tokens per sequence)
    # the released pattern (full attention last), 4 value heads over 2 key heads, conv 4, 70 tokens: one whole
    # delta-rule chunk of 64 and a padded one
    "lin_lin_full_conv4": (dict(), 70),
    # full attention first, one KV head, top-1, conv 3, as many value as key heads, rope on half the head
    "full_first_one_kv_top1_conv3": (dict(layer_types=[FULL, LIN, LIN], num_key_value_heads=1, num_experts_per_tok=1,
                                          linear_conv_kernel_dim=3, linear_num_value_heads=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5}), 24),
    # alternating, 6 value heads over 2 key heads (3 each), k = E, no GQA in the full layers
    "alternating_3_values_per_key_topk_all": (dict(num_hidden_layers=4, layer_types=[LIN, FULL, LIN, FULL],
                                                   linear_num_value_heads=6, num_experts_per_tok=6,
                                                   num_key_value_heads=4), 24),
}


def save_tiny(path, seed=0, **overrides) -> str:
    """A random Qwen3_5MoeForCausalLM with transformers' init, except A_log: transformers draws exp(A_log) from
    (0.01, 16), so most heads decay their state by e^-10 and more per token and the delta rule barely recurs;
    (0.01, 1) keeps the state alive over tens of tokens, which the parity then tests."""
    torch.manual_seed(seed)
    ref = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**BASE, **overrides}))
    with torch.no_grad():
        for layer in ref.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(0.01, 1.0).log_()
    ref.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_grads_and_export_match_transformers(tmp_path, name):
    overrides, seq_len = CONFIGS[name]
    path = save_tiny(tmp_path, **overrides)
    rows = check_recipe("qwen3_5_35b_a3b", path, seq_len=seq_len)
    # and in float64 (bound 1e-10), except top-1: renormalised, its routing weight is p / p = 1 and the router's
    # exact gradient 0, so in float64 too both routers' gradients are rounding noise (~1e-19) with no reference
    # finer than it; in fp32 tools/hf_parity.py bounds each tensor by transformers' own fp32-vs-float64 noise
    if overrides.get("num_experts_per_tok") != 1:
        rows += check_recipe("qwen3_5_35b_a3b", path, seq_len=seq_len, dtype=torch.float64)
    print(f"\n{name}\n" + format_table(rows))
    assert all(r.ok for r in rows), "\n" + format_table(rows)


def test_aux_loss_and_its_gradient_match_transformers(tmp_path):
    path = save_tiny(tmp_path)
    assert_aux_loss_matches(Qwen3_5MoeForCausalLM, qwen35, path, BASE["vocab_size"], lambda model, ref: [
        (model.layers[str(i)].mlp.gate.weight, ref.model.layers[i].mlp.gate.weight) for i in range(3)])


def test_partial_model_reads_only_its_tensors(tmp_path):
    # layer 1 (linear): 2 norms, Gated DeltaNet (4 projections, conv, A_log, dt_bias, norm, out_proj), router,
    # shared expert (3) and its gate, 2 experts x 3
    assert_partial_model_reads_only_its_tensors(qwen35, save_tiny(tmp_path), 2 + 9 + 1 + 4 + 3 * 2)


def test_released_config_parameter_count():
    """The recipe's Model and transformers' Qwen3_5MoeForCausalLM of the released text config, both on meta."""
    hf = json.loads(real_config_path().read_text())
    with torch.device("meta"):
        model = Model(ModelConfig.from_hf(real_config_path()))
        ref = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{k: v for k, v in hf.items() if k != "model_type"}))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters()) == 34_660_610_688


def test_released_checkpoint_layout_loads(tmp_path):
    """The released folder: a multimodal config.json (text_config inside), the text model under
    model.language_model. with fused experts, and vision and MTP tensors that the recipe skips."""
    path = save_tiny(tmp_path / "hf")
    ref = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in ref.state_dict().items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors  # transformers' fused layout
    tensors |= {"mtp.fc.weight": torch.ones(4, 4), "model.visual.patch_embed.proj.weight": torch.ones(4, 4)}
    text = {**ModelConfig.from_hf(path).to_hf(), "model_type": "qwen3_5_moe_text"}
    write_hf_folder(tmp_path / "released", tensors, {"model_type": "qwen3_5_moe", "text_config": text,
                                                     "vision_config": {"depth": 1}})
    model = Model(ModelConfig.from_hf(tmp_path / "released"))
    names = load_hf_checkpoint(model, tmp_path / "released")
    assert not any(n.startswith(("mtp.", "model.visual.")) for n in names)
    ids = torch.randint(0, BASE["vocab_size"], (2, 17))
    with torch.no_grad():
        assert (model(ids) - ref(input_ids=ids).logits).abs().max() <= 1e-4  # fp32 parity, as tools/hf_parity.py


def test_config_errors(tmp_path):
    path = tmp_path / "config.json"
    cases = {
        "model_type is 'qwen3_moe'": {"model_type": "qwen3_moe"},
        "tie_word_embeddings=true": {"tie_word_embeddings": True},
        "attn_output_gate=false": {"attn_output_gate": False},
        "layer_types must list 3 entries": {"layer_types": [LIN, FULL]},
        "must be a multiple of linear_num_key_heads": {"linear_num_value_heads": 3},
        "only default rope": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
    }
    for message, change in cases.items():
        path.write_text(json.dumps({"model_type": "qwen3_5_moe_text", **BASE, **change}))
        with pytest.raises(ValueError, match=message):
            load_config(path)
    # no layer_types: every full_attention_interval-th layer is full, as transformers' config
    path.write_text(json.dumps({"model_type": "qwen3_5_moe_text", **{k: v for k, v in BASE.items() if k != "layer_types"},
                                "num_hidden_layers": 6, "full_attention_interval": 3}))
    assert load_config(path).layer_types == [LIN, LIN, FULL, LIN, LIN, FULL]


def cp_worker(config: dict, cps: tuple, seq_len: int, chunk: int) -> dict:
    """At each cp (the ranks split into groups of cp; here 4 ranks: cp2 twice, then cp4): the model with a cp group,
    each rank holding chunks r and 2cp-1-r of 2 sequences, against one process over the whole sequences: loss
    (summed over the cp ranks), whole-sequence logits and every gradient (summed over the cp ranks). The delta rule
    runs in chunks of `chunk` tokens, so each cp chunk spans several (and a padded last one)."""
    dist.init_process_group("gloo")
    GatedDeltaNet.chunk_size = chunk
    cfg = ModelConfig(**{k: v for k, v in config.items() if k in ModelConfig.__dataclass_fields__})
    errors = {}
    for cp in cps:
        mesh = build_mesh(dp=dist.get_world_size() // cp, cp=cp, ep=1)
        cp_group, cp_rank = mesh.group("cp"), mesh.coord("cp")
        models = []
        for group in (cp_group, None):
            torch.manual_seed(0)
            models.append(Model(cfg, cp_group=group))
            with torch.no_grad():  # decays that keep the state over tens of tokens (see save_tiny)
                for layer in models[-1].layers.values():
                    if layer.linear:
                        layer.linear_attn.A_log.copy_(torch.linspace(0.02, 1.0, cfg.linear_num_value_heads).log())
        model, full = models
        ids = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(3))
        labels = torch.roll(ids, -1, 1)
        ref = full.forward_train(ids, labels).loss_sum
        ref.backward()
        positions_BS = cp_positions(seq_len, cp_rank, cp)[None].expand(2, -1)
        loss = model.forward_train(*(split_for_cp(x, cp_rank, cp) for x in (ids, labels)), positions_BS).loss_sum
        loss.backward()
        dist.all_reduce(loss := loss.detach(), group=cp_group)
        errors[f"cp{cp} loss"] = rel_err(loss, ref.detach())
        with torch.no_grad():
            errors[f"cp{cp} logits (whole sequences)"] = rel_err(model(ids), full(ids))
        full_params = dict(full.named_parameters())
        for name, p in model.named_parameters():
            dist.all_reduce(grad := p.grad.clone(), group=cp_group)
            errors[f"cp{cp} grad {name}"] = rel_err(grad, full_params[name].grad)
    dist.destroy_process_group()
    return errors


def test_linear_attention_layers_under_cp2_and_cp4_equal_one_process():
    """The check config's layers, linear, full, linear, at cp2 and cp4: 96-token sequences in delta-rule chunks of
    4, so a cp chunk holds 3 (cp4) or 6 (cp2) of them. Bound 1e-5 relative: the cp path composes the
    entering states from chunk summaries (S_in = M S + C per chunk) instead of running the recurrence through,
    the same sums in another order; fp32 rounds at 6e-8 per op and the errors measured ~1e-7 to 1e-6 (the
    gradients of A_log and dt_bias, sums of cancelling terms, the largest)."""
    config = {**check_setup()["config"], "num_hidden_layers": 3, "layer_types": [LIN, FULL, LIN]}
    errors = run_ranks(4, cp_worker, config, (2, 4), 96, 4)
    worst = max(((e, name) for rank in errors for name, e in rank.items()))
    print(f"worst: {worst}")
    assert worst[0] <= 1e-5, worst
