"""Benchmark the Qwen3-MoE training step: tokens/s, MFU, step time, peak memory; with --vs-hf, next to transformers.

    python -m tools.bench --size tiny --vs-hf                        # CPU: the tiny model, ours vs transformers
    python -m tools.bench --size wide --layers 8 --fp8 --vs-hf       # GPU: real width (2048, 128 experts), 8 layers
    torchrun --nproc-per-node 8 -m tools.bench --size real --ep 8    # a layout: --dp/--ep/--cp go to train.py
    python -m tools.bench --optimizer-step --rounds 3                 # each recipe's optimizer step, AdamW vs Muon
    python -m tools.bench --newton-schulz-share                       # Muon's FLOPs vs a training step, released models
    python -m tools.bench --document-mask-cost --steps 10 --rounds 2   # --document-mask vs plain causal, each recipe
    python -m tools.bench --checkpoint-cost --steps 8 --rounds 2        # a checkpoint every step: none, sync, async
    python -m tools.bench --train-ab "" "--optimizer muon" --nproc 4 --pp 2 --ep 2 --rounds 3   # train.py A vs B

Our step is recipes/qwen3_30b_a3b/train.py's own loop: train.main on a synthetic token dataset written to a temp
folder (data loader, micro-batches, forward + backward, gradient reduction, clipping, AdamW, metrics), so every
layout of train.py runs here under torchrun. The transformers step runs Qwen3MoeForCausalLM with the same config
(router aux loss on), the same batches, micro-batch split and precision (fp32 weights, bf16 autocast when our run
uses it, and then the expert weights cast to bf16 in each forward: transformers' grouped GEMM casts its input to
the weights' dtype, so it would otherwise run the experts in fp32): forward with labels + backward + clipping +
AdamW (fused on GPU, foreach on CPU), on one process, with transformers' default experts implementation
(grouped_mm when torch has it) and attention (sdpa). The dtypes and path of its expert GEMMs are printed.
MFU is against the datasheet's dense bf16 peak on a GPU (core/metrics.py), with a measured bf16 matmul beside.
Step times are medians (and minima: "best") over the measured steps, after warm-up steps (compilation, allocator, autotuning); with
--rounds n the two implementations take turns n times (on a shared machine, load that comes and goes then hits
both alike). Peak memory is the CUDA allocator's peak, or on CPU the process's resident high-water mark (reset
before each run through /proc/self/clear_refs).

--optimizer-step times, for every recipe, what the optimizer adds to a training step (gradient reduction, clipping,
the step: train.py's three calls) with FSDPAdamW and with MuonAdamW (on FSDP2's shards under torchrun), on random
gradients of the recipe's model (--size tiny: its config_tiny.json; wide: its config.json with --layers layers,
default 2), the two taking turns --rounds times; under torchrun --dp/--ep set the layout. --newton-schulz-share
counts (no run) the Newton-Schulz FLOPs of one Muon step of each released model (recipes/*/config.json, every matrix
of Model.parameter_rules' muon) against its training step's at launch.sh's GPU defaults on one 8-GPU node: 64 sequences
of 4,096 tokens (flops_per_token).

--train-ab A B runs train.py under torchrun (--nproc ranks, the layout flags after the others) with flag set A, then
B, taking turns --rounds times, each run a fresh process group, and compares their step times (from metrics.jsonl,
after --warmup steps): medians and bests of the wall-clock time, and the median of rank 0's CPU time per step
(`cpu_time`, which other jobs on a shared machine do not inflate, but which leaves out time spent waiting), B / A. The two flag sets are strings as on a command line; anything
train.py takes (another optimizer, precision, recompute, overlap) can be set against anything else.

--checkpoint-cost runs train.py (the tiny model unless --size) with no checkpoints, a blocking checkpoint after
every step and an asynchronous one (--async-checkpoint) after every step, taking turns --rounds times, and times
whole loop iterations (from one step's log line to the next: the step plus its save), medians over the measured
steps; the checkpoint's size is the saved folder's.
"""

