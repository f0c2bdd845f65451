"""DeepSeek-V3 (also R1, V3.1, Kimi K2, Moonlight): multi-head latent attention (MLA) with the query LoRA and YaRN
rope, a sigmoid router with the auxiliary-loss-free bias (`e_score_correction_bias`) and group-limited top-k
(groups ranked by the sum of their best two scores; `Router.forward`), normalised top-k weights times
routed_scaling_factor, shared experts, dense first layers, the V3 paper's optional sequence-wise balance loss, and
multi-token prediction (`MTP`, training only, on pp rank 0 with its own loss term). Released checkpoints store
matrices as FP8 with a scale per 128x128 block; loading dequantises them (core.hf_io.CheckpointReader).

Numerics follow transformers' `DeepseekV3ForCausalLM` (checked by tests/test_deepseek_v3_parity.py); the balance
loss and MTP, which transformers does not compute, follow the DeepSeek-V3 paper (Model docstrings).

Legend: B batch, S sequence, T = B*S tokens, H hidden, N heads, D q/k head dim (= P + R), P no-rope part of a
q/k head, R rope part (one rope key shared by all heads), U v head dim, C kv latent (kv_lora_rank), Q q latent
(q_lora_rank), K whole (cp-gathered) sequence, X numbers side by side (named where built), V vocab, E experts
(held by this rank), k experts per token, G expert groups, M routed rows (token, expert), I expert ffn width,
J = 2*I.

A Model may be partial as in recipes/qwen3_30b_a3b/model.py's docstring (`embed`/`head` also decide the MTP
module, which shares both); the seams follow skills/add-new-architecture/SKILL.md's table in this file's order;
the layer protocol and router contract: AGENTS.md.
"""

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.attention import attention, cp_attention_mask
from core.context import cp_positions, gather_sequence
from core.fp8 import convert_linears, fp8_grouped_mm
from core.hf_io import CheckpointReader, read_hf_config, variant_config, write_hf_folder
from core.kernels.cross_entropy import linear_cross_entropy
from core.kernels.swiglu import swiglu
from core.moe import expert_counts, expert_matmul, moe_forward, update_expert_bias, weighted_rows
from core.pipeline import running
from core.placement import Placement
from core.precision import compute_dtype, upcast
from core.routing import routing
from core.training import LossTerm, ParamRule, check_args, default_rule, init_parameters
from core.weight_cache import cast_weight


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 7168
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 256  # n_routed_experts in config.json
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    intermediate_size: int = 18432  # dense layers (the first first_k_dense_replace)
    first_k_dense_replace: int = 3
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True  # the k sigmoid scores divided by their sum before routed_scaling_factor
    n_group: int = 8  # expert groups; a token's experts come from its topk_group best groups (sum of top-2 scores)
    topk_group: int = 4
    topk_method: str = "noaux_tc"  # kept only to write config.json back (transformers' V3 always routes as above)
    aux_loss_alpha: float = 0.001  # kept to write config.json back; the balance loss's weight is --aux-loss-coef
    seq_aux: bool = True
    num_nextn_predict_layers: int = 0  # multi-token prediction modules (0 or 1): Model.mtp, training only
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # YaRN: type/rope_type, factor, original_max_position_embeddings, beta_*, mscale*
    rope_interleave: bool = True  # rope on pairs (x[2i], x[2i+1]) (DeepSeek's layout), else (x[i], x[i + R/2])
    attention_bias: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 163840
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # kept only to write config.json back

    @classmethod
    def from_hf(cls, path) -> "ModelConfig":
        """Read a Hugging Face DeepSeek-V3 config.json (the file, or a checkpoint folder holding it); Kimi K2's
        (model_type kimi_k2, architectures DeepseekV3ForCausalLM) too. quantization_config (FP8 blocks) is what
        the checkpoint stores, dequantised on load, so it is not kept."""
        hf = read_hf_config(path)
        kimi = hf.get("model_type") == "kimi_k2" and "DeepseekV3ForCausalLM" in hf.get("architectures", [])
        if hf.get("model_type") not in ("deepseek_v3", Path(__file__).parent.name) and not kimi:
            raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, this recipe reads 'deepseek_v3' configs"
                             + (f" ({hf['how_to_load']})" if "how_to_load" in hf else ""))
        unsupported = {"hidden_act": ("silu", "silu"), "scoring_func": ("sigmoid", "sigmoid"), "tie_word_embeddings":
                       (False, False), "moe_layer_freq": (1, 1)}
        for key, (default, needed) in unsupported.items():
            if hf.get(key, default) != needed:
                raise ValueError(f"{path}: {key}={hf[key]!r} is not supported by this recipe (nor by transformers' "
                                 f"DeepseekV3); use {key}={json.dumps(needed)}")
        if (hf.get("num_key_value_heads") or hf["num_attention_heads"]) != hf["num_attention_heads"]:
            raise ValueError(f"{path}: MLA expands keys and values per head: num_key_value_heads must equal "
                             f"num_attention_heads ({hf['num_attention_heads']})")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if kind not in ("default", "yarn"):
            raise ValueError(f"{path}: rope type {kind!r} is not supported; DeepSeek-V3 uses 'yarn' (or 'default')")
        if kind == "yarn" and not ("factor" in rope and "original_max_position_embeddings" in rope):
            raise ValueError(f"{path}: yarn rope needs factor and original_max_position_embeddings, got {rope}")
        names = {f.name for f in cls.__dataclass_fields__.values()}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["num_experts"] = hf.get("n_routed_experts", cls.num_experts)
        kwargs["num_nextn_predict_layers"] = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
        kwargs["rope_theta"], kwargs["rope_scaling"] = theta, ({"rope_type": "yarn", **rope} if kind == "yarn" else None)
        cfg = cls(**kwargs)
        E = cfg.num_choices
        if not (cfg.n_group >= 1 and E % cfg.n_group == 0 and E // cfg.n_group >= 2 and 1 <= cfg.topk_group <= cfg.n_group):
            raise ValueError(f"{path}: n_group={cfg.n_group} must divide n_routed_experts={E} into groups of >= 2 "
                             f"experts (a group's score is its best two), and 1 <= topk_group={cfg.topk_group} <= n_group")
        if cfg.num_experts_per_tok > cfg.topk_group * E // cfg.n_group:
            raise ValueError(f"{path}: num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts of topk_group "
                             f"groups ({cfg.topk_group * E // cfg.n_group})")
        if cfg.num_nextn_predict_layers not in (0, 1):
            raise ValueError(f"{path}: num_nextn_predict_layers={cfg.num_nextn_predict_layers}: this recipe trains "
                             "one MTP module (depth 1, as DeepSeek-V3) or none; set it to 1 or 0")
        return cfg

    def to_hf(self) -> dict:
        """The config.json that transformers needs to load an exported folder."""
        hf = asdict(self)
        hf["n_routed_experts"] = hf.pop("num_experts")
        hf["rope_parameters"] = {"rope_theta": hf.pop("rope_theta"), "rope_type": "default",
                                 **(hf.pop("rope_scaling") or {})}
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
                "tie_word_embeddings": False, "num_key_value_heads": self.num_attention_heads, "scoring_func": "sigmoid",
                "attention_dropout": 0.0, "dtype": "float32", **hf}

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def num_choices(self) -> int:
        """The router's choice space (AGENTS.md: router contract): n_routed_experts, the same as num_experts here."""
        return self.num_experts

    @property
    def slots_per_token(self) -> float:
        """Mean routed-expert slots a token fills (AGENTS.md): every token fills num_experts_per_tok here."""
        return float(self.num_experts_per_tok)

    calibration_seq_len = 64  # tokens per sequence of core/memory.py's activation calibration

    @property
    def router_aux_loss_coef(self) -> float:
        """Coefficient of the balance loss (Model.aux_loss) in the training loss: 0. DeepSeek-V3 balances by the
        expert bias (--expert-bias-rate, the paper's gamma 0.001) and adds the sequence-wise loss only with an
        "extremely small" alpha (the paper's 0.0001: --aux-loss-coef 1e-4); released configs' aux_loss_alpha
        (0.001) is not what the paper trained with, so it is not taken."""
        return 0.0




