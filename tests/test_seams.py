"""The seams a new architecture uses instead of editing train.py or core (on the Qwen3 recipe): the post-step call
(Model.after_step with the step's global statistics, the optimizer and the run's folder), statistics gathered over
the ranks (core/metrics.py:reduce_stats "gather"), which micro-batch is running (core/pipeline.py:running, here in
train.py's pp=1 loop; DualPipeV's is tests/test_pipeline.py:test_running_names_the_chunk), the load max/mean and
the collapse warning over the experts a router can choose, and flags for optional features a model lacks.

The routing-decisions artifact is written by test-only code on the recipe's classes (a router that switches 5 of
its 8 experts off, its take_stats and after_step), patched into each spawned rank: each step's expert ids and
weights of every token, gathered over the pp and ep ranks, must equal one process's, token by token."""

import contextlib
import io
import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.context import on_whole_sequence, split_for_cp
from core.metrics import load_max_over_mean, reduce_stats
from core.pipeline import running
from core.reliability import collapse_warning
from core.training import LossTerm
from recipes.qwen3_30b_a3b import model as qwen3
from recipes.qwen3_30b_a3b import train
from tests.conftest import TINY_TRAIN_CONFIG
from tests.multiproc import run_ranks
from tests.recipe_checks import Recipe, check_args, model_grads_worker, write_counting_data
from tests.test_train import assert_matches_single, noise_bound, run_train, train_args

# ---------------------------------------------------------------------------- statistics gathered over ranks


def gather_worker():
    """Rank r hands 2r rows (rank 0 none) of [r, 10 * r + row] int64, and one float row; the sum stays a sum."""
    dist.init_process_group("gloo")
    r = dist.get_rank()
    rows = torch.tensor([[r, 10 * r + i] for i in range(2 * r)], dtype=torch.int64).view(2 * r, 2)
    out = reduce_stats({"rows": (rows, "gather"), "mine": (torch.full((1, 3), float(r)), "gather"),
                        "count": (torch.ones(2), "sum")}, dist.group.WORLD)
    dist.destroy_process_group()
    return out


def test_reduce_stats_gathers_in_rank_order():
    """Concatenated along dim 0 in rank order, uneven sizes (a rank with no rows) and the dtype kept; alone: as
    given; a 0-dim tensor or an unknown reduction is a one-line error."""
    for out in run_ranks(2, gather_worker):
        assert out["rows"].dtype == torch.int64
        assert out["rows"].tolist() == [[1, 10], [1, 11]]
        assert out["mine"].tolist() == [[0.0] * 3, [1.0] * 3]
        assert out["count"].tolist() == [2.0, 2.0]
    assert reduce_stats({"x": (torch.arange(3), "gather")}, None)["x"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="at least one dim"):
        reduce_stats({"x": (torch.tensor(1.0), "gather")}, None)
    with pytest.raises(ValueError, match="not one of sum, max, gather"):
        reduce_stats({"x": (torch.ones(1), "mean")}, None)


# ------------------------------------------------------------------------------- load over the live experts


def test_load_over_live_experts():
    """Worked by hand: loads [6, 2, 0, 0] with experts 2 and 3 switched off read 6 / 4 = 1.5, not 6 / 2 = 3 over
    all four, so only the second form warns of a collapse; a layer with no load reads 0."""
    load_LE = torch.tensor([[6.0, 2, 0, 0], [0, 0, 0, 0]])
    live_LE = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    assert load_max_over_mean(load_LE) == [3.0, 0.0]
    assert load_max_over_mean(load_LE, live_LE) == [1.5, 0.0]
    assert "layer 1 3.00x" in collapse_warning(25, load_LE, [1, 3])
    assert collapse_warning(25, load_LE, [1, 3], live_LE.bool()) == ""
    assert load_max_over_mean(torch.zeros(0, 4)) == []


# ---------------------------------------------------------------------- features a model does not support


@pytest.mark.parametrize("flag,feature", [(["--expert-bias-rate", "0.01"], "expert_bias"),
                                          (["--aux-loss-coef", "0.1"], "aux_loss"),
                                          (["--recompute", "layer"], "recompute"), (["--fp8"], "fp8"),
                                          (["--optimizer", "muon"], "muon")])