import argparse
import contextlib
import gc
import io
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from core.data import TokenLoader
from core.fsdp import FSDPAdamW, shard_model
from core.mesh import build_mesh, destroy_mesh
from core.metrics import measure_matmul_flops, peak_flops_and_source, timed
from core.muon import MuonAdamW, newton_schulz_flops
from core.training import parameter_rules
from recipes import recipe_names
from recipes.qwen3_30b_a3b import train
from recipes.qwen3_30b_a3b.model import ModelConfig, flops_per_token, real_config_path, tiny_config_path
from tools.shards import write_shards

SIZES = {"tiny": (tiny_config_path(), None), "wide": (real_config_path(), 2), "real": (real_config_path(), None)}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the resident-set high-water mark (VmHWM)


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def synthetic_data(folder: Path, vocab: int, tokens: int, seed: int) -> None:
    """Random documents of 100-2000 tokens (uniform ids), packed like a real dataset."""
    rng = random.Random(seed)
    docs, n = [], 0
    while n < tokens:
        doc = [rng.randrange(3, vocab) for _ in range(rng.randrange(100, 2000))]
        docs.append(doc)
        n += len(doc) + 1
    write_shards(docs, folder, vocab_size=vocab, eos_id=2, tokenizer={"kind": "none"}, shard_tokens=n)


class ExpertsInDtype(torch.nn.Module):
    """transformers' experts with their weights cast to `dtype` in every forward, as autocast casts nn.Linear
    weights and as our bf16 path runs its expert GEMMs: transformers' grouped GEMM casts its input to the weights'
    dtype, so with fp32 master weights its experts would run in fp32 under autocast."""

    def __init__(self, experts: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = experts, dtype

    def forward(self, *args, **kwargs):
        params = {name: p.to(self.dtype) for name, p in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, params, args, kwargs)


def record_expert_gemms(seen: dict) -> None:
    """Note the dtypes and the path of transformers' first grouped expert GEMM (transformers.integrations.moe)."""
    from transformers.integrations import moe

    gemm = getattr(moe, "_grouped_mm", None)
    if gemm is None or getattr(gemm, "recording", False):
        return

    def recorded(input, weight, offs):
        if not seen:
            fast = getattr(moe, "_can_use_grouped_mm", lambda *a: True)(input, weight, offs)
            path = ("torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else
                    "torch._grouped_mm") if fast else "transformers' fallback (loop over experts)"
            seen.update(received=str(input.dtype).replace("torch.", ""), path=path,
                        gemm=str(weight.dtype).replace("torch.", ""))  # the input is cast to the weights' dtype
        return gemm(input, weight, offs)

    recorded.recording = True
    moe._grouped_mm = recorded


def hf_model(cfg: ModelConfig, device: torch.device, use_bf16: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**cfg.to_hf(), "output_router_logits": True}))
    cuda = device.type == "cuda"
    if use_bf16:
        for block in model.modules():
            if isinstance(getattr(block, "experts", None), torch.nn.Module):
                block.experts = ExpertsInDtype(block.experts, torch.bfloat16)
    print(f"transformers: experts {getattr(model.config, '_experts_implementation', '?')}, "
          f"attention {getattr(model.config, '_attn_implementation', '?')}", flush=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda, foreach=not cuda)


def hf_steps(model, opt, loader: TokenLoader, args, device: torch.device, use_bf16: bool) -> list[float]:
    """transformers' training step on the same batches; returns each step's seconds."""
    cuda, n_micro = device.type == "cuda", args.batch // args.micro_batch
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        input_ids, _ = (t.to(device) for t in loader.next_batch())
        for mb in range(n_micro):
            ids = input_ids[mb * args.micro_batch:(mb + 1) * args.micro_batch]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                loss = model(input_ids=ids, labels=ids).loss / n_micro  # labels shifted inside; + aux loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # like our loop's logging: the step is done when its loss is on the host
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def row(name: str, times: list[float], tokens: int, flops_tok: float, peak: float, mem: float) -> dict:
    step_s = statistics.median(times)
    tps = tokens / step_s
    return {"impl": name, "tokens_per_s": tps, "mfu": flops_tok * tps / peak, "step_ms": 1000 * step_s,
            "best_ms": 1000 * min(times), "peak_mem_gib": mem}


