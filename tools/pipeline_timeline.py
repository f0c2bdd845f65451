"""Seeing the DualPipeV schedule: draw per-rank timelines, measure the bubble, compare with torch and the paper.

    python -m tools.pipeline_timeline --pp 2 --micro 8 --out runs/timeline     # run the stand-in on gloo
    python -m tools.pipeline_timeline --from-json timelines.json --out runs/tl  # timelines saved by a train.py

Writes <out>/timeline.png (ranks as rows, a ms axis, micro-batch ids on the boxes; needs matplotlib:
pip install 'moe-train[plot]') and <out>/trace.json (Perfetto), and prints the numbers; without matplotlib the
PNG is skipped with one line saying so, the rest is the same.

A timeline is what `DualPipeV.run` leaves in `engine.timeline` on one rank: (op, start_s, end_s) with op in
F0, F1, B0, B1, W, F0&B1, F1&B0 (phase 0 = stage r, phase 1 = stage 2*pp-1-r). --from-json reads a JSON list
with one such list per pp rank (pp, micro-batch count, overlap and delay are read off the ops).

Bubble, as measured here: span = max(end) - min(start) over all ranks' ops; busy_r = time rank r spends inside
an op; bubble_r = span - busy_r (idle time, including waits on transfers); bubble fraction
= 1 - sum(busy_r) / (ranks * span).

Bubble formula (DualPipe README, "Pipeline Bubbles"): DualPipeV's bubble per device is (PP/2-1)(F&B+B-3W), where
PP is the number of pipeline *stages* (DualPipeV runs PP stages on PP/2 devices). Our pp ranks hold 2*pp stages,
so the formula reads (pp-1)(F&B + B - 3W): F&B = one overlapped forward+backward pair, B = a full backward chunk
(input and weight gradients), W = one delayed weight-gradient chunk; F does not appear. It assumes free transfers,
equal stages, and (our replay shows) an input-gradient backward as long as a forward (I = F): with I = F, B = I + W
and F&B = F + B the replay of our order reproduces it exactly. So next to it we print the bubble of that ideal
replay (`simulate`) of the engine's own order with each rank's measured mean durations and free transfers:
formula vs replay = unequal stages and I != F; replay vs measured = transfers, waits and jitter.

Order comparison. Both orders are written as F<phase>.<mb>, B<phase>.<mb> (full backward), I<phase>.<mb> (input
gradient only, weight gradient queued), W<phase>.<mb> (a queued weight gradient) and F<p>.<mb>&B<q>.<mb> (one
overlapped pair). Ours comes from a dry run of `DualPipeV.run` (the schedule code itself, with compute and
communication replaced by recording: no process group); torch's from the static per-rank computation of
`torch.distributed.pipelining.schedules.ScheduleDualPipeV` (`_calculate_single_rank_operations`, which needs no
stages). Both follow DeepSeek's reference dualpipev.py, so the orders agree action for action; the differences
are in what an action does:
  - torch's OVERLAP_F_B runs its forward and its backward one after the other unless a custom function is
    registered for it; ours interleaves them layer by layer so each all-to-all hides behind the other's compute;
  - torch's I/W split covers every weight of the stage; ours delays only the expert GEMMs' weight gradients
    (W is shorter, I longer than torch's would be);
  - torch adds SEND/RECV actions of its own (`_prepare_schedule_with_comms`); ours batches the transfers of
    each step with batch_isend_irecv around the compute;
  - our engine records a full and an input-only backward both as "B<phase>" in its timeline; the dry run says
    which is which.
"""

import argparse
import json
import os
import re
from types import SimpleNamespace

import torch

from core.pipeline import DualPipeV

# ------------------------------------------------------------------------------------------------ drawing

COLOURS = {  # light shade = phase 0 (stage r, way down), dark shade = phase 1 (stage 2pp-1-r, way back)
    ("F", 0): "#96bef5", ("F", 1): "#2355be",
    ("B", 0): "#96e196", ("B", 1): "#198737",
    ("I", 0): "#96e196", ("I", 1): "#198737",
    ("W", None): "#af6ecd",
}
OTHER = "#808080"  # an op name outside the table
LEGEND = {"F0": "forward, phase 0", "F1": "forward, phase 1", "B0": "backward, phase 0", "B1": "backward, phase 1",
          "W": "delayed weight gradient"}  # plus the overlapped F&B pair
NO_MATPLOTLIB = "timeline.png skipped: matplotlib is not installed (pip install 'moe-train[plot]' or pip install matplotlib)"


