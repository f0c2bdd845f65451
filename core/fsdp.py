"""Full sharding with FSDP2 (`fully_shard`, train.py `--shard fsdp`): fp32 weights, gradients and AdamW state on 1/n
shards; the ZeRO-1 alternative (`--shard zero1`) is core/optimizer.py.

Units (`shard_model`): each MoE layer's routed experts (`layer.mlp.experts`) over (dp, cp); each decoder layer's
other parameters, the embedding, and the root (final norm, head), each over (dp, cp, ep). A parameter is a DTensor,
Shard(0): ceil(d0 / n) rows, so an expert tensor [L, H, J] splits by whole experts when n divides L. Weights are
gathered in bf16 (on the bf16 path), gradients reduce-scattered and accumulated in fp32, summed (divide factor 1:
losses are pre-divided by the global label count).

When shards are gathered and gradients reduced, in a step of n_micro micro-batches:
  pp = 1   FSDP2's own hooks: a unit is gathered before its forward, freed after it, gathered again for its
           backward, and its gradient reduce-scattered as soon as that ends, per micro-batch. Per step and
           parameter: n_micro x (2 bf16 all-gathers + 1 fp32 reduce-scatter); memory 16/n bytes + units in flight.
  pp > 1   DualPipeV calls a layer's steps, not its forward (no dense unit's hook fires), and its W slots write
           expert weight gradients after the chunk's backward. So `gather` all-gathers the rank's units once
           before the schedule (reshard_after_forward False), gradients accumulate unsharded through all F, B and
           W slots, and `FSDPAdamW.reduce_gradients` runs each unit's post-backward (reduce-scatter, reshard) by
           hand after the last W slot, as torch.distributed.pipelining.stage's perform_reduce_grad does. Per step
           one bf16 all-gather and one fp32 reduce-scatter; memory 16/n + 2 + 4 (gathered copy, gradient) bytes.

Optimizer (`FSDPAdamW`, ShardedAdamW's calls): torch's AdamW on the local shards (views of FSDP2's storage); the
gradient norm sums every rank's shards. Checkpoints keep ZeRO-1's keys (routed experts per global id `name[e]`,
dense moments as DTensors of the parameter's shape), so they reshard to any layout and placement; a ZeRO-1
checkpoint's flat moments are read through their old layout (`after_load`).
"""

import math

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from core.optimizer import clip_grad_norm_, expert_checkpoint_entries, reinit_rows


