"""One command for the GPU machine: the GPU-only tests, the kernel micro-benchmarks, the Qwen3-30B-A3B benchmarks
(full width, as many layers as fit, bf16 and FP8, next to transformers), a per-step profile of the bf16 run, the
layout planner's calibration (tools/calibrate.py: measured GEMM, FP8 GEMM, grouped GEMM, attention, launch and
memory rates -> runs/calibration_gpu.json, read by `python -m tools.plan ... --calibration`), and with two or more
GPUs the multi-process layouts (pp=2, ep=2, cp=2 on NCCL against one GPU), with one summary table.

    python -m tools.gpu_check              # GPU machine; without CUDA: the reduced CPU form (layouts on gloo, the
                                           # CPU profile; the GPU parts are listed as skipped)
    python -m tools.gpu_check --dry-run    # anywhere: print the plan, check that the GPU tests collect
    python -m tools.gpu_check --profile --dtype bf16 ...   # one part alone: profile train.py (flags after it)

Each part runs in its own process (a clean allocator for every benchmark) under a time limit taken from what is
left of the budget, so a hang or an out-of-memory costs one row, not the run. Layers: full-width training keeps
16 bytes per parameter (fp32 weight and gradient, Adam moments) plus activations; the estimate fills ~80% of the
GPU's memory, leaving room for transformers' fp32 logits in the comparison.

Layouts: the tiny config (4 layers) in fp32 for a few steps through tools.bench under torchrun, the same batches
as the one-process run; every step's loss must agree (relative 1e-4 on GPU, 1e-5 on CPU).
Profile (torch.profiler, one step after a warm-up step, step boundaries at the optimizer step): the time of the
step's device kernels (CPU: ops' own time) by what launched them: expert GEMMs (grouped / expert matmuls, forward
and backward), attention (SDPA, flash, flex), all-to-all, other collectives, weight casts (a cast whose input has
a parameter's shape, and its backward), the rest; idle is the part of the step with no kernel (CPU: no op) running.
On a GPU the communication kernels overlap compute, so the shares may add up to more than the busy time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from recipes.qwen3_30b_a3b.model import ModelConfig, real_config_path, tiny_config_path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = (("pp=2", ["--pp", "2"]), ("ep=2", ["--ep", "2"]), ("cp=2", ["--cp", "2"]))
COMMUNICATION = ("all-to-all", "other collectives")  # the rest of CATEGORIES but idle: compute
CATEGORIES = ("expert GEMMs", "attention", "all-to-all", "other collectives", "weight casts", "other compute", "idle")


def layers_that_fit(gpu_bytes: float, seq_len: int, micro_batch: int) -> int:
    """Decoder layers of the real width that train on one GPU: 16 B/param + ~activations of one micro-batch (of the
    Qwen3 recipe, the one this check benchmarks: its config's fields)."""
    cfg = ModelConfig.from_hf(real_config_path())
    H, I, E, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.vocab_size
    attn = H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * 2
    layer_params = attn + E * 3 * H * I + E * H
    T = seq_len * micro_batch
    # per layer, saved for backward: ~10 [T, H] fp32 (residual, norms, attention) + the expert rows in bf16
    layer_act = 10 * T * H * 4 + T * cfg.slots_per_token * (2 * H + 3 * I) * 2
    fixed = 16 * 2 * V * H + 2 * T * V * 4  # embedding + LM head; transformers' fp32 logits and their gradient
    return max(1, min(cfg.num_hidden_layers, int((0.8 * gpu_bytes - fixed) / (16 * layer_params + layer_act))))


def plan(layers: int, steps: int, gpus: int = 1) -> list[tuple[str, list[str], float]]:
    """(name, command, share of the time budget). gpus 0: the reduced CPU form (layouts on gloo, CPU profile)."""
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    dev = "cuda" if gpus else "cpu"
    tiny = ["-m", "tools.bench", "--size", "tiny", "--seq-len", "64", "--batch", "8", "--micro-batch", "2",
            "--steps", "3", "--warmup", "0", "--dtype", "fp32", "--no-compile", "--device", dev]
    profile = [py, "-m", "tools.gpu_check", "--profile", "--device", dev, "--dtype", "bf16"]
    layouts = [("layouts: one process (reference)", [py, *tiny], 0.04)] + \
        [(f"layouts: {name} on {'NCCL' if gpus else 'gloo'}", [*torchrun, *tiny, *flags], 0.06)
         for name, flags in LAYOUTS] + \
        [("profile: bf16 step, tiny, ep=2", [*torchrun, *profile[1:], "--ep", "2"], 0.06)]
    bench = [py, "-m", "tools.bench", "--size", "wide", "--layers", str(layers), "--steps", str(steps), "--warmup", "2"]
    gpu_parts = [("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "tests/"], 0.22),
                 ("kernel micro-benchmarks", [py, "-m", "tools.bench_kernels"], 0.06),
                 (f"bench wide x{layers} bf16 + compile vs transformers", [*bench, "--vs-hf"], 0.26),
                 (f"bench wide x{layers} fp8 + compile", [*bench, "--fp8"], 0.16),
                 (f"profile: bf16 step, wide x{layers}, eager",
                  [*profile, "--config-size", "wide", "--layers", str(layers), "--no-compile"], 0.08),
                 ("planner calibration -> runs/calibration_gpu.json",
                  [py, "-m", "tools.calibrate", "--device", "cuda", "--out", "runs/calibration_gpu.json"], 0.04)]
    parts = [*layouts, ("profile: bf16 step, tiny", profile, 0.18)] if not gpus else \
        gpu_parts + (layouts if gpus >= 2 else [])
    total = sum(share for _, _, share in parts)
    return [(name, cmd, share / total) for name, cmd, share in parts]


# ------------------------------------------------------------------------------------------- profile


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace(" ", "")


def name_category(names) -> str | None:
    """The category an op's name and its parents' names imply (an op, or for a kernel the kernel and the ops that
    launched it), or None: then it is compute of no named kind. Also used by skills/analyze-profile on traces."""
    names = " ".join(_norm(n) for n in names)
    if "alltoall" in names:
        return "all-to-all"
    if any(k in names for k in ("nccl", "gloo", "allgather", "reducescatter", "allreduce", "c10d", "sendrecv",
                                "broadcast", "recordparamcomms")):
        return "other collectives"
    if any(k in names for k in ("groupedmm", "expertmatmul", "groupedgemm")):
        return "expert GEMMs"
    if any(k in names for k in ("attention", "flash", "fmha", "flex")):
        return "attention"
    return None


def _category(evt, param_shapes: set, fwd_category: dict) -> str:
    """What an op (or the op that launched a kernel) belongs to, from its own name and its parents'."""
    chain = []
    while evt is not None:
        chain.append(evt)
        evt = evt.cpu_parent
    category = name_category(e.name for e in chain)
    if category:
        return category
    for e in chain:
        if e.name == "aten::_to_copy" and e.input_shapes and tuple(e.input_shapes[0]) in param_shapes:
            return "weight casts"
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in fwd_category:
            return fwd_category[e.sequence_nr]  # backward of a tagged forward op (the cast of a weight)
    return "other compute"


def _union_us(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def step_shares(events, param_shapes: set) -> dict:
    """Milliseconds and shares of one profiled step (the last ProfilerStep) by category: device kernels by the op
    that launched them when there are any (CUDA), else CPU ops by their own time. idle: the step minus the union
    of the kernels (ops) that ran in it."""
    from torch.autograd import DeviceType

    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    if not steps:
        raise ValueError("no ProfilerStep in the trace: profile at least one step with a schedule")
    t0, t1 = steps[-1].time_range.start, steps[-1].time_range.end
    inside = [e for e in events if t0 <= e.time_range.start < t1 and not e.name.startswith("ProfilerStep")]
    # async CPU events (a collective that completes on another thread, the optimizer step the step boundary cuts)
    # span time the thread spends elsewhere: left out of both the shares and the busy time
    cpu_ops = [e for e in inside if e.device_type == DeviceType.CPU and not e.is_async]
    kernels = [e for e in inside if e.device_type == DeviceType.CUDA]
    fwd_category = {}  # sequence number of a forward op -> category, for its backward
    for e in cpu_ops:
        if e.name == "aten::_to_copy" and e.sequence_nr >= 0 and e.input_shapes and \
                tuple(e.input_shapes[0]) in param_shapes:
            fwd_category[e.sequence_nr] = "weight casts"
    ms = dict.fromkeys(CATEGORIES, 0.0)
    if kernels:
        launcher = {e.id: e for e in events if e.device_type == DeviceType.CPU}
        for k in kernels:
            category = _category(launcher.get(k.linked_correlation_id), param_shapes, fwd_category)
            ms[category] += k.time_range.elapsed_us() / 1e3
        busy = _union_us((k.time_range.start, k.time_range.end) for k in kernels)
    else:
        for e in cpu_ops:
            ms[_category(e, param_shapes, fwd_category)] += e.self_cpu_time_total / 1e3
        busy = _union_us((e.time_range.start, e.time_range.end) for e in cpu_ops)
    step_ms = (t1 - t0) / 1e3
    ms["idle"] = max(0.0, step_ms - busy / 1e3)
    return {"device": "cuda" if kernels else "cpu", "step_ms": step_ms,
            "ms": ms, "share": {c: v / step_ms for c, v in ms.items()}}


def profile_training(flags: list[str], device: str) -> dict:
    """train.py (flags: --config, --seq-len, --global-batch, ... ) on synthetic data (tools.bench's) for 3 steps
    under torch.profiler; the third step is recorded (the first two: warm-up, compilation). Its step_shares."""
    import torch.optim.optimizer as optim_hooks
    from torch.profiler import ProfilerActivity, profile, schedule

    from recipes.qwen3_30b_a3b import train
    from tools.bench import synthetic_data

    value = lambda flag: flags[flags.index(flag) + 1]  # noqa: E731
    tokens = 3 * int(value("--global-batch")) * (int(value("--seq-len")) + 1) + 1
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with tempfile.TemporaryDirectory(prefix="profile_") as tmp:
        synthetic_data(Path(tmp) / "data", ModelConfig.from_hf(value("--config")).vocab_size, tokens, seed=0)
        argv = ["--data", str(Path(tmp) / "data"), "--out", str(Path(tmp) / "run"), "--steps", "3",
                "--ckpt-every", "0", "--device", device, *flags]
        with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=1), record_shapes=True) as prof:
            hook = optim_hooks.register_optimizer_step_post_hook(lambda *_: prof.step())  # a step ends at AdamW
            try:
                _, model = train.main(argv)
            finally:
                hook.remove()
    return step_shares(prof.events(), {tuple(p.shape) for p in model.parameters()})


def print_shares(res: dict) -> None:
    print(f"profile of one training step on {res['device']}: {res['step_ms']:.1f} ms")
    print(f"{'what':<20} {'ms':>10} {'of step':>8}")
    for c in CATEGORIES:
        print(f"{c:<20} {res['ms'][c]:10.2f} {100 * res['share'][c]:7.1f}%")


def profile_main(argv: list[str]) -> int:
    """--profile [--device D] [--config-size wide --layers L] [train.py flags]: print the step's shares; with
    --json F append them to F."""
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config-size", choices=["tiny", "wide"], default="tiny")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", default="")
    args, flags = p.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile_cfg_") as tmp:
        if args.config_size == "wide":  # the real width with --layers layers, sequences of 4096 in pairs
            hf = json.loads(real_config_path().read_text())
            hf["num_hidden_layers"] = args.layers
            (Path(tmp) / "config.json").write_text(json.dumps(hf))
            flags = ["--config", str(Path(tmp) / "config.json"), "--seq-len", "4096", "--global-batch", "4",
                     "--micro-batch", "2", *flags]
        else:
            flags = ["--config", str(tiny_config_path()), "--seq-len", "128", "--global-batch", "8",
                     "--micro-batch", "2", *flags]
        res = profile_training(flags, args.device)
    if int(os.environ.get("RANK", "0")) == 0:
        print_shares(res)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"profile": res}) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------- main


