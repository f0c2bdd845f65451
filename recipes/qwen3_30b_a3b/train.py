"""Train this recipe's model (model.py): args -> checks -> mesh -> data -> model -> load -> optimizer -> resume ->
loop (log, checkpoint) -> export.

    torchrun --nproc-per-node 2 -m recipes.<this folder>.train --steps 300 --ep 2      (or: bash launch.sh)
    python -m recipes.<this folder>.train --dry-run --ep 3        (check flags, config, layout, data; no training)

This file is the same in every shipped recipe (tests/test_layers.py compares them); what differs between
architectures lives in model.py: the config and its checks (`load_config`), the layers, the pipeline hand-off
(`PipelineStage`: what stage 0 creates crosses the pp ranks), the loss terms (`Model.loss_terms`: name -> weight
and denominator, core/training.py:LossTerm; their sums `TrainOutput.terms`), per-token inputs made from whole
sequences (`Model.prepare_batch`), the step statistics (`Model.take_stats`), the optional features it supports
(`Model.features`: a flag for another is refused) and what it does after each step (`Model.after_step`: the
expert bias, a router's own changes, per-step files).

The loss of a step is the sum over the model's loss terms of weight x the term summed over the global batch /
its denominator over the global batch (counted across all ranks before the forward): the cross-entropy ("lm")
over every non-ignored label, divided by their number, plus aux_loss_coef x the mean per-micro-batch balance
loss ("aux"), plus whatever terms the model adds. With loss masks (datasets of conversations, tools/prepare_data.py --chat) the labels
of untrained tokens (prompts, padding) are ignored, so the loss is the mean over the trained tokens of the global
batch, whatever the layout; the balance loss still counts every token, trained or not, since every token is
routed and loads the experts. Each micro-batch's backward adds its share, and gradients are *summed* over the ranks
replicating a parameter (dense: dp x cp x ep, routed experts: dp x cp, since each ep rank holds other experts
and already received its ep group's tokens for them), so any layout equals one process running the same global
batch and micro-batch split. The cp ranks of a group read the same sequences and each keeps its 2 of their
2*cp chunks (core/context.py): every per-token sum (loss, label count, expert load) then adds over cp too.
"""

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from core import fp8
from core.checkpoint import Checkpointer, complete_checkpoints, load_checkpoint, resume_candidates
from core.context import cp_positions, split_for_cp
from core.data import TokenLoader, load_tokenizer, open_dataset, parse_mixture, positions_in_documents, source_losses
from core.fsdp import FSDPAdamW, shard_model, whole_model
from core.kernels.cross_entropy import loss_groups
from core.memory import check_train_args
from core.mesh import build_mesh, destroy_mesh, resolve_layout
from core.metrics import MetricsLogger, load_max_over_mean, peak_flops, peak_memory_gib, reduce_stats, timed
from core.moe import traffic
from core.muon import MuonAdamW
from core.pipeline import DualPipeV, running, split_layers
from core.placement import Placement
from core.profiling import StepProfiler, parse_steps
from core.reliability import (
    PG_TIMEOUT_S,
    StopRequest,
    StopRun,
    Watchdog,
    collapse_warning,
    grads_finite,
    inject_fault,
    run_main,
    step_is_finite,
)
from core.routing import routing
from core.training import (
    StepDone,
    check_args,
    check_features,
    check_wandb,
    declared,
    loss_denominators,
    loss_weights,
    lr_factor,
    objective,
    parse_args,
)

from .model import (
    Model,
    PipelineStage,
    compile_dense_parts,
    enable_fp8,
    flops_by_layer,
    flops_per_token,
    load_config,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config_path,
)


