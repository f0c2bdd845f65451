"""Qwen3.5-MoE (Qwen3.5-35B-A3B, text model): a hybrid of Gated DeltaNet linear-attention layers (`GatedDeltaNet`,
under cp through `core/linear_attention.py`) and gated softmax attention layers (`layer_types`), every layer with a
softmax top-k MoE plus a sigmoid-gated shared expert in layer step (1); pp stages split by `flops_by_layer`.

Numerics follow transformers' `Qwen3_5MoeForCausalLM` (checked by tests/test_qwen3_5_parity.py). The
multi-token-prediction head of the released checkpoint (`mtp.*`) is not built: transformers drops it on load too
(`_keys_to_ignore_on_load_unexpected`), and so does load_hf_checkpoint, with the vision tower (`model.visual.*`).

Legend: B batch, S sequence, T = B*S tokens, H hidden, N query heads, G key/value heads, D head dim, V vocab,
E experts (held by this rank), k experts per token, R = T*k routed rows, I expert ffn width, J = 2*I (gate and up
side by side), L layers. Gated DeltaNet: A key heads, W value heads (W a multiple of A), K key head dim, U value
head dim, C = 2*A*K + W*U conv channels (q, k, v side by side), X conv kernel width.

A Model may be partial: `layers` picks which decoder layers it holds (parameter names keep the global
layer index, `layers.7.…`), `expert_ids` which routed experts (global ids; with `ep_group` given, this rank's
experts of the `placement`, core/placement.py, and tokens reach them through core/moe.py's all-to-all), `embed`/`head` whether it
holds the embedding and the final norm + LM head. Checkpoint I/O then touches only those tensors.

Seams (skills/add-new-architecture/SKILL.md's table, in this file's order): a config field `ModelConfig`,
`load_config`; attention `Attention.forward` (through core.attention.attention), the linear attention
`GatedDeltaNet.forward` (through core.linear_attention) and their masks `Model.set_positions`; the router `Router`,
`MoE.route`; expert kinds `ModelConfig.num_choices` (the router's choices) vs `num_experts` (the dispatched ones),
`DecoderLayer.finish`; the layer's step order `DecoderLayer.before_mlp` (recompute: `DecoderLayer._run`); state
crossing pipeline stages: the `state` list of `DecoderLayer` (entries after the first two pass through every base
layer) made by `Model.initial_state` (what crosses pp ranks follows it); the running micro-batch
`DecoderLayer.current_rope` (core.pipeline.running); loss terms `Model.loss_terms` (name -> weight, denominator) and
their sums `Model.loss_sums`; per-token inputs made from whole sequences `Model.prepare_batch`; optional flags
`Model.features`; statistics `Model.take_stats`; after each step `Model.after_step`; each parameter's group, Muon
matrices and init `Model.parameter_rules`; slots a token fills `ModelConfig.slots_per_token`; the shared checks'
config `check_setup` (end of file).
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
from core.kernels.gated_delta import chunk_gated_delta_flops_per_token
from core.kernels.swiglu import swiglu
from core.linear_attention import causal_conv1d, gated_delta_rule
from core.moe import expert_counts, expert_matmul, moe_forward, update_expert_bias, weighted_rows
from core.pipeline import running
from core.placement import Placement
from core.precision import compute_dtype, upcast
from core.routing import routing
from core.training import LossTerm, ParamRule, check_args, constant, default_rule, init_parameters
from core.weight_cache import cast_weight

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class ModelConfig:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: list[str] = field(default_factory=lambda: [LAYER_TYPES[(i + 1) % 4 == 0] for i in range(40)])
    num_attention_heads: int = 16  # gated attention layers
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25  # rope on the first head_dim * factor dims of q and k
    rope_theta: float = 1e7
    attention_bias: bool = False
    linear_num_key_heads: int = 16  # Gated DeltaNet layers
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8  # the top-k weights are always renormalised (transformers' router)
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    max_position_embeddings: int = 262144
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # kept only to write config.json back

    @classmethod
    def from_hf(cls, path) -> "ModelConfig":
        """Read a Hugging Face Qwen3.5-MoE config.json (the file, or a checkpoint folder holding it): the text
        model's (model_type qwen3_5_moe_text) or the released multimodal one (qwen3_5_moe), whose text_config is used."""
        hf = read_hf_config(path)
        if hf.get("model_type") == "qwen3_5_moe" and isinstance(hf.get("text_config"), dict):
            hf = {"model_type": "qwen3_5_moe_text", **hf["text_config"]}
        if hf.get("model_type") not in ("qwen3_5_moe_text", Path(__file__).parent.name):  # (the second: a variant's)
            raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, this recipe reads 'qwen3_5_moe_text' "
                             f"configs (or 'qwen3_5_moe' with a text_config)"
                             + (f" ({hf['how_to_load']})" if "how_to_load" in hf else ""))
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (Qwen3.5-MoE uses silu)")
        if hf.get("tie_word_embeddings"):
            raise ValueError(f"{path}: tie_word_embeddings=true is not supported by this recipe (Qwen3.5-MoE is untied)")
        if hf.get("attn_output_gate") is False:
            raise ValueError(f"{path}: attn_output_gate=false is not supported (transformers always gates the output)")
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{path}: only default rope is supported, got {rope}")
        names = {f.name for f in cls.__dataclass_fields__.values()}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        kwargs["partial_rotary_factor"] = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        kwargs["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if not hf.get("layer_types"):  # transformers' default: every full_attention_interval-th layer is full
            interval = hf.get("full_attention_interval", 4)
            kwargs["layer_types"] = [LAYER_TYPES[(i + 1) % interval == 0] for i in range(hf["num_hidden_layers"])]
        return cls(**kwargs)

    def to_hf(self) -> dict:
        """The config.json that transformers needs to load an exported folder (Qwen3_5MoeForCausalLM)."""
        hf = asdict(self)
        hf["rope_parameters"] = {"rope_theta": hf.pop("rope_theta"), "rope_type": "default",
                                 "partial_rotary_factor": hf.pop("partial_rotary_factor")}
        return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "hidden_act": "silu",
                "tie_word_embeddings": False, "attention_dropout": 0.0, "dtype": "float32", **hf}

    def is_moe_layer(self, i: int) -> bool:  # every Qwen3.5-MoE layer has routed experts
        return True

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

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
        f"{path}: linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
        f"({cfg.linear_num_key_heads})": cfg.linear_num_key_heads >= 1 and cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0,
        f"{path}: layer_types must list {cfg.num_hidden_layers} entries, each one of {', '.join(LAYER_TYPES)}":
            len(cfg.layer_types) == cfg.num_hidden_layers and set(cfg.layer_types) <= set(LAYER_TYPES),
        f"{path}: head_dim * partial_rotary_factor must be an even number >= 2":
            int(cfg.head_dim * cfg.partial_rotary_factor) >= 2 and int(cfg.head_dim * cfg.partial_rotary_factor) % 2 == 0,
        f"{path}: hidden_size, head dims, intermediate sizes, vocab_size, linear_conv_kernel_dim and num_hidden_layers "
        f"must be >= 1": min(cfg.hidden_size, cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                             cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.vocab_size,
                             cfg.linear_conv_kernel_dim, cfg.num_hidden_layers) >= 1,
    })
    return cfg


