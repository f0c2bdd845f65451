"""Hold tools/plan.py to measurements on this CPU: calibrate (tools/calibrate.py), predict the step time of each
recipe's tiny config under several layouts of 1, 2 and 4 gloo ranks, run train.py in each layout, and print one
table: predicted, measured, error, and the rank order of the layouts by both.

    python -m tools.plan_check                       # 3 recipes x 8 layouts, 2 rounds (~20 min on 2 cores)
    python -m tools.plan_check --recipes qwen3_30b_a3b --rounds 1 --steps 8
    python -m tools.plan_check --published           # published GPU runs (tools/published_runs.json) vs predicted

The setup is launch.sh's CPU one (tiny config, fp32, sequences of 256, global batch 8, micro-batch 1, expert bias
on, OMP_NUM_THREADS=1: one core per rank). Every run is preceded by a calibration at its world size, so that
calibrations sample the same load as the runs; the prediction uses the median of all calibrations at the run's
world size (--paired: the one just before the run; on a machine whose load swings within a minute, a single
calibration is noisier than the run it precedes); a run's time is the median of its steps after --warmup
steps; the table gives the median over rounds of predictions and of measurements.
For pp layouts it also prints the bubble fraction of the last step's recorded timeline (train.py writes
pipeline_timeline.json) beside the planner's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from core.memory import Layout
from recipes import recipe_names
from tools.calibrate import calibrate_cpu
from tools.pipeline_timeline import timeline_stats
from tools.plan import PUBLISHED_RUNS, machine_for, predict, print_published, published_table, recipe_modules

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ((1, ()), (2, ("--ep", "2")), (2, ("--pp", "2")), (2, ("--cp", "2")), (2, ()),
           (4, ("--pp", "2", "--ep", "2")), (4, ("--cp", "2", "--ep", "2")), (4, ("--ep", "4")))
SETUP = dict(seq_len=256, global_batch=8, micro_batch=1)


def layout_of(world: int, flags: tuple[str, ...]) -> Layout:
    sizes = {"pp": 1, "cp": 1, "ep": 1}
    for name, value in zip(flags[::2], flags[1::2]):
        sizes[name[2:]] = int(value)
    dp = world // (sizes["pp"] * sizes["cp"] * sizes["ep"])
    return Layout(sizes["pp"], dp, sizes["cp"], sizes["ep"], SETUP["micro_batch"], SETUP["seq_len"], bf16=False)


def name_of(layout: Layout) -> str:
    parts = [f"{d}{getattr(layout, d)}" for d in ("pp", "dp", "cp", "ep") if getattr(layout, d) > 1]
    return " x ".join(parts) or "1 rank"


def measure(recipe: str, world: int, flags, steps: int, warmup: int, data: str) -> dict:
    """Run train.py under torchrun; the median step time after `warmup` steps, and the pp timeline if written."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "-m", f"recipes.{recipe}.train", *flags, "--seq-len", str(SETUP["seq_len"]),
               "--global-batch", str(SETUP["global_batch"]), "--micro-batch", str(SETUP["micro_batch"]),
               "--steps", str(steps), "--ckpt-every", "0", "--eval-every", "0", "--expert-bias-rate", "1e-2",
               "--data", data, "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        timeline = Path(out) / "pipeline_timeline.json"
        result = {"step_s": statistics.median(x["step_time"] for x in records[warmup:])}
        if timeline.exists():
            result["bubble_fraction"] = timeline_stats(json.loads(timeline.read_text()))["bubble_fraction"]
        return result


def median_calibration(cals: list[dict], world: int) -> dict:
    """One calibration whose every field at `world` ranks is the median over `cals`."""
    entries = [c["ranks"][str(world)] for c in cals]
    entry = {key: {f: statistics.median(e[key][f] for e in entries) for f in value if f != "points"}
             if isinstance(value, dict) else statistics.median(e[key] for e in entries) for key, value in entries[0].items()}
    return {**cals[0], "ranks": {str(world): entry}}


