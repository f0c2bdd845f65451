"""Routing traces (train.py --routing-trace, core/routing.py) against one process in every layout, a variable-k
router's empty slots, the per-layer routing statistics, the trace reader (tools/routing.py) and --wandb
(core/metrics.py:WandbWriter) in wandb's offline mode."""

import json
import struct
import sys

import numpy as np
import pytest
import torch

from recipes import recipe_names
from recipes.qwen3_30b_a3b import model as qwen3
from recipes.qwen3_30b_a3b import train
from tests.model_variants import variable_k
from tests.multiproc import one_thread, start_ranks
from tests.recipe_checks import layouts_worker, load_recipe, write_counting_chats, write_counting_data
from tests.test_train import train_args
from tools import routing as routing_tool

# A layout's routing weights against one process's: the router's input differs only by the rounding of sums taken
# in another order (cp: attention over gathered keys in other blocks; a stage boundary or FSDP2's reduce-scatter:
# gradients summed in another order, so after one AdamW step weights differ by ~1e-7 relative, ~3e-6 after 3,
# tests/test_train.py), a few fp32 ulps (6e-8 each) per operation through 2 layers; a weight is a softmax
# probability in [0, 1] renormalised over the kept slots, so its absolute error is about its logits': measured
# 6.9e-7 at worst over every layout and step here. 1e-5 leaves ~15x; a token taken from another row, position or
# cp chunk moves a weight by ~0.01 to 0.3 (another token's routing) and mostly changes its ids too.
WEIGHT_TOL = 1e-5
STEPS = 2
LAYOUTS = {2: {"ep2": {"ep": 2}, "pp2": {"pp": 2}, "dp2": {"dp": 2}, "cp2 docs": {"cp": 2}},
           4: {"pp2xep2": {"pp": 2, "ep": 2}, "cp2xep2 docs": {"cp": 2, "ep": 2}}}


def trace_args(config, data, out, **extra) -> list[str]:
    """STEPS steps of 8 micro-batches of one sequence of 32 tokens (pp2 at dp1 needs >= 4), every step traced."""
    return train_args(config, data, out, **{"steps": STEPS, "micro_batch": 1, "routing_trace": 1, **extra})


