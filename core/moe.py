"""Routed experts across the expert-parallel (ep) group: deduplicated all-to-all dispatch and combine,
grouping rows by expert, grouped GEMM, and the aux-loss-free expert-bias update.

Legend: T tokens on this rank, H hidden, k experts per token, E experts in the model, n ranks in the ep group,
L = E / n experts per rank (rank d holds experts [d*L, (d+1)*L)), P (token, destination rank) pairs this
rank sends, Q pairs it receives, R (received row, local expert) pairs = rows of the grouped GEMM,
X = H + k (a dispatched row carries the token and its k routing weights for that rank).

Deduplication: a token travels to a rank once, however many of its k experts live there; the receiver
expands it into one row per local expert, and sums its local experts' weighted outputs per received row
before sending back, so the combine also moves one row per (token, rank). Dropless: nothing is capped.

One MoE layer on one micro-batch, in the five steps a pipeline schedule can interleave (2 and 4 are the
all-to-alls; `start_*` returns at once and `.wait()` gives the result with autograd attached):

    plan = DispatchPlan(topk_ids_Tk, E, ep_group)              # routing exchange (small, blocking)
    x_QX = plan.start_dispatch(x_TH, topk_weights_Tk).wait()    # (2)
    y_QH = plan.run_experts(x_QX, experts_fn)                   # (3) experts_fn(rows_RH, counts_L) -> [R, H]
    y_PH = plan.start_combine(y_QH).wait()                      # (4)
    out_TH = plan.unpermute(y_PH)                               # (5) before the residual add

With ep_group None (one rank holds every expert) the same code runs with the all-to-alls skipped.
"""

import torch
import torch.distributed as dist

from core.kernels.dispatch_index import group_by_expert
from core.weight_cache import cast_weight

