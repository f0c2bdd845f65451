"""core/kernels: each Triton kernel against its PyTorch reference, forward and backward.

The Triton code runs on CPU under TRITON_INTERPRET=1. Triton reads that variable when it is imported, and
in a pytest process it may already be imported (by torch or another test module), so the interpreted checks
run in one subprocess (`python -c "...run_interpreted_checks()"` with the variable set), which prints one JSON
result per check. In that subprocess the references that the wrappers would fall back to are replaced by
stubs that raise, and every kernel launch is counted, so a passing check proves the Triton path ran.
bf16 tolerances allow one bf16 ulp: the interpreter casts fp32 -> bf16 by truncation (GPUs round to nearest).
"""

import json
import os
import subprocess
import sys
import traceback
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core.kernels import cross_entropy, dispatch_index, swiglu

ROOT = Path(__file__).resolve().parents[1]
REFS = {"swiglu_ref": swiglu, "gptoss_swiglu_ref": swiglu, "linear_cross_entropy_ref": cross_entropy,
        "group_by_expert_ref": dispatch_index}
KERNELS = {"_fwd_kernel": swiglu, "_bwd_kernel": swiglu, "_ce_kernel": cross_entropy,
           "_hist_kernel": dispatch_index, "_scatter_kernel": dispatch_index}


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() if b.numel() else 0.0


