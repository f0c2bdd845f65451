"""Qwen3-MoE (Qwen3-30B-A3B): GQA attention with per-head q/k RMSNorm and rotate-half rope (`Attention.forward`), a
softmax top-k router (`Router.forward`), each layer MoE or dense by config (`ModelConfig.is_moe_layer`).

Numerics follow transformers' `Qwen3MoeForCausalLM` (checked by tests/test_qwen3_parity.py).

Legend: B batch, S sequence, T = B*S tokens, H hidden, N query heads, G key/value heads, D head dim,
V vocab, E experts (held by this rank), k experts per token, R = T*k routed rows, I expert ffn width,
J = 2*I (gate and up side by side), F dense ffn width, L layers.

A Model may be partial: `layers` picks which decoder layers it holds (parameter names keep the global
layer index, `layers.7.…`), `expert_ids` which routed experts (global ids; with `ep_group` given, this rank's
experts of the `placement`, core/placement.py, and tokens reach them through core/moe.py's all-to-all), `embed`/`head` whether it
holds the embedding and the final norm + LM head. Checkpoint I/O then touches only those tensors.

Seams (skills/add-new-architecture/SKILL.md's table, in this file's order): a config field `ModelConfig`,
`load_config`; attention `Attention.forward` (through core.attention.attention) and its masks
`Model.set_positions`; the router `Router`, `MoE.route`; expert kinds `ModelConfig.num_choices` (the router's
choices) vs `num_experts` (the dispatched ones), `DecoderLayer.finish`; the layer's step order
`DecoderLayer.before_mlp` (recompute: `DecoderLayer._run`); state crossing pipeline stages: the `state` list
of `DecoderLayer` (entries after the first two pass through every base layer) made by `Model.initial_state`
(what crosses pp ranks follows it); the running micro-batch `DecoderLayer.current_rope`
(core.pipeline.running); loss terms `Model.loss_terms` (name -> weight, denominator) and their sums
`Model.loss_sums`; per-token inputs made from whole sequences `Model.prepare_batch`; optional flags
`Model.features`; statistics `Model.take_stats`; after each step `Model.after_step`; each parameter's group,
Muon matrices and init `Model.parameter_rules`; slots a token fills `ModelConfig.slots_per_token`; the shared
checks' config `check_setup` (end of file).
"""

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.attention import attention, cp_attention_mask
from core.context import cp_positions
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
    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    intermediate_size: int = 6144  # only for dense layers (mlp_only_layers / decoder_sparse_step)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    attention_bias: bool = False
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # kept only to write config.json back

    @classmethod
    def from_hf(cls, path) -> "ModelConfig":
        """Read a Hugging Face Qwen3-MoE config.json (the file, or a checkpoint folder holding it)."""
        hf = read_hf_config(path)
        if hf.get("model_type") not in ("qwen3_moe", Path(__file__).parent.name):  # (the second: this variant's exports)
            raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, this recipe reads 'qwen3_moe' configs"
                             + (f" ({hf['how_to_load']})" if "how_to_load" in hf else ""))
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (Qwen3-MoE uses silu)")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{path}: use_sliding_window=true is not supported by this recipe; set it false")
        if hf.get("tie_word_embeddings"):
            raise ValueError(f"{path}: tie_word_embeddings=true is not supported by this recipe (Qwen3-MoE is untied)")
        rope = hf.get("rope_parameters") or {}
        rope_scaling = hf.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default" or rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
            raise ValueError(f"{path}: only default rope is supported, got {rope or rope_scaling}")
        names = {f.name for f in cls.__dataclass_fields__.values()}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["num_experts"] = hf.get("num_experts", hf.get("num_local_experts", cls.num_experts))
        kwargs["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        kwargs["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        kwargs["mlp_only_layers"] = list(hf.get("mlp_only_layers") or [])
        return cls(**kwargs)

    def to_hf(self) -> dict:
        """The config.json that transformers needs to load an exported folder."""
        hf = asdict(self)
        hf["rope_parameters"] = {"rope_theta": hf.pop("rope_theta"), "rope_type": "default"}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
                "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
                "attention_dropout": 0.0, "dtype": "float32", **hf}

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def num_choices(self) -> int:
        """The router's choice space: the ids it scores and picks, 0..num_choices-1 (its weight rows, expert
        bias, load and aux statistics). num_experts (config.json's field) counts the routed experts core
        dispatches, ids 0..num_experts-1, held by the ep ranks. They are the same here; a router that also picks
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
            min(cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size, cfg.intermediate_size, cfg.vocab_size,
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
        # statistics in fp32, output in the input dtype (bf16 on the bf16 path), as transformers does for a model
        # of that dtype
        x32 = upcast(x)  # fp32, or float64 kept (a float64 reference model)
        return self.weight.to(x.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(position_ids_BS: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, D] for rotate-half rope at the given (global) positions."""
    angle_dtype = compute_dtype(dtype)  # fp32 (bf16 too, as transformers does), float64 for a float64 model
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=angle_dtype, device=position_ids_BS.device) / head_dim))
    freqs_BSd = position_ids_BS[..., None].to(angle_dtype) * inv_freq
    emb_BSD = torch.cat((freqs_BSd, freqs_BSd), dim=-1)
    return emb_BSD.cos().to(dtype)[:, None], emb_BSD.sin().to(dtype)[:, None]


