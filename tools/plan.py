"""Plan a run before renting the GPUs: every valid layout of a recipe on N GPUs, its predicted step time, memory
and bottleneck, best first.

    python -m tools.plan qwen3_30b_a3b --gpus 16 --gpus-per-node 8 --gpu h100 --seq-len 4096 --global-batch 512 --fp8
    python -m tools.plan qwen3_30b_a3b --gpus 4 --gpu cpu --calibration runs/calibration_cpu.json \\
        --config recipes/qwen3_30b_a3b/config_tiny.json --seq-len 256 --global-batch 8 --micro-batches 1 --fp32

Layouts: every (pp, dp, cp, ep) with pp*dp*cp*ep = --gpus, micro-batch and recompute choice that the recipe's
own train.py accepts (its `check_run`: ep divides the experts, 2*pp stages get layers, >= 2*pp micro-batches,
the sequence divides by 2*cp, the batch splits) and whose core/memory.py estimate fits the GPU.
--layout "--pp 1 --ep 8 --micro-batch 4" predicts only that layout (train.py's flags, checked by its check_run;
--fsdp-gather step among them at pp = 1). --optimizer muon plans train.py's Muon (memory and its step).
Published runs at their own layouts: tools/published_runs.json, `python -m tools.plan_check --published`.

Step time (per rank, one optimizer step), a roofline per operation class with measured rates (a calibration, or
on a GPU without one the datasheet x the published efficiencies of GPU_EFFICIENCY, each cited there):
  compute    FLOPs per token by class from the recipe's model.py `flops_by_layer` (attention, dense GEMMs, routed
             expert GEMMs, head) x tokens of a micro-batch (micro_batch * seq_len / cp), each class at its own rate
             (GEMM, grouped GEMM; attention forward and backward apart, flex kernels where core/attention.py uses
             them). With --fp8, as core/fp8.py runs it: forward and input-gradient GEMMs at the FP8 rate, weight
             gradients in bf16, plus quantising each FP8 GEMM's activation input per call (5 bytes per number);
             expert GEMMs also no faster than reading the local experts' weights (bytes / HBM bandwidth). With
             --recompute attention (layer), the attention (whole layer) forward runs twice. Routed expert time is
             multiplied by the expert-load imbalance (max/mean, 1 for uniform routing, or --expert-load). On a
             CPU, masked attention (cp, DeepSeek's value width, GPT-OSS's sinks) computes every (query, key)
             pair, at the calibrated rate of its form (SDPA with a boolean mask, or the explicit softmax form).
  other      ATen ops per layer (counted once per recipe on its tiny config by a TorchDispatchMode, forward and
             backward, at cp = ep = 1). On a GPU each costs its launch, and kernels launch asynchronously: a
             layer takes the larger of the launch time and the kernel time, whose memory part is the activation
             bytes (core/memory.py's saved bytes per token and layer, written in forward and read in backward)
             / HBM bandwidth. On a CPU each op costs a fixed time plus three hidden-state-sized tensors (two
             read, one written) at the calibrated elementwise rate, and the loss over the vocab its calibrated
             cross-entropy rate.
  all-to-all dispatch and combine of each MoE layer, forward and backward, deduplicated (core/moe.py): a token
             goes to each ep rank holding one of its k experts once: expected rows per token, the sum over ranks
             of 1 - C(E - L_r, k) / C(E, k), L_r experts on rank r (the run's placement; uniform routing), or
             what the busiest rank receives if more, rows of H + k numbers out and H back (the busiest rank's
             expert GEMMs scale with its max L_r * ep / E too); plus the two small blocking exchanges of DispatchPlan;
             --recompute layer dispatches once more in backward, blocking (never hidden). Without pp they are
             exposed; under DualPipeV an overlapped F&B hides each chunk's all-to-alls behind the other's compute.
  cp gather  all-gather of `cp_gather_width` numbers per token per layer (K/V, or the MLA latent) forward, a
             reduce-scatter of the same size backward; blocking inside attention.
  pipeline   the action order of core/pipeline.py's DualPipeV (tools/pipeline_timeline.py:schedule_order, a dry
             run of the engine itself) replayed with these durations per stage and a p2p hand-off time between
             ranks (tools/pipeline_timeline.py:simulate); the bubble is span - busy of the rank reported.
  FSDP2      the collectives over each parameter's replicas (dense: dp*cp*ep, routed experts: dp*cp;
             core/fsdp.py), weights gathered in the compute dtype, gradients reduce-scattered in fp32. Gathered once
             per step (pp > 1, --fsdp-gather step): one all-gather before the step and one reduce-scatter after it,
             exposed. Gathered per micro-batch (pp = 1's default): each unit twice (forward, backward) and reduced
             once per micro-batch, one unit ahead behind the compute of the unit before (fsdp_exposed_s): exposed
             are the first gathers, the last reduce-scatters and what exceeds the compute it runs behind (a CPU:
             all of them, gloo computing on the cores that compute). Plus the optimizer step on the shard (AdamW;
             --optimizer muon: Newton-Schulz of the owned matrices at the GEMM rate and the two all-to-alls that
             bring their rows to the owners and back).
Collective time = t0 + bytes * (n-1)/n / bandwidth, with the bandwidth of where the group lands: ranks are
row-major over (pp, dp, cp, ep), so a group stays inside a node while its span of ranks <= GPUs per node (NVLink),
else it crosses the network (per-GPU NIC).
"""

import argparse
import functools
import hashlib
import importlib
import itertools
import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from core.memory import (
    GIB,
    Layout,
    activation_calibration,
    estimate,
    handoff_bytes,
    meta_model,
    rank_hit_chance,
    saved_per_token_layer,
)
from core.muon import newton_schulz_flops
from core.pipeline import split_layers
from core.placement import Placement
from core.reliability import run_main
from core.training import parameter_rules
from recipes import recipe_names
from tools.calibrate import OpCounter
from tools.pipeline_timeline import schedule_order, simulate