def load_config(path) -> ModelConfig:
    """The model config, with the mistakes a hand-edited config.json can hold reported in one line (train.py)."""
    try:
        cfg = ModelConfig.from_hf(path)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} lacks or mistypes a field ({type(e).__name__}: {e}); compare it with "
                         f"{tiny_config_path()}") from None
    check_args({
        f"{path}: num_experts_per_tok ({cfg.num_experts_per_tok}) must be in 1..num_experts ({cfg.num_experts})":
            1 <= cfg.num_experts_per_tok <= cfg.num_choices,
        f"{path}: hidden_size, num_attention_heads, head dims, kv_lora_rank, intermediate sizes, vocab_size and "
        f"num_hidden_layers must be >= 1":
            min(cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                cfg.kv_lora_rank, cfg.q_lora_rank or 1, cfg.moe_intermediate_size, cfg.intermediate_size,
                cfg.vocab_size, cfg.num_hidden_layers) >= 1,
    })
    return cfg
# ---------------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # statistics in fp32, output in the input dtype (bf16 on the bf16 path), as transformers does
        x32 = upcast(x)  # fp32, or float64 kept (a float64 reference model)
        return self.weight.to(x.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig, dtype=torch.float32) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] of the rope dims and the factor cos/sin are scaled by: plain rope, or YaRN
    (frequencies ramped between interpolation by `factor` and extrapolation over the dims whose wavelength
    lies between beta_fast and beta_slow rotations of the original context). In fp32, or float64 for dtype float64."""
    R, base, rope = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    pos_freqs = base ** (torch.arange(0, R, 2, dtype=compute_dtype(dtype)) / R)
    if rope is None:
        return 1.0 / pos_freqs, 1.0
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor") or (
        yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all else yarn_mscale(factor))

    def dim_of(rotations):  # the dim whose wavelength fits `rotations` times into the original context
        return R * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(rope.get("beta_fast") or 32), dim_of(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    ramp = ((torch.arange(R // 2, dtype=pos_freqs.dtype) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: divide it by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """192^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling or {}
    if rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def rope_cos_sin(position_ids_BS: torch.Tensor, cfg: ModelConfig, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, R/2] (fp32; float64 for a float64 model) at the given (global) positions, times the YaRN
    attention factor."""
    inv_freq, attention_factor = rope_frequencies(cfg, dtype)
    freqs_BSr = position_ids_BS[..., None].to(inv_freq.dtype) * inv_freq.to(position_ids_BS.device)
    return freqs_BSr.cos() * attention_factor, freqs_BSr.sin() * attention_factor


def apply_rope(x, cos, sin, interleave: bool):
    """Pair i = (x[2i], x[2i+1]) (interleave, DeepSeek's layout) or (x[i], x[i + R/2]) rotated by angle i, in fp32;
    the rotated pairs come out as [first elements, second elements] (transformers' layout for both; queries and
    keys alike, so the scores do not depend on it). x [..., S, R], cos/sin broadcastable to [..., S, R/2]."""
    x1, x2 = (upcast(x)[..., 0::2], upcast(x)[..., 1::2]) if interleave else upcast(x).chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Attention(nn.Module):
    """MLA: per-head queries; keys and values expanded from a shared latent (C) plus one shared rope key (R)."""

    def __init__(self, cfg: ModelConfig, cp_group=None):
        super().__init__()
        H, N, C = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        self.N, self.P, self.R, self.U, self.C = N, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, C
        self.scale, self.cp_group, self.interleave = softmax_scale(cfg), cp_group, cfg.rope_interleave
        D, self.q_lora = self.P + self.R, cfg.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = nn.Linear(H, N * D, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, N * D, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, C + self.R, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(C, 1e-6)
        self.kv_b_proj = nn.Linear(C, N * (self.P + self.U), bias=False)
        self.o_proj = nn.Linear(N * self.U, H, bias=cfg.attention_bias)

    def forward(self, x_BSH, cos, sin, mask_BSK=None):
        """mask_BSK None: plain causal over these S tokens. Otherwise x holds this rank's split_for_cp part of each
        sequence: the normed latent and roped key of the whole sequence (K = S * cp, C + R numbers per token) are
        gathered over the cp group, expanded to per-head keys and values on every rank, and this rank's queries
        attend to them under mask_BSK (a core.context.CPMask)."""
        B, S, _ = x_BSH.shape
        q_BSX = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSH))) if self.q_lora else self.q_proj(x_BSH)
        q_BNSD = q_BSX.view(B, S, self.N, self.P + self.R).transpose(1, 2)
        q_BNSD = torch.cat([q_BNSD[..., :self.P], apply_rope(q_BNSD[..., self.P:], cos[:, None], sin[:, None], self.interleave)], -1)
        latent_BSX = self.kv_a_proj_with_mqa(x_BSH)
        latent_BSX = torch.cat([self.kv_a_layernorm(latent_BSX[..., :self.C]),
                                apply_rope(latent_BSX[..., self.C:], cos, sin, self.interleave)], -1)
        latent_BKX = gather_sequence(latent_BSX, self.cp_group, dim=1) if mask_BSK is not None else latent_BSX
        K = latent_BKX.shape[1]
        kv_BNKX = self.kv_b_proj(latent_BKX[..., :self.C]).view(B, K, self.N, self.P + self.U).transpose(1, 2)
        k_rope_BNKR = latent_BKX[:, None, :, self.C:].expand(B, self.N, K, self.R)
        k_BNKD = torch.cat([kv_BNKX[..., :self.P], k_rope_BNKR], -1)
        o_BNSU = attention(q_BNSD, k_BNKD, kv_BNKX[..., self.P:], mask_BSK, self.cp_group, self.scale)  # keys whole
        return self.o_proj(o_BNSU.transpose(1, 2).reshape(B, S, self.N * self.U))


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_choices, cfg.hidden_size))
        # aux-loss-free balancing (core.moe.update_expert_bias): shifts which experts are chosen, not their weights;
        # the released checkpoints' e_score_correction_bias (loaded and saved under that name)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_choices))
        self.cfg = cfg

    def forward(self, x_TH):
        """Balance probabilities [T, E] (the sigmoid scores divided by their sum over all experts: the paper's
        s'_{i,t}, only for the balance loss), the chosen experts' weights [T, k] and ids [T, k]. In fp32, also under
        autocast (transformers keeps the gate in fp32). The choice: scores + expert_bias, only in the topk_group
        groups whose two best biased scores sum highest; the weights: the unbiased sigmoid scores of the chosen,
        divided by their sum (norm_topk_prob), times routed_scaling_factor."""
        cfg, E, G = self.cfg, self.cfg.num_choices, self.cfg.n_group
        with torch.autocast(x_TH.device.type, enabled=False):
            scores_TE = F.linear(upcast(x_TH), upcast(self.weight)).sigmoid()
        biased_TE = scores_TE + self.expert_bias
        group_TG = biased_TE.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, group_TG.topk(cfg.topk_group, -1).indices, True)
        biased_TE = biased_TE.masked_fill(~keep_TG.repeat_interleave(E // G, 1), float("-inf"))
        ids_Tk = biased_TE.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights_Tk = scores_TE.gather(1, ids_Tk)
        if cfg.norm_topk_prob:
            weights_Tk = weights_Tk / (weights_Tk.sum(-1, keepdim=True) + 1e-20)
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        return probs_TE, (weights_Tk * cfg.routed_scaling_factor).to(x_TH.dtype), ids_Tk


class Experts(nn.Module):
    """Routed experts stacked for grouped GEMMs: gate_up_proj [E, H, J], down_proj [E, I, H]; expert_ids: global ids."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int]):
        super().__init__()
        self.expert_ids = list(expert_ids)
        E = len(self.expert_ids)
        self.gate_up_proj = nn.Parameter(torch.empty(E, cfg.hidden_size, 2 * cfg.moe_intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(E, cfg.moe_intermediate_size, cfg.hidden_size))
        self.fp8 = False  # set by enable_fp8

    def forward(self, rows_MH, counts_E):
        mm = fp8_grouped_mm if self.fp8 else expert_matmul  # expert_matmul: weight gradient may be delayed
        h_MJ = mm(rows_MH, self.gate_up_proj, counts_E)
        return mm(swiglu(h_MJ), self.down_proj, counts_E)  # fused silu(gate) * up (Triton on GPU)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_ids: list[int], ep_group, cp_group):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg, expert_ids)
        self.shared_experts = DenseMLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.num_experts, self.k = cfg.num_experts, cfg.num_experts_per_tok
        self.num_choices = cfg.num_choices  # the router's ids; num_experts: the dispatched ones (ModelConfig.num_choices)
        self.ep_group, self.cp_group = ep_group, cp_group
        self.load_E = None  # (token, slot) pairs routed per expert since Model.take_expert_load

    def route(self, x_TH, batch: int, aux_1):
        """Router, plus this layer's sequence-wise balance loss added to aux_1 [1] (see Model.aux_loss): per
        sequence, the routed slots per expert (of the whole sequence: summed over the cp ranks, no gradient) times
        this rank's summed router probabilities (differentiable), so the cp ranks' parts add up to the loss.
        load_E counts the routed slots that are kept (ids >= 0, core/moe.py's router contract). No host sync."""
        probs_TE, weights_Tk, ids_Tk = self.gate(x_TH)
        routing.note_entropy(probs_TE)  # router entropy per layer in the log (core/routing.py)
        E, k = self.num_choices, self.k
        ids_BX = ids_Tk.view(batch, -1)  # every slot of a sequence
        counts_BE = probs_TE.new_zeros(batch, E).scatter_add_(1, ids_BX, probs_TE.new_ones(ids_BX.shape))
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        if cp > 1:
            dist.all_reduce(counts_BE, group=self.cp_group)
        seq_len = x_TH.shape[0] // batch * cp  # tokens of a whole sequence
        probs_BE = probs_TE.view(batch, -1, E).sum(1)
        aux_1 = aux_1 + (counts_BE * probs_BE).sum().view(1) * E / (k * seq_len * seq_len * batch)
        load_E = expert_counts(ids_Tk, E)
        self.load_E = load_E if self.load_E is None else self.load_E + load_E
        return weights_Tk, ids_Tk, aux_1


RECOMPUTE = ("none", "attention", "layer")
MTP_WEIGHT = 0.3  # lambda of the MTP loss (Model.loss_terms)


class DecoderLayer(nn.Module):
    """One decoder layer: AGENTS.md's layer protocol, its steps and recompute as recipes/qwen3_30b_a3b/model.py's
    DecoderLayer. Step (1) also runs the shared experts, so under the pipeline's overlap they compute while another
    micro-batch's all-to-all is in flight. `state` is [hidden x_BSH, balance loss aux_1, *more]. --recompute
    "attention" also recomputes the latent norm and the per-head expansion, "layer" the shared experts too; with cp
    the latent gather runs again with its attention block (on every cp rank alike)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, expert_ids: list[int], ep_group, cp_group=None,
                 recompute: str = "none", placement: Placement | None = None):
        super().__init__()
        self.recompute = recompute
        self.recompute_dispatch = recompute == "layer"  # core/moe.py, core/pipeline.py read it
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cp_group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = cfg.is_moe_layer(layer_id)
        self.mlp = MoE(cfg, expert_ids, ep_group, cp_group) if self.moe else DenseMLP(cfg, cfg.intermediate_size)
        self.num_experts, self.ep_group, self.placement = cfg.num_experts, ep_group, placement
        self.rope = None

    def _run(self, mode: str, fn, *args):
        """fn(*args); under --recompute `mode` fn runs again in backward (non-reentrant checkpoint; no RNG state:
        nothing in fn draws random numbers)."""
        if self.recompute == mode and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        return fn(*args)

    def current_rope(self):
        """(cos, sin, mask) of the micro-batch computing now (core.pipeline.running), set by Model.set_positions."""
        return self.rope[0] if len(self.rope) == 1 else self.rope[running.micro_batch]

    def attention_block(self, x_BSH):
        return self.self_attn(self.input_layernorm(x_BSH), *self.current_rope())

    def before_mlp(self, x_BSH):
        """(h_BSH: x plus the attention block, x_TH: the MLP's input, normed)."""
        h_BSH = x_BSH + self._run("attention", self.attention_block, x_BSH)
        return h_BSH, self.post_attention_layernorm(h_BSH).flatten(0, 1)

    def attention(self, state):  # (1)
        x_BSH, aux_1, *more = state
        h_BSH, x_TH = self._run("layer", self.before_mlp, x_BSH)
        weights_Tk, ids_Tk, aux_1 = self.mlp.route(x_TH, h_BSH.shape[0], aux_1)
        h_BSH = h_BSH + self._run("layer", self.mlp.shared_experts, x_TH).view_as(h_BSH)
        return [h_BSH, aux_1, *more], x_TH, ids_Tk, weights_Tk

    def routed_experts(self, x_QH, row_R, counts_L, weights_R):  # (3)
        return self._run("layer", weighted_rows, self.mlp.experts, x_QH, row_R, counts_L, weights_R)  # [R, H]

    def finish(self, state, x_TH, out_TH):  # (5) x_TH: step (1)'s routed tokens (a zero-computation expert's input)
        h_BSH, *more = state
        return [h_BSH + out_TH.view_as(h_BSH), *more]

    def dense(self, state):  # a layer without routed experts, whole
        x_BSH, *more = state
        return [self._run("layer", self._dense, x_BSH), *more]

    def _dense(self, x_BSH):
        h_BSH, x_TH = self.before_mlp(x_BSH)
        return h_BSH + self.mlp(x_TH).view_as(h_BSH)

    def forward(self, state):
        """The five steps back to back (the pipeline schedule runs them interleaved instead)."""
        if not self.moe:
            return self.dense(state)
        state, x_TH, ids_Tk, weights_Tk = self.attention(state)
        out_TH, _ = moe_forward(x_TH, ids_Tk, weights_Tk, self.num_experts, self.ep_group, self.routed_experts,
                                self.placement, self.recompute_dispatch)
        return self.finish(state, x_TH, out_TH)


class MTP(nn.Module):
    """DeepSeek-V3's multi-token prediction module of depth 1 (the paper's 2.2), training only: at position i it
    combines the main model's final hidden state h_i (after the final norm: what the LM head reads) with the
    embedding of token i+1, h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]) (the released weights' order, which
    vLLM and SGLang use; the paper writes the two halves the other way round), runs one decoder layer (index
    num_hidden_layers, a MoE layer) over h' with the main model's positions and mask, and its own final norm
    (shared_head.norm); the caller applies the shared LM head to predict token i+2. The embedding and the head are
    the main model's (Model.mtp_loss_sum), so the module lives where both are: the pipeline's pp rank 0."""

    def __init__(self, cfg: ModelConfig, *layer_args):
        super().__init__()
        H = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(H, cfg.rms_norm_eps), RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers, *layer_args)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, h_BSH, e_BSH, aux_1):
        """(final hidden state [B, S, H] of the MTP depth, balance loss aux_1 with its MoE layer's term added)."""
        x_BSH = self.eh_proj(torch.cat([self.enorm(e_BSH), self.hnorm(h_BSH)], -1))
        x_BSH, aux_1 = self.layer([x_BSH, aux_1])
        return self.norm(x_BSH), aux_1


# ----------------------------------------------------------------------------------------------- model


@dataclass
class TrainOutput:
    terms: dict[str, torch.Tensor]  # each loss term's 0-d sum over this micro-batch on this rank (Model.loss_sums)

    @property
    def loss_sum(self) -> torch.Tensor:  # "lm": summed cross-entropy over this rank's non-ignored labels
        return self.terms["lm"]

    @property
    def aux_loss(self) -> torch.Tensor:
        # "aux": the balance loss, unscaled (Model.aux_loss); with cp this rank's part (the cp ranks' parts sum to it)
        return self.terms["aux"]


class Model(nn.Module):
    # optional training features this model has (core/training.py:check_features; recipes/qwen3_30b_a3b/model.py)
    features = frozenset({"expert_bias", "aux_loss", "recompute", "fp8", "muon", "document_mask"})
    expert_bias_rate = 0.0  # after_step's --expert-bias-rate; > 0: take_stats reports each router's bias range

    def __init__(self, cfg: ModelConfig, layers=None, expert_ids: list[int] | None = None, embed: bool = True,
                 head: bool = True, ep_group=None, cp_group=None, recompute: str = "none",
                 placement: Placement | None = None):
        """layers: the decoder layers held (None: all); expert_ids: the routed experts held, global ids (None:
        all); with ep_group, this rank's experts of `placement` instead (None: Placement.even)."""
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}")
        self.cfg, self.cp_group = cfg, cp_group
        # drawn before any module exists (their constructors draw too): the same on every rank and layout
        self.base_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        layer_ids = range(cfg.num_hidden_layers) if layers is None else layers
        if ep_group is not None:
            placement = placement or Placement.even(cfg.num_experts, dist.get_world_size(ep_group))
            placement.check(cfg.num_experts, dist.get_world_size(ep_group))
            expert_ids = placement.experts[dist.get_rank(ep_group)]
        expert_ids = range(cfg.num_experts) if expert_ids is None else expert_ids
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, expert_ids, ep_group, cp_group, recompute, placement)
                                     for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head else None
        # multi-token prediction: with the embedding and the head it shares (pp rank 0 holds both)
        self.mtp = MTP(cfg, expert_ids, ep_group, cp_group, recompute, placement) \
            if cfg.num_nextn_predict_layers and embed and head else None
        self.init_weights()

    def decoder_layers(self) -> list:
        """Every DecoderLayer this rank holds: its share of the main stack, then the MTP module's."""
        return [*self.layers.values(), *([self.mtp.layer] if self.mtp is not None else [])]

    def moe_layers(self) -> list[tuple[int, "DecoderLayer | None"]]:
        """(layer id, the layer if this rank holds it) for every MoE layer of the whole model in order, the MTP
        module's (id num_hidden_layers) last: the rows of expert_load and of the expert-bias update."""
        L, held = self.cfg.num_hidden_layers, {int(i): layer for i, layer in self.layers.items()}
        if self.mtp is not None:
            held[L] = self.mtp.layer
        ids = [i for i in range(L + (1 if self.cfg.num_nextn_predict_layers else 0)) if self.cfg.is_moe_layer(i)]
        return [(i, held.get(i)) for i in ids]

    @torch.no_grad()
    def init_weights(self):
        """Every parameter by its rule's init (parameter_rules, core/training.py:init_parameters: a partial model gets
        its part of the full model's weights), every buffer (expert_bias) zero: as recipes/qwen3_30b_a3b/model.py."""
        for buf in self.buffers():
            buf.zero_()
        init_parameters(self, self.base_seed)

    def set_positions(self, position_ids_BS, cp_split: bool = True, doc_ids_BK=None) -> None:
        """Rope and the attention mask for every layer (the MTP module's too), as recipes/qwen3_30b_a3b/model.py's
        (micro-batch lists, cp_split, doc_ids_BK of the WHOLE sequences); under cp the latents are gathered
        (Attention.forward). With documents rope restarts at each; the balance loss stays per packed sequence."""
        many = isinstance(position_ids_BS, list)
        pairs = zip(position_ids_BS, doc_ids_BK or [None] * len(position_ids_BS)) if many else [(position_ids_BS, doc_ids_BK)]
        cp, cp_rank = (1, 0) if self.cp_group is None or not cp_split else \
            (dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group))
        ropes = []
        for positions_BS, docs_BK in pairs:
            S = positions_BS.shape[1]
            mask_BSK = None if cp == 1 and docs_BK is None else \
                cp_attention_mask(S * cp, cp_rank, cp, doc_ids_BK=docs_BK, device=positions_BS.device)
            ropes.append((*rope_cos_sin(positions_BS, self.cfg, next(self.parameters()).dtype), mask_BSK))
        for layer in self.decoder_layers():
            layer.rope = ropes

    def default_positions(self, B: int, S: int, device, cp_split: bool = True):
        """Positions 0..S-1, or with cp this rank's global positions of sequences of S * cp tokens."""
        if self.cp_group is None or not cp_split:
            return torch.arange(S, device=device).expand(B, S)
        cp, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        return cp_positions(S * cp, cp_rank, cp, device).expand(B, S)

    def loss_terms(self, args) -> dict[str, LossTerm]:
        """The objective's terms (core/training.py:LossTerm; --loss-weight NAME=W): "lm" per trained token, "aux" the
        sequence-wise balance loss per micro-batch (--aux-loss-coef; ModelConfig.router_aux_loss_coef), with an MTP
        module "mtp": its cross-entropy per valid MTP target (the paper's L_MTP, eq. 25, depth 1), weight lambda =
        MTP_WEIGHT (the paper's 0.3 of its first 10T tokens; it then used 0.1: --loss-weight mtp=0.1)."""
        aux = self.cfg.router_aux_loss_coef if args.aux_loss_coef < 0 else args.aux_loss_coef
        mtp = {"mtp": LossTerm(MTP_WEIGHT, "mtp_targets")} if self.cfg.num_nextn_predict_layers else {}
        return {"lm": LossTerm(1.0, "tokens"), "aux": LossTerm(aux, "micro_batches"), **mtp}

    def initial_state(self, input_ids_BS, extras: dict):
        """[embedding, balance loss 0 [1]]: the state stage 0 creates, what crosses pp ranks (a variant appends
        entries: recipes/qwen3_30b_a3b/model.py). The embedding is in the compute dtype, and with it the cp-gathered
        latents; rope and the balance loss are computed in fp32 (AGENTS.md's bf16 path)."""
        return [self.embed(input_ids_BS), torch.zeros(1, device=input_ids_BS.device)]

    def embed(self, input_ids_BS):
        h_BSH, device = self.embed_tokens(input_ids_BS), input_ids_BS.device.type
        return h_BSH.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else h_BSH

    def trunk(self, input_ids_BS, position_ids_BS=None, cp_split: bool = True, doc_ids_BK=None, extras=None):
        """Embedding + decoder layers + final norm: the final state [h_BSH normed, balance loss [1], ...]."""
        B, S = input_ids_BS.shape
        if position_ids_BS is None:
            position_ids_BS = self.default_positions(B, S, input_ids_BS.device, cp_split)
        self.set_positions(position_ids_BS, cp_split, doc_ids_BK)
        state = self.initial_state(input_ids_BS, extras or {})
        for layer in self.layers.values():
            state = layer(state)
        return [self.norm(state[0]), *state[1:]]

    def forward(self, input_ids_BS, position_ids_BS=None):
        """Logits [B, S, V] of the whole model, for whole sequences (each cp rank computes them all)."""
        return self.lm_head(self.trunk(input_ids_BS, position_ids_BS, cp_split=False)[0])

    def forward_train(self, input_ids_BS, labels_BS, position_ids_BS=None, doc_ids_BK=None, extras=None) -> TrainOutput:
        """doc_ids_BK: see set_positions (the whole sequences' documents under cp); extras: this micro-batch's
        prepare_batch tensors (this rank's cp part); None: made here from these ids and labels, as whole sequences
        without documents."""
        if extras is None:
            extras = self.prepare_batch(input_ids_BS, labels_BS, None, None)
        state = self.trunk(input_ids_BS, position_ids_BS, doc_ids_BK=doc_ids_BK, extras=extras)
        return TrainOutput(self.loss_sums(state, labels_BS, extras))

    def loss_sums(self, state, labels_BS, extras: dict) -> dict[str, torch.Tensor]:
        """Each loss term's sum over this micro-batch (loss_terms' names) from the final state (hidden normed), on
        the last pipeline stage: the cross-entropy summed over labels != -100, the MTP module's over its targets
        (it adds its MoE layer's term to the balance loss), and the balance loss."""
        h_BSH, aux_1 = state[0], state[1]
        terms = {"lm": self.cross_entropy_sum(h_BSH, labels_BS)}
        if self.mtp is not None and torch.is_grad_enabled():  # training only: evaluation reads the main head alone
            terms["mtp"], aux_1 = self.mtp_loss_sum(h_BSH, extras["mtp_input_ids"], extras["mtp_labels"], aux_1)
        elif self.mtp is not None:
            terms["mtp"] = torch.zeros((), device=h_BSH.device)
        return {**terms, "aux": self.aux_loss(aux_1)}

    def cross_entropy_sum(self, h_BSH, labels_BS):
        """LM head + cross-entropy without the [T, V] logits (Triton on GPU), summed over labels != -100."""
        h_TH, w_VH = h_BSH.flatten(0, 1), self.lm_head.weight
        if torch.is_autocast_enabled(h_TH.device.type):  # autocast does not reach into the fused kernel
            dtype = torch.get_autocast_dtype(h_TH.device.type)
            h_TH, w_VH = h_TH.to(dtype), cast_weight(w_VH, dtype)  # the weight cast once per step
        return linear_cross_entropy(h_TH, w_VH, labels_BS.flatten(), ignore_index=-100, reduction="sum")

    def mtp_loss_sum(self, h_BSH, mtp_input_ids_BS, mtp_labels_BS, aux_1):
        """The MTP module's summed cross-entropy over its valid targets (mtp_labels != -100) and aux_1 with its MoE
        layer's balance term, from the main model's final-normed h_BSH and prepare_batch's tensors; the main layers'
        positions and mask (set_positions), the shared embedding and head."""
        e_BSH = self.embed(mtp_input_ids_BS)
        g_BSH, aux_1 = self.mtp(h_BSH, e_BSH, aux_1)
        return self.cross_entropy_sum(g_BSH, mtp_labels_BS), aux_1

    def prepare_batch(self, input_ids_BS, labels_BS, doc_ids_BS=None, positions_BS=None) -> dict[str, torch.Tensor]:
        """The MTP module's inputs, from whole sequences (train.py splits them like the ids, under cp too, where
        position i + 1 may be on another cp rank): mtp_input_ids [B, S] the token at i + 1 (0 at the last
        position), mtp_labels [B, S] the token at i + 2 = labels[i + 1], -100 where that label is not trained (a
        loss mask, a document's last token, padding), at the last position and where i + 1 starts another document
        (with doc_ids: the packed documents stay apart, as if each ran alone); mtp_targets the 0/1 mask of valid
        MTP labels (the MTP loss's denominator). {} without an MTP module."""
        if not self.cfg.num_nextn_predict_layers:
            return {}
        next_ids_BS = F.pad(input_ids_BS[:, 1:], (0, 1))
        mtp_labels_BS = F.pad(labels_BS[:, 1:], (0, 1), value=-100)
        if doc_ids_BS is not None:
            mtp_labels_BS[:, :-1] = mtp_labels_BS[:, :-1].masked_fill(doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1], -100)
        return {"mtp_input_ids": next_ids_BS, "mtp_labels": mtp_labels_BS,
                "mtp_targets": (mtp_labels_BS != -100).to(torch.float32)}

    @staticmethod
    def aux_loss(aux_1):
        """DeepSeek-V3's complementary sequence-wise balance loss (the paper's eq. 17-20), unscaled (train.py
        multiplies by --aux-loss-coef; off by default, ModelConfig.router_aux_loss_coef), summed over the MoE layers:
        per layer, the mean over the micro-batch's sequences of sum_e f_e * P_e, with f_e = E / (k * T) * (slots of
        the sequence routed to e) and P_e = mean over the sequence's T tokens (all tokens, every label) of the
        token's sigmoid score of e divided by the sum of its scores over all experts (Router.forward). Each layer
        adds its term to aux_1 (MoE.route), which crosses pipeline stages as one number; with cp, a rank's part uses
        the whole sequence's counts and its own tokens' probabilities: the parts add up, each part's gradient exact."""
        return aux_1.sum()

    def take_stats(self) -> dict[str, tuple[torch.Tensor, str]]:
        """This rank's statistics since the last call, name -> (tensor, "sum" | "max" | "gather"): the seam of
        recipes/qwen3_30b_a3b/model.py's take_stats; expert_load has a row per MoE layer, the MTP module's last."""
        stats = {"expert_load": (self.take_expert_load(), "sum")}
        if self.expert_bias_rate > 0:  # expert_bias_range: each MoE layer's bias max - min (-inf: another stage's)
            none = torch.tensor(-torch.inf, device=stats["expert_load"][0].device)
            layers = [layer for _, layer in self.moe_layers()]
            stats["expert_bias_range"] = (torch.stack([none if layer is None else layer.mlp.gate.expert_bias.max()
                                                       - layer.mlp.gate.expert_bias.min() for layer in layers]), "max")
        return stats

    def after_step(self, done) -> None:
        """The post-step seam (AGENTS.md, core.training.StepDone): the aux-loss-free expert-bias update
        (--expert-bias-rate), none at lr 0 or on a skipped step."""
        self.expert_bias_rate = done.args.expert_bias_rate
        if done.args.expert_bias_rate > 0 and done.args.lr > 0 and not done.skipped:
            self.update_expert_bias(done.stats["expert_load"], done.args.expert_bias_rate)

    @torch.no_grad()
    def update_expert_bias(self, load_LE: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing step of every router this rank holds, from the global expert load [MoE layers, E]."""
        for (_, layer), load_E in zip(self.moe_layers(), load_LE):
            if layer is not None:
                update_expert_bias(layer.mlp.gate.expert_bias, load_E, rate)

    def take_expert_load(self) -> torch.Tensor:
        """(token, slot) pairs per expert routed by this rank since the last call, [MoE layers of the whole
        model (the MTP module's last), E] with zero rows for layers held by other pipeline stages."""
        layers = self.moe_layers()
        device = next(self.parameters()).device
        load_LE = torch.zeros(len(layers), self.cfg.num_choices, device=device)
        for row, (_, layer) in enumerate(layers):
            mlp = layer.mlp if layer is not None else None
            if mlp is not None and mlp.load_E is not None:
                load_LE[row], mlp.load_E = mlp.load_E, None
        return load_LE

    def parameter_rules(self, name: str, t: torch.Tensor) -> ParamRule:
        """What core does with parameter `name` (core/training.py:ParamRule, default_rule by name: AGENTS.md); the
        stacked experts' Muon matrices are each expert's gate, up and down."""
        rule = default_rule(self, name, t, self.cfg.initializer_range)
        if rule.expert_ids is not None and name.endswith("gate_up_proj"):  # [E, H, J]: gate = [..., :I], up = [..., I:]
            gate, up = t.chunk(2, dim=-1)  # transformers' layout: one matrix per expert, gate and up apart
            return replace(rule, muon={"gate": (gate, rule.expert_ids), "up": (up, rule.expert_ids)})
        if rule.expert_ids is not None and name.endswith("down_proj"):
            return replace(rule, muon={"down": (t, rule.expert_ids)})
        return rule


class PipelineStage:
    """One pipeline stage over this rank's Model (AGENTS.md's layer protocol; recipes/qwen3_30b_a3b/model.py)."""

    def __init__(self, model: Model, layer_ids, first: bool, last: bool):
        self.model, self.first, self.last = model, first, last
        self.layers = [model.layers[str(i)] for i in layer_ids]
        self.input_ids = self.labels = self.extras = self.loss_fn = None
        self.stats = {}

    def pre(self, inputs, mb):
        return self.model.initial_state(self.input_ids[mb], self.extras[mb]) if self.first else inputs

    def post(self, state, mb):
        if not self.last:
            return state
        terms = self.model.loss_sums([self.model.norm(state[0]), *state[1:]], self.labels[mb], self.extras[mb])
        self.stats = {name: self.stats.get(name, 0.0) + t.detach() for name, t in terms.items()}
        return [self.loss_fn(terms)]


def flops_by_layer(cfg: ModelConfig, seq_len: int, cp: int = 1) -> list[dict[str, float]]:
    """Training FLOPs per token (forward + backward = 3x forward) by class as in recipes/qwen3_30b_a3b/model.py:
    per decoder layer {attention: causal QK^T over D = P + R dims and AV over U, 3 * S * N * (D + U)
    (2 * S/2 * N * dims each, x3); dense: the MLA projections (q or q_a/q_b, kv_a, kv_b, o), router, shared experts
    and dense MLP, 6 x their parameters; experts: 6 x k x 3HI}, then {embedding: 0} and the last stage's {head:
    6 x V x H}, with the MTP module there too (Model.mtp): {mtp_layer: its MoE layer's three classes, mtp_eh_proj:
    6 x 2H x H, mtp_head: 6 x V x H}. cp > 1: every cp rank expands the gathered latent of the whole sequence
    (kv_b_proj on cp x its own tokens, Attention.forward), so that projection counts cp times per local token."""
    H, N, C, P, R, U = (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim)
    Q, I = cfg.q_lora_rank, cfg.moe_intermediate_size
    attn = (H * N * (P + R) if Q is None else H * Q + Q * N * (P + R)) + H * (C + R) + cp * C * N * (P + U) + N * U * H
    out = []
    for i in range(cfg.num_hidden_layers + 1):  # the last: the MTP module's layer
        moe = cfg.is_moe_layer(i)
        mlp = cfg.n_shared_experts * 3 * H * I + H * cfg.num_choices if moe else 3 * H * cfg.intermediate_size
        out.append({"attention": 3 * seq_len * N * (P + R + U), "dense": 6 * (attn + mlp),
                    "experts": 6 * cfg.slots_per_token * 3 * H * I if moe else 0})
    mtp_layer = out.pop()
    head = {"head": 6 * cfg.vocab_size * H}
    if cfg.num_nextn_predict_layers:
        head |= {"mtp_layer": sum(mtp_layer.values()), "mtp_eh_proj": 6 * 2 * H * H, "mtp_head": 6 * cfg.vocab_size * H}
    return out + [{"embedding": 0.0}, head]  # first stage's, last stage's


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, flops_by_layer's classes summed: 6 x active matmul parameters (the k routed experts
    and the shared ones; LM head and MTP module included, embedding lookup excluded), plus causal attention."""
    return sum(sum(part.values()) for part in flops_by_layer(cfg, seq_len))


def cp_gather_width(cfg: ModelConfig) -> int:
    """Numbers per token and layer all-gathered over cp (Attention.forward): the MLA latent and shared rope key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


# ------------------------------------------------------------------ speed switches (train.py --compile, --fp8)


def compile_dense_parts(model: Model, document_mask: bool = False) -> None:
    """torch.compile(fullgraph=True) each decoder layer's norms, attention block (not with a cp group, which
    all-gathers the latents, nor with document_mask: a CPMask), router, shared experts and dense MLPs, in place;
    the routed experts, dispatch/combine and residual adds stay eager (as recipes/qwen3_30b_a3b/model.py)."""
    for layer in model.decoder_layers():
        for module in (layer.input_layernorm, layer.post_attention_layernorm):
            module.compile(fullgraph=True)
        if layer.self_attn.cp_group is None and not document_mask:  # else its mask is a CPMask (flex on CUDA)
            layer.self_attn.compile(fullgraph=True)
        for module in ((layer.mlp.gate, layer.mlp.shared_experts) if isinstance(layer.mlp, MoE) else (layer.mlp,)):
            module.compile(fullgraph=True)


def enable_fp8(model: Model) -> None:
    """FP8 GEMMs (core/fp8.py), in place, for the attention projections, dense and shared MLPs, routed experts and
    the MTP module's eh_proj; the rest as recipes/qwen3_30b_a3b/model.py's enable_fp8."""
    if model.mtp is not None:
        convert_linears(model.mtp)  # eh_proj and its layer's projections
    for layer in model.decoder_layers():
        convert_linears(layer.self_attn)
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts.fp8 = True
            convert_linears(layer.mlp.shared_experts)
        else:
            convert_linears(layer.mlp)


# ------------------------------------------------------------------------------------ checkpoint I/O
# Our names are transformers' names without the "model." prefix, except the routed experts: transformers
# writes one key per expert (experts.{e}.gate_proj.weight [I, H], ...) while we stack them, the routers' bias
# (e_score_correction_bias), and the MTP module: the released checkpoints keep it as one more layer,
# model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, shared_head.norm, self_attn..., mlp...}, plus copies
# of the shared embedding (.embed_tokens) and head (.shared_head.head), written for the inference engines that
# read them there (vLLM, SGLang) and not read back. transformers drops that layer on load.


def _hf_name(name: str, num_layers: int) -> str:
    name = name.replace("gate.expert_bias", "gate.e_score_correction_bias")
    if name.startswith("mtp."):  # mtp.layer.X -> layers.L.X, mtp.norm -> layers.L.shared_head.norm
        rest = name.removeprefix("mtp.").removeprefix("layer.")
        return f"model.layers.{num_layers}.{'shared_head.norm.weight' if rest == 'norm.weight' else rest}"
    return name if name.startswith("lm_head.") else "model." + name


@torch.no_grad()
def load_hf_checkpoint(model: Model, path) -> list[str]:
    """Fill `model` (possibly partial) from a Hugging Face safetensors folder; returns the tensor names read. FP8
    matrices with block scales are dequantised (core.hf_io.CheckpointReader). A folder without any MTP tensor
    (written by transformers, or a model released without MTP) leaves the MTP module at its init_weights values."""
    reader, L = CheckpointReader(path), model.cfg.num_hidden_layers
    skip_mtp = model.mtp is not None and not any(n.startswith(f"model.layers.{L}.") for n in reader.weight_map)
    I, H = model.cfg.moe_intermediate_size, model.cfg.hidden_size
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # buffers: the routers' bias
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) or (skip_mtp and name.startswith("mtp.")):
            continue
        t.copy_(reader.get(_hf_name(name, L), t.shape))
    for layer in model.decoder_layers():
        if not isinstance(layer.mlp, MoE) or (skip_mtp and layer is model.mtp.layer):
            continue
        experts = layer.mlp.experts
        prefix = _hf_name(next(n for n, m in model.named_modules() if m is experts), L)
        if f"{prefix}.gate_up_proj" in reader:  # fused layout [E, J, H] / [E, H, I] (transformers in memory)
            E, ids = model.cfg.num_experts, experts.expert_ids  # read only this model's experts
            experts.gate_up_proj.copy_(reader.get_rows(f"{prefix}.gate_up_proj", (E, 2 * I, H), ids).transpose(1, 2))
            experts.down_proj.copy_(reader.get_rows(f"{prefix}.down_proj", (E, H, I), ids).transpose(1, 2))
            continue
        for j, e in enumerate(experts.expert_ids):
            experts.gate_up_proj[j, :, :I] = reader.get(f"{prefix}.{e}.gate_proj.weight", (I, H)).T
            experts.gate_up_proj[j, :, I:] = reader.get(f"{prefix}.{e}.up_proj.weight", (I, H)).T
            experts.down_proj[j] = reader.get(f"{prefix}.{e}.down_proj.weight", (H, I)).T
    return reader.names_read


@torch.no_grad()
def hf_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """This model's tensors under the names the released checkpoints use (per-expert keys, the MTP layer)."""
    out, L = {}, model.cfg.num_hidden_layers
    I = model.cfg.moe_intermediate_size
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, ids = _hf_name(name.rsplit(".", 1)[0], L), model.get_submodule(name.rsplit(".", 1)[0]).expert_ids
            for j, e in enumerate(ids):
                if name.endswith("gate_up_proj"):
                    out[f"{prefix}.{e}.gate_proj.weight"] = p[j, :, :I].T
                    out[f"{prefix}.{e}.up_proj.weight"] = p[j, :, I:].T
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = p[j].T
        else:
            out[_hf_name(name, L)] = p
    if model.mtp is not None:  # the released layout's copies of the shared tensors
        out[f"model.layers.{L}.embed_tokens.weight"] = model.embed_tokens.weight.clone()  # (safetensors: no shared storage)
        out[f"model.layers.{L}.shared_head.head.weight"] = model.lm_head.weight.clone()
    return out


def save_hf_checkpoint(model: Model, path, dtype: torch.dtype | None = None, dense: bool = True, experts: bool = True) -> None:
    """Write `model` as a folder that transformers' DeepseekV3ForCausalLM.from_pretrained loads; every rank calls it
    (core.hf_io.write_hf_folder), `dense` / `experts`: whether it is the first replica of those tensors."""
    fp32 = ("e_score_correction_bias", "mlp.gate.weight")  # kept in fp32 (transformers' _keep_in_fp32_modules_strict)
    tensors = {k: (v.to(dtype) if dtype and not k.endswith(fp32) else v) for k, v in hf_state_dict(model).items()
               if (experts if ".mlp.experts." in k else dense)}
    config = model.cfg.to_hf()
    if TRANSFORMERS_CLASS is None:  # a variant: its export must not pass for the base model (names the variant)
        config = variant_config(config, Path(__file__).parent.name)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    write_hf_folder(path, tensors, config)


def tiny_config_path() -> Path:
    return Path(__file__).with_name("config_tiny.json")


def real_config_path() -> Path:
    return Path(__file__).with_name("config.json")


# ------------------------------------------------------------------------------------------- recipe checks
# what the shared checks need (meanings: recipes/qwen3_30b_a3b/model.py's block, skills/validate-correctness/SKILL.md)
TRANSFORMERS_CLASS = "DeepseekV3ForCausalLM"
BASE_RECIPE = None
SHARED_TRAIN_PY = True  # train.py is the shared file (tests/test_layers.py)


def check_setup() -> dict:
    """6 layers, the first 2 dense (with pp=2 each of the 4 stages holds some), 8 experts in 4 groups of 2 of which
    a token's top-2 come from the best 2 groups (the group limit acts), 2 shared experts, the query LoRA, YaRN
    (original length 16 < 32: the scaled frequencies, the attention factor mscale / mscale_all_dim and the softmax
    scale all act), normalised top-k weights times 2.5, the MTP module (its loss term, its MoE layer on the last
    stage). (With top-3 here one token's choice flips at step 3 of the cp2 run, a near tie that rounding decides:
    every layout then differs by a routing decision, not by a bug; tests/test_deepseek_v3_parity.py covers top-3
    and top-4 against transformers.)"""
    config = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
              "norm_topk_prob": True, "moe_intermediate_size": 32, "n_shared_experts": 2, "intermediate_size": 64,
              "first_k_dense_replace": 2, "num_nextn_predict_layers": 1, "rope_theta": 10000.0,
              "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "mscale": 1.0,
                               "mscale_all_dim": 0.707}, "max_position_embeddings": 64}
    return {"config": config, "seq_len": 32, "base_config": None}


if __name__ == "__main__":  # print the parameter count of the released config without allocating it
    with torch.device("meta"):
        m = Model(ModelConfig.from_hf(real_config_path()))
    total = sum(p.numel() for p in m.parameters())
    print(json.dumps({"parameters": total, "billions": round(total / 1e9, 3), "gflops_per_token_4k": round(flops_per_token(m.cfg, 4096) / 1e9, 2)}))