def traces(out) -> list[dict]:
    return [dict(np.load(out / "routing_trace" / f"step_{s:08d}.npz")) for s in range(1, STEPS + 1)]


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trace_equals_one_process_in_every_layout(tiny_train_setup, tmp_path):
    """ep2, pp2, dp2, cp2 with documents on 2 ranks, pp2xep2 and cp2xep2 with documents on 4, each group one process
    group running its layouts in turn, against one process on the same data: every step's file holds every token of
    the global batch once with the same batch row, position, rope position and token id, the same expert ids and the
    weights within WEIGHT_TOL; the logged routing statistics agree (summed over the ranks)."""
    config, data = tiny_train_setup
    chats = write_counting_chats(tmp_path / "chats", 32)
    jobs = {world: {name: ("train", trace_args(config, chats if "docs" in name else data, tmp_path / name.replace(
        " ", "_"), **layout)) for name, layout in layouts.items()} for world, layouts in LAYOUTS.items()}
    groups = [start_ranks(world, layouts_worker, "qwen3_30b_a3b", world_jobs) for world, world_jobs in jobs.items()]
    with one_thread():  # (as the ranks run)
        for name, source in (("single", data), ("single_docs", chats)):
            train.main(trace_args(config, source, tmp_path / name))
    for group in groups:
        group.join()
    worst = 0.0
    for name in [name for layouts in LAYOUTS.values() for name in layouts]:
        ref = tmp_path / ("single_docs" if "docs" in name else "single")
        for step, (got, want) in enumerate(zip(traces(tmp_path / name.replace(" ", "_")), traces(ref)), 1):
            assert got.keys() == want.keys() and got["expert_ids"].shape == (2, 8 * 32, 2), (name, step)
            for key in ("row", "position", "doc_position", "token_ids", "layer", "step", "expert_ids"):
                assert np.array_equal(got[key], want[key]), (name, step, key)
            worst = max(worst, float(np.abs(got["weights"] - want["weights"]).max()))
            assert worst <= WEIGHT_TOL, (name, step, worst)
        for got, want in zip(records(tmp_path / name.replace(" ", "_")), records(ref)):
            assert got["dead_experts"] == want["dead_experts"], name
            np.testing.assert_allclose(got["router_entropy"], want["router_entropy"], rtol=1e-5, err_msg=name)
    print(f"worst routing weight difference from one process: {worst:.2e} (bound {WEIGHT_TOL})")


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_is_traced_with_no_edit(recipe, tmp_path, monkeypatch):
    """Each recipe's check config, one process: a traced step holds, per MoE layer, the ids and weights that its
    step (1) (the layer protocol's `attention`) returned, token by token; the router's entropy is logged."""
    r = load_recipe(recipe)
    steps = []  # (layer, ids [T, k], weights [T, k]) per step (1) call
    attention = r.model.DecoderLayer.attention

    def step1(self, state):
        out = attention(self, state)
        steps.append((self, out[2].detach(), out[3].detach().float()))
        return out

    monkeypatch.setattr(r.model.DecoderLayer, "attention", step1)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(r.config))
    _, model = r.train.main(trace_args(config, write_counting_data(tmp_path / "data"), tmp_path / "out", steps=1,
                                       seq_len=r.seq_len))
    z = dict(np.load(tmp_path / "out" / "routing_trace" / "step_00000001.npz"))
    moe = [int(i) for i in z["layer"]]
    assert moe and moe == [i for i in range(r.config["num_hidden_layers"]) if model.layers[str(i)].moe]
    for row, i in enumerate(moe):  # one process: micro-batches in order are the global batch's rows
        ids_Nk, weights_Nk = (torch.cat(x) for x in zip(*[c[1:] for c in steps if c[0] is model.layers[str(i)]]))
        assert np.array_equal(z["expert_ids"][row], ids_Nk.numpy()), (recipe, i)
        assert np.array_equal(z["weights"][row], weights_Nk.numpy()), (recipe, i)
    assert len(records(tmp_path / "out")[0]["router_entropy"]) == len(moe)


def test_a_variable_k_router_leaves_minus_one_with_weight_zero(tiny_train_setup, tmp_path, monkeypatch, capsys):
    """tests/model_variants.py:variable_k (odd tokens keep 1 of their 2 slots): the trace holds -1 with weight 0 in
    exactly those slots, the log the empty share (1/4 of the slots), and tools/routing.py counts them."""
    config, data = tiny_train_setup
    monkeypatch.setattr(train, "Model", variable_k().Model)
    train.main(trace_args(config, data, tmp_path / "out"))
    for z in traces(tmp_path / "out"):
        odd_N = z["position"] % 2 == 1  # (the router drops by token index on its rank: seq_len is even)
        assert (z["expert_ids"][:, odd_N, 1] == -1).all() and (z["weights"][:, odd_N, 1] == 0).all()
        assert (z["expert_ids"][:, ~odd_N] >= 0).all() and (z["expert_ids"][:, :, 0] >= 0).all()
    assert all(r["empty_slots"] == [0.25, 0.25] for r in records(tmp_path / "out"))
    routing_tool.main([str(tmp_path / "out" / "routing_trace")])
    assert f"empty slots: {2 * 128:,} of {2 * 256 * 2:,}" in capsys.readouterr().out  # per layer, 2 steps


class Router3(qwen3.Router):
    def forward(self, x_TH):  # the last expert is never chosen: its bias sinks it below every probability
        self.expert_bias[-1] = -2.0
        return super().forward(x_TH)


