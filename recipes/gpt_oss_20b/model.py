"""GPT-OSS (GPT-OSS-20B): GQA attention with biases and a learned sink logit per head, layers alternating
sliding-window and full attention (`Attention.forward`, `ModelConfig.window`), YaRN rope, a biased top-k router
(softmax over the chosen experts only), experts with biases and a clamped SwiGLU on interleaved gate/up
(`Experts.forward`), routed experts in every layer.

Numerics follow transformers' `GptOssForCausalLM` (checked by tests/test_gpt_oss_parity.py). The released
checkpoint stores the expert matrices in MXFP4 (`*_blocks` + `*_scales`); load_hf_checkpoint dequantises them
per expert shard (core.hf_io.dequantize_mxfp4).

Legend: B batch, S sequence, T = B*S tokens, H hidden, N query heads, G key/value heads, D head dim,
V vocab, E experts (held by this rank), k experts per token, R = T*k routed rows, I expert ffn width,
J = 2*I (gate and up interleaved: gate = [..., 0::2], up = [..., 1::2]), L layers.

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.attention import CPMask, attention, cp_attention_mask
from core.context import cp_positions
from core.fp8 import convert_linears, fp8_grouped_mm
from core.hf_io import CheckpointReader, dequantize_mxfp4, read_hf_config, variant_config, write_hf_folder
from core.kernels.cross_entropy import linear_cross_entropy
from core.kernels.swiglu import gptoss_swiglu
from core.moe import expert_counts, expert_matmul, moe_forward, update_expert_bias, weighted_rows
from core.pipeline import running
from core.placement import Placement, gather_experts
from core.precision import compute_dtype, upcast
from core.routing import routing
from core.training import LossTerm, ParamRule, check_args, constant, default_rule, init_parameters, normal
from core.weight_cache import cast_weight

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class ModelConfig:
    vocab_size: int = 201088
    hidden_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_experts: int = 32  # num_local_experts in the Hugging Face config
    num_experts_per_tok: int = 4
    intermediate_size: int = 2880  # expert ffn width
    sliding_window: int = 128
    layer_types: list[str] = field(default_factory=list)  # per layer: sliding_attention | full_attention
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict = field(default_factory=dict)  # {} = plain rope; yarn: factor, beta_fast, beta_slow, ...
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.9
    initializer_range: float = 0.02
    max_position_embeddings: int = 131072
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # kept only to write config.json back
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.layer_types:  # transformers' default: sliding on even layers, full on odd ones
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {self.num_hidden_layers} entries of {LAYER_TYPES}, got "
                             f"{self.layer_types}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 1")

    @classmethod
    def from_hf(cls, path) -> "ModelConfig":
        """Read a Hugging Face GPT-OSS config.json (the file, or a checkpoint folder holding it): the released one
        (rope_scaling, rope_theta at the top) or one transformers writes (rope_parameters)."""
        hf = read_hf_config(path)
        if hf.get("model_type") not in ("gpt_oss", Path(__file__).parent.name):  # (the second: this variant's exports)
            raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, this recipe reads 'gpt_oss' configs"
                             + (f" ({hf['how_to_load']})" if "how_to_load" in hf else ""))
        if hf.get("tie_word_embeddings"):
            raise ValueError(f"{path}: tie_word_embeddings=true is not supported by this recipe (GPT-OSS is untied)")
        if not hf.get("attention_bias", True):
            raise ValueError(f"{path}: attention_bias=false is not supported (GPT-OSS attention has biases)")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 150000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"{path}: rope_type {rope_type!r} is not supported (default or yarn)")
        names = {f.name for f in cls.__dataclass_fields__.values()}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["num_experts"] = hf.get("num_local_experts", hf.get("num_experts", cls.num_experts))
        kwargs["rope_theta"], kwargs["rope_scaling"] = float(theta), rope if rope_type == "yarn" else {}
        kwargs["sliding_window"] = hf.get("sliding_window") or cls.sliding_window
        kwargs["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        return cls(**kwargs)

    def to_hf(self) -> dict:
        """The config.json that transformers needs to load an exported folder."""
        hf = asdict(self)
        hf["num_local_experts"] = hf.pop("num_experts")
        hf["rope_parameters"] = {"rope_type": "default", **hf.pop("rope_scaling"), "rope_theta": hf.pop("rope_theta")}
        return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_act": "silu",
                "attention_bias": True, "tie_word_embeddings": False, "attention_dropout": 0.0, "dtype": "float32", **hf}

    def is_moe_layer(self, i: int) -> bool:  # every GPT-OSS layer has routed experts
        return True

    @property
    def num_choices(self) -> int:
        """The router's choice space: the ids it scores and picks, 0..num_choices-1 (its weight rows, expert
        bias, load and aux statistics). num_experts (config.json's num_local_experts) counts the routed experts
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

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None




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
        f"{path}: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of num_key_value_heads "
        f"({cfg.num_key_value_heads})": cfg.num_key_value_heads >= 1 and cfg.num_attention_heads % cfg.num_key_value_heads == 0,
        f"{path}: hidden_size, head_dim, intermediate sizes, vocab_size and num_hidden_layers must be >= 1":
            min(cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
                cfg.num_hidden_layers) >= 1,
    })
    return cfg