def run_grad(fn, inputs, dy_seed=0):
    """Output of fn and the gradients of its inputs for a fixed random output gradient."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    y = fn(*xs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed)).to(y.dtype)
    y.backward(dy)
    return y.detach(), [x.grad for x in xs]


# ------------------------------------------------------------- checks run under the interpreter (subprocess)


def check_swiglu(refs):
    errs = {}
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for shape in ((300, 2 * 40), (2, 37, 2 * 96), (1, 2 * 16), (0, 2 * 24)):  # R, I not multiples of blocks
            x = (3 * torch.randn(shape, generator=g)).to(dtype)
            y, (dx,) = run_grad(swiglu.swiglu, [x])
            y_ref, (dx_ref,) = run_grad(lambda x: refs["swiglu_ref"](*x.chunk(2, -1)), [x])
            assert y.dtype == dtype and y.shape == y_ref.shape and dx.shape == x.shape
            e = max(rel_err(y, y_ref), rel_err(dx, dx_ref))
            assert e <= tol, (dtype, shape, e)
            errs[f"concat {dtype} {shape}"] = e
            gate, up = x.chunk(2, -1)  # two-tensor form
            y, (dg, du) = run_grad(swiglu.swiglu, [gate, up])
            y_ref, (dg_ref, du_ref) = run_grad(refs["swiglu_ref"], [gate, up])
            e = max(rel_err(y, y_ref), rel_err(dg, dg_ref), rel_err(du, du_ref))
            assert e <= tol, ("two tensors", dtype, shape, e)
            errs[f"pair {dtype} {shape}"] = e
    return errs


def check_gptoss_swiglu(refs):
    errs = {}
    g = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for shape in ((257, 2 * 48), (3, 5, 2 * 24), (0, 2 * 16)):
            x = (6 * torch.randn(shape, generator=g)).to(dtype)  # many values beyond the +-7 clamp
            if x.numel():  # exact boundaries: gate = 7, up = +-7 (torch.clamp passes the gradient there)
                x.view(-1, shape[-1])[0, :8] = torch.tensor([7.0, 7.0, 7.5, -7.0, -9.0, -7.5, 3.0, 7.5])
            y, (dx,) = run_grad(swiglu.gptoss_swiglu, [x])
            y_ref, (dx_ref,) = run_grad(refs["gptoss_swiglu_ref"], [x])
            e = max(rel_err(y, y_ref), rel_err(dx, dx_ref))
            assert e <= tol, (dtype, shape, e)
            clamped = torch.zeros_like(x, dtype=torch.bool)
            clamped[..., 0::2], clamped[..., 1::2] = x[..., 0::2] > 7, x[..., 1::2].abs() > 7
            assert (dx[clamped] == 0).all() and (dx_ref[clamped] == 0).all()
            errs[f"{dtype} {shape}"] = e
    return errs


def check_linear_cross_entropy(refs):
    errs = {}
    g = torch.Generator().manual_seed(2)
    T, H, V = 100, 32, 600  # vocab tiles of 128 and 256 end partial (88), token chunks of 64 and 41 too (36, 18)
    for dtype, tol, gtol in ((torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-4, 2e-2)):
        h = torch.randn(T, H, generator=g).to(dtype)
        w = (torch.randn(V, H, generator=g) * 1.5).to(dtype)  # logits up to ~+-40: tests the online max
        labels = torch.randint(0, V, (T,), generator=g)
        labels[::7] = -100
        for block_v, chunk, reduction in ((128, 64, "sum"), (4096, 4096, "sum"), (256, 41, "mean")):
            cross_entropy.BLOCK_V_MAX = block_v  # 128: 5 vocab tiles, the last one partial
            fused = lambda h, w, kw=dict(labels_T=labels, reduction=reduction, chunk_tokens=chunk): \
                cross_entropy.linear_cross_entropy(h, w, **kw) * 0.5
            ref = lambda h, w, kw=dict(labels_T=labels, reduction=reduction): refs["linear_cross_entropy_ref"](h, w, **kw) * 0.5
            (loss, (dh, dw)), (loss_ref, (dh_ref, dw_ref)) = run_grad(fused, [h, w]), run_grad(ref, [h, w])
            e, ge = rel_err(loss, loss_ref), max(rel_err(dh, dh_ref), rel_err(dw, dw_ref))
            assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
            assert e <= tol and ge <= gtol, (dtype, block_v, chunk, reduction, e, ge)
            errs[f"{dtype} tile {block_v} chunk {chunk} {reduction}"] = (e, ge)
        cross_entropy.BLOCK_V_MAX = 4096
        # all labels ignored: zero loss, zero gradients; and w frozen, and no_grad, and T = 0
        ign = torch.full((T,), -100)
        (loss, (dh, dw)) = run_grad(lambda h, w, ign=ign: cross_entropy.linear_cross_entropy(h, w, ign), [h, w])
        assert loss.item() == 0 and not dh.any() and not dw.any()
        hh = h.detach().clone().requires_grad_()
        cross_entropy.linear_cross_entropy(hh, w, labels).backward()
        hh_ref = h.detach().clone().requires_grad_()
        refs["linear_cross_entropy_ref"](hh_ref, w, labels).backward()
        assert rel_err(hh.grad, hh_ref.grad) <= gtol
        with torch.no_grad():
            lab = labels.clamp(min=0)  # ignore_index 3 instead of -100
            assert rel_err(cross_entropy.linear_cross_entropy(h, w, lab, ignore_index=3),
                           refs["linear_cross_entropy_ref"](h, w, lab, ignore_index=3)) <= tol
        loss, (dh, dw) = run_grad(lambda h, w, lab=labels[:0]: cross_entropy.linear_cross_entropy(h, w, lab), [h[:0], w])
        assert loss.item() == 0 and dh.shape == (0, H) and not dw.any()
    return errs


def check_group_by_expert(refs):
    g = torch.Generator().manual_seed(3)
    cases = {"topk": (torch.randint(0, 8, (100, 3), generator=g), 8),
             "dedup receiver": (torch.randint(-1, 5, (77, 4), generator=g), 6),
             "one expert": (torch.full((90, 2), 2), 4), "empty experts": (torch.randint(3, 5, (40, 2), generator=g), 16),
             "all -1": (torch.full((10, 2), -1), 3), "R = 0": (torch.empty(0, 2, dtype=torch.long), 4),
             "E = 130": (torch.randint(0, 130, (300, 8), generator=g), 130), "int32": (torch.randint(0, 5, (65, 2), dtype=torch.int32), 5)}
    for name, (ids, E) in cases.items():
        (order, counts), (order_ref, counts_ref) = dispatch_index.group_by_expert(ids, E), refs["group_by_expert_ref"](ids, E)
        assert order.dtype == counts.dtype == torch.int64, name
        assert torch.equal(order, order_ref) and torch.equal(counts, counts_ref), name
        known_R = dispatch_index.group_by_expert(ids, E, int((ids >= 0).sum()))  # the caller's count: no host sync
        assert torch.equal(known_R[0], order_ref) and torch.equal(known_R[1], counts_ref), name
    with_error = False
    try:
        dispatch_index.group_by_expert(torch.tensor([[0, 4]]), 4)
    except ValueError:
        with_error = True
    assert with_error
    return {"cases": list(cases)}


def run_interpreted_checks():
    """Entry point of the subprocess: prints {check: {"ok", "errs" or "error"}, "launches": {kernel: n}}."""
    import triton.runtime.interpreter as interp

    assert os.environ.get("TRITON_INTERPRET") == "1" and isinstance(swiglu._fwd_kernel, interp.InterpretedFunction)
    refs = {name: getattr(mod, name) for name, mod in REFS.items()}
    for name, mod in REFS.items():
        setattr(mod, name, lambda *a, _n=name, **k: (_ for _ in ()).throw(AssertionError(f"reference {_n} called")))
    launches = dict.fromkeys(KERNELS, 0)
    for name, mod in KERNELS.items():
        kernel = getattr(mod, name)

        class Counting:  # kernel[grid](...) as before, counted
            def __getitem__(self, grid, _k=kernel, _n=name):
                launches[_n] += 1
                return _k[grid]
        setattr(mod, name, Counting())
    results = {}
    for check in (check_swiglu, check_gptoss_swiglu, check_linear_cross_entropy, check_group_by_expert):
        try:
            results[check.__name__] = {"ok": True, "errs": check(refs)}
        except Exception:
            results[check.__name__] = {"ok": False, "error": traceback.format_exc()}
    print(json.dumps({"results": results, "launches": launches}))


@pytest.fixture(scope="module")
def interpreted():
    code = "from tests.test_kernels import run_interpreted_checks; run_interpreted_checks()"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", ["check_swiglu", "check_gptoss_swiglu", "check_linear_cross_entropy", "check_group_by_expert"])
def test_triton_interpreted(interpreted, check):
    r = interpreted["results"][check]
    assert r["ok"], r.get("error")


def test_every_kernel_launched_under_interpreter(interpreted):
    assert all(n > 0 for n in interpreted["launches"].values()), interpreted["launches"]


# ----------------------------------------------------------------- in-process: references and the CPU path


def test_gptoss_reference_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x = 6 * torch.randn(64, 2 * 24)
    x[0, :4] = torch.tensor([7.0, -7.0, 7.0, 7.0])  # clamp boundaries
    experts = types.SimpleNamespace(alpha=1.702, limit=7.0)  # GptOssConfig's swiglu_alpha, swiglu_limit
    y, (dx,) = run_grad(swiglu.gptoss_swiglu_ref, [x])
    y_hf, (dx_hf,) = run_grad(lambda x: GptOssExperts._apply_gate(experts, x), [x])
    assert rel_err(y, y_hf) <= 1e-6 and rel_err(dx, dx_hf) <= 1e-6 and torch.equal(dx == 0, dx_hf == 0)


def test_references_match_plain_formulas():
    x = torch.randn(33, 2 * 20)
    gate, up = x.chunk(2, -1)
    assert torch.equal(swiglu.swiglu_ref(gate, up), F.silu(gate) * up)  # Qwen3 model.py's expression
    h, w, labels = torch.randn(20, 8), torch.randn(50, 8), torch.randint(0, 50, (20,))
    labels[3] = -100
    expected = F.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction="sum")
    assert torch.allclose(cross_entropy.linear_cross_entropy_ref(h, w, labels), expected)
    ids = torch.randint(-1, 6, (40, 3))
    flat = ids.flatten().tolist()
    order, counts = dispatch_index.group_by_expert_ref(ids, 6)
    assert order.tolist() == [i for e in range(6) for i in range(len(flat)) if flat[i] == e]  # stable by expert
    assert counts.tolist() == [flat.count(e) for e in range(6)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the non-Triton dispatch")
def test_cpu_path_is_the_reference():
    x = torch.randn(10, 2 * 8)
    assert torch.equal(swiglu.swiglu(x), swiglu.swiglu_ref(*x.chunk(2, -1)))
    assert torch.equal(swiglu.gptoss_swiglu(x), swiglu.gptoss_swiglu_ref(x))
    h, w, labels = torch.randn(6, 4), torch.randn(30, 4), torch.randint(0, 30, (6,))
    assert torch.equal(cross_entropy.linear_cross_entropy(h, w, labels), cross_entropy.linear_cross_entropy_ref(h, w, labels))
    ids = torch.randint(0, 5, (12, 2))
    assert all(torch.equal(a, b) for a, b in zip(dispatch_index.group_by_expert(ids, 5), dispatch_index.group_by_expert_ref(ids, 5)))


def test_user_errors_are_value_errors():
    x = torch.randn(4, 6)
    bad = [lambda: swiglu.swiglu(torch.randn(4, 5)), lambda: swiglu.swiglu(x.long()),
           lambda: swiglu.swiglu(x, torch.randn(4, 5)), lambda: swiglu.gptoss_swiglu(torch.randn(4, 7)),
           lambda: cross_entropy.linear_cross_entropy(x, torch.randn(9, 5), torch.zeros(4, dtype=torch.long)),
           lambda: cross_entropy.linear_cross_entropy(x, torch.randn(9, 6), torch.zeros(4, dtype=torch.int32)),
           lambda: cross_entropy.linear_cross_entropy(x, torch.randn(9, 6).double(), torch.zeros(4, dtype=torch.long)),
           lambda: cross_entropy.linear_cross_entropy(x, torch.randn(9, 6), torch.zeros(4, dtype=torch.long), reduction="none"),
           lambda: cross_entropy.linear_cross_entropy(x, torch.randn(9, 6), torch.tensor([0, 1, 9, -100])),
           lambda: dispatch_index.group_by_expert(torch.zeros(3, 2), 4),
           lambda: dispatch_index.group_by_expert(torch.zeros(3, 2, dtype=torch.long), 0),
           lambda: dispatch_index.group_by_expert(torch.tensor([[0, 4]]), 4)]
    for f in bad:
        with pytest.raises(ValueError):
            f()


def test_bench_cli_runs_on_cpu():
    p = subprocess.run([sys.executable, "-m", "tools.bench_kernels", "--rows", "64", "--tokens", "32", "--vocab", "300",
                        "--hidden", "16", "--iters", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "swiglu" in p.stdout and "cross_entropy" in p.stdout and "group_by_expert" in p.stdout


def test_float64_is_computed_in_float64(monkeypatch):
    """A float64 model's kernels (swiglu, GPT-OSS swiglu, the loss, the experts' grouped GEMMs, forward and
    backward) run in float64, also where Triton would run (always the reference): outputs and gradients within
    1e-13 of the formulas computed here in float64 (a few float64 roundings of O(1) values, 2^-53 = 1.1e-16 each,
    summed over <= 32 terms), while one fp32 rounding anywhere would show as >= 1e-8."""
    from core.moe import grouped_mm, grouped_weight_grad

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the wrappers' Triton dispatch (read per call) must pass float64 by
    g = torch.Generator().manual_seed(0)
    x, h, w = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((12, 16), (6, 8), (30, 8)))
    labels = torch.randint(0, 30, (6,), generator=g)
    limited = lambda x: (x[:, 1::2].clamp(-7, 7) + 1) * x[:, 0::2].clamp(max=7) * torch.sigmoid(1.702 * x[:, 0::2].clamp(max=7))
    rows, w_EKN, counts = torch.randn(10, 16, generator=g, dtype=torch.float64), \
        torch.randn(3, 16, 8, generator=g, dtype=torch.float64), torch.tensor([4, 0, 6])
    per_expert = lambda rows, w: torch.cat([rows[:4] @ w[0], rows[4:] @ w[2]])
    cases = [(swiglu.swiglu, lambda x: F.silu(x[:, :8]) * x[:, 8:], [x]),
             (swiglu.gptoss_swiglu, limited, [x]),
             (lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels),
              lambda h, w: F.cross_entropy(h @ w.T, labels, reduction="sum"), [h, w]),
             (lambda rows, w: grouped_mm(rows, w, counts), per_expert, [rows, w_EKN])]
    for fn, formula, inputs in cases:
        (y, grads), (ref, ref_grads) = run_grad(fn, inputs), run_grad(formula, inputs)
        assert y.dtype == torch.float64 and rel_err(y, ref) <= 1e-13, (fn, rel_err(y, ref))
        assert all(rel_err(a, b) <= 1e-13 for a, b in zip(grads, ref_grads)), fn
    dy = torch.randn(10, 8, generator=g, dtype=torch.float64)
    dw = grouped_weight_grad(rows, dy, counts)
    assert rel_err(dw, torch.stack([rows[:4].T @ dy[:4], torch.zeros(16, 8, dtype=torch.float64), rows[4:].T @ dy[4:]])) <= 1e-13
