"""Read a folder of routing traces (train.py --routing-trace N writes <out>/routing_trace/step_N.npz: core/routing.py,
README "Routing: statistics, traces, Weights & Biases") and print, per MoE layer, the load of each expert over the
traced steps, the pairs of experts that share a token's slots most often, and the experts that the most frequent
token ids go to; --png draws the load and the pairs as pictures (matplotlib, the plot extra).

    python -m tools.routing runs/qwen3_30b_a3b/routing_trace                   # every MoE layer
    python -m tools.routing runs/qwen3_30b_a3b/routing_trace --layer 3 --top 5 --png runs/routing

Definitions. Load of expert e at a step: the share of the step's kept slots (id >= 0) routed to e (1/E each when
balanced). A pair (a, b): the share of tokens whose kept slots hold both, beside what uniform random routing of k
slots would give, k(k-1) / (E(E-1)). Token ids: the `--top` most frequent over all traced tokens, each with its count
and, per layer, its three most frequent experts and the share of its occurrences that reach each. Memory: one step's
trace at a time. Legend: S traced steps, L MoE layers, N tokens per step, k slots, E experts, t frequent token ids.
"""

import argparse
from pathlib import Path

import numpy as np


def trace_files(folder) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; pass <out>/routing_trace of a run with --routing-trace N")
    files = sorted(folder.glob("step_*.npz"))
    if not files:
        raise FileNotFoundError(f"no step_*.npz in {folder}; train with --routing-trace N (every N steps) first")
    return files


def summarise(files: list[Path], top: int = 10) -> dict:
    """Over the traced steps, one file at a time (memory: one step's trace): steps [S], layer [L] (the model's index
    of each MoE layer), load_SLE (kept slots per expert), empty_L (empty slots), co_LEE (tokens holding both experts,
    diagonal: holding e), tokens [top] (the most frequent token ids), token_count [top], token_LtE (their kept slots
    per expert), tokens_per_layer (N summed over the steps), k, slots (tokens_per_layer x k)."""
    steps, load, empty, co, counts, tokens = [], [], 0, 0, {}, 0
    for path in files:  # pass 1: load, co-occurrence, token frequencies
        with np.load(path) as z:
            ids_LNk, E = z["expert_ids"].astype(np.int64), int(z["num_experts"])
            tokens, k = tokens + ids_LNk.shape[1], ids_LNk.shape[2]
            steps.append(int(z["step"]))
            layer = z["layer"]
            kept_LNk = ids_LNk >= 0
            onehot_LNE = np.zeros((*ids_LNk.shape[:2], E + 1), dtype=np.int64)  # column E: an empty slot
            np.put_along_axis(onehot_LNE, np.where(kept_LNk, ids_LNk, E), 1, axis=2)  # (a token's k ids differ)
            load.append(onehot_LNE[..., :E].sum(1))
            empty = empty + (~kept_LNk).sum((1, 2))
            held_LNE = onehot_LNE[..., :E].astype(np.float64)
            co = co + np.einsum("lne,lnf->lef", held_LNE, held_LNE)
            ids, n = np.unique(z["token_ids"], return_counts=True)
            for i, c in zip(ids.tolist(), n.tolist()):
                counts[i] = counts.get(i, 0) + c
    frequent = sorted(counts, key=lambda i: (-counts[i], i))[:top]
    token_LtE = np.zeros((len(layer), len(frequent), E), dtype=np.int64)
    for path in files:  # pass 2: the experts of the frequent token ids
        with np.load(path) as z:
            ids_LNk, tokens_N = z["expert_ids"].astype(np.int64), z["token_ids"]
            for t, token in enumerate(frequent):
                ids_LMk = ids_LNk[:, tokens_N == token]
                for lay in range(len(layer)):
                    kept = ids_LMk[lay][ids_LMk[lay] >= 0]
                    token_LtE[lay, t] += np.bincount(kept, minlength=E)
    return {"steps": np.array(steps), "layer": layer, "load_SLE": np.stack(load), "empty_L": empty, "k": k,
            "co_LEE": co.astype(np.int64), "tokens": frequent, "token_count": [counts[i] for i in frequent],
            "token_LtE": token_LtE, "tokens_per_layer": tokens, "slots": tokens * k, "top": top}


