"""Per-rank peak training memory of a recipe's model under a layout, by component, and whether it fits a GPU.
Model-agnostic (functions take the recipe's model module and a config); `check_train_args` is train.py's guard,
`python -m tools.estimate_memory` prints the table.

Components of the most loaded pipeline rank (every pp rank is built; the largest total is reported):
  weights      fp32 master parameters of the recipe's Model built on `meta` for this rank's part (its two
               DualPipeV stages, the ep rank holding the most experts, embedding and head on pp rank 0)
  gradients    fp32, one per parameter (the full gradient lives until ShardedAdamW.reduce_gradients)
  optimizer    AdamW's two fp32 moments of this rank's ZeRO-1 shard (core/optimizer.py: ceil(numel / n) each)
  weight cache bf16 casts of the routed experts and LM head (core/weight_cache.py); fp8: the two FP8 operands
               of every weight the recipe's enable_fp8 converts instead, with their fp32 scales (fp8_operand_bytes)
  activations  bytes saved for backward and held when the forward ends (core/moe.py frees received rows it
               dispatches again), measured once with torch.autograd.graph.saved_tensors_hooks on the
               recipe's tiny config on CPU (per token and layer, and per routed choice: an MoE layer keeps [T*k, H]
               rows; per token and vocab entry for the head), scaled by top-k, tokens (micro_batch * seq_len / cp),
               layers, hidden_size / tiny's, vocab, 1/2 for bf16, micro-batches in flight (pp + 1 under DualPipeV)
  comm buffers MoE all-to-all rows (sent and received, tokens * top-k * hidden), a reduce-scatter bucket
With `shard="fsdp"` (core/fsdp.py) every parameter lies on 1/n shards of ceil(d0 / n) rows: 16 bytes per shard
element, no bf16 cache. pp = 1: the comm buffers hold the two largest units gathered and the largest unit's gradient
before its reduce-scatter (compute dtype + fp32), with fp8 the largest weight's operands (made per use, none kept);
pp > 1: the weight cache is the gathered stage plus the FP8 operands, the gradients add the unsharded ones (compute
dtype for dense units, fp32 for experts) and the comm buffers the largest unit's fp32 reduce-scatter input.
Plus a reserve for the CUDA context and fragmentation. Weights, gradients, optimizer and weight cache are exact (tested
against a built model, ShardedAdamW, FSDP2, the cache); activations exact on tiny configs, first-order on full ones.
Parameter names follow the recipes' convention: routed experts under `.mlp.experts.`, the head is `lm_head`.
"""

import itertools
import math
import sys
from dataclasses import dataclass, replace

import torch

from core.fp8 import BLOCK, FP8Linear
from core.optimizer import _split
from core.pipeline import split_layers
from core.placement import Placement

GIB = 2**30
BUCKET_BYTES = 256 << 20  # ShardedAdamW's default bucket_bytes


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
    shard: str = "zero1"  # train.py's --shard: zero1 (core/optimizer.py) or fsdp (core/fsdp.py)
    fp8_recipe: str = "rowwise"  # train.py's --fp8-recipe (the bytes of the FP8 operands' scales)

    def __str__(self):
        return (f"--pp {self.pp} --dp {self.dp} --cp {self.cp} --ep {self.ep} --micro-batch {self.micro_batch} "
                f"--recompute {self.recompute}" + (f" --expert-placement {self.expert_placement}"
                                                   if self.expert_placement else "")
                + (" --shard fsdp" if self.fsdp else ""))

    @property
    def fsdp(self) -> bool:
        """FSDP2 runs (one process runs ZeRO-1's code: nothing to shard)."""
        return self.shard == "fsdp" and self.pp * self.dp * self.cp * self.ep > 1


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


def fp8_weights(model) -> set[str]:
    """Names of the weights core/fp8.py quantises: FP8Linear weights, [E, K, N] tensors of experts with .fp8 set."""
    return {f"{name}.{n}" for name, m in model.named_modules() for n, p in m.named_parameters(recurse=False)
            if (isinstance(m, FP8Linear) and n == "weight") or (getattr(m, "fp8", False) is True and p.ndim == 3)}


def fp8_operand_bytes(shape, recipe: str) -> int:
    """Bytes of a weight's forward and dgrad FP8 operands (core/fp8.py:weight_operand): a byte per element each, fp32
    scales per row of each (rowwise) or per 128x128 block (blockwise; a [1, k] or [n, 1] grid's transpose: no copy)."""
    *lead, a, b = shape
    n, k = math.ceil(a / BLOCK), math.ceil(b / BLOCK)
    return math.prod(lead) * (2 * a * b + 4 * ((a + b) if recipe == "rowwise" else n * k * (1 + (min(n, k) > 1))))


