"""skills/capture-profile and skills/analyze-profile: train.py --profile-steps writes one trace per rank, and
analyze_profile.py's table, CSV and shares agree with the trace events recomputed here independently.

The two-rank (ep=2) capture runs for qwen3_30b_a3b; every other recipe folder (the same train.py) profiles one
step in one process, and every recipe rejects a bad --profile-steps in one line."""

import csv
import importlib
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from recipes import recipe_names
from tests.multiproc import run_ranks

ROOT = Path(__file__).resolve().parents[1]
RECIPES = recipe_names()
sys.path.insert(0, str(ROOT / "skills" / "analyze-profile" / "scripts"))
import analyze_profile  # noqa: E402


def train_main(recipe: str, argv: list[str]) -> int:
    importlib.import_module(f"recipes.{recipe}.train").main(argv)
    return 0


def argv(recipe, data, out, steps, window, *extra):
    """The recipe's tiny config cut to 2 layers (traces of ~1 MB) on conftest's data."""
    config = Path(out).parent / f"{recipe}_2_layers.json"
    hf = json.loads((ROOT / "recipes" / recipe / "config_tiny.json").read_text())
    hf["num_hidden_layers"] = 2
    if "layer_types" in hf:  # gpt_oss: one entry per layer
        hf["layer_types"] = hf["layer_types"][:2]
    config.write_text(json.dumps(hf))
    return ["--config", str(config), "--data", str(data), "--out", str(out),
            "--steps", str(steps), "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--ckpt-every", "0",
            "--eval-every", "0", "--profile-steps", window, *extra]


def expected_self_ms(trace: Path) -> dict:
    """{name: [self ms, calls, rounding ms]} of the host events that start inside a ProfilerStep, from the raw JSON:
    an event's duration minus the durations of the events directly nested in it on its thread. analyze_profile.py
    takes the same differences on absolute times (ts + dur, ~6e12 us: one double ulp ~1e-3 us), so each time it
    adds rounds by up to half an ulp: 2 per event and 2 per direct child (AdamW.step has hundreds), the bound."""
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    is_step = lambda e: re.fullmatch(r"ProfilerStep#\d+", e["name"])  # noqa: E731
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in spans if is_step(e)]
    host = [e for e in spans if e.get("cat") in ("cpu_op", "user_annotation") and not is_step(e)]
    self_us, edges = [e["dur"] for e in host], [2] * len(host)
    half_ulp_ms = max((math.ulp(e["ts"] + e["dur"]) for e in spans), default=0.0) / 2 / 1e3
    threads = defaultdict(list)
    for i, e in enumerate(host):
        threads[(e["pid"], e["tid"])].append(i)
    for idx in threads.values():
        open_ = []  # enclosing events
        for i in sorted(idx, key=lambda i: (host[i]["ts"], -host[i]["dur"])):
            while open_ and host[open_[-1]]["ts"] + host[open_[-1]]["dur"] < host[i]["ts"] + host[i]["dur"]:
                open_.pop()
            if open_:
                self_us[open_[-1]] -= host[i]["dur"]
                edges[open_[-1]] += 2
            open_.append(i)
    out = defaultdict(lambda: [0.0, 0, 0.0])
    for e, us, n in zip(host, self_us, edges):
        if any(a <= e["ts"] < b for a, b in steps):
            out[e["name"]][0] += us / 1e3
            out[e["name"]][1] += 1
            out[e["name"]][2] += n * half_ulp_ms
    return out