def _colour_parts(op: str) -> list[str]:
    """One colour per part of an op name: 'F0' -> [F0 colour]; 'F0&B1' -> [F0 colour, B1 colour]."""
    parts = []
    for part in op.split("&"):
        phase = int(part[1]) if len(part) > 1 and part[1].isdigit() else None
        parts.append(COLOURS.get((part[0], phase), COLOURS.get((part[0], None), OTHER)))
    return parts


def timeline_stats(timelines: list[list[tuple[str, float, float]]]) -> dict:
    """busy (per rank), span, bubble (per rank, span - busy) and bubble_fraction, as defined in the module doc."""
    ops = [op for tl in timelines for op in tl]
    t_min, t_max = min(s for _, s, _ in ops), max(e for _, _, e in ops)
    span = t_max - t_min
    busy = []
    for tl in timelines:  # union of the rank's intervals: ops of one rank do not overlap, but be safe
        total, reach = 0.0, t_min
        for _, s, e in sorted(tl, key=lambda o: o[1]):
            total += max(0.0, e - max(s, reach))
            reach = max(reach, e)
        busy.append(total)
    return {"busy": busy, "span": span, "t_min": t_min, "bubble": [span - b for b in busy],
            "bubble_fraction": 1 - sum(busy) / (len(timelines) * span) if span > 0 else 0.0}


def draw_png(timelines: list[list[tuple[str, float, float]]], path, labels: list[list[str]] | None = None) -> bool:
    """One row per rank (rank 0 on top), ops as boxes on a ms axis; an overlapped F&B box is split, forward colour
    on top, backward below. labels: per rank, one action per op in our notation (schedule_order: 'F0.3',
    'F0.4&B1.1'); the micro-batch ids go on the boxes wide enough to hold them. False (and one printed line)
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print(NO_MATPLOTLIB)
        return False
    stats = timeline_stats(timelines)
    span_ms, t_min = (stats["span"] or 1.0) * 1e3, stats["t_min"]
    width_in = 14
    fig, ax = plt.subplots(figsize=(width_in, 1.0 + 0.7 * len(timelines)), dpi=110)
    ms_per_px = span_ms / (width_in * 110 * 0.8)  # the axes take ~80% of the figure's width
    for r, tl in enumerate(timelines):
        for i, (op, s, e) in enumerate(tl):
            x, w = (s - t_min) * 1e3, (e - s) * 1e3
            parts = _colour_parts(op)
            for k, colour in enumerate(parts):  # row r spans y in [r - 0.4, r + 0.4] (y grows downwards); part 0 on top
                h = 0.8 / len(parts)
                ax.broken_barh([(x, w)], (r - 0.4 + k * h, h), facecolors=colour, edgecolor="white", linewidth=0.5)
            if labels is not None:
                text = "/".join(a.split(".")[1] for a in labels[r][i].split("&") if "." in a)
                if text and w / ms_per_px >= 7 * len(text) + 4:
                    ax.text(x + w / 2, r, text, ha="center", va="center", fontsize=8)
    ax.set_ylim(len(timelines) - 0.5, -0.5)
    ax.set_yticks(range(len(timelines)), [f"pp rank {r}" for r in range(len(timelines))])
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"DualPipeV timeline: bubble fraction {stats['bubble_fraction']:.3f}"
                 + ("; numbers on boxes = micro-batch (forward/backward)" if labels is not None else ""), fontsize=10)
    ax.legend(handles=[Patch(facecolor=_colour_parts(op)[0], label=f"{op}: {text}") for op, text in LEGEND.items()]
              + [Patch(facecolor=_colour_parts("F0")[0], edgecolor=_colour_parts("B1")[0],
                       linewidth=2, label="F&B: overlapped pair (F top, B bottom)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / len(timelines)), ncol=3, fontsize=8, frameon=False)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


def write_trace(timelines: list[list[tuple[str, float, float]]], path) -> None:
    """Chrome/Perfetto trace JSON (open it in ui.perfetto.dev or chrome://tracing): one thread per rank."""
    t_min = min(s for tl in timelines for _, s, _ in tl)
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}}
              for r in range(len(timelines))]
    events += [{"name": op, "ph": "X", "pid": 0, "tid": r, "ts": (s - t_min) * 1e6, "dur": (e - s) * 1e6}
               for r, tl in enumerate(timelines) for op, s, e in tl]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