def saved_bytes(model, input_ids_BS) -> tuple[int, int]:
    """Bytes autograd keeps for backward in one forward_train (fp32 on CPU), each storage once at its size when the
    forward ends (core/moe.py frees received rows it dispatches again), weights excluded; and of them, the bytes of
    received dispatch payloads (core/moe.py: [Q, H + k] rows, kept as [Q, H] views)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    H, k = model.cfg.hidden_size, getattr(model.cfg, "num_experts_per_tok", 0)
    seen, received = {}, set()

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() in seen and seen[s.data_ptr()].data_ptr() != s.data_ptr():
            received.discard(s.data_ptr())  # the storage seen at this address was freed: this is another one
        if s.data_ptr() not in weights:
            seen[s.data_ptr()] = s
            if k and t.dim() == 2 and t.shape[1] == H and t.stride(0) == H + k:  # payload rows without their weights
                received.add(s.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.forward_train(input_ids_BS, input_ids_BS)
    sizes = {ptr: s.nbytes() for ptr, s in seen.items()}
    del out  # (the graph, and the storages only it held)
    return sum(sizes.values()), sum(sizes[p] for p in received)


_CALIBRATION = {}


def activation_calibration(mod, recompute: str, batch: int = 2, seq: int = 64) -> tuple:
    """(tiny config, saved bytes per token and layer (at k = 0; per routed choice, from a run at twice the tiny k;
    per row received by the experts' rank, one per token in one process), per token and vocab entry of the head),
    on CPU in fp32 (the model minus one without layers gives the layers; seq 64: whole linear-attention chunks)."""
    key = (mod.__name__, recompute)
    if key not in _CALIBRATION:
        tiny = mod.ModelConfig.from_hf(mod.tiny_config_path())
        tokens = batch * seq
        k = getattr(tiny, "num_experts_per_tok", 0)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            ids = torch.randint(0, tiny.vocab_size, (batch, seq))
            head, _ = saved_bytes(mod.Model(tiny, layers=[], recompute=recompute), ids)
            full, received = saved_bytes(mod.Model(tiny, recompute=recompute), ids)
            layers, per_choice = full - head - received, 0.0
            if k:
                try:
                    more, more_received = saved_bytes(mod.Model(replace(tiny, num_experts_per_tok=2 * k),
                                                                recompute=recompute), ids)
                    per_choice = (more - more_received - head - layers) / (k * tokens * tiny.num_hidden_layers)
                except (ValueError, RuntimeError):  # 2k choices not allowed (expert groups, too few experts)
                    pass
        per_layer, per_row = (layers / (tokens * tiny.num_hidden_layers), received / (tokens * tiny.num_hidden_layers))
        _CALIBRATION[key] = (tiny, (per_layer - per_choice * k, per_choice, per_row), head / (tokens * tiny.vocab_size))
    return _CALIBRATION[key]


def received_rows_per_token(cfg, layout: Layout) -> float:
    """Rows the most loaded ep rank receives per token of its own (deduplicated dispatch, core/moe.py) under uniform
    routing: each of the ep ranks' tokens once if any of its k experts is among this rank's L of E."""
    E, k = cfg.num_experts, getattr(cfg, "num_experts_per_tok", 0)
    L = max(len(e) for e in Placement.parse(layout.expert_placement, E, layout.ep).experts)
    return layout.ep * (1 - math.comb(E - L, k) / math.comb(E, k)) if k else 1.0


def saved_per_token_layer(mod, cfg, layout: Layout) -> float:
    """fp32 bytes autograd keeps per token and decoder layer at the tiny config's width, for cfg's top-k and the
    rows this layout's most loaded ep rank receives."""
    _, (per_token_layer, per_choice, per_row), _ = activation_calibration(mod, layout.recompute)
    return (per_token_layer + per_choice * getattr(cfg, "num_experts_per_tok", 0)
            + per_row * received_rows_per_token(cfg, layout))


def fsdp_unit(name: str) -> str:
    """The FSDP2 unit (core/fsdp.py:shard_model) of a parameter: a layer's experts or rest, embedding, root."""
    parts = name.split(".")
    if parts[0] == "embed_tokens":
        return "embed_tokens"
    return "root" if parts[0] != "layers" else f"layers.{parts[1]}" + (".experts" if ".mlp.experts." in name else "")


def fsdp_bytes(model, layout: Layout) -> dict:
    """Exact bytes of weights, gradients and Adam state of rank 0 of each shard group under FSDP2 (the largest
    shards), the units in flight counted as comm_buffers (module docstring)."""
    n_dense, n_expert = layout.dp * layout.cp * layout.ep, layout.dp * layout.cp
    compute = 2 if layout.bf16 else 4  # bytes of a gathered weight (MixedPrecisionPolicy param_dtype)
    shards = cache = unsharded_grads = fp8_per_use = 0
    units, fp8 = {}, fp8_weights(model) if layout.fp8 else set()
    for name, p in model.named_parameters():
        expert = ".mlp.experts." in name
        rows = p.shape[0] if p.ndim else 1
        shards += math.ceil(rows / (n_expert if expert else n_dense)) * (p.numel() // rows)
        units[fsdp_unit(name)] = units.get(fsdp_unit(name), 0) + p.numel()
        if layout.pp > 1:  # gathered once per step, its FP8 operands made once per step
            cache += compute * p.numel() + (fp8_operand_bytes(p.shape, layout.fp8_recipe) if name in fp8 else 0)
            unsharded_grads += (4 if expert else compute) * p.numel()
        elif name in fp8:  # pp = 1: per use (core/weight_cache.py keep False), both operands at most
            fp8_per_use = max(fp8_per_use, fp8_operand_bytes(p.shape, layout.fp8_recipe))
    largest = sorted(units.values(), reverse=True)
    in_flight = largest[0] * 4 if layout.pp > 1 else \
        compute * sum(largest[:2]) + (compute + 4) * largest[0] + fp8_per_use
    return dict(weights=4 * shards, gradients=4 * shards + unsharded_grads, optimizer=8 * shards, weight_cache=cache,
                fsdp_buffers=in_flight)


def param_bytes(model, layout: Layout) -> dict:
    """Exact bytes of weights, gradients and Adam shards (dp*cp rank 0: the largest shards) of this model."""
    if layout.fsdp:
        return fsdp_bytes(model, layout)
    n_dense = layout.dp * layout.cp * layout.ep
    n_expert = layout.dp * layout.cp
    weights = adam = cache = 0
    fp8 = fp8_weights(model) if layout.fp8 else set()
    for name, p in model.named_parameters():
        expert = ".mlp.experts." in name
        weights += 4 * p.numel()
        lo, hi = _split(p.numel(), n_expert if expert else n_dense, 0)
        adam += 8 * (hi - lo)
        if name in fp8:
            cache += fp8_operand_bytes(p.shape, layout.fp8_recipe)
        elif layout.bf16 and (expert or name.startswith("lm_head")):
            cache += 2 * p.numel()
    return dict(weights=weights, gradients=weights, optimizer=adam, weight_cache=cache, fsdp_buffers=0)


_MODELS, _PARAMS = {}, {}


def rank_param_bytes(mod, cfg, layout: Layout, pp_rank: int) -> tuple[dict, list[int], bool]:
    """(param_bytes, layer ids, holds the head) of one pp rank, from the model built on meta (the model cached per
    (pp, ep, placement, sequence length: the layer costs split the stages, pp rank), the bytes per layout)."""
    key = (mod.__name__, id(cfg), layout.pp, layout.dp, layout.cp, layout.ep, layout.expert_placement, layout.bf16,
           layout.fp8, layout.fp8_recipe, layout.seq_len, layout.shard, pp_rank)
    if key not in _PARAMS:
        model_key = (mod.__name__, id(cfg), layout.pp, layout.ep, layout.expert_placement, layout.seq_len, layout.fp8,
                     pp_rank)
        if model_key not in _MODELS:
            parts = rank_parts(cfg, layout, pp_rank, mod.flops_by_layer(cfg, layout.seq_len))
            _MODELS[model_key] = (meta_model(mod, cfg, layout.fp8, **parts), parts["head"], cfg)
        model, head, _ = _MODELS[model_key]
        _PARAMS[key] = (param_bytes(model, layout), [int(i) for i in model.layers], head)
    return _PARAMS[key]


def estimate(mod, cfg, layout: Layout) -> dict:
    """Bytes per component on the most loaded pp rank, plus 'total' and 'pp_rank'. mod: the recipe's model module."""
    if layout.seq_len % (2 * layout.cp):
        raise ValueError(f"--seq-len {layout.seq_len} is not divisible by 2*cp = {2 * layout.cp}")
    tiny, _, per_token_vocab = activation_calibration(mod, layout.recompute)
    per_token_layer = saved_per_token_layer(mod, cfg, layout)
    tokens = layout.micro_batch * layout.seq_len // layout.cp
    in_flight = layout.pp + 1 if layout.pp > 1 else 1
    width = cfg.hidden_size / tiny.hidden_size * (0.5 if layout.bf16 else 1.0)
    act_bytes = 2 if layout.bf16 else 4
    best = None
    for pp_rank in range(layout.pp):
        params, layer_ids, has_head = rank_param_bytes(mod, cfg, layout, pp_rank)
        out = dict(params)
        fsdp_buffers = out.pop("fsdp_buffers")
        head = per_token_vocab * cfg.vocab_size * (0.5 if layout.bf16 else 1.0) if has_head else 0
        out["activations"] = int(in_flight * tokens * (len(layer_ids) * per_token_layer * width + head))
        moe_layers = sum(cfg.is_moe_layer(i) for i in layer_ids)
        rows = tokens * cfg.num_experts_per_tok * cfg.hidden_size * act_bytes if moe_layers else 0
        # dispatch + combine, send + recv; ZeRO-1's reduce-scatter bucket or FSDP2's units in flight
        out["comm_buffers"] = 4 * rows + (fsdp_buffers if layout.fsdp else min(BUCKET_BYTES, out["gradients"]))
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
                    args.recompute, args.expert_placement, args.shard, args.fp8_recipe)
    check_fits(sys.modules[model_cls.__module__], cfg, layout, torch.cuda.get_device_properties(0).total_memory / GIB)