def test_unsupported_feature_flag_fails_in_check_run(tiny_train_setup, tmp_path, monkeypatch, flag, feature):
    """--dry-run (launch.sh runs it before torchrun starts a rank) refuses the flag in one line naming the feature,
    also where the features depend on the config; the shared layout checks leave out the flag and the checks of a
    feature the model declines."""
    config, data = tiny_train_setup
    argv = train_args(config, data, tmp_path / "out", dry_run=True) + flag
    assert train.main(argv) == ([], None)  # supported
    # a feature that depends on the config (Model.features a property): declined for this config's 4 experts
    every = qwen3.Model.features
    monkeypatch.setattr(qwen3.Model, "features", property(
        lambda self: every - ({feature} if self.cfg.num_experts == 4 else set())))
    with pytest.raises(ValueError, match=f"needs the model feature '{feature}'.*drop the flag") as e:
        train.main(argv)
    assert "\n" not in str(e.value)
    recipe = Recipe("qwen3_30b_a3b", qwen3, train, None, None, TINY_TRAIN_CONFIG, 32, None)
    assert ("--expert-bias-rate" in check_args(recipe, config, data, tmp_path)) == (feature != "expert_bias")


# ------------------------------------------------------------- post-step seam: per-step routing decisions

OFF = [3, 5, 6, 7, 1]  # experts the test router never chooses: 3 live of 8, top-2
SEAM_CONFIG = {**TINY_TRAIN_CONFIG, "num_experts": 8}
REINIT = 0.5  # after the last step, routed expert 0 of layer 0 is re-initialised to this (through the optimizer)
TAKE_STATS, AFTER_STEP, ROUTE = qwen3.Model.take_stats, qwen3.Model.after_step, qwen3.MoE.route


def router_forward(self, x_TH):
    """recipes/qwen3_30b_a3b/model.py:Router.forward with the OFF experts never chosen."""
    probs_TE = F.linear(x_TH, self.weight).softmax(dim=-1, dtype=torch.float32)
    scores_TE = (probs_TE + self.expert_bias).index_fill(1, torch.tensor(OFF), float("-inf"))
    ids_Tk = scores_TE.topk(self.k, dim=-1).indices
    weights_Tk = probs_TE.gather(1, ids_Tk)
    return probs_TE.log(), (weights_Tk / weights_Tk.sum(-1, keepdim=True)).to(x_TH.dtype), ids_Tk


def route(self, x_TH, aux_2E):
    """MoE.route, keeping (micro-batch running, ids, weights) of each call."""
    weights_Tk, ids_Tk, aux_2E = ROUTE(self, x_TH, aux_2E)
    self.__dict__.setdefault("decisions", []).append((running.micro_batch, ids_Tk, weights_Tk.detach()))
    return weights_Tk, ids_Tk, aux_2E


