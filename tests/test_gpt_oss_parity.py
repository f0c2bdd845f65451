"""GPT-OSS recipe against transformers' GptOssForCausalLM (tiny random models, fp32, CPU), and the released
MXFP4 checkpoint layout against transformers' own MXFP4 dequantisation, also read at ep=2 by train.py. (What every
recipe shares, layouts included, is tests/test_recipes.py.)"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from recipes.gpt_oss_20b import model as gpt_oss
from recipes.gpt_oss_20b import train
from recipes.gpt_oss_20b.model import Model, ModelConfig, check_setup, load_hf_checkpoint, real_config_path
from tests.multiproc import run_ranks
from tests.recipe_checks import assert_aux_loss_matches, assert_partial_model_reads_only_its_tensors
from tests.test_train import run_train, train_args
from tools.hf_parity import check_recipe, folder_tensors, format_table, make_tiny_hf_model

BASE = dict(model_type="gpt_oss", vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=4, max_position_embeddings=131072)

CONFIGS = {  # sequences of 23 tokens
    # window 4 < 23, YaRN (factor 32, as released), top-2 of 4
    "yarn_window4_top2": dict(),
    # window 64 > 23, plain rope, top-1, 3 layers: full, sliding, sliding
    "plain_rope_window64_top1": dict(sliding_window=64, num_experts_per_tok=1, num_hidden_layers=3,
                                     layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # k = E, no GQA, weights std 0.5: gate/up values beyond +-7, so the SwiGLU clamps act
    "topk_all_clamped": dict(num_experts_per_tok=4, num_key_value_heads=4, initializer_range=0.5),
}


def save_tiny(path, seed=0, **overrides) -> str:
    return str(make_tiny_hf_model({**BASE, **overrides}, path, seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_grads_and_export_match_transformers(tmp_path, monkeypatch, name):
    clamped = []  # per transformers expert call: values its SwiGLU clamps
    apply_gate = GptOssExperts._apply_gate

    def counting(self, gate_up):
        clamped.append(((gate_up[..., ::2] > self.limit).sum() + (gate_up[..., 1::2].abs() > self.limit).sum()).item())
        return apply_gate(self, gate_up)

    monkeypatch.setattr(GptOssExperts, "_apply_gate", counting)
    rows = check_recipe("gpt_oss_20b", save_tiny(tmp_path, **CONFIGS[name]), seq_len=23)
    print(f"\n{name}\n" + format_table(rows))
    assert all(r.ok for r in rows), "\n" + format_table(rows)
    assert (sum(clamped) > 0) == (name == "topk_all_clamped"), clamped


def test_aux_loss_and_its_gradient_match_transformers(tmp_path):
    path = save_tiny(tmp_path, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"])
    assert_aux_loss_matches(GptOssForCausalLM, gpt_oss, path, BASE["vocab_size"], lambda model, ref: [
        (getattr(model.layers[str(i)].mlp.router, name), getattr(ref.model.layers[i].mlp.router, name))
        for i in range(3) for name in ("weight", "bias")])


def test_partial_model_reads_only_its_tensors(tmp_path):
    path = save_tiny(tmp_path, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    # q, k, v, o (+ biases), sinks, 2 norms, router (+ bias), fused experts (gate_up, down + biases)
    assert_partial_model_reads_only_its_tensors(gpt_oss, path, 8 + 1 + 2 + 2 + 4)


def test_released_config_parameter_count():
    cfg = ModelConfig.from_hf(real_config_path())
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.sliding_window, cfg.rope_scaling["factor"]) == (32, 4, 128, 32.0)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 12
    with torch.device("meta"):
        model = Model(cfg)
    assert sum(p.numel() for p in model.parameters()) == 20_914_757_184


# ------------------------------------------------------------------------------------------------ MXFP4

FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w_EKM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]: per 32 inputs a power-of-
    two scale that brings the largest magnitude to <= 6, each value rounded to the nearest FP4 E2M1 value."""
    x = w_EKM.transpose(1, 2).unflatten(-1, (-1, 32))  # [E, out, G, 32]
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=2.0**-100) / 6)).clamp(-127, 127)
    y = x / torch.exp2(exp)[..., None]
    codes = (y.abs()[..., None] - FP4_GRID).abs().argmin(-1) + 8 * (y < 0)  # sign bit 3
    return (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8), (exp + 127).to(torch.uint8)


