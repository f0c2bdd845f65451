"""Per-rank peak training memory of a recipe's model under a layout, by component, and whether it fits a GPU
(`check_train_args`: train.py's guard). It reads what the model declares (Model.parameter_rules, slots_per_token,
Model.initial_state) and what core sees a tiny run do. Components of the most loaded pp rank (each built on `meta`):
  weights, gradients  fp32, the rank's part (its two DualPipeV stages, the ep rank with the most experts); FSDP2's
               shards at world > 1 (ceil(d0 / n) rows; routed experts over dp*cp, the rest over dp*cp*ep)
  optimizer    AdamW's two fp32 moments; --optimizer muon: Muon's momentum on its owners (the most: `muon_bytes`)
  weight cache one process: the bf16 casts and FP8 operands its model hands core/weight_cache.py (weight_copies)
  activations  what a tiny run keeps for backward (activation_calibration) x tokens, slots_per_token, dtype,
               hidden_size / tiny's; pp > 1: the chunks DualPipeV holds at its peak + states handed on (handoff_bytes)
  comm buffers the all-to-all rows, FSDP2's units in flight (fsdp_bytes), Muon's largest bucket
Gathered once per step (pp > 1, --fsdp-gather step) the weight cache is the stage in the compute dtype with its FP8
operands. Weights, gradients, optimizer and cache exact (tested against a built model, the optimizers, FSDP2, the
cache); activations exact on tiny configs, first-order on full ones.
"""

import itertools
import math
import sys
import weakref
from collections import namedtuple
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from core.fp8 import BLOCK
from core.fsdp import fsdp_units
from core.moe import step3
from core.muon import assign_owners, matrix_rows, newton_schulz_flops
from core.pipeline import _forward_steps, _Tape, split_layers  # (saved_bytes runs a stage as the engine does)
from core.placement import Placement
from core.training import parameter_rules
from core.weight_cache import CACHE

GIB = 2**30
BUCKET_BYTES = 256 << 20  # core/muon.py:MuonAdamW's default bucket_bytes


@dataclass(frozen=True)
class Layout:
    """A training layout in train.py's terms (dp given, not derived); str() is the flags that select it."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    seq_len: int = 4096
    bf16: bool = True
    fp8: bool = False
    recompute: str = "none"
    expert_placement: str = ""  # train.py's --expert-placement ('': the even split)
    optimizer: str = "adamw"  # train.py's --optimizer: adamw or muon
    fsdp_gather: str = "auto"  # train.py's --fsdp-gather: auto, micro-batch or step
    fp8_recipe: str = "rowwise"  # train.py's --fp8-recipe (the bytes of the FP8 operands' scales)

    def __str__(self):
        return (f"--pp {self.pp} --dp {self.dp} --cp {self.cp} --ep {self.ep} --micro-batch {self.micro_batch} "
                f"--recompute {self.recompute}" + (f" --expert-placement {self.expert_placement}"
                                                   if self.expert_placement else "")
                + (f" --optimizer {self.optimizer}" if self.optimizer != "adamw" else "")
                + (" --fsdp-gather step" if self.fsdp_gather == "step" and self.pp == 1 else ""))

    @property
    def once(self) -> bool:
        """FSDP2 gathers the units once per step (always at pp > 1), not around every micro-batch."""
        return self.pp > 1 or self.fsdp_gather == "step"

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the parameters (every run of more than one rank; one process trains plain tensors)."""
        return self.pp * self.dp * self.cp * self.ep > 1


def rank_parts(cfg, layout: Layout, pp_rank: int, costs: list | None = None) -> dict:
    """Model(...) keyword arguments of one pp rank (as train.py builds it: costs, the recipe's flops_by_layer at
    layout.seq_len, split the layers), with the experts of the ep rank that holds the most."""
    placement = Placement.parse(layout.expert_placement, cfg.num_experts, layout.ep)
    most = max(placement.experts, key=len)
    layers = None
    if layout.pp > 1:
        stage_layers = split_layers(cfg.num_hidden_layers, layout.pp, costs)
        layers = stage_layers[pp_rank] + stage_layers[2 * layout.pp - 1 - pp_rank]
    return dict(layers=layers, expert_ids=most, embed=pp_rank == 0, head=pp_rank == 0)


