"""Routed-expert plumbing every recipe shares: group (token, expert) rows by expert, grouped GEMM, combine.

Legend: T tokens, H hidden, E experts (local to this rank), k top-k, R = T*k routed rows,
K/N the two sides of a GEMM.

A model's MoE layer does:  order, counts = sort_by_expert(topk_ids)
                            rows = x[order // k]            (one row per (token, expert), grouped by expert)
                            rows = its expert MLP, built from grouped_mm(rows, w_EKN, counts)
                            out  = combine(rows, order, topk_weights, T)
"""

import torch


def sort_by_expert(topk_ids_Tk: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row order that groups the T*k (token, slot) pairs by expert (stable: tokens keep their order inside an
    expert), and how many rows each expert gets. Row r of the grouped layout is token order[r] // k."""
    flat_R = topk_ids_Tk.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)
    counts_E = torch.bincount(flat_R, minlength=num_experts)
    return order_R, counts_E


def grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ w[e]; rows are contiguous per expert, counts_E long.

    Reference path: one matmul per expert (a host sync on counts). Autograd flows to x and w; an expert
    with no rows gets a zero weight gradient."""
    sizes = counts_E.tolist()
    assert sum(sizes) == x_RK.shape[0] and len(sizes) == w_EKN.shape[0], (sizes, x_RK.shape, w_EKN.shape)
    return torch.cat([x_e @ w_EKN[e] for e, x_e in enumerate(x_RK.split(sizes))])


def combine(rows_RH: torch.Tensor, order_R: torch.Tensor, topk_weights_Tk: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """out[t] = sum over t's k experts of weight * expert output; rows_RH is in the grouped order."""
    k = topk_weights_Tk.shape[1]
    weighted_RH = rows_RH * topk_weights_Tk.reshape(-1)[order_R].unsqueeze(-1).to(rows_RH.dtype)
    out_TH = rows_RH.new_zeros(num_tokens, rows_RH.shape[1])
    return out_TH.index_add(0, order_R // k, weighted_RH)