# ------------------------------------------------------------------------------------- schedule orders


class _DryRun(DualPipeV):
    """DualPipeV.run with compute and communication replaced by recording the action: the schedule code itself
    decides the order, with no process group and no model."""

    def __init__(self, rank: int, pp: int, overlap: bool, delay: bool):
        super().__init__([None, None], rank, pp, None, None, None, [], torch.device("cpu"), overlap, delay)
        self.order, self.queued = [], []  # queued: (phase, mb) of weight gradients, oldest first like the engine

    def _next(self, kind: str, phase: int) -> str:
        counter = self.f_chunk if kind == "F" else self.b_chunk
        counter[phase] += 1
        return f"{kind}{phase}.{counter[phase] - 1}"

    def _forward_compute(self, phase):
        self.order.append(self._next("F", phase))

    def _backward_compute(self, phase, zero_bubble=False):
        delayed = zero_bubble and self.delay_weight_grads
        action = self._next("B", phase)
        if delayed:
            self.queued.append(action[1:])
        self.order.append(("I" if delayed else "B") + action[1:])

    def _forward_backward_compute(self, phase_f, phase_b):
        if not self.overlap:
            self._forward_compute(phase_f)
            self._backward_compute(phase_b)
        else:
            self.order.append(f"{self._next('F', phase_f)}&{self._next('B', phase_b)}")

    def _weight_compute(self):
        if self.delay_weight_grads:
            self.order.append("W" + self.queued.pop(0) if self.queued else "W")

    def _recv_forward(self, phase):
        pass

    _send_forward = _recv_backward = _send_backward = _recv_forward

    def _commit(self):
        pass


def schedule_order(pp: int, num_micro: int, overlap: bool = True, delay: bool = True) -> list[list[str]]:
    """Per-rank action order that our DualPipeV engine issues (a dry run of DualPipeV.run, see the module doc)."""
    orders = []
    for r in range(pp):
        engine = _DryRun(r, pp, overlap, delay)
        engine.run(num_micro)
        orders.append(engine.order)
    return orders