@dataclass(frozen=True)
class GPU:
    """Datasheet figures of one GPU (dense, no sparsity). bw in bytes/s per direction."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_gib: float
    hbm_bw: float
    nvlink_bw: float  # per GPU, one direction (the datasheets give both directions added)
    network_bw: float  # per GPU: one 400 Gb/s NIC per GPU in the DGX/HGX systems


GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 / FP8 3,958 TFLOPS with sparsity (half dense),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s (one per GPU).
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    "h100": GPU("H100 SXM", 989e12, 1979e12, 80, 3.35e12, 450e9, 50e9),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same tensor cores as H100 SXM, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s. https://www.nvidia.com/en-us/data-center/h200/
    "h200": GPU("H200 SXM", 989e12, 1979e12, 141, 4.8e12, 450e9, 50e9),
    # NVIDIA HGX B200 / DGX B200 datasheet, per GPU (the 8-GPU totals / 8): FP8 72 PFLOPS and BF16 36 PFLOPS with
    # sparsity (4.5 / 2.25 PFLOPS dense), 1,440 GB HBM3e at 64 TB/s (180 GB, 8 TB/s), NVLink 5 1.8 TB/s,
    # 8x ConnectX-7 400 Gb/s. https://www.nvidia.com/en-us/data-center/dgx-b200/
    "b200": GPU("B200 SXM", 2.25e15, 4.5e15, 180, 8e12, 900e9, 50e9),
}
@dataclass(frozen=True)
class Efficiency:
    """A fraction of one datasheet figure (`peak`: a GPU field) that someone else measured on that GPU, with where
    it comes from and how it was carried to our shapes; `conservative` where no published figure exists."""

    value: float
    peak: str
    source: str
    conservative: bool = False


# What a GPU reaches of its datasheet, until tools/gpu_check.py (tools/calibrate.py --device cuda) has measured
# that GPU type: figures published by others on H100 / H800 (same SM90 tensor cores and clocks as H100 SXM),
# applied as fractions to every GPU in GPUS. Not yet measured on a GPU by this framework.
GPU_EFFICIENCY = {
    "gemm": Efficiency(0.61, "bf16_flops",
                       "Maximum Achievable Matmul FLOPS table (stas00/ml-engineering, compute/accelerator): H100 SXM "
                       "bf16 794.5 of 989 TFLOP/s (80.3%) at its best shape 2048x2048x13312; scaled to the attention "
                       "and head shapes (inner dim 2048-4096) by DeepGEMM's (deepseek-ai/DeepGEMM README, H800) dense "
                       "M=4096 N=7168 K=2048 over its best K=16384 row, 1025 / 1358 TFLOP/s: 0.803 x 0.755"),
    "gemm_fp8": Efficiency(0.52, "fp8_flops",
                           "DeepGEMM README, H800 normal dense FP8 GEMMs: M=4096 N=7168 K=2048 at 1025 of 1979 "
                           "TFLOP/s"),
    "grouped_gemm": Efficiency(0.48, "bf16_flops",
                               "conservative: no published bf16 grouped GEMM at MoE expert shapes (hidden 2048-2880, "
                               "expert width 512-1536) on H100; the dense bf16 figure above x 0.8, the ratio of "
                               "DeepGEMM's FP8 grouped (8 groups x 4096, N 7168, K 2048: 1093 TFLOP/s) to its best "
                               "dense FP8 row (1358)", conservative=True),
    "grouped_gemm_fp8": Efficiency(0.55, "fp8_flops",
                                   "DeepGEMM README, H800 grouped GEMMs for MoE (contiguous layout): 8 groups of 4096 "
                                   "rows, N=7168 K=2048 at 1093 of 1979 TFLOP/s (expert widths below 2048 are slower: "
                                   "its dense K=512 row reaches 590)"),
    "attention": Efficiency(0.30, "bf16_flops",
                            "FlashAttention-3 paper (Shah et al. 2024), H100 SXM5 bf16 forward, FlashAttention-2 (the "
                            "kernel of torch SDPA's flash backend): 293-368 TFLOP/s at sequence 4k over head dims 64, "
                            "128, 256; the lowest, 293 (head dim 256)"),
    "attention_bwd": Efficiency(0.23, "bf16_flops",
                                "FlashAttention-3 paper, H100 SXM5 bf16 backward, FlashAttention-2: 279 (head dim 64) "
                                "and 310 (128) TFLOP/s at 4k; 279 counted as 2.5 x forward FLOPs, ours count backward "
                                "as 2 x forward: 279 x 2 / 2.5 = 223"),
    "flex_attention": Efficiency(0.90, "attention",
                                 "PyTorch blog 'FlexAttention: The Flexibility of PyTorch with the Performance of "
                                 "FlashAttention': 90% of FlashAttention-2 forward; applied where core/attention.py "
                                 "attention runs flex (its kernel table: a CPMask or sinks on CUDA; taken here for "
                                 "cp > 1 and for recipes whose attention is not plain causal SDPA)"),
    "flex_attention_bwd": Efficiency(0.85, "attention_bwd", "the same PyTorch FlexAttention blog: 85% of "
                                     "FlashAttention-2 backward"),
    "memory": Efficiency(0.78, "hbm_bw",
                         "DeepGEMM README, H800 (HBM3 3.35 TB/s as H100 SXM): its memory-bound M=128 dense rows reach "
                         "up to 2,604 GB/s"),
    "nvlink": Efficiency(0.50, "nvlink_bw",
                         "conservative: NCCL all-to-all / all-gather / reduce-scatter inside a node; the best "
                         "published EP exchange, DeepEP intranode EP8 on H800 (deepseek-ai/DeepEP docs/legacy.md), "
                         "reaches 153-158 of ~160 GB/s NVLink, DeepEP V2 on B200 726-740 of 900 GB/s (README); "
                         "NCCL, which this framework calls, is assumed to reach half", conservative=True),
    "network": Efficiency(0.86, "network_bw",
                          "DeepEP docs/legacy.md, H800 + CX7 400 Gb/s (~50 GB/s): internode EP16 dispatch and combine "
                          "43 GB/s (RDMA bottleneck bandwidth)"),
}
# seconds per kernel launch (host side, overlapped with the kernels); conservative: PyTorch eager dispatch plus a
# CUDA launch, no published per-op figure for this framework's ops
GPU_OP_LATENCY = Efficiency(8e-6, "", "conservative: eager PyTorch op dispatch + cudaLaunchKernel, not measured here",
                            conservative=True)
# fixed cost of one NCCL collective; conservative: DeepEP's low-latency EP8 dispatch of 128 tokens takes 77 us on
# H800 (docs/legacy.md), an NCCL call on small data is taken as a quarter of that
GPU_COLLECTIVE_T0 = Efficiency(20e-6, "", "conservative: a quarter of DeepEP's 77 us low-latency EP8 dispatch "
                               "(docs/legacy.md, H800)", conservative=True)


@dataclass
class Machine:
    """Rates one rank gets (FLOP/s, bytes/s, seconds), from a calibration file and / or a datasheet."""

    name: str
    peak_flops: float  # MFU denominator: the datasheet's dense bf16 (a CPU: its measured fp32 GEMM rate)
    hbm_gib: float
    rates: dict  # class -> {"rate", "t0"}: gemm, gemm_fp8, grouped_gemm, grouped_gemm_fp8, attention, memory
    op_latency: float
    async_launch: bool  # GPU: the host launches ahead of the kernels
    comm_in_node: dict  # collective -> {"rate", "t0"}: all_to_all, all_gather, reduce_scatter, p2p
    comm_network: dict


def load_calibration(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no calibration file {path}; write one with python -m tools.calibrate "
                                f"(this CPU) or python -m tools.gpu_check (a GPU)") from None


def machine_for(gpu: str, calibration: dict | None, world: int) -> Machine:
    """The rates of one rank of a `world`-rank run on `gpu` (h100, h200, b200 or cpu)."""
    if gpu == "cpu":
        if calibration is None or calibration.get("kind") != "cpu":
            raise ValueError("--gpu cpu needs a CPU calibration file: python -m tools.calibrate, then --calibration FILE")
        worlds = sorted(int(w) for w in calibration["ranks"])
        entry = calibration["ranks"][str(min((w for w in worlds if w >= world), default=worlds[-1]))]
        rates = {k: entry[k] for k in ("gemm", "grouped_gemm", "attention", "memory", "attention_masked",
                                       "attention_explicit", "elementwise", "cross_entropy") if k in entry}
        rates["gemm_fp8"], rates["grouped_gemm_fp8"] = rates["gemm"], rates["grouped_gemm"]  # emulated on CPU
        comm = {k: entry[k] for k in ("all_to_all", "all_gather", "reduce_scatter", "p2p") if k in entry}
        return Machine(f"CPU ({calibration['device']})", entry["gemm"]["rate"], 1e9, rates, entry["op_latency"],
                       False, comm, comm)
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu}: unknown; choose one of {', '.join(GPUS)} or cpu")
    spec = GPUS[gpu]
    eff = {k: e.value for k, e in GPU_EFFICIENCY.items()}
    op_latency = GPU_OP_LATENCY.value
    if calibration is not None and calibration.get("kind") == "gpu":
        # measured rates as fractions of the calibrated GPU's own datasheet, applied to this one
        measured = next((g for g in GPUS.values() if g.name.split()[0] in calibration["device"]), spec)
        entry = calibration["ranks"]["1"]
        for k in ("gemm", "grouped_gemm", "attention"):
            eff[k] = entry[k]["rate"] / measured.bf16_flops
        eff["attention_bwd"] = eff["attention"]  # the calibration times forward + backward together
        if "gemm_fp8" in entry:
            eff["gemm_fp8"] = entry["gemm_fp8"]["rate"] / measured.fp8_flops
            eff["grouped_gemm_fp8"] = eff["grouped_gemm"] * eff["gemm_fp8"] / eff["gemm"]
        eff["memory"] = entry["memory"]["rate"] / measured.hbm_bw
        op_latency = entry["op_latency"]
    rates = {k: {"rate": eff[k] * (spec.fp8_flops if k.endswith("fp8") else spec.bf16_flops), "t0": 0.0}
             for k in ("gemm", "gemm_fp8", "grouped_gemm", "grouped_gemm_fp8", "attention", "attention_bwd")}
    for k in ("flex_attention", "flex_attention_bwd"):  # flex kernels: a fraction of the flash rate
        rates[k] = {"rate": eff[k] * rates[GPU_EFFICIENCY[k].peak]["rate"], "t0": 0.0}
    rates["memory"] = {"rate": eff["memory"] * spec.hbm_bw}
    link = lambda bw: {k: {"rate": bw, "t0": GPU_COLLECTIVE_T0.value}
                       for k in ("all_to_all", "all_gather", "reduce_scatter", "p2p")}
    return Machine(spec.name, spec.bf16_flops, spec.hbm_gib, rates, op_latency, True,
                   link(eff["nvlink"] * spec.nvlink_bw), link(eff["network"] * spec.network_bw))


# ------------------------------------------------------------------------------------------ model pieces


def expected_ranks_hit(num_experts: int, slots: float, ep: int, counts: list[int] | None = None) -> float:
    """Expected number of distinct ep ranks a token's experts (`slots` distinct of E, uniform; a mean: see
    core/memory.py:rank_hit_chance) live on: the sum over ranks of the chance that the rank's L_r experts hold at
    least one of them, 1 - C(E-L_r, k) / C(E, k). counts: L_r per rank (default core/placement.py's even split: the
    first E % ep ranks hold one more)."""
    counts = counts or [len(x) for x in Placement.even(num_experts, ep).experts]
    return sum(rank_hit_chance(num_experts, slots, L) for L in counts)


def expert_imbalance(path: str) -> float:
    """Max/mean expert load from a run's metrics.jsonl (train.py logs `expert_load_max_over_mean` per MoE layer
    each step): the mean over layers of the last record, the factor by which the busiest ep rank's expert rows
    exceed the average (1 = uniform)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if "expert_load_max_over_mean" in line]
    if not records or not records[-1]["expert_load_max_over_mean"]:
        raise ValueError(f"{path} has no expert_load_max_over_mean record; pass a train.py run's metrics.jsonl")
    loads = records[-1]["expert_load_max_over_mean"]
    return sum(loads) / len(loads)


