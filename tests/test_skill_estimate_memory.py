"""core/memory.py (the estimate) against exact counts on CPU: parameter bytes of the built model, optimizer state of
the real FSDPAdamW and MuonAdamW (one process and 2 gloo ranks: Adam shards, each rank's Muon momentum), bytes saved
for backward measured with saved_tensors_hooks (one process, ep2, and what each rank of a DualPipeV step at pp2 x ep2
holds at its peak); the refusal with suggested layouts; and the skill's script (tools/estimate_memory.py's command
line) on every recipe."""

import dataclasses
import json
import runpy
import sys
import types
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from core import memory, moe
from core.fsdp import FSDPAdamW, shard_model
from core.mesh import build_mesh, destroy_mesh
from core.muon import MuonAdamW
from core.pipeline import DualPipeV, Running, split_layers
from core.training import parameter_rules
from core.weight_cache import CACHE
from recipes import recipe_names
from tests.conftest import TINY_TRAIN_CONFIG
from tests.model_variants import VARIANTS
from tests.multiproc import run_ranks
from tools.estimate_memory import recipe_module


def tiny(recipe):
    mod = VARIANTS[recipe]() if recipe in VARIANTS else recipe_module(recipe)
    return mod, mod.ModelConfig.from_hf(mod.tiny_config_path())


class Saved:
    """What the pack hook hands autograd for a tensor it saves: alive while the node that saved it is."""

    def __init__(self, t):
        self.t = t


def storages_of(tensors, weights: set) -> dict:
    """{storage identity: storage} of these tensors, weights excluded. By identity, not address: a storage freed
    during the forward (core/moe.py's received rows) may have its address reused by a later tensor."""
    return {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors
            if t.untyped_storage()._cdata not in weights}


def weight_storages(model) -> set:
    return {p.untyped_storage()._cdata for p in model.parameters()}


def measured_saved_bytes(model, batch, seq):
    """Reference: the tensors autograd saved in one forward_train and still holds when it has ended, each storage
    counted once at its size then (a storage freed meanwhile counts 0), weights excluded."""
    saved = weakref.WeakSet()

    def pack(t):
        saved.add(s := Saved(t))
        return s

    ids = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.t):
        out = model.forward_train(ids, ids)
    held = sum(s.nbytes() for s in storages_of([s.t for s in saved], weight_storages(model)).values())
    del out
    return held