def document_mask_cost(args) -> dict:
    """{recipe: {"plain_ms", "masked_ms", "ratio"}}: forward + backward of one micro-batch (--micro-batch x
    --seq-len, the recipe's config_tiny.json) with plain causal attention and with --document-mask (documents of 16
    to seq_len/2 tokens packed whole, positions restarting), the two alternating step by step for --steps x
    --rounds pairs after --warmup; ratio: the median of the pairwise masked / plain ratios (a pair runs within a
    second, so load that comes and goes on a shared machine hits both alike)."""
    import importlib

    from core.data import positions_in_documents

    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    B, S = args.micro_batch or (2 if device.type == "cuda" else 4), args.seq_len or (4096 if device.type == "cuda" else 256)
    results = {}
    for name in recipe_names():
        mod = importlib.import_module(f"recipes.{name}.model")
        torch.manual_seed(0)
        with torch.device(device):
            model = mod.Model(mod.ModelConfig.from_hf(mod.tiny_config_path()))
        g = torch.Generator().manual_seed(0)
        ids_BS = torch.randint(3, model.cfg.vocab_size, (B, S), generator=g).to(device)
        docs = []
        for _ in range(B):  # whole documents, then one padding document, as core/data.py packs them
            lengths = []
            while sum(lengths) < S:
                lengths.append(min(int(torch.randint(16, S // 2 + 1, (), generator=g)), S - sum(lengths)))
            docs.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
        docs_BS = torch.stack(docs).to(device)
        positions_BS = positions_in_documents(docs_BS)

        def step(masked: bool, model=model, ids_BS=ids_BS, extra=(positions_BS, docs_BS)):
            out = model.forward_train(ids_BS, ids_BS, *(extra if masked else ()))
            (out.loss_sum + out.aux_loss).backward()
            model.zero_grad(set_to_none=True)

        times = {False: [], True: []}
        for i in range(args.warmup + args.steps * args.rounds):
            for masked in (False, True) if i % 2 else (True, False):  # who goes first alternates too
                seconds = timed(lambda masked=masked: step(masked), device)
                if i >= args.warmup:
                    times[masked].append(seconds)
        ratios = [m / p for m, p in zip(times[True], times[False])]
        results[name] = {"plain_ms": 1000 * statistics.median(times[False]),
                         "masked_ms": 1000 * statistics.median(times[True]), "ratio": statistics.median(ratios)}
    print(f"--document-mask cost: forward + backward of {B} x {S} tokens (tiny configs, {device.type}), "
          f"{args.steps * args.rounds} alternating pairs after {args.warmup} warm-up")
    print(f"{'recipe':<18} {'plain ms':>10} {'masked ms':>10} {'ratio':>7}")
    for name, r in results.items():
        print(f"{name:<18} {r['plain_ms']:>10.1f} {r['masked_ms']:>10.1f} {r['ratio']:>7.2f}")
    return results


def optimizer_step_times(args, layout: list[str]) -> dict:
    """{recipe: {"adamw_ms", "muon_ms", "ratio"}}: the median over steps and rounds of reduce_gradients +
    clip_grad_norm_ + step, each optimizer on its own copy of the recipe's model (the same random gradients)."""
    import importlib

    sub = argparse.ArgumentParser()
    sub.add_argument("--dp", type=int, default=-1)
    sub.add_argument("--ep", type=int, default=1)
    dims = sub.parse_args(layout)
    mesh = build_mesh(1, dims.dp, 1, dims.ep, args.device)
    results = {}
    for name in recipe_names():
        mod = importlib.import_module(f"recipes.{name}.model")
        hf = json.loads((mod.tiny_config_path() if args.size == "tiny" else mod.real_config_path()).read_text())
        if args.size != "tiny" or args.layers:
            hf["num_hidden_layers"] = args.layers or (None if args.size == "real" else 2) or hf["num_hidden_layers"]
        with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(hf))
            cfg = mod.ModelConfig.from_hf(Path(tmp) / "config.json")
        times = {"adamw": [], "muon": []}
        for kind in [k for _ in range(args.rounds) for k in times]:
            torch.manual_seed(0)
            with torch.device(mesh.device):
                model = mod.Model(cfg, ep_group=mesh.group("ep"))
            units = shard_model(model, mesh, bf16=False, once=False) if mesh.world > 1 else None
            adamw = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                         norm_group=torch.distributed.group.WORLD if mesh.world > 1 else None)
            opt = MuonAdamW(model, units, **adamw) if kind == "muon" else \
                FSDPAdamW(model, units, **adamw)

            def optimizer_calls(opt=opt):
                opt.reduce_gradients()
                opt.clip_grad_norm_(1.0)
                opt.step()
            for step in range(args.warmup + args.steps):
                for p in model.parameters():  # (FSDP2: this rank's shard, as its reduce-scatter leaves it)
                    p.grad = torch.randn_like(p)
                seconds = timed(optimizer_calls, mesh.device)
                opt.zero_grad()
                if step >= args.warmup:
                    times[kind].append(seconds)
            del model, opt
        adamw_ms, muon_ms = (1000 * statistics.median(times[k]) for k in ("adamw", "muon"))
        results[name] = {"adamw_ms": adamw_ms, "muon_ms": muon_ms, "ratio": muon_ms / adamw_ms}
    if mesh.is_main:
        print(f"optimizer step (reduce + clip + step), {args.size} configs, {mesh.device.type} x{mesh.world} "
              f"(dp={mesh.dp} ep={mesh.ep}), median of {args.steps} steps x {args.rounds} rounds after {args.warmup} "
              f"warm-up; Newton-Schulz in {'bf16' if mesh.device.type == 'cuda' else 'fp32'}")
        print(f"{'recipe':<18} {'AdamW ms':>10} {'Muon ms':>10} {'Muon / AdamW':>13}")
        for name, r in results.items():
            print(f"{name:<18} {r['adamw_ms']:>10.2f} {r['muon_ms']:>10.2f} {r['ratio']:>12.2f}x")
    destroy_mesh()
    return results


def newton_schulz_share(seq_len: int = 4096, sequences: int = 64) -> dict:
    """{recipe: (Newton-Schulz FLOPs per step, training FLOPs per step)} of the released configs (meta tensors)."""
    import importlib

    results = {}
    for name in recipe_names():
        mod = importlib.import_module(f"recipes.{name}.model")
        cfg = mod.ModelConfig.from_hf(mod.real_config_path())
        with torch.device("meta"):
            model = mod.Model(cfg)
        ns = sum(newton_schulz_flops(*view_SAB.shape[1:]) * view_SAB.shape[0]
                 for rule in parameter_rules(model).values() for view_SAB, _ in rule.muon.values())
        results[name] = (ns, mod.flops_per_token(cfg, seq_len) * seq_len * sequences)
        print(f"{name:<18} Newton-Schulz {ns / 1e12:8.1f} TFLOP per step, training step {results[name][1] / 1e15:8.1f} "
              f"PFLOP ({sequences} x {seq_len} tokens): {100 * ns / results[name][1]:.2f}%")
    return results


class StepClock(io.StringIO):
    """train.py's stdout, with the time each step's log line was written (one per loop iteration)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def write(self, text):
        if text.startswith("step ") and "| loss" in text:
            self.times.append(time.perf_counter())
        return super().write(text)


def checkpoint_cost(args, flags: list[str], out: Path) -> dict:
    """Loop-iteration time with a checkpoint every step (blocking, background) against none."""
    modes = {"none": ["--ckpt-every", "0"], "sync": ["--ckpt-every", "1"],
             "async": ["--ckpt-every", "1", "--async-checkpoint"]}
    times, size = {m: [] for m in modes}, 0
    for r in range(args.rounds):
        for mode, extra in modes.items():
            clock = StepClock()
            with contextlib.redirect_stdout(clock):
                train.main([*flags, "--out", str(out / f"{mode}{r}"), *extra, "--keep-checkpoints", "1"])
            times[mode] += [b - a for a, b in zip(clock.times[args.warmup:], clock.times[args.warmup + 1:])]
            for step_dir in (out / f"{mode}{r}/checkpoints").glob("step_*"):
                size = sum(f.stat().st_size for f in step_dir.iterdir())
    ms = {m: 1000 * statistics.median(t) for m, t in times.items()}
    best = {m: 1000 * min(t) for m, t in times.items()}  # on a shared machine the least disturbed iteration
    print(f"loop iteration with a checkpoint every step ({size / 2**20:.1f} MiB), {len(times['none'])} steps per "
          f"mode over {args.rounds} rounds taking turns: median, best")
    for mode in modes:
        print(f"  {mode:<6} {ms[mode]:8.1f} ms ({ms[mode] / ms['none']:.2f}x none)  {best[mode]:8.1f} ms "
              f"({best[mode] / best['none']:.2f}x none)")
    return {"checkpoint_mib": size / 2**20, "iteration_ms": ms, "best_ms": best}


def train_ab(args, flags: list[str], out: Path) -> dict:
    """Step and optimizer-step times of train.py under flag sets A and B (args.train_ab), taking turns."""
    import shlex
    import subprocess
    import sys

    sets = {"A": shlex.split(args.train_ab[0]), "B": shlex.split(args.train_ab[1])}
    times = {k: {"step": [], "opt": [], "cpu": []} for k in sets}
    for r in range(args.rounds):
        for name, extra in sets.items():
            run = out / f"{name}{r}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
                   "-m", "recipes.qwen3_30b_a3b.train", *flags, "--out", str(run), *extra]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"train.py {' '.join(extra)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][args.warmup:]
            times[name]["step"] += [x["step_time"] for x in records]
            times[name]["opt"] += [x.get("opt_time", 0.0) for x in records]
            times[name]["cpu"] += [x.get("cpu_time", 0.0) for x in records]
    result = {}
    for name in sets:
        step, opt, cpu = times[name]["step"], times[name]["opt"], times[name]["cpu"]
        result[name] = {"flags": args.train_ab["AB".index(name)], "step_ms": 1000 * statistics.median(step),
                        "best_ms": 1000 * min(step), "opt_ms": 1000 * statistics.median(opt),
                        "cpu_ms": 1000 * statistics.median(cpu)}
    result["ratio"] = result["B"]["step_ms"] / result["A"]["step_ms"]
    result["best_ratio"] = result["B"]["best_ms"] / result["A"]["best_ms"]
    result["cpu_ratio"] = result["B"]["cpu_ms"] / result["A"]["cpu_ms"]
    print(f"train.py on {args.nproc} ranks, {' '.join(flags[flags.index('--steps'):])}: {args.steps} measured steps "
          f"x {args.rounds} rounds taking turns, after {args.warmup} warm-up; load {os.getloadavg()[0]:.1f}")
    for name in sets:
        r = result[name]
        print(f"  {name} {r['flags'] or '(no flags)'!r:<36} step: median {r['step_ms']:7.0f} ms, best {r['best_ms']:7.0f} ms,"
              f" rank 0's CPU {r['cpu_ms']:7.0f} ms; optimizer {r['opt_ms']:6.0f} ms")
    print(f"  B / A: median {result['ratio']:.2f}x, best {result['best_ratio']:.2f}x, CPU {result['cpu_ratio']:.2f}x")
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="tiny",
                   help="tiny: config_tiny.json; wide: the real config with --layers layers (default 2); real: all 48")
    p.add_argument("--layers", type=int, default=None, help="number of decoder layers (overrides the size's)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 on GPU, 256 on CPU")
    p.add_argument("--batch", type=int, default=None, help="sequences per step, all ranks (default 8 GPU, 16 CPU)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward (default: 2 GPU, 4 CPU)")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before measuring")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 autocast on GPU")
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs (train.py --fp8)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: train.py's")
    p.add_argument("--vs-hf", action="store_true", help="also time transformers' training step; print the ratio")
    p.add_argument("--rounds", type=int, default=1, help="with --vs-hf / --train-ab: take turns this many times")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default="", help="append the result as one JSON line to this file")
    p.add_argument("--optimizer-step", action="store_true", help="time each recipe's optimizer step, AdamW vs Muon")
    p.add_argument("--newton-schulz-share", action="store_true", help="Muon's FLOPs per step vs a training step's")
    p.add_argument("--document-mask-cost", action="store_true", help="forward + backward with --document-mask vs "
                   "without, each recipe's tiny config")
    p.add_argument("--checkpoint-cost", action="store_true", help="step time with a checkpoint every step: none, "
                   "blocking, asynchronous")
    p.add_argument("--train-ab", nargs=2, metavar=("A", "B"), help="train.py under flag sets A and B in turn")
    p.add_argument("--nproc", type=int, default=1, help="with --train-ab: ranks (torchrun --nproc-per-node)")
    args, layout = p.parse_known_args(argv)  # the rest (--dp, --ep, --cp, ...) goes to train.py
    if args.newton_schulz_share:
        return newton_schulz_share()
    if args.optimizer_step:
        return optimizer_step_times(args, layout)
    if args.document_mask_cost:
        return document_mask_cost(args)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    args.seq_len = args.seq_len or (4096 if cuda else 256)
    args.batch = args.batch or (8 if cuda else 16)
    args.micro_batch = args.micro_batch or (2 if cuda else 4)
    if args.batch % args.micro_batch:
        raise ValueError(f"--batch {args.batch} is not a multiple of --micro-batch {args.micro_batch}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.vs_hf and world > 1:
        raise ValueError("--vs-hf compares one process with transformers; run it without torchrun")

    config_path, default_layers = SIZES[args.size]
    hf = json.loads(Path(config_path).read_text())
    hf["num_hidden_layers"] = args.layers or default_layers or hf["num_hidden_layers"]
    total_steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text(json.dumps(hf))
        cfg = ModelConfig.from_hf(tmp / "config.json")
        synthetic_data(tmp / "data", cfg.vocab_size, total_steps * args.batch * (args.seq_len + 1) + 1, seed=0)
        flags = ["--config", str(tmp / "config.json"), "--data", str(tmp / "data"), "--out", str(tmp / "run"),
                 "--steps", str(total_steps), "--seq-len", str(args.seq_len), "--global-batch", str(args.batch),
                 "--micro-batch", str(args.micro_batch), "--warmup-steps", "1", "--ckpt-every", "0",
                 "--dtype", args.dtype, "--device", args.device, *(["--fp8"] if args.fp8 else []),
                 *([] if args.compile is None else ["--compile" if args.compile else "--no-compile"]), *layout]
        if args.checkpoint_cost:
            return checkpoint_cost(args, flags, tmp)  # (its flags come later: they win)
        if args.train_ab:
            return train_ab(args, flags, tmp)
        device = torch.device("cuda" if cuda else "cpu")
        use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and cuda)
        ours, theirs, mem_ours, mem_theirs, hf, losses, hf_gemm = [], [], 0.0, 0.0, None, None, {}
        if args.vs_hf:
            record_expert_gemms(hf_gemm)
        for _ in range(args.rounds if args.vs_hf else 1):
            reset_peak(device)
            log = io.StringIO()
            with contextlib.redirect_stdout(log):  # train.py's per-step lines; printed below on failure only
                try:
                    history, model = train.main(flags)
                except BaseException:
                    print(log.getvalue())
                    raise
            ours += [h["step_time"] for h in history[args.warmup:]]
            losses = losses or [h["loss"] for h in history]
            mem_ours, n_params = max(mem_ours, peak_gib(device)), sum(p.numel() for p in model.parameters())
            del model, history
            gc.collect()
            if args.vs_hf:
                if cuda:
                    torch.cuda.empty_cache()
                reset_peak(device)
                try:  # a failure on their side (say, out of memory) keeps our numbers
                    hf = hf or hf_model(cfg, device, use_bf16)
                    loader = TokenLoader(tmp / "data", args.seq_len, args.batch, seed=0)  # train.py's batches (seed 0)
                    theirs += hf_steps(*hf, loader, args, device, use_bf16)[args.warmup:]
                    mem_theirs = max(mem_theirs, peak_gib(device))
                except Exception as e:
                    print(f"transformers step failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    args.vs_hf, hf = False, None
        is_main = int(os.environ.get("RANK", "0")) == 0
        flops_tok = flops_per_token(cfg, args.seq_len)
        peak_one, peak_source = peak_flops_and_source(device)
        peak = peak_one * world
        measured = measure_matmul_flops(device, torch.bfloat16, 8192, 20) if cuda else None
        tokens = args.batch * args.seq_len
        rows = [row("ours", ours, tokens, flops_tok, peak, mem_ours)]
        if args.vs_hf:
            rows.append(row("transformers", theirs, tokens, flops_tok, peak, mem_theirs))

    result = {"size": args.size, "layers": cfg.num_hidden_layers, "params_per_rank": n_params, "device": str(device),
              "world": world, "seq_len": args.seq_len, "batch": args.batch, "micro_batch": args.micro_batch,
              "precision": ("bf16" if use_bf16 else "fp32") + ("+fp8" if args.fp8 else ""),
              "compile": args.compile if args.compile is not None else cuda, "layout": " ".join(layout) or "single",
              "rows": rows, "losses": losses}
    if args.vs_hf:
        result["ratio_vs_hf"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
        result["hf_expert_gemm"] = hf_gemm
        result["same_precision"] = hf_gemm.get("gemm", "bfloat16" if use_bf16 else "float32") == \
            ("bfloat16" if use_bf16 else "float32")
    result["peak_flops"], result["peak_source"], result["flops_per_token"] = peak_one, peak_source, flops_tok
    if measured:
        result["mfu_vs_measured_matmul"] = [r["tokens_per_s"] * flops_tok / (measured * world) for r in rows]
    if is_main:
        print(f"qwen3_30b_a3b {args.size}: {cfg.num_hidden_layers} layers, {n_params / 1e6:,.1f}M params per rank, "
              f"{device.type} x{world} ({result['layout']}), {args.batch} x {args.seq_len} tokens per step in micro-batches "
              f"of {args.micro_batch}, {result['precision']}, compile {'on' if result['compile'] else 'off'}, "
              f"{args.warmup} warm-up + {args.steps} measured steps x {len(ours) // args.steps} rounds; MFU against "
              f"{peak_one / 1e12:,.3g} TFLOP/s per device ({peak_source})"
              + (f"; bf16 matmul measured here {measured / 1e12:,.0f} TFLOP/s" if measured else ""))
        print(f"{'impl':<14} {'tokens/s':>12} {'MFU':>8} {'step ms':>10} {'best ms':>10} {'peak mem GiB':>13}")
        for r in rows:
            print(f"{r['impl']:<14} {r['tokens_per_s']:>12,.0f} {100 * r['mfu']:>7.2f}% {r['step_ms']:>10.1f} "
                  f"{r['best_ms']:>10.1f} {r['peak_mem_gib']:>13.2f}")
        if args.vs_hf:
            gemm = (f"receive {hf_gemm['received']}, run {hf_gemm['gemm']} through {hf_gemm['path']}" if hf_gemm else
                    "no grouped GEMM call (per-expert modules)")
            print(f"transformers' expert GEMMs: {gemm}; ours: {result['precision']}")
            if not result["same_precision"]:
                print("WARNING: transformers' experts ran in another precision than ours: the ratio compares "
                      "unlike runs")
            print(f"ours / transformers tokens/s: {result['ratio_vs_hf']:.2f}x")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
