"""The data-parallel engine (AGENTS.md's design, FSDP2; units: `fsdp_units`). Shard(0): ceil(d0 / n) rows, so [L, H,
J] experts split by whole experts; gradients reduce-scattered in fp32 and summed (losses pre-divided by the label count).

When units are gathered: README "Data parallelism: FSDP2" (--fsdp-gather; once per step: `FSDPAdamW.gather`, the
gradients unsharded, in fp32 on the bf16 path, `_in_fp32`, and reduced by hand, as torch.distributed.pipelining's
perform_reduce_grad does). Checkpoints: AGENTS.md's design (older flat Adam moments: core/checkpoint.py).
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from core.training import parameter_rules


def fsdp_units(model: torch.nn.Module, rules: dict) -> tuple[list[str], list[str]]:
    """shard_model's units: the modules holding routed experts (ParamRule.expert_ids) over (dp, cp), and over (dp,
    cp, ep) the embedding, each decoder layer and the root ('') in forward order; by module name."""
    owners = {n.rsplit(".", 1)[0] for n, rule in rules.items() if rule.expert_ids is not None}
    for owner in owners:
        if dense := [n for n, rule in rules.items() if n.startswith(owner + ".") and rule.expert_ids is None]:
            raise ValueError(f"{owner} holds routed experts and dense {dense[0]}: FSDP2 shards a module over one "
                             f"mesh, so move the routed-expert parameters into a module of their own")
    names = {m: n for n, m in model.named_modules()}
    chain = [model.embed_tokens] if model.embed_tokens is not None else []
    return [n for n in names.values() if n in owners], [names[m] for m in chain + list(model.layers.values())] + [""]


def shard_model(model: torch.nn.Module, mesh, bf16: bool, once: bool) -> list[FSDPModule]:
    """fully_shard the model's units in place over core.mesh.Mesh `mesh` (world > 1), gathered once per step or
    per micro-batch (module docstring); returns them, root last."""
    owners, chain = fsdp_units(model, parameter_rules(model))
    per_micro_batch, dense_mesh = not once, mesh.replica_mesh()  # (dp, cp, ep) flattened
    expert_mesh = mesh.device_mesh["dp", "cp"]._flatten("dp_cp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    shard = lambda module, mesh: fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=per_micro_batch)
    if once and mesh.device.type == "cpu":  # gloo: each collective a loopback round trip of CPU time (1.15x the
        # step at dp2 per layer), so one unit per mesh; a GPU keeps per-layer units: its transient reduce-scatter
        # input is the largest unit (core/memory.py)
        experts = shard([model.get_submodule(name) for name in owners], expert_mesh)[:1] if owners else []
        chain = [shard(model, dense_mesh)]
    else:  # the embedding is its own unit: FSDP2 keeps the root's gathered through the whole step
        experts = [shard(model.get_submodule(name), expert_mesh) for name in owners]
        chain = [shard(model.get_submodule(name), dense_mesh) for name in chain]  # in forward order, the root last
    register_fsdp_forward_method(model, "forward_train")  # train.py's pp = 1 loop calls it, not forward
    # Backward prefetch along the dense units only, each the one before: an experts unit's backward starts at
    # another point on ranks holding other (or no) experts, so the all-gather FSDP2's default would prefetch there
    # (of the unit before in forward order) would meet the MoE all-to-alls in another order on each rank: a
    # deadlock. A unit set to prefetch itself prefetches nothing.
    for before, unit in [*zip(chain[:1] + chain, chain), *zip(experts, experts)]:
        unit.set_modules_to_backward_prefetch([before])
    for unit in experts + chain:
        unit.set_gradient_divide_factor(1.0)  # a sum over the shard group, not FSDP2's mean
        unit.set_force_sum_reduction_for_comms(True)  # as ReduceOp.SUM (gloo has no PREMUL_SUM)
    return experts + chain


def whole_model(model: torch.nn.Module, make_model) -> torch.nn.Module:
    """A plain copy of a sharded model (collective): make_model() built on meta, every tensor all-gathered whole
    (this rank's part: all its dense tensors, its ep rank's experts), for export, sampling and the caller."""
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    with torch.device("meta"):
        plain = make_model()
    plain.load_state_dict(state, assign=True)
    return plain


def local_rows(p: torch.Tensor) -> tuple[int, int, int]:
    """(shard group size n, this rank's index in it, first dim-0 row of its shard) of a parameter: FSDP2's
    Shard(0) gives rank i rows [i c, (i + 1) c), c = ceil(d0 / n); a plain tensor (one process) is all of it."""
    if not isinstance(p, DTensor):
        return 1, 0, 0
    n, i = p.device_mesh.size(), p.device_mesh.get_local_rank()
    return n, i, min(i * math.ceil(p.shape[0] / n), p.shape[0])


def expert_checkpoint_entries(name: str, full_LX: torch.Tensor, expert_ids: list[int]) -> dict[str, torch.Tensor]:
    """Rows of local experts [L, ...] (weight or optimizer state) as checkpoint entries '{name}[{e}]' -> row (a view
    a load fills in place), one per global expert e: they load under any placement and ep size."""
    assert full_LX.shape[0] == len(expert_ids), (name, full_LX.shape, expert_ids)
    return {f"{name}[{e}]": full_LX[j] for j, e in enumerate(expert_ids)}


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, norm_group) -> torch.Tensor:
    """Scale `grads` (every rank's own elements; each element of the model on one rank) so that their global L2
    norm over norm_group is at most max_norm (0: no clipping); returns the norm before clipping."""
    # squares summed in fp64: ranks split this sum by layout, and in fp32 its last bit followed the split, moving
    # the clip factor and every weight; in fp64 it rounds to one fp32 norm (tests/test_train_pp.py: pp2 = one
    # process bit for bit, which fp32 sums break at step 2)
    sq = torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()
    if norm_group is not None:
        dist.all_reduce(sq, group=norm_group)
    norm = sq.sqrt().float()
    if max_norm > 0:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return norm


def reinit_rows(name: str, shape, index: int | slice, values: torch.Tensor | None) -> tuple[int, int]:
    """reinit_'s rows first:last of dim 0 of a parameter of `shape`, its arguments checked."""
    rows = shape[0] if len(shape) else 0
    if isinstance(index, int) and not isinstance(index, bool):
        if not -rows <= index < rows:
            raise ValueError(f"reinit_: index {index} is out of range for dim 0 of {name} (size {rows})")
        first = index % rows
        last, part, where = first + 1, tuple(shape[1:]), f"{name}[{first}]"
    elif isinstance(index, slice):  # negative bounds count from the end, as in Python
        first = 0 if index.start is None else index.start + rows * (index.start < 0)
        last = rows if index.stop is None else index.stop + rows * (index.stop < 0)
        if index.step not in (None, 1) or not 0 <= first < last <= rows:
            raise ValueError(f"reinit_: {index} must select rows first:last (step 1) with 0 <= first < last <= "
                             f"{rows}, dim 0 of {name} {tuple(shape)}")
        part, where = (last - first, *shape[1:]), f"{name}[{first}:{last}]"
    else:
        raise ValueError(f"reinit_: index must be an int or a slice of dim 0 of {name}, got {index!r}")
    if values is not None and (not isinstance(values, torch.Tensor) or tuple(values.shape) != part):
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"reinit_: values for {where} must have shape {part}, got {got}")
    return first, last


def _in_fp32(fsdp_param):
    """A hook moving each gradient a gathered bf16 parameter receives into FSDP2's fp32 accumulator: FSDP2 upcasts
    only in its post-backward hook, once per backward at most, which never fires on pipeline steps."""
    def hook(_):
        fsdp_param.accumulate_unsharded_grad_if_needed()  # fp32 sum += this bf16 gradient, or
        fsdp_param.to_accumulated_grad_if_needed()  # the first one cast to fp32
    return hook


class FSDPAdamW:
    """AdamW on the local shards (weight decay where ParamRule.decay says); train.py's calls per step:
    reduce_gradients, clip_grad_norm_, step, zero_grad."""

    def __init__(self, model, units: list[FSDPModule] | None, lr: float, weight_decay: float, betas, eps: float,
                 norm_group=None, once: bool = False, skip=()):
        """units: shard_model's (None: one process, plain tensors); norm_group spans every rank; once: units
        gathered once per step (shard_model's); skip: names of parameters another optimizer trains (core/muon.py)."""
        self.model, self.units, self.once, self.norm_group = model, units or [], once and bool(units), norm_group
        self.params = dict(model.named_parameters())  # DTensors, Shard(0), or plain tensors
        self.buffers = [n for n in model.state_dict() if n not in self.params]  # persistent (expert biases)
        with torch.no_grad():  # views of FSDP2's sharded storage (or of the parameter)
            self.local = {n: p.to_local() if isinstance(p, DTensor) else p.detach() for n, p in self.params.items()}
        rules = parameter_rules(model)
        self.expert_ids = {n: rule.expert_ids for n, rule in rules.items() if rule.expert_ids is not None}
        self.adamw = [n for n in self.params if n not in set(skip)]
        on_gpu = next(iter(self.local.values())).device.type == "cuda"
        groups = [{"params": [self.local[n] for n in self.adamw if rules[n].decay == d], "weight_decay": weight_decay * d}
                  for d in (True, False)]  # ParamRule.decay
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_gpu, foreach=not on_gpu)
        if self.once:  # gathered once per step: micro-batches sum in fp32 (_in_fp32)
            fully_shard.state(self.units[-1])._lazy_init()  # what the root's first forward does (none at pp > 1)
            for unit in self.units:
                unit.unshard()  # FSDP2 creates a parameter's gathered form at its first all-gather, then keeps it
            for fsdp_param in self._fsdp_params():
                if fsdp_param.param_dtype not in (None, fsdp_param.reduce_dtype):  # gathered in bf16
                    fsdp_param._unsharded_param.register_post_accumulate_grad_hook(_in_fp32(fsdp_param))
        self.gather()

    def gather(self) -> None:
        """Once per step: all-gather every unit before the step; they stay gathered until reduce_gradients."""
        if not self.once:
            return
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.reshard()  # (a no-op when sharded; after a load the gathered copy is stale)
        for handle in [unit.unshard(async_op=True) for unit in self.units]:  # issued together, then waited on
            handle.wait()

    def _fsdp_params(self):
        return [fp for unit in self.units for group in fully_shard.state(unit)._fsdp_param_groups
                for fp in group.fsdp_params]

    def reduce_gradients(self) -> None:
        """Once per step: each unit's post-backward (reduce-scatter of the accumulated gradients, reshard). Then
        every local shard's gradient (zeros for a parameter without one: an idle expert steps with g = 0)."""
        if self.once:
            for unit in self.units:
                unit.set_requires_gradient_sync(True, recurse=False)
                unit.set_reshard_after_backward(True, recurse=False)
                for group in fully_shard.state(unit)._fsdp_param_groups:
                    group.post_backward()
            fully_shard.state(self.units[-1])._root_post_backward_final_callback()
        for n, p in self.params.items():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            self.local[n].grad = torch.zeros_like(self.local[n]) if g is None else g

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every local gradient to the global L2 norm max_norm (0: none); returns the norm before."""
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
        return (sum(8 * self.local[n].numel() for n in self.adamw),
                sum(2 * self.params[n].numel() * self.params[n].element_size() for n in self.adamw))

    def _rows(self, name: str, index: int | slice, values: torch.Tensor | None) -> tuple[int, int, int]:
        """reinit_: param[index] = values on this rank's rows (and, gathered once per step, in the gathered copy, as
        the next all-gather would write it: no collective); (first, last) of index and where the shard starts."""
        if name not in self.params:
            raise ValueError(f"reinit_: no parameter {name!r} in this optimizer; it has {len(self.params)}, e.g. "
                             f"{', '.join(map(repr, list(self.params)[:4]))}")
        p, local = self.params[name], self.local[name]
        first, last = reinit_rows(name, p.shape, index, values)
        start = local_rows(p)[2]
        lo, hi = max(first, start), min(last, start + local.shape[0])  # rows in this rank's shard
        if lo < hi and values is not None:
            local[lo - start: hi - start].copy_(values.reshape(last - first, *p.shape[1:])[lo - first: hi - first])
        if self.once and values is not None:
            self.model.get_parameter(name)[first:last].copy_(values.reshape(last - first, *p.shape[1:]))
        return first, last, start

    @torch.no_grad()
    def reinit_(self, name: str, index: int | slice, values: torch.Tensor | None = None) -> None:
        """param[index] = values (a dead routed expert replaced mid-run: index an int or slice of dim 0, local expert
        j of [L, H, J]; values None: only the state) and the Adam moments zeroed where this rank's shard meets it; on
        every rank holding it, same arguments, between steps (no collective). `step` is kept: bias corrections ~1,
        so the part's first update is (1 - beta1) / sqrt(1 - beta2) * lr (0.45 lr at betas (0.9, 0.95))."""
        first, last, start = self._rows(name, index, values)
        state, rows = self.optimizer.state.get(self.local[name]), self.local[name].shape[0]
        lo, hi = max(first - start, 0), min(last - start, rows)
        if state and lo < hi:
            state["exp_avg"][lo:hi].zero_()
            state["exp_avg_sq"][lo:hi].zero_()

    # ----------------------------------------------------------------------------------- checkpoints

    def _init_state(self) -> None:
        """Adam state as torch creates it at the first step, so that a checkpoint can be loaded into it."""
        for t in (self.local[n] for n in self.adamw):
            if t not in self.optimizer.state:
                step = torch.zeros((), device=t.device) if self.optimizer.defaults["fused"] else torch.tensor(0.0)
                self.optimizer.state[t] = {"step": step, "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}

    def _expert_rows(self, n: str) -> list[int]:
        """Global expert ids of the rows of parameter n's local shard (whole experts: FSDP2 splits dim 0)."""
        start = local_rows(self.params[n])[2]
        return self.expert_ids[n][start: start + self.local[n].shape[0]]

    def checkpoint_state(self, model=None) -> dict:
        """{'model', 'optim'} for torch.distributed.checkpoint: 'model' (dense: the parameters, DTensors of their
        whole shape, and the buffers; experts: name[e] of this rank's rows), 'optim' per parameter step and moments (dense: shaped
        like the parameter; experts: per id), views that a load fills in place."""
        self._init_state()
        model_sd, optim_sd = {}, {"lr": torch.tensor([g["lr"] for g in self.param_groups], dtype=torch.float64)}
        for n, p in self.params.items():
            if n in self.expert_ids:
                model_sd.update(expert_checkpoint_entries(n, self.local[n], self._expert_rows(n)))
            else:
                model_sd[n] = p if isinstance(p, DTensor) else self.local[n]
        model_sd.update({n: self.model.get_buffer(n) for n in self.buffers})
        for n in self.adamw:
            p, state = self.params[n], self.optimizer.state[self.local[n]]
            optim_sd[n] = {"step": state["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                if n in self.expert_ids:
                    for entry, row in expert_checkpoint_entries(n, state[key], self._expert_rows(n)).items():
                        optim_sd.setdefault(entry, {})[key] = row
                elif isinstance(p, DTensor):
                    optim_sd[n][key] = DTensor.from_local(state[key], p.device_mesh, p.placements, run_check=False,
                                                          shape=p.shape, stride=p.stride())
                else:
                    optim_sd[n][key] = state[key]
        return {"model": model_sd, "optim": optim_sd}

    @torch.no_grad()
    def after_load(self, state: dict) -> None:
        """What a load cannot fill in place: the learning rates; once per step: the loaded weights gathered."""
        for g, lr in zip(self.param_groups, state["optim"]["lr"].tolist()):
            g["lr"] = lr
        self.gather()