def optimizer_bytes(model, mesh, optimizer: str) -> tuple[int, int]:
    """(Adam bytes, Muon momentum bytes) the real optimizer holds on this rank (FSDP2 over `mesh` at world > 1)."""
    units = shard_model(model, mesh, bf16=False, once=False) if mesh is not None and mesh.world > 1 else None
    if optimizer == "adamw":
        return FSDPAdamW(model, units, 1e-3, 0.1, (0.9, 0.95), 1e-8).state_bytes()[0], 0
    opt = MuonAdamW(model, units, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    momentum = sum(4 * m.momentum_kAB.numel() for m in opt.owned)
    return opt.state_bytes()[0] - momentum, momentum


def unit_of_parameters(model, mesh) -> dict[str, str]:
    """{parameter name: the name of the FSDP2 unit that shards it} as FSDP2 itself records it after shard_model."""
    units, names = shard_model(model, mesh, bf16=False, once=False), {m: n for n, m in model.named_modules()}
    params = {id(p): n for n, p in model.named_parameters()}
    return {params[id(fp.sharded_param)]: names[unit] for unit in units
            for group in fully_shard.state(unit)._fsdp_param_groups for fp in group.fsdp_params}


@pytest.mark.parametrize("recipe", recipe_names())
def test_params_and_optimizer_exact_one_process(recipe):
    """Each pp rank's weights/gradients with pp=2 and ep=2 equal that rank's share of the CPU-built full model
    (its two stages' layers, embedding/norm/head on rank 0, half of each expert tensor), dense rows sharded over the
    2 ep ranks, the gradients plus the unsharded fp32 sums of pp > 1; in one process the optimizer state equals a
    real FSDPAdamW's and MuonAdamW's."""
    mod, cfg = tiny(recipe)
    model = mod.Model(cfg)
    layout = memory.Layout(pp=2, ep=2, bf16=False)
    stages, rules = split_layers(cfg.num_hidden_layers, 2), parameter_rules(model)
    for pp_rank, layers in enumerate((stages[0] + stages[3], stages[1] + stages[2])):
        local = shard = 0  # elements of this rank's part, and of its FSDP2 shards (dense rows over the 2 ep ranks)
        for name, p in model.named_parameters():
            held = int(name.split(".")[1]) in layers if name.startswith("layers.") else pp_rank == 0
            expert = rules[name].expert_ids is not None  # (the model's declaration: Model.parameter_rules)
            local += held * p.numel() // (2 if expert else 1)
            shard += held * (p.numel() // 2 if expert else -(-p.shape[0] // 2) * (p.numel() // p.shape[0]))
        got = memory.param_bytes(mod, memory.meta_model(mod, cfg, **memory.rank_parts(cfg, layout, pp_rank)), layout)
        assert got["weights"] == 4 * shard and got["gradients"] == 4 * shard + 4 * local  # + the unsharded sums
    got = memory.param_bytes(mod, memory.meta_model(mod, cfg), memory.Layout(bf16=False))
    assert got["optimizer"] == sum(optimizer_bytes(model, None, "adamw")) == 2 * got["weights"]
    muon = memory.param_bytes(mod, memory.meta_model(mod, cfg), memory.Layout(bf16=False, optimizer="muon"))
    assert muon["optimizer"] == sum(optimizer_bytes(model, None, "muon")) < got["optimizer"]
    assert got["weight_cache"] == 0  # fp32: no casts


@pytest.mark.parametrize("recipe", recipe_names())
def test_bf16_weight_copies_exact_one_process(recipe, tmp_path):
    """One process under --dtype bf16 keeps a bf16 copy of each weight its model hands core/weight_cache.py for the
    step: one forward and backward of the recipe's check model (6 layers) holds exactly the bytes the estimate
    counts, which learns those weights from a run of the tiny config cut to 2 layers (here: the others by their
    place in the model's structure, as a full config's 48)."""
    from tests.recipe_checks import load_recipe, write_config

    checked = load_recipe(recipe)
    tiny = json.loads(checked.model.tiny_config_path().read_text())  # cut to 2 layers, a list per layer too
    per_layer = {k: v[:2] for k, v in tiny.items() if isinstance(v, list) and len(v) == tiny["num_hidden_layers"]}
    tiny_path = write_config(tmp_path / "tiny.json", {**tiny, **per_layer, "num_hidden_layers": 2})
    mod = types.ModuleType(f"{checked.model.__name__}_2_layers")
    mod.__dict__.update({k: v for k, v in vars(checked.model).items() if not k.startswith("__")},
                        tiny_config_path=lambda: tiny_path)
    cfg = mod.ModelConfig.from_hf(write_config(tmp_path / "config.json", checked.config))
    torch.manual_seed(0)
    model, ids = mod.Model(cfg), torch.randint(0, cfg.vocab_size, (2, checked.seq_len))
    CACHE.invalidate()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sum(model.forward_train(ids, ids.roll(-1, 1)).terms.values()).backward()
    held = sum(copy.untyped_storage().nbytes() for _, _, copy in CACHE.entries.values())
    CACHE.invalidate()
    estimated = memory.param_bytes(mod, memory.meta_model(mod, cfg), memory.Layout())["weight_cache"]
    assert held == estimated > 0, (held, estimated)


def _optimizers_on_two_ranks():
    """(Adam bytes, Muon momentum bytes) held by this rank: dp2 (everything over both ranks) and ep2 (dense over
    both, experts alone), AdamW and Muon."""
    out = {}
    for recipe in recipe_names() + ["renamed_experts"]:
        mod, cfg = tiny(recipe)
        for name, dims in (("dp2", dict(dp=2)), ("ep2", dict(ep=2))):
            mesh = build_mesh(**dims)
            for optimizer in ("adamw", "muon"):
                torch.manual_seed(0)
                out[recipe, name, optimizer] = optimizer_bytes(mod.Model(cfg, ep_group=mesh.group("ep")), mesh,
                                                               optimizer)
            out[recipe, name, "units"] = unit_of_parameters(mod.Model(cfg, ep_group=mesh.group("ep")), mesh)
    dist.destroy_process_group()
    return out


def test_optimizer_shards_exact_on_two_ranks():
    """Adam's moments: the first rank holds the estimate's (the largest shards, ceil(d0 / 2) rows), the other at
    most that; Muon's momentum on each rank exactly what core/memory.py:muon_bytes places there (matrices inside a
    row on its holder, 2-D weights on FLOP-balanced owners), the estimate counting the most any rank holds. Also for
    routed experts named without `experts` (tests/model_variants.py: declared by Model.parameter_rules), which FSDP2
    shards and the estimate counts as experts (over dp, not dp x ep). The FSDP2 units whose sizes the estimate sums
    (core/memory.py:param_units) are the ones FSDP2 records for each parameter."""
    ranks = run_ranks(2, _optimizers_on_two_ranks)
    for recipe in recipe_names() + ["renamed_experts"]:
        mod, cfg = tiny(recipe)
        for name, layout, experts in (("dp2", memory.Layout(dp=2, bf16=False), None),
                                      ("ep2", memory.Layout(ep=2, bf16=False), range(cfg.num_experts // 2))):
            model = memory.meta_model(mod, cfg, **({} if experts is None else {"expert_ids": experts}))
            assert ranks[0][recipe, name, "units"] == memory.param_units(model, parameter_rules(model)), (recipe, name)
            for optimizer in ("adamw", "muon"):
                L = dataclasses.replace(layout, optimizer=optimizer)
                model = memory.meta_model(mod, cfg, **({} if experts is None else {"expert_ids": experts}))
                momentum = memory.muon_bytes(model, L)[0] if optimizer == "muon" else [0, 0]
                adam = memory.param_bytes(mod, model, L)["optimizer"] - max(momentum)
                got = [ranks[r][recipe, name, optimizer] for r in (0, 1)]
                assert got[0][0] == adam and got[1][0] <= adam, (recipe, name, optimizer, got, adam)
                assert [m for _, m in got] == momentum, (recipe, name, optimizer, got, momentum)
                assert optimizer == "adamw" or min(momentum) > 0, momentum  # both ranks own matrices


def assert_activations_estimated(mod, cfg, recomputes, seed: int):
    """One process, micro-batch 4 x the calibration's sequence length (the tiny config's calibration_seq_len), fp32:
    the estimate within 2% of the bytes measured, per recompute mode. The estimate is per token, calibrated at
    micro-batch 2 x that length, where it is exact but for the few bytes that do not grow with the tokens (the loss's
    scalars, router statistics [2, E] per micro-batch; measured within 0.06%), and per slot filled: a router's own
    [T, k] outputs (ids, weights) grow with k, not with the slots it fills, which k doubled (the top-k check) leaves
    uncounted: measured up to 0.96% short under --recompute layer (the fewest bytes per token). The same length as
    the calibration: a length's own offsets (chunked linear attention's first chunk: 1.1% more per token at 128
    than at 64) stay as calibrated; the CPU attention keeps no S x S tensor for backward at any length
    (core/attention.py:attention_reference: kept, they made the estimate 5-7% short at 128 tokens)."""
    for recompute in recomputes:
        torch.manual_seed(seed)
        seq = mod.ModelConfig.from_hf(mod.tiny_config_path()).calibration_seq_len
        want = measured_saved_bytes(mod.Model(cfg, recompute=recompute), 4, seq)
        got = memory.estimate(mod, cfg, memory.Layout(micro_batch=4, seq_len=seq, bf16=False, recompute=recompute))
        assert abs(got["activations"] / want - 1) < 0.02, (recompute, got["activations"], want)


@pytest.mark.parametrize("recipe", recipe_names() + list(VARIANTS))
def test_activations_match_saved_tensors(recipe):
    """The estimate against the bytes measured, for each recompute mode (assert_activations_estimated), for every
    recipe and for the copies of tests/model_variants.py (another router's counts, another state)."""
    mod, cfg = tiny(recipe)
    assert_activations_estimated(mod, cfg, ("none", "attention", "layer"), seed=0)


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b", *VARIANTS])
def test_activations_scale_with_top_k(recipe):
    """The Qwen3 recipe and its copies with the router's num_experts_per_tok doubled (the full configs route 3-4x
    the tiny k): an MoE layer keeps [R, H] expanded rows, which the estimate scales by the slots a token fills
    (ModelConfig.slots_per_token; measured 22-30% short when it did not). variable_k: a router filling 1.5 (here 3)
    of its 2 (4) slots on average; two_streams: one slot whatever k is (a calibration that doubled k and divided
    by the change in slots divided by zero). Bound as above."""
    mod, cfg = tiny(recipe)
    cfg = dataclasses.replace(cfg, num_experts_per_tok=2 * cfg.num_experts_per_tok)
    assert_activations_estimated(mod, cfg, ("none", "layer"), seed=1)


def test_variable_slots_reach_the_estimate_and_flops():
    """A router filling 1.5 of its 2 slots per token on average (tests/model_variants.py:variable_k, declared by
    ModelConfig.slots_per_token, nothing else changed): the FLOPs count 1.5 experts per token, the all-to-all
    buffers 1.5 rows per token (3/4 of the base recipe's 2: rows of the same width), and the activations held (the
    expert rows: 1.5 per token) match the measured bytes (bound as above)."""
    mod, cfg = tiny("variable_k")
    base, base_cfg = tiny("qwen3_30b_a3b")
    assert cfg.slots_per_token == 1.5 and base_cfg.slots_per_token == 2
    for ours, full in zip(mod.flops_by_layer(cfg, 64), base.flops_by_layer(base_cfg, 64)):
        assert ours == {part: flops * (0.75 if part == "experts" else 1) for part, flops in full.items()}
    layout = memory.Layout(micro_batch=4, seq_len=128, bf16=False)
    assert memory.estimate(mod, cfg, layout)["comm_buffers"] == 0.75 * memory.estimate(base, base_cfg, layout)["comm_buffers"]
    assert_activations_estimated(mod, cfg, ("none",), seed=2)


def test_calibration_runs_at_the_length_the_model_declares(monkeypatch):
    """ModelConfig.calibration_seq_len (64 by default) is the sequence length of every calibration run: a model whose
    feature acts only on longer sequences declares more (here 96), and the saved bytes are measured at it."""
    qwen3 = recipe_module("qwen3_30b_a3b")

    class LongerConfig(qwen3.ModelConfig):
        calibration_seq_len = 96

    mod = types.ModuleType("calibrated_at_96")
    mod.__dict__.update({k: v for k, v in vars(qwen3).items() if not k.startswith("__")}, ModelConfig=LongerConfig)
    lengths, measure = [], memory.saved_bytes
    recorded = lambda model, ids_BS, *stage: lengths.append(ids_BS.shape[1]) or measure(model, ids_BS, *stage)
    monkeypatch.setattr(memory, "saved_bytes", recorded)
    memory.activation_calibration(mod, "none")
    assert lengths and set(lengths) == {96}, lengths


@pytest.mark.parametrize("recipe", recipe_names() + list(VARIANTS))
def test_layer_recompute_keeps_no_expert_rows(recipe):
    """--recompute layer on one MoE layer (and DeepSeek-V3's MTP layer): of what autograd saves while step (3) runs
    (core/moe.py:step3 says when, and which rows it was handed), it keeps no expanded rows: less than a quarter of a
    dispatched row's bytes per (row, local expert) pair (their indices and weights, 12-16 bytes; the expanded input,
    the unweighted outputs, torch's index_add source were a row or more each, kept once), and the received rows
    (one per routed token in one process) the checkpoint saves are freed when the forward ends: the backward
    dispatches them again (core/moe.py recompute_dispatch). Weights are not counted. Storages by identity: keyed by
    address, the MTP layer's rows, allocated where the first layer's freed rows were (as a caching allocator does),
    were taken for them, and one layer seemed to keep none."""
    mod, cfg = tiny(recipe)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    model = mod.Model(cfg, layers=[layer], recompute="layer")
    weights, inside = weight_storages(model), {}

    def pack(t):
        if moe.step3.inside:
            inside.update(storages_of([t], weights))
        return t

    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    moe.step3.on, moe.step3.received, moe.step3.rows = True, [], 0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.forward_train(ids, ids)
    finally:
        moe.step3.on, handed, moe.step3.received = False, moe.step3.received, []
    received = storages_of([x_QX for x_QX, _ in handed], weights)
    moe_layers = sum(getattr(m, "moe", False) is True and hasattr(m, "routed_experts") for m in model.modules())
    assert moe_layers in (1, 2) and len(received) == len(handed) == moe_layers, (moe_layers, received, handed)
    assert all(storage.nbytes() == 0 for storage in received.values()), [s.nbytes() for s in received.values()]
    kept = sum(s.nbytes() for c, s in inside.items() if c not in received)
    row_bytes = handed[0][0].shape[1] * handed[0][0].element_size()
    assert 0 < kept < moe.step3.rows * row_bytes / 4, (kept, moe.step3.rows, row_bytes)
    out.terms["lm"].backward()  # (the rows dispatched again: the recompute reads them)


def _saved_bytes_at_ep2(recompute):
    """Bytes each of 2 ep ranks keeps for backward (tiny configs, their own tokens), per recipe."""
    dist.init_process_group("gloo")
    out = {}
    for recipe in recipe_names():
        mod, cfg = tiny(recipe)
        torch.manual_seed(0)
        model = mod.Model(cfg, ep_group=dist.group.WORLD, recompute=recompute)
        torch.manual_seed(1 + dist.get_rank())
        out[recipe] = measured_saved_bytes(model, 4, 128)
    dist.destroy_process_group()
    return out


def test_activations_at_ep2_with_layer_recompute():
    """Each of 2 ep ranks against the estimate under --recompute layer, which keeps none of the rows a rank receives
    (each token of both ranks once if any of its k experts is there: 1.5 per own token at k = 2 of 8 experts on
    4 + 4): they are freed once the experts ran and the backward dispatches them again over the all-to-all, which
    one process does not run. Kept, they would be ~5% of a rank's bytes here (the head's [T, V] logits dominate),
    so 3%: measured within 0.4%. Without recompute the estimate is 4-9% short here (not from the received rows)."""
    ranks = run_ranks(2, _saved_bytes_at_ep2, "layer")
    for recipe in recipe_names():
        mod, cfg = tiny(recipe)
        got = memory.estimate(mod, cfg, memory.Layout(ep=2, micro_batch=4, seq_len=128, bf16=False,
                                                      recompute="layer"))["activations"]
        for want in (ranks[0][recipe], ranks[1][recipe]):
            assert abs(got / want - 1) < 0.03, (recipe, got, want)


def peak_held_bytes(engine, model, num_micro: int) -> int:
    """Reference: the most bytes `engine`'s DualPipeV step holds for backward at once on this rank: the storages of
    what autograd saved and still holds and of the chunks' inputs, outputs and tapes the engine keeps, each once,
    weights and all-to-all buffers in flight (the estimate's comm buffers) excluded. Sampled before every step of
    every chunk (the engine sets `running` then), so also inside each overlapped forward-backward pair."""
    weights, saved, in_flight, peak = weight_storages(model), weakref.WeakSet(), set(), [0]
    start, wait, set_running = moe._StartAllToAll.forward, moe._WaitAllToAll.forward, Running.set

    def sample(*args, **kwargs):
        held = [s.t for s in saved]
        for phase in (0, 1):
            held += [t for chunk in engine.inputs[phase] + engine.outputs[phase] if chunk for t in chunk]
            held += [t for tape in engine.tapes[phase] if tape for outs, leaves, _ in tape.segments
                     for t in outs + leaves]
        storages = storages_of(held, weights | in_flight)
        peak[0] = max(peak[0], sum(s.nbytes() for s in storages.values()))
        set_running(*args, **kwargs)

    def started(ctx, x, transfer):
        out = start(ctx, x, transfer)
        transfer.buffers = {x.untyped_storage()._cdata, out.untyped_storage()._cdata}
        in_flight.update(transfer.buffers)
        return out

    def waited(ctx, out, transfer):
        in_flight.difference_update(transfer.buffers)
        return wait(ctx, out, transfer)

    def pack(t):
        saved.add(s := Saved(t))
        return s

    with mock.patch.object(Running, "set", sample), mock.patch.object(moe._StartAllToAll, "forward", started), \
            mock.patch.object(moe._WaitAllToAll, "forward", waited), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.t):
        engine.run(num_micro)
    return peak[0]


PP_RECIPES = recipe_names() + ["two_streams"]  # (its state: two copies of the hidden state, counted as declared)


def _held_bytes_at_pp2_ep2(recompute, batch, seq):
    """Per recipe, peak_held_bytes of one DualPipeV step on each of 4 ranks, pp2 x ep2 (tiny configs, as train.py
    builds the stages; 2pp = 4 micro-batches of batch x seq tokens, each ep rank its own)."""
    mesh = build_mesh(pp=2, ep=2, dp=1)
    r, out = mesh.coord("pp"), {}
    for recipe in PP_RECIPES:
        mod, cfg = tiny(recipe)
        layers = split_layers(cfg.num_hidden_layers, 2, mod.flops_by_layer(cfg, seq))
        torch.manual_seed(0)
        model = mod.Model(cfg, layers=layers[r] + layers[3 - r], embed=r == 0, head=r == 0,
                          ep_group=mesh.group("ep"), recompute=recompute)
        engine = DualPipeV([mod.PipelineStage(model, layers[s], s == 0, s == 3) for s in (r, 3 - r)], r, 2,
                           mesh.rank - 2 if r else None, mesh.rank + 2 if r == 0 else None, mesh.group("pp"), None,
                           torch.device("cpu"))
        torch.manual_seed(1 + mesh.coord("ep"))
        ids = torch.randint(0, cfg.vocab_size, (4 * batch, seq))
        extras = model.prepare_batch(ids, ids, None, torch.arange(seq).expand_as(ids))
        model.set_positions(torch.arange(seq).expand(batch, seq))
        for stage in engine.stages:
            stage.input_ids = stage.labels = ids.split(batch)
            stage.extras = [{n: t[m * batch:(m + 1) * batch] for n, t in extras.items()} for m in range(4)]
            stage.loss_fn = lambda terms: sum(terms.values())
        out[recipe] = peak_held_bytes(engine, model, 4)
    destroy_mesh()
    return out


def test_activations_at_pp2_ep2_with_layer_recompute():
    """Each of 4 ranks (pp2 x ep2) against its pp rank's estimate under --recompute layer. DualPipeV holds at most
    2pp - r chunks (micro-batches) of stage r and r + 1 of stage 2pp-1-r: here 4 + 1 on pp rank 0 (embedding and
    2 layers, the head), 3 + 2 on pp rank 1 (2 layers each); each with its tape's state at every MoE layer's
    dispatch (the layer's recompute would not keep it) and the state it handed to the other rank, while the
    dispatched payloads and the combined rows are freed once their all-to-all has completed (core/pipeline.py).
    3%: measured within 1% (the estimate 0.3-0.9% short: per-micro-batch statistics). Kept payloads and combined
    rows would add ~90% on pp rank 1; the tape's states uncounted, 28% short there; pp + 1 micro-batches of all
    a rank's layers and head (the estimate before) 1.8-6.9x."""
    batch, seq = 4, 128
    ranks = run_ranks(4, _held_bytes_at_pp2_ep2, "layer", batch, seq)
    for recipe in PP_RECIPES:
        mod, cfg = tiny(recipe)
        layout = memory.Layout(pp=2, ep=2, micro_batch=batch, seq_len=seq, bf16=False, recompute="layer")
        for rank, held in enumerate(ranks):
            got = memory.estimate(mod, cfg, layout, pp_rank=rank // 2)["activations"]
            assert abs(got / held[recipe] - 1) < 0.03, (recipe, rank, got, held[recipe])


def test_activations_scale_with_width():
    """A config of another width (conftest's: hidden 64 instead of the tiny 128, 4 experts instead of 8, its expert
    width a quarter) estimated from the tiny calibration scaled by the hidden size. 15%: the expert and attention
    widths do not scale exactly with the hidden size (the error seen is 8%); for the full configs this scaling is
    the estimate's main approximation."""
    mod = recipe_module("qwen3_30b_a3b")
    cfg = mod.ModelConfig(**{k: v for k, v in TINY_TRAIN_CONFIG.items() if k != "model_type"})
    torch.manual_seed(0)
    want = measured_saved_bytes(mod.Model(cfg), 2, 64)
    got = memory.estimate(mod, cfg, memory.Layout(micro_batch=2, seq_len=64, bf16=False))["activations"]
    assert abs(got / want - 1) < 0.15, (got, want)


def test_refusal_names_layouts_that_fit():
    """A budget between the estimate with and without recompute: one line, naming layouts the estimator says fit."""
    mod, cfg = tiny("qwen3_30b_a3b")
    layout = memory.Layout(dp=2, micro_batch=8, seq_len=2048, bf16=True)
    full = memory.estimate(mod, cfg, layout)["total"]
    lean = memory.estimate(mod, cfg, memory.Layout(dp=2, micro_batch=8, seq_len=2048, recompute="layer"))["total"]
    assert lean < full
    gib = (lean + full) / 2 / memory.GIB
    with pytest.raises(ValueError) as e:
        memory.check_fits(mod, cfg, layout, gib, reserve_gib=0)
    msg = str(e.value)
    assert "\n" not in msg and "layouts that fit: --pp" in msg
    for text in msg.split("layouts that fit: ")[1].split(" (python")[0].split("; "):
        f = text.split()
        cand = memory.Layout(int(f[1]), int(f[3]), int(f[5]), int(f[7]), int(f[9]), 2048, True, False, f[11])
        assert cand.pp * cand.dp * cand.cp * cand.ep == 2 and memory.fits(memory.estimate(mod, cfg, cand), gib, 0)
    memory.check_fits(mod, cfg, layout, full / memory.GIB + 0.01, reserve_gib=0)  # fits: no error


@pytest.mark.parametrize("recipe", recipe_names())
def test_skill_script(recipe, capsys, monkeypatch):
    script = "skills/estimate-memory/scripts/estimate_memory.py"
    monkeypatch.setattr(sys, "argv", [script, recipe, "--pp", "2", "--ep", "2", "--seq-len", "64", "--gpu-gib", "80"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(script, run_name="__main__")
    out = capsys.readouterr().out
    assert e.value.code == 0 and "FITS in 80 GiB" in out and "pp rank" in out, out
    rows = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()[2:9]}
    assert abs(sum(v for k, v in rows.items() if k != "total") - rows["total"]) < 0.06
    monkeypatch.setattr(sys, "argv", [script, recipe, "--seq-len", "64", "--micro-batch", "64", "--gpu-gib", "4.1",
                                      "--reserve-gib", "4", "--dp", "2"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(script, run_name="__main__")
    out = capsys.readouterr().out
    assert e.value.code == 1 and "DOES NOT FIT" in out and "fits: --pp" in out, out


@pytest.mark.parametrize("recipe", recipe_names())
def test_train_refuses_before_allocating(recipe, monkeypatch):
    """train.py on a (pretended) GPU with half the estimate beyond the 4 GiB reserve stops with the one-line error
    before the mesh; on CPU it checks nothing."""
    import importlib
    train = importlib.import_module(f"recipes.{recipe}.train")
    mod, cfg = tiny(recipe)
    need = memory.estimate(mod, cfg, memory.Layout(micro_batch=64, seq_len=64))["total"]  # (train.py's: bf16 on GPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 4 * memory.GIB + need / 2}))
    argv = ["--seq-len", "64", "--micro-batch", "64", "--global-batch", "64", "--data", "/nonexistent"]
    with pytest.raises(ValueError, match="exceeds 4 GiB - 4 GiB reserve for .* layouts that fit: --pp 1"):
        train.main(argv)
    with pytest.raises(FileNotFoundError, match="/nonexistent"):  # --device cpu: no memory check; the data check next
        train.main(argv + ["--device", "cpu"])
