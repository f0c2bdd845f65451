"""Fused LM head + cross-entropy that never holds the full [T, V] logits (vocabularies are 102k-201k).

Legend: T tokens, H hidden, V vocab, Tc tokens per chunk.

Design (Liger-kernel style): per token chunk, logits_TcV = h_TcH @ w_VH.T (torch GEMM), then one Triton program
per row computes the logsumexp by an online softmax over vocab tiles, the loss lse - logit[label], and overwrites
the logits with their gradient softmax - onehot (zero for ignored rows). The chunk's input gradients follow at once,
grad_h[chunk] = dlogits @ w and grad_w += dlogits.T @ h_chunk (fp32), so backward only scales them by grad_output.
Peak extra memory: one [Tc, V] chunk plus the [V, H] fp32 accumulator; each logit is read twice and written once.

The loss is summed over non-ignored tokens, or averaged (reduction="mean"). Triton for CUDA tensors or under
TRITON_INTERPRET=1, else (and for float64) the reference. A label outside [0, V) other than ignore_index: NaN loss on
the Triton path (a check would need a host sync), ValueError on the CPU paths.
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from core.precision import upcast

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BLOCK_V_MAX = 4096  # vocab tile of the kernel (the tests lower it to cover several tiles)


def linear_cross_entropy_ref(h_TH: torch.Tensor, w_VH: torch.Tensor, labels_T: torch.Tensor,
                             ignore_index: int = -100, reduction: str = "sum") -> torch.Tensor:
    logits_TV = upcast(h_TH @ w_VH.T)  # fp32, or float64 kept
    return F.cross_entropy(logits_TV, labels_T, ignore_index=ignore_index, reduction=reduction)


@triton.jit
def _ce_kernel(logits_ptr, labels_ptr, loss_ptr, stride, V, ignore_index, GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    # one program per row of the chunk: loss_ptr[row] = lse - logit[label]; if GRAD, logits row <- softmax - onehot
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    m = -float("inf")  # running max and sum of exp(x - m) over the vocab tiles (online softmax)
    d = 0.0
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(ptr + v0 + offs, mask=v0 + offs < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(d)
    keep = label != ignore_index
    valid = (label >= 0) & (label < V)
    x_label = tl.load(ptr + tl.where(valid, label, 0)).to(tl.float32)  # read before the row is overwritten
    loss = tl.where(valid, lse - x_label, float("nan"))
    tl.store(loss_ptr + row, tl.where(keep, loss, 0.0))
    if GRAD:
        for v0 in range(0, V, BLOCK_V):
            mask = v0 + offs < V
            x = tl.load(ptr + v0 + offs, mask=mask).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(v0 + offs == label, 1.0, 0.0)
            tl.store(ptr + v0 + offs, tl.where(keep, grad, 0.0).to(logits_ptr.dtype.element_ty), mask=mask)


class LossGroups:
    """Per-group sums of the cross-entropy (a data mixture's sources) with no change to a model: train.py sets each
    micro-batch's label groups (`begin`: groups_T per micro-batch index); linear_cross_entropy then adds each label's
    detached loss to sums_G of its group, once per micro-batch (`core/pipeline.py:running` says which; a further
    call, e.g. another head, is not counted) and only for labels of that shape. One instance, `loss_groups`."""

    def __init__(self):
        self.groups_T, self.sums_G, self.counted = None, None, set()

    def begin(self, groups_T: list[torch.Tensor], num_groups: int) -> None:
        self.groups_T, self.counted = groups_T, set()
        self.sums_G = torch.zeros(num_groups, dtype=torch.float64, device=groups_T[0].device)

    def active(self, labels_T: torch.Tensor) -> bool:
        from core.pipeline import running  # (core.pipeline sits above the kernels)

        mb = running.micro_batch
        return (self.groups_T is not None and mb is not None and mb not in self.counted
                and self.groups_T[mb].shape == labels_T.shape)

    def add(self, loss_T: torch.Tensor) -> None:
        from core.pipeline import running

        self.counted.add(running.micro_batch)
        self.sums_G.index_add_(0, self.groups_T[running.micro_batch], loss_T.detach().double())

    def take(self) -> torch.Tensor:
        """The step's sums [groups] (float64); ends the step."""
        sums, self.groups_T, self.sums_G = self.sums_G, None, None
        return sums


loss_groups = LossGroups()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, ignore_index, chunk_tokens, grad_enabled):
        (T, H), V = h_TH.shape, w_VH.shape[0]
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h_TH) if need_h else None
        grad_w = torch.zeros(V, H, dtype=torch.float32, device=w_VH.device) if need_w else None
        loss_T = torch.empty(T, dtype=torch.float32, device=h_TH.device)
        BLOCK_V = min(BLOCK_V_MAX, triton.next_power_of_2(V))
        for t0 in range(0, T, chunk_tokens):
            h_c = h_TH[t0:t0 + chunk_tokens]
            logits = h_c @ w_VH.T  # [Tc, V] in the input dtype; becomes dlogits in place
            _ce_kernel[(h_c.shape[0],)](logits, labels_T[t0:t0 + chunk_tokens], loss_T[t0:], logits.stride(0), V,
                                        ignore_index, GRAD=need_h or need_w, BLOCK_V=BLOCK_V, num_warps=8)
            if need_h:
                torch.mm(logits, w_VH, out=grad_h[t0:t0 + chunk_tokens])
            if need_w and grad_w.dtype == logits.dtype:
                grad_w.addmm_(logits.T, h_c)
            elif need_w:
                grad_w += logits.T @ h_c  # a [V, H] product in the input dtype, summed in fp32
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(w_VH.dtype))
        if loss_groups.active(labels_T):
            loss_groups.add(loss_T)
        return loss_T.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype), None, None, None, None)