def apply_rope(x_BNSD, cos, sin):
    x1, x2 = x_BNSD.chunk(2, dim=-1)
    cos, sin = cos.to(x_BNSD.dtype), sin.to(x_BNSD.dtype)  # in the activations' dtype, as transformers does
    return x_BNSD * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, cp_group=None):
        super().__init__()
        N, G, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.N, self.G, self.D, self.cp_group = N, G, D, cp_group
        self.q_proj = nn.Linear(H, N * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, G * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, G * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(N * D, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)  # per head, before rope
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x_BSH, cos, sin, mask_BSK=None):
        """mask_BSK None: plain causal over these S tokens (SDPA's causal kernel). Otherwise x holds this rank's
        split_for_cp part of each sequence: K and V of the whole sequence (K = S * cp) are gathered over the cp
        group and this rank's queries attend to them under mask_BSK (a core.attention.CPMask: flex_attention on CUDA)."""
        B, S, _ = x_BSH.shape
        q_BNSD = self.q_norm(self.q_proj(x_BSH).view(B, S, self.N, self.D)).transpose(1, 2)
        k_BGSD = self.k_norm(self.k_proj(x_BSH).view(B, S, self.G, self.D)).transpose(1, 2)
        v_BGSD = self.v_proj(x_BSH).view(B, S, self.G, self.D).transpose(1, 2)
        q_BNSD, k_BGSD = apply_rope(q_BNSD, cos, sin), apply_rope(k_BGSD, cos, sin)
        o_BNSD = attention(q_BNSD, k_BGSD, v_BGSD, mask_BSK, self.cp_group)  # which kernel: its docstring table
        return self.o_proj(o_BNSD.transpose(1, 2).reshape(B, S, self.N * self.D))


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_choices, cfg.hidden_size))
        # aux-loss-free balancing (core.moe.update_expert_bias): shifts which experts are chosen, not their weights
        self.register_buffer("expert_bias", torch.zeros(cfg.num_choices))
        self.k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x_TH):
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = logits_TE.softmax(dim=-1, dtype=compute_dtype(logits_TE.dtype))  # router in fp32 (or float64)
        ids_Tk = (probs_TE + self.expert_bias).topk(self.k, dim=-1).indices
        weights_Tk = probs_TE.gather(1, ids_Tk)
        if self.norm_topk_prob:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return logits_TE, weights_Tk.to(x_TH.dtype), ids_Tk


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

    def forward(self, rows_RH, counts_E):
        mm = fp8_grouped_mm if self.fp8 else expert_matmul  # expert_matmul: weight gradient may be delayed
        h_RJ = mm(rows_RH, self.gate_up_proj, counts_E)
        return mm(swiglu(h_RJ), self.down_proj, counts_E)  # fused silu(gate) * up (Triton on GPU)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_ids: list[int], ep_group, cp_group):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg, expert_ids)
        self.num_experts, self.k, self.ep_group, self.cp_group = cfg.num_experts, cfg.num_experts_per_tok, ep_group, cp_group
        self.num_choices = cfg.num_choices  # the router's ids; num_experts: the dispatched ones (ModelConfig.num_choices)
        self.load_E = None  # (token, slot) pairs routed per expert since Model.take_expert_load

    def route(self, x_TH, aux_2E):
        """Router, plus this layer's share of the load-balancing loss statistics added to aux_2E: row 0 the summed
        router probabilities per expert (differentiable), row 1 the top-k counts per expert of the whole
        micro-batch (summed over the cp ranks, which hold the other tokens; no gradient). See Model.aux_loss.
        load_E counts the routed slots that are kept (ids >= 0, core/moe.py's router contract). No host sync."""
        logits_TE, weights_Tk, ids_Tk = self.gate(x_TH)
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
    add, then the MLP's input norm), followed by the MLP: routed experts as the three compute steps that
    core/pipeline.py interleaves (its contract): (1) `attention` (before_mlp, router), (3) `routed_experts`, (5)
    `finish` (residual add), the dispatch and combine all-to-alls (2) and (4) running between them in core/moe.py;
    or a dense MLP (`dense`). `state` is [hidden x_BSH, aux_2E, *more] (more: whatever a variant's
    Model.initial_state adds, passed through untouched). `rope` holds (cos, sin, attention mask) of each
    micro-batch of the step, set by Model.set_positions (one entry: the same for every micro-batch);
    `current_rope` picks the running one.

    recompute (RECOMPUTE) wraps these same functions (`_run`): "attention" keeps only the input of each attention
    block (input norm, projections, q/k norms, rope, attention, output projection) and recomputes the rest in
    backward; "layer" keeps only the inputs of before_mlp and of the router, or of a dense layer: in backward the
    dispatch all-to-all runs again (core/moe.py recompute_dispatch), then step (3) (the expansion, the expert GEMMs,
    SwiGLU and the weighting). The router (whose expert counts are statistics) and the combine run once."""

    def __init__(self, cfg: ModelConfig, layer_id: int, expert_ids: list[int], ep_group, cp_group=None,
                 recompute: str = "none", placement: Placement | None = None):
        super().__init__()
        self.recompute = recompute
        self.recompute_dispatch = recompute == "layer"  # core/moe.py, core/pipeline.py read it
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cp_group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = cfg.is_moe_layer(layer_id)
        self.mlp = MoE(cfg, expert_ids, ep_group, cp_group) if self.moe else DenseMLP(cfg)
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
        """(cos, sin, mask) of the micro-batch computing now (core.pipeline.running: under the pipeline's overlap
        and in a recompute inside a backward too)."""
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
        # "aux": load-balancing loss (unscaled), as transformers' load_balancing_loss_func; with cp, this rank's
        # part of the micro-batch's loss (the cp ranks' parts sum to it, see Model.aux_loss)
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
        seq_len / cp): keys and values are gathered over the cp group and masked causally by global position
        (CPMask, S x S * cp). doc_ids_BK (train.py --document-mask): the document of each token of the WHOLE
        sequences [B, S * cp] (every cp rank knows them), so that attention stays inside each document; rope's
        positions then restart at each document (core.data.positions_in_documents), as if each ran alone.
        cp_split=False: whole sequences, computed by every cp rank alone (generation, evaluation)."""
        many = isinstance(position_ids_BS, list)
        pairs = zip(position_ids_BS, doc_ids_BK or [None] * len(position_ids_BS)) if many else [(position_ids_BS, doc_ids_BK)]
        cp, cp_rank = (1, 0) if self.cp_group is None or not cp_split else \
            (dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group))
        dtype, ropes = next(self.parameters()).dtype, []
        for positions_BS, docs_BK in pairs:
            S = positions_BS.shape[1]
            mask_BSK = None if cp == 1 and docs_BK is None else \
                cp_attention_mask(S * cp, cp_rank, cp, doc_ids_BK=docs_BK, device=positions_BS.device)
            ropes.append((*rope_cos_sin(positions_BS, self.cfg.head_dim, self.cfg.rope_theta, dtype), mask_BSK))
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
        """transformers' load_balancing_loss_func over all MoE layers' tokens together: E * sum_e f_e * P_e, with
        f_e = top-k slots routed to e / N and P_e = summed router probability of e / N, N = MoE layers x tokens of
        the micro-batch. aux_2E holds the sums (MoE.route). With cp, the counts cover the whole micro-batch and
        the probabilities this rank's tokens only: the cp ranks' parts add up to the loss, and each part's
        gradient is exactly the loss's gradient on that rank's tokens. Computed at the end, it also works across
        pipeline stages, which carry aux_2E along with the hidden state."""
        cfg = self.cfg
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        if layers == 0:
            return aux_2E.new_zeros(())
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        return cfg.num_choices * (aux_2E[0] * aux_2E[1]).sum() / (layers * tokens * cp) ** 2

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
    {attention: QK^T and AV, 6 * S * N * D (2 * S/2 * N * D each on average, x3); dense: the q/k/v/o projections,
    router and dense MLP, 6 x their parameters; experts: the k routed experts, 6 x k x 3HI}, then the first
    stage's own modules {embedding: 0 (a lookup)} and the last stage's {head: 6 x V x H} (final norm: no GEMM;
    core/pipeline.py:split_layers counts both). tools/plan.py times each class; flops_per_token is their sum. cp:
    no part of a layer repeats under context parallelism."""
    H, N, G, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = H * (N + 2 * G) * D + N * D * H
    out = []
    for i in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(i)
        out.append({"attention": 6 * seq_len * N * D,
                    "dense": 6 * (attn + (H * cfg.num_choices if moe else 3 * H * cfg.intermediate_size)),
                    "experts": 6 * cfg.slots_per_token * 3 * H * cfg.moe_intermediate_size if moe else 0})
    return out + [{"embedding": 0.0}, {"head": 6 * cfg.vocab_size * H}]  # first stage's, last stage's


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 x active matmul parameters (the k routed
    experts, not all E; LM head included, embedding lookup excluded), plus causal attention scores and
    values, 6 * S * N * D per layer (QK^T and AV, 2 * S/2 * N * D each on average, x3)."""
    return sum(sum(part.values()) for part in flops_by_layer(cfg, seq_len))


