"""Microbenchmarks that calibrate the step-time model of tools/plan.py: the rates this machine reaches on the
operations a training step is made of, written to a JSON file that `tools/plan.py --calibration FILE` reads.

    python -m tools.calibrate --out runs/calibration_cpu.json            # this CPU: 1, 2 and 4 gloo ranks
    python -m tools.calibrate --device cuda --out runs/calibration_gpu.json   # one GPU (tools/gpu_check runs it)

What is measured, each at several sizes: compute classes as a rate (total work / total time), collectives as a
straight-line fit time = t0 + bytes / rate (least squares: the slope's inverse is the bandwidth, the intercept
the latency); the raw (work, seconds) points are kept in the file:
  gemm          a linear layer's forward, input-gradient and weight-gradient GEMMs (bf16 on a GPU, fp32 on a
                CPU; on a CPU each call on other operands, from a pool larger than the last-level cache, as in a
                step), and the forward in FP8 (torch._scaled_mm) on a GPU that has it
  grouped_gemm  the same three of core.moe.grouped_mm over 8 experts with equal rows (the routed-expert GEMMs)
  attention     causal scaled_dot_product_attention forward + backward, counted as its useful (causal) FLOPs
  attention_masked, attention_explicit   (CPU) core.attention.attention forward + backward of a cp=2 rank's queries
                over the gathered keys under a causal CPMask, without and with sinks: the form a CPU runs where a
                GPU runs flash / flex kernels, counted over every (query, key) pair: it computes masked ones too
  cross_entropy (CPU) the loss over the vocab (F.cross_entropy forward + backward), in logits per second
  op_latency    seconds per ATen op of a chain of small autograd ops (forward + backward), counted by a
                TorchDispatchMode: the cost of an op whose work is negligible (Python, dispatcher, kernel launch);
                on a CPU the intercept of `elementwise`: that chain at three tensor sizes, seconds per op = t0 +
                bytes / rate (bytes: two tensors read, one written)
  memory        bytes/s of a large elementwise op (read + write)
  all_to_all, all_gather, reduce_scatter, p2p   (more than one rank) bytes each rank sends -> seconds, over
                the whole world (p2p: batch_isend_irecv between rank pairs)
On a CPU the ranks are processes sharing the cores, so every rank runs the same benchmarks at the same time and
the file holds one entry per world size ("ranks": {"1": ..., "2": ..., "4": ...}): the rate a rank gets while
as many others compute beside it, other users of the machine included. Each entry is the median over ranks.
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from core.attention import CPMask, attention
from core.moe import grouped_mm, grouped_weight_grad

# torch 2.13 renamed the flat collectives (the old names warn with a FutureWarning on every call); the oldest torch
# pyproject admits (2.11) has only the old names
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.count, self.batched_matmuls = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.batched_matmuls += func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm)
        return func(*args, **(kwargs or {}))


def _timed(fn, device, min_seconds: float, calls: int = 0) -> float:
    """Mean seconds of fn() over as many calls as fill `min_seconds` (after one warm-up call), or over exactly
    `calls` calls (collectives: every rank must make the same number). A mean over a long window, not a median of
    short calls: on a CPU shared with other processes a training step, which lasts many scheduler time slices,
    gets the average share of the cores, and so does this window."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    done, start = 0, time.perf_counter()
    while done < calls if calls else (done == 0 or time.perf_counter() - start < min_seconds):
        fn()
        sync()
        done += 1
    return (time.perf_counter() - start) / done


def fit_line(points: list[tuple[float, float]]) -> dict:
    """Least squares time = t0 + work / rate over (work, seconds) points (collectives: latency and bandwidth);
    t0 clamped at 0, and the aggregate rate (total work / total time) when the slope comes out non-positive."""
    n = len(points)
    mx, my = sum(w for w, _ in points) / n, sum(t for _, t in points) / n
    sxx = sum((w - mx) ** 2 for w, _ in points)
    slope = sum((w - mx) * (t - my) for w, t in points) / sxx if sxx else 0.0
    if slope <= 0 or my - slope * mx < 0:
        return aggregate(points)
    return {"rate": 1.0 / slope, "t0": my - slope * mx, "points": points}


def aggregate(points: list[tuple[float, float]]) -> dict:
    """Compute classes: total work / total time over the sizes, no fixed term (the planner charges each op's fixed
    cost through op_latency). On a shared CPU the two-parameter fit of a few small sizes swings with the load; the
    aggregate does not."""
    return {"rate": sum(w for w, _ in points) / sum(t for _, t in points), "t0": 0.0, "points": points}


