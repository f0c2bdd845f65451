"""Routed experts across the expert-parallel (ep) group: deduplicated all-to-all dispatch and combine,
grouping rows by expert, grouped GEMM, and the aux-loss-free expert-bias update.

Router contract: AGENTS.md's. Example, k = 2, E = 4: ids [[2, 0], [3, -1], [-1, -1]] (negative: an empty slot), weights
[[.7, .3], [1., .5], [0., 0.]] give out[0] = .7 expert2(x0) + .3 expert0(x0), out[1] = expert3(x1), out[2] = 0.

Legend: T tokens on this rank, H hidden, k slots per token, E experts in the model, n ranks in the ep group, L
experts on this rank (core/placement.py; may be 0), P (token, destination rank) pairs sent, Q pairs received, R
(received row, local expert) pairs = grouped GEMM rows, X = H + k (a row carries the token and its k weights).

Dispatch deduplicated and dropless (AGENTS.md's design) in the five steps a schedule can interleave (`moe_forward`: back
to back; `start_*` returns at once, `.wait()` gives the result with autograd); ep_group None: no all-to-all. One host
sync per layer and micro-batch, in DispatchPlan: the row counts sizing all-to-alls and GEMMs (reused in backward).

recompute_dispatch (--recompute layer): the received [Q, X] rows are freed once the experts ran and dispatched again
in backward (`DispatchPlan.refill`, same splits) on every ep rank at the same point: one more dispatch, Q x X saved.
"""

import types

import torch
import torch.distributed as dist

from core.kernels.dispatch_index import expert_counts, group_by_expert
from core.placement import Placement
from core.routing import routing
from core.weight_cache import cast_weight