def report(s: dict, layers: list[int]) -> str:
    """The tables of `summarise`'s result, for the MoE layer rows in `layers`."""
    lines, E = [], s["load_SLE"].shape[-1]
    share_SLE = s["load_SLE"] / np.maximum(s["load_SLE"].sum(-1, keepdims=True), 1)
    for row in layers:
        co_EE = s["co_LEE"][row]
        header = f"{'step':>8} " + " ".join(f"{'e' + str(e):>5}" for e in range(E)) + "  max/mean"
        lines += [f"## MoE layer {s['layer'][row]}: load per expert, % of the step's kept slots (balanced: "
                  f"{100 / E:.1f}% each)", header]
        lines += [f"{step:>8} " + " ".join(f"{100 * x:5.1f}" for x in share_E) + f"  {share_E.max() * E:8.2f}"
                  for step, share_E in zip(s["steps"], share_SLE[:, row])]
        if s["empty_L"][row]:
            lines.append(f"empty slots: {int(s['empty_L'][row]):,} of {s['slots']:,}")
        k = co_EE.trace() / s["tokens_per_layer"]  # kept slots per token
        pairs = sorted(((co_EE[a, b], a, b) for a in range(E) for b in range(a + 1, E) if co_EE[a, b]), reverse=True)
        lines.append(f"expert pairs in one token's slots, most frequent first: % of tokens (uniform random routing: "
                     f"{100 * k * (k - 1) / max(E * (E - 1), 1):.2f}% each)")
        lines += [f"  e{a:<4} e{b:<4} {100 * c / s['tokens_per_layer']:6.2f}%  ({c:,} tokens)"
                  for c, a, b in pairs[:s["top"]]]
        lines.append(f"the {len(s['tokens'])} most frequent token ids: occurrences, their 3 most frequent experts "
                     f"(% of the token's occurrences that reach each)")
        for t, (token, count) in enumerate(zip(s["tokens"], s["token_count"])):
            slots_E = s["token_LtE"][row, t]
            best = [e for e in np.argsort(-slots_E, kind="stable")[:3] if slots_E[e]]
            lines.append(f"  token {token:>7} x{count:<8,}" + " ".join(f" e{e} {100 * slots_E[e] / count:.0f}%"
                                                                      for e in best))
        lines.append("")
    return "\n".join(lines)


def pairs_EE(co_EE: np.ndarray) -> np.ndarray:
    """The co-occurrence counts with the diagonal (tokens holding one expert) left out (NaN: drawn blank)."""
    return np.where(np.eye(len(co_EE), dtype=bool), np.nan, co_EE.astype(np.float64))


def draw(s: dict, layers: list[int], out: Path) -> list[Path]:
    """Per MoE layer, load_layer<i>.png (expert x step, share of the kept slots) and cooccurrence_layer<i>.png
    (expert x expert, share of tokens holding both, the diagonal left blank); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("note: matplotlib is not installed, no PNG drawn (pip install matplotlib, or pip install -e .[plot])")
        return []
    out.mkdir(parents=True, exist_ok=True)
    share_SLE = s["load_SLE"] / np.maximum(s["load_SLE"].sum(-1, keepdims=True), 1)
    written = []
    for row in layers:
        layer = s["layer"][row]
        for name, image, xlabel in (("load", share_SLE[:, row].T, "step"),
                                    ("cooccurrence", pairs_EE(s["co_LEE"][row]) / s["tokens_per_layer"], "expert")):
            fig, ax = plt.subplots(figsize=(8, 5))
            shown = ax.imshow(image, aspect="auto", interpolation="nearest", origin="lower")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            if name == "load":
                steps = s["steps"]
                ax.set_xticks(range(len(steps))[:: max(1, len(steps) // 10)], steps[:: max(1, len(steps) // 10)])
            what = "share of the step's kept slots" if name == "load" else "share of tokens holding both experts"
            ax.set(xlabel=xlabel, ylabel="expert", title=f"MoE layer {layer}: {what}")
            fig.colorbar(shown, ax=ax)
            fig.savefig(out / f"{name}_layer{layer}.png", dpi=100, bbox_inches="tight")
            plt.close(fig)
            written.append(out / f"{name}_layer{layer}.png")
    return written


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("folder", help="<out>/routing_trace of a train.py run with --routing-trace N")
    parser.add_argument("--layer", type=int, action="append", help="the model's index of a MoE layer (repeat for "
                        "several); default: all")
    parser.add_argument("--top", type=int, default=10, help="expert pairs and token ids shown per layer")
    parser.add_argument("--png", default="", help="also draw the load and co-occurrence of each layer into this folder")
    args = parser.parse_args(argv)
    s = summarise(trace_files(args.folder), args.top)
    known = [int(x) for x in s["layer"]]
    if any(i not in known for i in args.layer or []):
        raise ValueError(f"--layer {args.layer}: the trace's MoE layers are {known}")
    layers = [known.index(i) for i in args.layer] if args.layer else list(range(len(known)))
    per_step = s["tokens_per_layer"] // len(s["steps"])
    print(f"{len(s['steps'])} traced steps ({s['steps'][0]}-{s['steps'][-1]}), {per_step:,} tokens each, "
          f"{s['load_SLE'].shape[-1]} experts, k = {s['k']}\n")
    print(report(s, layers))
    if args.png:
        for path in draw(s, layers, Path(args.png)):
            print(f"png: {path}")
    return s


if __name__ == "__main__":
    main()