def meta_model(mod, cfg, fp8: bool = False, **parts):
    with torch.device("meta"):
        model = mod.Model(cfg, **parts)
    if fp8:
        mod.enable_fp8(model)
    return model


_COPIES = {}


def weight_copies(mod, model, fp8: bool) -> tuple[set[str], set[str]]:
    """(names of the weights whose FP8 operands, of those whose bf16 casts core/weight_cache.py keeps) in `model`:
    those the model hands it in a bf16 forward of its tiny config (fp8: enable_fp8), a layer's in every layer."""

    def keys(m):  # each weight by its FSDP2 unit's class and its name there: a layer's stands for it in every layer
        units = param_units(m, parameter_rules(m))
        return {n: (type(m.get_submodule(u)), n.removeprefix(f"{u}.")) for n, u in units.items()}

    if (mod.__name__, fp8) not in _COPIES:
        tiny = mod.ModelConfig.from_hf(mod.tiny_config_path())
        with torch.random.fork_rng():
            torch.manual_seed(0)
            small, ids_BS = mod.Model(tiny), torch.randint(0, tiny.vocab_size, (1, tiny.calibration_seq_len))
        if fp8:
            mod.enable_fp8(small)
        kept, CACHE.entries, CACHE.keep = (CACHE.entries, CACHE.keep), {}, True
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):  # (with gradients: a training-only module runs)
                small.forward_train(ids_BS, ids_BS)
            made = {(ptr, str(kind).startswith("fp8")) for ptr, _, _, kind in CACHE.entries}
        finally:
            CACHE.entries, CACHE.keep = kept
        keyed = keys(small)
        _COPIES[mod.__name__, fp8] = [{keyed[n] for n, p in small.named_parameters() if (p.data_ptr(), q) in made}
                                      for q in (True, False)]
    return tuple({n for n, key in keys(model).items() if key in found} for found in _COPIES[mod.__name__, fp8])


def fp8_operand_bytes(shape, recipe: str) -> int:
    """Bytes of a weight's forward and dgrad FP8 operands (core/fp8.py:weight_operand): a byte per element each, fp32
    scales per row of each (rowwise) or per 128x128 block (blockwise; a [1, k] or [n, 1] grid's transpose: no copy)."""
    *lead, a, b = shape
    n, k = math.ceil(a / BLOCK), math.ceil(b / BLOCK)
    return math.prod(lead) * (2 * a * b + 4 * ((a + b) if recipe == "rowwise" else n * k * (1 + (min(n, k) > 1))))


class _Saved:  # a tensor autograd saved (saved_bytes): alive while the graph node that saved it lives
    def __init__(self, t: torch.Tensor):
        self.t, self.expanded = t, step3.inside