@dataclass
class Args:
    """Train this recipe's model (its config.json, or the tiny CPU config) with pipeline, data, context and expert
    parallelism."""

    config: str = str(tiny_config_path())  # HF config.json; ignored when --hf-checkpoint is given
    hf_checkpoint: str = ""  # start from these Hugging Face weights (its config.json is used)
    data: str = "data/stdlib"  # token shards from tools/prepare_data.py; a mixture: [NAME=]FOLDER:WEIGHT,... (web=data/web:0.7,data/code:0.3)
    out: str = f"runs/{Path(__file__).parent.name}"  # tensorboard/ and checkpoints/ go here (runs/<this folder>)
    pp: int = 1  # DualPipeV over this many ranks: 2*pp stages, each rank holds two (needs >= 2*pp micro-batches)
    overlap: bool = True  # pp: overlap one micro-batch's forward with another's backward at the all-to-alls
    delay_wgrad: bool = True  # pp: delay expert weight gradients into the schedule's W slots (zero bubble)
    dp: int = -1  # -1: world size / (pp * cp * ep)
    cp: int = 1  # each sequence split over this many ranks (keys/values gathered); --seq-len divisible by 2*cp
    ep: int = 1  # routed experts split over this many ranks (tokens reach them by all-to-all)
    expert_placement: str = ""  # ep rank of each routed expert, comma-separated (6 experts at --ep 4: 0,0,1,1,2,3); '': contiguous, as even as possible
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    compile: bool | None = None  # torch.compile the dense parts of each layer; default on for CUDA, off for CPU
    # (there, compiling the C++ kernels takes longer than a whole tiny run and gains nothing at its sizes)
    document_mask: bool | None = None  # attention only within each document, positions restarting at each; default on
    # for datasets of whole documents (tools/prepare_data.py --chat), off for raw text (then documents end at eos)
    recompute: Literal["none", "attention", "layer"] = "none"  # activations recomputed in backward instead of kept (model.py)
    fp8: bool = False  # FP8 GEMMs (Hopper) for attention, dense MLP and expert weights; on CPU the same numerics
    fp8_recipe: Literal["rowwise", "blockwise"] = "rowwise"  # with --fp8: one scale per row (weight gradients in bf16),
    # or DeepSeek-V3's 1x128 tiles for activations and gradients, 128x128 blocks for weights, FP8 weight gradients
    steps: int = 300
    seq_len: int = 256
    global_batch: int = 16  # sequences per optimizer step, all ranks together
    micro_batch: int = 4  # sequences per forward/backward on one rank
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon for the weight matrices, AdamW for the rest (core/muon.py)
    fsdp_gather: Literal["auto", "micro-batch", "step"] = "auto"  # more than one rank (FSDP2, core/fsdp.py): gather each
    # unit around every micro-batch's forward and backward (least memory), or once per step (one all-gather and one
    # reduce-scatter per step, +6 bytes per parameter: its bf16 copy and fp32 gradient sum); auto: step at --pp > 1
    # (the only one there) and on CPU (gloo: a loopback round trip per unit and micro-batch buys memory that does
    # not matter there), micro-batch on a GPU at --pp 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    lr_schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    aux_loss_coef: float = -1.0  # weight of the balance loss; < 0: the config's (model.py: ModelConfig.router_aux_loss_coef)
    loss_weight: str = ""  # NAME=W[,NAME=W...]: weights of the model's loss terms (model.py: Model.loss_terms; lm, aux, ...)
    expert_bias_rate: float = 0.0  # > 0: aux-loss-free balancing, bias += rate * sign(mean - load) per step
    seed: int = 0
    load_heatmap_every: int = 50  # TensorBoard image of the (MoE layer, expert) load every this many steps; 0: never
    routing_trace: int = 0  # every this many steps, each MoE layer's expert ids and weights for every token of the
    # global batch -> <out>/routing_trace/step_N.npz (README "Routing"; python -m tools.routing reads it); 0: never. Cost
    # (tiny Qwen3, CPU): 354 KiB a step (12 B per token and MoE layer, 16 per token), +4 ms of a 1.05 s step in one
    # process, ~+15 ms of 1.5 s on 4 ranks (<= 1.01x), ~3x the file in each rank's memory while it is gathered
    wandb: str = ""  # also send the TensorBoard scalars to this Weights & Biases project, the flags as its config (pip install -e .[wandb]; WANDB_MODE=offline: no network); a resume continues the wandb run
    ckpt_every: int = 100  # also saves after the last step; 0 disables checkpoints
    keep_checkpoints: int = 2  # 0: keep all
    resume: str = ""  # '' (fresh; after a torchrun restart: auto) | auto (newest complete in <out>/checkpoints) | a step_* folder
    async_checkpoint: bool = False  # checkpoints staged to host memory and written in the background while training goes on
    time_limit: float = 0.0  # minutes: stop (checkpoint, exit) before this wall-clock time since start-up, room left for the
    # save; 0: none. SIGTERM / SIGUSR1 (Slurm's --signal=USR1@SECONDS, a preemption) stop the run the same way
    # ---- reliability and evaluation
    step_timeout: float = 0.0  # seconds a step may take before the watchdog stops the rank; 0: 10x the step time after warm-up
    max_bad_steps: int = 5  # stop after this many steps in a row with a non-finite loss or gradient (each is skipped)
    deterministic: bool = False  # deterministic algorithms (bit-identical reruns; slower on GPU)
    eval_every: int = -1  # validation loss every this many steps; -1: with every checkpoint when the data has a val/ split
    eval_data: str = ""  # validation dataset; default <data>/val (tools/prepare_data.py writes it)
    eval_batches: int = 8  # global batches per evaluation (fewer if the validation set is smaller)
    eval_only: bool = False  # evaluate the loaded weights (--resume / --hf-checkpoint) on the validation data and exit
    export_hf: str = ""  # write the trained model here as a Hugging Face folder
    sample_tokens: int = 0  # print a sample of this many tokens at the end
    sample_prompt: str = "def "
    sample_chat: str = ""  # also sample the assistant's answer to this question through the tokenizer's chat template
    profile_steps: str = ""  # "A-B": torch.profiler over steps A..B -> <out>/profile/rank<N>.json (core/profiling.py)
    dry_run: bool = False  # check flags, config, layout (against WORLD_SIZE), data and resume, then exit (launch.sh does)
    # ---- flags that no longer exist -> what replaced them (core/training.py:parse_args refuses each in one line)
    removed_flags = {"shard": "every run of more than one rank shards weights, gradients and optimizer state with "
                              "FSDP2 (core/fsdp.py) and one process runs unsharded; drop the flag"}


