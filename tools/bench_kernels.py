"""Micro-benchmark of core/kernels: each Triton kernel next to PyTorch eager.

On GPU: time (ms, triton.testing.do_bench), achieved bandwidth (GB/s, over the bytes the op must move at least)
and its fraction of the measured copy bandwidth (clone of a 1 GiB tensor); for the fused linear + cross-entropy
also TFLOP/s (3 GEMMs, 6*T*H*V) and peak memory fused vs unfused. Eager is the expression the model would run
without the kernel, in the input dtype (for SwiGLU: F.silu(gate) * up).
On CPU: the Triton interpreter is far too slow to time, so only eager runs, at small sizes.

    python -m tools.bench_kernels                      # realistic sizes on GPU, small ones on CPU
    python -m tools.bench_kernels --rows 4096 --vocab 201088
"""

import argparse
import time

import torch
import torch.nn.functional as F

from core.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from core.kernels.dispatch_index import group_by_expert, group_by_expert_ref
from core.kernels.swiglu import gptoss_swiglu, swiglu
from core.metrics import peak_flops_and_source


def bench_ms(fn, iters: int, cuda: bool) -> float:
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5 * iters, rep=20 * iters)
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def fwd_bwd(f, x, dy):
    y = f(x)
    return torch.autograd.grad(y, x, dy)


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384 if cuda else 1024, help="expert rows R for SwiGLU and dispatch")
    p.add_argument("--qwen-ffn", type=int, default=768, help="I of the Qwen3 SwiGLU")
    p.add_argument("--gptoss-ffn", type=int, default=2880, help="I of the GPT-OSS SwiGLU")
    p.add_argument("--tokens", type=int, default=8192 if cuda else 256, help="T of the cross-entropy")
    p.add_argument("--hidden", type=int, default=2048 if cuda else 128, help="H of the cross-entropy")
    p.add_argument("--vocab", type=int, default=151936 if cuda else 8192, help="V of the cross-entropy")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    dev, dtype = ("cuda" if cuda else "cpu"), (torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    s = dtype.itemsize
    torch.manual_seed(0)

    big = torch.empty(2**30 if cuda else 2**26, dtype=torch.uint8, device=dev)
    copy_gbs = 2 * big.numel() / bench_ms(big.clone, args.iters, cuda) / 1e6
    del big
    peak, peak_source = peak_flops_and_source(torch.device(dev))
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}  dtype {args.dtype}  "
          f"copy bandwidth {copy_gbs:.0f} GB/s  peak {peak / 1e12:.0f} TFLOP/s ({peak_source})")
    if not cuda:
        print("note: no GPU, so the Triton kernels are not timed (the interpreter is not a benchmark); eager only")
    print(f"{'kernel':<40} {'impl':<7} {'ms':>9} {'GB/s':>8} {'of copy':>8}")

    def row(name, impl, ms, nbytes):
        print(f"{name:<40} {impl:<7} {ms:9.3f} {nbytes / ms / 1e6:8.1f} {nbytes / ms / 1e6 / copy_gbs:8.1%}")

    R = args.rows
    eager_swiglu = lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]

    def eager_gptoss(x):
        gate, up = x[..., 0::2].clamp(max=7.0), x[..., 1::2].clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)

    for name, I, fused, eager in (("swiglu", args.qwen_ffn, swiglu, eager_swiglu),
                                  ("gptoss_swiglu", args.gptoss_ffn, gptoss_swiglu, eager_gptoss)):
        x = torch.randn(R, 2 * I, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(R, I, device=dev, dtype=dtype)
        for impl, f in (("triton", fused), ("eager", eager)) if cuda else (("eager", eager),):
            fwd, step = (lambda f=f, x=x: f(x)), (lambda f=f, x=x, dy=dy: fwd_bwd(f, x, dy))
            row(f"{name} fwd R={R} I={I}", impl, bench_ms(fwd, args.iters, cuda), 3 * R * I * s)  # read J, write I
            row(f"{name} fwd+bwd R={R} I={I}", impl, bench_ms(step, args.iters, cuda), 9 * R * I * s)  # + read I, J, write J

    T, H, V = args.tokens, args.hidden, args.vocab
    h = torch.randn(T, H, device=dev, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, H, device=dev, dtype=dtype) * H**-0.5).requires_grad_()
    labels = torch.randint(0, V, (T,), device=dev)
    labels[::10] = -100
    for impl, f in (("fused", linear_cross_entropy), ("eager", linear_cross_entropy_ref)) if cuda else (("eager", linear_cross_entropy_ref),):
        step = lambda f=f: torch.autograd.grad(f(h, w, labels), (h, w))
        ms = bench_ms(step, max(1, args.iters // 2), cuda)
        tflops = 6 * T * H * V / ms / 1e9
        mem = ""
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            mem = f"  peak memory +{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB"
        print(f"{f'cross_entropy fwd+bwd T={T} H={H} V={V}':<40} {impl:<7} {ms:9.3f}  {tflops:.2f} TFLOP/s "
              f"{tflops / (peak / 1e12):6.1%} of peak{mem}")

    E, k = args.experts, args.topk
    ids = torch.rand(R // k, E, device=dev).topk(k, dim=-1).indices  # [T, k] distinct experts per token
    nbytes = 2 * ids.numel() * 8  # read ids, write order
    for impl, f in (("triton", group_by_expert), ("eager", group_by_expert_ref)) if cuda else (("eager", group_by_expert_ref),):
        row(f"group_by_expert N={ids.numel()} E={E}", impl, bench_ms(lambda f=f: f(ids, E), args.iters, cuda), nbytes)


if __name__ == "__main__":
    main()