def saved_bytes(model, input_ids_BS, stage_cls=None) -> dict:
    """Bytes a forward (fp32, CPU) leaves held for backward, each storage once (by identity: freed ones' addresses are
    reused) at its size when it ends, weights excluded: what autograd still holds of what forward_train saved, or of
    the model run as one DualPipeV stage (stage_cls: the recipe's PipelineStage) plus what its tape holds: "total",
    of it the rows step (3) was handed (core/moe.py:step3) and the rest saved while it ran, their counts (Q, R), and
    numbers per dispatched and per combined row (a top-k router's x_TH and weights: H + k, and H)."""
    saved, tensors = weakref.WeakSet(), []

    def pack(t):
        saved.add(held := _Saved(t))
        return held

    step3.on, step3.received, step3.rows = True, [], 0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
            if stage_cls is None:
                out = model.forward_train(input_ids_BS, input_ids_BS)
            else:
                stage, tape, out, positions_BS = stage_cls(model, list(model.layers), True, True), _Tape(True), [], \
                    torch.arange(input_ids_BS.shape[1]).expand_as(input_ids_BS)
                stage.input_ids = stage.labels = [input_ids_BS]
                stage.extras = [model.prepare_batch(input_ids_BS, input_ids_BS, None, positions_BS)]
                stage.loss_fn = lambda terms: sum(terms.values())
                model.set_positions(positions_BS)
                list(_forward_steps(stage, [], 0, tape, out))  # (it yields at each all-to-all start)
                tensors = [t for outs, leaves, _ in tape.segments for t in outs + leaves]
    finally:
        step3.on, received, step3.received = False, step3.received, []
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    rows, sizes, kind = {t.untyped_storage()._cdata for t, _ in received}, {}, {}
    for t, expanded in [(t, False) for t in tensors] + [(held.t, held.expanded) for held in saved]:
        if (c := (s := t.untyped_storage())._cdata) not in weights:
            sizes[c], kind[c] = s.nbytes(), "received" if c in rows else "expanded" if expanded else kind.get(c, "")
    del out  # (the graph, and the storages only it held)
    part = lambda name: sum(size for c, size in sizes.items() if kind[c] == name)
    return dict(total=sum(sizes.values()), received=part("received"), expanded=part("expanded"),
                received_rows=sum(t.shape[0] for t, _ in received), expanded_rows=step3.rows,
                widths=(received[0][0].shape[1], received[0][0].shape[1] - received[0][1]) if received else (0, 0))


# fp32 bytes kept per token of a dense / MoE layer (expert rows apart), per expanded pair, per received row, per vocab
Calibration = namedtuple("Calibration", "tiny per_dense per_moe per_slot per_row per_token_vocab widths")
_CALIBRATION = {}


def activation_calibration(mod, recompute: str, pipeline: bool = False, batch: int = 2) -> Calibration:
    """The model minus one without layers gives the layers, the dense ones alone the dense ones, the expert rows per
    row step (3) ran (any router's counts); at the tiny config's calibration_seq_len; pipeline: as a DualPipeV stage."""
    key = (mod.__name__, recompute, pipeline)
    if key not in _CALIBRATION:
        tiny = mod.ModelConfig.from_hf(mod.tiny_config_path())
        tokens = batch * tiny.calibration_seq_len
        moe_ids = [i for i in range(tiny.num_hidden_layers) if tiny.is_moe_layer(i)]
        dense_ids = [i for i in range(tiny.num_hidden_layers) if i not in moe_ids]
        measure = lambda layers=None: saved_bytes(mod.Model(tiny, layers=layers, recompute=recompute), ids,
                                                  mod.PipelineStage if pipeline else None)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            ids = torch.randint(0, tiny.vocab_size, (batch, tiny.calibration_seq_len))
            head, full = measure([]), measure()  # (the head's part: a layer of its own, DeepSeek-V3's MTP, too)
            dense = measure(dense_ids)["total"] - head["total"] if dense_ids else 0
        layers = {name: full[name] - head[name] for name in full if name != "widths"}
        per_moe = (layers["total"] - dense - layers["received"] - layers["expanded"]) / (tokens * max(len(moe_ids), 1))
        _CALIBRATION[key] = Calibration(
            tiny, dense / (tokens * len(dense_ids)) if dense_ids else per_moe, per_moe,
            layers["expanded"] / max(layers["expanded_rows"], 1), layers["received"] / max(layers["received_rows"], 1),
            head["total"] / (tokens * tiny.vocab_size), full["widths"])
    return _CALIBRATION[key]


def rank_hit_chance(num_experts: int, slots: float, local: int) -> float:
    """The chance that a token's experts (`slots` distinct of E, uniform; a mean: floor and ceil mixed to give it)
    include one of a rank's `local` experts: 1 - C(E - L, k) / C(E, k)."""
    k, frac = int(slots), slots - int(slots)
    miss = lambda k: math.comb(num_experts - local, k) / math.comb(num_experts, k)
    return 1 - (1 - frac) * miss(k) - (frac * miss(k + 1) if frac else 0)


