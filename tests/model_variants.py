"""Variants of the Qwen3 recipe as a copied recipe would write them, each a module standing in for a recipe's
model.py (core/memory.py, tools/plan.py and the shared memory and Muon checks take the module): core must read what
they declare, not guess it from names, shapes, ranks or num_experts_per_tok. VARIANTS: name -> the module's maker.

renamed_experts()  the routed experts' module is `mlp.routed` (parameters layers.N.mlp.routed.gate_up_proj, ...: no
                   `experts` in any name), declared routed by Model.parameter_rules.
variable_k()       the router keeps all k slots of even tokens and the first k - k // 2 of odd ones (the rest: id -1,
                   an empty slot), so a token fills k - (k // 2) / 2 slots on average (1.5 at the tiny k = 2), which
                   ModelConfig.slots_per_token declares.
two_streams()      the router keeps one slot of its k whatever k is (slots_per_token 1: a count num_experts_per_tok
                   does not move); the state carries a second copy of the residual stream [B, S, H] through every
                   layer (what crosses pipeline stages: twice the hidden state), mixed into the last hidden state by
                   `stream_mix` [2, 2], a matrix declared AdamW's without weight decay (ParamRule.decay False).
"""

import dataclasses
import types

import torch
from torch import nn

from core.training import ParamRule, normal
from recipes.qwen3_30b_a3b import model as qwen3


class RenamedMoE(qwen3.MoE):
    experts = property(lambda self: self.routed)  # the recipe's code reads mlp.experts; the module is `routed`


class RenamedModel(qwen3.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for layer in self.layers.values():
            if isinstance(layer.mlp, qwen3.MoE):
                layer.mlp._modules["routed"] = layer.mlp._modules.pop("experts")
                layer.mlp.__class__ = RenamedMoE

    def parameter_rules(self, name: str, t: torch.Tensor) -> ParamRule:
        if ".mlp.routed." not in name:
            return super().parameter_rules(name, t)
        ids = self.get_submodule(name.rsplit(".", 1)[0]).expert_ids
        muon = dict(zip(("gate", "up"), ((half, ids) for half in t.chunk(2, dim=-1)))) \
            if name.endswith("gate_up_proj") else {"down": (t, ids)}
        return ParamRule(ids, muon, normal(self.cfg.initializer_range))


class DroppingRouter(qwen3.Router):
    """The Qwen3 router, then the slots `dropped(ids_Tk)` marks emptied (id -1, weight 0: core's empty slot)."""

    def forward(self, x_TH):
        logits_TE, weights_Tk, ids_Tk = super().forward(x_TH)
        drop_Tk = self.dropped(ids_Tk)
        return logits_TE, weights_Tk.masked_fill(drop_Tk, 0), ids_Tk.masked_fill(drop_Tk, -1)


class HalfSlotRouter(DroppingRouter):
    def dropped(self, ids_Tk):
        drop_Tk = torch.zeros_like(ids_Tk, dtype=torch.bool)
        drop_Tk[1::2, self.k - self.k // 2:] = True
        return drop_Tk


@dataclasses.dataclass
class VariableKConfig(qwen3.ModelConfig):
    slots_per_token = property(lambda self: self.num_experts_per_tok - (self.num_experts_per_tok // 2) / 2)


def use_router(model, router_cls) -> None:
    """Every MoE layer's router becomes a router_cls (same parameters and buffers)."""
    for layer in model.layers.values():
        if isinstance(layer.mlp, qwen3.MoE):
            layer.mlp.gate.__class__ = router_cls


class VariableKModel(qwen3.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        use_router(self, HalfSlotRouter)


class OneSlotRouter(DroppingRouter):
    def dropped(self, ids_Tk):
        drop_Tk = torch.ones_like(ids_Tk, dtype=torch.bool)
        drop_Tk[:, 0] = False
        return drop_Tk


@dataclasses.dataclass
class OneSlotConfig(qwen3.ModelConfig):
    slots_per_token = property(lambda self: 1.0)


class TwoStreamsModel(qwen3.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        use_router(self, OneSlotRouter)
        if self.lm_head is not None:  # (with the head: the last stage's)
            self.stream_mix = nn.Parameter(torch.empty(2, 2, device=self.lm_head.weight.device))
            self.parameter_rules("stream_mix", self.stream_mix).init(self.stream_mix.data, None)

    def parameter_rules(self, name: str, t: torch.Tensor) -> ParamRule:
        if name != "stream_mix":
            return super().parameter_rules(name, t)
        return ParamRule(None, {}, lambda t, gen: t.copy_(torch.eye(2)), decay=False)

    def initial_state(self, input_ids_BS, extras):
        x_BSH, *more = super().initial_state(input_ids_BS, extras)
        return [x_BSH, *more, 0.5 * x_BSH]  # the second stream: passed through every layer untouched

    def loss_sums(self, state, labels_BS, extras):
        h_BSH, *more, stream_BSH = state
        mixed_BSH = self.stream_mix[0, 0] * h_BSH + self.stream_mix[0, 1] * self.norm(stream_BSH)
        return super().loss_sums([mixed_BSH, *more], labels_BS, extras)


def _variant(name: str, **overrides) -> types.ModuleType:
    mod = types.ModuleType(f"{qwen3.__name__}_{name}")
    mod.__dict__.update({k: v for k, v in vars(qwen3).items() if not k.startswith("__")}, **overrides)
    return mod


def renamed_experts() -> types.ModuleType:
    return _variant("renamed_experts", Model=RenamedModel)


def variable_k() -> types.ModuleType:
    return _variant("variable_k", Model=VariableKModel, ModelConfig=VariableKConfig)


def two_streams() -> types.ModuleType:
    return _variant("two_streams", Model=TwoStreamsModel, ModelConfig=OneSlotConfig)


VARIANTS = {"renamed_experts": renamed_experts, "variable_k": variable_k, "two_streams": two_streams}
