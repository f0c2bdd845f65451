"""Compare two or more training runs side by side at the steps they all logged.

  python skills/compare-runs/scripts/compare_runs.py runs/a runs/b [--every N] [--png curves.png]

Reads <run>/metrics.jsonl, the record train.py writes on the main rank after every step (the same values as its
TensorBoard scalars, but exact: JSON keeps the full float64, TensorBoard stores float32). A resumed run appends to
the file; the last record of a step wins. Prints one table per metric (loss, grad norm, tokens/s, MFU, expert load
max/mean per MoE layer, validation loss) with a row per common step and a column per run, then draws the curves to
a PNG when matplotlib is installed (`pip install matplotlib`, the `plot` extra).
"""

import argparse
import json
import sys
from pathlib import Path

# (table title, record key, format); expert load expands to one table per layer
METRICS = [("loss", "loss", "{:.4f}"), ("grad norm", "grad_norm", "{:.4f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
           ("MFU %", "mfu", "{:.3%}"), ("optimizer step s", "opt_time", "{:.3f}"), ("val loss", "val_loss", "{:.4f}")]
LOAD = "expert_load_max_over_mean"


def read_run(run: Path) -> dict[int, dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give the --out folder of a train.py run (it holds metrics.jsonl)")
    records = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                print(f"warning: {path}:{lineno} is not complete JSON; skipped", file=sys.stderr)
                continue
            records[rec["step"]] = rec  # resumed runs append: the newest record of a step wins
    if not records:
        raise ValueError(f"{path} holds no step records yet")
    return records


def series(runs: list[dict[int, dict]]) -> list[tuple[str, str, str, callable]]:
    """(title, format, key for the curve) with a getter per table; expert load: one per layer."""
    out = [(title, fmt, key, lambda rec, key=key: rec.get(key)) for title, key, fmt in METRICS]
    layers = max((len(rec.get(LOAD) or []) for recs in runs for rec in recs.values()), default=0)
    out[5:5] = [(f"expert load max/mean, MoE layer {i}", "{:.3f}", f"{LOAD}[{i}]",
                 lambda rec, i=i: (rec.get(LOAD) or [None] * (i + 1))[i] if len(rec.get(LOAD) or []) > i else None)
                for i in range(layers)]
    return out


def tables(names: list[str], runs: list[dict[int, dict]], steps: list[int]) -> str:
    lines = []
    width = max(12, *(len(n) for n in names))
    for title, fmt, _, get in series(runs):
        rows = [(s, [get(r[s]) for r in runs]) for s in steps]
        rows = [(s, vals) for s, vals in rows if any(v is not None for v in vals)]
        if not rows:
            continue  # e.g. val loss when no run evaluated
        lines.append(f"## {title}")
        lines.append(f"{'step':>6} " + " ".join(f"{n:>{width}}" for n in names))
        for s, vals in rows:
            lines.append(f"{s:>6} " + " ".join(f"{'-' if v is None else fmt.format(v):>{width}}" for v in vals))
        lines.append("")
    return "\n".join(lines)


def draw(png: Path, names: list[str], runs: list[dict[int, dict]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("note: matplotlib is not installed, no PNG drawn (pip install matplotlib, or pip install -e .[plot])")
        return False
    panels = [s for s in series(runs) if any(s[3](rec) is not None for r in runs for rec in r.values())]
    cols = 2
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(12, 3 * ((len(panels) + 1) // cols)),
                             squeeze=False)
    for ax, (title, _, key, get) in zip(axes.flat, panels):
        scale = 100 if key == "mfu" else 1  # the table's unit (%)
        for name, recs in zip(names, runs):
            pts = [(s, scale * get(rec)) for s, rec in sorted(recs.items()) if get(rec) is not None]
            if pts:
                ax.plot(*zip(*pts), label=name, marker="." if len(pts) < 50 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"curves: {png}")
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="--out folders of train.py runs (each holds metrics.jsonl)")
    p.add_argument("--every", type=int, default=1, help="print every N-th common step (the last one always)")
    p.add_argument("--png", help="where to draw the curves (default: compare_runs.png in the current folder)",
                   default="compare_runs.png")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("give at least two run folders to compare")
    if args.every < 1:
        p.error(f"--every must be >= 1, got {args.every}")
    paths = [Path(r) for r in args.runs]
    runs = [read_run(r) for r in paths]
    names = [r.name or str(r) for r in paths]
    if len(set(names)) < len(names):
        names = [str(r) for r in paths]
    common = sorted(set.intersection(*(set(r) for r in runs)))
    if not common:
        raise ValueError("the runs share no logged step: " + ", ".join(f"{n}: steps {min(r)}-{max(r)}" for n, r in zip(names, runs)))
    shown = [s for i, s in enumerate(common) if i % args.every == 0 or s == common[-1]]
    print(f"{len(common)} common steps ({common[0]}-{common[-1]}) of " + ", ".join(f"{n}: {len(r)}" for n, r in zip(names, runs)))
    print()
    print(tables(names, runs, shown))
    draw(Path(args.png), names, runs)
    return names, runs, shown


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from core.reliability import run_main

    run_main(main)