def take_stats(self):
    """Model.take_stats plus the live experts ("max") and this rank's routing decisions since the last call, one
    row per (token, MoE layer) ("gather"): keys (global rank, micro-batch, layer, token), ids, weights."""
    stats = TAKE_STATS(self)
    moe_ids = [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)]
    live_LE = torch.zeros(len(moe_ids), self.cfg.num_choices)
    keys, ids, weights = [torch.zeros(0, 4, dtype=torch.int64)], [torch.zeros(0, 2, dtype=torch.int64)], [torch.zeros(0, 2)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    for row, i in enumerate(moe_ids):
        if str(i) not in self.layers:
            continue
        live_LE[row] = 1
        live_LE[row, OFF] = 0
        for mb, ids_Tk, weights_Tk in self.layers[str(i)].mlp.__dict__.pop("decisions", []):
            T = ids_Tk.shape[0]
            keys.append(torch.stack([torch.full((T,), rank), torch.full((T,), mb), torch.full((T,), i), torch.arange(T)], 1))
            ids.append(ids_Tk)
            weights.append(weights_Tk.float())
    return {**stats, "expert_live": (live_LE, "max"), "routing_keys": (torch.cat(keys), "gather"),
            "routing_ids": (torch.cat(ids), "gather"), "routing_weights": (torch.cat(weights), "gather")}


def after_step(self, done):
    """Model.after_step (the expert bias), then rank 0 writes the step's routing decisions of every rank to
    <out>/routing/step_N.pt; after the last step, routed expert 0 of layer 0 gets REINIT (optimizer.reinit_)."""
    AFTER_STEP(self, done)
    if done.mesh.is_main:
        (done.out / "routing").mkdir(exist_ok=True)
        torch.save({name: done.stats[f"routing_{name}"] for name in ("keys", "ids", "weights")},
                   done.out / "routing" / f"step_{done.step}.pt")
    if done.step == done.args.steps and "0" in self.layers:
        experts = self.layers["0"].mlp.experts
        if 0 in experts.expert_ids:
            j = experts.expert_ids.index(0)
            done.optimizer.reinit_("layers.0.mlp.experts.gate_up_proj", j, torch.full_like(experts.gate_up_proj[j], REINIT))


def patch_model():
    qwen3.Router.forward, qwen3.MoE.route = router_forward, route
    qwen3.Model.take_stats, qwen3.Model.after_step = take_stats, after_step


def train_with_routing_artifact(argv):
    """In a spawned rank: the patched model trains; its stdout comes back too."""
    patch_model()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = run_train(argv)
    return result, out.getvalue()


def decisions(out, steps, local_rows, micro_batch, seq_len, data_rank):
    """{step: {(sequence of the global batch, position, layer): (ids, weights)}} from <out>/routing; the keys'
    global ranks must come in rank order (reduce_stats' "gather")."""
    found = {}
    for step in range(1, steps + 1):
        rows = torch.load(out / "routing" / f"step_{step}.pt", weights_only=True)
        ranks = rows["keys"][:, 0]
        assert (ranks[1:] >= ranks[:-1]).all(), "gathered out of rank order"
        table = {}
        for (rank, mb, layer, t), ids, weights in zip(rows["keys"].tolist(), rows["ids"], rows["weights"]):
            b, s = divmod(t, seq_len)
            key = (data_rank(rank) * local_rows + mb * micro_batch + b, s, layer)
            assert key not in table, key
            table[key] = (ids, weights)
        found[step] = table
    return found


def test_post_step_seam_writes_routing_decisions(tmp_path, monkeypatch, capsys):
    """pp2 x ep2 (4 ranks: pp rank 0 holds no layer, so its ranks gather 0 rows) against one process, 3 steps:
    every token's routing decisions per step are the same (ids exactly, weights to 1e-5 relative, the layouts'
    bound of tests/test_train.py), the logged load max/mean is the one recomputed from those ids over the 3 live
    experts (never above 1.5 = 3 live / top-2, while over all 8 it is >= 8/3, which would warn of a collapse), no
    collapse warning, the expert re-initialised through the optimizer holds REINIT on every rank that holds it,
    and losses, grad norms and weights equal one process's."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SEAM_CONFIG))
    data = write_counting_data(tmp_path / "data")
    steps, seq_len = 3, 32
    args = lambda out, **extra: train_args(config, data, tmp_path / out, steps=steps, micro_batch=1, adam_eps=1e-6,
                                           expert_bias_rate=0.01, **extra)
    for name, fn in (("forward", router_forward), ("route", route), ("take_stats", take_stats),
                     ("after_step", after_step)):
        monkeypatch.setattr(qwen3.Router if name == "forward" else qwen3.MoE if name == "route" else qwen3.Model, name, fn)
    single = run_train(args("single"))
    single_log = capsys.readouterr().out
    results = run_ranks(4, train_with_routing_artifact, args("pp2ep2", pp=2, ep=2))
    assert_matches_single(single, [r for r, _ in results])

    ref = decisions(tmp_path / "single", steps, 8, 1, seq_len, lambda rank: 0)
    got = decisions(tmp_path / "pp2ep2", steps, 4, 1, seq_len, lambda rank: rank % 2)  # data rank = ep rank here
    records = [json.loads(line) for line in (tmp_path / "pp2ep2" / "metrics.jsonl").read_text().splitlines()]
    for step in range(1, steps + 1):
        assert len(ref[step]) == 8 * seq_len * SEAM_CONFIG["num_hidden_layers"] and got[step].keys() == ref[step].keys()
        for key, (ids, weights) in ref[step].items():
            assert torch.equal(got[step][key][0], ids), (step, key)
            assert torch.allclose(got[step][key][1], weights, rtol=1e-5, atol=0), (step, key)
        ids_LX = torch.stack([torch.stack([ref[step][(q, s, i)][0] for q in range(8) for s in range(seq_len)])
                              for i in range(SEAM_CONFIG["num_hidden_layers"])]).flatten(1)
        load_LE = torch.stack([torch.bincount(ids_X, minlength=8) for ids_X in ids_LX]).float()
        live = [e for e in range(8) if e not in OFF]
        assert load_LE[:, OFF].sum() == 0
        expected = (load_LE[:, live].max(-1).values / load_LE[:, live].mean(-1)).tolist()
        assert records[step - 1]["expert_load_max_over_mean"] == pytest.approx(expected, rel=1e-6)
        assert min(load_LE.max(-1).values / load_LE.mean(-1)) >= 8 / 3  # over all 8 a collapse
    for log in [single_log] + [out for _, out in results]:
        assert "routing is collapsing" not in log
    holders = [weights["layers.0.mlp.experts.gate_up_proj[0]"] for _, _, weights in [single] + [r for r, _ in results[2:3]]]
    assert all(torch.equal(w, torch.full_like(w, REINIT)) for w in holders)


# ------------------------------------------------------------------------------------------ a variant's export


def test_variant_export_names_the_variant(tmp_path, monkeypatch, capsys):
    """A recipe that departs from transformers (TRANSFORMERS_CLASS None; here DeepSeek-V2-Lite's, patched) exports
    a config.json whose model_type names the recipe: transformers' Auto classes refuse it (instead of loading a
    DeepSeek-V2 and dropping the variant's tensors), the recipe reads it back, another recipe's refusal says how to
    load it, and tools.evaluate --hf picks the variant's recipe by itself."""
    import transformers

    from recipes.deepseek_v2_lite import model as deepseek
    from tools import evaluate

    monkeypatch.setattr(deepseek, "TRANSFORMERS_CLASS", None)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**deepseek.check_setup()["config"], "num_hidden_layers": 2}))
    cfg = deepseek.ModelConfig.from_hf(config)
    torch.manual_seed(0)
    deepseek.save_hf_checkpoint(deepseek.Model(cfg), tmp_path / "variant")
    hf = json.loads((tmp_path / "variant" / "config.json").read_text())
    assert (hf["model_type"], hf["base_model_type"], hf["architectures"]) == ("deepseek_v2_lite", "deepseek_v2", [])
    assert "python -m tools.evaluate --hf FOLDER --recipe deepseek_v2_lite" in hf["how_to_load"]
    with pytest.raises(ValueError, match="deepseek_v2_lite"):
        transformers.AutoConfig.from_pretrained(tmp_path / "variant")
    assert deepseek.ModelConfig.from_hf(tmp_path / "variant") == cfg
    with pytest.raises(ValueError, match="--recipe deepseek_v2_lite"):
        qwen3.ModelConfig.from_hf(tmp_path / "variant")
    data = write_counting_data(tmp_path / "data")
    val = evaluate.main(["--hf", str(tmp_path / "variant"), "--data", str(data), "--seq-len", "32", "--global-batch",
                         "8", "--micro-batch", "2", "--eval-batches", "1", "--out", str(tmp_path / "eval")])
    assert "export of the variant recipe deepseek_v2_lite" in capsys.readouterr().out
    assert 0 < val["val_loss"] < 10  # ln(256) = 5.5 for random weights


