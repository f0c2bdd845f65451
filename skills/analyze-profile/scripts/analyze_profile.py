"""Summarise the traces train.py --profile-steps A-B wrote (<out>/profile/rank<N>.json, one per rank).

    python skills/analyze-profile/scripts/analyze_profile.py runs/qwen3_30b_a3b/profile [--top 20] [--csv FILE]

Only what starts inside the profiled steps (the `ProfilerStep#<step>` annotations) counts. Time of an event:
on a GPU trace (one with kernels) each kernel's duration; on a CPU trace each op's self time (its duration minus
its children's on the same thread), so that nothing is counted twice.
1. The top operators/kernels by total time summed over all ranks: name, total ms, calls, mean ms (a table, and
   the same rows at full precision in a CSV, default <profile dir>/top_ops.csv).
2. Per rank, shares of the profiled steps' wall time: compute (time with any compute op/kernel running),
   exposed communication (communication with no compute running beside it) and idle (nothing running); they
   add up to 1. Overlap: the share of all communication time during which compute ran too.
Categories are tools/gpu_check.py's (name_category): all-to-all and other collectives (gloo/NCCL, all-gather,
reduce-scatter, all-reduce, send/recv, ...) are communication, the rest compute.
"""

import argparse
import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, so `tools` imports

from tools.gpu_check import COMMUNICATION, name_category  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
STEP = re.compile(r"ProfilerStep#\d+")


def union(intervals) -> list[tuple[float, float]]:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs, ys) -> list[tuple[float, float]]:
    """Intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def rank_files(profile_dir: Path) -> list[tuple[int, Path]]:
    files = sorted((int(m.group(1)), p) for p in profile_dir.glob("rank*.json")
                   if (m := re.fullmatch(r"rank(\d+)\.json", p.name)))
    if not files:
        raise SystemExit(f"no rank<N>.json in {profile_dir}: run train.py with --profile-steps A-B "
                         f"(skills/capture-profile/SKILL.md) and pass its <out>/profile folder")
    return files


def analyze_rank(events: list[dict]) -> dict:
    """One rank's trace -> {"device", "ops": {name: [ms, calls]}, "window_ms", "compute_ms", "comm_ms",
    "exposed_comm_ms", "overlap_ms", "idle_ms", "category_ms"}."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = union((e["ts"], e["ts"] + e["dur"]) for e in spans if STEP.fullmatch(e["name"]))
    if not steps:
        raise SystemExit("a trace has no ProfilerStep#N annotation: was it written by train.py --profile-steps?")
    inside = lambda e: any(a <= e["ts"] < b for a, b in steps)  # noqa: E731
    host = [e for e in spans if e.get("cat") in HOST_CATS and not STEP.fullmatch(e["name"])]
    # nesting on each thread: parent of every host event, and each event's children (for self time)
    parent, children = {}, defaultdict(list)
    by_thread = defaultdict(list)
    for i, e in enumerate(host):
        by_thread[(e["pid"], e["tid"])].append(i)
    for idx in by_thread.values():
        stack = []
        for i in sorted(idx, key=lambda i: (host[i]["ts"], -host[i]["dur"])):
            end = host[i]["ts"] + host[i]["dur"]
            while stack and host[stack[-1]]["ts"] + host[stack[-1]]["dur"] < end:
                stack.pop()
            parent[i] = stack[-1] if stack else None
            if stack:
                children[stack[-1]].append(i)
            stack.append(i)

    def chain(i):
        names = []
        while i is not None:
            names.append(host[i]["name"])
            i = parent[i]
        return names

    kernels = [e for e in spans if e.get("cat") in DEVICE_CATS and inside(e)]
    ops, busy = defaultdict(lambda: [0.0, 0]), defaultdict(list)  # busy: category -> intervals (us)
    if kernels:  # GPU: kernels, categorised by their own name and the ops that launched them
        launch = {host[i]["args"]["correlation"]: i for i in range(len(host))
                  if host[i].get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in host[i].get("args", {})}
        for k in kernels:
            names = [k["name"]] + chain(launch.get(k.get("args", {}).get("correlation")))
            busy[name_category(names) or "other compute"].append((k["ts"], k["ts"] + k["dur"]))
            ops[k["name"]][0] += k["dur"] / 1e3
            ops[k["name"]][1] += 1
    else:  # CPU: ops' self time, the parts of each op's span its children do not cover
        for i, e in enumerate(host):
            if e.get("cat") == "cuda_runtime" or not inside(e):
                continue
            kids = union((host[c]["ts"], host[c]["ts"] + host[c]["dur"]) for c in children[i])
            edges = [e["ts"]] + [t for kid in kids for t in kid] + [e["ts"] + e["dur"]]  # the gaps between kids
            own = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]
            busy[name_category(chain(i)) or "other compute"] += own
            ops[e["name"]][0] += length(own) / 1e3
            ops[e["name"]][1] += 1
    clip = lambda xs: intersect(union(xs), steps)  # noqa: E731
    comm = clip(iv for c, xs in busy.items() if c in COMMUNICATION for iv in xs)
    compute = clip(iv for c, xs in busy.items() if c not in COMMUNICATION for iv in xs)
    overlap = length(intersect(comm, compute))
    window, any_busy = length(steps), length(union(comm + compute))
    return {"device": "cuda" if kernels else "cpu", "ops": dict(ops), "window_ms": window / 1e3,
            "compute_ms": length(compute) / 1e3, "comm_ms": length(comm) / 1e3, "overlap_ms": overlap / 1e3,
            "exposed_comm_ms": (length(comm) - overlap) / 1e3, "idle_ms": (window - any_busy) / 1e3,
            "category_ms": {c: length(clip(xs)) / 1e3 for c, xs in sorted(busy.items())}}


