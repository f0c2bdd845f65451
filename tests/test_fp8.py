"""FP8 GEMMs (core/fp8.py) against an FP8 emulation written here: each operand quantised along its reduction dim
with one scale per row (amax / 448) to float8_e4m3fn by torch's own cast, dequantised, multiplied in fp32 (float64
here, so the emulation adds no rounding of its own). Forward and input gradient must equal the emulation to fp32
accumulation rounding; the tolerance is ~1000x tighter than the gap between FP8 and plain fp32, which the test
also measures, so an fp32 GEMM in place of FP8 (or a scale per tensor, or the forward copy of the weight reused
for the gradient) fails. The weight gradient is specified as high precision: it must equal fp32 and not FP8.
Then the weight cache as FSDP2 uses it (a weight moved by a re-gather, a copy per use, operands quantised in the
compute dtype, the bytes core/memory.py counts) and the bounds of an FP8 run under a layout (tests/test_fsdp.py)."""

import pytest
import torch

from core import fp8, memory
from core.moe import grouped_mm_ref
from recipes import recipe_names
from tests.recipe_checks import load_recipe, write_config
from tests.test_train import LAYOUT_TOLERANCE, layout_errors, rel_err, worst_error

TOL = 1e-5  # fp32 accumulation over K <= 96 terms; FP8 vs fp32 differs by ~3e-2


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


# ---------------------------------------------------------------------------- the weight cache under FSDP2


def test_weight_cache_never_serves_a_moved_weights_operand():
    """FSDP2 frees a gathered weight's storage after its use and gathers into it again without moving its version
    counter (torch's _unsafe_preserve_version_counter: autograd's saved weights must stay valid), at the same address
    or elsewhere; another weight of the same shape may then lie at the freed address, at the same version. Emulated
    with set_: weight a moves elsewhere, b takes a's old memory with other values and a's version. b and a each get
    the operand of their own values."""
    g = torch.Generator().manual_seed(0)
    memory = torch.randn(8, 16, generator=g)
    a = torch.empty(0).set_(memory.untyped_storage(), 0, (8, 16))
    fp8.CACHE.invalidate()
    fp8.weight_operand(a, a.dtype)
    a.set_(torch.randn(8, 16, generator=g).untyped_storage(), 0, (8, 16))  # a gathered elsewhere
    b = torch.empty(0).set_(memory.untyped_storage(), 0, (8, 16))  # b where a was
    with torch.autograd._unsafe_preserve_version_counter(b):  # as FSDP2 copies the all-gather in
        b.copy_(torch.randn(8, 16, generator=g))
    assert b._version == 1 and b.data_ptr() == memory.data_ptr()  # a's version and address when quantised
    for w in (b, a):
        q, s = fp8.weight_operand(w, w.dtype)
        assert torch.equal(fp8.dequantize(q, s), fp8.dequantize(*fp8.quantize_rowwise(w)))


def test_weight_cache_keeps_nothing_when_weights_are_gathered_per_use():
    """CACHE.keep False (train.py: FSDP2 at pp = 1): every use quantises, nothing is kept (FSDP2 frees the gathered
    weight after the use; a kept operand would hold every layer's through the step), the same GEMMs."""
    g, x = data()
    w, dy = torch.randn(48, 96, generator=g), torch.randn(40, 48, generator=g)
    fp8.CACHE.invalidate()
    kept = linear_and_grads(fp8.fp8_linear, x, w, dy)
    fp8.CACHE.invalidate()
    fp8.CACHE.keep = False
    try:
        before = fp8.CACHE.quantizations
        for _ in range(2):
            per_use = linear_and_grads(fp8.fp8_linear, x, w, dy)
        assert fp8.CACHE.quantizations - before == 4 and not fp8.CACHE.entries  # forward + dgrad operand, twice
    finally:
        fp8.CACHE.keep = True
    assert all(torch.equal(a, b) for a, b in zip(per_use, kept))