def group_span(layout: Layout, dims: tuple[str, ...]) -> int:
    """Last minus first global rank + 1 of one group over `dims` (ranks row-major over (pp, dp, cp, ep)): the group
    stays inside a node of G ranks when this is <= G (nodes hold G consecutive ranks; G a multiple of the span's
    block, as with power-of-two sizes)."""
    sizes = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "ep": layout.ep}
    order = ("pp", "dp", "cp", "ep")
    stride = lambda d: math.prod(sizes[o] for o in order[order.index(d) + 1:])
    return 1 + sum(stride(d) * (sizes[d] - 1) for d in dims)


def collective_s(machine: Machine, kind: str, sent_bytes: float, n: int, span: int, gpus_per_node: int) -> float:
    """Seconds of one collective where each of n ranks sends `sent_bytes` in all ((n-1)/n of them leave it)."""
    if n <= 1:
        return 0.0
    c = (machine.comm_in_node if span <= gpus_per_node else machine.comm_network)[kind]
    return c["t0"] + sent_bytes * ((n - 1) / n if kind != "p2p" else 1.0) / c["rate"]


@functools.cache
def op_counts(mod_name: str, recompute: str) -> dict:
    """ATen ops per token-independent unit, counted on the recipe's tiny config (batch 1 x 32 tokens) by a
    TorchDispatchMode: forward and forward+backward of one decoder layer (the model minus a model without
    layers, per layer) and of the embedding + head + loss; and whether its attention runs as batched matmuls
    (the explicit form) rather than a fused kernel."""
    mod = importlib.import_module(mod_name)
    tiny = mod.ModelConfig.from_hf(mod.tiny_config_path())
    counts = {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = torch.randint(0, tiny.vocab_size, (1, 32))
        for name, layers in (("all", None), ("head", [])):
            model = mod.Model(tiny, layers=layers, recompute=recompute)
            fwd = OpCounter()
            with fwd:
                loss = model.forward_train(ids, ids).loss_sum
            counts["explicit_attention"] = counts.get("explicit_attention", False) or fwd.batched_matmuls > 0
            both = OpCounter()
            with both:
                loss.backward()
            counts[name] = (fwd.count, fwd.count + both.count)
    L = tiny.num_hidden_layers
    return {"explicit_attention": counts["explicit_attention"], "layer_fwd": (counts["all"][0] - counts["head"][0]) / L,
            "layer_train": (counts["all"][1] - counts["head"][1]) / L,
            "head_fwd": counts["head"][0], "head_train": counts["head"][1]}


@functools.cache
def layer_params(mod_name: str, cfg_path: str) -> tuple[list[int], list[int], int, int]:
    """(dense parameters per decoder layer, routed-expert parameters per layer, the embedding's, the rest outside
    the layers: final norm, head, ...: FSDP2's root unit), counted on the whole model built once on meta."""
    mod = importlib.import_module(mod_name)
    cfg = mod.ModelConfig.from_hf(cfg_path)
    dense, expert = [0] * cfg.num_hidden_layers, [0] * cfg.num_hidden_layers
    model = meta_model(mod, cfg)
    rules, layer_of = parameter_rules(model), {n: int(i) for n, (i, _) in layer_parameters(model).items()}
    embed = sum(p.numel() for p in model.embed_tokens.parameters())
    for name, p in model.named_parameters():
        if name in layer_of:
            table = expert if rules[name].expert_ids is not None else dense  # (Model.parameter_rules)
            table[layer_of[name]] += p.numel()
    return dense, expert, embed, sum(p.numel() for p in model.parameters()) - sum(dense) - sum(expert) - embed


def layer_parameters(model) -> dict[str, tuple[str, str]]:
    """{name: (its decoder layer's key in model.layers, its name inside that layer)} of the layers' parameters."""
    names = {m: n for n, m in model.named_modules()}
    return {f"{names[layer]}.{n}": (i, n) for i, layer in model.layers.items() for n, _ in layer.named_parameters()}


@functools.cache
def muon_layer_costs(mod_name: str, cfg_path: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]], tuple]:
    """Per decoder layer (dense, routed experts) and outside the layers: (Newton-Schulz FLOPs, elements) of the
    matrices --optimizer muon orthogonalises (ParamRule.muon of the recipe's parameter_rules,
    core/muon.py:newton_schulz_flops)."""
    mod = importlib.import_module(mod_name)
    cfg = mod.ModelConfig.from_hf(cfg_path)
    model = meta_model(mod, cfg)
    dense, expert, outside = [(0, 0)] * cfg.num_hidden_layers, [(0, 0)] * cfg.num_hidden_layers, (0, 0)
    layer_of = {n: int(i) for n, (i, _) in layer_parameters(model).items()}
    for name, rule in parameter_rules(model).items():
        for v_SAB, _ in rule.muon.values():
            cost = (v_SAB.shape[0] * newton_schulz_flops(*v_SAB.shape[1:]), v_SAB.numel())
            if name not in layer_of:
                outside = tuple(map(sum, zip(outside, cost)))
                continue
            table, i = expert if rule.expert_ids is not None else dense, layer_of[name]
            table[i] = tuple(map(sum, zip(table[i], cost)))
    return dense, expert, outside


def stage_ids(mod, cfg, layout: Layout, pp_rank: int) -> list[int]:
    """The decoder layers of one pp rank: its two DualPipeV stages (all of them at pp = 1)."""
    if layout.pp == 1:
        return list(range(cfg.num_hidden_layers))
    stages = split_layers(cfg.num_hidden_layers, layout.pp, mod.flops_by_layer(cfg, layout.seq_len))
    return stages[pp_rank] + stages[2 * layout.pp - 1 - pp_rank]