# ---------------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise and scale in fp32, then cast (GPT-OSS keeps its norms in fp32)
        x32 = upcast(x)  # fp32, or float64 kept (a float64 reference model)
        return (upcast(self.weight) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, dtype=torch.float32) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the factor on cos/sin: plain rope, or YaRN as transformers computes it
    (frequencies blended between interpolated and extrapolated by a linear ramp over the correction range); in fp32,
    or float64 for dtype float64."""
    D, base, rs = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    pos_freqs = base ** (torch.arange(0, D, 2, dtype=compute_dtype(dtype)) / D)
    if not rs:
        return 1.0 / pos_freqs, 1.0
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return D * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.get("beta_fast") or 32), correction_dim(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(D // 2, dtype=pos_freqs.dtype) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(position_ids_BS: torch.Tensor, cfg: ModelConfig, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, D/2] (times the YaRN attention factor) at the given (global) positions."""
    inv_freq, scale = rope_inv_freq(cfg, dtype)
    freqs_BSd = position_ids_BS[..., None].to(inv_freq.dtype) * inv_freq.to(position_ids_BS.device)
    return (freqs_BSd.cos() * scale).to(dtype)[:, None], (freqs_BSd.sin() * scale).to(dtype)[:, None]


def apply_rope(x_BNSD, cos, sin):
    x1, x2 = x_BNSD.chunk(2, dim=-1)
    cos, sin = cos.to(x_BNSD.dtype), sin.to(x_BNSD.dtype)  # in the activations' dtype, as transformers does
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        N, G, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.N, self.G, self.D = N, G, D
        self.q_proj = nn.Linear(H, N * D)
        self.k_proj = nn.Linear(H, G * D)
        self.v_proj = nn.Linear(H, G * D)
        self.o_proj = nn.Linear(N * D, H)
        self.sinks = nn.Parameter(torch.empty(N))  # one logit per head in the softmax denominator, without a value

    def forward(self, x_BSH, cos, sin, mask_BSK: CPMask, cp_group=None):
        """x holds this rank's split_for_cp part of each sequence (the whole sequence without cp_group): K and V
        of the whole sequence (K = S * cp) are gathered over cp_group and this rank's queries attend to them under
        mask_BSK (causal, sliding window on sliding layers; flex_attention on CUDA), with the sinks."""
        B, S, _ = x_BSH.shape
        q_BNSD = self.q_proj(x_BSH).view(B, S, self.N, self.D).transpose(1, 2)
        k_BGSD = self.k_proj(x_BSH).view(B, S, self.G, self.D).transpose(1, 2)
        v_BGSD = self.v_proj(x_BSH).view(B, S, self.G, self.D).transpose(1, 2)
        q_BNSD, k_BGSD = apply_rope(q_BNSD, cos, sin), apply_rope(k_BGSD, cos, sin)
        o_BNSD = attention(q_BNSD, k_BGSD, v_BGSD, mask_BSK, cp_group, sinks_N=self.sinks)
        return self.o_proj(o_BNSD.transpose(1, 2).reshape(B, S, self.N * self.D))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_choices, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_choices))
        # aux-loss-free balancing (core.moe.update_expert_bias): shifts which experts are chosen, not their weights
        self.register_buffer("expert_bias", torch.zeros(cfg.num_choices))
        self.k = cfg.num_experts_per_tok

    def forward(self, x_TH):
        """Top-k of the raw logits (plus the balancing bias), softmax over the k chosen logits (in fp32)."""
        logits_TE = F.linear(x_TH, self.weight, self.bias)
        ids_Tk = (upcast(logits_TE) + self.expert_bias).topk(self.k, dim=-1).indices
        weights_Tk = logits_TE.gather(1, ids_Tk).softmax(dim=-1, dtype=compute_dtype(logits_TE.dtype))
        return logits_TE, weights_Tk.to(x_TH.dtype), ids_Tk