def test_fp8_operands_are_quantised_in_the_compute_dtype():
    """On the bf16 path FSDP2 gathers each weight in bf16 while one process holds it in fp32: the FP8 GEMMs quantise
    the weight in the compute dtype, so both give the same forward and input gradient bit for bit. (Quantised from
    fp32, a row's scale moves by up to 2^-9 and the elements within that of an e4m3 rounding boundary, ~1/32 of
    them, round to the neighbouring value.)"""
    g, x = data()
    w, dy = torch.randn(48, 96, generator=g) * 0.1, torch.randn(40, 48, generator=g).bfloat16()
    results = []
    for weight in (w, w.bfloat16()):  # one process's fp32 weight, FSDP2's bf16 gather of it
        fp8.CACHE.invalidate()
        x_ = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp8.fp8_linear(x_, weight.clone().requires_grad_())
        y.backward(dy)
        results.append((y, x_.grad))
    assert results[0][0].dtype == torch.bfloat16
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", recipe_names())
def test_weight_cache_holds_the_estimated_bytes(name, tmp_path):
    """One forward and backward of each recipe's check model with --fp8 in one process: the weight cache holds the
    bytes core/memory.py estimates (the FP8 operands of exactly the weights enable_fp8 converts, both directions,
    with their scales), row-wise and block-wise."""
    from tests.test_fsdp import _storage_bytes  # (test_fsdp imports this file's layout bounds)

    recipe = load_recipe(name)
    cfg = recipe.model.ModelConfig.from_hf(write_config(tmp_path / "config.json", recipe.config))
    torch.manual_seed(0)
    model = recipe.model.Model(cfg)
    recipe.model.enable_fp8(model)
    ids = torch.randint(0, cfg.vocab_size, (2, recipe.seq_len))

    def run() -> int:
        fp8.CACHE.invalidate()
        out = model.forward_train(ids, ids.roll(-1, 1))
        sum(out.terms.values()).backward()
        return _storage_bytes([t for _, _, operand in fp8.CACHE.entries.values() for t in operand])

    for scaling in ("rowwise", "blockwise"):
        held = run() if scaling == "rowwise" else blockwise(run)
        estimated = memory.param_bytes(recipe.model, memory.meta_model(recipe.model, cfg, fp8=True),
                                       memory.Layout(bf16=False, fp8=True, fp8_recipe=scaling))["weight_cache"]
        assert held == estimated > 0, (scaling, held, estimated)


# ----------------------------------------------------------- FP8 runs under a layout (tests/test_fsdp.py: FSDP2)
FP8_STEPS = 2  # step 1 from equal weights; step 2 from weights a layout rounded otherwise (and re-gathered)
# Bounds of an FP8 run under a layout against the same FP8 run in one process (fp32 on CPU), derived below; measured
# over dp2, ep2, pp2, cp2, ep2 placed, pp2xep2, cp2xep2, dp2xep2 placed, both recipes, ATEN_CPU_CAPABILITY default
# and avx2. Step 1: every rank holds the one process's weights bit for bit and quantises each token's row on its own
# (a row-wise scale per row, 1x128 tiles along a row), so its FP8 operands are the one process's and only summation
# orders differ: the loss and the row-wise grad norm within LAYOUT_TOLERANCE (measured <= 8.6e-8). Blockwise
# quantises the weight gradient's operands in 1x128 tiles along the tokens of the rank's GEMM: at ep an expert's
# rows come from every ep rank, at cp a rank holds half of each sequence, so other tokens share a tile, other
# scales: each product rounds by up to 2^-4 relative otherwise (e4m3's 3 mantissa bits), not in the 7th digit.
FP8_TILES = 1e-3  # step-1 blockwise grad norm: the norm averages those roundings over ~1e5 elements (measured 9.1e-5)
# Step 2: the weights differ by fp32 rounding (~1e-7). An operand element within that of an e4m3 rounding boundary
# rounds to the neighbouring value, a whole step (2^-3 of its binade) away, and moves its token's row by ~2^-3 /
# sqrt(K); the top-k routing and Adam (a near-zero gradient's sign decides a +-lr move) carry that on, and the
# blockwise tiles above add theirs. Measured worst (blockwise cp2 / cp2xep2): losses 9.5e-5, grad norms 1.3e-3,
# weights 5.8e-2 (row-wise: 1.4e-7, 3.3e-5, 4.7e-3); the bounds leave 3.4x to 15x. A GEMM served another layer's
# operand (FSDP2 re-gathering at a freed address) moved them by 2.6e-3, 3.7e-2, 0.65 and the step-1 loss by 1e-3,
# 100x over LAYOUT_TOLERANCE: the step-1 bounds are the sharp ones.
FP8_LATER = {"losses": 1e-3, "grad norms": 2e-2, "weights": 0.2}


def fp8_layout_errors(single, results, scaling: str) -> dict:
    """{check: (worst error, where, bound)} of an FP8 run under a layout (every rank's (losses, grad norms,
    weights), tests/test_train.py:run_train) against the same FP8 run in one process (the bounds above)."""
    first = lambda what: worst_error((rel_err(torch.tensor(run[what][:1]), torch.tensor(single[what][:1])),
                                      f"rank {rank}") for rank, run in enumerate(results))
    errors = {"step-1 loss": (*first(0), LAYOUT_TOLERANCE),
              "step-1 grad norm": (*first(1), LAYOUT_TOLERANCE if scaling == "rowwise" else FP8_TILES)}
    for what, (error, where, _) in layout_errors(single, results).items():
        if what in FP8_LATER:  # (expert bias: --expert-bias-rate 0)
            errors[what] = (error, where, FP8_LATER[what])
    return errors
