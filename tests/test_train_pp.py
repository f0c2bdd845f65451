"""The Qwen3 recipe with --pp (DualPipeV) in the layouts the shared recipe checks do not run: pp=4, pp=2 x dp=2
without overlap or delayed weight gradients, pp=2 x cp=2; each trains exactly like one process running the same
global batch and micro-batch split (losses, grad norms, every weight after the steps). pp=2 and pp=2 x ep=2 run
for every recipe in tests/test_recipes.py."""

import json

import pytest

from recipes.qwen3_30b_a3b import train
from recipes.qwen3_30b_a3b.model import Model, ModelConfig
from tests.conftest import TINY_TRAIN_CONFIG
from tests.multiproc import one_thread, run_ranks
from tests.test_train import assert_matches_single, bitwise_error, layout_errors, run_train, train_args


def pp_args(config, data, out, **extra):
    """3 steps of 8 micro-batches of 1 sequence. Adam eps 1e-6 instead of 1e-8: a stage boundary sums gradient
    contributions in another order, and Adam turns the ~1e-7 relative rounding of near-zero gradient elements
    into lr-sized steps (see tests/recipe_checks.py:check_args); losses and grad norms match at either eps."""
    return train_args(config, data, out, steps=3, micro_batch=1, adam_eps=1e-6, **extra)


TAKE_STATS = Model.take_stats


def take_stats_with_router_counts(self) -> dict:
    """Model.take_stats plus two statistics of the kind a new router adds, whose global values are known without
    this repository's code: slots routed per MoE layer ("sum": every token of the global batch fills the
    ModelConfig.slots_per_token it declares, k here) and the most slots one rank routed per layer ("max": a data
    rank's share of the tokens times k; ranks without the layer report 0)."""
    stats = TAKE_STATS(self)
    slots_L = stats["expert_load"][0].sum(-1)
    return {**stats, "router_slots": (slots_L, "sum"), "rank_slots_max": (slots_L.clone(), "max")}


def run_train_with_router_counts(argv):
    Model.take_stats = take_stats_with_router_counts  # in this spawned rank only
    return run_train(argv)


def test_pp2_dp2_without_overlap_or_delay_equals_single_process(tiny_train_setup, tmp_path, monkeypatch, capsys):
    """With aux-loss-free balancing on: each rank updates the biases of its own layers from the global load,
    bit-identical to one process's (assert_matches_single). The statistics a model hands the loop
    (Model.take_stats) are summed or maxed over the ranks that hold other tokens (dp) or layers (pp) and reach the
    log line, TensorBoard and metrics.jsonl."""
    config, data = tiny_train_setup
    args = lambda out, **extra: pp_args(config, data, tmp_path / out, expert_bias_rate=0.01, **extra)
    monkeypatch.setattr(Model, "take_stats", take_stats_with_router_counts)
    single = run_train(args("single"))
    log = capsys.readouterr().out
    assert all(w.any() for name, w in single[2].items() if name.endswith("expert_bias"))
    results = run_ranks(4, run_train_with_router_counts, args("pp2dp2", pp=2, dp=2, no_overlap=True,
                                                              no_delay_wgrad=True))
    assert_matches_single(single, results)
    cfg = ModelConfig(**{name: v for name, v in TINY_TRAIN_CONFIG.items() if name != "model_type"})
    tokens, k, moe_layers = 8 * 32, int(cfg.slots_per_token), cfg.num_hidden_layers  # (the slots a token fills)
    for run, data_ranks in (("single", 1), ("pp2dp2", 2)):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["router_slots"] for r in records] == [[tokens * k] * moe_layers] * 3, run
        assert [r["rank_slots_max"] for r in records] == [[tokens * k / data_ranks] * moe_layers] * 3, run
    assert f"| router_slots {tokens * k} {tokens * k} | rank_slots_max {tokens * k} {tokens * k} |" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "single" / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("router_slots/layer_01")] == [tokens * k] * 3


def test_pp4_equals_single_process(tiny_train_setup, tmp_path):
    _, data = tiny_train_setup
    config = tmp_path / "six_layers.json"
    config.write_text(json.dumps({**TINY_TRAIN_CONFIG, "num_hidden_layers": 6}))
    single = run_train(pp_args(config, data, tmp_path / "single"))
    assert_matches_single(single, run_ranks(4, run_train, pp_args(config, data, tmp_path / "pp4", pp=4)))


def test_pp2_is_one_process_bit_for_bit(tiny_train_setup, tmp_path):
    """At dp = 1 DualPipeV holds each parameter whole on one rank and adds its micro-batches' gradients in one
    process's order: losses, grad norms and every weight are one process's bit for bit, clipping active. This needs
    the global norm's squares summed in fp64 (core/fsdp.py:clip_grad_norm_): in fp32 the two ranks' partial sums
    round otherwise than one process's single sum, its last bit moved at step 2 here (1.2e-7), and with it the clip
    factor and every weight."""
    _, data = tiny_train_setup
    config = tmp_path / "six_layers.json"  # (the shared checks' model: 6 layers, each stage holds some)
    config.write_text(json.dumps({**TINY_TRAIN_CONFIG, "num_hidden_layers": 6}))
    args = lambda out, **extra: train_args(config, data, tmp_path / out, steps=2, micro_batch=1, **extra)
    with one_thread():  # as each rank computes: ATen may split a reduction by thread count
        single = run_train(args("single"))
    errors = layout_errors(single, run_ranks(2, run_train, args("pp2", pp=2)), error=bitwise_error)
    assert all(error == 0 for error, _, _ in errors.values()), errors


def test_pipeline_errors(tiny_train_setup, tmp_path):
    config, data = tiny_train_setup
    with pytest.raises(ValueError, match="cannot fill 2\\*pp = 8 pipeline stages"):
        train.main(pp_args(config, data, tmp_path, pp=4))


def test_pp2_cp2_equals_single_process(tiny_train_setup, tmp_path):
    """DualPipeV with context parallelism."""
    config, data = tiny_train_setup
    single = run_train(pp_args(config, data, tmp_path / "single"))
    assert_matches_single(single, run_ranks(4, run_train, pp_args(config, data, tmp_path / "pp2cp2", pp=2, cp=2)))
