"""FP8 (e4m3) GEMMs for training on Hopper: linear layers and grouped expert GEMMs, row-wise or block-wise scaled.

Legend: T tokens (rows), K input features, N output features, E experts, R expert rows (grouped by expert).

Row-wise (torchao's "rowwise"): a tensor is quantised along its reduction dim, q = round_e4m3(x / s), s = amax(|row|) /
448 per row (fp32), so each row's largest value maps to the largest e4m3 number and every element keeps 3 mantissa bits
(relative rounding error <= 2^-4; values below 2^-6 * s are subnormal, absolute error <= 2^-10 * s).
  forward   y  = x @ w.T      x per row over K, w per output row over K          -> torch._scaled_mm, fp32 accumulate
  dgrad     dx = dy @ w       dy per row over N, w per input column over N (a second operand made from w)
  wgrad     dw = dy.T @ x     high precision (GPU: bf16): per-token scales do not factor out of its sum over tokens
Straight-through (quantisation the identity in backward); x saved in the compute dtype. torch._scaled_mm (on CPU too:
torch 2.13 runs float8_e4m3fn) and, on CUDA, torch._scaled_grouped_mm (bf16 out).

Blockwise (--fp8-recipe blockwise; DeepSeek-V3's recipe, paper 3.3): activations, gradients in 1x128 tiles along the
reduction dim, weights in 128x128 blocks (one quantisation serves forward and dgrad: a block's scale is its
transpose's), the wgrad in FP8 too, both operands in 1x128 tiles along the tokens; last tiles / blocks may be partial.
`block_scaled_mm`: F.scaled_mm with BlockWise1x128 / BlockWise128x128 scales on CUDA (one GEMM per expert), else fp32.

Weight operands: `weight_operand` (core/weight_cache.py). The GEMMs are torch custom ops, opaque to torch.compile:
the cache lookup runs at run time, also inside a compiled graph.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from core.moe import GROUPED_MM
from core.weight_cache import CACHE

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)  # CUDA only (no CPU kernel in torch 2.13)
SCALING = "rowwise"  # or "blockwise": set once before the first FP8 GEMM (set_scaling)
BLOCK = 128


def set_scaling(recipe: str, device) -> None:
    """Set SCALING (train.py --fp8-recipe); blockwise on CUDA needs F.scaled_mm with BlockWise1x128 (torch >= 2.10)."""
    global SCALING
    if recipe == "blockwise" and torch.device(device).type == "cuda" and not hasattr(getattr(F, "ScalingType", None),
                                                                                     "BlockWise1x128"):
        raise ValueError(f"--fp8-recipe blockwise needs torch.nn.functional.scaled_mm with BlockWise1x128 scales "
                         f"(torch >= 2.10), torch {torch.__version__} has none; use --fp8-recipe rowwise")
    SCALING = recipe


def quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [..., ceil(K/128)] fp32): one scale per 1x128 tile of a row."""
    K = x.shape[-1]
    x_XkB = F.pad(x.detach().float(), (0, -K % BLOCK)).unflatten(-1, (-1, BLOCK))
    scale = x_XkB.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    q = (x_XkB / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).flatten(-2)[..., :K]
    return q.contiguous(), scale


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q [..., N, K] e4m3, scale [..., ceil(N/128), ceil(K/128)] fp32): one per 128x128 block."""
    N, K = w.shape[-2:]
    w_XnBkB = F.pad(w.detach().float(), (0, -K % BLOCK, 0, -N % BLOCK)).unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))
    scale = w_XnBkB.abs().amax((-3, -1)).clamp(min=1e-12) / E4M3_MAX
    q = (w_XnBkB / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).flatten(-4, -3).flatten(-2)
    # a copy of the unpadded part (a row slice of the padded blocks is contiguous and would keep all of them)
    return q if q.shape[-2:] == (N, K) else q[..., :N, :K].clone(memory_format=torch.contiguous_format), scale


def _expand(scale, rows: int, cols: int, row_block: int) -> torch.Tensor:
    return scale.repeat_interleave(row_block, -2)[..., :rows, :].repeat_interleave(BLOCK, -1)[..., :cols]


def block_scaled_mm(qa_MK, sa, qb_NK, sb, out_dtype, b_tiles: bool = False) -> torch.Tensor:
    """(qa * sa) @ (qb * sb).T -> [M, N]: a in 1x128 tiles (sa [M, k]), b in 128x128 blocks (sb [n, k]) or with b_tiles
    in 1x128 tiles (sb [N, k]). CUDA: one block-scaled GEMM (fp32 accumulate), else the fp32 reference."""
    (M, K), N = qa_MK.shape, qb_NK.shape[0]
    if qa_MK.is_cuda:
        kind = F.ScalingType  # tile scales outer-dim major, as torch's block-scaled kernels read them
        return F.scaled_mm(qa_MK, qb_NK.T, sa.T.contiguous().T, kind.BlockWise1x128,
                           (sb.T.contiguous().T if b_tiles else sb).T,
                           kind.BlockWise1x128 if b_tiles else kind.BlockWise128x128, output_dtype=out_dtype)
    a = qa_MK.float() * _expand(sa, M, K, 1)
    return (a @ (qb_NK.float() * _expand(sb, N, K, 1 if b_tiles else BLOCK)).T).to(out_dtype)


def _tiled_mm(a_MK: torch.Tensor, b_NK: torch.Tensor, out_dtype) -> torch.Tensor:
    """a @ b.T with both operands quantised here in 1x128 tiles along K (the wgrad: K = tokens)."""
    return block_scaled_mm(*quantize_tiles(a_MK), *quantize_tiles(b_NK), out_dtype, b_tiles=True)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3 contiguous, scale [..., 1] fp32) with x ~= q * scale, one scale per row."""
    x = x.detach()
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)  # an all-zero row gets q = 0
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