def main(argv=None):
    args = parse_args(Args, argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg = check_run(args, world)  # every user error that needs no process group, in one line, before any work
    if args.dry_run:
        return [], None
    stop = StopRequest(args.time_limit * 60)  # SIGTERM / SIGUSR1 / --time-limit: every rank stops at one step boundary
    schedule = dict(schedule=args.lr_schedule, warmup=args.warmup_steps, total=args.steps,
                    min_ratio=args.min_lr_ratio, decay_fraction=args.decay_fraction)
    if args.deterministic:  # before any CUDA work; cuBLAS reads its workspace setting at start-up
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
        torch.backends.cudnn.benchmark = False

    # ---- mesh
    stage_layers = split_layers(cfg.num_hidden_layers, args.pp, flops_by_layer(cfg, args.seq_len)) if args.pp > 1 else None
    mesh = build_mesh(args.pp, args.dp, args.cp, args.ep, args.device, timeout_s=max(PG_TIMEOUT_S, args.step_timeout + 60))
    device = mesh.device
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    n_micro = args.global_batch // mesh.data_world // args.micro_batch
    torch.manual_seed(args.seed)  # same seed everywhere: identical replicas at init

    # ---- data (checked by check_run) and validation data (<data>/val unless --eval-data names another dataset)
    # (a mixture of datasets: core/data.py:MixtureLoader), validation per source
    loader = open_dataset(args.data, args.seq_len, args.global_batch, mesh.data_rank, mesh.data_world, args.seed)
    eval_dir, eval_every = eval_settings(args)
    eval_loader = None  # {source: (loader, weight)}
    if eval_dir and (eval_every > 0 or args.eval_only):
        eval_loader = {name: (TokenLoader(path, args.seq_len, args.global_batch, mesh.data_rank, mesh.data_world,
                                          args.seed), weight) for name, path, weight in parse_mixture(eval_dir)}
    document_mask = loader.documents if args.document_mask is None else args.document_mask

    # ---- model: this rank's routed experts (--expert-placement), everything else whole (HF weights or random init)
    # with --pp, this rank's two stages of the V: stage r (holding the embedding on rank 0) and stage 2pp-1-r
    # (holding the head on rank 0)
    pp_rank = mesh.coord("pp")
    stages = (pp_rank, 2 * args.pp - 1 - pp_rank)
    parts = dict(layers=None if stage_layers is None else stage_layers[stages[0]] + stage_layers[stages[1]],
                 embed=pp_rank == 0, head=pp_rank == 0, ep_group=mesh.group("ep"), cp_group=mesh.group("cp"),
                 recompute=args.recompute, placement=Placement.parse(args.expert_placement, cfg.num_experts, args.ep))
    if args.hf_checkpoint:
        with torch.device("meta"):
            model = Model(cfg, **parts)
        model.to_empty(device=device)
        model.init_weights()  # every buffer (HF folders hold none) and any weight the checkpoint lacks
        load_hf_checkpoint(model, args.hf_checkpoint)
    else:
        with torch.device(device):
            model = Model(cfg, **parts)
    if args.fp8:
        enable_fp8(model)
    if args.compile if args.compile is not None else device.type == "cuda":
        compile_dense_parts(model, document_mask)
    # FSDP2: fully_shard the experts over (dp, cp), the rest over (dp, cp, ep) (core/fsdp.py); one process: plain
    once = args.fsdp_gather == "step" or args.pp > 1 or (args.fsdp_gather == "auto" and device.type == "cpu")
    fsdp_units = shard_model(model, mesh, use_bf16, once) if mesh.world > 1 else None
    # FP8 / bf16 weight copies once per step, but none kept where FSDP2 frees each unit's gathered weights after use
    fp8.CACHE.keep = fsdp_units is None or once  # (core/weight_cache.py)
    pipeline = None
    if args.pp > 1:
        step_ranks = mesh.world // args.pp  # global rank distance between pipeline neighbours
        pipeline = DualPipeV([PipelineStage(model, stage_layers[s], s == 0, s == 2 * args.pp - 1) for s in stages],
                             pp_rank, args.pp, mesh.rank - step_ranks if pp_rank > 0 else None,
                             mesh.rank + step_ranks if pp_rank < args.pp - 1 else None, mesh.group("pp"),
                             None, device,  # what crosses pp ranks: what stage 0 creates (Model.initial_state)
                             overlap=args.overlap, delay_weight_grads=args.delay_wgrad)
    loss_terms = loss_weights(model.loss_terms(args), args.loss_weight)  # name -> LossTerm (weight, denominator)
    n_params = sum(p.numel() for p in model.parameters())

    # ---- optimizer (on FSDP2's shards; Muon: each matrix on one owner) and lr schedule
    adamw = dict(lr=args.lr, weight_decay=args.weight_decay, betas=(args.beta1, args.beta2), eps=args.adam_eps,
                 norm_group=dist.group.WORLD if mesh.world > 1 else None, once=once)
    optimizer = MuonAdamW(model, fsdp_units, **adamw) if args.optimizer == "muon" else \
        FSDPAdamW(model, fsdp_units, **adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: lr_factor(s, **schedule))

    # ---- resume
    ckpt_dir = Path(args.out) / "checkpoints"
    checkpointer = Checkpointer(ckpt_dir, mesh.rank, args.keep_checkpoints, args.async_checkpoint)
    start_step, resume_from = 0, None
    candidates = [] if args.eval_only and not args.resume else resume_candidates(args.resume, ckpt_dir)  # (checked)
    for candidate in candidates:  # newest first; with auto an unreadable one falls back to the one before
        try:
            if args.eval_only:  # the weights only
                start_step = load_checkpoint(candidate, {"model": optimizer.checkpoint_state(model)["model"]}, {},
                                             mesh.rank)["step"]
                optimizer.gather()  # pp > 1: gather the loaded shards again
            else:
                extra = load_checkpoint(candidate, optimizer.checkpoint_state(model),
                                        {"scheduler": scheduler.state_dict(), "data": loader.state_dict()}, mesh.rank)
                optimizer.after_load(extra)
                scheduler.load_state_dict(extra["scheduler"])
                loader.load_state_dict(extra["data"])
                start_step = extra["step"]
            resume_from = candidate
            break
        except ValueError as e:
            if candidate == candidates[-1]:
                raise
            if mesh.is_main:
                print(f"warning: {e}; trying the previous checkpoint", flush=True)
    state_held, state_full = optimizer.state_bytes()
    if mesh.is_main:
        print(f"model {n_params / 1e6:.1f}M params on rank 0 | optimizer state {state_held / 2**20:.1f} MiB "
              f"({100 * state_held / state_full:.0f}% of unsharded) | mesh pp={mesh.pp} dp={mesh.dp} cp={mesh.cp} ep={mesh.ep} on "
              f"{device.type} | {n_micro} micro-batches of {args.micro_batch} x {args.seq_len} per rank | "
              + (f"resumed from {resume_from} at step {start_step}" if resume_from else "fresh start"), flush=True)
        if args.optimizer == "muon":
            print(f"rank 0's parameters: {optimizer.describe()}", flush=True)

    # ---- training loop
    logger = MetricsLogger(Path(args.out) / "tensorboard", mesh.is_main, args.steps, flops_per_token(cfg, args.seq_len),
                           peak_flops(device) * mesh.world, args.wandb, vars(args), resume_from is not None)
    routing.watch(model, cfg, mesh, args)  # per-layer routing statistics, --routing-trace (core/routing.py)
    history = []
    # global positions of this rank's tokens for rope [micro_batch, seq_len / cp] (None: 0..seq_len-1)
    positions_BS = cp_positions(args.seq_len, mesh.coord("cp"), mesh.cp, device).expand(args.micro_batch, -1) \
        if mesh.cp > 1 else torch.arange(args.seq_len, device=device).expand(args.micro_batch, -1)
    batch_inputs = dict(args=args, mesh=mesh, positions_BS=positions_BS, document_mask=document_mask,
                        prepare=model.prepare_batch)
    model.train()
    if args.eval_only:
        val = evaluate_sources(model, pipeline, eval_loader, batch_inputs, use_bf16)
        if mesh.is_main:
            print(f"{resume_from or args.hf_checkpoint} on {eval_dir}: val loss {val['val_loss']:.4f} | "
                  f"val ppl {val['val_ppl']:.2f} | {val['val_tokens']:,} tokens | load max/mean per layer "
                  f"{' '.join(f'{x:.2f}' for x in val['val_load_max_over_mean'])}", flush=True)
        stop.close()
        destroy_mesh()
        return [val], model
    watchdog = Watchdog(args.step_timeout, mesh.rank, mesh.world)
    profiler = StepProfiler(args.profile_steps, args.steps, args.out, mesh.rank, device)
    # window_LE: expert load since the last collapse check, window_live_LE: experts live in all of it (None: all)
    bad_in_a_row, skipped, timeline, window_LE, window_live_LE, why = 0, 0, [], 0, None, ""
    for step in range(start_step + 1, args.steps + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        watchdog.arm(step, "data")
        inject_fault("hang", step)  # MOE_TRAIN_FAULT (tests only; core/reliability.py)
        profiler.begin(step)
        input_ids, labels, positions, docs, extras = rank_batch(loader, **batch_inputs)
        routing.begin(step, input_ids, positions)
        denominators = loss_denominators(loss_terms, labels, extras, n_micro, mesh)  # over the global batch
        sources_B = getattr(loader, "sources", None)  # a mixture: each row's source; the labels' losses summed per source
        if sources_B is not None:
            sources_T = sources_B.to(device).repeat_interleave(labels.shape[1])  # in labels.flatten()'s order
            loss_groups.begin(list(sources_T.split(args.micro_batch * labels.shape[1])), len(loader.names))

        def micro_batch_loss(terms, denominators=denominators):
            return objective(terms, loss_terms, denominators)

        stats = torch.zeros(len(loss_terms), device=device)  # each term's sum (pp: on pp rank 0 only)
        watchdog.set_phase("forward-backward" if pipeline is None else "DualPipeV schedule")
        if pipeline is None:  # micro-batches one after the other, in one autocast region (as the pipeline runs:
            # autocast casts each nn.Linear weight once per region, and backwards compute alike in both)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                for mb in range(n_micro):  # `running` tells the layers which micro-batch (core/pipeline.py)
                    rows = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                    running.set(mb)
                    out = model.forward_train(input_ids[rows], labels[rows], positions[mb], docs[mb], extras[mb])
                    running.set(mb, backward=True)
                    micro_batch_loss(out.terms).backward()
                    stats += torch.stack([out.terms[name].detach() for name in loss_terms])
                running.set(None)
        else:  # DualPipeV over the pp ranks (core/pipeline.py); each layer picks its micro-batch's positions and mask
            model.set_positions(positions, doc_ids_BK=docs) if document_mask else model.set_positions(positions_BS)
            for stage in pipeline.stages:
                stage.input_ids, stage.labels = input_ids.split(args.micro_batch), labels.split(args.micro_batch)
                stage.extras, stage.loss_fn, stage.stats = extras, micro_batch_loss, {}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                pipeline.run(n_micro)
            timeline = pipeline.timeline
            stats += torch.stack([torch.as_tensor(pipeline.stages[1].stats.get(name, 0.0), dtype=stats.dtype,
                                                  device=device) for name in loss_terms])

        # ---- reliability: a step with a non-finite loss or gradient on any rank is skipped on every rank
        watchdog.set_phase("gradient reduce-scatter and norm")
        optimizer.reduce_gradients()  # (pp > 1: the reduce-scatter over each parameter's replicas; pp = 1: done)
        for fault in ("nan", "kill"):
            inject_fault(fault, step, model)
        finite_P, grad_names = grads_finite(model)  # on each rank's reduced shards
        grad_norm = optimizer.clip_grad_norm_(args.grad_clip)
        watchdog.set_phase("finiteness all-reduce")
        stats, bad_ranks, bad_names = step_is_finite(stats, finite_P, grad_names, grad_norm, mesh.rank, mesh.world)
        lr = scheduler.get_last_lr()[0]
        watchdog.set_phase("optimizer step")
        opt_time = 0.0
        if not bad_ranks:  # AdamW on this rank's shards (Muon: the matrices it owns)
            opt_time = timed(optimizer.step, device)
            fp8.CACHE.invalidate()  # new weights: the next step's first micro-batch re-quantises / re-casts them
            scheduler.step()
        bad_in_a_row, skipped = (bad_in_a_row + 1, skipped + 1) if bad_ranks else (0, skipped)
        optimizer.zero_grad()

        # statistics of the global batch: every rank holds other tokens (dp, cp, ep) or other layers (pp); the
        # model's own (Model.take_stats: the expert load and whatever its router counts) and the all-to-all rows
        watchdog.set_phase("statistics all-reduce")
        own_stats = {**model.take_stats(), **routing.take()}
        model_stats = reduce_stats({**own_stats, "a2a_rows": (torch.zeros(2, device=device) + traffic.take(), "sum")},
                                   dist.group.WORLD if mesh.world > 1 else None)
        a2a_rows, routing_stats = model_stats.pop("a2a_rows"), routing.step_done(model_stats)  # (writes a trace)

        # ---- post-step seam: the model sees the step's global statistics and the optimizer (Model.after_step;
        # by default the expert-bias update), on every rank alike
        watchdog.set_phase("Model.after_step")
        model.after_step(StepDone(step, model_stats, optimizer, Path(args.out), args, bool(bad_ranks), mesh))
        load_LE, live_LE = model_stats["expert_load"], model_stats.get("expert_live")
        logged = {n: v for n, v in model_stats.items() if n not in ("expert_load", "expert_live")
                  and own_stats[n][1] != "gather"}  # gathered records are the model's to write (after_step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        profiler.end(step)  # (writes the traces after the window's last step)
        load_per_layer = load_max_over_mean(load_LE, live_LE)  # over the experts the router could choose
        scalars = {"loss" if name == "lm" else f"{name}_loss": float(total / denominators[name])
                   for name, total in zip(loss_terms, stats)}  # every term: its sum / its denominator
        scalars.update({"lr": lr, "grad_norm": grad_norm.item(), "peak_mem_gib": peak_memory_gib(device),
                   "skipped_steps": skipped, "opt_time": opt_time,
                   "cpu_time": time.process_time() - cpu_start})  # this rank's CPU seconds (other jobs add none)
        if a2a_rows[1] > 0:  # rows sent to other ranks, deduplicated vs one per (token, expert)
            scalars["a2a_rows_vs_naive"] = (a2a_rows[0] / a2a_rows[1]).item()
        history.append(logger.log(step, time.perf_counter() - start, args.global_batch * args.seq_len, scalars,
                                  {"expert_load_max_over_mean": load_per_layer,
                                   "trained_tokens": int(denominators["lm"]), **routing_stats,
                                   **logged, **({} if sources_B is None else source_losses(
                                       loader.names, loss_groups.take(), labels, sources_B.to(device),
                                       mesh.group("dp", "cp", "ep")))}))
        watchdog.step_done(history[-1]["step_time"])
        logger.log_load_heatmap(step, load_LE, args.load_heatmap_every)
        window_LE = window_LE + load_LE
        if live_LE is not None:  # the experts live throughout the window
            window_live_LE = live_LE.bool() & (True if window_live_LE is None else window_live_LE)
        if step % 25 == 0 or step == args.steps:  # over 25 steps: one batch's content would be noise
            moe_ids = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
            warning = collapse_warning(step, window_LE, moe_ids, window_live_LE)
            if warning and mesh.is_main and step > args.warmup_steps:
                print(warning, flush=True)
            window_LE, window_live_LE = 0, None

        # ---- validation loss (every eval_every steps and after the last one)
        if eval_every > 0 and (step % eval_every == 0 or step == args.steps):
            watchdog.arm(step, "evaluation", slow=True)
            history[-1].update(evaluate_sources(model, pipeline, eval_loader, batch_inputs, use_bf16))
            if mesh.is_main:
                print(f"step {step:>5}/{args.steps} | val loss {history[-1]['val_loss']:.4f} | val ppl "
                      f"{history[-1]['val_ppl']:.2f} | {history[-1]['val_tokens']:,} tokens | load max/mean per layer "
                      f"{' '.join(f'{x:.2f}' for x in history[-1]['val_load_max_over_mean'])}"
                      + "".join(f" | {k} {v:.4f}" for k, v in history[-1].items() if k.startswith("val_loss_")), flush=True)
                for name in [k for k in history[-1] if k.startswith(("val_loss", "val_ppl"))]:  # (and per source)
                    logger.writer.add_scalar(f"val/{name[4:]}", history[-1][name], step)
        if mesh.is_main:  # the same records, machine-readable; a resumed run appends
            with open(Path(args.out) / "metrics.jsonl", "a") as f:
                f.write(json.dumps(history[-1]) + "\n")
        if bad_ranks:  # after --max-bad-steps in a row this stops the run, before it saves a checkpoint
            report_bad_step(step, bad_ranks, bad_names, bad_in_a_row, args, mesh, ckpt_dir)

        # ---- checkpoint (every ckpt_every steps, after the last one, and when every rank agrees to stop: a signal
        # or --time-limit); a background write (--async-checkpoint) is completed at the first step boundary where
        # every rank has finished it (the same all-reduce)
        watchdog.arm(step, "stop agreement and checkpoint save", slow=True)
        for fault in ("sigterm", "sigusr1", "sigterm-launcher"):  # MOE_TRAIN_FAULT (tests only)
            inject_fault(fault, step)
        why, written = stop.agree(history[-1]["step_time"], checkpointer.writing(), mesh.world, device)
        if written and checkpointer.pending is not None and mesh.is_main:
            print(f"saved checkpoint {checkpointer.complete()} (written in the background)", flush=True)
        elif written and checkpointer.pending is not None:
            checkpointer.complete()
        if why or (args.ckpt_every > 0 and (step % args.ckpt_every == 0 or step == args.steps)):
            saving = time.perf_counter()
            checkpointer.save(step, optimizer.checkpoint_state(model),
                              {"scheduler": scheduler.state_dict(), "data": loader.state_dict()})
            path = checkpointer.complete() if why or step == args.steps or not args.async_checkpoint else None
            stop.saved(time.perf_counter() - saving)
            if mesh.is_main and path is not None:
                print(f"saved checkpoint {path}", flush=True)
        watchdog.disarm()
        if why:
            break
    stop.close()
    logger.close()
    if why:  # the run stops early, its state saved: no export or sample (a relaunch with --resume auto goes on)
        if mesh.is_main:
            print(f"stopped after step {step} of {args.steps} ({why}); checkpoint {path} holds every rank's state: "
                  f"relaunch with --resume auto to continue", flush=True)
        destroy_mesh()
        return history, model
    if fsdp_units is not None:  # this rank's part of the model whole again, for export, sampling and the caller
        model = whole_model(model, lambda: Model(cfg, **parts))
    if pipeline is not None:  # the last step's schedule, one list of (op, start, end) per pp rank, for
        # python -m tools.pipeline_timeline --from-json <out>/pipeline_timeline.json
        timelines = [None] * mesh.world
        dist.all_gather_object(timelines, timeline)
        if mesh.is_main:
            per_pp_rank = timelines[:: mesh.world // args.pp]
            (Path(args.out) / "pipeline_timeline.json").write_text(json.dumps(per_pp_rank))

    # ---- export and sample (every rank takes part: each writes the tensors it is the first replica of, and
    # expert parallelism needs every ep rank in each forward)
    if args.export_hf:
        save_hf_checkpoint(model, args.export_hf, dense=mesh.first_replica(experts=False),
                           experts=mesh.first_replica(experts=True))
        if mesh.is_main:
            print(f"exported Hugging Face folder {args.export_hf}", flush=True)
    if args.sample_tokens > 0 and args.pp > 1:
        if mesh.is_main:
            print("no sample: with --pp no rank holds the whole model (export it with --export-hf and sample that)")
    elif args.sample_tokens > 0 or args.sample_chat:
        wanted = ([(args.sample_prompt, False)] if args.sample_tokens > 0 else []) + \
            ([(args.sample_chat, True)] if args.sample_chat else [])  # (prompt, through the chat template)
        for prompt, chat in wanted:
            text = sample(model, loader.meta, args, device, prompt, chat)
            if mesh.is_main:
                print(f"sample{' (chat)' if chat else ''}: {text!r}", flush=True)
    if mesh.is_main and history:
        print(f"trained steps {history[0]['step']}-{history[-1]['step']} in {sum(h['step_time'] for h in history):.0f}s: "
              f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}", flush=True)
    if mesh.is_main:
        print(f"tensorboard logs: {Path(args.out) / 'tensorboard'}  (tensorboard --logdir {args.out})\n"
              f"checkpoints: {ckpt_dir}", flush=True)
    destroy_mesh()
    return history, model


def check_arguments(args: Args) -> None:
    """Bad flags fail here, in one line each, before any work (the layout is checked with the mesh)."""
    check_args({
        f"--steps must be >= 1, got {args.steps}": args.steps >= 1,
        f"--lr must be >= 0, got {args.lr}": args.lr >= 0,
        f"--warmup-steps must be >= 0, got {args.warmup_steps}": args.warmup_steps >= 0,
        f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}": 0 <= args.min_lr_ratio <= 1,
        f"--decay-fraction must be in [0, 1], got {args.decay_fraction}": 0 <= args.decay_fraction <= 1,
        f"--beta1 and --beta2 must be in [0, 1), got {args.beta1}, {args.beta2}": 0 <= args.beta1 < 1 and 0 <= args.beta2 < 1,
        f"--adam-eps must be > 0, got {args.adam_eps}": args.adam_eps > 0,
        f"--weight-decay must be >= 0, got {args.weight_decay}": args.weight_decay >= 0,
        f"--grad-clip must be >= 0 (0: off), got {args.grad_clip}": args.grad_clip >= 0,
        f"--expert-bias-rate must be >= 0 (0: off), got {args.expert_bias_rate}": args.expert_bias_rate >= 0,
        f"--ckpt-every must be >= 0 (0: off), got {args.ckpt_every}": args.ckpt_every >= 0,
        f"--keep-checkpoints must be >= 0 (0: all), got {args.keep_checkpoints}": args.keep_checkpoints >= 0,
        f"--max-bad-steps must be >= 1, got {args.max_bad_steps}": args.max_bad_steps >= 1,
        f"--step-timeout must be >= 0 (0: automatic), got {args.step_timeout}": args.step_timeout >= 0,
        f"--eval-batches must be >= 1, got {args.eval_batches}": args.eval_batches >= 1,
        f"--time-limit must be >= 0 minutes (0: none), got {args.time_limit}": args.time_limit >= 0,
        f"--routing-trace must be >= 0 (0: never), got {args.routing_trace}": args.routing_trace >= 0,
        f"--sample-tokens must be >= 0, got {args.sample_tokens}": args.sample_tokens >= 0,
        "--sample-chat samples without the pipeline: use --pp 1 (or export with --export-hf and sample that)":
            not (args.sample_chat and args.pp > 1),
        f"--export-hf {args.export_hf} is a file; name a folder": not os.path.isfile(args.export_hf),
        f"--fp8-recipe {args.fp8_recipe} chooses the recipe of --fp8: add --fp8": args.fp8 or args.fp8_recipe == "rowwise",
        "--fsdp-gather micro-batch needs --pp 1 (DualPipeV runs a layer's steps, not its forward: FSDP2 gathers once "
        "per step there); drop it": not (args.fsdp_gather == "micro-batch" and args.pp > 1),
    })
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --out {args.out} ({e.strerror}); choose a writable folder") from None


def check_run(args: Args, world: int):
    """Every check that needs no process group, against a world of `world` ranks: flags, the model config, the
    layout, the batch split, the data and the checkpoint to resume. Returns the model config. train.py runs it
    first on every rank; launch.sh runs it once (--dry-run) before torchrun starts any rank, so that a user error
    costs one line."""
    check_arguments(args)
    check_wandb(args.wandb)  # the optional package, before any rank starts
    parse_steps(args.profile_steps, args.steps)
    lr_factor(0, args.lr_schedule, args.warmup_steps, args.steps, args.min_lr_ratio, args.decay_fraction)
    if args.cp >= 1 and args.seq_len % (2 * args.cp):  # (cp < 1 is rejected with the layout)
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by 2*cp = {2 * args.cp}: context parallelism "
                         f"cuts each sequence into 2*cp chunks; use a --seq-len that is a multiple of {2 * args.cp}")
    cfg = load_config(args.hf_checkpoint or args.config)
    model = declared(Model, cfg)  # a model holding no layer: what this config's model declares
    loss_weights(model.loss_terms(args), args.loss_weight)  # an unknown term or a bad weight
    check_features(model.features, {  # optional features: each model.py says which it has (Model.features)
        "expert_bias": (f"--expert-bias-rate {args.expert_bias_rate}", args.expert_bias_rate > 0),
        "aux_loss": (f"--aux-loss-coef {args.aux_loss_coef}", args.aux_loss_coef > 0),
        "recompute": (f"--recompute {args.recompute}", args.recompute != "none"),
        "fp8": ("--fp8", args.fp8), "muon": ("--optimizer muon", args.optimizer == "muon")},
        f"recipes/{Path(__file__).parent.name}/model.py")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    fp8.set_scaling(args.fp8_recipe, "cuda" if cuda else "cpu")  # every FP8 GEMM's recipe (core/fp8.py)
    if args.pp > 1:
        split_layers(cfg.num_hidden_layers, args.pp, flops_by_layer(cfg, args.seq_len))  # clear error if too few layers
    pp, dp, cp, ep = resolve_layout(world, args.pp, args.dp, args.cp, args.ep)
    Placement.parse(args.expert_placement, cfg.num_experts, ep)  # a bad table
    data_world = dp * ep  # ranks reading different sequences (cp ranks share theirs)
    if args.micro_batch < 1 or args.global_batch < 1 or args.global_batch % (data_world * args.micro_batch):
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by data ranks ({data_world}) "
                         f"x --micro-batch {args.micro_batch} (both >= 1)")
    n_micro = args.global_batch // data_world // args.micro_batch
    if pp > 1 and n_micro < 2 * pp:
        raise ValueError(f"DualPipeV needs at least 2*pp = {2 * pp} micro-batches per rank and step, got "
                         f"{n_micro}; raise --global-batch or lower --micro-batch")
    check_train_args(Model, cfg, args, world)  # GPU: refuse a layout that cannot fit
    eval_dir, eval_every = eval_settings(args)
    for what, path in (("dataset", args.data), ("validation data", eval_dir if eval_every > 0 or args.eval_only else "")):
        if path:
            data_loader = open_dataset(path, args.seq_len, args.global_batch, 0, data_world, args.seed)
            meta, vocab = data_loader.meta, data_loader.meta["vocab_size"]
            if what == "dataset":  # on by default for a dataset of whole documents (conversations)
                check_features(model.features, {"document_mask": (
                    "--document-mask" if args.document_mask else "a dataset of whole documents (--document-mask is "
                    "its default: pass --no-document-mask)", data_loader.documents if args.document_mask is None
                    else args.document_mask)}, f"recipes/{Path(__file__).parent.name}/model.py")
            if args.sample_chat and what == "dataset" and meta["tokenizer"]["kind"] != "hf":
                raise ValueError(f"--sample-chat needs a Hugging Face tokenizer with a chat template, but {path} was "
                                 f"made with a {meta['tokenizer']['kind']} tokenizer; prepare it with --hf-tokenizer")
            if vocab > cfg.vocab_size:
                raise ValueError(f"{what} {path} has vocab {vocab} but the model only {cfg.vocab_size}; tokenize with "
                                 f"the model's tokenizer or use a bigger config")
    if args.eval_only and not (args.resume or args.hf_checkpoint):
        raise ValueError("--eval-only evaluates loaded weights: give --resume STEP_DIR or --hf-checkpoint FOLDER")
    if not args.eval_only or args.resume:
        resume_candidates(args.resume, Path(args.out) / "checkpoints")  # a missing or unexpected checkpoint
    return cfg