def pipeline_bubble(pred: dict) -> float:
    """The planner's bubble share of the pipeline part (span) of the step, comparable to timeline_stats."""
    b = pred["by_class"]
    span = pred["step_s"] - b["FSDP2 all-gather/reduce-scatter"]
    return b["bubble"] / span if span > 0 else 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(recipe_names()))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of each run's median")
    p.add_argument("--min-seconds", type=float, default=0.3, help="time per calibration benchmark size")
    p.add_argument("--paired", action="store_true", help="predict each run from the calibration just before it "
                   "(default: from the median of all calibrations at its world size)")
    p.add_argument("--data", default="data/stdlib", help="tokens from python -m tools.prepare_data --default")
    p.add_argument("--json", default="", help="also write the measurements (calibrations, runs) and the table here")
    p.add_argument("--replay", default="", help="predict again from the measurements a --json file holds (no runs)")
    p.add_argument("--published", nargs="?", const=str(PUBLISHED_RUNS), default="", metavar="FILE",
                   help="instead: predict each published GPU run of FILE (default tools/published_runs.json) at its "
                        "own layout; a markdown table of published, predicted and their ratio")
    a = p.parse_args(argv)
    if a.published:
        table = published_table(a.published)
        print_published(table)
        return table
    recipes = a.recipes.split(",")
    if a.replay:
        saved = json.loads(Path(a.replay).read_text())
        runs = saved["runs"]
        recipes = [r for r in recipes if any(run["recipe"] == r for run in runs)]
    else:
        if not (ROOT / a.data / "meta.json").exists() and not (Path(a.data) / "meta.json").exists():
            raise FileNotFoundError(f"no dataset at {a.data}; run python -m tools.prepare_data --default first")
        runs = []
        for round_ in range(a.rounds):
            jobs = [(r, w, f) for r in recipes for w, f in LAYOUTS]
            for recipe, world, flags in jobs if round_ % 2 == 0 else reversed(jobs):  # alternate the order per round
                calibration = calibrate_cpu(worlds=(world,), min_seconds=a.min_seconds)  # right before the run: same load
                res = measure(recipe, world, flags, a.steps, a.warmup, a.data)
                runs.append({"recipe": recipe, "world": world, "flags": list(flags), "round": round_,
                             "calibration": calibration, **res})
                print(f"round {round_ + 1}: {recipe} {name_of(layout_of(world, flags))}: {res['step_s']:.3f} s",
                      flush=True)
                if a.json:  # after every run, so that a long check keeps what it measured
                    Path(a.json).write_text(json.dumps({"runs": runs, "steps": a.steps, "warmup": a.warmup}, indent=1))
    measured = {}
    for run in runs:
        measured.setdefault((run["recipe"], run["world"], tuple(run["flags"])), []).append(run)
    cal = runs[0]["calibration"]
    pooled = {w: median_calibration([r["calibration"] for r in runs if r["world"] == w], w)
              for w in {r["world"] for r in runs}}
    rows = []
    for recipe in recipes:
        mod, _ = recipe_modules(recipe)
        cfg_path = str(mod.tiny_config_path())
        cfg = mod.ModelConfig.from_hf(cfg_path)
        for world, flags in LAYOUTS:
            layout = layout_of(world, flags)
            if (recipe, world, flags) not in measured:  # a replay of a check stopped early
                continue
            runs = measured[(recipe, world, flags)]
            if a.paired:  # each run with the calibration measured just before it
                cals = [r["calibration"] for r in runs]
            else:  # the median of every calibration at this world size
                cals = [pooled[world]]
            preds = [predict(mod, cfg, cfg_path, layout, SETUP["global_batch"], machine_for("cpu", c, world), world)
                     for c in cals]
            row = {"recipe": recipe, "layout": name_of(layout), "ranks": world,
                   "predicted_s": statistics.median(p["step_s"] for p in preds),
                   "measured_s": statistics.median(r["step_s"] for r in runs),
                   "bottleneck": preds[0]["bottleneck"]}
            if "bubble_fraction" in runs[0]:
                row["bubble_measured"] = statistics.median(r["bubble_fraction"] for r in runs)
                row["bubble_predicted"] = statistics.median(pipeline_bubble(p) for p in preds)
            row["error"] = row["predicted_s"] / row["measured_s"] - 1
            rows.append(row)
    rounds = 1 + max(run["round"] for run in runs)
    print(f"\nconditions: {cal['device']}, torch {cal['torch']}, {rounds} round(s), steps per run: the median after "
          f"the first {a.warmup}, OMP_NUM_THREADS=1, machine shared with whatever else runs")
    print(f"{'recipe':<18} {'layout':<12} {'ranks':>5} {'predicted s':>12} {'measured s':>11} {'error':>7} "
          f"{'rank p/m':>9}  bubble p/m")
    summary = []
    for recipe in recipes:
        mine = [r for r in rows if r["recipe"] == recipe]
        by_pred = sorted(mine, key=lambda r: r["predicted_s"])
        by_meas = sorted(mine, key=lambda r: r["measured_s"])
        for r in mine:
            r["rank_predicted"], r["rank_measured"] = by_pred.index(r) + 1, by_meas.index(r) + 1
            bubble = f"{r['bubble_predicted']:.2f}/{r['bubble_measured']:.2f}" if "bubble_measured" in r else ""
            print(f"{recipe:<18} {r['layout']:<12} {r['ranks']:>5} {r['predicted_s']:>12.3f} {r['measured_s']:>11.3f} "
                  f"{100 * r['error']:>6.0f}% {r['rank_predicted']:>4}/{r['rank_measured']:<4}  {bubble}")
        fastest = by_meas[0]
        summary.append(f"{recipe}: measured-fastest {fastest['layout']} ranked {fastest['rank_predicted']} by the planner")
    errors = [abs(r["error"]) for r in rows]
    print(f"median |error| {100 * statistics.median(errors):.0f}% over {len(rows)} runs (goal <= 25%)")
    for line in summary:
        print(line)
    if a.json and not a.replay:
        saved = json.loads(Path(a.json).read_text())
        Path(a.json).write_text(json.dumps({**saved, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
