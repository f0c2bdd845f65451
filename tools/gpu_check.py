"""One command for one GPU: the GPU-only tests, the kernel micro-benchmarks and the Qwen3-30B-A3B benchmarks (full
width, as many layers as fit, bf16 and FP8, next to transformers), in under 8 minutes, with one summary table.

    python -m tools.gpu_check              # on a machine with one CUDA GPU (an H200 for the README numbers)
    python -m tools.gpu_check --dry-run    # anywhere: print the plan, check that the GPU tests collect

Each part runs in its own process (a clean allocator for every benchmark) under a time limit taken from what is
left of the budget, so a hang or an out-of-memory costs one row, not the run. Layers: full-width training keeps
16 bytes per parameter (fp32 weight and gradient, Adam moments) plus activations; the estimate fills ~80% of the
GPU's memory, leaving room for transformers' fp32 logits in the comparison.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from recipes.qwen3_30b_a3b.model import ModelConfig, real_config_path

ROOT = Path(__file__).resolve().parents[1]


def layers_that_fit(gpu_bytes: float, seq_len: int, micro_batch: int) -> int:
    """Decoder layers of the real width that train on one GPU: 16 B/param + ~activations of one micro-batch."""
    cfg = ModelConfig.from_hf(real_config_path())
    H, I, E, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.vocab_size
    attn = H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * 2
    layer_params = attn + E * 3 * H * I + E * H
    T = seq_len * micro_batch
    # per layer, saved for backward: ~10 [T, H] fp32 (residual, norms, attention) + the expert rows in bf16
    layer_act = 10 * T * H * 4 + T * cfg.num_experts_per_tok * (2 * H + 3 * I) * 2
    fixed = 16 * 2 * V * H + 2 * T * V * 4  # embedding + LM head; transformers' fp32 logits and their gradient
    return max(1, min(cfg.num_hidden_layers, int((0.8 * gpu_bytes - fixed) / (16 * layer_params + layer_act))))


def plan(layers: int, steps: int) -> list[tuple[str, list[str], float]]:
    """(name, command, share of the time budget)."""
    py = sys.executable
    bench = [py, "-m", "tools.bench", "--size", "wide", "--layers", str(layers), "--steps", str(steps), "--warmup", "2"]
    return [("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "tests/"], 0.30),
            ("kernel micro-benchmarks", [py, "-m", "tools.bench_kernels"], 0.10),
            (f"bench wide x{layers} bf16 + compile vs transformers", [*bench, "--vs-hf"], 0.35),
            (f"bench wide x{layers} fp8 + compile", [*bench, "--fp8"], 0.25)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and collect the GPU tests; run nothing else")
    p.add_argument("--budget", type=float, default=470.0, help="seconds for everything (the target is < 8 min)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the benchmarks (0: as many as fit)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per benchmark")
    args = p.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise ValueError("no CUDA device: run on a GPU machine, or pass --dry-run")
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else 139 * 2**30
    layers = args.layers or layers_that_fit(gpu_bytes, seq_len=4096, micro_batch=2)
    device = torch.cuda.get_device_name(0) if cuda else "no GPU (dry run; layers for a 139 GiB H200)"
    print(f"gpu_check: {device}, torch {torch.__version__}, {gpu_bytes / 2**30:.0f} GiB -> {layers} layers", flush=True)
    steps = plan(layers, args.steps)
    if args.dry_run:
        for name, cmd, share in steps:
            print(f"  {name:<48} <= {share * args.budget:4.0f}s  {' '.join(Path(c).name if c == sys.executable else c for c in cmd)}")
        collect = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "tests/"],
                                 cwd=ROOT, capture_output=True, text=True)
        tests = [line for line in collect.stdout.splitlines() if "::" in line]
        print(f"GPU tests that would run ({len(tests)}):\n  " + "\n  ".join(tests))
        return 0 if collect.returncode == 0 and tests else 1

    summary, details, fails = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "bench.jsonl"
        for i, (name, cmd, _share) in enumerate(steps):
            # this part may use what earlier parts left over, but not the shares of the parts after it
            limit = args.budget - (time.perf_counter() - start) - sum(s for _, _, s in steps[i + 1:]) * args.budget
            if limit < 30:
                summary.append((name, "skipped", 0.0, "out of time"))
                continue
            if cmd[2] == "tools.bench":
                cmd = [*cmd, "--json", str(jsonl)]
            t0 = time.perf_counter()
            try:
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
                out, status = r.stdout + r.stderr, "ok" if r.returncode == 0 else f"FAILED rc={r.returncode}"
            except subprocess.TimeoutExpired as e:
                out, status = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "TIMEOUT"
            fails += status != "ok"
            lines = [line for line in out.splitlines() if line.strip()]
            if cmd[2] == "pytest":
                note = lines[-1] if lines else ""
            elif cmd[2] == "tools.bench" and status == "ok":
                res = json.loads(jsonl.read_text().splitlines()[-1])
                note = " | ".join(f"{r['impl']} {r['tokens_per_s']:,.0f} tok/s MFU {100 * r['mfu']:.1f}% "
                                  f"{r['step_ms']:.0f} ms {r['peak_mem_gib']:.0f} GiB" for r in res["rows"])
                if "ratio_vs_hf" in res:
                    note += f" | {res['ratio_vs_hf']:.2f}x transformers"
            else:
                note = f"{len(lines)} lines below"
            summary.append((name, status, time.perf_counter() - t0, note))
            details.append((name, lines if status != "ok" or cmd[2] == "tools.bench_kernels" else lines[-12:]))
        results = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    bf16 = [r for r in results if r["precision"] == "bf16"]
    fp8 = [r for r in results if r["precision"].endswith("fp8")]
    if bf16 and fp8:  # same data, same init: the loss curves of the two precisions
        a, b = torch.tensor(fp8[0]["losses"]), torch.tensor(bf16[0]["losses"])
        err = ((a - b).abs() / b.abs()).max().item()
        summary.append(("fp8 vs bf16 loss, same steps (max rel diff)", "ok", 0.0, f"{err:.2e} over {len(a)} steps"))

    for name, lines in details:
        print(f"\n---- {name}\n" + "\n".join(lines))
    print(f"\n{'check':<52} {'status':<14} {'s':>6}  result")
    for name, status, secs, note in summary:
        print(f"{name:<52} {status:<14} {secs:6.0f}  {note}")
    print(f"total {time.perf_counter() - start:.0f}s on {device}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