# Compiled on CUDA: 2 fused passes over x, not 5 eager ones (costing what FP8 saves); dynamic: rows vary by micro-batch.
@functools.cache
def _quantize_cuda():
    return torch.compile(quantize_rowwise, dynamic=True)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_cuda()(x) if x.is_cuda else quantize_rowwise(x)


def weight_operand(w: torch.Tensor, dtype: torch.dtype, dgrad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight, [N, K] (nn.Linear) or [E, K, N] (stacked experts, y = x @ w[e]), in `dtype` (the GEMMs' compute dtype)
    as an FP8 operand from the weight cache: the forward's (q_NK, s_N1) quantised over K or the dgrad's (q_KN, s_K1)
    over N ([E, ...] leading), each made alone. Blockwise: 128x128 blocks (s_nk); the dgrad's is their transpose."""
    kind = f"fp8{SCALING} {dtype}"
    w_NK = lambda w: (w if w.dim() == 2 else w.transpose(-2, -1)).to(dtype)
    if SCALING == "blockwise":
        blocks = lambda w: CACHE.get(w, kind, lambda w: quantize_blocks(w_NK(w)))
        transposed = lambda q_NK, s_nk: (q_NK.transpose(-2, -1).contiguous(), s_nk.transpose(-2, -1).contiguous())
        return CACHE.get(w, kind + " dgrad", lambda w: transposed(*blocks(w))) if dgrad else blocks(w)
    return CACHE.get(w, kind + " dgrad", lambda w: _quantize(w_NK(w).transpose(-2, -1))) if dgrad else \
        CACHE.get(w, kind, lambda w: _quantize(w_NK(w)))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype FP8 GEMM inputs are cast to and outputs written in: bf16 on CUDA (what Hopper's row-wise scaled
    GEMMs write), else the autocast dtype or x's own (the CPU reference also runs fp32)."""
    if x.is_cuda:
        return torch.bfloat16
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _scaled_mm(a_MK: torch.Tensor, q_NK: torch.Tensor, s_N1: torch.Tensor) -> torch.Tensor:
    """a [M, K] (high precision, quantised per row) @ (q * s)[N, K].T -> [M, N] in a's dtype; q_NK.T is cuBLAS's
    column-major operand, fp32 scales [M, 1], [1, N]. Blockwise: a in 1x128 tiles, s_N1 block scales [n, k]."""
    if SCALING == "blockwise":
        return block_scaled_mm(*quantize_tiles(a_MK), q_NK, s_N1, a_MK.dtype)
    qa_MK, sa_M1 = _quantize(a_MK)
    return torch._scaled_mm(qa_MK, q_NK.T, scale_a=sa_M1, scale_b=s_N1.T, out_dtype=a_MK.dtype)


# ------------------------------------------------------------------------------------------ linear


@torch.library.custom_op("moe_fp8::linear", mutates_args=())
def _linear(x_TK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    return _scaled_mm(x_TK, *weight_operand(w_NK, x_TK.dtype))


@torch.library.custom_op("moe_fp8::linear_dgrad", mutates_args=())
def _linear_dgrad(dy_TN: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    return _scaled_mm(dy_TN, *weight_operand(w_NK, dy_TN.dtype, dgrad=True))


@_linear.register_fake
def _(x_TK, w_NK):
    return x_TK.new_empty(x_TK.shape[0], w_NK.shape[0])


@_linear_dgrad.register_fake
def _(dy_TN, w_NK):
    return dy_TN.new_empty(dy_TN.shape[0], w_NK.shape[1])


def _linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x in the compute dtype, as bf16 training keeps it; w for the cache


def _linear_backward(ctx, dy_TN):
    x_TK, w_NK = ctx.saved_tensors
    dy_TN = dy_TN.contiguous()
    dx = _linear_dgrad(dy_TN, w_NK) if ctx.needs_input_grad[0] else None  # FP8
    dw = None
    if ctx.needs_input_grad[1]:  # high precision; blockwise: FP8, 1x128 tiles along the tokens
        dw = (_tiled_mm(dy_TN.T, x_TK.T, x_TK.dtype) if SCALING == "blockwise" else dy_TN.T @ x_TK).to(w_NK.dtype)
    return dx, dw


torch.library.register_autograd("moe_fp8::linear", _linear_backward, setup_context=_linear_setup)


def fp8_linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x @ w.T (no bias) in FP8: x [..., K], w [N, K] -> [..., N] in compute_dtype(x); straight-through gradients."""
    dtype = compute_dtype(x)
    return _linear(x.reshape(-1, x.shape[-1]).to(dtype), w_NK).view(*x.shape[:-1], w_NK.shape[0])


class FP8Linear(nn.Linear):
    """nn.Linear whose matmul runs through fp8_linear; made by convert_linears, sharing the original parameters."""

    def forward(self, x):
        y = fp8_linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def convert_linears(module: nn.Module) -> None:
    """Each nn.Linear below `module` -> FP8Linear on the same parameters (names, optimizer state, checkpoints kept)."""
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            new = FP8Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            new.weight, new.bias = child.weight, child.bias
            setattr(module, name, new)
        else:
            convert_linears(child)


# ------------------------------------------------------------------------------------ grouped experts


def _grouped(x_RK, q_ENK, s_EN1, counts_E):
    """x [R, K] grouped by expert @ (q * s)[e].T for each expert's rows -> [R, N] in x's dtype. CUDA: one
    torch._scaled_grouped_mm (q_ENK.transpose is its column-major [E, K, N] operand); elsewhere the reference,
    one row-wise _scaled_mm per expert (a host sync on counts)."""
    if x_RK.is_cuda and SCALED_GROUPED_MM is not None and SCALING == "rowwise":
        qx_RK, sx_R1 = _quantize(x_RK)
        return SCALED_GROUPED_MM(qx_RK, q_ENK.transpose(-2, -1), sx_R1.squeeze(-1), s_EN1.squeeze(-1),
                                 offs=counts_E.cumsum(0, dtype=torch.int32), out_dtype=x_RK.dtype)
    return torch.cat([_scaled_mm(x_e, q_ENK[e], s_EN1[e]) if x_e.shape[0] else x_e.new_empty(0, q_ENK.shape[1])
                      for e, x_e in enumerate(x_RK.split(counts_E.tolist()))])


@torch.library.custom_op("moe_fp8::grouped_mm", mutates_args=())
def _grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return _grouped(x_RK, *weight_operand(w_EKN, x_RK.dtype), counts_E)


@torch.library.custom_op("moe_fp8::grouped_mm_dgrad", mutates_args=())
def _grouped_mm_dgrad(dy_RN: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return _grouped(dy_RN, *weight_operand(w_EKN, dy_RN.dtype, dgrad=True), counts_E)


@_grouped_mm.register_fake
def _(x_RK, w_EKN, counts_E):
    return x_RK.new_empty(x_RK.shape[0], w_EKN.shape[2])


@_grouped_mm_dgrad.register_fake
def _(dy_RN, w_EKN, counts_E):
    return dy_RN.new_empty(dy_RN.shape[0], w_EKN.shape[1])


def _grouped_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_backward(ctx, dy_RN):
    x_RK, w_EKN, counts_E = ctx.saved_tensors
    dy_RN = dy_RN.contiguous()
    dx = _grouped_mm_dgrad(dy_RN, w_EKN, counts_E) if ctx.needs_input_grad[0] else None  # FP8
    dw = None
    if ctx.needs_input_grad[1]:  # high precision: dw[e] = x[rows of e].T @ dy[rows of e] (blockwise: FP8 tiles)
        if SCALING == "blockwise":
            sizes = counts_E.tolist()
            dw = torch.stack([_tiled_mm(x_e.T, dy_e.T, x_RK.dtype) for x_e, dy_e in zip(x_RK.split(sizes), dy_RN.split(sizes))])
        elif x_RK.is_cuda and GROUPED_MM is not None:
            dw = GROUPED_MM(x_RK.T, dy_RN, offs=counts_E.cumsum(0, dtype=torch.int32))
        else:
            sizes = counts_E.tolist()
            dw = torch.stack([x_e.T @ dy_e for x_e, dy_e in zip(x_RK.split(sizes), dy_RN.split(sizes))])
        dw = dw.to(w_EKN.dtype)
    return dx, dw, None


torch.library.register_autograd("moe_fp8::grouped_mm", _grouped_backward, setup_context=_grouped_setup)


def fp8_grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """core.moe.grouped_mm in FP8: x [R, K] grouped by expert, w [E, K, N], counts [E] -> [R, N] in compute_dtype(x)."""
    return _grouped_mm(x_RK.to(compute_dtype(x_RK)), w_EKN, counts_E)