def cp_gather_width(cfg: ModelConfig) -> int:
    """Numbers per token and layer that attention all-gathers over cp (core.attention.attention): K and V of
    the G key-value heads. tools/plan.py times the gather from it."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim


# ------------------------------------------------------------------ speed switches (train.py --compile, --fp8)


def compile_dense_parts(model: Model, document_mask: bool = False) -> None:
    """torch.compile(fullgraph=True) the dense parts of every decoder layer, in place (parameter names unchanged):
    the norms, the attention block (projections, q/k norms, rope, SDPA), the router and dense MLPs. Modules, not
    DecoderLayer.forward, are compiled, so any schedule that calls them (whole layer, or pipeline steps) runs the
    compiled code. Left eager: the routed experts and the dispatch/combine around them (row counts depend on the
    routing, and the all-to-alls), the residual adds (one elementwise op each), and attention with a cp group
    (it all-gathers K/V) or with document_mask (its mask is a CPMask: flex_attention with a BlockMask built
    outside the graph). One layer's graphs serve all layers (same shapes); a new (B, S) recompiles once."""
    for layer in model.layers.values():
        for module in (layer.input_layernorm, layer.post_attention_layernorm):
            module.compile(fullgraph=True)
        if layer.self_attn.cp_group is None and not document_mask:  # else its mask is a CPMask (flex on CUDA)
            layer.self_attn.compile(fullgraph=True)
        (layer.mlp.gate if isinstance(layer.mlp, MoE) else layer.mlp).compile(fullgraph=True)