class Experts(nn.Module):
    """Routed experts stacked for grouped GEMMs, in transformers' layout: gate_up_proj [E, H, J]
    (gate and up interleaved), gate_up_proj_bias [E, J], down_proj [E, I, H], down_proj_bias [E, H]; local
    expert j is global expert expert_ids[j]."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int]):
        super().__init__()
        self.expert_ids, self.alpha, self.limit = list(expert_ids), cfg.swiglu_alpha, cfg.swiglu_limit
        E, H, I = len(self.expert_ids), cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.fp8 = False  # set by enable_fp8

    def forward(self, rows_RH, counts_E):
        mm = fp8_grouped_mm if self.fp8 else expert_matmul  # expert_matmul: weight gradient may be delayed
        R = rows_RH.shape[0]
        expert_R = torch.arange(counts_E.numel(), device=rows_RH.device).repeat_interleave(counts_E, output_size=R)
        h_RJ = mm(rows_RH, self.gate_up_proj, counts_E)
        h_RJ = h_RJ + self.gate_up_proj_bias[expert_R].to(h_RJ.dtype)
        y_RH = mm(gptoss_swiglu(h_RJ, self.alpha, self.limit), self.down_proj, counts_E)  # Triton on GPU
        return y_RH + self.down_proj_bias[expert_R].to(y_RH.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_ids: list[int], ep_group, cp_group):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg, expert_ids)
        self.num_experts, self.k, self.ep_group, self.cp_group = cfg.num_experts, cfg.num_experts_per_tok, ep_group, cp_group
        self.num_choices = cfg.num_choices  # the router's ids; num_experts: the dispatched ones (ModelConfig.num_choices)
        self.load_E = None  # (token, slot) pairs routed per expert since Model.take_expert_load

    def route(self, x_TH, aux_2E):
        """Router, plus this layer's share of the load-balancing loss statistics added to aux_2E: row 0 the summed
        softmax probabilities (over all experts) per expert (differentiable), row 1 the top-k counts per expert of
        the whole micro-batch (summed over the cp ranks, which hold the other tokens; no gradient). See
        Model.aux_loss. load_E counts the routed slots actually taken. No host sync."""
        logits_TE, weights_Tk, ids_Tk = self.router(x_TH)
        probs_TE = logits_TE.softmax(dim=-1)
        routing.note_entropy(probs_TE)  # router entropy per layer in the log (core/routing.py)
        counts_E = expert_counts(probs_TE.topk(self.k, dim=-1).indices, self.num_choices).float()
        if self.cp_group is not None:
            dist.all_reduce(counts_E, group=self.cp_group)
        load_E = expert_counts(ids_Tk, self.num_choices)
        self.load_E = load_E if self.load_E is None else self.load_E + load_E
        return weights_Tk, ids_Tk, aux_2E + torch.stack([upcast(probs_TE).sum(0), counts_E])


RECOMPUTE = ("none", "attention", "layer")


class DecoderLayer(nn.Module):
    """One decoder layer. Its step order is written once, in `before_mlp` (the attention block with its residual
    add, then the MLP's input norm), followed by the routed experts as the three compute steps that
    core/pipeline.py interleaves (its contract): (1) `attention` (before_mlp, router), (3) `routed_experts`, (5)
    `finish` (residual add), the dispatch and combine all-to-alls (2) and (4) running between them in core/moe.py.
    `state` is [hidden x_BSH, aux_2E, *more] (more: whatever a variant's Model.initial_state adds, passed through
    untouched). `rope` holds (cos, sin, attention mask, cp group or None) of each micro-batch of the step, set by
    Model.set_positions (one entry: the same for every micro-batch); `current_rope` picks the running one.

    recompute (RECOMPUTE) wraps these same functions (`_run`): "attention" keeps only the input of each attention
    block (input norm, projections, rope, attention with sinks, output projection) and recomputes the rest in
    backward; "layer" keeps only the inputs of before_mlp and of the router: in backward the dispatch all-to-all
    runs again (core/moe.py recompute_dispatch), then step (3) (the expansion, the expert GEMMs, SwiGLU and the
    weighting). The router (whose expert counts are statistics) and the combine run once."""

    moe = True  # every GPT-OSS layer has routed experts

    def __init__(self, cfg: ModelConfig, layer_id: int, expert_ids: list[int], ep_group, cp_group=None,
                 recompute: str = "none", placement: Placement | None = None):
        super().__init__()
        self.recompute = recompute
        self.recompute_dispatch = recompute == "layer"  # core/moe.py, core/pipeline.py read it
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, expert_ids, ep_group, cp_group)
        self.window = cfg.window(layer_id)
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
        x_BSH, aux_2E, *more = state
        h_BSH, x_TH = self._run("layer", self.before_mlp, x_BSH)
        weights_Tk, ids_Tk, aux_2E = self.mlp.route(x_TH, aux_2E)
        return [h_BSH, aux_2E, *more], x_TH, ids_Tk, weights_Tk

    def routed_experts(self, x_QH, row_R, counts_L, weights_R):  # (3)
        return self._run("layer", weighted_rows, self.mlp.experts, x_QH, row_R, counts_L, weights_R)  # [R, H]

    def finish(self, state, x_TH, out_TH):  # (5) x_TH: step (1)'s routed tokens (a zero-computation expert's input)
        h_BSH, *more = state
        return [h_BSH + out_TH.view_as(h_BSH), *more]

    def forward(self, state):
        """The five steps back to back (the pipeline schedule runs them interleaved instead)."""
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
        # "aux": load-balancing loss (unscaled), as transformers' load_balancing_loss_func; with cp, this
        # rank's part of the micro-batch's loss (the cp ranks' parts sum to it, see Model.aux_loss)
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
        self.cfg, self.cp_group, self.ep_group = cfg, cp_group, ep_group
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
        """Rope at these positions, and the attention masks, for every layer: one micro-batch's tensors for every
        micro-batch, or lists of them, one per micro-batch of the step, of which each layer takes the running
        one (DecoderLayer.current_rope).
        With a cp group and cp_split, a micro-batch holds this rank's split_for_cp part of each sequence
        (S = seq_len / cp): keys and values are gathered over the cp group and masked by global position (CPMask,
        S x S * cp): causal, and on sliding layers within the window, which may reach into other ranks' chunks.
        doc_ids_BK (train.py --document-mask): the document of each token of the WHOLE
        sequences [B, S * cp] (every cp rank knows them), so that attention stays inside each document; rope's
        positions then restart at each document (core.data.positions_in_documents), as if each ran alone. The window counts global positions, which within a document differ as the restarted ones do;
        the sinks join each query's softmax as ever, over the keys it sees.
        cp_split=False: whole sequences, computed by every cp rank alone (generation, evaluation)."""
        many = isinstance(position_ids_BS, list)
        pairs = zip(position_ids_BS, doc_ids_BK or [None] * len(position_ids_BS)) if many else [(position_ids_BS, doc_ids_BK)]
        cp, cp_rank = (1, 0) if self.cp_group is None or not cp_split else \
            (dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group))
        ropes = {w: [] for w in (None, self.cfg.sliding_window)}
        for positions_BS, docs_BK in pairs:
            S, dev = positions_BS.shape[1], positions_BS.device
            cos, sin = rope_cos_sin(positions_BS, self.cfg, next(self.parameters()).dtype)
            for w, per_mb in ropes.items():
                mask = cp_attention_mask(S * cp, cp_rank, cp, window=w, doc_ids_BK=docs_BK, device=dev) \
                    or CPMask(torch.arange(S, device=dev), S)
                per_mb.append((cos, sin, mask, self.cp_group if cp > 1 else None))
        for layer in self.layers.values():
            layer.rope = ropes[layer.window]

    def default_positions(self, B: int, S: int, device, cp_split: bool = True):
        """Positions 0..S-1, or with cp this rank's global positions of sequences of S * cp tokens."""
        if self.cp_group is None or not cp_split:
            return torch.arange(S, device=device).expand(B, S)
        cp, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        return cp_positions(S * cp, cp_rank, cp, device).expand(B, S)

    def loss_terms(self, args) -> dict[str, LossTerm]:
        """The terms of the training objective by name (core/training.py:LossTerm; train.py --loss-weight NAME=W
        overrides a weight): "lm" the cross-entropy per trained token, "aux" the balance loss per micro-batch
        (--aux-loss-coef, or the config's router_aux_loss_coef). Their sums per micro-batch: loss_sums."""
        aux = self.cfg.router_aux_loss_coef if args.aux_loss_coef < 0 else args.aux_loss_coef
        return {"lm": LossTerm(1.0, "tokens"), "aux": LossTerm(aux, "micro_batches")}

    def prepare_batch(self, input_ids_BS, labels_BS, doc_ids_BS, positions_BS) -> dict[str, torch.Tensor]:
        """Extra per-token inputs made from this rank's WHOLE sequences of the step, before the cp split ([B, S]
        each; doc_ids_BS None without --document-mask; positions_BS the rope positions): {name: [B, S, ...]}.
        train.py splits each for cp like the ids, then per micro-batch, and hands them to forward_train / the
        pipeline stages (`extras`). A term's own targets (a LossTerm whose per names one of them) go here. None."""
        return {}

    def initial_state(self, input_ids_BS, extras: dict) -> list[torch.Tensor]:
        """The state the layers carry, as the first pipeline stage creates it: [embedding x_BSH, aux statistics
        [2, E]]; a variant appends entries here (base layers pass them through, and what crosses pp ranks is
        what this returns: core/pipeline.py takes its shapes and dtypes from it)."""
        return [self.embed(input_ids_BS), torch.zeros(2, self.cfg.num_choices, device=input_ids_BS.device)]

    def trunk(self, input_ids_BS, position_ids_BS=None, cp_split: bool = True, doc_ids_BK=None, extras=None):
        """Embedding + decoder layers + final norm: the final state, its hidden state normed: [h_BSH, aux_2E, ...]."""
        B, S = input_ids_BS.shape
        if position_ids_BS is None:
            position_ids_BS = self.default_positions(B, S, input_ids_BS.device, cp_split)
        self.set_positions(position_ids_BS, cp_split, doc_ids_BK)
        state = self.initial_state(input_ids_BS, extras or {})
        for layer in self.layers.values():
            state = layer(state)
        return [self.norm(state[0]), *state[1:]]

    def embed(self, input_ids_BS):
        """The embedding [B, S, H] in the compute dtype. Under bf16 autocast (which leaves the lookup in fp32) that
        is bf16, and with it the residual stream, every norm's output and all that crosses ranks (hidden states
        between pipeline stages, dispatched and combined rows); fp32 stays where numerics need it: norm statistics,
        router softmax, loss, aux-loss statistics."""
        h_BSH, device = self.embed_tokens(input_ids_BS), input_ids_BS.device.type
        return h_BSH.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else h_BSH

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
        return {"lm": self.cross_entropy_sum(state[0], labels_BS), "aux": self.aux_loss(state[1], labels_BS.numel())}

    def cross_entropy_sum(self, h_BSH, labels_BS):
        """LM head + cross-entropy without the [T, V] logits (Triton on GPU), summed over labels != -100."""
        h_TH, w_VH = h_BSH.flatten(0, 1), self.lm_head.weight
        if torch.is_autocast_enabled(h_TH.device.type):  # autocast does not reach into the fused kernel
            dtype = torch.get_autocast_dtype(h_TH.device.type)
            h_TH, w_VH = h_TH.to(dtype), cast_weight(w_VH, dtype)  # the weight cast once per step
        return linear_cross_entropy(h_TH, w_VH, labels_BS.flatten(), ignore_index=-100, reduction="sum")

    def aux_loss(self, aux_2E, tokens: int):
        """transformers' load_balancing_loss_func over all layers' tokens together: E * sum_e f_e * P_e, with
        f_e = top-k slots of the router softmax routed to e / N and P_e = summed router probability of e / N,
        N = layers x tokens of the micro-batch. aux_2E holds the sums (MoE.route). With cp, the counts cover the
        whole micro-batch and the probabilities this rank's tokens only: the cp ranks' parts add up to the loss,
        and each part's gradient is exactly the loss's gradient on that rank's tokens. Computed at the end, it
        also works across pipeline stages, which carry aux_2E along with the hidden state."""
        cfg = self.cfg
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        return cfg.num_choices * (aux_2E[0] * aux_2E[1]).sum() / (cfg.num_hidden_layers * tokens * cp) ** 2

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
            layers = [self.layers[str(i)] if str(i) in self.layers else None
                      for i in range(self.cfg.num_hidden_layers)]
            stats["expert_bias_range"] = (torch.stack([none if layer is None else layer.mlp.router.expert_bias.max()
                                                       - layer.mlp.router.expert_bias.min() for layer in layers]), "max")
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
                update_expert_bias(self.layers[str(layer_id)].mlp.router.expert_bias, load_E, rate)

    def take_expert_load(self) -> torch.Tensor:
        """(token, slot) pairs per expert routed by this rank since the last call, [layers of the whole model, E]
        with zero rows for layers held by other pipeline stages."""
        device = next(self.parameters()).device
        load_LE = torch.zeros(self.cfg.num_hidden_layers, self.cfg.num_choices, device=device)
        for i, layer in self.layers.items():
            if layer.mlp.load_E is not None:
                load_LE[int(i)], layer.mlp.load_E = layer.mlp.load_E, None
        return load_LE

    def parameter_rules(self, name: str, t: torch.Tensor) -> ParamRule:
        """What core does with parameter `name` (t: it, or a tensor of its shape; core/training.py:ParamRule): its
        routed experts' global ids (FSDP2 mesh, gradient sums, checkpoint entries, memory estimate), the matrices
        --optimizer muon orthogonalises (views of t; {}: AdamW) and its init. By name (core default_rule): routed
        experts under `.mlp.experts.`, ones for norm weights, zeros for biases, Normal(0, initializer_range) for the
        rest; Muon for the 2-D weights but the embedding, LM head and router. A parameter of another name or rule
        is declared here.
        Here also: zeros for the experts' biases, Normal for the router's bias and the sinks; AdamW for the router."""
        rule = default_rule(self, name, t, self.cfg.initializer_range)
        if rule.expert_ids is not None and name.endswith("gate_up_proj"):  # [E, H, J], gate and up interleaved
            rule = replace(rule, muon={"gate": (t[..., 0::2], rule.expert_ids), "up": (t[..., 1::2], rule.expert_ids)})
        elif rule.expert_ids is not None and name.endswith("down_proj"):
            rule = replace(rule, muon={"down": (t, rule.expert_ids)})
        elif name.endswith("mlp.router.weight"):
            rule = replace(rule, muon={})
        if name.endswith("_bias"):  # the experts' [E, J] and [E, H] biases (AdamW: 2-D, not matrices)
            rule = replace(rule, init=constant(0.0))
        return replace(rule, init=normal(self.cfg.initializer_range)) if name.endswith("router.bias") else rule


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
    {attention: scores and values, 12 * N * D per visible key (QK^T and AV, 2 flops each, x3) with the mean
    number of keys a query sees, (S + 1) / 2 on full layers, w - w(w - 1) / 2S on sliding ones (window w < S; the
    sink is one logit per head, not counted); dense: q/k/v/o projections and router, 6 x their weights; experts:
    the k routed experts, 6 x k x 3HI}, then the first stage's own modules {embedding: 0 (a lookup)} and the last
    stage's {head: 6 x V x H} (final norm, biases: no GEMM; core/pipeline.py:split_layers counts both).
    tools/plan.py times each class; flops_per_token is their sum. cp: no part of a layer repeats under context
    parallelism."""
    H, N, G, D, S = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, seq_len
    out = []
    for i in range(cfg.num_hidden_layers):
        w = cfg.window(i)
        keys = (S + 1) / 2 if w is None or w >= S else w - w * (w - 1) / (2 * S)
        out.append({"attention": 12 * N * D * keys, "dense": 6 * (H * (N + 2 * G) * D + N * D * H + H * cfg.num_choices),
                    "experts": 6 * cfg.slots_per_token * 3 * H * cfg.intermediate_size})
    return out + [{"embedding": 0.0}, {"head": 6 * cfg.vocab_size * H}]  # first stage's, last stage's


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 x active matmul parameters (the k routed
    experts, not all E; router and LM head included, embedding lookup and biases excluded), plus attention
    scores and values (flops_by_layer: the mean number of keys a query sees on full and sliding layers)."""
    return sum(sum(part.values()) for part in flops_by_layer(cfg, seq_len))


def cp_gather_width(cfg: ModelConfig) -> int:
    """Numbers per token and layer that attention all-gathers over cp (core.attention.attention): K and V of
    the G key-value heads. tools/plan.py times the gather from it."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim


# ------------------------------------------------------------------ speed switches (train.py --compile, --fp8)


def compile_dense_parts(model: Model, document_mask: bool = False) -> None:
    """torch.compile(fullgraph=True) the norms and the router of every decoder layer, in place (parameter names
    unchanged). Left eager: attention (its core already runs as compiled flex_attention on CUDA, whose block
    mask is built outside the graph; document_mask changes nothing), the routed experts and the dispatch/combine around them (row counts depend
    on the routing, and the all-to-alls), the residual adds. One layer's graphs serve all layers."""
    for layer in model.layers.values():
        for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.router):
            module.compile(fullgraph=True)