def eval_settings(args: Args) -> tuple[str, int]:
    """(validation data folder, or sources as --data takes them, or '', evaluate every this many steps): <data>/val
    from tools/prepare_data.py (a mixture: each source's own that exists) unless --eval-data names other data;
    by default with every checkpoint when such a split exists."""
    sources = parse_mixture(args.data)
    found = [(name, os.path.join(path, "val"), w) for name, path, w in sources if os.path.isdir(os.path.join(path, "val"))]
    default_val = os.path.join(sources[0][1], "val")
    eval_dir = args.eval_data or (found[0][1] if len(sources) == 1 and found else
                                  ",".join(f"{name}={path}:{w}" for name, path, w in found))
    eval_every = args.eval_every if args.eval_every >= 0 else (args.ckpt_every if eval_dir else 0)
    if (eval_every > 0 or args.eval_only) and not eval_dir:
        raise ValueError(f"evaluation needs validation data but {default_val} does not exist; rerun tools.prepare_data "
                         f"(it writes a val/ split) or pass --eval-data DIR (or --eval-every 0)")
    return eval_dir, eval_every


def report_bad_step(step, bad_ranks, bad_names, bad_in_a_row, args, mesh, ckpt_dir):
    """Log a skipped step; after --max-bad-steps in a row, stop the run (every rank raises the same)."""
    names = ", ".join(bad_names[:6]) + (f" and {len(bad_names) - 6} more" if len(bad_names) > 6 else "")
    if mesh.is_main:
        print(f"warning: step {step} skipped (no weight, optimizer or lr change): non-finite loss or gradient on "
              f"ranks {bad_ranks}; parameters with non-finite gradients: {names or 'none (the loss)'} "
              f"[{bad_in_a_row} in a row, --max-bad-steps {args.max_bad_steps}]", flush=True)
    if bad_in_a_row >= args.max_bad_steps:
        found = complete_checkpoints(ckpt_dir)
        raise StopRun(f"{bad_in_a_row} steps in a row ({step - bad_in_a_row + 1}-{step}) had a non-finite loss or "
                      f"gradient (ranks {bad_ranks}; {names or 'the loss'}), so the run stopped; "
                      + (f"the newest checkpoint {found[-1]} holds the last good weights: resume from it" if found else
                         "no checkpoint was written: restart")
                      + " with a lower --lr or --grad-clip, or check the data around this step")