# ---------------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x_normed * (1 + weight), weight starting at 0 (transformers' Qwen3_5MoeRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        # statistics and the scale in fp32, output in the input dtype (bf16 on the bf16 path), as transformers does
        x32 = upcast(x)  # fp32, or float64 kept (a float64 reference model)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + upcast(self.weight))).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm (weight starting at 1) of each value head's output, times SiLU(z) (transformers' RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        x32 = upcast(x)
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(upcast(z))).to(x.dtype)


def rope_cos_sin(position_ids_BS: torch.Tensor, rotary_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, rotary_dim] for rotate-half rope at the given (global) positions. Text tokens have the
    same position on transformers' three mrope axes, so its interleaved mrope sections reduce to this."""
    angle_dtype = compute_dtype(dtype)  # fp32 (bf16 too, as transformers does), float64 for a float64 model
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=angle_dtype, device=position_ids_BS.device) / rotary_dim))
    freqs_BSd = position_ids_BS[..., None].to(angle_dtype) * inv_freq
    emb_BSD = torch.cat((freqs_BSd, freqs_BSd), dim=-1)
    return emb_BSD.cos().to(dtype)[:, None], emb_BSD.sin().to(dtype)[:, None]


def apply_rope(x_BNSD, cos, sin):
    """Partial rope: the first cos.shape[-1] dims of each head rotate, the rest pass through."""
    rot, rest = x_BNSD[..., :cos.shape[-1]], x_BNSD[..., cos.shape[-1]:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos.to(x_BNSD.dtype), sin.to(x_BNSD.dtype)  # in the activations' dtype, as transformers does
    return torch.cat((rot * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


class Attention(nn.Module):
    """Gated softmax attention: q_proj yields each head's query and an output gate side by side; per-head q/k
    RMSNorm, partial rope, GQA; the output is multiplied by sigmoid(gate) before o_proj."""

    def __init__(self, cfg: ModelConfig, cp_group=None):
        super().__init__()
        N, G, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.N, self.G, self.D, self.cp_group = N, G, D, cp_group
        self.q_proj = nn.Linear(H, N * 2 * D, bias=cfg.attention_bias)  # per head: [query D | gate D]
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
        q_BSND, gate_BSND = self.q_proj(x_BSH).view(B, S, self.N, 2 * self.D).chunk(2, dim=-1)
        q_BNSD = self.q_norm(q_BSND).transpose(1, 2)
        k_BGSD = self.k_norm(self.k_proj(x_BSH).view(B, S, self.G, self.D)).transpose(1, 2)
        v_BGSD = self.v_proj(x_BSH).view(B, S, self.G, self.D).transpose(1, 2)
        q_BNSD, k_BGSD = apply_rope(q_BNSD, cos, sin), apply_rope(k_BGSD, cos, sin)
        o_BNSD = attention(q_BNSD, k_BGSD, v_BGSD, mask_BSK, self.cp_group)  # which kernel: its docstring table
        o_BSX = o_BNSD.transpose(1, 2).reshape(B, S, self.N * self.D) * torch.sigmoid(gate_BSND.reshape(B, S, -1))
        return self.o_proj(o_BSX)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention (transformers' Qwen3_5MoeGatedDeltaNet): projections to q, k, v (one
    matrix), z (output gate), b (write strength) and a (decay); a causal depthwise conv over q, k, v with SiLU;
    L2-normalised q and k; decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); the chunked gated
    delta rule (core/kernels/gated_delta.py) with each key head serving W/A consecutive value heads; an RMSNorm
    of each value head gated by SiLU(z); out_proj."""

    def __init__(self, cfg: ModelConfig, cp_group=None):
        super().__init__()
        A, W, K, U, H = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.hidden_size)
        self.A, self.W, self.K, self.U, self.cp_group = A, W, K, U, cp_group
        C = 2 * A * K + W * U
        self.in_proj_qkv = nn.Linear(H, C, bias=False)
        self.in_proj_z = nn.Linear(H, W * U, bias=False)
        self.in_proj_b = nn.Linear(H, W, bias=False)
        self.in_proj_a = nn.Linear(H, W, bias=False)
        self.conv1d = nn.Conv1d(C, C, cfg.linear_conv_kernel_dim, groups=C, bias=False)  # weight [C, 1, X]
        self.dt_bias = nn.Parameter(torch.ones(W))
        self.A_log = nn.Parameter(torch.zeros(W))  # Model.init_weights: log(uniform(0.01, 16)) as transformers
        self.norm = GatedRMSNorm(U, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(W * U, H, bias=False)

    chunk_size = 64  # the delta rule's chunk (fla's; the result does not depend on it beyond rounding)

    def forward(self, x_BSH, cp_split: bool = False, doc_ids_BK=None):
        """x holds whole sequences, or with cp_split (and a cp group) this rank's split_for_cp part of each
        (core/linear_attention.py then exchanges the conv tails and the chunks' state summaries over the cp group,
        nothing per token). doc_ids_BK (--document-mask): the documents of the WHOLE sequences [B, S * cp]; the
        delta rule's state restarts at 0 and the conv reads nothing before each document's first token."""
        B, S, _ = x_BSH.shape
        cp_group = self.cp_group if cp_split else None
        A, W, K, U = self.A, self.W, self.K, self.U
        qkv_BSC = causal_conv1d(self.in_proj_qkv(x_BSH), self.conv1d.weight.squeeze(1), activation="silu",
                                cp_group=cp_group, doc_ids_BK=doc_ids_BK)
        q_BSAK, k_BSAK, v_BSWU = qkv_BSC.split([A * K, A * K, W * U], dim=-1)
        beta_BSW = torch.sigmoid(self.in_proj_b(x_BSH))
        g_BSW = -upcast(self.A_log).exp() * F.softplus(upcast(self.in_proj_a(x_BSH)) + self.dt_bias)  # fp32 at least
        # q and k L2-normalised in fp32 inside the kernel, as transformers does; key head a serves value heads
        # a*W/A .. (a+1)*W/A - 1
        o_BSWU, _ = gated_delta_rule(q_BSAK.reshape(B, S, A, K), k_BSAK.reshape(B, S, A, K), v_BSWU.reshape(B, S, W, U),
                                     g_BSW, beta_BSW, scale=K ** -0.5, use_qk_l2norm_in_kernel=True,
                                     chunk_size=self.chunk_size, cp_group=cp_group, doc_ids_BK=doc_ids_BK)
        o_BSWU = self.norm(o_BSWU.to(x_BSH.dtype), self.in_proj_z(x_BSH).reshape(B, S, W, U))
        return self.out_proj(o_BSWU.reshape(B, S, W * U))


class MLP(nn.Module):
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
        # aux-loss-free balancing (core.moe.update_expert_bias): shifts which experts are chosen, not their weights
        self.register_buffer("expert_bias", torch.zeros(cfg.num_choices))
        self.k = cfg.num_experts_per_tok

    def forward(self, x_TH):
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = logits_TE.softmax(dim=-1, dtype=compute_dtype(logits_TE.dtype))  # router in fp32 (or float64)
        ids_Tk = (probs_TE + self.expert_bias).topk(self.k, dim=-1).indices
        weights_Tk = probs_TE.gather(1, ids_Tk)
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)  # always renormalised (transformers)
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
        self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.num_experts, self.k, self.ep_group, self.cp_group = cfg.num_experts, cfg.num_experts_per_tok, ep_group, cp_group
        self.num_choices = cfg.num_choices  # the router's ids; num_experts: the dispatched ones (ModelConfig.num_choices)
        self.load_E = None  # (token, slot) pairs routed per expert since Model.take_expert_load

    def shared(self, x_TH):
        """The shared expert, scaled per token by sigmoid(shared_expert_gate(x))."""
        return torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)

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
    """One decoder layer. Its step order is written once, in `before_mlp` (the token mixer with its residual add,
    then the MLP's input norm), followed by routed and shared experts as the three compute steps that
    core/pipeline.py interleaves (its contract): (1) `attention` (before_mlp, router, shared expert), (3)
    `routed_experts`, (5) `finish` (residual add), the dispatch and combine all-to-alls (2) and (4) running between
    them in core/moe.py. The token mixer is a GatedDeltaNet (`linear_attn`) or a gated Attention (`self_attn`) by
    cfg.layer_types. `state` is [hidden x_BSH, aux_2E, *more] (more: whatever a variant's Model.initial_state adds,
    passed through untouched). `rope` holds (cos, sin, attention mask, whether the micro-batch is cp-split,
    document ids) of each micro-batch of the step, set by Model.set_positions (one entry: the same for every
    micro-batch); `current_rope` picks the running one (linear layers read the cp flag and the document ids).

    recompute (RECOMPUTE) wraps these same functions (`_run`): "attention" keeps only the input of each
    token-mixer block (input norm, projections, conv, norms, rope, attention or delta rule, output projection) and
    recomputes the rest in backward; "layer" keeps only the inputs of before_mlp and of the router and the shared
    expert: in backward the dispatch all-to-all runs again (core/moe.py recompute_dispatch), then step (3) (the
    expert GEMMs and SwiGLU). The router (whose expert counts are statistics) and the combine run once."""

    def __init__(self, cfg: ModelConfig, layer_id: int, expert_ids: list[int], ep_group, cp_group=None,
                 recompute: str = "none", placement: Placement | None = None):
        super().__init__()
        self.recompute = recompute
        self.recompute_dispatch = recompute == "layer"  # core/moe.py, core/pipeline.py read it
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear = cfg.is_linear(layer_id)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, cp_group)
        else:
            self.self_attn = Attention(cfg, cp_group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = True
        self.mlp = MoE(cfg, expert_ids, ep_group, cp_group)
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
        """(cos, sin, mask, cp_split, doc_ids) of the micro-batch computing now (core.pipeline.running: under the
        pipeline's overlap and in a recompute inside a backward too)."""
        return self.rope[0] if len(self.rope) == 1 else self.rope[running.micro_batch]

    def attention_block(self, x_BSH):
        cos, sin, mask_BSK, cp_split, doc_ids_BK = self.current_rope()
        if self.linear:
            return self.linear_attn(self.input_layernorm(x_BSH), cp_split, doc_ids_BK)
        return self.self_attn(self.input_layernorm(x_BSH), cos, sin, mask_BSK)

    def before_mlp(self, x_BSH):
        """(h_BSH: x plus the attention block, x_TH: the MLP's input, normed)."""
        h_BSH = x_BSH + self._run("attention", self.attention_block, x_BSH)
        return h_BSH, self.post_attention_layernorm(h_BSH).flatten(0, 1)

    def attention(self, state):  # (1)
        x_BSH, aux_2E, *more = state
        h_BSH, x_TH = self._run("layer", self.before_mlp, x_BSH)
        weights_Tk, ids_Tk, aux_2E = self.mlp.route(x_TH, aux_2E)
        h_BSH = h_BSH + self._run("layer", self.mlp.shared, x_TH).view_as(h_BSH)
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
        sequences [B, S * cp]: block-causal attention per document, and the Gated DeltaNet layers restart their
        state and conv at each document (core/linear_attention.py), so each document computes as if alone.
        cp_split=False: whole sequences, computed by every cp rank alone (generation, evaluation)."""
        many = isinstance(position_ids_BS, list)
        pairs = zip(position_ids_BS, doc_ids_BK or [None] * len(position_ids_BS)) if many else [(position_ids_BS, doc_ids_BK)]
        cp, cp_rank = (1, 0) if self.cp_group is None or not cp_split else \
            (dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group))
        dtype, ropes = next(self.parameters()).dtype, []
        rotary_dim = int(self.cfg.head_dim * self.cfg.partial_rotary_factor)
        for positions_BS, docs_BK in pairs:
            S = positions_BS.shape[1]
            mask_BSK = None if cp == 1 and docs_BK is None else \
                cp_attention_mask(S * cp, cp_rank, cp, doc_ids_BK=docs_BK, device=positions_BS.device)
            ropes.append((*rope_cos_sin(positions_BS, rotary_dim, self.cfg.rope_theta, dtype), mask_BSK, cp > 1, docs_BK))
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
        (tensor, "sum" | "max" | "gather": how core/metrics.py:reduce_stats combines the ranks, which hold other
        tokens (dp, cp, ep) or other layers (pp)). Every rank returns the same names and shapes (rows of layers held
        by other pipeline stages are 0, or -inf for "max"). expert_load [MoE layers, num_choices] is required (the
        expert bias and the load heatmap use it); a new router adds its own entries. Scalars and 1-D tensors are
        logged. "gather" concatenates the ranks' rows instead (per-token records for an after_step file; not
        logged). Optional expert_live [MoE layers, num_choices] ("max"; 1 where the router can choose the expert
        now): the load max/mean and the collapse warning then count only those; absent: every choice is live."""
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
        is declared here.
        Here also: zeros for the zero-centred norms (RMSNorm), ones for the gated norms and dt_bias,
        log(uniform(0.01, 16)) for A_log; AdamW for the shared-expert gate (one row) and the conv weights."""
        rule = default_rule(self, name, t, self.cfg.initializer_range)
        if rule.expert_ids is not None and name.endswith("gate_up_proj"):  # [E, H, J]: gate = [..., :I], up = [..., I:]
            gate, up = t.chunk(2, dim=-1)  # transformers' layout: one matrix per expert, gate and up apart
            return replace(rule, muon={"gate": (gate, rule.expert_ids), "up": (up, rule.expert_ids)})
        if rule.expert_ids is not None and name.endswith("down_proj"):
            return replace(rule, muon={"down": (t, rule.expert_ids)})
        if name.endswith("shared_expert_gate.weight"):
            rule = replace(rule, muon={})
        owner = self.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(owner, RMSNorm):
            return replace(rule, init=constant(0.0))
        if isinstance(owner, GatedRMSNorm) or name.endswith("dt_bias"):
            return replace(rule, init=constant(1.0))
        if name.endswith("A_log"):
            return replace(rule, init=lambda p, gen: p.uniform_(0.01, 16.0, generator=gen).log_())
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
    {attention: gated-attention layers QK^T and AV, 6 * S * N * D (2 * S/2 * N * D each on average, x3); Gated
    DeltaNet layers 3 x core/kernels/gated_delta.py:chunk_gated_delta_flops_per_token (no term in S: the state
    has a fixed size; under cp the kernel also carries the state-transition columns); dense: the token mixer's
    projections and conv, router, shared expert and its gate, 6 x their parameters; experts: the k routed
    experts, 6 x k x 3HI}, then the first stage's own modules {embedding: 0 (a lookup)} and the last stage's
    {head: 6 x V x H} (final norm: no GEMM; core/pipeline.py:split_layers counts both). tools/plan.py times each
    class; flops_per_token is their sum."""
    H, N, G, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    A, W, K, U = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gated_attn = H * (2 * N + 2 * G) * D + N * D * H
    delta_net = H * (2 * A * K + 2 * W * U + 2 * W) + (2 * A * K + W * U) * cfg.linear_conv_kernel_dim + W * U * H
    moe_dense = H * cfg.num_choices + 3 * H * cfg.shared_expert_intermediate_size + H
    out = []
    for i in range(cfg.num_hidden_layers):
        linear = cfg.is_linear(i)
        delta = 3 * chunk_gated_delta_flops_per_token(K, U, W, cp=cp)
        out.append({"attention": delta if linear else 6 * seq_len * N * D,
                    "dense": 6 * ((delta_net if linear else gated_attn) + moe_dense),
                    "experts": 6 * cfg.slots_per_token * 3 * H * cfg.moe_intermediate_size})
    return out + [{"embedding": 0.0}, {"head": 6 * cfg.vocab_size * H}]  # first stage's, last stage's


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 x active matmul parameters (the k routed
    experts and the shared one, not all E; LM head included, embedding lookup excluded), plus causal attention
    scores and values of the gated-attention layers, and the delta rule of the Gated DeltaNet layers."""
    return sum(sum(part.values()) for part in flops_by_layer(cfg, seq_len))


def cp_gather_width(cfg: ModelConfig) -> float:
    """Numbers per token and layer that attention all-gathers over cp, averaged over the layers (tools/plan.py
    times one gather per layer from it): K and V of the G key-value heads in the gated-attention layers; the Gated
    DeltaNet layers gather no per-token activations (only conv tails and per-chunk state summaries, counted 0)."""
    full = sum(not cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    return 2 * cfg.num_key_value_heads * cfg.head_dim * full / cfg.num_hidden_layers


# ------------------------------------------------------------------ speed switches (train.py --compile, --fp8)


def compile_dense_parts(model: Model, document_mask: bool = False) -> None:
    """torch.compile(fullgraph=True) the dense parts of every decoder layer, in place (parameter names unchanged):
    the norms, the attention block (projections, q/k norms, rope, SDPA) or the Gated DeltaNet block, the router and
    the shared expert. Modules, not
    DecoderLayer.forward, are compiled, so any schedule that calls them (whole layer, or pipeline steps) runs the
    compiled code. Left eager: the routed experts and the dispatch/combine around them (row counts depend on the
    routing, and the all-to-alls), the residual adds (one elementwise op each), and token mixers with a cp group
    (they exchange K/V or state summaries). One layer's graphs serve all layers of its kind (same shapes); a new
    (B, S) recompiles once."""
    for layer in model.layers.values():
        for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.gate, layer.mlp.shared_expert):
            module.compile(fullgraph=True)
        mixer = layer.linear_attn if layer.linear else layer.self_attn
        # eager under a document mask: a CPMask (flex on CUDA), and fla's varlen form builds its sequence starts
        # on the host (core/kernels/gated_delta.py)
        if mixer.cp_group is None and not document_mask:
            mixer.compile(fullgraph=True)  # fla's kernels are custom ops: one graph (core/kernels/gated_delta.py)


def enable_fp8(model: Model) -> None:
    """FP8 GEMMs (core/fp8.py) for the token mixers' projections, the shared expert and the routed experts, in
    place. The embedding, router (fp32 softmax), shared_expert_gate (one row) and LM head stay in high precision.
    Call core.fp8.CACHE.invalidate() after every optimizer step (the FP8 weight copies are made once per step)."""
    for layer in model.layers.values():
        convert_linears(layer.linear_attn if layer.linear else layer.self_attn)
        convert_linears(layer.mlp.shared_expert)
        layer.mlp.experts.fp8 = True


# ------------------------------------------------------------------------------------ checkpoint I/O
# Our names are transformers' Qwen3_5MoeForCausalLM names without the "model." prefix, except the experts:
# transformers writes one key per expert (experts.{e}.gate_proj.weight [I, H], ...) while we stack them. The
# released checkpoint (Qwen3_5MoeForConditionalGeneration) holds the text model under "model.language_model."
# with fused experts ([E, J, H] gate_up_proj, [E, H, I] down_proj), next to the vision tower ("model.visual.")
# and the MTP head ("mtp."), which are not read.


def _hf_name(name: str, prefix: str = "model.") -> str:
    return name if name.startswith("lm_head.") else prefix + name


@torch.no_grad()
def load_hf_checkpoint(model: Model, path) -> list[str]:
    """Fill `model` (possibly partial) from a Hugging Face safetensors folder (a Qwen3_5MoeForCausalLM export, or
    the released multimodal checkpoint); returns the tensor names read."""
    reader = CheckpointReader(path)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in reader.weight_map) else "model."
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            continue
        p.copy_(reader.get(_hf_name(name, prefix), p.shape))
    I, H = model.cfg.moe_intermediate_size, model.cfg.hidden_size
    for lname, layer in model.layers.items():
        experts, key = layer.mlp.experts, f"{prefix}layers.{lname}.mlp.experts"
        if f"{key}.gate_up_proj" in reader:  # fused layout [E, J, H] / [E, H, I] (released; transformers in memory)
            E, ids = model.cfg.num_experts, experts.expert_ids  # only this model's experts
            experts.gate_up_proj.copy_(reader.get_rows(f"{key}.gate_up_proj", (E, 2 * I, H), ids).transpose(1, 2))
            experts.down_proj.copy_(reader.get_rows(f"{key}.down_proj", (E, H, I), ids).transpose(1, 2))
            continue
        for j, e in enumerate(experts.expert_ids):
            experts.gate_up_proj[j, :, :I] = reader.get(f"{key}.{e}.gate_proj.weight", (I, H)).T
            experts.gate_up_proj[j, :, I:] = reader.get(f"{key}.{e}.up_proj.weight", (I, H)).T
            experts.down_proj[j] = reader.get(f"{key}.{e}.down_proj.weight", (H, I)).T
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
    """Write `model` as a folder that transformers' Qwen3_5MoeForCausalLM.from_pretrained loads. In a distributed
    run every rank calls it (see core.hf_io.write_hf_folder) and writes what it owns: `dense` / `experts` say
    whether this rank is the first replica of its dense / routed-expert tensors."""
    tensors = {k: (v.to(dtype) if dtype else v) for k, v in hf_state_dict(model).items()
               if (experts if ".mlp.experts." in k else dense)}
    config = model.cfg.to_hf()
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    if TRANSFORMERS_CLASS is None:  # a variant: its export must not pass for the base model (names the variant)
        config = variant_config(config, Path(__file__).parent.name)
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
TRANSFORMERS_CLASS = "Qwen3_5MoeForCausalLM"
BASE_RECIPE = None
SHARED_TRAIN_PY = True


def check_setup() -> dict:
    """6 layers, linear, linear, full, linear, linear, full (with pp=2 each of the 4 stages holds some, and both
    kinds sit on several stages), 4 experts top-2 plus the shared expert, gated attention 4/2 heads with head_dim
    16 != hidden/heads and rope on half of it, Gated DeltaNet with 4 value heads over 2 key heads."""
    config = {"model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
              "layer_types": [LAYER_TYPES[(i + 1) % 3 == 0] for i in range(6)],
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "router_aux_loss_coef": 0.01}
    return {"config": config, "seq_len": 32, "base_config": None}


if __name__ == "__main__":  # print the parameter count of the released config without allocating it
    with torch.device("meta"):
        m = Model(ModelConfig.from_hf(real_config_path()))
    total = sum(p.numel() for p in m.parameters())
    print(json.dumps({"parameters": total, "billions": round(total / 1e9, 3), "gflops_per_token_4k": round(flops_per_token(m.cfg, 4096) / 1e9, 2)}))
