"""Fused SwiGLU activations of the expert MLPs, forward and backward, in Triton with PyTorch references.

Legend: R rows (leading dims flattened), I expert ffn width, J = 2*I (gate and up of one GEMM output).

  swiglu(x_RJ)          Qwen3 / DeepSeek layout, gate = x[:, :I], up = x[:, I:]: out = silu(gate) * up
  swiglu(gate, up)      the same on two [R, I] tensors
  gptoss_swiglu(x_RJ)   GPT-OSS, interleaved: gate = x[:, 0::2], up = x[:, 1::2], gate clamped to <= 7,
                        up to [-7, 7]; out = (up + 1) * gate * sigmoid(1.702 * gate)

Kernels compute in fp32, store in the input dtype (CUDA or TRITON_INTERPRET=1; else, and for float64, the reference);
backward recomputes the activation from the inputs (no [R, I] intermediate).
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from core.precision import upcast

ALPHA, LIMIT = 1.702, 7.0  # GPT-OSS swiglu_alpha, swiglu_limit (transformers' GptOssExperts)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def swiglu_ref(gate_RI: torch.Tensor, up_RI: torch.Tensor) -> torch.Tensor:
    return (F.silu(upcast(gate_RI)) * upcast(up_RI)).to(gate_RI.dtype)


def gptoss_swiglu_ref(x_RJ: torch.Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> torch.Tensor:
    x = upcast(x_RJ)
    gate, up = x[..., 0::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return ((up + 1) * gate * torch.sigmoid(alpha * gate)).to(x_RJ.dtype)


# Element (r, c) of the gate is at g_ptr + r * stride + c * STEP and of the up at u_ptr + (same) + u_off:
# STEP=1, u_off=I for one [R, J] tensor side by side (g_ptr = u_ptr), STEP=2, u_off=1 interleaved,
# STEP=1, u_off=0 for two tensors. Gradients are written in the layout of the inputs.
@triton.jit
def _fwd_kernel(g_ptr, u_ptr, o_ptr, R, I, stride, u_off, alpha, limit,
                STEP: tl.constexpr, CLAMPED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows[:, None] < R) & (cols[None, :] < I)
    off = rows[:, None].to(tl.int64) * stride + cols[None, :] * STEP
    g = tl.load(g_ptr + off, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + off + u_off, mask=mask).to(tl.float32)
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1) * g * tl.sigmoid(alpha * g)
    else:
        out = g * tl.sigmoid(g) * u
    o_off = rows[:, None].to(tl.int64) * I + cols[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, R, I, stride, u_off, alpha, limit,
                STEP: tl.constexpr, CLAMPED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows[:, None] < R) & (cols[None, :] < I)
    off = rows[:, None].to(tl.int64) * stride + cols[None, :] * STEP
    dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], mask=mask).to(tl.float32)
    g = tl.load(g_ptr + off, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + off + u_off, mask=mask).to(tl.float32)
    if CLAMPED:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * gc)
        # torch.clamp passes the gradient where min <= x <= max (bounds included), zero outside
        dg = tl.where(g <= limit, dy * (uc + 1) * (s + alpha * gc * s * (1 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dy * gc * s, 0.0)
    else:
        s = tl.sigmoid(g)
        dg = dy * u * s * (1 + g * (1 - s))  # d silu(g) / dg = s * (1 + g * (1 - s))
        du = dy * g * s
    tl.store(dg_ptr + off, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + off + u_off, du.to(du_ptr.dtype.element_ty), mask=mask)


def _blocks(R: int, I: int) -> tuple[int, int, tuple[int, int]]:
    BLOCK_I = min(256, triton.next_power_of_2(I))
    BLOCK_R = max(1, 2048 // BLOCK_I)  # ~2048 elements per program
    return BLOCK_R, BLOCK_I, (triton.cdiv(R, BLOCK_R), triton.cdiv(I, BLOCK_I))


class _SwiGLU(torch.autograd.Function):
    """g [R, *], u [R, *] or None (then the up half lives in g, at u_off); (I, u_off, STEP, CLAMPED, alpha, limit)."""

    @staticmethod
    def forward(ctx, g, u, I, u_off, step, clamped, alpha, limit):
        ctx.save_for_backward(g, u)
        ctx.cfg = (I, u_off, step, clamped, alpha, limit)
        R = g.shape[0]
        out = g.new_empty(R, I)
        BLOCK_R, BLOCK_I, grid = _blocks(R, I)
        if R > 0:
            _fwd_kernel[grid](g, g if u is None else u, out, R, I, g.stride(0), u_off, alpha, limit,
                              STEP=step, CLAMPED=clamped, BLOCK_R=BLOCK_R, BLOCK_I=BLOCK_I)
        return out

    @staticmethod
    def backward(ctx, dy_RI):
        g, u = ctx.saved_tensors
        I, u_off, step, clamped, alpha, limit = ctx.cfg
        dy_RI = dy_RI.contiguous()
        dg = torch.empty_like(g)  # for one input tensor this is its whole gradient, both halves
        du = None if u is None else torch.empty_like(u)
        R = g.shape[0]
        BLOCK_R, BLOCK_I, grid = _blocks(R, I)
        if R > 0:
            _bwd_kernel[grid](dy_RI, g, g if u is None else u, dg, dg if u is None else du, R, I, g.stride(0), u_off,
                              alpha, limit, STEP=step, CLAMPED=clamped, BLOCK_R=BLOCK_R, BLOCK_I=BLOCK_I)
        return dg, du, None, None, None, None, None, None


def _use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and t.dtype != torch.float64


def _check(x: torch.Tensor, name: str, even: bool):
    if x.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported, expected one of {DTYPES}")
    if x.dim() < 1 or (even and x.shape[-1] % 2):
        raise ValueError(f"{name}: expected shape [..., 2*I] with an even last dim, got {tuple(x.shape)}")


def swiglu(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up -> [..., I], for x [..., 2I] = (gate | up) side by side, or for x = gate, up both [..., I]."""
    if up is None:
        _check(x, "swiglu input", even=True)
        I = x.shape[-1] // 2
        if not _use_triton(x):
            return swiglu_ref(*x.chunk(2, dim=-1))
        out = _SwiGLU.apply(x.reshape(-1, 2 * I).contiguous(), None, I, I, 1, False, 1.0, 0.0)
        return out.view(*x.shape[:-1], I)
    _check(x, "swiglu gate", even=False)
    if up.shape != x.shape or up.dtype != x.dtype or up.device != x.device:
        raise ValueError(f"swiglu: gate {tuple(x.shape)} {x.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    if not _use_triton(x):
        return swiglu_ref(x, up)
    I = x.shape[-1]
    out = _SwiGLU.apply(x.reshape(-1, I).contiguous(), up.reshape(-1, I).contiguous(), I, 0, 1, False, 1.0, 0.0)
    return out.view(x.shape)


def gptoss_swiglu(x: torch.Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> torch.Tensor:
    """GPT-OSS clamped SwiGLU of interleaved x [..., 2I] (gate = x[..., 0::2], up = x[..., 1::2]) -> [..., I]."""
    _check(x, "gptoss_swiglu input", even=True)
    if not _use_triton(x):
        return gptoss_swiglu_ref(x, alpha, limit)
    I = x.shape[-1] // 2
    out = _SwiGLU.apply(x.reshape(-1, 2 * I).contiguous(), None, I, 1, 2, True, float(alpha), float(limit))
    return out.view(*x.shape[:-1], I)