def layout_parity(results: list[dict], tol: float) -> list[tuple[str, str, float, str]]:
    """Summary rows: each layout's per-step losses against the one-process run's (tiny, fp32, same batches)."""
    tiny = [r for r in results if r.get("size") == "tiny"]
    ref = next((r for r in tiny if r["layout"] == "single"), None)
    rows = []
    for r in tiny:
        if ref is None or r is ref:
            continue
        a, b = torch.tensor(r["losses"]), torch.tensor(ref["losses"])
        err = ((a - b).abs() / b.abs()).max().item() if a.shape == b.shape else float("inf")
        rows.append((f"layout {r['layout']} vs one process: losses", "ok" if err <= tol else "FAILED", 0.0,
                     f"max rel diff {err:.1e} over {len(a)} steps (tol {tol:.0e}), world {r['world']}"))
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--profile" in argv:
        return profile_main([a for a in argv if a != "--profile"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and collect the GPU tests; run nothing else")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds for everything (default 470 with one GPU or none, 600 with two or more)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the benchmarks (0: as many as fit)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per benchmark")
    args = p.parse_args(argv)
    start = time.perf_counter()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if gpus else 139 * 2**30
    layers = args.layers or layers_that_fit(gpu_bytes, seq_len=4096, micro_batch=2)
    device = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "CPU (no CUDA: reduced form)"
    print(f"gpu_check: {device}, torch {torch.__version__}, {gpu_bytes / 2**30:.0f} GiB -> {layers} layers", flush=True)
    steps = plan(layers, args.steps, gpus)
    args.budget = args.budget or (600.0 if gpus >= 2 else 470.0)
    if args.dry_run:
        for gpu_count in (1, 2):
            print(f"plan with {gpu_count} GPU(s):")
            for name, cmd, share in plan(layers, args.steps, gpu_count):
                print(f"  {name:<48} <= {share * args.budget:4.0f}s  "
                      f"{' '.join(Path(c).name if c == sys.executable else c for c in cmd)}")
        collect = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "tests/"],
                                 cwd=ROOT, capture_output=True, text=True)
        tests = [line for line in collect.stdout.splitlines() if "::" in line]
        print(f"GPU tests that would run ({len(tests)}):\n  " + "\n  ".join(tests))
        return 0 if collect.returncode == 0 and tests else 1

    summary, details, fails = [], [], 0
    if not gpus:
        summary += [(name, "skipped", 0.0, "needs CUDA") for name, _, _ in plan(layers, args.steps, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "results.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if not gpus else "8")}
        for i, (name, cmd, _share) in enumerate(steps):
            # this part may use what earlier parts left over, but not the shares of the parts after it
            limit = args.budget - (time.perf_counter() - start) - sum(s for _, _, s in steps[i + 1:]) * args.budget
            if limit < 30:
                summary.append((name, "skipped", 0.0, "out of time"))
                continue
            kind = "pytest" if "pytest" in cmd else "profile" if "--profile" in cmd else \
                "bench" if "tools.bench" in cmd else "other"
            if kind in ("bench", "profile"):
                cmd = [*cmd, "--json", str(jsonl)]
            lines_before = len(jsonl.read_text().splitlines()) if jsonl.exists() else 0
            t0 = time.perf_counter()
            try:
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit, env=env)
                out, status = r.stdout + r.stderr, "ok" if r.returncode == 0 else f"FAILED rc={r.returncode}"
            except subprocess.TimeoutExpired as e:
                out, status = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "TIMEOUT"
            fails += status != "ok"
            lines = [line for line in out.splitlines() if line.strip()]
            new = jsonl.read_text().splitlines()[lines_before:] if jsonl.exists() else []
            note = f"{len(lines)} lines below"
            if kind == "pytest":
                note = lines[-1] if lines else ""
            elif kind == "bench" and status == "ok" and new:
                res = json.loads(new[-1])
                note = " | ".join(f"{r['impl']} {r['tokens_per_s']:,.0f} tok/s MFU {100 * r['mfu']:.1f}% "
                                  f"{r['step_ms']:.0f} ms {r['peak_mem_gib']:.1f} GiB" for r in res["rows"])
                if "ratio_vs_hf" in res:
                    note += f" | {res['ratio_vs_hf']:.2f}x transformers" + ("" if res["same_precision"] else
                                                                            " (UNLIKE PRECISION)")
            elif kind == "profile" and status == "ok" and new:
                share = json.loads(new[-1])["profile"]["share"]
                note = " | ".join(f"{c} {100 * share[c]:.0f}%" for c in CATEGORIES if share[c] >= 0.005)
            summary.append((name, status, time.perf_counter() - t0, note))
            details.append((name, lines if status != "ok" or kind in ("profile", "other") or
                            "tools.bench_kernels" in cmd else lines[-12:]))
        results = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    results = [r for r in results if "profile" not in r]
    parity = layout_parity(results, tol=1e-4 if gpus else 1e-5)
    summary += parity
    fails += sum(status == "FAILED" for _, status, _, _ in parity)
    bf16 = [r for r in results if r["precision"] == "bf16" and r["size"] == "wide"]
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