class Model3(qwen3.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for layer in self.layers.values():
            layer.mlp.gate.__class__ = Router3


def test_dead_experts_and_the_reader(tiny_train_setup, tmp_path, monkeypatch, capsys):
    """A router that never chooses expert 3 of 4: dead_experts 1/4 per layer at every step (0 without it), and
    tools/routing.py's load, expert pairs and token experts equal a plain count over the trace files."""
    config, data = tiny_train_setup
    monkeypatch.setattr(train, "Model", Model3)
    train.main(trace_args(config, data, tmp_path / "out", steps=3))
    assert [r["dead_experts"] for r in records(tmp_path / "out")] == [[0.25, 0.25]] * 3
    files = routing_tool.trace_files(tmp_path / "out" / "routing_trace")
    s = routing_tool.main([str(files[0].parent), "--top", "3", "--png", str(tmp_path / "png")])
    shown = capsys.readouterr().out
    zs = [dict(np.load(f)) for f in files]
    assert s["load_SLE"].shape == (3, 2, 4) and not s["load_SLE"][..., 3].any()
    for z, load_LE in zip(zs, s["load_SLE"]):
        assert [np.bincount(z["expert_ids"][lay].ravel(), minlength=4).tolist() for lay in range(2)] == load_LE.tolist()
    ids_LNk = np.concatenate([z["expert_ids"] for z in zs], 1)
    tokens_N = np.concatenate([z["token_ids"] for z in zs])
    for lay in range(2):
        for a in range(4):
            for b in range(4):
                both = ((ids_LNk[lay] == a).any(-1) & (ids_LNk[lay] == b).any(-1)).sum()
                assert s["co_LEE"][lay, a, b] == both
    values, counts = np.unique(tokens_N, return_counts=True)
    top = values[np.lexsort((values, -counts))][:3].tolist()
    assert s["tokens"] == top
    for t, token in enumerate(top):
        want = [np.bincount(ids_LNk[lay][tokens_N == token].ravel(), minlength=4).tolist() for lay in range(2)]
        assert s["token_LtE"][:, t].tolist() == want
    assert "## MoE layer 1" in shown and "e3    0.0" not in shown  # (a column of zeros prints as 0.0)
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "cooccurrence_layer0.png", "cooccurrence_layer1.png", "load_layer0.png", "load_layer1.png"]
    with pytest.raises(FileNotFoundError, match="--routing-trace N"):
        routing_tool.trace_files(tmp_path / "png")


def test_entropy_bias_range_and_every_n_steps(tiny_train_setup, tmp_path, monkeypatch):
    """router_entropy per layer is the mean over the step's tokens of the entropy of softmax(router logits) (computed
    here in float64 from the logits the router returns); a traced step holds the ids and weights the router returned,
    token by token (the layouts test compares the rest with this one process); expert_bias_range is the bias's
    max - min as the step found it (after the previous step's update: 0 at step 1), logged only with
    --expert-bias-rate; --routing-trace 2 traces steps 2 and 4 only."""
    config, data = tiny_train_setup
    logits, ranges = [], []  # (router, logits [T, E]) per call; per step after the bias update: [max - min per layer]
    forward, after_step = qwen3.Router.forward, qwen3.Model.after_step

    def router_forward(self, x_TH):
        out = forward(self, x_TH)
        logits.append((self, out[0].detach().double(), out[2].detach(), out[1].detach()))
        return out

    def model_after_step(self, done):
        after_step(self, done)
        ranges.append([float(layer.mlp.gate.expert_bias.max() - layer.mlp.gate.expert_bias.min())
                       for layer in self.layers.values()])

    monkeypatch.setattr(qwen3.Router, "forward", router_forward)
    monkeypatch.setattr(qwen3.Model, "after_step", model_after_step)
    train.main(trace_args(config, data, tmp_path / "out", steps=4, routing_trace=2, expert_bias_rate=0.01))
    logged = records(tmp_path / "out")
    routers = list(dict.fromkeys(call[0] for call in logits))  # layer 0's router first
    calls = len(logits) // 4  # per step: 8 micro-batches x 2 layers
    for step, record in enumerate(logged, 1):
        want = []
        for layer, router in enumerate(routers):  # one process: micro-batches in order are the batch's rows
            logits_NE, ids_Nk, weights_Nk = (torch.cat(x) for x in zip(*[c[1:] for c in logits[
                (step - 1) * calls:step * calls] if c[0] is router]))
            p_NE = logits_NE.softmax(-1)
            want.append(float(-(p_NE * p_NE.log()).sum(-1).mean()))
            if step % 2 == 0:  # traced: the router's own ids and weights, token by token
                z = np.load(tmp_path / "out" / "routing_trace" / f"step_{step:08d}.npz")
                assert np.array_equal(z["expert_ids"][layer], ids_Nk.numpy())
                assert np.array_equal(z["weights"][layer], weights_Nk.float().numpy())
        np.testing.assert_allclose(record["router_entropy"], want, rtol=1e-5)  # (fp32 sums of 256 terms)
    # (reported from step 2 on: the model learns the rate in step 1's after_step, when the biases leave 0)
    assert [r.get("expert_bias_range") for r in logged] == [None] + [pytest.approx(x) for x in ranges[:3]]
    assert max(max(x) for x in ranges) > 0
    assert sorted(p.name for p in (tmp_path / "out" / "routing_trace").iterdir()) == ["step_00000002.npz",
                                                                                   "step_00000004.npz"]
    monkeypatch.undo()
    train.main(train_args(config, data, tmp_path / "plain", steps=1))
    plain = records(tmp_path / "plain")[0]
    assert "expert_bias_range" not in plain and "empty_slots" not in plain and "router_entropy" in plain
    assert not (tmp_path / "plain" / "routing_trace").exists()
    with pytest.raises(ValueError, match="--routing-trace must be >= 0"):
        train.main(train_args(config, data, tmp_path / "bad", routing_trace=-1, dry_run=True))