def write_released_layout(src, dst, every_byte: bool = False) -> dict[str, torch.Tensor]:
    """Copy the folder src in the released layout to dst: experts as MXFP4 blocks/scales, everything else bf16, the
    released quantization_config. every_byte: layer 0's down_proj gets random bytes (every code) and scales
    100-149 instead. Returns transformers' dequantisation (convert_moe_packed_tensors) of each expert tensor."""
    tensors, expected = {}, {}
    for name, t in folder_tensors(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t)
            if every_byte and name.endswith("layers.0.mlp.experts.down_proj"):
                blocks = torch.randint(0, 256, blocks.shape, dtype=torch.uint8)
                scales = torch.randint(100, 150, scales.shape, dtype=torch.uint8)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            tensors[name] = t.to(torch.bfloat16)
    released = json.loads(real_config_path().read_text())
    config = {**json.loads((Path(src) / "config.json").read_text()), "dtype": "bfloat16",
              "quantization_config": released["quantization_config"]}
    Path(dst).mkdir(parents=True)
    save_file(tensors, Path(dst) / "model.safetensors", metadata={"format": "pt"})
    (Path(dst) / "config.json").write_text(json.dumps(config))
    return expected


def test_mxfp4_released_layout_matches_transformers_dequantisation(tmp_path):
    """A released-layout folder: expert tensors equal transformers' convert_moe_packed_tensors bit for bit, an
    expert shard reads only its rows, and the logits equal transformers' model loaded (and dequantised) from it."""
    expected = {k.removeprefix("model."): v for k, v in
                write_released_layout(save_tiny(tmp_path / "fp32"), tmp_path / "mxfp4", every_byte=True).items()}

    model = Model(ModelConfig.from_hf(tmp_path / "mxfp4"))
    load_hf_checkpoint(model, tmp_path / "mxfp4")
    state = model.state_dict()
    assert len(expected) == 4 and all(torch.equal(state[n], t) for n, t in expected.items())
    shard = Model(model.cfg, layers=[0], expert_ids=[1, 2], embed=False, head=False)
    names = load_hf_checkpoint(shard, tmp_path / "mxfp4")
    assert "model.layers.0.mlp.experts.down_proj_blocks" in names
    assert torch.equal(shard.layers["0"].mlp.experts.down_proj, expected["layers.0.mlp.experts.down_proj"][1:3])

    ref = GptOssForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32,
                                            quantization_config=Mxfp4Config(dequantize=True))
    assert torch.equal(ref.model.layers[1].mlp.experts.gate_up_proj, expected["layers.1.mlp.experts.gate_up_proj"])
    ids = torch.randint(0, BASE["vocab_size"], (2, 24))
    with torch.no_grad():
        err = (model(ids) - ref(input_ids=ids).logits).abs().max().item()
    print(f"\nMXFP4 folder: experts bit-equal to convert_moe_packed_tensors; logits vs transformers max abs {err:.2e}")
    assert err <= 1e-4



def test_released_layout_read_at_ep2_exports_the_dequantised_weights(tiny_train_setup, tmp_path):
    """train.py --hf-checkpoint on the released layout at ep=2 (each rank dequantises only its experts), exported
    after a step of lr 0: transformers' dequantised experts and the bf16 dense tensors, exactly."""
    released = write_released_layout(make_tiny_hf_model(check_setup()["config"], tmp_path / "fp32"), tmp_path / "mxfp4")
    run_ranks(2, run_train, train_args("unused", tiny_train_setup[1], tmp_path / "run", steps=1, lr=0.0, ep=2,
                                       hf_checkpoint=tmp_path / "mxfp4", export_hf=tmp_path / "hf_out"), train.main)
    exported, source = folder_tensors(tmp_path / "hf_out"), folder_tensors(tmp_path / "mxfp4")
    assert exported.keys() == released.keys() | {k for k in source if "_blocks" not in k and "_scales" not in k}
    for name, t in exported.items():
        assert torch.equal(t, released[name] if name in released else source[name].float()), name

def test_config_errors(tmp_path):
    path = tmp_path / "config.json"
    for fields, match in ((dict(model_type="qwen3_moe"), "reads 'gpt_oss'"),
                          (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type 'linear'"),
                          (dict(layer_types=["full_attention"]), "layer_types must list 2"),
                          (dict(tie_word_embeddings=True), "untied")):
        path.write_text(json.dumps({**BASE, **fields}))
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf(path)