def enable_fp8(model: Model) -> None:
    """FP8 GEMMs (core/fp8.py) for the attention projections, dense MLPs and routed experts, in place. The
    embedding, router (fp32 softmax) and LM head stay in high precision. Call core.fp8.CACHE.invalidate() after
    every optimizer step (the FP8 weight copies are made once per step)."""
    for layer in model.layers.values():
        convert_linears(layer.self_attn)
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts.fp8 = True
        else:
            convert_linears(layer.mlp)


# ------------------------------------------------------------------------------------ checkpoint I/O
# Our names are transformers' names without the "model." prefix, except the experts: transformers
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
    I = model.cfg.moe_intermediate_size
    for lname, layer in model.layers.items():
        if not isinstance(layer.mlp, MoE):
            continue
        experts, prefix = layer.mlp.experts, f"model.layers.{lname}.mlp.experts"
        if f"{prefix}.gate_up_proj" in reader:  # fused layout [E, J, H] / [E, H, I] (transformers in memory)
            E, H, ids = model.cfg.num_experts, model.cfg.hidden_size, experts.expert_ids  # only this model's experts
            experts.gate_up_proj.copy_(reader.get_rows(f"{prefix}.gate_up_proj", (E, 2 * I, H), ids).transpose(1, 2))
            experts.down_proj.copy_(reader.get_rows(f"{prefix}.down_proj", (E, H, I), ids).transpose(1, 2))
            continue
        H = model.cfg.hidden_size
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
    """Write `model` as a folder that transformers' Qwen3MoeForCausalLM.from_pretrained loads. In a distributed
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
TRANSFORMERS_CLASS = "Qwen3MoeForCausalLM"
BASE_RECIPE = None
SHARED_TRAIN_PY = True


def check_setup() -> dict:
    """6 MoE layers (with pp=2 each of the 4 stages holds some: fewer layers leave pp rank 0 none, and pp2 would
    not split the model), 4 experts top-2 renormalised, GQA 4/2 with head_dim 16 != hidden/heads. With 2 layers,
    tests/conftest.py's TINY_TRAIN_CONFIG, which most single-feature tests train."""
    config = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "intermediate_size": 64,
              "rope_theta": 10000.0, "router_aux_loss_coef": 0.01}
    return {"config": config, "seq_len": 32, "base_config": None}


if __name__ == "__main__":  # print the parameter count of the released config without allocating it
    with torch.device("meta"):
        m = Model(ModelConfig.from_hf(real_config_path()))
    total = sum(p.numel() for p in m.parameters())
    print(json.dumps({"parameters": total, "billions": round(total / 1e9, 3), "gflops_per_token_4k": round(flops_per_token(m.cfg, 4096) / 1e9, 2)}))
