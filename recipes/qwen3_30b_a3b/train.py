"""Train Qwen3-MoE: args -> mesh -> data -> model -> load -> optimizer -> resume -> loop (log, checkpoint) -> export.

    torchrun --nproc-per-node 2 -m recipes.qwen3_30b_a3b.train --steps 300 --ep 2      (or: bash launch.sh)

The loss of a step is the cross-entropy summed over every non-ignored label of the global batch, divided by
their number (counted across all data ranks before the forward), plus aux_loss_coef x the mean
per-micro-batch load-balancing loss. Each micro-batch's backward adds its share, and gradients are *summed*
over the ranks replicating a parameter (dense: dp x ep, routed experts: dp, since each ep rank holds other
experts and already received every data rank's tokens for them), so any layout equals one process running
the same global batch and micro-batch split.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from core.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from core.data import TokenLoader, load_tokenizer
from core.mesh import build_mesh, destroy_mesh
from core.metrics import MetricsLogger, peak_flops, peak_memory_gib
from core.moe import update_expert_bias
from core.optimizer import ReplicaSet, ShardedAdamW
from core.training import lr_factor, parse_args

from .model import Model, ModelConfig, MoE, flops_per_token, load_hf_checkpoint, save_hf_checkpoint, tiny_config_path


@dataclass
class Args:
    """Train Qwen3-30B-A3B (or the tiny CPU config) with data and expert parallelism."""

    config: str = str(tiny_config_path())  # HF config.json; ignored when --hf-checkpoint is given
    hf_checkpoint: str = ""  # start from these Hugging Face weights (its config.json is used)
    data: str = "data/stdlib"  # token shards from tools/prepare_data.py
    out: str = "runs/qwen3_30b_a3b"  # tensorboard/ and checkpoints/ go here
    pp: int = 1
    dp: int = -1  # -1: world size / (pp * cp * ep)
    cp: int = 1
    ep: int = 1  # routed experts split over this many ranks (tokens reach them by all-to-all)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
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
    aux_loss_coef: float = -1.0  # < 0: the config's router_aux_loss_coef
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
    if (args.pp, args.cp) != (1, 1):
        raise ValueError("this recipe trains with data and expert parallelism so far; use --pp 1 --cp 1")
    cfg = ModelConfig.from_hf(args.hf_checkpoint or args.config)
    if cfg.num_experts % args.ep:
        raise ValueError(f"{cfg.num_experts} experts cannot be split evenly over --ep {args.ep}; "
                         f"choose an ep that divides {cfg.num_experts}")
    mesh = build_mesh(args.pp, args.dp, args.cp, args.ep, args.device)
    data_group = mesh.group("dp", "ep")  # ranks that read different sequences of the batch
    device = mesh.device
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    local_batch = args.global_batch // mesh.data_world
    if args.micro_batch < 1 or args.global_batch < 1 or args.global_batch % (mesh.data_world * args.micro_batch):
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by data ranks ({mesh.data_world}) "
                         f"x --micro-batch {args.micro_batch} (both >= 1)")
    n_micro = local_batch // args.micro_batch
    torch.manual_seed(args.seed)  # same seed everywhere: identical replicas at init

    # ---- data (before the model, so that a missing or mismatched dataset fails in seconds)
    cfg = ModelConfig.from_hf(args.hf_checkpoint or args.config)
    loader = TokenLoader(args.data, args.seq_len, args.global_batch, mesh.data_rank, mesh.data_world, args.seed)
    if loader.meta["vocab_size"] > cfg.vocab_size:
        raise ValueError(f"dataset {args.data} has vocab {loader.meta['vocab_size']} but the model only "
                         f"{cfg.vocab_size}; tokenize with a matching tokenizer or use a bigger config")

    # ---- model: this rank's 1/ep of the routed experts, everything else whole (HF weights or random init)
    if args.hf_checkpoint:
        with torch.device("meta"):
            model = Model(cfg, ep_group=mesh.group("ep"))
        model.to_empty(device=device)
        model.init_weights()  # buffers (expert bias); the weights come from the checkpoint
        load_hf_checkpoint(model, args.hf_checkpoint)
    else:
        with torch.device(device):
            model = Model(cfg, ep_group=mesh.group("ep"))
    routers = [layer.mlp.gate for layer in model.layers.values() if isinstance(layer.mlp, MoE)]
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
    model.train()
    for step in range(start_step + 1, args.steps + 1):
        start = time.perf_counter()
        input_ids, labels = (t.to(device) for t in loader.next_batch())
        num_labels = (labels != -100).sum().float()
        if data_group is not None:
            dist.all_reduce(num_labels, group=data_group)
        num_labels = num_labels.clamp(min=1)

        stats = torch.zeros(2, device=device)  # summed cross-entropy, summed aux loss
        tokens_per_expert, a2a_rows = 0, 0
        for mb in range(n_micro):
            rows = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                out = model.forward_train(input_ids[rows], labels[rows])
            loss = out.loss_sum / num_labels + aux_coef * out.aux_loss / (n_micro * mesh.data_world)
            loss.backward()
            stats += torch.stack([out.loss_sum.detach(), out.aux_loss.detach()])
            tokens_per_expert = tokens_per_expert + out.tokens_per_expert_LE
            a2a_rows = a2a_rows + out.a2a_rows

        optimizer.reduce_gradients()  # reduce-scatter over each parameter's replicas
        grad_norm = optimizer.clip_grad_norm_(args.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()  # AdamW on this rank's shard, then all-gather the weights
        scheduler.step()
        optimizer.zero_grad()

        load_LE, a2a_rows = tokens_per_expert.float(), a2a_rows.float()
        if data_group is not None:
            for t in (stats, load_LE, a2a_rows):
                dist.all_reduce(t, group=data_group)
        if args.expert_bias_rate > 0:  # global load, so the bias stays identical on every rank
            for router, load_E in zip(routers, load_LE):
                update_expert_bias(router.expert_bias, load_E, args.expert_bias_rate)
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

    # ---- export and sample (every rank takes part: each writes the tensors it is the first replica of, and
    # expert parallelism needs every ep rank in each forward)
    if args.export_hf:
        save_hf_checkpoint(model, args.export_hf, dense=mesh.first_replica(experts=False),
                           experts=mesh.first_replica(experts=True))
        if mesh.is_main:
            print(f"exported Hugging Face folder {args.export_hf}", flush=True)
    if args.sample_tokens > 0:
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