def check_analysis(profile_dir: Path, ranks: int, capsys, tmp_path, comm_expected: bool):
    traces = sorted(profile_dir.glob("rank*.json"))
    assert [p.name for p in traces] == [f"rank{r}.json" for r in range(ranks)]
    expected = defaultdict(lambda: [0.0, 0, 0.0])
    for trace in traces:
        for name, found in expected_self_ms(trace).items():
            expected[name] = [a + b for a, b in zip(expected[name], found)]
    csv_path = tmp_path / "ops.csv"
    capsys.readouterr()
    assert analyze_profile.main([str(profile_dir), "--top", "100000", "--csv", str(csv_path)]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader(csv_path.open()))
    # every event counted once: the CSV holds every name, with the totals and calls recomputed from the JSON
    assert {r["name"] for r in rows} == set(expected)
    for r in rows:
        ms, calls, rounding = expected[r["name"]]
        assert int(r["calls"]) == calls, r
        # the CSV's 6 decimals (5e-7 ms) and the times' own rounding (expected_self_ms)
        assert float(r["total_ms"]) == pytest.approx(ms, rel=0, abs=5e-7 + rounding), r
        assert float(r["mean_ms"]) == pytest.approx(ms / calls, rel=0, abs=5e-7 + rounding / calls), r
    assert [float(r["total_ms"]) for r in rows] == sorted((float(r["total_ms"]) for r in rows), reverse=True)
    # the printed table is the CSV, rounded
    table = printed.split("\n", 2)[2].split("csv:")[0].strip().splitlines()
    assert len(table) == len(rows)
    for line, r in zip(table, rows):
        total, calls, mean = line.rsplit(maxsplit=3)[1:]
        assert line.startswith(r["name"][:80])
        # printed to 3 decimals from the same value the CSV holds to 6 (so no exact re-rounding of the CSV's)
        assert int(calls) == int(r["calls"]) and abs(float(total) - float(r["total_ms"])) <= 5e-4 + 1e-6, (line, r)
        assert float(mean) == pytest.approx(float(r["mean_ms"]), abs=1e-4)
    # per rank: compute + exposed communication + idle = the profiled steps; overlap within the communication
    res = analyze_profile.analyze(profile_dir)
    assert sorted(res["ranks"]) == list(range(ranks))
    for x in res["ranks"].values():
        assert x["device"] == "cpu" and x["window_ms"] > 0
        shares = [x[k] / x["window_ms"] for k in ("compute_ms", "exposed_comm_ms", "idle_ms")]
        assert sum(shares) == pytest.approx(1.0, abs=1e-9) and min(shares) >= -1e-12
        assert 0 <= x["overlap_ms"] <= x["comm_ms"] + 1e-9
        assert (x["comm_ms"] > 0) == comm_expected
        assert x["category_ms"].get("all-to-all", 0) > 0 if comm_expected else "all-to-all" not in x["category_ms"]
    assert len(re.findall(r"^\s+\d+\s+cpu\s", printed, re.M)) == ranks


def test_two_rank_capture_and_analysis(tiny_train_setup, tmp_path, capsys):
    """qwen3_30b_a3b at ep=2: steps 2-3 of 3 profiled on both ranks; all-to-all shows up as communication."""
    _, data = tiny_train_setup
    run_ranks(2, train_main, "qwen3_30b_a3b", argv("qwen3_30b_a3b", data, tmp_path / "run", 3, "2-3", "--ep", "2"))
    check_analysis(tmp_path / "run" / "profile", 2, capsys, tmp_path, comm_expected=True)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "qwen3_30b_a3b"])
def test_one_process_capture(recipe, tiny_train_setup, tmp_path, capsys):
    _, data = tiny_train_setup
    train_main(recipe, argv(recipe, data, tmp_path / "run", 2, "2-2"))
    assert "profile of steps 2-2" in capsys.readouterr().out
    check_analysis(tmp_path / "run" / "profile", 1, capsys, tmp_path, comm_expected=False)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("window, message", [("3-2", "need 1 <= A <= B <= --steps"), ("2-9", "<= --steps (3)"),
                                             ("2", "is not A-B"), ("a-b", "is not A-B"), ("0-1", "need 1 <= A")])
def test_bad_profile_steps(recipe, window, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_main(recipe, argv(recipe, tmp_path / "no_data", tmp_path / "run", 3, window))


def test_gpu_trace_shares(tmp_path, capsys):
    """The GPU branch on a hand-made trace (no GPU here): kernels timed on the device, categorised through the
    op that launched them (correlation id); an all-to-all kernel half hidden behind a GEMM."""
    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}
    events = [x("user_annotation", "ProfilerStep#2", 0, 100),
              x("cpu_op", "c10d::alltoall_base_", 1, 5), x("cuda_runtime", "ncclLaunch", 2, 1, correlation=1),
              x("cpu_op", "aten::mm", 10, 5), x("cuda_runtime", "cudaLaunchKernel", 11, 1, correlation=2),
              x("kernel", "ncclDevKernel_Generic", 20, 40, tid=7, correlation=1),  # 20..60
              x("kernel", "sm90_gemm", 40, 40, tid=8, correlation=2),  # 40..80: overlaps 20 us of the all-to-all
              x("kernel", "sm90_gemm", 200, 10, tid=8, correlation=2)]  # outside the step: not counted
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    r = analyze_profile.analyze(tmp_path)["ranks"][0]
    assert r["device"] == "cuda" and r["window_ms"] == pytest.approx(0.1)
    assert r["ops"] == {"ncclDevKernel_Generic": [0.04, 1], "sm90_gemm": [0.04, 1]}
    assert r["category_ms"] == pytest.approx({"all-to-all": 0.04, "other compute": 0.04})
    assert (r["compute_ms"], r["comm_ms"], r["overlap_ms"], r["exposed_comm_ms"], r["idle_ms"]) == \
        pytest.approx((0.04, 0.04, 0.02, 0.02, 0.04))
    assert analyze_profile.main([str(tmp_path)]) == 0
    assert "kernels (device time)" in capsys.readouterr().out