def enable_fp8(model: Model) -> None:
    """FP8 GEMMs (core/fp8.py) for the attention projections and routed experts, in place (biases added in high
    precision). The embedding, router and LM head stay in high precision. Call core.fp8.CACHE.invalidate()
    after every optimizer step (the FP8 weight copies are made once per step)."""
    for layer in model.layers.values():
        convert_linears(layer.self_attn)
        layer.mlp.experts.fp8 = True


# ------------------------------------------------------------------------------------ checkpoint I/O
# Our names are transformers' names without the "model." prefix, the expert tensors included (same layout).
# The released checkpoint replaces gate_up_proj / down_proj by MXFP4 `_blocks` [E, out, in/32, 16] and
# `_scales` [E, out, in/32]; we dequantise them to [E, in, out].

EXPERT_MATRICES = ("gate_up_proj", "down_proj")


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


@torch.no_grad()
def load_hf_checkpoint(model: Model, path) -> list[str]:
    """Fill `model` (possibly partial) from a Hugging Face safetensors folder, bf16/fp32 or the released MXFP4
    layout; each expert shard reads (and dequantises) only its own experts. Returns the tensor names read."""
    reader = CheckpointReader(path)
    E = model.cfg.num_experts
    for name, p in model.named_parameters():
        hf = _hf_name(name)
        if ".experts." not in name:
            p.copy_(reader.get(hf, p.shape))
            continue
        ids = model.get_submodule(name.rsplit(".", 1)[0]).expert_ids  # this rank's experts only
        if hf in reader or not name.endswith(EXPERT_MATRICES):
            p.copy_(reader.get_rows(hf, (E, *p.shape[1:]), ids))
            continue
        K, M = p.shape[1:]  # [in, out]
        if K % 32:
            raise ValueError(f"{hf}: MXFP4 needs an input width divisible by 32, the config gives {K}")
        blocks = reader.get_rows(hf + "_blocks", (E, M, K // 32, 16), ids)
        scales = reader.get_rows(hf + "_scales", (E, M, K // 32), ids)
        p.copy_(dequantize_mxfp4(blocks, scales, p.dtype).flatten(-2).transpose(1, 2))
    return reader.names_read


@torch.no_grad()
def hf_state_dict(model: Model, dense: bool = True, experts: bool = True) -> dict[str, torch.Tensor]:
    """This model's tensors under the names transformers writes. With an ep group, each ep rank gathers the
    whole expert tensors of every ep-th layer (layer i on ep rank i % ep; core/placement.py:gather_experts puts
    every rank's experts back in global order) and returns those: every rank calls it. `dense` / `experts`: whether to return the non-expert / expert
    tensors (whether this rank is their first replica)."""
    out = {}
    ep_group = model.ep_group
    ep, ep_rank = (1, 0) if ep_group is None else (dist.get_world_size(ep_group), dist.get_rank(ep_group))
    for name, p in model.named_parameters():
        if ".experts." not in name:
            if dense:
                out[_hf_name(name)] = p
            continue
        owner = int(name.split(".")[1]) % ep
        if ep > 1:
            p = gather_experts(p.detach(), model.layers[name.split(".")[1]].placement, ep_group, owner)
        if experts and ep_rank == owner:
            out[_hf_name(name)] = p
    return out


def save_hf_checkpoint(model: Model, path, dtype: torch.dtype | None = None, dense: bool = True, experts: bool = True) -> None:
    """Write `model` as a folder that transformers' GptOssForCausalLM.from_pretrained loads (bf16/fp32, not
    MXFP4). In a distributed run every rank calls it (see core.hf_io.write_hf_folder and hf_state_dict)."""
    tensors = {k: (v.to(dtype) if dtype else v) for k, v in hf_state_dict(model, dense, experts).items()}
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
TRANSFORMERS_CLASS = "GptOssForCausalLM"
BASE_RECIPE = None
SHARED_TRAIN_PY = True


def check_setup() -> dict:
    """6 layers alternating sliding and full attention (with pp=2 each of the 4 stages holds some), sinks, 4
    experts top-2 with biases. Window 6 over sequences of 32: at cp=2 the 4 chunks hold 8 tokens each, so a query
    early in a chunk sees keys of the chunk before it, held by the other cp rank (chunks 0, 3 on rank 0 and 1, 2 on
    rank 1)."""
    config = {"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
              "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 6, "router_aux_loss_coef": 0.01}
    return {"config": config, "seq_len": 32, "base_config": None}


if __name__ == "__main__":  # print the parameter count of the released config without allocating it
    with torch.device("meta"):
        m = Model(ModelConfig.from_hf(real_config_path()))
    total = sum(p.numel() for p in m.parameters())
    print(json.dumps({"parameters": total, "billions": round(total / 1e9, 3), "gflops_per_token_4k": round(flops_per_token(m.cfg, 4096) / 1e9, 2)}))