# ------------------------------------------------ extensions through the seams, train.py and core untouched
# Test-only code on the Qwen3 recipe's classes (patched here and in each spawned rank), each through one seam:
#   loss term with its own targets: "ahead", the cross-entropy of the token two ahead, its targets and their 0/1
#       mask made by Model.prepare_batch on whole sequences (under cp a target sits in another rank's chunk);
#   parameter-only regulariser: "l2", the squared norm of every router and routed expert weight (per None), summed
#       layer by layer into an extra state entry that Model.initial_state creates: through pp2 it crosses ranks;
#   extra per-token input made on whole sequences: the previous token's embedding added to each token's;
#   whole-sequence routing decision: each expert keeps the CAPACITY highest-scoring of the tokens that chose it in
#       the whole sequence (core.context.on_whole_sequence under cp), the others' slots are dropped;
#   a statistic logged by name: "dropped_slots".


CAPACITY = 12  # kept slots per expert and sequence: 32 tokens x top-2 over 4 experts make 16 on average
AHEAD_WEIGHT, L2_WEIGHT = 0.5, 1e-3
EXT = {name: getattr(cls, name) for cls, names in ((qwen3.Model, ("loss_terms", "prepare_batch", "initial_state",
                                                                    "loss_sums", "set_positions", "take_stats")),
                                                   (qwen3.Router, ("forward",)), (qwen3.DecoderLayer, ("attention",)))
       for name in names}


