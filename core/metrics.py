"""Step metrics: one log line per step, TensorBoard scalars (also to Weights & Biases with --wandb), MFU, peak
memory, progress and ETA; the model's own step statistics summed, maxed or gathered over the ranks; expert load
max/mean over the live experts."""

import functools
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peaks (NVIDIA datasheets) by device name, MFU's reference on a GPU; the best bf16 matmul
# measured on one H200 reached ~790 TFLOP/s.
DATASHEET_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989e12),
                        ("H200", 989e12), ("A100", 312e12))  # first match wins: "GH200" reads as H200 (989)


def measure_matmul_flops(device: torch.device, dtype=torch.float32, size: int = 512, repeats: int = 8) -> float:
    """Achieved matmul FLOP/s of one device (a CPU: this process's threads): square GEMMs of `size`."""
    g = torch.Generator(device=device).manual_seed(0)  # not the global RNG, which a resume has just restored
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=g) for _ in range(2))
    a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


@functools.cache
def measure_cpu_flops(threads: int, size: int = 512, repeats: int = 8) -> float:
    """Achieved fp32 matmul FLOP/s of this process's `threads` CPU threads: the 'peak' for MFU on a CPU run.
    Measured once per process and thread count (~0.2 s: a process that trains many times, as tests do, pays once)."""
    return measure_matmul_flops(torch.device("cpu"), torch.float32, size, repeats)