def linear_cross_entropy(h_TH: torch.Tensor, w_VH: torch.Tensor, labels_T: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "sum", chunk_tokens: int = 2048) -> torch.Tensor:
    """Cross-entropy of logits h @ w.T against labels, summed (or averaged) over labels != ignore_index, fp32 scalar
    (float64 for float64). h [T, H], w [V, H] (LM head), labels [T] int64; h and w of one dtype."""
    if h_TH.dim() != 2 or w_VH.dim() != 2 or h_TH.shape[1] != w_VH.shape[1]:
        raise ValueError(f"linear_cross_entropy: expected h [T, H] and w [V, H], got {tuple(h_TH.shape)} and {tuple(w_VH.shape)}")
    if labels_T.shape != (h_TH.shape[0],) or labels_T.dtype != torch.int64 or labels_T.device != h_TH.device:
        raise ValueError(f"linear_cross_entropy: labels must be int64 [{h_TH.shape[0]}] on {h_TH.device}, "
                         f"got {labels_T.dtype} {tuple(labels_T.shape)} on {labels_T.device}")
    if h_TH.dtype not in DTYPES or w_VH.dtype != h_TH.dtype:
        raise ValueError(f"linear_cross_entropy: h {h_TH.dtype} and w {w_VH.dtype} must share one dtype of {DTYPES}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'sum' or 'mean', got {reduction!r}")
    if chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    if not h_TH.is_cuda:  # a host check is free off-GPU; on GPU a bad label yields NaN instead of a sync
        bad = (labels_T != ignore_index) & ((labels_T < 0) | (labels_T >= w_VH.shape[0]))
        if bad.any():
            raise ValueError(f"linear_cross_entropy: labels {labels_T[bad][:5].tolist()} are outside [0, {w_VH.shape[0]})")
    if not (h_TH.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or h_TH.dtype == torch.float64:
        if loss_groups.active(labels_T):  # per-label losses for loss_groups (one cross-entropy, then their sum)
            loss_T = linear_cross_entropy_ref(h_TH, w_VH, labels_T, ignore_index, "none")
            loss_groups.add(loss_T)
            return loss_T.sum() / (labels_T != ignore_index).sum() if reduction == "mean" else loss_T.sum()
        return linear_cross_entropy_ref(h_TH, w_VH, labels_T, ignore_index, reduction)
    loss = _LinearCrossEntropy.apply(h_TH.contiguous(), w_VH.contiguous(), labels_T.contiguous(), ignore_index, chunk_tokens,
                                     torch.is_grad_enabled())
    return loss / (labels_T != ignore_index).sum() if reduction == "mean" else loss
