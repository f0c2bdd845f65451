"""Two variants of the Qwen3 recipe as a copied recipe would write them, each a module standing in for a recipe's
model.py (core/memory.py and the shared memory checks take the module): core must read what they declare, not guess
it from names or from num_experts_per_tok.

renamed_experts()  the routed experts' module is `mlp.routed` (parameters layers.N.mlp.routed.gate_up_proj, ...: no
                   `experts` in any name), declared routed by Model.parameter_rules.
variable_k()       the router keeps all k slots of even tokens and the first k - k // 2 of odd ones (the rest: id -1,
                   an empty slot), so a token fills k - (k // 2) / 2 slots on average (1.5 at the tiny k = 2), which
                   ModelConfig.slots_per_token declares.
"""

import dataclasses
import types

import torch

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


class HalfSlotRouter(qwen3.Router):
    def forward(self, x_TH):
        logits_TE, weights_Tk, ids_Tk = super().forward(x_TH)
        drop_Tk = torch.zeros_like(ids_Tk, dtype=torch.bool)
        drop_Tk[1::2, self.k - self.k // 2:] = True
        return logits_TE, weights_Tk.masked_fill(drop_Tk, 0), ids_Tk.masked_fill(drop_Tk, -1)


@dataclasses.dataclass
class VariableKConfig(qwen3.ModelConfig):
    slots_per_token = property(lambda self: self.num_experts_per_tok - (self.num_experts_per_tok // 2) / 2)


class VariableKModel(qwen3.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for layer in self.layers.values():
            if isinstance(layer.mlp, qwen3.MoE):
                layer.mlp.gate.__class__ = HalfSlotRouter


def _variant(name: str, **overrides) -> types.ModuleType:
    mod = types.ModuleType(f"{qwen3.__name__}_{name}")
    mod.__dict__.update({k: v for k, v in vars(qwen3).items() if not k.startswith("__")}, **overrides)
    return mod


def renamed_experts() -> types.ModuleType:
    return _variant("renamed_experts", Model=RenamedModel)


def variable_k() -> types.ModuleType:
    return _variant("variable_k", Model=VariableKModel, ModelConfig=VariableKConfig)