def peak_flops_and_source(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s per device for MFU, where it comes from). CUDA: the datasheet's dense bf16 peak of this GPU;
    a GPU not in the table: a measured bf16 matmul (8192^3); CPU: a measured fp32 matmul."""
    if device.type != "cuda":
        return measure_cpu_flops(torch.get_num_threads()), "measured fp32 matmul, CPU"
    name = torch.cuda.get_device_name(device)
    for key, flops in DATASHEET_BF16_FLOPS:
        if key in name:
            return flops, f"datasheet dense bf16, {name}"
    return measure_matmul_flops(device, torch.bfloat16, 8192, 20), f"measured bf16 matmul, {name} (not in the table)"


def peak_flops(device: torch.device) -> float:
    return peak_flops_and_source(device)[0]


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def timed(fn, device: torch.device) -> float:
    """Seconds that fn() takes, its GPU work included (on CUDA: synchronized before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


REDUCTIONS = ("sum", "max", "gather")


def reduce_stats(stats: dict[str, tuple[torch.Tensor, str]], group) -> dict[str, torch.Tensor]:
    """{name: (tensor, "sum" | "max" | "gather")} -> {name: tensor combined over the ranks of `group`} (None: this
    rank alone): counts add up, maxima take the largest, one all-reduce per kind (fp32: exact up to 2^24 per entry).

    "gather": every rank's tensor concatenated along dim 0 in the group's rank order (WORLD: global rank,
    core/mesh.py), on every rank; dim-0 sizes may differ (0 rows: a rank without the layer), the other dims and the
    dtype must agree and the dtype is kept (bool: send as uint8). Two all-gathers per name."""
    for name, (t, how) in stats.items():
        if how not in REDUCTIONS:
            raise ValueError(f"statistic {name!r}: reduction {how!r} is not one of {', '.join(REDUCTIONS)}")
        if how == "gather" and t.dim() == 0:
            raise ValueError(f"statistic {name!r}: 'gather' concatenates along dim 0; give it at least one dim")
    out = {}
    for how, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        items = [(name, t) for name, (t, h) in stats.items() if h == how]
        if not items:
            continue
        flat = torch.cat([t.detach().float().reshape(-1) for _, t in items])
        if group is not None:
            dist.all_reduce(flat, op=op, group=group)
        for (name, t), part in zip(items, flat.split([t.numel() for _, t in items])):
            out[name] = part.view(t.shape)
    for name, (t, how) in stats.items():
        if how == "gather":
            out[name] = gather_rows(t.detach(), group)
    return out


def gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `t` concatenated along dim 0 in the rank order of `group` (None: t); dim-0 sizes may differ
    (padded to the longest for the all-gather, which needs equal shapes, and cut back)."""
    if group is None:
        return t.clone()
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device), group=group)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros((max(sizes), *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


def load_max_over_mean(load_LE: torch.Tensor, live_LE: torch.Tensor | None = None) -> list[float]:
    """Per MoE layer, the busiest expert's load over the mean load, both over the experts the router can choose
    (live_LE nonzero; None: all). 1.0 is balanced; a layer with no live expert or no load reads 0."""
    if not load_LE.numel():
        return []
    live_LE = torch.ones_like(load_LE, dtype=torch.bool) if live_LE is None else live_LE.bool()
    load_LE = load_LE.float()
    busiest_L = load_LE.masked_fill(~live_LE, float("-inf")).max(-1).values.clamp(min=0)
    mean_L = (load_LE * live_LE).sum(-1) / live_LE.sum(-1).clamp(min=1)
    return torch.where(mean_L > 0, busiest_L / mean_L.clamp(min=1e-30), 0.0).tolist()


def _fmt_duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


# colour map from cold (no tokens) to hot (the busiest expert): viridis anchors, linearly interpolated between
HEATMAP_ANCHORS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def load_heatmap(load_LE: torch.Tensor, max_width: int = 1024) -> torch.Tensor:
    """Image (H, W, 3) uint8 of a (MoE layer, expert) load table: row = layer (first on top), column = expert, one
    square cell per entry, scaled up to at most max_width pixels wide; colour = load / the busiest cell's load."""
    load_LE = load_LE.detach().float().cpu()
    cell = max(1, min(16, max_width // load_LE.shape[1]))
    t_LE = load_LE / load_LE.max().clamp(min=1e-30) * (len(HEATMAP_ANCHORS) - 1)
    i_LE = t_LE.floor().clamp(max=len(HEATMAP_ANCHORS) - 2).long()
    anchors_A3 = torch.tensor(HEATMAP_ANCHORS, dtype=torch.float32)
    frac_LE1 = (t_LE - i_LE).unsqueeze(-1)
    rgb_LE3 = anchors_A3[i_LE] * (1 - frac_LE1) + anchors_A3[i_LE + 1] * frac_LE1
    return rgb_LE3.round().to(torch.uint8).repeat_interleave(cell, 0).repeat_interleave(cell, 1)


class WandbWriter:
    """A SummaryWriter whose scalars also go to a Weights & Biases run (--wandb); the run's id is kept in
    out/wandb_run_id, so that a resumed run continues it."""

    def __init__(self, writer, project: str, out: Path, config: dict, resumed: bool):
        import wandb

        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None  # None: a new run
        self.writer, self.run = writer, wandb.init(project=project, id=run_id, resume="allow", config=config, dir=out)
        id_file.write_text(self.run.id)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)
        self.run.log({tag: value}, step=step)  # (wandb merges the scalars of one step into one row)

    def __getattr__(self, name):  # add_image and the rest: TensorBoard only
        return getattr(self.writer, name)

    def close(self) -> None:
        self.writer.close()
        self.run.finish()


class MetricsLogger:
    """Prints a line per step and writes TensorBoard scalars (wandb_project: also to wandb, WandbWriter, its config
    and run id file in log_dir's parent: the run's --out), on the main rank only."""

    def __init__(self, log_dir, enabled: bool, total_steps: int, flops_per_token: float, peak_flops_total: float,
                 wandb_project: str = "", config: dict | None = None, resumed: bool = False):
        self.enabled, self.total_steps = enabled, total_steps
        self.flops_per_token, self.peak_flops_total = flops_per_token, peak_flops_total
        self.step_times: list[float] = []
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir)
            if wandb_project:
                self.writer = WandbWriter(self.writer, wandb_project, Path(log_dir).parent, config or {}, resumed)

    def log(self, step: int, step_time: float, tokens: int, scalars: dict[str, float], stats: dict | None = None) -> dict:
        """scalars: loss, other loss terms as NAME_loss (printed as NAME), lr, grad_norm, ...; adds throughput, MFU,
        memory. stats: per-step statistics (expert_load_max_over_mean, Model.take_stats), each a scalar or a 1-D
        tensor / list (larger tensors are left out). Returns the full record (metrics.jsonl)."""
        self.step_times.append(step_time)
        tokens_per_s = tokens / step_time
        record = {"step": step, **scalars, "tokens_per_s": tokens_per_s,
                  "mfu": self.flops_per_token * tokens_per_s / self.peak_flops_total, "step_time": step_time}
        extra = {}  # name -> float or list of floats
        for name, value in (stats or {}).items():
            value = value.tolist() if isinstance(value, torch.Tensor) and value.dim() <= 1 else value
            if isinstance(value, (int, float)) or (isinstance(value, list) and not any(isinstance(v, list) for v in value)):
                extra[name] = value
        record.update(extra)
        if not self.enabled:
            return record
        recent = self.step_times[-20:]
        eta = (self.total_steps - step) * sum(recent) / len(recent)
        load = extra.get("expert_load_max_over_mean", [])
        a2a = f" | a2a rows {100 * record['a2a_rows_vs_naive']:.0f}% of naive" if "a2a_rows_vs_naive" in record else ""
        opt = f" (optimizer {1000 * record['opt_time']:.0f} ms)" if "opt_time" in record else ""
        terms = "".join(f" | {name.removesuffix('_loss')} {v:.4f}" for name, v in scalars.items() if name.endswith("_loss"))
        own = "".join(f" | {name} " + (" ".join(f"{x:.3g}" for x in v) if isinstance(v, list) else f"{v:.4g}")
                      for name, v in extra.items() if name != "expert_load_max_over_mean")
        print(f"step {step:>5}/{self.total_steps} | loss {record['loss']:.4f}{terms} | "
              f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | load max/mean per layer "
              f"{' '.join(f'{x:.2f}' for x in load) or '-'}{a2a}{own} | {tokens_per_s:,.0f} tok/s | "
              f"MFU {100 * record['mfu']:.2f}% | {1000 * step_time:.0f} ms{opt} | mem {record['peak_mem_gib']:.2f} GiB | "
              f"eta {_fmt_duration(eta)}", flush=True)
        for name, value in record.items():
            if name != "step" and name not in extra:
                self.writer.add_scalar(f"train/{name}", value, step)
        for name, value in extra.items():
            if isinstance(value, list):
                for layer, v in enumerate(value):
                    self.writer.add_scalar(f"{name}/layer_{layer:02d}", v, step)
            else:
                self.writer.add_scalar(f"train/{name}", value, step)
        return record

    def log_load_heatmap(self, step: int, load_LE: torch.Tensor, every: int) -> None:
        """The (MoE layer, expert) load table as a TensorBoard image (load_heatmap) every `every` steps; 0: never."""
        if self.enabled and every > 0 and step % every == 0 and load_LE.numel():
            self.writer.add_image("expert_load/layer_x_expert", load_heatmap(load_LE).numpy(), step, dataformats="HWC")

    def close(self):
        if self.writer is not None:
            self.writer.close()