# ------------------------------------------------------------------------------------------------ wandb


def wandb_records(path):
    """The protobuf records of a wandb run file (run-<id>.wandb), read as wandb's writer lays them out: a 7-byte
    header, then 32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle,
    4 last) and its bytes; fewer than 7 bytes left in a block are padding."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, parts = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_gets_the_tensorboard_scalars_and_resumes_its_run(tiny_train_setup, tmp_path, monkeypatch):
    """--wandb in wandb's offline mode (no network): the run's flags as its config; at every step exactly the
    scalars TensorBoard got (tag and value); a resume (--resume auto) continues the same wandb run id."""
    pytest.importorskip("wandb", reason="the wandb extra: pip install -e .[wandb] (dev includes it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, data = tiny_train_setup
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    argv = lambda steps, **extra: train_args(config, data, out, steps=steps, ckpt_every=2, wandb="moe-train-test",
                                             **extra)
    train.main(argv(2))
    run_id = (out / "wandb_run_id").read_text()
    train.main(argv(4, resume="auto"))
    assert (out / "wandb_run_id").read_text() == run_id
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(runs) == 2, list((out / "wandb").iterdir())
    sent = {}  # step -> {tag: value}
    for path in runs:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id and record.run.project == "moe-train-test"
                flags = {u.key: json.loads(u.value_json) for u in record.run.config.update}
                assert flags["lr"] == 1e-2 and flags["wandb"] == "moe-train-test" and flags["steps"] in (2, 4)
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}  # (a tag with "/" comes as its parts)
                sent[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    logged = {}
    for tag in board.Tags()["scalars"]:
        for event in board.Scalars(tag):
            logged.setdefault(event.step, {})[tag] = event.value
    assert sorted(sent) == sorted(logged) == [1, 2, 3, 4]
    for step in logged:
        assert sent[step].keys() == logged[step].keys(), step
        assert sent[step] == pytest.approx(logged[step], rel=1e-6), step  # (TensorBoard keeps float32)
    assert {"train/loss", "router_entropy/layer_00", "dead_experts/layer_01"} <= logged[4].keys()


def test_wandb_without_the_extra_fails_in_one_line_before_any_rank(tiny_train_setup, tmp_path, monkeypatch):
    """Without the wandb package, --wandb stops in check_run (launch.sh's --dry-run, before torchrun)."""
    config, data = tiny_train_setup
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as where it is not installed
    with pytest.raises(ValueError, match=r"^--wandb proj needs the wandb package: pip install -e \.\[wandb\]"):
        train.main(train_args(config, data, tmp_path / "out", wandb="proj", dry_run=True))