# torch._grouped_mm (public as F.grouped_mm from torch 2.10 on); None in versions that have neither
GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_ref(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Reference path: one matmul per expert (a host sync on counts)."""
    sizes = counts_E.tolist()
    assert sum(sizes) == x_RK.shape[0] and len(sizes) == w_EKN.shape[0], (sizes, x_RK.shape, w_EKN.shape)
    return torch.cat([x_e @ w_EKN[e] for e, x_e in enumerate(x_RK.split(sizes))])


def grouped_mm_fused(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """One torch._grouped_mm over all experts: no host sync, one launch. Offsets are the int32 ends of each
    expert's rows (cumsum of counts, last = R, so no uninitialised tail rows). Runs on CPU too (tested there)."""
    return GROUPED_MM(x_RK.contiguous(), w_EKN, offs=counts_E.cumsum(0, dtype=torch.int32))


def _fused_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: fp32, bf16, fp16 on CPU (not float64), bf16 on CUDA (others
    loop inside torch), rows of 16-byte multiples (K and N * element size)."""
    return GROUPED_MM is not None and a.dtype != torch.float64 and \
        (a.device.type == "cpu" or a.dtype == torch.bfloat16) and \
        all(t.shape[-1] * t.element_size() % 16 == 0 for t in (a, b))


def grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ w[e] (rows contiguous per expert, counts_E [E] int), differentiable,
    in the autocast dtype (else x's): the fused grouped GEMM where it fits (_fused_fits), else a per-expert loop."""
    device = x_RK.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_RK.dtype
    x_RK, w_EKN = x_RK.to(dtype), w_EKN.to(dtype)
    return (grouped_mm_fused if _fused_fits(x_RK, w_EKN) else grouped_mm_ref)(x_RK, w_EKN, counts_E)


def grouped_weight_grad(x_RK: torch.Tensor, dy_RN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """dW[e] = x_e^T dy_e [E, K, N] in dy's dtype (zeros for an expert without rows): one grouped GEMM in the
    transposed-A form grouped_mm(x^T [K, R], dy [R, N], offs) where it fits, else the per-expert loop."""
    x_RK, dy_RN = x_RK.to(dy_RN.dtype).contiguous(), dy_RN.contiguous()
    if _fused_fits(x_RK, dy_RN):
        return GROUPED_MM(x_RK.T, dy_RN, offs=counts_E.cumsum(0, dtype=torch.int32))
    sizes = counts_E.tolist()
    return torch.stack([x_e.T @ dy_e for x_e, dy_e in zip(x_RK.split(sizes), dy_RN.split(sizes))])


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


# step (3) as core/memory.py's calibration sees it while `on`: rows handed to it, (row, expert) pairs, running now
step3 = types.SimpleNamespace(on=False, inside=False, received=[], rows=0)


def weighted_rows(experts, x_QH: torch.Tensor, row_R: torch.Tensor, counts_L: torch.Tensor,
                  weights_R: torch.Tensor) -> torch.Tensor:
    """experts(x_QH[row_R], counts_L) [R, H] (each received row once per local expert it chose), each row times its
    routing weight: what a recipe's routed_experts returns. Inside its recompute region the expansion and the
    product run again in backward, so autograd keeps only the Q received rows (freed under recompute_dispatch)."""
    return experts(x_QH[row_R], counts_L) * weights_R.unsqueeze(-1)


class _SumRows(torch.autograd.Function):
    """out_NH[index_R[r]] += src_RH[r] (index_add into zeros); backward gathers grad rows. It keeps only the index
    for backward: torch's index_add keeps the source too (for its shape), an [R, H] tensor per MoE layer."""

    @staticmethod
    def forward(ctx, src_RH: torch.Tensor, index_R: torch.Tensor, n: int) -> torch.Tensor:
        ctx.save_for_backward(index_R)
        return src_RH.new_zeros(n, src_RH.shape[-1]).index_add_(0, index_R, src_RH)

    @staticmethod
    def backward(ctx, grad_NH):
        (index_R,) = ctx.saved_tensors
        return grad_NH.index_select(0, index_R), None, None


def release(t: torch.Tensor) -> None:
    """Free t's storage, its shape kept (Megatron's deallocate_output_tensor): for a tensor nothing reads again."""
    t.untyped_storage().resize_(0)


class _OnBackward(torch.autograd.Function):
    """Identity whose backward first calls then() (recompute_dispatch: on the experts' output, before their backward,
    the received rows are refilled; on the received rows, after every reader, freed again)."""

    @staticmethod
    def forward(ctx, x, then):
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.then()
        return grad, None


def _true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of mask's `count` True entries, in order (nonzero without its host sync: count is known)."""
    flat = mask.flatten()
    slot = torch.where(flat, flat.cumsum(0) - 1, count)  # the False entries all land in the extra slot `count`
    out = torch.zeros(count + 1, dtype=torch.int64, device=mask.device)
    return out.scatter_(0, slot, torch.arange(flat.numel(), device=mask.device))[:count]


class DispatchPlan:
    """Where one micro-batch's tokens go in the ep group, and how received rows map onto local experts."""

    def __init__(self, topk_ids_Tk: torch.Tensor, num_experts: int, group, placement: Placement | None = None,
                 recompute_dispatch: bool = False):
        """placement: which rank holds each expert (None: Placement.even); recompute_dispatch: module docstring."""
        n = 1 if group is None else dist.get_world_size(group)
        me = 0 if group is None else dist.get_rank(group)
        placement = Placement.even(num_experts, n) if placement is None else placement
        assert (placement.num_experts, placement.ep) == (num_experts, n), (placement, num_experts, n)
        T, k = topk_ids_Tk.shape
        L = len(placement.experts[me])
        self.group, self.num_tokens, self.k = group, T, k
        self.recompute_dispatch, self.source, self.received = recompute_dispatch, None, None
        ids_Tk = topk_ids_Tk.long()
        keep_Tk = (ids_Tk >= 0) & (ids_Tk < num_experts)  # ids >= E are reported below, on every rank
        rank_E, local_E = placement.tables(ids_Tk.device)
        safe_Tk = ids_Tk.clamp(0, num_experts - 1)  # table lookups of masked slots (their result is unused)
        dest_Tk = torch.where(keep_Tk, rank_E[safe_Tk], n)  # rank n: nowhere (a masked slot)
        goes_TN = torch.zeros(T, n + 1, dtype=torch.bool, device=ids_Tk.device).scatter_(1, dest_Tk, True)[:, :n]
        # per destination: rows (tokens), (token, expert) pairs, and this rank's out-of-range ids
        bad = (~keep_Tk & (ids_Tk >= 0)).sum()
        header_N3 = torch.stack([goes_TN.sum(0), expert_counts(dest_Tk, n), bad.expand(n)], 1)
        if group is None:
            recv_N3 = header_N3
        else:
            recv_N3 = torch.empty_like(header_N3)
            dist.all_to_all_single(recv_N3, header_N3, group=group)
        sizes = torch.cat([header_N3[:, 0], recv_N3.flatten()]).tolist()  # the one host sync of the layer
        self.send_splits, recv = sizes[:n], sizes[n:]
        self.recv_splits, num_pairs, num_bad = recv[0::3], sum(recv[1::3]), sum(recv[2::3])
        if num_bad:
            raise ValueError(f"router expert ids must be < num_experts={num_experts} (or negative for an empty "
                             f"slot); {num_bad} ids in this ep group are not")
        # rows crossing ranks: deduplicated (this plan) vs one row per kept (token, slot) (a naive dispatch)
        self.rows_moved = torch.stack([header_N3[:, 0].sum() - header_N3[me, 0], (keep_Tk & (dest_Tk != me)).sum()])
        traffic.rows = traffic.rows + self.rows_moved
        flat_P = _true_positions(goes_TN.T, sum(self.send_splits))  # grouped by destination, tokens in order
        dest_P, self.token_P = flat_P // max(T, 1), flat_P % max(T, 1)
        self.here_Pk = dest_Tk[self.token_P] == dest_P[:, None]  # which of the token's slots live at that rank
        local_ids_Pk = torch.where(self.here_Pk, local_E[safe_Tk[self.token_P]], -1)  # index at the destination
        if group is None:
            local_ids_Qk = local_ids_Pk
        else:  # the local expert ids of every row (small, blocking)
            local_ids_Qk = local_ids_Pk.new_empty(sum(self.recv_splits), k)
            dist.all_to_all_single(local_ids_Qk, local_ids_Pk, self.recv_splits, self.send_splits, group=group)
        if L:
            self.order_R, self.counts_L = group_by_expert(local_ids_Qk, L, num_pairs)  # Triton on GPU
        else:  # a rank without experts receives no rows
            self.order_R = self.counts_L = torch.zeros(0, dtype=torch.long, device=ids_Tk.device)

    def dispatch_payload(self, x_TH: torch.Tensor, topk_weights_Tk: torch.Tensor) -> torch.Tensor:
        """Each token once per destination rank, with its routing weights for that rank's experts: [P, X]."""
        if self.recompute_dispatch and torch.is_grad_enabled():  # kept anyway: the router saves x_TH
            self.source = (x_TH.detach(), topk_weights_Tk.detach())
        w_Pk = torch.where(self.here_Pk, topk_weights_Tk[self.token_P], 0).to(x_TH.dtype)
        return torch.cat([x_TH[self.token_P], w_Pk], dim=-1)

    def start_dispatch(self, x_TH: torch.Tensor, topk_weights_Tk: torch.Tensor) -> AllToAll:
        """(2) Send the dispatch payload."""
        return AllToAll(self.dispatch_payload(x_TH, topk_weights_Tk), self.send_splits, self.recv_splits, self.group)

    def run_experts(self, x_QX: torch.Tensor, experts_fn) -> torch.Tensor:
        """(3) Received rows expanded per local expert (grouped by expert), experts run, weighted sums: [Q, H]."""
        if step3.on:
            step3.received.append((x_QX, self.k))
            step3.rows += self.order_R.numel()
        step3.inside = True
        recompute = self.source is not None and x_QX.requires_grad
        if recompute:
            x_QX = _OnBackward.apply(x_QX, lambda: release(self.received))  # (a pipeline's tape refers to them)
        x_QH, w_Qk = x_QX[:, : -self.k], x_QX[:, -self.k :]
        row_R, w_R = self.order_R // self.k, w_Qk.reshape(-1)[self.order_R]
        # no local experts: no rows (R = 0), and the empty result stays in the graph so the combine's backward runs
        y_RH = experts_fn(x_QH, row_R, self.counts_L, w_R) if self.counts_L.numel() else x_QH[row_R] * w_R[:, None]
        y_QH = _SumRows.apply(y_RH, row_R, x_QH.shape[0])
        step3.inside = False
        if not recompute:
            return y_QH
        # an alias with its own version counter: refilling it in place leaves autograd's saved views valid
        self.received = torch.empty(0, dtype=x_QX.dtype, device=x_QX.device).set_(
            x_QX.untyped_storage(), x_QX.storage_offset(), x_QX.shape, x_QX.stride())
        self.received_bytes = x_QX.untyped_storage().nbytes()
        release(self.received)
        return _OnBackward.apply(y_QH, self.refill)

    @torch.no_grad()
    def refill(self) -> None:
        """The dispatch again (backward, recompute_dispatch): the senders' payloads rebuilt from the kept x_TH and
        weights, the received rows written into their freed storage."""
        self.received.untyped_storage().resize_(self.received_bytes)
        payload = self.dispatch_payload(*self.source)
        if self.group is None:
            self.received.copy_(payload)
        else:
            dist.all_to_all_single(self.received, payload, self.recv_splits, self.send_splits, group=self.group)
        self.source = None

    def start_combine(self, y_QH: torch.Tensor) -> AllToAll:
        """(4) Send each received row's result back to the rank it came from."""
        return AllToAll(y_QH, self.recv_splits, self.send_splits, self.group)

    def unpermute(self, y_PH: torch.Tensor) -> torch.Tensor:
        """(5) Sum the results of a token's destination ranks: [T, H]."""
        return _SumRows.apply(y_PH, self.token_P, self.num_tokens)


def moe_forward(x_TH, topk_ids_Tk, topk_weights_Tk, num_experts: int, group, experts_fn,
                placement: Placement | None = None, recompute_dispatch: bool = False):
    """The five steps back to back (no overlap): routed-expert output [T, H] and rows moved [2]."""
    routing.record(getattr(experts_fn, "__self__", None), topk_ids_Tk, topk_weights_Tk)  # the layer of step (3)
    plan = DispatchPlan(topk_ids_Tk, num_experts, group, placement, recompute_dispatch)
    x_QX = plan.start_dispatch(x_TH, topk_weights_Tk).wait()
    y_PH = plan.start_combine(plan.run_experts(x_QX, experts_fn)).wait()
    return plan.unpermute(y_PH), plan.rows_moved


@torch.no_grad()
def update_expert_bias(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), after each optimizer step: bias += rate * sign(mean - load). `load_E`
    must be the global count, so that the bias stays identical on every rank."""
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
        # dW in the compute dtype (dy's), accumulated in the parameter's dtype
        if not weight_grads.enabled:
            return dx_RK, grouped_weight_grad(x_RK, dy_RN, counts_E).to(w.dtype), None

        def accumulate():  # through autograd's accumulation, so that hooks on w see it (core/fsdp.py: fp32 sums)
            w.backward(grouped_weight_grad(x_RK, dy_RN, counts_E).to(w.dtype))

        weight_grads.put(accumulate)
        return dx_RK, None, None


def expert_matmul(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """grouped_mm for expert weights (parameters), whose weight gradient can be delayed (weight_grads)."""
    return _ExpertMatmul.apply(x_RK, w_EKN, counts_E)