def received_rows_per_token(cfg, layout: Layout) -> float:
    """Rows the most loaded ep rank receives per token of its own (deduplicated dispatch, core/moe.py) under uniform
    routing: each of the ep ranks' tokens once if any of its experts is among this rank's L of E."""
    E, slots = cfg.num_experts, cfg.slots_per_token
    L = max(len(e) for e in Placement.parse(layout.expert_placement, E, layout.ep).experts)
    return layout.ep * rank_hit_chance(E, slots, L) if slots else 1.0


def saved_per_token_layer(mod, cfg, layout: Layout, pipeline: bool = False, moe: bool = True) -> float:
    """fp32 bytes autograd keeps (pipeline: a DualPipeV stage holds) per token in an MoE decoder layer, for cfg's
    slots per token and the rows this layout's most loaded ep rank receives, or in a dense one, at tiny's width."""
    c = activation_calibration(mod, layout.recompute, pipeline)
    return c.per_moe + c.per_slot * cfg.slots_per_token + c.per_row * received_rows_per_token(cfg, layout) if moe \
        else c.per_dense


def param_units(model, rules: dict) -> dict[str, str]:
    """Each parameter's FSDP2 unit (core/fsdp.py:fsdp_units, as shard_model makes them): the innermost holding it."""
    units = sorted(sum(fsdp_units(model, rules), []), key=len, reverse=True)  # ('' the root: last)
    return {n: next(u for u in units if n.startswith(u + ".") or not u) for n in rules}