def previous_tokens(ids_BS):
    """The token before each (0 before the first) of whole sequences."""
    return torch.cat([torch.zeros_like(ids_BS[:, :1]), ids_BS[:, :-1]], 1)


def ext_loss_terms(self, args):
    return {**EXT["loss_terms"](self, args), "ahead": LossTerm(AHEAD_WEIGHT, "ahead_valid"), "l2": LossTerm(L2_WEIGHT, None)}


def ext_prepare_batch(self, input_ids_BS, labels_BS, doc_ids_BS, positions_BS):
    valid_BS = torch.ones_like(input_ids_BS, dtype=torch.float32)
    valid_BS[:, -2:] = 0  # the last two tokens have no token two ahead in the sequence
    ahead_BS = torch.where(valid_BS.bool(), torch.roll(input_ids_BS, -2, 1), -100)
    return {"ahead_ids": ahead_BS, "ahead_valid": valid_BS, "prev_ids": previous_tokens(input_ids_BS)}


def ext_initial_state(self, input_ids_BS, extras):
    """+ the previous token's embedding (whole sequences without extras: sampling, logits), + the l2 entry [1]."""
    x_BSH, aux_2E = EXT["initial_state"](self, input_ids_BS, extras)
    prev_BS = extras["prev_ids"] if "prev_ids" in extras else previous_tokens(input_ids_BS)
    return [x_BSH + 0.5 * self.embed(prev_BS), aux_2E, torch.zeros(1, device=x_BSH.device)]


def ext_attention(self, state):
    """Step (1), + this layer's router and routed-expert squared norms into the l2 entry; the experts' part counted
    ep times (core/training.py:LossTerm: the ep ranks hold 1/ep of them each)."""
    state, x_TH, ids_Tk, weights_Tk = EXT["attention"](self, state)
    ep = 1 if self.ep_group is None else dist.get_world_size(self.ep_group)
    l2 = self.mlp.gate.weight.pow(2).sum() + ep * self.mlp.experts.gate_up_proj.pow(2).sum()
    return [state[0], state[1], state[2] + l2], x_TH, ids_Tk, weights_Tk


def ext_loss_sums(self, state, labels_BS, extras):
    return {**EXT["loss_sums"](self, state, labels_BS, extras),
            "ahead": self.cross_entropy_sum(state[0], extras["ahead_ids"]), "l2": state[2].sum()}


def ext_set_positions(self, position_ids_BS, cp_split=True, doc_ids_BK=None):
    """+ tell each router its sequences: (the cp group they are split over, None for whole ones; tokens per row)."""
    EXT["set_positions"](self, position_ids_BS, cp_split, doc_ids_BK)
    S = (position_ids_BS[0] if isinstance(position_ids_BS, list) else position_ids_BS).shape[1]
    for layer in self.layers.values():
        layer.mlp.gate.sequences = (self.cp_group if cp_split else None, S)