def torch_schedule_order(pp: int, num_micro: int) -> list[list[str]]:
    """Per-rank compute-action order of torch.distributed.pipelining's ScheduleDualPipeV, in our notation.
    `_calculate_single_rank_operations` only reads the group size and the micro-batch count, so it runs on a
    stand-in `self` without building stages or a process group."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    if num_micro < 2 * pp:
        raise ValueError(f"DualPipeV needs at least 2*pp = {2 * pp} micro-batches, got {num_micro}")
    fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=num_micro)

    def name(a, r):  # rank r holds stage r (phase 0) and stage 2pp-1-r (phase 1); type value: F, B, I or W
        return f"{a.computation_type.value}{0 if a.stage_index == r else 1}.{a.microbatch_index}"

    return [["&".join(name(s, r) for s in a.sub_actions) if a.sub_actions else name(a, r)
             for a in ScheduleDualPipeV._calculate_single_rank_operations(fake, r) if a is not None]
            for r in range(pp)]


def compare_orders(ours: list[list[str]], theirs: list[list[str]], show: int = 3) -> list[str]:
    """Printable lines: per rank, equal or the first `show` differing positions."""
    lines = []
    for r, (a, b) in enumerate(zip(ours, theirs)):
        diffs = [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]
        if not diffs:
            lines.append(f"  rank {r}: identical, {len(a)} actions: {' '.join(a)}")
            continue
        lines.append(f"  rank {r}: {len(diffs)} differing positions ({len(a)} ours, {len(b)} torch); first:")
        for i in diffs[:show]:
            lines.append(f"    #{i}: ours {a[i] if i < len(a) else '-'}  torch {b[i] if i < len(b) else '-'}")
    return lines


def engine_name(action: str) -> str:
    """Our notation -> the op name the engine records: 'I1.3' -> 'B1', 'W0.2' -> 'W', 'F0.4&B1.1' -> 'F0&B1'."""
    return re.sub(r"\.\d+", "", action).replace("I", "B").replace("W0", "W").replace("W1", "W")


# ------------------------------------------------------------------------------------ bubble: formula, replay


def formula_bubble(pp: int, t_f: float, t_b: float, t_w: float, t_fb: float | None = None) -> float:
    """DualPipe README bubble of DualPipeV per device, (PP/2-1)(F&B+B-3W) with PP = 2*pp stages, i.e.
    (pp-1)(F&B + B - 3W) for our pp ranks. t_b is a full backward chunk. F does not appear in the formula; it
    serves when nothing overlapped (t_fb None): then F&B = F + B."""
    t_fb = t_f + t_b if t_fb is None else t_fb
    return (pp - 1) * (t_fb + t_b - 3 * t_w)


def simulate(orders: list[list[str]], durations: dict | list, transfer: float = 0.0) -> list[list[tuple[str, float, float]]]:
    """Replay per-rank action orders with fixed durations (keys F, B, I, W, F&B; one dict, or one per rank; or per
    rank a function action -> seconds, e.g. 'F0.3&B1.0') and transfers of `transfer` seconds between ranks (the
    stage pp-1 -> pp hand-off stays on one rank): an action starts when its rank is free and its inputs exist
    (forward of stage s-1, backward of stage s+1, same micro-batch). Returns per-rank timelines with engine op
    names. With free transfers, I = F, B = I + W and F&B = F + B its bubble is exactly the formula's
    (tests/test_pipeline_timeline.py)."""
    pp = len(orders)
    durations = durations if isinstance(durations, list) else [durations] * pp
    done, timelines, pos, free = {}, [[] for _ in range(pp)], [0] * pp, [0.0] * pp
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                action = orders[r][pos[r]]
                parts = [(p[0], r if p[1] == "0" else 2 * pp - 1 - r, int(p[3:])) for p in action.split("&")]
                needs = [("F", s - 1, m) for k, s, m in parts if k == "F" and s > 0]
                needs += [("B", s + 1, m) for k, s, m in parts if k in "BI" and s < 2 * pp - 1]
                if any(n not in done for n in needs):
                    break
                owner = lambda s: s if s < pp else 2 * pp - 1 - s  # the pp rank holding stage s
                start = max([free[r]] + [done[n] + (transfer if owner(n[1]) != r else 0.0) for n in needs])
                d = durations[r]
                free[r] = start + (d(action) if callable(d) else d["F&B" if len(parts) > 1 else parts[0][0]])
                for k, s, m in parts:
                    done[("B" if k == "I" else k, s, m)] = free[r]
                timelines[r].append((engine_name(action), start, free[r]))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the orders deadlock at positions {pos}")
    return timelines


def op_durations(timelines: list[list[tuple[str, float, float]]], orders: list[list[str]]) -> tuple[dict, list[dict]]:
    """Mean measured duration of each kind F, B (full backward), I (input gradient only), W, F&B: over all ranks,
    and per rank (a kind a rank lacks takes the overall mean). The engine names both backwards 'B<phase>'; the
    order from schedule_order, aligned op by op, tells them apart."""
    samples = [{} for _ in timelines]
    for r, (tl, order) in enumerate(zip(timelines, orders)):
        if [engine_name(a) for a in order] != [op for op, *_ in tl]:
            raise ValueError("the timeline does not follow schedule_order(); pass the pp, micro-batch count, "
                             "overlap and delay settings it was recorded with")
        for action, (_, s, e) in zip(order, tl):
            samples[r].setdefault("F&B" if "&" in action else action[0], []).append(e - s)
    mean = lambda groups: {k: sum(sum(g.get(k, [])) for g in groups) / sum(len(g.get(k, [])) for g in groups)
                           for k in set().union(*groups)}
    overall = mean(samples)
    if "B" not in overall:  # no full backward recorded: input plus weight gradient is one
        overall["B"] = overall.get("I", 0.0) + overall.get("W", 0.0)
    return overall, [{**overall, **mean([g])} for g in samples]


# ------------------------------------------------------------------------------ running the stand-in on gloo


def _timeline_worker(pp: int, num_micro: int, steps: int):
    """One pp rank of the test suite's MoE stand-in (tests/test_pipeline.py), overlap and weight-gradient delay on;
    returns the timeline of the last of `steps` runs (the first ones warm up allocator and gloo)."""
    import torch.distributed as dist

    from core.mesh import build_mesh, destroy_mesh
    from core.pipeline import split_layers
    from tests.test_pipeline import LAYERS, MB, H, S, ToyModel, ToyStage, batches

    mesh = build_mesh(pp=pp, ep=1, dp=1)
    r = mesh.coord("pp")
    model, ids = ToyModel(), batches(num_micro)
    layers = split_layers(LAYERS, pp)
    stages = [ToyStage(model, layers[s], s == 0, s == 2 * pp - 1, ids, ids.numel()) for s in (r, 2 * pp - 1 - r)]
    engine = DualPipeV(stages, r, pp, r - 1 if r > 0 else None, r + 1 if r < pp - 1 else None, mesh.group("pp"),
                       [((MB, S, H), torch.float32)], torch.device("cpu"), overlap=True, delay_weight_grads=True)
    for _ in range(steps):
        dist.barrier()  # each rank's timeline starts at its own run(); the barrier lines the ranks up
        engine.run(num_micro)
    timeline = engine.timeline
    destroy_mesh()
    return timeline


def record_timelines(pp: int, num_micro: int, steps: int = 2) -> list[list[tuple[str, float, float]]]:
    from tests.multiproc import run_ranks

    return run_ranks(pp, _timeline_worker, pp, num_micro, steps)


def report(timelines, out_dir: str) -> dict:
    """Draw, then print the bubble, the formula next to it and the order comparison with torch. pp, the number
    of micro-batches, overlap and weight-gradient delay are read off the timelines."""
    os.makedirs(out_dir, exist_ok=True)
    png, trace = os.path.join(out_dir, "timeline.png"), os.path.join(out_dir, "trace.json")
    pp = len(timelines)
    num_micro = sum(op.count("F0") for op, *_ in timelines[0])  # every micro-batch passes stage 0 once
    overlap, delay = (any(key in op for tl in timelines for op, *_ in tl) for key in ("&", "W"))
    ours = schedule_order(pp, num_micro, overlap, delay)
    d, per_rank = op_durations(timelines, ours)  # checks that the timelines follow `ours` op by op
    stats = timeline_stats(timelines)
    write_trace(timelines, trace)
    drawn = draw_png(timelines, png, labels=ours)
    print(f"wrote {png + ' and ' if drawn else ''}{trace}  (pp={pp}, micro-batches={num_micro})")
    print(f"span {stats['span'] * 1e3:.2f} ms; busy per rank (ms): {' '.join(f'{b * 1e3:.2f}' for b in stats['busy'])}")
    print(f"bubble fraction (1 - sum busy / (ranks * span)): {stats['bubble_fraction']:.3f}")

    ms = lambda xs: " ".join(f"{x * 1e3:.2f}" for x in xs)
    print("mean op durations (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(d.items())))
    fb, w = d.get("F&B", d["F"] + d["B"]), d.get("W", 0.0)
    predicted = formula_bubble(pp, d["F"], d["B"], w, d.get("F&B"))
    ideal = timeline_stats(simulate(ours, per_rank))
    print(f"bubble per rank (ms), measured: mean {sum(stats['bubble']) / pp * 1e3:.2f} [{ms(stats['bubble'])}]")
    print(f"  ideal replay of our order, each rank's mean durations, free transfers: mean "
          f"{sum(ideal['bubble']) / pp * 1e3:.2f} [{ms(ideal['bubble'])}]")
    print(f"  DualPipe formula (pp-1)(F&B+B-3W) = {pp - 1}*({fb * 1e3:.3f}+{d['B'] * 1e3:.3f}-3*{w * 1e3:.3f}) "
          f"= {predicted * 1e3:.2f}")

    print(f"order: ours (dry run of DualPipeV.run) vs torch.distributed.pipelining ScheduleDualPipeV, "
          f"pp={pp}, {num_micro} micro-batches")
    theirs = torch_schedule_order(pp, num_micro)
    for line in compare_orders(ours, theirs):
        print(line)
    print("  same actions, different mechanics: torch's OVERLAP_F_B runs F then B (no overlap unless a custom\n"
          "  function is registered), its I/W split covers all stage weights (ours: expert GEMMs only), and it\n"
          "  issues transfers as separate SEND/RECV actions (ours: batch_isend_irecv around each compute step).")
    return stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks of the stand-in run (2*pp stages)")
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step (>= 2*pp)")
    p.add_argument("--steps", type=int, default=2, help="runs per rank; the last one is drawn")
    p.add_argument("--from-json", help="JSON file: a list per pp rank of [op, start_s, end_s] (skips the run)")
    p.add_argument("--out", default="runs/timeline", help="output folder for timeline.png and trace.json")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            timelines = [[tuple(op) for op in tl] for tl in json.load(f)]
    else:
        timelines = record_timelines(args.pp, args.micro, args.steps)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "timelines.json"), "w") as f:  # re-drawable with --from-json
            json.dump(timelines, f)
    report(timelines, args.out)


if __name__ == "__main__":
    main()
