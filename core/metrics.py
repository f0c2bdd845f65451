"""Step metrics: one log line per step, TensorBoard scalars, MFU, peak memory, progress and ETA."""

import resource
import sys
import time

import torch

# Dense bf16 matmul throughput measured on one H200 (datasheet 989 TFLOP/s); used for MFU on GPUs.
H200_BF16_FLOPS = 790e12


def measure_cpu_flops(size: int = 512, repeats: int = 8) -> float:
    """Achieved fp32 matmul FLOP/s of this process's CPU threads: the 'peak' for MFU on a CPU run."""
    g = torch.Generator().manual_seed(0)  # not the global RNG, which a resume has just restored
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def peak_flops(device: torch.device) -> float:
    return H200_BF16_FLOPS if device.type == "cuda" else measure_cpu_flops()


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def _fmt_duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Prints a line per step and writes TensorBoard scalars, on the main rank only."""

    def __init__(self, log_dir, enabled: bool, total_steps: int, flops_per_token: float, peak_flops_total: float):
        self.enabled, self.total_steps = enabled, total_steps
        self.flops_per_token, self.peak_flops_total = flops_per_token, peak_flops_total
        self.step_times: list[float] = []
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir)

    def log(self, step: int, step_time: float, tokens: int, scalars: dict[str, float], per_layer: dict | None = None) -> dict:
        """scalars: loss, aux_loss, lr, grad_norm, ... ; adds throughput, MFU, memory; returns the full record."""
        self.step_times.append(step_time)
        tokens_per_s = tokens / step_time
        record = {"step": step, **scalars, "tokens_per_s": tokens_per_s,
                  "mfu": self.flops_per_token * tokens_per_s / self.peak_flops_total, "step_time": step_time}
        if not self.enabled:
            return record
        recent = self.step_times[-20:]
        eta = (self.total_steps - step) * sum(recent) / len(recent)
        load = (per_layer or {}).get("expert_load_max_over_mean", [])
        a2a = f" | a2a rows {100 * record['a2a_rows_vs_naive']:.0f}% of naive" if "a2a_rows_vs_naive" in record else ""
        print(f"step {step:>5}/{self.total_steps} | loss {record['loss']:.4f} | aux {record['aux_loss']:.4f} | "
              f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | load max/mean per layer "
              f"{' '.join(f'{x:.2f}' for x in load) or '-'}{a2a} | {tokens_per_s:,.0f} tok/s | MFU {100 * record['mfu']:.2f}% | "
              f"{1000 * step_time:.0f} ms | mem {record['peak_mem_gib']:.2f} GiB | eta {_fmt_duration(eta)}", flush=True)
        for name, value in record.items():
            if name != "step":
                self.writer.add_scalar(f"train/{name}", value, step)
        for name, values in (per_layer or {}).items():
            for layer, value in enumerate(values):
                self.writer.add_scalar(f"{name}/layer_{layer:02d}", value, step)
        return record

    def close(self):
        if self.writer is not None:
            self.writer.close()