def keep_top_capacity(score_BSE):
    """Whole sequences: True for the CAPACITY highest finite scores of each (sequence, expert)."""
    top_BCE = score_BSE.topk(CAPACITY, dim=1).indices
    return torch.zeros_like(score_BSE, dtype=torch.bool).scatter(1, top_BCE, True) & score_BSE.isfinite()


def capacity_router(self, x_TH):
    """Router.forward, then the capacity rule over whole sequences: a dropped slot gets id -1 and weight 0."""
    logits_TE, weights_Tk, ids_Tk = EXT["forward"](self, x_TH)
    cp_group, S = self.sequences
    E = logits_TE.shape[1]
    chosen_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, ids_Tk, True)
    score_TE = logits_TE.softmax(-1, dtype=torch.float32).masked_fill(~chosen_TE, float("-inf"))
    keep_TE = on_whole_sequence(keep_top_capacity, score_TE.view(-1, S, E), cp_group).reshape(-1, E)
    kept_Tk = keep_TE.gather(1, ids_Tk)
    self.dropped = getattr(self, "dropped", 0) + (~kept_Tk).sum()
    return logits_TE, weights_Tk * kept_Tk, torch.where(kept_Tk, ids_Tk, -1)


def ext_take_stats(self):
    dropped = sum(layer.mlp.gate.__dict__.pop("dropped", 0) for layer in self.layers.values())
    return {**EXT["take_stats"](self), "dropped_slots": (torch.as_tensor(dropped, dtype=torch.float32), "sum")}


EXTENSION = {(qwen3.Model, "loss_terms"): ext_loss_terms, (qwen3.Model, "prepare_batch"): ext_prepare_batch,
             (qwen3.Model, "initial_state"): ext_initial_state, (qwen3.Model, "loss_sums"): ext_loss_sums,
             (qwen3.Model, "set_positions"): ext_set_positions, (qwen3.Model, "take_stats"): ext_take_stats,
             (qwen3.Router, "forward"): capacity_router, (qwen3.DecoderLayer, "attention"): ext_attention}


def extension_worker(jobs: dict) -> dict:
    """In a spawned rank: the extension patched in, then every job in one process group: ("train", argv) ->
    (losses, grad norms, weights) of train.py, ("grads", args) -> model_grads_worker's errors (the shared checks'
    model-level path: prepare_batch, the cp split of the extras, forward_train, the terms' objective), ("whole",
    None) -> on_whole_sequence against the whole-sequence computation, values and gradients."""
    for (cls, name), fn in EXTENSION.items():
        setattr(cls, name, fn)
    dist.init_process_group("gloo")
    train.destroy_mesh = lambda: None  # one process group for every job (tests/recipe_checks.py:layouts_worker)
    results = {}
    for name, (kind, arg) in jobs.items():
        if kind == "train":
            with contextlib.redirect_stdout(io.StringIO()):
                results[name] = run_train(arg)
        elif kind == "grads":
            results[name] = model_grads_worker(*arg, recipe="qwen3_30b_a3b")
        else:
            results[name] = whole_sequence_check()
    dist.barrier()
    dist.destroy_process_group()
    return results


def whole_sequence_check():
    """cp2 over WORLD: a function coupling all tokens of a sequence (softmax over it, running sum) through
    on_whole_sequence equals it on the whole sequence, and so do the gradients of a weighted sum of its output."""
    rank, gen = dist.get_rank(), torch.Generator().manual_seed(0)
    x_BSd, w_BSd = torch.randn(2, 8, 3, generator=gen, dtype=torch.float64), torch.randn(2, 8, 3, generator=gen, dtype=torch.float64)
    couple = lambda t: t.softmax(dim=1) * t.cumsum(1)
    whole = x_BSd.clone().requires_grad_()
    (couple(whole) * w_BSd).sum().backward()
    mine = split_for_cp(x_BSd, rank, 2).requires_grad_()
    out = on_whole_sequence(couple, mine, dist.group.WORLD)
    (out * split_for_cp(w_BSd, rank, 2)).sum().backward()
    return (out - split_for_cp(couple(x_BSd), rank, 2)).abs().max().item(), \
        (mine.grad - split_for_cp(whole.grad, rank, 2)).abs().max().item()