def analyze(profile_dir: Path) -> dict:
    ranks = {r: analyze_rank(json.loads(p.read_text())["traceEvents"]) for r, p in rank_files(profile_dir)}
    total = defaultdict(lambda: [0.0, 0])
    for res in ranks.values():
        for name, (ms, calls) in res["ops"].items():
            total[name][0] += ms
            total[name][1] += calls
    top = sorted(((n, ms, c) for n, (ms, c) in total.items()), key=lambda row: -row[1])
    return {"ranks": ranks, "top": top}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile_dir", type=Path, help="<out>/profile of a train.py --profile-steps run")
    p.add_argument("--top", type=int, default=20, help="rows of the operator table (default 20)")
    p.add_argument("--csv", type=Path, default=None, help="the table's file (default <profile_dir>/top_ops.csv)")
    args = p.parse_args(argv)
    if not args.profile_dir.is_dir():
        raise SystemExit(f"{args.profile_dir} is not a folder: pass <out>/profile of a --profile-steps run")
    res = analyze(args.profile_dir)
    ranks, top = res["ranks"], res["top"][: args.top]
    device = {r["device"] for r in ranks.values()}
    what = "kernels (device time)" if device == {"cuda"} else "operators (CPU self time)"
    print(f"top {len(top)} {what}, summed over {len(ranks)} ranks")
    width = max([len("name")] + [min(len(n), 80) for n, _, _ in top])
    print(f"{'name':<{width}} {'total ms':>11} {'calls':>7} {'mean ms':>10}")
    for name, ms, calls in top:
        print(f"{name[:80]:<{width}} {ms:11.3f} {calls:7d} {ms / calls:10.4f}")
    csv_path = args.csv or args.profile_dir / "top_ops.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "total_ms", "calls", "mean_ms"])
        w.writerows([name, f"{ms:.6f}", calls, f"{ms / calls:.6f}"] for name, ms, calls in top)
    print(f"csv: {csv_path}\n")
    print(f"{'rank':>4} {'device':>6} {'steps ms':>10} {'compute':>8} {'comm':>8} {'idle':>8} {'comm ms':>9} "
          f"{'overlapped':>10}")
    for r, x in sorted(ranks.items()):
        W = x["window_ms"]
        print(f"{r:>4} {x['device']:>6} {W:10.2f} {x['compute_ms'] / W:8.1%} {x['exposed_comm_ms'] / W:8.1%} "
              f"{x['idle_ms'] / W:8.1%} {x['comm_ms']:9.2f} {x['overlap_ms'] / max(x['comm_ms'], 1e-9):10.1%}")
    print("compute + comm (communication with no compute beside it) + idle = 100% of the profiled steps; "
          "overlapped: share of all communication time with compute running too")
    for r, x in sorted(ranks.items()):
        print(f"rank {r} busy ms by category: " + ", ".join(f"{c} {ms:.2f}" for c, ms in x["category_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
