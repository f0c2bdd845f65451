"""Train DeepSeek-V2: args -> mesh -> data -> model -> load -> optimizer -> resume -> loop (log, checkpoint) -> export.

    torchrun --nproc-per-node 2 -m recipes.deepseek_v2_lite.train --steps 300 --ep 2      (or: bash launch.sh)

The loss of a step is the cross-entropy summed over every non-ignored label of the global batch, divided by
their number (counted across all ranks before the forward), plus aux_loss_coef x the mean per-micro-batch
sequence-wise balance loss (each a mean over its sequences). Each micro-batch's backward adds its share, and
gradients are *summed* over the ranks replicating a parameter (dense: dp x cp x ep, routed experts: dp x cp,
since each ep rank holds other experts and already received its ep group's tokens for them), so any layout
equals one process running the same global batch and micro-batch split. The cp ranks of a group read the same
sequences and each keeps its 2 of their 2*cp chunks (core/context.py): every per-token sum (loss, label count,
expert load) then adds over cp too.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from core import fp8
from core.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from core.context import cp_positions, split_for_cp
from core.data import TokenLoader, load_tokenizer
from core.mesh import build_mesh, destroy_mesh
from core.metrics import MetricsLogger, peak_flops, peak_memory_gib
from core.moe import traffic, update_expert_bias
from core.optimizer import ReplicaSet, ShardedAdamW
from core.pipeline import DualPipeV, split_layers
from core.training import lr_factor, parse_args

from .model import (
    Model,
    ModelConfig,
    MoE,
    PipelineStage,
    compile_dense_parts,
    enable_fp8,
    flops_per_token,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config_path,
)


@dataclass
class Args:
    """Train DeepSeek-V2-Lite (or the tiny CPU config) with data, context and expert parallelism."""

    config: str = str(tiny_config_path())  # HF config.json; ignored when --hf-checkpoint is given
    hf_checkpoint: str = ""  # start from these Hugging Face weights (its config.json is used)
    data: str = "data/stdlib"  # token shards from tools/prepare_data.py
    out: str = "runs/deepseek_v2_lite"  # tensorboard/ and checkpoints/ go here
    pp: int = 1  # DualPipeV over this many ranks: 2*pp stages, each rank holds two (needs >= 2*pp micro-batches)
    overlap: bool = True  # pp: overlap one micro-batch's forward with another's backward at the all-to-alls
    delay_wgrad: bool = True  # pp: delay expert weight gradients into the schedule's W slots (zero bubble)
    dp: int = -1  # -1: world size / (pp * cp * ep)
    cp: int = 1  # each sequence split over this many ranks (keys/values gathered); --seq-len divisible by 2*cp
    ep: int = 1  # routed experts split over this many ranks (tokens reach them by all-to-all)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    compile: bool | None = None  # torch.compile the dense parts of each layer; default on for CUDA, off for CPU
    # (there, compiling the C++ kernels takes longer than a whole tiny run and gains nothing at its sizes)
    fp8: bool = False  # FP8 GEMMs (Hopper) for attention, dense MLP and expert weights; on CPU the same numerics
    steps: int = 300
    seq_len: int = 256
    global_batch: int = 16  # sequences per optimizer step, all ranks together
    micro_batch: int = 4  # sequences per forward/backward on one rank
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    lr_schedule: str = "cosine"  # cosine | wsd
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    aux_loss_coef: float = -1.0  # < 0: the config's aux_loss_alpha (0 unless seq_aux)
    expert_bias_rate: float = 0.0  # > 0: aux-loss-free balancing, bias += rate * sign(mean - load) per step
    seed: int = 0
    ckpt_every: int = 100  # also saves after the last step; 0 disables checkpoints
    keep_checkpoints: int = 2
    resume: str = ""  # '' | auto (newest in <out>/checkpoints) | a step_* folder
    export_hf: str = ""  # write the trained model here as a Hugging Face folder
    sample_tokens: int = 0  # print a sample of this many tokens at the end
    sample_prompt: str = "def "


def main(argv=None):
    args = parse_args(Args, argv)

    # ---- mesh (the layout is checked against the world size before any process group exists)
    if args.cp >= 1 and args.seq_len % (2 * args.cp):  # (cp < 1 is rejected with the mesh)
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by 2*cp = {2 * args.cp}: context parallelism "
                         f"cuts each sequence into 2*cp chunks; use a --seq-len that is a multiple of {2 * args.cp}")
    cfg = ModelConfig.from_hf(args.hf_checkpoint or args.config)
    stage_layers = split_layers(cfg.num_hidden_layers, args.pp) if args.pp > 1 else None  # clear error if too few
    if cfg.num_experts % args.ep:
        raise ValueError(f"{cfg.num_experts} experts cannot be split evenly over --ep {args.ep}; "
                         f"choose an ep that divides {cfg.num_experts}")
    mesh = build_mesh(args.pp, args.dp, args.cp, args.ep, args.device)
    data_group = mesh.group("dp", "cp", "ep")  # ranks that hold different tokens of the batch
    device = mesh.device
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    local_batch = args.global_batch // mesh.data_world
    if args.micro_batch < 1 or args.global_batch < 1 or args.global_batch % (mesh.data_world * args.micro_batch):
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by data ranks ({mesh.data_world}) "
                         f"x --micro-batch {args.micro_batch} (both >= 1)")
    n_micro = local_batch // args.micro_batch
    if args.pp > 1 and n_micro < 2 * args.pp:
        raise ValueError(f"DualPipeV needs at least 2*pp = {2 * args.pp} micro-batches per rank and step, got "
                         f"{n_micro}; raise --global-batch or lower --micro-batch")
    torch.manual_seed(args.seed)  # same seed everywhere: identical replicas at init

    # ---- data (before the model, so that a missing or mismatched dataset fails in seconds)
    cfg = ModelConfig.from_hf(args.hf_checkpoint or args.config)
    loader = TokenLoader(args.data, args.seq_len, args.global_batch, mesh.data_rank, mesh.data_world, args.seed)
    if loader.meta["vocab_size"] > cfg.vocab_size:
        raise ValueError(f"dataset {args.data} has vocab {loader.meta['vocab_size']} but the model only "
                         f"{cfg.vocab_size}; tokenize with a matching tokenizer or use a bigger config")

    # ---- model: this rank's 1/ep of the routed experts, everything else whole (HF weights or random init)
    # with --pp, this rank's two stages of the V: stage r (holding the embedding on rank 0) and stage 2pp-1-r
    # (holding the head on rank 0)
    pp_rank = mesh.coord("pp")
    stages = (pp_rank, 2 * args.pp - 1 - pp_rank)
    parts = dict(layers=None if stage_layers is None else stage_layers[stages[0]] + stage_layers[stages[1]],
                 embed=pp_rank == 0, head=pp_rank == 0, ep_group=mesh.group("ep"), cp_group=mesh.group("cp"))
    if args.hf_checkpoint:
        with torch.device("meta"):
            model = Model(cfg, **parts)
        model.to_empty(device=device)
        model.init_weights()  # buffers (expert bias); the weights come from the checkpoint
        load_hf_checkpoint(model, args.hf_checkpoint)
    else:
        with torch.device(device):
            model = Model(cfg, **parts)
    if args.fp8:
        enable_fp8(model)
    if args.compile if args.compile is not None else device.type == "cuda":
        compile_dense_parts(model)
    routers = {i: layer.mlp.gate for i, layer in model.layers.items() if isinstance(layer.mlp, MoE)}
    pipeline = None
    if args.pp > 1:
        step_ranks = mesh.world // args.pp  # global rank distance between pipeline neighbours
        pipeline = DualPipeV([PipelineStage(model, stage_layers[s], s == 0, s == 2 * args.pp - 1) for s in stages],
                             pp_rank, args.pp, mesh.rank - step_ranks if pp_rank > 0 else None,
                             mesh.rank + step_ranks if pp_rank < args.pp - 1 else None, mesh.group("pp"),
                             [((args.micro_batch, args.seq_len // args.cp, cfg.hidden_size), torch.float32),
                              ((1,), torch.float32)], device,
                             overlap=args.overlap, delay_weight_grads=args.delay_wgrad)
    aux_coef = cfg.router_aux_loss_coef if args.aux_loss_coef < 0 else args.aux_loss_coef
    n_params = sum(p.numel() for p in model.parameters())

    # ---- optimizer (ZeRO-1: Adam state sharded over each parameter's replicas) and lr schedule
    experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}
    dense = {n: p for n, p in model.named_parameters() if n not in experts}
    optimizer = ShardedAdamW([ReplicaSet(dense, mesh.group("dp", "cp", "ep"), mesh.replica_mesh(experts=False)),
                              ReplicaSet(experts, mesh.group("dp", "cp"), mesh.replica_mesh(experts=True))],
                             args.lr, args.weight_decay, (args.beta1, args.beta2), args.adam_eps,
                             norm_group=dist.group.WORLD if mesh.world > 1 else None)
    schedule = dict(schedule=args.lr_schedule, warmup=args.warmup_steps, total=args.steps,
                    min_ratio=args.min_lr_ratio, decay_fraction=args.decay_fraction)
    lr_factor(0, **schedule)  # a wrong --lr-schedule fails here, not after the first step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: lr_factor(s, **schedule))

    # ---- resume
    ckpt_dir = Path(args.out) / "checkpoints"
    start_step = 0
    resume_from = resolve_resume(args.resume, ckpt_dir)
    if resume_from is not None:
        extra = load_checkpoint(resume_from, optimizer.checkpoint_state(model),
                                {"scheduler": scheduler.state_dict(), "data": loader.state_dict()}, mesh.rank)
        optimizer.after_load(extra)
        scheduler.load_state_dict(extra["scheduler"])
        loader.load_state_dict(extra["data"])
        start_step = extra["step"]
    state_held, state_full = optimizer.state_bytes()
    if mesh.is_main:
        print(f"model {n_params / 1e6:.1f}M params on rank 0 | Adam state {state_held / 2**20:.1f} MiB "
              f"({100 * state_held / state_full:.0f}% of unsharded) | mesh pp={mesh.pp} dp={mesh.dp} cp={mesh.cp} ep={mesh.ep} on "
              f"{device.type} | {n_micro} micro-batches of {args.micro_batch} x {args.seq_len} per rank | "
              + (f"resumed from {resume_from} at step {start_step}" if resume_from else "fresh start"), flush=True)

    # ---- training loop
    logger = MetricsLogger(Path(args.out) / "tensorboard", mesh.is_main, args.steps,
                           flops_per_token(cfg, args.seq_len), peak_flops(device) * mesh.world)
    history = []
    # global positions of this rank's tokens for rope [micro_batch, seq_len / cp] (None: 0..seq_len-1)
    positions_BS = cp_positions(args.seq_len, mesh.coord("cp"), mesh.cp, device).expand(args.micro_batch, -1) \
        if mesh.cp > 1 else torch.arange(args.seq_len, device=device).expand(args.micro_batch, -1)
    model.train()
    for step in range(start_step + 1, args.steps + 1):
        start = time.perf_counter()
        input_ids, labels = (t.to(device) for t in loader.next_batch())
        if mesh.cp > 1:  # this rank's chunks r and 2cp-1-r of every sequence: [local_batch, seq_len / cp]
            input_ids, labels = (split_for_cp(t, mesh.coord("cp"), mesh.cp) for t in (input_ids, labels))
        num_labels = (labels != -100).sum().float()
        if data_group is not None:
            dist.all_reduce(num_labels, group=data_group)
        num_labels = num_labels.clamp(min=1)

        def micro_batch_loss(loss_sum, aux_loss, num_labels=num_labels):
            return loss_sum / num_labels + aux_coef * aux_loss / (n_micro * mesh.data_world)

        stats = torch.zeros(2, device=device)  # summed cross-entropy, summed aux loss (pp: on pp rank 0 only)
        if pipeline is None:  # micro-batches one after the other
            for mb in range(n_micro):
                rows = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    out = model.forward_train(input_ids[rows], labels[rows], positions_BS)
                micro_batch_loss(out.loss_sum, out.aux_loss).backward()
                stats += torch.stack([out.loss_sum.detach(), out.aux_loss.detach()])
        else:  # DualPipeV over the pp ranks (core/pipeline.py)
            model.set_positions(positions_BS)
            for stage in pipeline.stages:
                stage.input_ids, stage.labels = input_ids.split(args.micro_batch), labels.split(args.micro_batch)
                stage.loss_fn, stage.stats = micro_batch_loss, stats
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                pipeline.run(n_micro)
            stats = pipeline.stages[1].stats

        optimizer.reduce_gradients()  # reduce-scatter over each parameter's replicas
        grad_norm = optimizer.clip_grad_norm_(args.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()  # AdamW on this rank's shard, then all-gather the weights
        fp8.CACHE.invalidate()  # new weights: the next step's first micro-batch re-quantises them (--fp8)
        scheduler.step()
        optimizer.zero_grad()

        # statistics of the global batch: every rank holds other tokens (dp, cp, ep) or other layers (pp)
        load_LE, a2a_rows = model.take_expert_load(), torch.zeros(2, device=device) + traffic.take()
        if mesh.world > 1:
            for t in (stats, load_LE, a2a_rows):
                dist.all_reduce(t)
        if args.expert_bias_rate > 0:  # global load, so the bias stays identical on every rank
            moe_ids = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
            for layer_id, load_E in zip(moe_ids, load_LE):
                if str(layer_id) in routers:
                    update_expert_bias(routers[str(layer_id)].expert_bias, load_E, args.expert_bias_rate)
        if device.type == "cuda":
            torch.cuda.synchronize()
        load_per_layer = (load_LE.max(-1).values / load_LE.mean(-1)).tolist() if load_LE.numel() else []
        scalars = {"loss": (stats[0] / num_labels).item(), "aux_loss": (stats[1] / (n_micro * mesh.data_world)).item(),
                   "lr": lr, "grad_norm": grad_norm.item(), "peak_mem_gib": peak_memory_gib(device)}
        if a2a_rows[1] > 0:  # rows sent to other ranks, deduplicated vs one per (token, expert)
            scalars["a2a_rows_vs_naive"] = (a2a_rows[0] / a2a_rows[1]).item()
        history.append(logger.log(step, time.perf_counter() - start, args.global_batch * args.seq_len, scalars,
                                  {"expert_load_max_over_mean": load_per_layer}))

        # ---- checkpoint (every ckpt_every steps and after the last one)
        if args.ckpt_every > 0 and (step % args.ckpt_every == 0 or step == args.steps):
            path = save_checkpoint(ckpt_dir, step, optimizer.checkpoint_state(model),
                                   {"scheduler": scheduler.state_dict(), "data": loader.state_dict()},
                                   mesh.rank, args.keep_checkpoints)
            if mesh.is_main:
                print(f"saved checkpoint {path}", flush=True)
    logger.close()
    if pipeline is not None:  # the last step's schedule, one list of (op, start, end) per pp rank, for
        # python -m tools.pipeline_timeline --from-json <out>/pipeline_timeline.json
        timelines = [None] * mesh.world
        dist.all_gather_object(timelines, pipeline.timeline)
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
    if args.sample_tokens > 0 and args.pp > 1 and mesh.is_main:
        print("no sample: with --pp no rank holds the whole model (export it with --export-hf and sample that)")
    elif args.sample_tokens > 0:
        text = sample(model, loader.meta, args, device)
        if mesh.is_main:
            print(f"sample: {text!r}", flush=True)
    if mesh.is_main and history:
        print(f"trained steps {history[0]['step']}-{history[-1]['step']} in {sum(h['step_time'] for h in history):.0f}s: "
              f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}", flush=True)
    if mesh.is_main:
        print(f"tensorboard logs: {Path(args.out) / 'tensorboard'}  (tensorboard --logdir {args.out})\n"
              f"checkpoints: {ckpt_dir}", flush=True)
    destroy_mesh()
    return history, model


@torch.no_grad()
def sample(model, meta, args, device) -> str:
    """Temperature-0.8 top-40 sampling without a KV cache (the tiny demo model only)."""
    tokenizer = load_tokenizer(meta)
    ids = torch.tensor([tokenizer.encode(args.sample_prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    model.eval()
    for _ in range(args.sample_tokens):
        logits_V = model(ids[:, -args.seq_len:])[0, -1].float() / 0.8
        top = logits_V.topk(40)
        next_id = top.indices[torch.multinomial(top.values.softmax(-1), 1, generator=gen)]
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    model.train()
    return tokenizer.decode(ids[0].tolist())


if __name__ == "__main__":
    main()