def step_records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_extensions_through_the_seams(tiny_train_setup, tmp_path, monkeypatch, capsys):
    """The extension (above) trains through train.py at pp2, cp2 and ep2 (one spawn of 2 ranks) equal to one
    process: losses (their sum of all four terms), grad norms, every weight (LAYOUT_TOLERANCE), the dropped slots
    exactly; every layout logs the first step's "ahead" and "l2" terms equal to a plain PyTorch computation from the
    initial weights and the first batch; the one process logs each term and the statistic by name in the log line,
    metrics.jsonl and TensorBoard; the model-level cp2 check of the shared checks passes with the extension; the
    whole-sequence helper equals the whole computation; --loss-weight with an unknown term fails in one line."""
    config, data = tiny_train_setup
    for (cls, name), fn in EXTENSION.items():
        monkeypatch.setattr(cls, name, fn)
    args = lambda out, **extra: train_args(config, data, tmp_path / out, steps=3, adam_eps=1e-6, **extra)
    single = run_train(args("single"))
    log = capsys.readouterr().out
    # the l2 term reads the experts' weights in the attention step, outside the experts' own FSDP2 unit: their units
    # gathered for the whole step (core/training.py:LossTerm)
    layouts = {"pp2": {"pp": 2}, "cp2": {"cp": 2, "fsdp_gather": "step"}, "ep2": {"ep": 2, "fsdp_gather": "step"}}
    jobs = {name: ("train", args(name, **layout)) for name, layout in layouts.items()}
    jobs |= {"grads cp2": ("grads", (config, 2, 1, 32)), "whole": ("whole", None)}
    per_rank = run_ranks(2, extension_worker, jobs)

    for name in layouts:
        assert_matches_single(single, [rank[name] for rank in per_rank])
    for rank in per_rank:
        # model level, through the shared checks' path: each quantity within its own rounding noise
        assert all(e <= noise_bound(noise) for e, noise in rank["grads cp2"].values()), rank["grads cp2"]
        assert max(rank["whole"]) < 1e-12  # float64, the same operations on the same numbers

    # the first step's terms from the initial weights (the same seed builds them) and the first batch, by hand
    cfg = qwen3.load_config(config)
    torch.manual_seed(0)
    model = qwen3.Model(cfg)
    l2 = sum(model.layers[i].mlp.gate.weight.pow(2).sum() + model.layers[i].mlp.experts.gate_up_proj.pow(2).sum()
             for i in model.layers)
    ids_BS = train.TokenLoader(str(data), 32, 8, 0, 1, 0).next_batch()[0]
    with torch.no_grad():
        logits_BSV = model(ids_BS)
    ahead = F.cross_entropy(logits_BSV[:, :-2].flatten(0, 1), ids_BS[:, 2:].flatten(), reduction="mean")
    records = {name: step_records(tmp_path / name) for name in ["single", *layouts]}
    for name, steps in records.items():
        # fp32 sums of 8 x 30 cross-entropies / of 2 x (4 x 64 + 4 x 64 x 64) squares in another order: ~1e-7
        assert steps[0]["ahead_loss"] == pytest.approx(ahead.item(), rel=1e-5), name
        assert steps[0]["l2_loss"] == pytest.approx(l2.item(), rel=1e-5), name
        assert [s["dropped_slots"] for s in steps] == [s["dropped_slots"] for s in records["single"]], name
    assert all(s["dropped_slots"] > 0 for s in records["single"])  # the capacity rule drops slots

    # logged by name: the log line, metrics.jsonl (above) and TensorBoard
    assert re.search(r"step +1/3 \| loss [0-9.]+ \| aux [0-9.]+ \| ahead [0-9.]+ \| l2 [0-9.]+ \|", log), log
    assert "dropped_slots" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "single" / "tensorboard")).Reload()
    assert {"train/ahead_loss", "train/l2_loss", "train/aux_loss", "train/dropped_slots"} <= set(events.Tags()["scalars"])

    with pytest.raises(ValueError, match=r"--loss-weight nope=1: .*one of the model's loss terms \(lm, aux, ahead, l2\)"):
        train.main(args("bad", dry_run=True, loss_weight="ahead=1,nope=1"))