def rank_batch(loader, args, mesh, positions_BS, document_mask: bool, prepare):
    """This rank's part of the loader's next global batch: input ids and labels [local batch, seq_len / cp] (under
    cp, chunks r and 2cp-1-r of every sequence), per micro-batch the rope positions [micro_batch, seq_len / cp]
    and the document ids of the whole sequences [micro_batch, seq_len] (the block-causal mask, which cp_attention_mask
    splits itself) with document_mask (without: positions_BS, 0..seq_len-1 or their cp part, and None), and the
    extras per micro-batch: prepare (Model.prepare_batch) of the whole sequences, each tensor split for cp like the
    ids."""
    device, cp_rank = positions_BS.device, mesh.coord("cp")
    n_micro = args.global_batch // mesh.data_world // args.micro_batch
    input_ids, labels, *docs = (t.to(device) for t in loader.next_batch(documents=document_mask))
    whole_positions = positions_in_documents(docs[0]) if document_mask else \
        torch.arange(args.seq_len, device=device).expand_as(input_ids)  # rope restarts at every document
    extras = prepare(input_ids, labels, docs[0] if document_mask else None, whole_positions)
    if mesh.cp > 1:  # this rank's chunks r and 2cp-1-r of every sequence: [local_batch, seq_len / cp]
        input_ids, labels = (split_for_cp(t, cp_rank, mesh.cp) for t in (input_ids, labels))
        extras = {name: split_for_cp(t, cp_rank, mesh.cp) for name, t in extras.items()}
    extras = [{name: t[mb * args.micro_batch:(mb + 1) * args.micro_batch] for name, t in extras.items()}
              for mb in range(n_micro)]
    if not document_mask:
        return input_ids, labels, [positions_BS] * n_micro, [None] * n_micro, extras
    positions_BK = split_for_cp(whole_positions, cp_rank, mesh.cp) if mesh.cp > 1 else whole_positions
    return (input_ids, labels, list(positions_BK.split(args.micro_batch)), list(docs[0].split(args.micro_batch)),
            extras)