def compute_rates(device: torch.device, big: bool, min_seconds: float) -> dict:
    """GEMM, grouped GEMM, attention, op latency and memory bandwidth of one rank (see the module doc)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape, dt=dtype: torch.randn(*shape, device=device, dtype=dt, generator=g)
    out = {}
    sizes = [(4096, 4096, 4096), (8192, 4096, 8192), (16384, 2048, 1536), (8192, 8192, 8192)] if big else \
        [(256, 64, 128), (256, 128, 384), (512, 128, 256), (1024, 128, 512), (1024, 256, 1024)]
    points = []
    for m, k, n in sizes:
        # the three GEMMs of a linear layer in training: y = x w, dx = dy w^T, dw = x^T dy; each call on other
        # operands, from a pool larger than a CPU's last-level cache, as in a step where no GEMM finds its
        # operands cached (big GPU sizes exceed any cache by themselves)
        pool = 1 if big else max(1, (48 << 20) // (4 * (m * k + k * n + m * n)))
        xs, ws, dys = ([rand(*shape) for _ in range(pool)] for shape in ((m, k), (k, n), (m, n)))
        turn = iter(range(1 << 62))

        def linear_gemms(xs=xs, ws=ws, dys=dys, turn=turn, pool=pool):
            i = next(turn) % pool
            xs[i] @ ws[i], dys[i] @ ws[i].T, xs[i].T @ dys[i]

        points.append((3 * 2 * m * k * n, _timed(linear_gemms, device, min_seconds)))
    out["gemm"] = aggregate(points)
    if device.type == "cuda" and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm"):
        try:
            points = []
            for m, k, n in sizes:
                a = rand(m, k).to(torch.float8_e4m3fn)
                b = rand(n, k).to(torch.float8_e4m3fn).t()
                one = torch.ones((), device=device)
                points.append((2 * m * k * n, _timed(lambda a=a, b=b, one=one: torch._scaled_mm(a, b, one, one, out_dtype=dtype),
                                                     device, min_seconds)))
            out["gemm_fp8"] = aggregate(points)
        except (RuntimeError, TypeError):  # FP8 GEMMs need Hopper or newer
            pass
    experts = 8
    points = []
    for rows, k, n in ([(8192, 2048, 768), (32768, 2048, 768), (65536, 2048, 1536)] if big else
                       [(128, 64, 128), (512, 128, 128), (1024, 128, 256)]):
        # forward, input gradient and weight gradient (the transposed-A form) of the routed experts, on pooled
        # operands as above
        pool = 1 if big else max(1, (48 << 20) // (4 * (rows * k + experts * k * n + rows * n)))
        xs, ws, dys = ([rand(*shape) for _ in range(pool)] for shape in ((rows, k), (experts, k, n), (rows, n)))
        counts = torch.full((experts,), rows // experts, device=device, dtype=torch.int32)
        turn = iter(range(1 << 62))

        def expert_gemms(xs=xs, ws=ws, dys=dys, c=counts, turn=turn, pool=pool):
            i = next(turn) % pool
            grouped_mm(xs[i], ws[i], c), grouped_mm(dys[i], ws[i].transpose(1, 2), c)
            grouped_weight_grad(xs[i], dys[i], c)

        points.append((3 * 2 * rows * k * n, _timed(expert_gemms, device, min_seconds)))
    out["grouped_gemm"] = aggregate(points)
    points = []
    for batch, heads, seq, dim in ([(1, 32, 4096, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)] if big else
                                   [(1, 4, 128, 32), (1, 4, 256, 32), (2, 4, 256, 32)]):
        q, k_, v = (rand(batch, heads, seq, dim).requires_grad_() for _ in range(3))

        def step(q=q, k_=k_, v=v):
            o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
            o.sum().backward()

        useful = 3 * 4 * batch * heads * dim * seq * (seq + 1) / 2  # QK^T and AV, causal half, forward + backward
        points.append((useful, _timed(step, device, min_seconds)))
    out["attention"] = aggregate(points)
    if not big:  # the forms a CPU runs where a GPU runs flash / flex kernels (core/attention.py:attention)
        for name, sinks in (("attention_masked", None), ("attention_explicit", torch.zeros(4, device=device))):
            points = []
            for batch, heads, seq, dim in [(1, 4, 128, 32), (1, 4, 256, 32), (2, 4, 256, 32)]:
                # a cp=2 rank's queries (the second half of the sequence) over the gathered keys, causal mask
                q = rand(batch, heads, seq // 2, dim).requires_grad_()
                k_, v = (rand(batch, heads, seq, dim).requires_grad_() for _ in range(2))
                mask = CPMask(torch.arange(seq // 2, seq, device=device), seq)

                def masked_step(q=q, k_=k_, v=v, mask=mask, sinks=sinks):
                    attention(q, k_, v, mask, sinks_N=sinks).sum().backward()

                pairs = 3 * 4 * batch * heads * dim * (seq // 2) * seq  # every pair, forward + backward
                points.append((pairs, _timed(masked_step, device, min_seconds)))
            out[name] = aggregate(points)
        points = []
        for tokens, vocab in ((256, 1024), (256, 4096), (512, 4096)):  # the loss over the vocab, forward + backward
            logits = rand(tokens, vocab).requires_grad_()
            labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
            step = lambda x=logits, y=labels: F.cross_entropy(x, y, reduction="sum").backward()
            points.append((tokens * vocab, _timed(step, device, min_seconds)))
        out["cross_entropy"] = aggregate(points)

    def chain(x):
        y = x
        for _ in range(8):
            y = torch.nn.functional.silu(y) * 1.01 + y
        y.sum().backward()

    counter = OpCounter()
    with counter:
        chain(rand(256, 64).requires_grad_())
    points = []
    for rows, cols in ((256, 64),) if big else ((256, 64), (256, 128), (512, 128)):
        x = rand(rows, cols).requires_grad_()
        points.append((3 * x.numel() * x.element_size(), _timed(lambda x=x: chain(x), device, min_seconds) / counter.count))
    if big:  # a GPU: the host's cost per op (kernels are small next to it and run asynchronously)
        out["op_latency"] = points[0][1]
    else:  # a CPU: per op a fixed cost plus its bytes (two tensors read, one written) at this rate
        out["elementwise"] = fit_line(points)
        out["op_latency"] = out["elementwise"]["t0"]
    big_x = rand(64 << 20 if big else 4 << 20, dt=torch.float32)
    out["memory"] = {"rate": 8 * big_x.numel() / _timed(lambda: big_x.mul_(1.0), device, min_seconds)}
    return out


def comm_rates(device: torch.device, min_seconds: float) -> dict:
    """Collectives over the whole world: time = t0 + bytes each rank sends / rate (see the module doc)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    sizes = [1 << 14, 1 << 17, 1 << 20] if device.type == "cpu" else [1 << 20, 1 << 24, 1 << 26]
    for name in ("all_to_all", "all_gather", "reduce_scatter", "p2p"):
        points = []
        for nbytes in sizes:
            numel = nbytes // 4 // world * world
            x = torch.ones(numel, device=device)
            y = torch.empty_like(x)
            if name == "all_to_all":
                fn = lambda x=x, y=y: dist.all_to_all_single(y, x)
            elif name == "all_gather":
                part = x[: numel // world]
                fn = lambda y=y, part=part: all_gather_flat(y, part)
            elif name == "reduce_scatter":
                part = y[: numel // world]
                fn = lambda x=x, part=part: reduce_scatter_flat(part, x)
            else:
                peer = rank ^ 1 if (rank ^ 1) < world else rank

                def fn(x=x, y=y, peer=peer):
                    if peer != rank:
                        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
                        for work in dist.batch_isend_irecv(ops):
                            work.wait()
            dist.barrier()
            sent = numel * 4 * ((world - 1) / world if name != "p2p" else 1.0)
            points.append((sent, _timed(fn, device, min_seconds, calls=10)))
        out[name] = fit_line(points)
    return out


def _rank_worker(min_seconds: float) -> dict:
    """One gloo rank: compute rates while every rank computes, then the collectives."""
    import torch.distributed as dist

    from core.mesh import build_mesh, destroy_mesh

    torch.set_num_threads(1)
    mesh = build_mesh(device="cpu")
    if mesh.world > 1:
        dist.barrier()
    result = compute_rates(mesh.device, big=False, min_seconds=min_seconds)
    if mesh.world > 1:
        result.update(comm_rates(mesh.device, min_seconds))
    destroy_mesh()
    return {"json": torch.tensor(list(json.dumps(result).encode()), dtype=torch.uint8)}


def _median_entry(entries: list[dict]) -> dict:
    """Per field, the median over the ranks."""
    out = {}
    for key, value in entries[0].items():
        if isinstance(value, dict):
            out[key] = {f: statistics.median(e[key][f] for e in entries) for f in value if f != "points"}
        else:
            out[key] = statistics.median(e[key] for e in entries)
    return out


def calibrate_cpu(worlds=(1, 2, 4), min_seconds: float = 0.3) -> dict:
    """The CPU calibration: every world size's ranks run the benchmarks together (spawned gloo processes)."""
    from tests.multiproc import run_ranks

    by_world = {}
    for world in worlds:
        results = run_ranks(world, _rank_worker, min_seconds)
        by_world[str(world)] = _median_entry([json.loads(bytes(r["json"].tolist()).decode()) for r in results])
    return {"kind": "cpu", "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "cores": os.cpu_count(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "ranks": by_world}


def calibrate_gpu(min_seconds: float = 0.3) -> dict:
    """One GPU's compute rates (collectives: the planner uses the datasheet's link bandwidths)."""
    device = torch.device("cuda", 0)
    return {"kind": "gpu", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "ranks": {"1": compute_rates(device, big=True, min_seconds=min_seconds)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default="", help="JSON file to write (default runs/calibration_<device>.json)")
    p.add_argument("--min-seconds", type=float, default=0.3, help="time spent on each benchmark size")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible; calibrate this CPU with --device cpu")
    result = calibrate_gpu(a.min_seconds) if a.device == "cuda" else calibrate_cpu(min_seconds=a.min_seconds)
    out = a.out or f"runs/calibration_{'gpu' if a.device == 'cuda' else 'cpu'}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for world, entry in result["ranks"].items():
        print(f"{world} rank(s): " + ", ".join(
            f"{k} {v['rate'] / 1e9:.2f} G/s" + (f" + {v['t0'] * 1e6:.0f} us" if v.get("t0") else "")
            if isinstance(v, dict) else f"{k} {v * 1e6:.1f} us" for k, v in entry.items()))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