# torch._grouped_mm (public as F.grouped_mm from torch 2.10 on); None in versions that have neither
GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_ref(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Reference path: one matmul per expert (a host sync on counts). An expert with no rows gets a zero
    weight gradient."""
    sizes = counts_E.tolist()
    assert sum(sizes) == x_RK.shape[0] and len(sizes) == w_EKN.shape[0], (sizes, x_RK.shape, w_EKN.shape)
    return torch.cat([x_e @ w_EKN[e] for e, x_e in enumerate(x_RK.split(sizes))])


def grouped_mm_fused(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """One torch._grouped_mm over all experts: no host sync, one launch. Offsets are the int32 ends of each
    expert's rows (cumsum of counts, last = R, so no uninitialised tail rows). Runs on CPU too (tested there)."""
    return GROUPED_MM(x_RK, w_EKN, offs=counts_E.cumsum(0, dtype=torch.int32))


def grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ w[e]; rows are contiguous per expert, counts_E [E] int.
    Autograd flows to x and w. On CUDA in bf16 (or under bf16 autocast) the fused grouped GEMM runs; elsewhere
    the per-expert loop (the reference: exact fp32 on CPU, and any torch version)."""
    cuda_bf16 = x_RK.is_cuda and (torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda")
                                  else x_RK.dtype) == torch.bfloat16
    if cuda_bf16 and GROUPED_MM is not None:
        return grouped_mm_fused(x_RK.to(torch.bfloat16), w_EKN.to(torch.bfloat16), counts_E)
    return grouped_mm_ref(x_RK, w_EKN, counts_E)


# ------------------------------------------------------------------------ asynchronous all-to-all


class _Transfer:
    """State shared by the start and wait nodes of one all-to-all (forward and reverse)."""

    def __init__(self, send_splits, recv_splits, group):
        self.send_splits, self.recv_splits, self.group = send_splits, recv_splits, group
        self.work = self.grad_work = self.grad_in = None


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, transfer):
        ctx.transfer = transfer
        out = x.new_empty(sum(transfer.recv_splits), *x.shape[1:])
        transfer.work = dist.all_to_all_single(out, x.contiguous(), transfer.recv_splits, transfer.send_splits,
                                               group=transfer.group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, _grad_placeholder):
        t = ctx.transfer  # the reverse all-to-all was started by _WaitAllToAll.backward
        t.grad_work.wait()
        grad, t.grad_in, t.grad_work = t.grad_in, None, None  # drop the references: no cycle through the graph
        return grad, None


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, transfer):
        ctx.transfer = transfer
        transfer.work.wait()
        transfer.work = None  # the work holds `out`, whose graph holds `transfer`: break the cycle
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        t = ctx.transfer  # start the reverse all-to-all now; _StartAllToAll.backward waits for it
        t.grad_in = grad_out.new_empty(sum(t.send_splits), *grad_out.shape[1:])
        t.grad_work = dist.all_to_all_single(t.grad_in, grad_out.contiguous(), t.send_splits, t.recv_splits,
                                             group=t.group, async_op=True)
        return grad_out, None


class AllToAll:
    """An all-to-all in flight: rows [sum(send_splits), ...] go out, `wait()` returns [sum(recv_splits), ...].
    Differentiable; its backward is the reverse all-to-all, likewise started before it is waited on."""

    def __init__(self, x, send_splits: list[int], recv_splits: list[int], group):
        self.transfer = None if group is None else _Transfer(send_splits, recv_splits, group)
        self.out = x if group is None else _StartAllToAll.apply(x, self.transfer)

    def wait(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The received rows. `out`: a detached alias of `self.out` (core/pipeline.py cuts autograd there, so
        that the reverse all-to-all's start and wait can be run apart)."""
        out = self.out if out is None else out
        return out if self.transfer is None else _WaitAllToAll.apply(out, self.transfer)


# ------------------------------------------------------------------------------------ dispatch plan


class _Traffic:
    """Rows all dispatches sent to other ranks since the last `take()`: [deduplicated, naive] (for the log)."""

    def __init__(self):
        self.rows = 0

    def take(self):
        rows, self.rows = self.rows, 0
        return rows


traffic = _Traffic()


class DispatchPlan:
    """Where one micro-batch's tokens go in the ep group, and how received rows map onto local experts."""

    def __init__(self, topk_ids_Tk: torch.Tensor, num_experts: int, group):
        n = 1 if group is None else dist.get_world_size(group)
        me = 0 if group is None else dist.get_rank(group)
        assert num_experts % n == 0, f"{num_experts} experts cannot be split over {n} ep ranks"
        T, k = topk_ids_Tk.shape
        L = num_experts // n
        self.group, self.num_tokens, self.k = group, T, k
        dest_Tk = topk_ids_Tk // L
        goes_TN = torch.zeros(T, n, dtype=torch.bool, device=topk_ids_Tk.device).scatter_(1, dest_Tk, True)
        dest_P, self.token_P = goes_TN.T.nonzero(as_tuple=True)  # grouped by destination, tokens in order
        self.here_Pk = dest_Tk[self.token_P] == dest_P[:, None]  # which of the token's slots live at that rank
        local_ids_Pk = torch.where(self.here_Pk, topk_ids_Tk[self.token_P] - dest_P[:, None] * L, -1)
        send_counts_N = goes_TN.sum(0)
        # rows crossing ranks: deduplicated (this plan) vs one row per (token, slot) (a naive dispatch)
        self.rows_moved = torch.stack([send_counts_N.sum() - send_counts_N[me], (dest_Tk != me).sum()])
        traffic.rows = traffic.rows + self.rows_moved
        if group is None:
            local_ids_Qk = local_ids_Pk
            self.send_splits = self.recv_splits = [T]
        else:  # exchange the split sizes, then the local expert ids of every row (small, blocking)
            recv_counts_N = torch.empty_like(send_counts_N)
            dist.all_to_all_single(recv_counts_N, send_counts_N, group=group)
            self.send_splits, self.recv_splits = send_counts_N.tolist(), recv_counts_N.tolist()
            local_ids_Qk = local_ids_Pk.new_empty(sum(self.recv_splits), k)
            dist.all_to_all_single(local_ids_Qk, local_ids_Pk, self.recv_splits, self.send_splits, group=group)
        self.order_R, self.counts_L = group_by_expert(local_ids_Qk, L)  # Triton on GPU

    def dispatch_payload(self, x_TH: torch.Tensor, topk_weights_Tk: torch.Tensor) -> torch.Tensor:
        """Each token once per destination rank, with its routing weights for that rank's experts: [P, X]."""
        w_Pk = torch.where(self.here_Pk, topk_weights_Tk[self.token_P], 0).to(x_TH.dtype)
        return torch.cat([x_TH[self.token_P], w_Pk], dim=-1)

    def start_dispatch(self, x_TH: torch.Tensor, topk_weights_Tk: torch.Tensor) -> AllToAll:
        """(2) Send the dispatch payload."""
        return AllToAll(self.dispatch_payload(x_TH, topk_weights_Tk), self.send_splits, self.recv_splits, self.group)

    def run_experts(self, x_QX: torch.Tensor, experts_fn) -> torch.Tensor:
        """(3) Expand received rows to one row per local expert (grouped by expert), run the experts, and sum
        each received row's weighted expert outputs: [Q, H]."""
        x_QH, w_Qk = x_QX[:, : -self.k], x_QX[:, -self.k :]
        row_R = self.order_R // self.k
        y_RH = experts_fn(x_QH[row_R], self.counts_L)
        y_RH = y_RH * w_Qk.reshape(-1)[self.order_R].unsqueeze(-1)
        return y_RH.new_zeros(x_QH.shape[0], y_RH.shape[-1]).index_add(0, row_R, y_RH)

    def start_combine(self, y_QH: torch.Tensor) -> AllToAll:
        """(4) Send each received row's result back to the rank it came from."""
        return AllToAll(y_QH, self.recv_splits, self.send_splits, self.group)

    def unpermute(self, y_PH: torch.Tensor) -> torch.Tensor:
        """(5) Sum the results of a token's destination ranks: [T, H]."""
        return y_PH.new_zeros(self.num_tokens, y_PH.shape[-1]).index_add(0, self.token_P, y_PH)


def moe_forward(x_TH, topk_ids_Tk, topk_weights_Tk, num_experts: int, group, experts_fn):
    """The five steps back to back (no overlap): routed-expert output [T, H] and rows moved [2]."""
    plan = DispatchPlan(topk_ids_Tk, num_experts, group)
    x_QX = plan.start_dispatch(x_TH, topk_weights_Tk).wait()
    y_PH = plan.start_combine(plan.run_experts(x_QX, experts_fn)).wait()
    return plan.unpermute(y_PH), plan.rows_moved


@torch.no_grad()
def update_expert_bias(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): after each optimizer step, raise the selection bias of experts
    that got fewer tokens than the mean and lower it for those that got more: bias += rate * sign(mean - load).
    `load_E` must be the global count (same on every rank), so that the bias stays identical everywhere."""
    bias_E += rate * torch.sign(load_E.float().mean() - load_E.float()).to(bias_E.dtype)


# ------------------------------------------------------------------ expert GEMM with delayed weight gradient


class WeightGradQueue:
    """Zero-bubble weight-gradient delay. While `enabled`, expert GEMMs compute their input gradient at once and
    queue their weight gradient here; `flush()` closes one backward chunk's entry and `pop()` runs the oldest."""

    def __init__(self):
        self.enabled = False
        self.pending, self.chunks = [], []

    def put(self, fn) -> None:
        self.pending.append(fn)

    def flush(self) -> None:
        self.chunks.append(self.pending)
        self.pending = []

    def pop(self) -> None:
        for fn in self.chunks.pop(0) if self.chunks else []:
            fn()

    def empty(self) -> bool:
        return not self.chunks and not self.pending


weight_grads = WeightGradQueue()


class _ExpertMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RK, w_EKN, counts_E):
        ctx.save_for_backward(x_RK, counts_E)
        ctx.weight = w_EKN  # the parameter itself (an input, so no reference cycle): its .grad may be filled later
        return grouped_mm(x_RK, cast_weight(w_EKN, x_RK.dtype), counts_E)  # bf16 copy made once per step

    @staticmethod
    def backward(ctx, dy_RN):
        x_RK, counts_E = ctx.saved_tensors
        w = ctx.weight
        dx_RK = grouped_mm(dy_RN, cast_weight(w, dy_RN.dtype).transpose(1, 2), counts_E)

        def weight_grad():  # dW[e] = x_e^T dy_e, accumulated in the parameter's dtype
            sizes = counts_E.tolist()
            return torch.stack([x_e.T.to(w.dtype) @ dy_e.to(w.dtype) if x_e.shape[0] else torch.zeros_like(w[e])
                                for e, (x_e, dy_e) in enumerate(zip(x_RK.split(sizes), dy_RN.split(sizes)))])

        if not weight_grads.enabled:
            return dx_RK, weight_grad(), None

        def accumulate():  # under autocast the matmuls in weight_grad return bf16: cast to the parameter's dtype
            dw = weight_grad().to(w.dtype)
            if w.grad is None:
                w.grad = dw
            else:
                w.grad += dw

        weight_grads.put(accumulate)
        return dx_RK, None, None


def expert_matmul(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """grouped_mm for expert weights (parameters), whose weight gradient can be delayed (weight_grads)."""
    return _ExpertMatmul.apply(x_RK, w_EKN, counts_E)