@torch.no_grad()
def evaluate(model, pipeline, loader, batch_inputs: dict, use_bf16) -> dict:
    """Validation loss (cross-entropy per label: per trained token under loss masks) and perplexity over the first
    --eval-batches global batches of `loader` (the same windows every time), under any layout; every rank takes
    part (pp: the forward-only schedule). Also the expert load max/mean per layer over those tokens; these routing
    counts stay out of the training statistics and the expert bias. batch_inputs: rank_batch's arguments."""
    args, mesh = batch_inputs["args"], batch_inputs["mesh"]
    device, n_micro = batch_inputs["positions_BS"].device, args.global_batch // mesh.data_world // args.micro_batch
    totals = torch.zeros(2, device=device)  # summed cross-entropy, labels (pp: on pp rank 0, which holds the loss)
    loader.step = 0
    for _ in range(max(1, min(args.eval_batches, loader.num_samples // args.global_batch))):
        input_ids, labels, positions, docs, extras = rank_batch(loader, **batch_inputs)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            if pipeline is None:
                for mb, (ids, lab) in enumerate(zip(input_ids.split(args.micro_batch), labels.split(args.micro_batch))):
                    running.set(mb)
                    totals[0] += model.forward_train(ids, lab, positions[mb], docs[mb], extras[mb]).terms["lm"].float()
                running.set(None)
            else:
                model.set_positions(positions, doc_ids_BK=docs if batch_inputs["document_mask"] else None)
                for stage in pipeline.stages:
                    stage.input_ids, stage.labels = input_ids.split(args.micro_batch), labels.split(args.micro_batch)
                    stage.extras, stage.loss_fn, stage.stats = extras, (lambda terms: terms["lm"]), {}
                pipeline.run(n_micro, forward_only=True)
                totals[0] += pipeline.stages[1].stats.get("lm", 0.0)
        if pipeline is None or mesh.coord("pp") == 0:
            totals[1] += (labels != -100).sum()
    stats = reduce_stats(model.take_stats(), dist.group.WORLD if mesh.world > 1 else None)
    traffic.take()
    if mesh.world > 1:
        dist.all_reduce(totals)
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(totals[1]),
            "val_load_max_over_mean": load_max_over_mean(stats["expert_load"], stats.get("expert_live"))}


def evaluate_sources(model, pipeline, loaders: dict, batch_inputs: dict, use_bf16) -> dict:
    """evaluate() on each validation source ({name: (loader, weight)}); several (a mixture's own splits): also
    val_loss_<name> of each, val_loss their mean by weight, the expert load the worst per layer."""
    found = {name: evaluate(model, pipeline, loader, batch_inputs, use_bf16) for name, (loader, _) in loaders.items()}
    if len(found) == 1:
        return next(iter(found.values()))
    loss = sum(w * found[name]["val_loss"] for name, (_, w) in loaders.items()) / sum(w for _, w in loaders.values())
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": sum(r["val_tokens"] for r in found.values()),
            "val_load_max_over_mean": [max(x) for x in zip(*(r["val_load_max_over_mean"] for r in found.values()))],
            **{f"val_loss_{name}": r["val_loss"] for name, r in found.items()}}


@torch.no_grad()
def sample(model, meta, args, device, prompt: str, chat: bool = False) -> str:
    """Temperature-0.8 top-40 sampling without a KV cache (the tiny demo model only) of --sample-tokens tokens
    (64 if 0) after `prompt`; chat: `prompt` is a user's question rendered by the tokenizer's chat template, the
    answer stops at the eos (which ends a turn) and only the answer is returned."""
    tokenizer = load_tokenizer(meta)
    if chat and tokenizer.chat_prompt is None:
        raise ValueError(f"--sample-chat needs a tokenizer with a chat template; {meta['tokenizer']['path']} has none "
                         "(prepare the data with --hf-tokenizer of the instruct model, tools/prepare_data.py --chat)")
    start = tokenizer.chat_prompt([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    ids = torch.tensor([start], device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    model.eval()
    for _ in range(args.sample_tokens or 64):
        logits_V = model(ids[:, -args.seq_len:])[0, -1].float() / 0.8
        top = logits_V.topk(40)
        next_id = top.indices[torch.multinomial(top.values.softmax(-1), 1, generator=gen)]
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        if chat and int(next_id) == tokenizer.eos_id:
            break
    model.train()
    return tokenizer.decode(ids[0, len(start) if chat else 0:].tolist())


if __name__ == "__main__":
    run_main(main)