def rank_params(mod, cfg_path: str, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(dense, routed expert) parameters held by one pp rank (as core/memory.py:rank_parts builds it)."""
    dense, expert, embed, root = layer_params(mod.__name__, cfg_path)
    ids = stage_ids(mod, mod.ModelConfig.from_hf(cfg_path), layout, pp_rank)
    return sum(dense[i] for i in ids) + (embed + root if pp_rank == 0 else 0), sum(expert[i] for i in ids) // layout.ep


def fsdp_exposed_s(forward_s: list[float], backward_s: list[float], gather_s: list[float], reduce_s: list[float],
                   root_gather_s: float, root_reduce_s: float) -> float:
    """Seconds FSDP2's collectives add to one micro-batch when units are gathered per micro-batch (pp = 1), the
    units in forward order (embedding, each decoder layer with its experts, the head) with their compute and
    their all-gather and reduce-scatter seconds; the root (head, final norm) is gathered at its pre-forward, first
    of all, kept through backward and reduce-scattered in the final callback. FSDP2 gathers one unit ahead: in
    forward the next unit's all-gather runs behind this unit's compute (the CPU issues it at the next pre-forward;
    one host sync per MoE layer, core/moe.py's DispatchPlan, keeps it from running further ahead); in backward
    the unit before's all-gather (core/fsdp.py's backward prefetch) and the reduce-scatter of the unit just done
    run behind this unit's backward, the two sharing the link. Exposed: the first gathers, what exceeds the compute
    it runs behind, and the last reduce-scatters (the embedding's, the root's), nothing after them to hide behind."""
    n = len(forward_s)
    exposed = root_gather_s + gather_s[0] + sum(max(0.0, gather_s[i + 1] - forward_s[i]) for i in range(n - 1))
    for i in range(n):  # backward, the units in any order: each term is one unit's backward
        hidden = (gather_s[i - 1] if i > 0 else 0.0) + (reduce_s[i + 1] if i + 1 < n else 0.0)
        exposed += max(0.0, hidden - backward_s[i])
    return exposed + reduce_s[0] + root_reduce_s


# ------------------------------------------------------------------------------------------- the step

CLASSES = ("attention", "expert GEMMs", "dense GEMMs", "other compute", "exposed all-to-all", "pipeline hand-offs",
           "bubble", "FSDP2 all-gather/reduce-scatter", "CP gather")


def _zero():
    return dict.fromkeys(CLASSES, 0.0)


def _add(a: dict, b: dict, scale: float = 1.0) -> dict:
    return {k: a[k] + scale * b[k] for k in a}


def stage_costs(mod, cfg, cfg_path: str, layout: Layout, layer_ids: list[int], embed: bool, head: bool,
                machine: Machine, gpus_per_node: int, imbalance: float) -> dict:
    """Seconds of one micro-batch on one stage, by class: {'F': ..., 'B': ..., 'W': ...} (W: the expert
    weight-gradient GEMMs that DualPipeV delays; B includes them) and 'a2a_F' / 'a2a_B' (the all-to-all part of
    F and B, which an overlapped pair can hide), 'a2a_refill' (B's blocking dispatch again, which it cannot)."""
    S, T = layout.seq_len, layout.micro_batch * layout.seq_len // layout.cp
    fpt = mod.flops_by_layer(cfg, S, layout.cp)
    r = machine.rates
    act_bytes = 2 if layout.bf16 else 4
    ops = op_counts(mod.__name__, layout.recompute)
    # a CPU computes masked attention over every (query, key) pair (core/attention.py:attention; a GPU runs flash /
    # flex kernels): the explicit softmax form where the recipe's attention takes it (GPT-OSS's sinks,
    # DeepSeek's value width), SDPA with a boolean mask under cp, each at its calibrated rate per pair (an older
    # calibration without them: the GEMM rate)
    explicit_attention = not machine.async_launch and (layout.cp > 1 or ops["explicit_attention"])
    pair_rate = r.get("attention_explicit" if ops["explicit_attention"] else "attention_masked", r["gemm"])["rate"]
    # a CPU op: a fixed cost plus its bytes, two hidden-state-sized tensors read and one written (calibrated);
    # a GPU op (or an older calibration): the launch cost, its bytes counted with the saved activations below
    # (hidden_size: every model's residual width, to first order the width of its activations and rows)
    op_s = machine.op_latency
    if not machine.async_launch and "elementwise" in r:
        op_s += 3 * T * cfg.hidden_size * act_bytes / r["elementwise"]["rate"]
    calibration = activation_calibration(mod, layout.recompute)
    scale = cfg.hidden_size / calibration.tiny.hidden_size * (0.5 if layout.bf16 else 1.0)
    saved = {moe: saved_per_token_layer(mod, cfg, layout, moe=moe) * scale for moe in (False, True)}  # dense, MoE
    saved_per_token_vocab = calibration.per_token_vocab
    widths = [w * cfg.hidden_size / calibration.tiny.hidden_size for w in calibration.widths]  # dispatch, combine
    out = {key: _zero() for key in ("F", "B", "W")}
    a2a = {"F": 0.0, "B": 0.0, "refill": 0.0}
    E, k, H = cfg.num_experts, cfg.slots_per_token, cfg.hidden_size  # k: slots a token fills, a mean
    # on CUDA core/attention.py:attention runs flex for a CPMask (cp, windows, documents) or sinks, flash SDPA for
    # plain causal attention; a recipe whose tiny-config forward is not plain SDPA is taken as flex
    flex = layout.cp > 1 or ops["explicit_attention"]

    def gemm_s(flops: float, quantized_elems: float, kind: str) -> float:
        """Seconds of a class's training GEMMs (forward, input gradient, weight gradient: a third each). In FP8
        (core/fp8.py) the first two run at the FP8 rate and the weight gradient in bf16, and each FP8 GEMM's
        activation input is quantised per call: two passes over it (amax, then scale + cast), 2 + 2 bytes
        read and 1 written per number, `quantized_elems` numbers per token (weights: once per step, cached)."""
        if not layout.fp8:
            return flops / r[kind]["rate"]
        return (2 * flops / 3 / r[kind + "_fp8"]["rate"] + flops / 3 / r[kind]["rate"] +
                5 * T * quantized_elems / r["memory"]["rate"])

    # rows each rank sends (its own share included) and the busiest rank receives, and the busiest rank's
    # expert rows over the mean, under the run's placement (1 for an even split of E over ep)
    counts = [len(x) for x in Placement.parse(layout.expert_placement, E, layout.ep).experts]
    rows = T * max(expected_ranks_hit(E, k, layout.ep, counts), layout.ep * rank_hit_chance(E, k, max(counts)))
    load = max(counts) * layout.ep / E
    ep_span, cp_span = group_span(layout, ("ep",)), group_span(layout, ("cp",))
    for i in layer_ids:
        f = fpt[i]
        rc_attn = 4 / 3 if layout.recompute in ("attention", "layer") else 1.0  # the forward (1/3) again
        rc_rest = 4 / 3 if layout.recompute == "layer" else 1.0
        if explicit_attention:  # every (query, key) pair: twice the causal pairs counted
            t_attn = 2 * T * f["attention"] / pair_rate * rc_attn
        else:  # forward 1/3 of the FLOPs, backward 2/3, each at its own rate (flash, or flex: masks, sinks)
            fwd, bwd = ("flex_attention", "flex_attention_bwd") if flex and "flex_attention" in r else \
                ("attention", "attention_bwd")
            t_attn = T * f["attention"] * (rc_attn - 2 / 3) / r[fwd]["rate"] + \
                T * f["attention"] * 2 / 3 / r.get(bwd, r["attention"])["rate"]
        # dense GEMMs quantise about two numbers per weight row of H inputs: 2 x params / H = f / (3H) per token
        t_dense = gemm_s(T * f["dense"], f["dense"] / (3 * H), "gemm") * rc_rest
        t_exp = w_share = 0.0
        if f["experts"]:
            weight_bytes = f["experts"] / (6 * k) * max(counts) * act_bytes  # the local experts, read per pass
            # per routed slot the expert GEMMs quantise x (H), the gate/up output's gradient (2I), the SwiGLU
            # output (I) and the down output's gradient (H): 2H + 3I numbers (f = 18 k H I per token)
            slot_elems = 2 * H + f["experts"] / (6 * H * k)
            flops_exp = T * f["experts"] * imbalance * load
            t_gemm = gemm_s(flops_exp, k * slot_elems * imbalance * load, "grouped_gemm")
            t_exp = max(t_gemm, 3 * weight_bytes / r["memory"]["rate"]) * rc_rest
            w_share = flops_exp / 3 / r["grouped_gemm"]["rate"] / t_gemm  # the weight gradients' part (bf16)
        n_ops = ops["layer_train"] + (ops["layer_fwd"] if layout.recompute == "layer" else 0)
        t_ops = n_ops * op_s
        t_bytes = 2 * T * saved[cfg.is_moe_layer(i)] / r["memory"]["rate"]  # written in forward, read in backward
        if not machine.async_launch and "elementwise" in r:
            t_bytes = 0.0  # in op_s
        t_other = t_bytes + (0.0 if machine.async_launch else t_ops)
        t_kernels = t_attn + t_dense + t_exp + t_other
        if machine.async_launch and t_ops > t_kernels:  # launch-bound: the host is the bottleneck
            t_other += t_ops - t_kernels
        for key, share in (("F", 1 / 3), ("B", 2 / 3)):
            part = out[key]
            part["attention"] += t_attn * share
            part["dense GEMMs"] += t_dense * share
            part["expert GEMMs"] += t_exp * share
            part["other compute"] += t_other * share
        out["W"]["expert GEMMs"] += t_exp * w_share
        if f["experts"] and layout.ep > 1:  # dispatch (H + k numbers) and combine (H), each way once per pass
            for key in ("F", "B"):
                t = sum(collective_s(machine, "all_to_all", rows * imbalance * width * act_bytes, layout.ep, ep_span,
                                     gpus_per_node)
                        for width in widths)
                if key == "F":  # DispatchPlan's two small blocking exchanges (row counts, local expert ids)
                    t += 2 * collective_s(machine, "all_to_all", 64, layout.ep, ep_span, gpus_per_node)
                a2a[key] += t
                out[key]["exposed all-to-all"] += t
            if layout.recompute == "layer":  # the dispatch again in B, blocking (core/moe.py recompute_dispatch)
                t = collective_s(machine, "all_to_all", rows * imbalance * widths[0] * act_bytes, layout.ep, ep_span,
                                 gpus_per_node)
                a2a["refill"] += t
                out["B"]["exposed all-to-all"] += t
        if layout.cp > 1:
            gathered = T * mod.cp_gather_width(cfg) * act_bytes * layout.cp  # the whole sequence's K/V (or latent)
            out["F"]["CP gather"] += collective_s(machine, "all_gather", gathered, layout.cp, cp_span, gpus_per_node)
            out["B"]["CP gather"] += collective_s(machine, "reduce_scatter", gathered, layout.cp, cp_span, gpus_per_node)
    if embed or head:
        n_ops = ops["head_train"] * (0.5 if not (embed and head) else 1.0)
        own = (sum(fpt[-2].values()) if embed else 0.0) + (sum(fpt[-1].values()) if head else 0.0)  # the first /
        t_head = T * own / r["gemm"]["rate"]  # last stage's own modules (flops_by_layer: embedding, LM head, ...)
        t_other = 0.0 if machine.async_launch else n_ops * machine.op_latency
        if head and "cross_entropy" in r:  # a CPU: the loss over the logits at its calibrated rate
            t_other += T * cfg.vocab_size / r["cross_entropy"]["rate"]
        elif head:  # the logits' bytes saved for backward (core/memory.py), written in forward and read in backward
            t_other += 2 * T * saved_per_token_vocab * cfg.vocab_size * (0.5 if layout.bf16 else 1.0) / r["memory"]["rate"]
        out["F"]["dense GEMMs"] += t_head / 3
        out["B"]["dense GEMMs"] += 2 * t_head / 3
        out["F"]["other compute"] += t_other / 3
        out["B"]["other compute"] += 2 * t_other / 3
    out["a2a_F"], out["a2a_B"], out["a2a_refill"] = a2a["F"], a2a["B"], a2a["refill"]
    return out


def predict(mod, cfg, cfg_path: str, layout: Layout, global_batch: int, machine: Machine, gpus_per_node: int,
            imbalance: float = 1.0, overlap: bool = True, delay_wgrad: bool = True) -> dict:
    """Predicted step of one layout: {'step_s', 'by_class' (seconds, adding up to step_s), 'tokens_per_s_gpu',
    'mfu', 'bottleneck'}."""
    world = layout.pp * layout.dp * layout.cp * layout.ep
    n_micro = global_batch // (layout.dp * layout.ep) // layout.micro_batch
    total = lambda part: sum(part.values())
    if layout.pp == 1:  # the embedding, each layer, the head apart: FSDP2's units, whose compute hides its gathers
        units = [stage_costs(mod, cfg, cfg_path, layout, ids, embed, head, machine, gpus_per_node, imbalance)
                 for ids, embed, head in ([[], True, False], *[([i], False, False) for i in
                                                                range(cfg.num_hidden_layers)], ([], False, True))]
        by_class = _zero()
        for st in units:
            by_class = _add(by_class, _add(st["F"], st["B"]), n_micro)
    else:
        stage_layers = split_layers(cfg.num_hidden_layers, layout.pp, mod.flops_by_layer(cfg, layout.seq_len))
        stages = [stage_costs(mod, cfg, cfg_path, layout, ids, s == 0, s == 2 * layout.pp - 1, machine,
                              gpus_per_node, imbalance) for s, ids in enumerate(stage_layers)]
        orders = schedule_order(layout.pp, n_micro, overlap, delay_wgrad)

        def parts(r: int, action: str) -> dict:
            """Classes of one action of pp rank r, e.g. 'F0.3&B1.0' (phase 0: stage r, phase 1: 2pp-1-r)."""
            stage = lambda p: stages[r if p == "0" else 2 * layout.pp - 1 - r]
            acts = [(a[0], stage(a[1]) if len(a) > 1 and a[1] in "01" else None) for a in action.split("&")]
            out = _zero()
            for kind, st in acts:
                if st is None:  # an empty W slot
                    continue
                if kind == "F":
                    out = _add(out, st["F"])
                elif kind == "B":
                    out = _add(out, st["B"])
                elif kind == "I":
                    out = _add(out, _add(st["B"], st["W"], -1.0))
                else:
                    out = _add(out, st["W"])
            if len(acts) == 2:  # overlapped pair: each chunk's all-to-alls run behind the other's compute
                (_, sf), (_, sb) = acts
                compute_f = total(sf["F"]) - sf["a2a_F"]
                compute_b = total(sb["B"]) - sb["a2a_B"] - sb["a2a_refill"]  # (the refill blocks both)
                out["exposed all-to-all"] = max(0.0, sf["a2a_F"] - compute_b) + max(0.0, sb["a2a_B"] - compute_f) + \
                    sb["a2a_refill"]
            return out

        memo = {}

        def cost(r: int, action: str) -> dict:  # a cost depends on the kinds and phases, not the micro-batch
            key = (r, re.sub(r"\.\d+", "", action))
            if key not in memo:
                memo[key] = parts(r, action)
            return memo[key]

        durations = [lambda a, r=r: total(cost(r, a)) for r in range(layout.pp)]
        p2p = collective_s(machine, "p2p", handoff_bytes(mod, cfg, layout), 2, group_span(layout, ("pp",)), gpus_per_node)
        span = lambda tl: max(e for t in tl for _, _, e in t) - min(s for t in tl for _, s, _ in t)
        with_p2p = span(simulate(orders, durations, transfer=p2p))
        free = span(simulate(orders, durations))
        busy = [_zero() for _ in range(layout.pp)]
        for r in range(layout.pp):
            for action in orders[r]:
                busy[r] = _add(busy[r], cost(r, action))
        by_class = max(busy, key=total)
        by_class["pipeline hand-offs"] = with_p2p - free
        by_class["bubble"] = free - total(by_class)
    # FSDP2 (core/fsdp.py) over each parameter's replicas (dense: dp*cp*ep ranks, routed experts: dp*cp), gathered
    # in the compute dtype, gradients reduce-scattered in fp32. Once per step (pp > 1, --fsdp-gather step): one
    # all-gather before the step and one reduce-scatter after its last W slot, nothing to hide them behind.
    # Per micro-batch (pp = 1's default): each unit gathered for its forward and again for its backward, reduce-
    # scattered after it, behind the neighbouring units' compute on a GPU (fsdp_exposed_s).
    dense, expert = max((rank_params(mod, cfg_path, layout, r) for r in range(layout.pp)), key=sum)
    n_dense, n_expert = layout.dp * layout.cp * layout.ep, layout.dp * layout.cp
    span_dense, span_expert = group_span(layout, ("dp", "cp", "ep")), group_span(layout, ("dp", "cp"))
    nbytes = {"all_gather": 2 if layout.bf16 else 4, "reduce_scatter": 4}
    sync = lambda kind, d, e: (collective_s(machine, kind, nbytes[kind] * d, n_dense, span_dense, gpus_per_node) +
                               collective_s(machine, kind, nbytes[kind] * e, n_expert, span_expert, gpus_per_node))
    if layout.once:
        by_class["FSDP2 all-gather/reduce-scatter"] += sync("all_gather", dense, expert) + \
            sync("reduce_scatter", dense, expert)
    else:
        dense_L, expert_L, embed, root = layer_params(mod.__name__, cfg_path)
        counts = [len(x) for x in Placement.parse(layout.expert_placement, cfg.num_experts, layout.ep).experts]
        per_unit = [(embed, 0)] + [(d, e * max(counts) // cfg.num_experts) for d, e in zip(dense_L, expert_L)] + [(0, 0)]
        # a CPU rank runs gloo's collectives on the core that computes (one per rank): nothing hides them
        compute = lambda st, key: 0.0 if not machine.async_launch else \
            total(st[key]) - st["a2a_" + key] - (st["a2a_refill"] if key == "B" else 0.0)
        by_class["FSDP2 all-gather/reduce-scatter"] += n_micro * fsdp_exposed_s(
            [compute(st, "F") for st in units], [compute(st, "B") for st in units],
            [sync("all_gather", d, e) for d, e in per_unit], [sync("reduce_scatter", d, e) for d, e in per_unit],
            sync("all_gather", root, 0), sync("reduce_scatter", root, 0))
    if layout.optimizer == "muon":  # + Newton-Schulz of the matrices this rank owns (FLOP-balanced over the shard
        # group, in bf16 on a GPU: at the GEMM rate) and their rows moved to the owners and back (two fp32 all-to-alls)
        flops, elems, share = 0.0, (0.0, 0.0), max(len(x) for x in Placement.parse(
            layout.expert_placement, cfg.num_experts, layout.ep).experts) / cfg.num_experts  # the busiest ep rank's
        muon_dense, muon_expert, muon_outside = muon_layer_costs(mod.__name__, cfg_path)
        for r in range(layout.pp):
            ids = stage_ids(mod, cfg, layout, r)
            f_d, e_d = map(sum, zip(*[muon_dense[i] for i in ids], muon_outside if r == 0 else (0, 0)))
            f_e, e_e = (sum(x) * share for x in zip((0, 0), *[muon_expert[i] for i in ids]))
            if f_d / n_dense + f_e / n_expert > flops:
                flops, elems = f_d / n_dense + f_e / n_expert, (e_d, e_e)
        if flops:
            by_class["other compute"] += flops / machine.rates["gemm"]["rate"]
            by_class["FSDP2 all-gather/reduce-scatter"] += 2 * (
                collective_s(machine, "all_to_all", 4 * elems[0] / n_dense, n_dense, span_dense, gpus_per_node) +
                collective_s(machine, "all_to_all", 4 * elems[1] / n_expert, n_expert, span_expert, gpus_per_node))
    shard = dense / n_dense + expert / n_expert  # the AdamW step reads and writes 7 fp32 numbers per shard element
    by_class["other compute"] += 7 * 4 * shard / machine.rates["memory"]["rate"]
    step = sum(by_class.values())
    tokens_per_s_gpu = global_batch * layout.seq_len / step / world
    return {"step_s": step, "by_class": by_class, "tokens_per_s_gpu": tokens_per_s_gpu,
            "mfu": mod.flops_per_token(cfg, layout.seq_len) * tokens_per_s_gpu / machine.peak_flops,
            "bottleneck": max(by_class, key=by_class.get)}


# ------------------------------------------------------------------------------------------- the search


def recipe_modules(recipe: str):
    """(recipes/<recipe>/model.py, recipes/<recipe>/train.py)."""
    try:
        return (importlib.import_module(f"recipes.{recipe}.model"), importlib.import_module(f"recipes.{recipe}.train"))
    except ModuleNotFoundError:
        raise ValueError(f"no recipe folder recipes/{recipe}; use a folder name such as {', '.join(recipe_names())}") from None


def valid_layouts(train, cfg_path: str, gpus: int, seq_len: int, global_batch: int, fp8: bool, bf16: bool,
                  micro_batches=(1, 2, 4, 8), recomputes=("none", "attention", "layer"),
                  optimizer: str = "adamw") -> list[Layout]:
    """Every layout that the recipe's train.py `check_run` accepts on `gpus` ranks (flags, config, layout, batch
    split; no data, no memory check: the planner checks memory against the target GPU itself)."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    found = []
    with tempfile.TemporaryDirectory() as out:
        for pp, cp, ep, mb, rc in itertools.product(divisors, divisors, divisors, micro_batches, recomputes):
            if gpus % (pp * cp * ep):
                continue
            args = train.Args(config=cfg_path, data="", out=out, pp=pp, dp=-1, cp=cp, ep=ep, device="cpu",
                              seq_len=seq_len, global_batch=global_batch, micro_batch=mb, recompute=rc, fp8=fp8,
                              optimizer=optimizer, eval_every=0, ckpt_every=0)
            try:
                train.check_run(args, gpus)
            except ValueError:
                continue
            found.append(Layout(pp, gpus // (pp * cp * ep), cp, ep, mb, seq_len, bf16, fp8, rc, optimizer=optimizer))
    return found


def plan(recipe: str, gpus: int, gpus_per_node: int, gpu: str, seq_len: int, global_batch: int, fp8: bool = False,
         config: str = "", calibration: str = "", expert_load: str = "", bf16: bool = True, reserve_gib: float = 4.0,
         micro_batches=(1, 2, 4, 8), optimizer: str = "adamw") -> list[dict]:
    """Every valid layout with its prediction and memory, fitting ones first, fastest first."""
    mod, train = recipe_modules(recipe)
    cfg_path = str(config or mod.real_config_path())
    cfg = mod.ModelConfig.from_hf(cfg_path)
    machine = machine_for(gpu, load_calibration(calibration) if calibration else None, gpus)
    imbalance = expert_imbalance(expert_load) if expert_load else 1.0
    rows = []
    for layout in valid_layouts(train, cfg_path, gpus, seq_len, global_batch, fp8, bf16, micro_batches,
                                optimizer=optimizer):
        mem = estimate(mod, cfg, layout)
        pred = predict(mod, cfg, cfg_path, layout, global_batch, machine, gpus_per_node, imbalance)
        rows.append({"layout": layout, "memory_gib": mem["total"] / GIB, "memory": mem,
                     "fits": mem["total"] <= (machine.hbm_gib - reserve_gib) * GIB, **pred})
    rows.sort(key=lambda row: (not row["fits"], -row["tokens_per_s_gpu"]))
    return rows


LAYOUT_FLAGS = {"--pp": "pp", "--dp": "dp", "--cp": "cp", "--ep": "ep", "--micro-batch": "micro_batch",
                "--recompute": "recompute", "--fsdp-gather": "fsdp_gather"}
WORD_FLAGS = ("--recompute", "--fsdp-gather")  # the layout flags whose value is a word, not an integer


SWITCHES = {"--overlap": ("overlap", True), "--no-overlap": ("overlap", False),
            "--delay-wgrad": ("delay_wgrad", True), "--no-delay-wgrad": ("delay_wgrad", False)}


def parse_layout(train, cfg_path: str, gpus: int, flags: str, seq_len: int, global_batch: int, fp8: bool,
                 bf16: bool, optimizer: str = "adamw") -> tuple[Layout, dict]:
    """The Layout that train.py flags such as '--pp 1 --ep 8 --micro-batch 4' name on `gpus` ranks (unset: pp, cp,
    ep, micro-batch 1, recompute none, dp the rest), checked by the recipe's own train.py check_run; and the
    schedule switches among them ({'overlap', 'delay_wgrad'}: train.py's --no-overlap, --no-delay-wgrad)."""
    words = shlex.split(flags)
    values = {"pp": 1, "dp": -1, "cp": 1, "ep": 1, "micro_batch": 1, "recompute": "none", "fsdp_gather": "auto"}
    switches = {"overlap": True, "delay_wgrad": True}
    i = 0
    while i < len(words):
        flag = words[i]
        if flag in SWITCHES:
            name, on = SWITCHES[flag]
            switches[name] = on
            i += 1
            continue
        if flag not in LAYOUT_FLAGS:
            raise ValueError(f"--layout: {flag} is not a layout flag; use {', '.join([*LAYOUT_FLAGS, *SWITCHES])}")
        if i + 1 == len(words):
            raise ValueError(f"--layout: {flag} needs a value, e.g. '--pp 1 --ep 8 --micro-batch 4'")
        value = words[i + 1]
        try:
            values[LAYOUT_FLAGS[flag]] = value if flag in WORD_FLAGS else int(value)
        except ValueError:
            raise ValueError(f"--layout: {flag} {value}: an integer is needed") from None
        i += 2
    for name in ("recompute", "fsdp_gather"):
        allowed = typing.get_args(train.Args.__annotations__[name])  # train.py's Literal: its argparse choices
        if values[name] not in allowed:
            raise ValueError(f"--layout: --{name.replace('_', '-')} {values[name]}: choose one of {', '.join(allowed)}")
    with tempfile.TemporaryDirectory() as out:
        args = train.Args(config=cfg_path, data="", out=out, device="cpu", seq_len=seq_len, global_batch=global_batch,
                          fp8=fp8, optimizer=optimizer, eval_every=0, ckpt_every=0, **values, **switches)
        train.check_run(args, gpus)  # a ValueError names what is wrong with the layout
    v = values
    dp = v["dp"] if v["dp"] > 0 else gpus // (v["pp"] * v["cp"] * v["ep"])
    return Layout(v["pp"], dp, v["cp"], v["ep"], v["micro_batch"], seq_len, bf16, fp8, v["recompute"],
                  optimizer=optimizer, fsdp_gather=v["fsdp_gather"]), switches


def plan_layout(recipe: str, gpus: int, gpus_per_node: int, gpu: str, flags: str, seq_len: int, global_batch: int,
                fp8: bool = False, config: str = "", calibration: str = "", bf16: bool = True,
                reserve_gib: float = 4.0, optimizer: str = "adamw") -> dict:
    """One named layout's prediction and memory (a plan() row)."""
    mod, train = recipe_modules(recipe)
    cfg_path = str(config or mod.real_config_path())
    cfg = mod.ModelConfig.from_hf(cfg_path)
    layout, switches = parse_layout(train, cfg_path, gpus, flags, seq_len, global_batch, fp8, bf16, optimizer)
    machine = machine_for(gpu, load_calibration(calibration) if calibration else None, gpus)
    mem = estimate(mod, cfg, layout)
    return {"layout": layout, "memory_gib": mem["total"] / GIB, "memory": mem,
            "fits": mem["total"] <= (machine.hbm_gib - reserve_gib) * GIB,
            **predict(mod, cfg, cfg_path, layout, global_batch, machine, gpus_per_node, **switches)}


PUBLISHED_RUNS = Path(__file__).with_name("published_runs.json")


def run_config(run: dict) -> str:
    """The config.json a published run is predicted with: its recipe's released one, with the run's
    config_overrides (null removes a field), written once to the temp folder under a name of its content."""
    mod, _ = recipe_modules(run["recipe"])
    if not run.get("config_overrides"):
        return str(mod.real_config_path())
    hf = json.loads(Path(mod.real_config_path()).read_text())
    for key, value in run["config_overrides"].items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    text = json.dumps(hf, sort_keys=True)
    path = Path(tempfile.gettempdir()) / f"plan_{run['recipe']}_{hashlib.sha1(text.encode()).hexdigest()[:12]}.json"
    if not path.exists():
        path.write_text(text)
    return str(path)


def published_table(path: str | Path = PUBLISHED_RUNS) -> list[dict]:
    """Each published run of the file predicted at its own layout: {'run', 'published', 'predicted', 'ratio'
    (predicted / published tokens/s per GPU), 'row' (the plan_layout row), 'fits' (whether its layout fits the
    run's GPU: core/memory.py:estimate, 4 GiB reserve)}."""
    out = []
    for run in json.loads(Path(path).read_text())["runs"]:
        ours = run["ours"]
        flags = " ".join(f"{flag} {ours[name]}" for flag, name in LAYOUT_FLAGS.items() if name in ours) + \
            ("" if ours.get("overlap", True) else " --no-overlap")
        row = plan_layout(run["recipe"], run["gpus"], run["gpus_per_node"], run["gpu"], flags, run["seq_len"],
                          ours["global_batch"], ours["fp8"], run_config(run))
        published = run["published"]["tokens_per_s_gpu"]
        out.append({"run": run, "published": published, "predicted": row["tokens_per_s_gpu"],
                    "ratio": row["tokens_per_s_gpu"] / published, "row": row, "fits": row["fits"]})
    return out


def print_published(table: list[dict]) -> None:
    print("| run | GPUs | layout (ours) | published tok/s/GPU | predicted | predicted / published | bottleneck | "
          "fits | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        run, L = t["run"], t["row"]["layout"]
        ours = f"pp{L.pp} dp{L.dp} cp{L.cp} ep{L.ep} mb{L.micro_batch}" + (" fp8" if L.fp8 else "") + \
            ("" if run["ours"].get("overlap", True) else " no-overlap") + \
            (" gathered per step" if L.pp == 1 and L.once else "")
        print(f"| {run['id']} | {run['gpus']} x {run['gpu'].upper()} | {ours} | {t['published']:,} | "
              f"{t['predicted']:,.0f} | {t['ratio']:.2f}{' (outlier)' if run.get('outlier') else ''} | "
              f"{t['row']['bottleneck']} | {'yes' if t['fits'] else 'no'} | "
              f"{run['source']} |")
    ratios = sorted(max(t["ratio"], 1 / t["ratio"]) for t in table)
    print(f"median factor {statistics.median(ratios):.2f}, worst {ratios[-1]:.2f} over {len(ratios)} runs")


def print_plan(rows: list[dict], machine_name: str, top: int) -> None:
    fitting = [row for row in rows if row["fits"]]
    print(f"{len(rows)} valid layouts, {len(fitting)} fit in memory on {machine_name}; best {min(top, len(fitting))}:")
    print(f"{'layout':<72} {'tok/s/GPU':>10} {'MFU':>6} {'step s':>8} {'GiB':>6}  bottleneck")
    for row in fitting[:top]:
        print(f"{str(row['layout']):<72} {row['tokens_per_s_gpu']:>10,.0f} {100 * row['mfu']:>5.1f}% "
              f"{row['step_s']:>8.3f} {row['memory_gib']:>6.1f}  {row['bottleneck']}")
    if not fitting:
        print("no layout fits: use more GPUs, a bigger GPU, a shorter --seq-len or --fp8")
        return
    best = fitting[0]
    print(f"memory of the best, GiB per GPU (core/memory.py, pp rank {best['memory']['pp_rank']}): " + ", ".join(
        f"{name} {nbytes / GIB:.1f}" for name, nbytes in best["memory"].items() if name != "pp_rank"))
    print(f"breakdown of the best ({best['layout']}), ms per step:")
    for name, seconds in best["by_class"].items():
        print(f"  {name:<32} {seconds * 1e3:>10.1f}  {100 * seconds / best['step_s']:5.1f}%")


def gpu_key(name: str) -> str:
    """The GPUS key of a device name as nvidia-smi or torch print it ('NVIDIA H100 80GB HBM3' -> 'h100'), or of a
    key itself; 'cpu' stays."""
    found = [key for key in (*GPUS, "cpu") if key in name.lower()]
    if len(found) != 1:
        raise ValueError(f"--gpu {name!r}: not one of {', '.join(GPUS)} or cpu; name the closest with --gpu")
    return found[0]


LAUNCH_LAYOUT_FLAGS = ("--pp", "--dp", "--cp", "--ep", "--expert-placement")


def launch_layout(recipe: str, gpus: int, gpus_per_node: int, gpu: str, train_argv: list[str],
                  calibration: str = "") -> tuple[list[str], str]:
    """The layout launch.sh uses when it is given none: the fastest that fits for the run the train.py flags
    describe (--config / --hf-checkpoint, --seq-len, --global-batch, --fp8, --dtype; a --micro-batch or
    --recompute among them is kept, else chosen too). Returns (the train.py flags of that layout, why: one line
    per the best three)."""
    from core.training import parse_args

    mod, train = recipe_modules(recipe)
    given = [a for a in train_argv if a.split("=")[0] in LAUNCH_LAYOUT_FLAGS]
    if given:
        raise ValueError(f"the train.py flags already choose a layout ({' '.join(given)}); plan only without them")
    args = parse_args(train.Args, train_argv)
    has = lambda flag: any(a.split("=")[0] == flag for a in train_argv)
    config = args.hf_checkpoint or args.config
    rows = plan(recipe, gpus, gpus_per_node, gpu_key(gpu), args.seq_len, args.global_batch, args.fp8, config,
                calibration, bf16=args.dtype != "fp32",
                micro_batches=(args.micro_batch,) if has("--micro-batch") else (1, 2, 4, 8), optimizer=args.optimizer)
    rows = [r for r in rows if r["fits"] and (not has("--recompute") or r["layout"].recompute == args.recompute)]
    machine = machine_for(gpu_key(gpu), load_calibration(calibration) if calibration else None, gpus)
    if not rows:
        raise ValueError(f"no layout of {recipe} on {gpus} x {machine.name} fits {args.global_batch} x {args.seq_len} "
                         f"tokens per step; use more GPUs, a shorter --seq-len, --fp8, or set PP and EP yourself")
    best = rows[0]["layout"]
    flags = ["--pp", str(best.pp), "--cp", str(best.cp), "--ep", str(best.ep), "--micro-batch", str(best.micro_batch),
             "--recompute", best.recompute]
    why = [f"layout chosen by tools/plan.py (no PP or EP given) for {gpus} x {machine.name}, {args.global_batch} x "
           f"{args.seq_len} tokens per step{' in FP8' if args.fp8 else ''}, rates "
           f"{'from ' + calibration if calibration else 'datasheet x published efficiencies'}; best of {len(rows)} "
           f"that fit:"]
    for row in rows[:3]:
        L = row["layout"]
        why.append(f"  pp{L.pp} dp{L.dp} cp{L.cp} ep{L.ep} micro-batch {L.micro_batch} recompute {L.recompute}: "
                   f"{row['tokens_per_s_gpu']:,.0f} tok/s/GPU predicted, MFU {100 * row['mfu']:.0f}%, "
                   f"{row['memory_gib']:.1f} GiB, bottleneck {row['bottleneck']}")
    return flags, "\n".join(why)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    if "--layout" in argv[:-1]:  # its value starts with '--': hand it over as --layout=VALUE
        i = argv.index("--layout")
        argv[i:i + 2] = [f"--layout={argv[i + 1]}"]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help=f"recipe folder name: {', '.join(recipe_names())} or a copy")
    p.add_argument("--gpus", type=int, required=True, help="ranks in all")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100", help=f"{', '.join(GPUS)} or cpu (needs --calibration)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=0, help="sequences per optimizer step (required)")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--fp32", action="store_true", help="fp32 compute (train.py's CPU default) instead of bf16")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw", help="train.py's --optimizer: muon "
                   "keeps one fp32 momentum for the weight matrices on their owners (memory) and orthogonalises them")
    p.add_argument("--config", default="", help="HF config.json (default: the recipe's released config.json)")
    p.add_argument("--calibration", default="", help="JSON from tools/calibrate.py or tools/gpu_check.py")
    p.add_argument("--expert-load", default="", help="a run's metrics.jsonl: its measured expert-load imbalance")
    p.add_argument("--micro-batches", default="1,2,4,8", help="micro-batch sizes to try, comma-separated")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--layout", default="", help="predict only this layout, in train.py's flags (e.g. '--pp 1 --ep 8 "
                   "--micro-batch 4 --recompute none'; unset flags: 1, dp the rest); refused if train.py would refuse it")
    p.add_argument("--launch-flags", action="store_true", help="print only the train.py flags of the best layout "
                   "for the run that the train.py flags after -- describe (launch.sh on GPUs without PP / EP); the "
                   "reason goes to stderr")
    a = p.parse_args(argv)
    if a.launch_flags:
        flags, why = launch_layout(a.recipe, a.gpus, a.gpus_per_node, a.gpu, train_argv, a.calibration)
        print(why, file=sys.stderr)
        print(" ".join(flags))
        return flags
    if a.global_batch < 1:
        raise ValueError("--global-batch (sequences per optimizer step) is required and must be >= 1")
    if a.gpus < 1 or a.gpus_per_node < 1:
        raise ValueError(f"--gpus {a.gpus} and --gpus-per-node {a.gpus_per_node} must be >= 1")
    if a.layout:
        row = plan_layout(a.recipe, a.gpus, a.gpus_per_node, gpu_key(a.gpu), a.layout, a.seq_len, a.global_batch,
                          a.fp8, a.config, a.calibration, bf16=not a.fp32, optimizer=a.optimizer)
        machine = machine_for(gpu_key(a.gpu), load_calibration(a.calibration) if a.calibration else None, a.gpus)
        print(f"{a.recipe} on {a.gpus} x {machine.name} ({a.gpus_per_node} per node), {a.global_batch} x {a.seq_len} "
              f"tokens per step{', FP8' if a.fp8 else ''}, layout {row['layout']}: {row['tokens_per_s_gpu']:,.0f} "
              f"tok/s/GPU, MFU {100 * row['mfu']:.1f}%, step {row['step_s']:.3f} s, {row['memory_gib']:.1f} GiB"
              f"{'' if row['fits'] else ' (does not fit)'}, bottleneck {row['bottleneck']}")
        for name, seconds in row["by_class"].items():
            print(f"  {name:<32} {seconds * 1e3:>10.1f}  {100 * seconds / row['step_s']:5.1f}%")
        return row
    micro = tuple(int(x) for x in a.micro_batches.split(","))
    rows = plan(a.recipe, a.gpus, a.gpus_per_node, gpu_key(a.gpu), a.seq_len, a.global_batch, a.fp8, a.config,
                a.calibration, a.expert_load, bf16=not a.fp32, micro_batches=micro, optimizer=a.optimizer)
    machine = machine_for(gpu_key(a.gpu), load_calibration(a.calibration) if a.calibration else None, a.gpus)
    print(f"{a.recipe} on {a.gpus} x {machine.name} ({a.gpus_per_node} per node), {a.global_batch} x {a.seq_len} "
          f"tokens per step{', FP8' if a.fp8 else ''}; MFU vs {machine.peak_flops / 1e12:,.0f} TFLOP/s")
    print_plan(rows, machine.name, a.top)
    return rows


if __name__ == "__main__":
    run_main(main)  # a user error: one `error:` line, exit code 2
