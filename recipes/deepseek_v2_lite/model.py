"""DeepSeek-V2 (Lite): multi-head latent attention (MLA) with YaRN rope, its latent gathered under cp
(`Attention.forward`), softmax top-k router (greedy or group-limited), shared experts in layer step (1), dense
first layers, a sequence-wise expert-balance loss (`MoE.route`) whose sums ride in the state that stage 0 makes
(`Model.initial_state`).

Numerics follow transformers' `DeepseekV2ForCausalLM` (checked by tests/test_deepseek_parity.py); the balance
loss, which transformers does not compute, follows DeepSeek-V2's definition (Model docstring).

Legend: B batch, S sequence, T = B*S tokens, H hidden, N heads, D q/k head dim (= P + R), P no-rope part of a
q/k head, R rope part (one rope key shared by all heads), U v head dim, C kv latent (kv_lora_rank), Q q latent
(q_lora_rank), K whole (cp-gathered) sequence, X numbers side by side (named where built), V vocab, E experts
(held by this rank), k experts per token, M routed rows (token, expert), I expert ffn width, J = 2*I.

A Model may be partial: `layers` picks which decoder layers it holds (parameter names keep the global
layer index, `layers.7.…`), `expert_ids` which routed experts (global ids; with `ep_group` given, this rank's
experts of the `placement`, core/placement.py, and tokens reach them through core/moe.py's all-to-all), `embed`/`head` whether it
holds the embedding and the final norm + LM head. Checkpoint I/O then touches only those tensors.

Seams (skills/add-new-architecture/SKILL.md's table, in this file's order): a config field `ModelConfig`,
`load_config`; attention `Attention.forward` (through core.attention.attention) and its masks `Model.set_positions`;
the router `Router`, `MoE.route`; expert kinds `ModelConfig.num_choices` (the router's choices) vs `num_experts`
(the dispatched ones), `DecoderLayer.finish`; the layer's step order `DecoderLayer.before_mlp` (recompute:
`DecoderLayer._run`); state crossing pipeline stages: the `state` list of `DecoderLayer` (entries after the first
two pass through every base layer) made by `Model.initial_state` (what crosses pp ranks follows it); the running
micro-batch `DecoderLayer.current_rope` (core.pipeline.running); loss terms `Model.loss_terms` (name -> weight,
denominator) and their sums `Model.loss_sums`; per-token inputs made from whole sequences `Model.prepare_batch`;
optional flags `Model.features`; statistics `Model.take_stats`; after each step `Model.after_step`; each parameter's
group, Muon matrices and init `Model.parameter_rules`; slots a token fills `ModelConfig.slots_per_token`; the shared
checks' config `check_setup` (end of file).
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
    vocab_size: int = 102400
    hidden_size: int = 2048
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj (DeepSeek-V2)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 64  # n_routed_experts in config.json
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1408
    n_shared_experts: int = 2
    intermediate_size: int = 10944  # dense layers (the first first_k_dense_replace)
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # greedy | group_limited_greedy
    n_group: int | None = None
    topk_group: int | None = None
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # YaRN: type/rope_type, factor, original_max_position_embeddings, beta_*, mscale*
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 163840
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # kept only to write config.json back

    @classmethod
    def from_hf(cls, path) -> "ModelConfig":
        """Read a Hugging Face DeepSeek-V2 config.json (the file, or a checkpoint folder holding it)."""
        hf = read_hf_config(path)
        if hf.get("model_type") not in ("deepseek_v2", Path(__file__).parent.name):  # (the second: this variant's exports)
            raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, this recipe reads 'deepseek_v2' configs"
                             + (f" ({hf['how_to_load']})" if "how_to_load" in hf else ""))
        unsupported = {"hidden_act": ("silu", "silu"), "scoring_func": ("softmax", "softmax"), "tie_word_embeddings":
                       (False, False), "moe_layer_freq": (1, 1), "norm_topk_prob": (False, False)}
        for key, (default, needed) in unsupported.items():
            if hf.get(key, default) != needed:
                raise ValueError(f"{path}: {key}={hf[key]!r} is not supported by this recipe (nor by transformers' "
                                 f"DeepseekV2); use {key}={json.dumps(needed)}")
        if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
            raise ValueError(f"{path}: MLA expands keys and values per head: num_key_value_heads must equal "
                             f"num_attention_heads ({hf['num_attention_heads']})")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if kind not in ("default", "yarn"):
            raise ValueError(f"{path}: rope type {kind!r} is not supported; DeepSeek-V2 uses 'yarn' (or 'default')")
        if kind == "yarn" and not ("factor" in rope and "original_max_position_embeddings" in rope):
            raise ValueError(f"{path}: yarn rope needs factor and original_max_position_embeddings, got {rope}")
        names = {f.name for f in cls.__dataclass_fields__.values()}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["num_experts"] = hf.get("n_routed_experts", cls.num_experts)
        kwargs["rope_theta"], kwargs["rope_scaling"] = theta, ({"rope_type": "yarn", **rope} if kind == "yarn" else None)
        cfg = cls(**kwargs)
        if cfg.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"{path}: topk_method {cfg.topk_method!r} is not supported; "
                             "use greedy or group_limited_greedy")
        if cfg.topk_method == "group_limited_greedy" and (not cfg.n_group or cfg.num_choices % cfg.n_group or not
                                                          cfg.topk_group or cfg.topk_group > cfg.n_group):
            raise ValueError(f"{path}: group_limited_greedy needs n_group dividing n_routed_experts={cfg.num_choices} "
                             f"and 1 <= topk_group <= n_group (got n_group={cfg.n_group}, topk_group={cfg.topk_group})")
        if cfg.topk_method == "group_limited_greedy" and \
                cfg.num_experts_per_tok > cfg.topk_group * cfg.num_choices // cfg.n_group:
            raise ValueError(f"{path}: num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts of topk_group "
                             f"groups ({cfg.topk_group * cfg.num_choices // cfg.n_group})")
        if not cfg.n_shared_experts:
            raise ValueError(f"{path}: n_shared_experts must be >= 1 (DeepSeek-V2 always has shared experts)")
        return cfg

    def to_hf(self) -> dict:
        """The config.json that transformers needs to load an exported folder."""
        hf = asdict(self)
        hf["n_routed_experts"] = hf.pop("num_experts")
        hf["rope_parameters"] = {"rope_theta": hf.pop("rope_theta"), "rope_type": "default",
                                 **(hf.pop("rope_scaling") or {})}
        return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_act": "silu",
                "tie_word_embeddings": False, "num_key_value_heads": self.num_attention_heads, "scoring_func": "softmax",
                "norm_topk_prob": False, "attention_dropout": 0.0, "dtype": "float32", **hf}

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def num_choices(self) -> int:
        """The router's choice space: the ids it scores and picks, 0..num_choices-1 (its weight rows, expert
        bias, load and aux statistics). num_experts (config.json's n_routed_experts) counts the routed experts
        core dispatches, ids 0..num_experts-1, held by the ep ranks. They are the same here; a router that also picks
        choices computed on the token's own rank (zero-computation experts, ids num_experts..num_choices-1)
        returns more, and hands those slots to core as -1 (core/moe.py: router contract)."""
        return self.num_experts

    @property
    def slots_per_token(self) -> float:
        """Routed-expert slots a token fills, on average over tokens (kept ids < num_experts: core/moe.py's router
        contract): what the memory estimate, the FLOPs, the planner and the shared checks count per token. Every
        token fills num_experts_per_tok here; a router that keeps a variable number returns its mean."""
        return float(self.num_experts_per_tok)

    calibration_seq_len = 64  # tokens per sequence of core/memory.py's activation calibration (64: whole
    # linear-attention chunks); a feature that acts only on longer sequences (block sparsity) asks for more

    @property
    def router_aux_loss_coef(self) -> float:
        """Coefficient of the balance loss (Model.aux_loss) in the training loss: aux_loss_alpha when seq_aux."""
        return self.aux_loss_alpha if self.seq_aux else 0.0




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
        # statistics in fp32, output in the input dtype (bf16 on the bf16 path), as transformers does for a model
        # of that dtype
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


def apply_rope(x, cos, sin):
    """Interleaved pairs (x[2i], x[2i+1]) rotated by angle i, in fp32 (transformers' complex form);
    x [..., S, R], cos/sin broadcastable to [..., S, R/2]."""
    x1, x2 = upcast(x)[..., 0::2], upcast(x)[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """MLA: per-head queries; keys and values expanded from a shared latent (C) plus one shared rope key (R)."""

    def __init__(self, cfg: ModelConfig, cp_group=None):
        super().__init__()
        H, N, C = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        self.N, self.P, self.R, self.U, self.C = N, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, C
        self.scale, self.cp_group = softmax_scale(cfg), cp_group
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
        attend to them under mask_BSK (a core.attention.CPMask)."""
        B, S, _ = x_BSH.shape
        q_BSX = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSH))) if self.q_lora else self.q_proj(x_BSH)
        q_BNSD = q_BSX.view(B, S, self.N, self.P + self.R).transpose(1, 2)
        q_BNSD = torch.cat([q_BNSD[..., :self.P], apply_rope(q_BNSD[..., self.P:], cos[:, None], sin[:, None])], -1)
        latent_BSX = self.kv_a_proj_with_mqa(x_BSH)
        latent_BSX = torch.cat([self.kv_a_layernorm(latent_BSX[..., :self.C]),
                                apply_rope(latent_BSX[..., self.C:], cos, sin)], -1)
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
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_choices, cfg.hidden_size))
        # aux-loss-free balancing (core.moe.update_expert_bias): shifts which experts are chosen, not their weights
        self.register_buffer("expert_bias", torch.zeros(cfg.num_choices))
        self.cfg = cfg

    def forward(self, x_TH):
        """Router probabilities [T, E] (fp32, also under autocast, as transformers keeps the gate in fp32), the
        chosen experts' weights [T, k] (probabilities times routed_scaling_factor, not renormalised) and ids."""
        cfg = self.cfg
        with torch.autocast(x_TH.device.type, enabled=False):
            probs_TE = F.linear(upcast(x_TH), upcast(self.weight)).softmax(dim=-1)
        scores_TE = probs_TE + self.expert_bias
        if cfg.topk_method == "group_limited_greedy":  # experts of the topk_group groups with the best expert only
            G = cfg.n_group
            best_TG = scores_TE.view(-1, G, cfg.num_choices // G).amax(-1)
            best_groups_Tg = best_TG.topk(cfg.topk_group, -1).indices
            keep_TG = torch.zeros_like(best_TG, dtype=torch.bool).scatter_(1, best_groups_Tg, True)
            scores_TE = scores_TE.masked_fill(~keep_TG.repeat_interleave(cfg.num_choices // G, 1), float("-inf"))
        ids_Tk = scores_TE.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights_Tk = probs_TE.gather(1, ids_Tk) * cfg.routed_scaling_factor
        return probs_TE, weights_Tk.to(x_TH.dtype), ids_Tk


class Experts(nn.Module):
    """Routed experts stacked for grouped GEMMs: gate_up_proj [E, H, J], down_proj [E, I, H]; local expert j is
    global expert expert_ids[j]."""

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


class DecoderLayer(nn.Module):
    """One decoder layer. Its step order is written once, in `before_mlp` (the attention block with its residual
    add, then the MLP's input norm), followed by the MLP: routed and shared experts as the three compute steps that
    core/pipeline.py interleaves (its contract): (1) `attention` (before_mlp, router, shared experts), (3)
    `routed_experts`, (5) `finish` (residual add), the dispatch and combine all-to-alls (2) and (4) running between
    them in core/moe.py; or a dense MLP (`dense`). The shared experts run in (1), so under the pipeline's overlap
    they compute while another micro-batch's all-to-all is in flight. `state` is [hidden x_BSH, balance loss aux_1,
    *more] (more: whatever a variant's Model.initial_state adds, passed through untouched). `rope` holds (cos, sin,
    attention mask) of each micro-batch of the step, set by Model.set_positions (one entry: the same for every
    micro-batch); `current_rope` picks the running one.

    recompute (RECOMPUTE) wraps these same functions (`_run`): "attention" keeps only the input of each attention
    block (input norm, projections, latent norm, rope, expansion, attention, output projection) and recomputes the
    rest in backward; "layer" keeps only the inputs of before_mlp and of the router, of the shared experts, or of a
    dense layer: in backward the dispatch all-to-all runs again (core/moe.py recompute_dispatch), then step (3) (the
    expert GEMMs and SwiGLU). The router (whose expert counts are statistics) and the combine run once; with cp,
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
        """fn(*args); under --recompute `mode` the tensors fn saves for backward are dropped and fn runs again in
        backward (torch.utils.checkpoint, non-reentrant: it nests in core/pipeline.py's autograd segments, replays
        the autocast state, and the delayed expert weight gradients capture the recomputed tensors). Nothing in fn
        draws random numbers, so no RNG state is kept."""
        if self.recompute == mode and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        return fn(*args)

    def current_rope(self):
        """(cos, sin, mask...) of the micro-batch computing now (core.pipeline.running: under the pipeline's
        overlap and in a recompute inside a backward too)."""
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


# ----------------------------------------------------------------------------------------------- model


@dataclass
class TrainOutput:
    terms: dict[str, torch.Tensor]  # each loss term's 0-d sum over this micro-batch on this rank (Model.loss_sums)

    @property
    def loss_sum(self) -> torch.Tensor:  # "lm": summed cross-entropy over this rank's non-ignored labels
        return self.terms["lm"]

    @property
    def aux_loss(self) -> torch.Tensor:
        # "aux": sequence-wise balance loss (unscaled, see Model.aux_loss); with cp, this rank's part of the
        # micro-batch's loss (the cp ranks' parts sum to it)
        return self.terms["aux"]


class Model(nn.Module):
    # optional training features this model has; train.py's check_run refuses a flag asking for another (one
    # error: line before any rank starts) and tests/recipe_checks.py skips its checks: expert_bias
    # (--expert-bias-rate, after_step), aux_loss (--aux-loss-coef), recompute (--recompute), fp8 (--fp8), muon
    # (--optimizer muon: parameter_rules), document_mask (--document-mask). A variant whose features depend on the
    # config makes this a property of self.cfg (train.py and the checks ask a model built on the meta device)
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
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every parameter by its rule's init (parameter_rules; core/training.py:init_parameters: each tensor, each
        routed expert's row, from a generator seeded by base_seed and its name, so a partial model (pipeline stage,
        any expert placement) gets exactly its part of the full model's weights; seed the default generator the
        same on every rank). Every buffer starts at zero (expert_bias): a buffer that needs another start value gets
        its rule here, since a model built on the meta device (the --hf-checkpoint path) has nothing else to fill it
        (tests/test_recipes.py checks every buffer)."""
        for buf in self.buffers():
            buf.zero_()
        init_parameters(self, self.base_seed)

    def set_positions(self, position_ids_BS, cp_split: bool = True, doc_ids_BK=None) -> None:
        """Rope at these positions, and the attention mask, for every layer: one micro-batch's tensors for every
        micro-batch, or lists of them, one per micro-batch of the step, of which each layer takes the running
        one (DecoderLayer.current_rope).

        With a cp group and cp_split, a micro-batch holds this rank's split_for_cp part of each sequence (S =
        seq_len / cp): latents are gathered over the cp group and masked causally by global position (CPMask,
        S x S * cp). doc_ids_BK (train.py --document-mask): the document of each token of the WHOLE
        sequences [B, S * cp] (every cp rank knows them), so that attention stays inside each document; rope's
        positions then restart at each document (core.data.positions_in_documents), as if each ran alone. The sequence-wise balance loss stays per packed sequence.
        cp_split=False: whole sequences, computed by every cp rank alone (generation, evaluation)."""
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
        for layer in self.layers.values():
            layer.rope = ropes

    def default_positions(self, B: int, S: int, device, cp_split: bool = True):
        """Positions 0..S-1, or with cp this rank's global positions of sequences of S * cp tokens."""
        if self.cp_group is None or not cp_split:
            return torch.arange(S, device=device).expand(B, S)
        cp, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        return cp_positions(S * cp, cp_rank, cp, device).expand(B, S)

    def loss_terms(self, args) -> dict[str, LossTerm]:
        """The terms of the training objective by name (core/training.py:LossTerm; train.py --loss-weight NAME=W
        overrides a weight): "lm" the cross-entropy per trained token, "aux" the sequence-wise balance loss per
        micro-batch (--aux-loss-coef, or the config's aux_loss_alpha with seq_aux). Their sums: loss_sums."""
        aux = self.cfg.router_aux_loss_coef if args.aux_loss_coef < 0 else args.aux_loss_coef
        return {"lm": LossTerm(1.0, "tokens"), "aux": LossTerm(aux, "micro_batches")}

    def prepare_batch(self, input_ids_BS, labels_BS, doc_ids_BS, positions_BS) -> dict[str, torch.Tensor]:
        """Extra per-token inputs made from this rank's WHOLE sequences of the step, before the cp split ([B, S]
        each; doc_ids_BS None without --document-mask; positions_BS the rope positions): {name: [B, S, ...]}.
        train.py splits each for cp like the ids, then per micro-batch, and hands them to forward_train / the
        pipeline stages (`extras`). A term's own targets (a LossTerm whose per names one of them) go here. None."""
        return {}

    def initial_state(self, input_ids_BS, extras: dict):
        """[embedding, balance loss 0 [1]]: the state the first decoder layer reads, as the first pipeline stage
        creates it; a variant appends entries here (base layers pass them through, and what crosses pp ranks is
        what this returns: core/pipeline.py takes its shapes and dtypes from it). The embedding is in the compute
        dtype: under bf16 autocast (which leaves the lookup in fp32) that is bf16, and with it the residual stream,
        every norm's output and all that crosses ranks (hidden states between pipeline stages, dispatched and
        combined rows, the cp-gathered latents); fp32 stays where numerics need it: norm statistics, rope, router
        softmax, loss, the balance loss."""
        h_BSH, device = self.embed_tokens(input_ids_BS), input_ids_BS.device.type
        h_BSH = h_BSH.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else h_BSH
        return [h_BSH, torch.zeros(1, device=input_ids_BS.device)]

    def trunk(self, input_ids_BS, position_ids_BS=None, cp_split: bool = True, doc_ids_BK=None, extras=None):
        """Embedding + decoder layers + final norm: the final state, its hidden state normed: [h_BSH, balance loss
        [1], ...]."""
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
        prepare_batch tensors (this rank's cp part)."""
        state = self.trunk(input_ids_BS, position_ids_BS, doc_ids_BK=doc_ids_BK, extras=extras)
        return TrainOutput(self.loss_sums(state, labels_BS, extras or {}))

    def loss_sums(self, state, labels_BS, extras: dict) -> dict[str, torch.Tensor]:
        """Each loss term's sum over this micro-batch (loss_terms' names) from the final state (hidden normed), on
        the last pipeline stage: the cross-entropy summed over labels != -100 and the balance loss."""
        return {"lm": self.cross_entropy_sum(state[0], labels_BS), "aux": self.aux_loss(state[1])}

    def cross_entropy_sum(self, h_BSH, labels_BS):
        """LM head + cross-entropy without the [T, V] logits (Triton on GPU), summed over labels != -100."""
        h_TH, w_VH = h_BSH.flatten(0, 1), self.lm_head.weight
        if torch.is_autocast_enabled(h_TH.device.type):  # autocast does not reach into the fused kernel
            dtype = torch.get_autocast_dtype(h_TH.device.type)
            h_TH, w_VH = h_TH.to(dtype), cast_weight(w_VH, dtype)  # the weight cast once per step
        return linear_cross_entropy(h_TH, w_VH, labels_BS.flatten(), ignore_index=-100, reduction="sum")

    @staticmethod
    def aux_loss(aux_1):
        """DeepSeek-V2's sequence-wise expert-balance loss, unscaled (train.py multiplies by aux_loss_alpha), summed
        over the MoE layers: per layer, the mean over the micro-batch's sequences of sum_e f_e * P_e, with f_e =
        E / (k * T) * (slots of the sequence routed to e) and P_e = mean router probability of e over the
        sequence's T tokens (all tokens, every label). Each layer adds its term to the carried aux_1 (MoE.route),
        so it crosses pipeline stages as one number; with cp, a rank's part uses the whole sequence's counts and
        its own tokens' probabilities: the parts add up to the loss and each part's gradient is exact."""
        return aux_1.sum()

    def take_stats(self) -> dict[str, tuple[torch.Tensor, str]]:
        """This rank's statistics since the last call, for the log line, TensorBoard and metrics.jsonl: name ->
        (tensor, "sum" | "max": how core/metrics.py:reduce_stats combines the ranks, which hold other tokens (dp,
        cp, ep) or other layers (pp)). Every rank returns the same names and shapes (rows of layers held by other
        pipeline stages are 0, or -inf for "max"). expert_load [MoE layers, num_choices] is required (the expert
        bias and the load heatmap use it); a new router adds its own entries. Scalars and 1-D tensors are logged.
        "gather" (core/metrics.py:reduce_stats) concatenates the ranks' rows instead (per-token records for an
        after_step file; not logged). Optional expert_live [MoE layers, num_choices] ("max"; 1 where the router
        can choose the expert now, 0 elsewhere and on rows of other stages' layers): the load max/mean and the
        collapse warning then count only those; absent: every choice is live."""
        stats = {"expert_load": (self.take_expert_load(), "sum")}
        if self.expert_bias_rate > 0:  # expert_bias_range: each MoE layer's bias max - min (-inf: another stage's)
            none = torch.tensor(-torch.inf, device=stats["expert_load"][0].device)
            layers = [self.layers[str(i)] if str(i) in self.layers else None for i in range(self.cfg.num_hidden_layers)
                      if self.cfg.is_moe_layer(i)]
            stats["expert_bias_range"] = (torch.stack([none if layer is None else layer.mlp.gate.expert_bias.max()
                                                       - layer.mlp.gate.expert_bias.min() for layer in layers]), "max")
        return stats

    def after_step(self, done) -> None:
        """The post-step seam: train.py calls it on every rank after each optimizer step (a skipped step too) with a
        core.training.StepDone: step, stats (take_stats reduced over all ranks), optimizer (reinit_ for re-initialised
        rows), out (the run's folder), args, skipped, mesh. What every rank does here must be the same (the stats
        are), so replicas stay identical. Here: the aux-loss-free expert-bias update (--expert-bias-rate)."""
        self.expert_bias_rate = done.args.expert_bias_rate
        if done.args.expert_bias_rate > 0 and not done.skipped:
            self.update_expert_bias(done.stats["expert_load"], done.args.expert_bias_rate)

    @torch.no_grad()
    def update_expert_bias(self, load_LE: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing step of every router this rank holds, from the global expert load [MoE layers, E]
        (identical on every rank, so the biases stay identical too)."""
        moe_ids = [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)]
        for layer_id, load_E in zip(moe_ids, load_LE):
            if str(layer_id) in self.layers:
                update_expert_bias(self.layers[str(layer_id)].mlp.gate.expert_bias, load_E, rate)

    def take_expert_load(self) -> torch.Tensor:
        """(token, slot) pairs per expert routed by this rank since the last call, [MoE layers of the whole
        model, E] with zero rows for layers held by other pipeline stages."""
        moe_ids = [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)]
        device = next(self.parameters()).device
        load_LE = torch.zeros(len(moe_ids), self.cfg.num_choices, device=device)
        for row, i in enumerate(moe_ids):
            mlp = self.layers[str(i)].mlp if str(i) in self.layers else None
            if mlp is not None and mlp.load_E is not None:
                load_LE[row], mlp.load_E = mlp.load_E, None
        return load_LE

    def parameter_rules(self, name: str, t: torch.Tensor) -> ParamRule:
        """What core does with parameter `name` (t: it, or a tensor of its shape; core/training.py:ParamRule): its
        routed experts' global ids (FSDP2 mesh, gradient sums, checkpoint entries, memory estimate), the matrices
        --optimizer muon orthogonalises (views of t; {}: AdamW) and its init. By name (core default_rule): routed
        experts under `.mlp.experts.`, ones for norm weights, zeros for biases, Normal(0, initializer_range) for the
        rest; Muon for the 2-D weights but the embedding, LM head and router. A parameter of another name or rule
        is declared here."""
        rule = default_rule(self, name, t, self.cfg.initializer_range)
        if rule.expert_ids is not None and name.endswith("gate_up_proj"):  # [E, H, J]: gate = [..., :I], up = [..., I:]
            gate, up = t.chunk(2, dim=-1)  # transformers' layout: one matrix per expert, gate and up apart
            return replace(rule, muon={"gate": (gate, rule.expert_ids), "up": (up, rule.expert_ids)})
        if rule.expert_ids is not None and name.endswith("down_proj"):
            return replace(rule, muon={"down": (t, rule.expert_ids)})
        return rule


class PipelineStage:
    """One pipeline stage over this rank's Model, as core/pipeline.py drives it: the initial state (embedding) on
    the first stage, a run of decoder layers, and the final norm, LM head and loss terms on the last. Before each
    step train.py sets `input_ids` / `labels` / `extras` (per micro-batch: Model.prepare_batch's tensors) and
    `loss_fn(terms) -> loss`; the last stage adds each micro-batch's detached term sums to `stats` by name. What
    crosses pp ranks is the state stage 0 creates (Model.initial_state: core/pipeline.py takes its shapes and
    dtypes). A loss term computed at a middle stage (a regulariser over its layers' parameters) rides in a state
    entry to the last stage, so its gradient flows back through the stage hand-offs like the hidden state's."""

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
    """Training FLOPs per token (forward + backward = 3x forward) by operation class: one dict per decoder layer,
    {attention: causal QK^T over D = P + R dims and AV over U, 3 * S * N * (D + U) (2 * S/2 * N * dims each, x3);
    dense: the MLA projections (q or q_a/q_b, kv_a, kv_b, o), router, shared experts and dense MLP, 6 x their
    parameters; experts: the k routed experts, 6 x k x 3HI}, then the first stage's own modules {embedding: 0 (a
    lookup)} and the last stage's {head: 6 x V x H} (final norm: no GEMM; core/pipeline.py:split_layers counts
    both). tools/plan.py times each class; flops_per_token is their sum. cp > 1: every cp rank expands the
    gathered latent of the whole sequence (kv_b_proj on cp x its own tokens, Attention.forward), so that
    projection counts cp times per local token."""
    H, N, C, P, R, U = (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim)
    Q, I = cfg.q_lora_rank, cfg.moe_intermediate_size
    attn = (H * N * (P + R) if Q is None else H * Q + Q * N * (P + R)) + H * (C + R) + cp * C * N * (P + U) + N * U * H
    out = []
    for i in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(i)
        mlp = cfg.n_shared_experts * 3 * H * I + H * cfg.num_choices if moe else 3 * H * cfg.intermediate_size
        out.append({"attention": 3 * seq_len * N * (P + R + U), "dense": 6 * (attn + mlp),
                    "experts": 6 * cfg.slots_per_token * 3 * H * I if moe else 0})
    return out + [{"embedding": 0.0}, {"head": 6 * cfg.vocab_size * H}]  # first stage's, last stage's


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 x active matmul parameters (the k routed
    experts and the shared ones, not all E; LM head included, embedding lookup excluded), plus causal
    attention, 3 * S * N * (D + U) per layer (QK^T over D dims and AV over U, 2 * S/2 * N * dims each, x3)."""
    return sum(sum(part.values()) for part in flops_by_layer(cfg, seq_len))


def cp_gather_width(cfg: ModelConfig) -> int:
    """Numbers per token and layer that attention all-gathers over cp (Attention.forward): the MLA latent and
    the shared rope key, C + R. tools/plan.py times the gather from it."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


# ------------------------------------------------------------------ speed switches (train.py --compile, --fp8)


def compile_dense_parts(model: Model, document_mask: bool = False) -> None:
    """torch.compile(fullgraph=True) the dense parts of every decoder layer, in place (parameter names unchanged):
    the norms, the attention block (projections, norms, rope, expansion, SDPA), the router, shared experts and
    dense MLPs. Left eager: the routed experts and the dispatch/combine around them, the residual adds, and
    attention with a cp group (it all-gathers the latents) or with document_mask (a CPMask). One layer's graphs
    serve all layers (same shapes)."""
    for layer in model.layers.values():
        for module in (layer.input_layernorm, layer.post_attention_layernorm):
            module.compile(fullgraph=True)
        if layer.self_attn.cp_group is None and not document_mask:  # else its mask is a CPMask (flex on CUDA)
            layer.self_attn.compile(fullgraph=True)
        for module in ((layer.mlp.gate, layer.mlp.shared_experts) if isinstance(layer.mlp, MoE) else (layer.mlp,)):
            module.compile(fullgraph=True)


def enable_fp8(model: Model) -> None:
    """FP8 GEMMs (core/fp8.py) for the attention projections, dense and shared MLPs and routed experts, in place.
    The embedding, router (fp32 softmax) and LM head stay in high precision. Call core.fp8.CACHE.invalidate()
    after every optimizer step (the FP8 weight copies are made once per step)."""
    for layer in model.layers.values():
        convert_linears(layer.self_attn)
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts.fp8 = True
            convert_linears(layer.mlp.shared_experts)
        else:
            convert_linears(layer.mlp)


# ------------------------------------------------------------------------------------ checkpoint I/O
# Our names are transformers' names without the "model." prefix, except the routed experts: transformers
# writes one key per expert (experts.{e}.gate_proj.weight [I, H], ...) while we stack them.


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


@torch.no_grad()
def load_hf_checkpoint(model: Model, path) -> list[str]:
    """Fill `model` (possibly partial) from a Hugging Face safetensors folder; returns the tensor names read."""
    reader = CheckpointReader(path)
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            continue
        p.copy_(reader.get(_hf_name(name), p.shape))
    I, H = model.cfg.moe_intermediate_size, model.cfg.hidden_size
    for lname, layer in model.layers.items():
        if not isinstance(layer.mlp, MoE):
            continue
        experts, prefix = layer.mlp.experts, f"model.layers.{lname}.mlp.experts"
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
    """This model's tensors under the names transformers writes (per-expert keys)."""
    out = {}
    I = model.cfg.moe_intermediate_size
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            prefix, ids = "model." + name.removesuffix(".gate_up_proj"), model.get_submodule(name.rsplit(".", 1)[0]).expert_ids
            for j, e in enumerate(ids):
                out[f"{prefix}.{e}.gate_proj.weight"] = p[j, :, :I].T
                out[f"{prefix}.{e}.up_proj.weight"] = p[j, :, I:].T
        elif name.endswith("experts.down_proj"):
            prefix, ids = "model." + name.removesuffix(".down_proj"), model.get_submodule(name.rsplit(".", 1)[0]).expert_ids
            for j, e in enumerate(ids):
                out[f"{prefix}.{e}.down_proj.weight"] = p[j].T
        else:
            out[_hf_name(name)] = p
    return out


def save_hf_checkpoint(model: Model, path, dtype: torch.dtype | None = None, dense: bool = True, experts: bool = True) -> None:
    """Write `model` as a folder that transformers' DeepseekV2ForCausalLM.from_pretrained loads. In a distributed
    run every rank calls it (see core.hf_io.write_hf_folder) and writes what it owns: `dense` / `experts` say
    whether this rank is the first replica of its dense / routed-expert tensors."""
    tensors = {k: (v.to(dtype) if dtype else v) for k, v in hf_state_dict(model).items()
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
# What the shared correctness checks need to know about this recipe. tests/test_recipes.py runs them for every
# folder under recipes/ (a copy of this folder is checked with no test file added) and
# skills/validate-correctness/scripts/validate.py --recipe <folder> prints them as one table: parity with
# transformers (or equality with BASE_RECIPE), every parallel layout against one process, resume, recompute, bf16,
# export round trip, buffers. No name here starts with "test" (pytest would collect it where a test imports it).
#   TRANSFORMERS_CLASS  the transformers class this model equals (logits, gradients, checkpoint names); None once
#                       the model departs from it, and then BASE_RECIPE must name the recipe it was copied from.
#   BASE_RECIPE         None, or the recipe folder this one is a variant of: trained on check_setup()["base_config"]
#                       (the new feature switched off) both give the same losses, grad norms and weights.
#   check_setup()       "config": the small model every check builds and trains (config.json fields; vocab_size
#                       >= 256, the test data's); "seq_len": tokens per sequence, a multiple of 4 (cp2 cuts it into
#                       4 chunks) and long enough for the attention's blocks and windows (64 or 128 if it needs);
#                       "base_config": config.json fields both this recipe and BASE_RECIPE read, or None.
#   SHARED_TRAIN_PY     True: train.py is the shared file, byte-identical to every other recipe's that says so
#                       (tests/test_layers.py); False for a copy whose train.py differs on purpose.
TRANSFORMERS_CLASS = "DeepseekV2ForCausalLM"
BASE_RECIPE = None
SHARED_TRAIN_PY = True


def check_setup() -> dict:
    """6 layers, the first dense (with pp=2 each of the 4 stages holds some), 4 experts top-2 with 1 shared expert,
    YaRN (original length 16 < 32: the scaled frequencies and the softmax scale both act), the sequence-wise
    balance loss with alpha 0.1 (large enough that its gradient shows in the router's)."""
    config = {"model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
              "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "n_shared_experts": 1, "intermediate_size": 64, "first_k_dense_replace": 1,
              "aux_loss_alpha": 0.1, "seq_aux": True, "rope_theta": 10000.0,
              "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "mscale": 1.0,
                               "mscale_all_dim": 0.707}, "max_position_embeddings": 64}
    return {"config": config, "seq_len": 32, "base_config": None}


if __name__ == "__main__":  # print the parameter count of the released config without allocating it
    with torch.device("meta"):
        m = Model(ModelConfig.from_hf(real_config_path()))
    total = sum(p.numel() for p in m.parameters())
    print(json.dumps({"parameters": total, "billions": round(total / 1e9, 3), "gflops_per_token_4k": round(flops_per_token(m.cfg, 4096) / 1e9, 2)}))