def shard_model(model: torch.nn.Module, mesh, bf16: bool) -> list[FSDPModule]:
    """fully_shard the model's units in place over core.mesh.Mesh `mesh` (world > 1); returns them, root last."""
    pp, dense_mesh = mesh.pp, mesh.replica_mesh()  # (dp, cp, ep) flattened
    expert_mesh = mesh.device_mesh["dp", "cp"]._flatten("dp_cp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    units = []
    for layer in model.layers.values():
        if layer.moe:
            units.append(fully_shard(layer.mlp.experts, mesh=expert_mesh, mp_policy=policy,
                                     reshard_after_forward=pp == 1))
        units.append(fully_shard(layer, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=pp == 1))
    if model.embed_tokens is not None:  # its own unit: FSDP2 keeps the root's gathered through the whole step
        units.append(fully_shard(model.embed_tokens, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=pp == 1))
    units.append(fully_shard(model, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=pp == 1))
    register_fsdp_forward_method(model, "forward_train")  # train.py's pp=1 loop calls it, not forward
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # a sum over the shard group, not FSDP2's mean
        unit.set_force_sum_reduction_for_comms(True)  # as ReduceOp.SUM (gloo has no PREMUL_SUM)
    return units


def whole_model(model: torch.nn.Module, make_model) -> torch.nn.Module:
    """A plain copy of a sharded model (collective): make_model() built on meta, every tensor all-gathered whole
    (this rank's part: all its dense tensors, its ep rank's experts), for export, sampling and the caller."""
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    with torch.device("meta"):
        plain = make_model()
    plain.load_state_dict(state, assign=True)
    return plain


class FSDPAdamW:
    def __init__(self, model, units: list[FSDPModule], lr: float, weight_decay: float, betas, eps: float,
                 norm_group=None, pp: int = 1):
        self.model, self.units, self.pp, self.norm_group = model, units, pp, norm_group
        self.params = dict(model.named_parameters())  # DTensors, Shard(0)
        with torch.no_grad():
            self.local = {n: p.to_local() for n, p in self.params.items()}  # views of FSDP2's sharded storage
        self.expert_ids = {n: model.get_submodule(n.rsplit(".", 1)[0]).expert_ids
                           for n in self.params if ".mlp.experts." in n}
        on_gpu = next(iter(self.local.values())).device.type == "cuda"
        groups = [{"params": [self.local[n] for n, p in self.params.items() if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [self.local[n] for n, p in self.params.items() if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_gpu, foreach=not on_gpu)
        self.gather()

    def gather(self) -> None:
        """pp > 1: all-gather every unit before the schedule; they stay gathered until reduce_gradients."""
        if self.pp == 1:
            return
        fully_shard.state(self.units[-1])._lazy_init()  # what the root's first forward does (none runs here)
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.reshard()  # (a no-op when sharded; after a load the gathered copy is stale)
            unit.unshard()

    def reduce_gradients(self) -> None:
        """pp > 1: each unit's post-backward (reduce-scatter of the accumulated gradients, reshard). Then every
        local shard's gradient (zeros for a parameter without one: it steps with g = 0, as under ZeRO-1)."""
        if self.pp > 1:
            for unit in self.units:
                unit.set_requires_gradient_sync(True, recurse=False)
                unit.set_reshard_after_backward(True, recurse=False)
                for group in fully_shard.state(unit)._fsdp_param_groups:
                    group.post_backward()
            fully_shard.state(self.units[-1])._root_post_backward_final_callback()
        for n, p in self.params.items():
            local = self.local[n]
            local.grad = torch.zeros_like(local) if p.grad is None else p.grad.to_local()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """ShardedAdamW.clip_grad_norm_ on the local shards (each element of each parameter on one rank)."""
        return clip_grad_norm_([t.grad for t in self.local.values()], max_norm, self.norm_group)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()  # in place on the shards: the next all-gather reads the new weights
        self.gather()

    def zero_grad(self) -> None:
        for n, p in self.params.items():
            p.grad = self.local[n].grad = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_bytes(self) -> tuple[int, int]:
        """(bytes of Adam state on this rank, bytes it would take unsharded)."""
        return (sum(8 * t.numel() for t in self.local.values()),
                sum(2 * p.numel() * p.element_size() for p in self.params.values()))

    @torch.no_grad()
    def reinit_(self, name: str, index: int | slice, values: torch.Tensor | None = None) -> None:
        """ShardedAdamW.reinit_ (the same arguments and contract; index: rows of dim 0 of this rank's parameter):
        the rows of this rank's shard among them get `values` and zero moments; pp > 1 gathers again."""
        if name not in self.params:
            raise ValueError(f"reinit_: no parameter {name!r} in this optimizer; it has {len(self.params)}, e.g. "
                             f"{', '.join(map(repr, list(self.params)[:4]))}")
        p, local = self.params[name], self.local[name]
        first, last = reinit_rows(name, p.shape, index, values)
        start = self._first_row(name)
        lo, hi = max(first, start), min(last, start + local.shape[0])  # rows in this rank's shard
        if lo < hi and values is not None:
            local[lo - start: hi - start].copy_(values.reshape(last - first, *p.shape[1:])[lo - first: hi - first])
        state = self.optimizer.state.get(local)
        if state and lo < hi:
            state["exp_avg"][lo - start: hi - start].zero_()
            state["exp_avg_sq"][lo - start: hi - start].zero_()
        self.gather()

    # ----------------------------------------------------------------------------------- checkpoints

    def _init_state(self) -> None:
        for t in self.local.values():
            if t not in self.optimizer.state:
                step = torch.zeros((), device=t.device) if self.optimizer.defaults["fused"] else torch.tensor(0.0)
                self.optimizer.state[t] = {"step": step, "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}

    def _first_row(self, n: str) -> int:
        """Where parameter n's local shard starts in dim 0 (FSDP2: torch.chunk's split)."""
        p = self.params[n]
        return min(p.device_mesh.get_local_rank() * math.ceil(p.shape[0] / p.device_mesh.size()), p.shape[0])

    def _expert_rows(self, n: str) -> list[int]:
        """Global expert ids of the rows of parameter n's local shard (whole experts: FSDP2 splits dim 0)."""
        start = self._first_row(n)
        return self.expert_ids[n][start: start + self.local[n].shape[0]]

    def checkpoint_state(self, model=None) -> dict:
        """ZeRO-1's keys (core/optimizer.py:ShardedAdamW.checkpoint_state): 'model' (dense: the DTensor parameters;
        experts: name[e] of this rank's shard), 'optim' per parameter step and moments (dense: DTensors of the
        parameter's shape; experts: per id, views of the shards that a load fills in place)."""
        self._init_state()
        model_sd, optim_sd = {}, {"lr": torch.tensor([g["lr"] for g in self.param_groups], dtype=torch.float64)}
        for n, p in self.params.items():
            state = self.optimizer.state[self.local[n]]
            optim_sd[n] = {"step": state["step"]}
            if n in self.expert_ids:
                ids = self._expert_rows(n)
                model_sd.update(expert_checkpoint_entries(n, self.local[n].detach(), ids))
                for key in ("exp_avg", "exp_avg_sq"):
                    for entry, row in expert_checkpoint_entries(n, state[key], ids).items():
                        optim_sd.setdefault(entry, {})[key] = row
                continue
            model_sd[n] = p
            for key in ("exp_avg", "exp_avg_sq"):
                optim_sd[n][key] = DTensor.from_local(state[key], p.device_mesh, p.placements, run_check=False,
                                                      shape=p.shape, stride=p.stride())
        return {"model": model_sd, "optim": optim_sd}

    @torch.no_grad()
    def after_load(self, state: dict) -> None:
        for g, lr in zip(self.param_groups, state["optim"]["lr"].tolist()):
            g["lr"] = lr
        self.gather()  # pp > 1: the loaded weights
