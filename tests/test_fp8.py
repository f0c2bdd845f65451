"""FP8 GEMMs (core/fp8.py) against an FP8 emulation written here: each operand quantised along its reduction dim
with one scale per row (amax / 448) to float8_e4m3fn by torch's own cast, dequantised, multiplied in fp32 (float64
here, so the emulation adds no rounding of its own). Forward and input gradient must equal the emulation to fp32
accumulation rounding; the tolerance is ~1000x tighter than the gap between FP8 and plain fp32, which the test
also measures, so an fp32 GEMM in place of FP8 (or a scale per tensor, or the forward copy of the weight reused
for the gradient) fails. The weight gradient is specified as high precision: it must equal fp32 and not FP8."""

import torch

from core import fp8
from core.moe import grouped_mm_ref

TOL = 1e-5  # fp32 accumulation over K <= 96 terms; FP8 vs fp32 differs by ~3e-2


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def fp8_emulated(x_MK: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one scale per row over its last (reduction) dim, back in float64."""
    scale = x_MK.abs().amax(dim=-1, keepdim=True).float() / torch.finfo(torch.float8_e4m3fn).max
    return (x_MK.float() / scale).to(torch.float8_e4m3fn).double() * scale.double()


def emulated_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """a @ b with both operands quantised along K (a per row, b per column)."""
    return fp8_emulated(a_MK) @ fp8_emulated(b_KN.T).T


def linear_and_grads(fn, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y.detach(), dx, dw


def data():
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, so that a per-tensor scale would lose the small rows to subnormals
    x = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 40)[:, None]
    return g, x


def test_fp8_linear_equals_the_emulation():
    g, x = data()
    w = torch.randn(48, 96, generator=g) * torch.logspace(-2, 0, 96)  # input columns of different sizes
    dy = torch.randn(40, 48, generator=g)
    fp8.CACHE.invalidate()
    y, dx, dw = linear_and_grads(fp8.fp8_linear, x, w, dy)
    y_emul, dx_emul = emulated_mm(x, w.T), emulated_mm(dy, w)  # dgrad: dy quantised over N, w over N (its columns)
    y_fp32, dx_fp32, dw_fp32 = linear_and_grads(lambda x, w: x @ w.T, x, w, dy)
    assert rel_err(y, y_emul) < TOL and rel_err(dx, dx_emul) < TOL, (rel_err(y, y_emul), rel_err(dx, dx_emul))
    assert rel_err(y_fp32, y_emul) > 1000 * TOL and rel_err(dx_fp32, dx_emul) > 1000 * TOL  # fp32 would fail
    assert rel_err(dw, dw_fp32) < 1e-6 and rel_err(dw, emulated_mm(dy.T, x)) > 1000 * TOL  # high precision, not FP8


def test_fp8_grouped_mm_equals_the_emulation():
    g, x = data()
    counts = torch.tensor([0, 13, 0, 20, 7])  # empty experts first, in the middle and last
    w = torch.randn(5, 96, 24, generator=g) * 0.1  # [E, K, N]
    dy = torch.randn(40, 24, generator=g)
    fp8.CACHE.invalidate()
    y, dx, dw = linear_and_grads(lambda x, w: fp8.fp8_grouped_mm(x, w, counts), x, w, dy)
    rows = list(zip(x.split(counts.tolist()), dy.split(counts.tolist())))
    y_emul = torch.cat([emulated_mm(x_e, w[e]) for e, (x_e, _) in enumerate(rows)])
    dx_emul = torch.cat([emulated_mm(dy_e, w[e].T) for e, (_, dy_e) in enumerate(rows)])
    y_fp32, dx_fp32, dw_fp32 = linear_and_grads(lambda x, w: grouped_mm_ref(x, w, counts), x, w, dy)
    assert rel_err(y, y_emul) < TOL and rel_err(dx, dx_emul) < TOL, (rel_err(y, y_emul), rel_err(dx, dx_emul))
    assert rel_err(y_fp32, y_emul) > 1000 * TOL and rel_err(dx_fp32, dx_emul) > 1000 * TOL
    assert rel_err(dw, dw_fp32) < 1e-6 and not dw[counts == 0].any()


# ------------------------------------------------------------------------------------ blockwise (DeepSeek-V3)
E4M3 = torch.float8_e4m3fn


def tiles_emulated(x_MK: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x rounded to e4m3 with one scale (amax / 448) per rows x cols tile, tile by tile in a loop, float64."""
    out = torch.empty(x_MK.shape, dtype=torch.float64)
    for i in range(0, x_MK.shape[0], rows):
        for j in range(0, x_MK.shape[1], cols):
            tile = x_MK[i:i + rows, j:j + cols].float()
            scale = tile.abs().max() / torch.finfo(E4M3).max
            out[i:i + rows, j:j + cols] = (tile / scale).to(E4M3).double() * scale.double()
    return out


def block_data(M=150, K=200, N=136):
    """Sizes not multiples of 128 (partial last tiles and blocks); each 1x128 tile of a row, and each 128-token
    stretch of a column, at another magnitude, so that one scale per row or per column would differ."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 1, M)[:, None]
    x[:, 128:] *= 50.0
    w = torch.randn(N, K, generator=g) * 0.1
    w[:128, :128] *= 0.01  # one weight block far smaller than the others
    dy = torch.randn(M, N, generator=g)
    dy[128:] *= 1e-3
    return x, w, dy


def blockwise(fn):
    fp8.CACHE.invalidate()
    fp8.SCALING = "blockwise"
    try:
        return fn()
    finally:
        fp8.SCALING = "rowwise"
        fp8.CACHE.invalidate()


def test_fp8_blockwise_linear_equals_the_tile_loop():
    """forward x (1x128 tiles) @ w (128x128 blocks).T; dgrad dy (1x128 tiles) @ the same weight blocks; wgrad
    dy.T @ x, both in 1x128 tiles along the tokens: each equal to the tile loop's fp32-rounded values multiplied in
    float64, to fp32 accumulation rounding (TOL); row-wise scaling misses by ~1000x more."""
    x, w, dy = block_data()
    y, dx, dw = blockwise(lambda: linear_and_grads(fp8.fp8_linear, x, w, dy))
    w_q = tiles_emulated(w, 128, 128)
    y_ref = tiles_emulated(x, 1, 128) @ w_q.T
    dx_ref = tiles_emulated(dy, 1, 128) @ w_q
    dw_ref = tiles_emulated(dy.T, 1, 128) @ tiles_emulated(x.T, 1, 128).T
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert rel_err(got, ref) < TOL, rel_err(got, ref)
    fp8.CACHE.invalidate()
    y_row, dx_row, dw_row = linear_and_grads(fp8.fp8_linear, x, w, dy)
    assert min(rel_err(y_row, y_ref), rel_err(dx_row, dx_ref), rel_err(dw_row, dw_ref)) > 100 * TOL


def test_fp8_blockwise_grouped_mm_equals_the_tile_loop():
    x, _, dy = block_data()
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([0, 140, 0, 10])  # an expert with 2 token tiles for its wgrad, empty ones
    w = torch.randn(4, 200, 136, generator=g) * 0.1  # [E, K, N]
    y, dx, dw = blockwise(lambda: linear_and_grads(lambda x, w: fp8.fp8_grouped_mm(x, w, counts), x, w, dy))
    rows = list(zip(x.split(counts.tolist()), dy.split(counts.tolist())))
    w_q = [tiles_emulated(w[e].T, 128, 128) for e in range(4)]  # [N, K] blocks
    y_ref = torch.cat([tiles_emulated(x_e, 1, 128) @ w_q[e].T for e, (x_e, _) in enumerate(rows)])
    dx_ref = torch.cat([tiles_emulated(dy_e, 1, 128) @ w_q[e] for e, (_, dy_e) in enumerate(rows)])
    dw_ref = torch.stack([tiles_emulated(x_e.T, 1, 128) @ tiles_emulated(dy_e.T, 1, 128).T if len(x_e)
                          else torch.zeros(200, 136, dtype=torch.float64) for x_e, dy_e in rows])
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert rel_err(got, ref) < TOL, rel_err(got, ref)
    assert not dw[counts == 0].any()