def muon_bytes(model, layout: Layout) -> tuple[list[int], int]:
    """(Muon's momentum bytes on each rank g of the dense shard group, g = (dp, cp) index x ep + ep index, and the
    transient bytes of its largest bucket on an owner: rows received, assembled, sent back, 3 x 4 bytes an element),
    as core/muon.py:MuonAdamW places them. `model`: the ep rank holding the most experts."""
    ep, n_expert = layout.ep, layout.dp * layout.cp
    counts = [len(e) for e in Placement.parse(layout.expert_placement, model.cfg.num_experts, ep).experts]
    flops, held, spanning = [0] * (n_expert * ep), [0] * (n_expert * ep), []
    for (name, p), rule in zip(model.named_parameters(), parameter_rules(model).values()):
        expert, row = rule.expert_ids is not None, p.numel() // p.shape[0] if p.ndim else 1
        for kind, (v_SAB, _) in rule.muon.items():
            cost, numel = newton_schulz_flops(*v_SAB.shape[1:]), v_SAB.shape[1] * v_SAB.shape[2]
            for s in range(v_SAB.shape[0]):
                first, last = matrix_rows(name, kind, v_SAB, s, row)
                if last - first > 1:  # its shard group: every rank (dense), or the dp*cp ranks of each ep rank
                    for k in range(ep) if expert else [None]:
                        if k is None or last <= counts[k]:
                            spanning.append((k, cost, numel, first, last, counts[k] if expert else p.shape[0]))
                    continue
                for g in range(n_expert * ep):  # the rank holding that row, if any (ep ranks hold other experts)
                    d0, n, i = (counts[g % ep], n_expert, g // ep) if expert else (p.shape[0], n_expert * ep, g)
                    if last <= d0 and first // math.ceil(d0 / n) == i:
                        flops[g], held[g] = flops[g] + cost, held[g] + numel
    largest = 0
    for k in sorted({x[0] for x in spanning}, key=str):
        ranks = list(range(len(flops))) if k is None else list(range(k, len(flops), ep))
        found = [x for x in spanning if x[0] == k]
        owners = assign_owners([cost for _, cost, *_ in found], [flops[g] for g in ranks])
        bucket, owned = 0, [0] * len(ranks)  # the buckets of MuonAdamW._plan_buckets: <= BUCKET_BYTES of fp32
        for (_, _, numel, *_), owner in zip(found, owners):
            held[ranks[owner]] += numel
            if bucket and 4 * (bucket + numel) > BUCKET_BYTES:
                bucket, owned = 0, [0] * len(ranks)
            bucket, owned[owner] = bucket + numel, owned[owner] + numel
            largest = max(largest, max(owned))
    return [4 * x for x in held], 3 * 4 * largest


def fsdp_bytes(mod, model, layout: Layout) -> dict:
    """Exact bytes of weights, gradients and optimizer state of rank 0 of each shard group under FSDP2 (the largest
    shards; Muon's momentum: the most any rank owns), and fsdp_buffers: the units in flight (gathered per micro-batch
    the two largest, the largest's gradient and the largest weight's FP8 operands; once per step the largest unit's
    fp32 reduce-scatter input, its sums in the gradients) and Muon's largest bucket."""
    n_dense, n_expert = layout.dp * layout.cp * layout.ep, layout.dp * layout.cp
    compute = 2 if layout.bf16 else 4  # bytes of a gathered weight (MixedPrecisionPolicy param_dtype)
    shards = adam = cache = unsharded_grads = fp8_per_use = 0
    rules, units = parameter_rules(model), {}
    unit_of, fp8 = param_units(model, rules), weight_copies(mod, model, True)[0] if layout.fp8 else set()
    muon = {n for n, rule in rules.items() if layout.optimizer == "muon" and rule.muon}
    for name, p in model.named_parameters():
        expert = rules[name].expert_ids is not None
        rows = p.shape[0] if p.shape else 1
        shard = math.ceil(rows / (n_expert if expert else n_dense)) * (p.numel() // rows)
        shards, adam = shards + shard, adam + (0 if name in muon else shard)
        units[unit_of[name]] = units.get(unit_of[name], 0) + p.numel()
        if layout.once:  # gathered once per step, its FP8 operands made once per step
            cache += compute * p.numel() + (fp8_operand_bytes(p.shape, layout.fp8_recipe) if name in fp8 else 0)
            unsharded_grads += 4 * p.numel()  # summed in fp32 (each bf16 gradient moves there as it arrives)
        elif name in fp8:  # per micro-batch: made per use (core/weight_cache.py keep False), both operands at most
            fp8_per_use = max(fp8_per_use, fp8_operand_bytes(p.shape, layout.fp8_recipe))
    momentum, muon_buffers = muon_bytes(model, layout) if muon else ([0], 0)
    largest = sorted(units.values(), reverse=True)
    in_flight = largest[0] * 4 if layout.once else \
        compute * sum(largest[:2]) + (compute + 4) * largest[0] + fp8_per_use
    return dict(weights=4 * shards, gradients=4 * shards + unsharded_grads, optimizer=8 * adam + max(momentum),
                weight_cache=cache, fsdp_buffers=in_flight + muon_buffers)


def param_bytes(mod, model, layout: Layout) -> dict:
    """Exact bytes of weights, gradients, optimizer state (world > 1: fsdp_bytes) of `model` (mod: its model.py)."""
    if layout.fsdp:
        return fsdp_bytes(mod, model, layout)
    weights = adam = cache = 0
    rules = parameter_rules(model)
    fp8, cast = weight_copies(mod, model, layout.fp8) if layout.fp8 or layout.bf16 else (set(), set())
    for name, p in model.named_parameters():  # one process: every tensor whole, plain
        weights += 4 * p.numel()
        adam += (4 if layout.optimizer == "muon" and rules[name].muon else 8) * p.numel()
        if name in fp8:
            cache += fp8_operand_bytes(p.shape, layout.fp8_recipe)
        elif layout.bf16 and name in cast:
            cache += 2 * p.numel()
    return dict(weights=weights, gradients=weights, optimizer=adam, weight_cache=cache, fsdp_buffers=0)


_MODELS, _PARAMS, _HANDOFF = {}, {}, {}


def rank_param_bytes(mod, cfg, layout: Layout, pp_rank: int) -> tuple[dict, list[int], bool]:
    """(param_bytes, layer ids, holds the head) of one pp rank, from the model built on meta (the model cached per
    (pp, ep, placement, sequence length: the layer costs split the stages, pp rank), the bytes per layout)."""
    key = (mod.__name__, id(cfg), layout.pp, layout.dp, layout.cp, layout.ep, layout.expert_placement, layout.bf16,
           layout.fp8, layout.fp8_recipe, layout.seq_len, layout.optimizer, layout.fsdp_gather, pp_rank)
    if key not in _PARAMS:
        model_key = (mod.__name__, id(cfg), layout.pp, layout.ep, layout.expert_placement, layout.seq_len, layout.fp8,
                     pp_rank)
        if model_key not in _MODELS:
            parts = rank_parts(cfg, layout, pp_rank, mod.flops_by_layer(cfg, layout.seq_len))
            _MODELS[model_key] = (meta_model(mod, cfg, layout.fp8, **parts), parts["head"], cfg)
        model, head, _ = _MODELS[model_key]
        _PARAMS[key] = (param_bytes(mod, model, layout), [int(i) for i in model.layers], head)
    return _PARAMS[key]


def handoff_bytes(mod, cfg, layout: Layout) -> int:
    """Bytes of the state stage 0 makes of a micro-batch (Model.initial_state: what crosses pp ranks, as
    DualPipeV._stage0_specs takes it), a cp rank's part, made on fake tensors (no memory; autocast refuses meta)."""
    key = (mod.__name__, id(cfg), layout.micro_batch, layout.seq_len, layout.cp, layout.bf16)
    if key not in _HANDOFF:
        model = meta_model(mod, cfg, layers=[], head=False)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            ids_BS = torch.zeros(layout.micro_batch, layout.seq_len // layout.cp, dtype=torch.long)  # a cp rank's
            extras = model.prepare_batch(ids_BS, ids_BS, None, torch.arange(ids_BS.shape[1]).expand_as(ids_BS))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=layout.bf16):
                state = model.initial_state(ids_BS, extras)
            _HANDOFF[key] = (sum(t.numel() * t.element_size() for t in state), cfg)  # cfg kept: its id stays its own
    return _HANDOFF[key][0]


def estimate(mod, cfg, layout: Layout, pp_rank: int | None = None) -> dict:
    """Bytes per component on the most loaded pp rank (or pp_rank), 'total', 'pp_rank'; mod: the recipe's model.py."""
    if layout.seq_len % (2 * layout.cp):
        raise ValueError(f"--seq-len {layout.seq_len} is not divisible by 2*cp = {2 * layout.cp}")
    pp, pipeline = layout.pp, layout.pp > 1
    c = activation_calibration(mod, layout.recompute, pipeline)
    tokens = layout.micro_batch * layout.seq_len // layout.cp
    # every model's activations and rows scale, to first order, with its width (test_activations_scale_with_width)
    width = cfg.hidden_size / c.tiny.hidden_size * (0.5 if layout.bf16 else 1.0)
    per_layer = {moe: saved_per_token_layer(mod, cfg, layout, pipeline, moe) * width for moe in (False, True)}
    chunk = lambda layers, head: tokens * (sum(per_layer[cfg.is_moe_layer(i)] for i in layers) + head)  # 1 micro-batch
    stages = split_layers(cfg.num_hidden_layers, pp, mod.flops_by_layer(cfg, layout.seq_len)) if pipeline else None
    best, ranks = None, range(pp) if pp_rank is None else [pp_rank]
    for pp_rank in ranks:
        params, layer_ids, has_head = rank_param_bytes(mod, cfg, layout, pp_rank)
        out = dict(params)
        fsdp_buffers = out.pop("fsdp_buffers")
        head = c.per_token_vocab * cfg.vocab_size * (0.5 if layout.bf16 else 1.0) if has_head else 0
        if pipeline:  # chunks held at the peak (module docstring), and the states they handed to another rank
            down, up, middle = 2 * pp - pp_rank, pp_rank + 1, 0 < pp_rank < pp - 1
            handoff = handoff_bytes(mod, cfg, layout)
            out["activations"] = int(down * (chunk(stages[pp_rank], 0) + handoff)
                                     + up * (chunk(stages[2 * pp - 1 - pp_rank], head) + middle * handoff))
        else:
            out["activations"] = int(chunk(layer_ids, head))
        moe = any(cfg.is_moe_layer(i) for i in layer_ids)
        rows = tokens * cfg.slots_per_token * sum(c.widths) * width * 4 if moe else 0  # dispatch + combine
        out["comm_buffers"] = int(2 * rows) + fsdp_buffers  # send + recv; FSDP2's units in flight
        out["total"] = sum(out.values())
        out["pp_rank"] = pp_rank
        if best is None or out["total"] > best["total"]:
            best = out
    return best


def fits(est: dict, gpu_gib: float, reserve_gib: float) -> bool:
    return est["total"] <= (gpu_gib - reserve_gib) * GIB


def suggest(mod, cfg, layout: Layout, gpu_gib: float, reserve_gib: float, limit: int = 3) -> list[Layout]:
    """Layouts on the same number of GPUs (same sequence length and precision) that fit, fewest changes first."""
    world = layout.pp * layout.dp * layout.cp * layout.ep
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    found = []
    for pp, cp, ep in itertools.product(divisors, divisors, divisors):
        if world % (pp * cp * ep) or layout.seq_len % (2 * cp):
            continue
        if pp > 1 and 2 * pp - 2 > cfg.num_hidden_layers:
            continue
        for mb, rc in itertools.product(sorted({1, layout.micro_batch}), ("none", "attention", "layer")):
            cand = replace(layout, pp=pp, dp=world // (pp * cp * ep), cp=cp, ep=ep, micro_batch=mb, recompute=rc,
                           expert_placement=layout.expert_placement if ep == layout.ep else "")
            if cand == layout:
                continue
            try:
                est = estimate(mod, cfg, cand)
            except ValueError:
                continue
            if fits(est, gpu_gib, reserve_gib):
                changes = sum(getattr(cand, f) != getattr(layout, f) for f in ("pp", "cp", "ep", "micro_batch", "recompute"))
                found.append((changes, est["total"], cand))
    return [c for _, _, c in sorted(found, key=lambda x: (x[0], x[1]))[:limit]]


def check_fits(mod, cfg, layout: Layout, gpu_gib: float, reserve_gib: float = 4.0) -> None:
    """Raise a one-line ValueError when the layout does not fit, naming layouts that would."""
    est = estimate(mod, cfg, layout)
    if fits(est, gpu_gib, reserve_gib):
        return
    others = suggest(mod, cfg, layout, gpu_gib, reserve_gib)
    hint = "; ".join(str(o) for o in others) if others else "none on this many GPUs: use more GPUs or a shorter --seq-len"
    raise ValueError(f"estimated peak {est['total'] / GIB:.1f} GiB per GPU (pp rank {est['pp_rank']}) exceeds "
                     f"{gpu_gib:.0f} GiB - {reserve_gib:.0f} GiB reserve for {layout}; layouts that fit: {hint} "
                     f"(python -m tools.estimate_memory for the table)")


def check_train_args(model_cls, cfg, args, world: int) -> None:
    """train.py's guard: on CUDA, refuse a layout that cannot fit in this GPU's memory; nothing on CPU.
    model_cls: the recipe's Model (its module is the recipe)."""
    if not torch.cuda.is_available() or args.device == "cpu":
        return
    dp = args.dp if args.dp > 0 else world // (args.pp * args.cp * args.ep)
    if dp < 1 or args.pp * dp * args.cp * args.ep != world:
        return  # build_mesh reports a layout that does not match the world size
    layout = Layout(args.pp, dp, args.cp, args.ep, args.micro_batch, args.seq_len, args.dtype != "fp32", args.fp8,
                    args.recompute, args.expert_placement, args.optimizer, args.fsdp_gather,
                    args.fp8_recipe)
    check_fits(sys.modules[model_cls.__module__], cfg, layout, torch.cuda.get_device_properties(0).total_memory / GIB)
