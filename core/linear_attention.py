"""Context parallelism for linear attention (any layer whose state update is linear, e.g. Gated DeltaNet): the
causal depthwise conv1d and the gated delta rule over a sequence split by core/context.py:split_for_cp
(cp_group None: the plain single-device operations).

A cp rank holds chunks r and 2cp-1-r of every sequence; no activations are gathered, only two small things:

- Conv tails. A causal conv of width W reads the W-1 inputs before each token: one all-gather of the last W-1
  inputs of every chunk, and chunk j is convolved after chunk j-1's tail (zeros for chunk 0).
- Chunk summaries. Per (batch, head), a chunk's effect on the state S [K, V] is affine: S_out = M S_in + C_, with
  M [K, K] the product of the chunk's transitions exp(g_t)(I - beta_t k_t k_t^T) and C_ [K, V] the state the
  chunk builds from zero. The recurrence acts on each column of S alone, so one kernel pass with values [v | 0]
  (width V + K) from the state [0 | I] gives C_ and M as the final state, and per token the zero-state output o0_t
  and P_t = A_t^T q_t (A_t: the transitions up to t); then o_t = o0_t + S_in^T P_t. One all-gather of the 2cp
  summaries [C_ | M] lets every rank compose the entering states S_{j+1} = M_j S_j + C_j locally (no sequential
  hops between ranks); backward reduce-scatters the summaries' gradients.

Documents (doc_ids_BK, int [B, K], ids of the WHOLE sequence): the state entering a document is 0, the conv reads no
earlier document's input. A chunk's pass gets the resets at its global positions: one inside chunk j zeroes M_j's
columns from there on (the composition carries nothing across it), a conv tap before its document start adds 0.
Cost: the kernel at value width V + K (~2x the FLOPs at K = V) plus 2cp [K, K] x [K, V] matmuls per head; bytes:
tools/cp_traffic.py (grows with cp - 1, not S).

Legend: B batch, S local sequence (the rank's two chunks side by side, 2 * h), h tokens of one chunk, Hk key
heads, Hv value heads, K key dim, V value dim, X = V + K, Ch conv channels, W conv width, R = 2 cp chunks.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.context import document_starts, gather_sequence, split_for_cp
from core.kernels.gated_delta import chunk_gated_delta_rule


def _two_chunks(x_BS_: torch.Tensor) -> torch.Tensor:
    """[B, 2h, ...] -> [2B, h, ...]: the rank's two chunks as two batches (first chunk first)."""
    if x_BS_.shape[1] % 2:
        raise ValueError(f"context parallelism: the local sequence has {x_BS_.shape[1]} tokens, not two equal chunks "
                         "(split it with core.context.split_for_cp)")
    return torch.cat(x_BS_.chunk(2, 1), 0)


def _one_sequence(x_2B_: torch.Tensor) -> torch.Tensor:
    """Inverse of _two_chunks."""
    return torch.cat(x_2B_.chunk(2, 0), 1)


def _conv(x_BTC: torch.Tensor, weight_CW: torch.Tensor, bias_C, activation, ids_BT=None) -> torch.Tensor:
    """Depthwise conv over [B, T, Ch] left-padded by W-1: [B, T - W + 1, Ch]. ids_BT (document ids of the padded
    positions): a tap reading another document than its token's contributes 0 (W masked shifted products)."""
    W = weight_CW.shape[-1]
    if ids_BT is None:
        out_BSC = F.conv1d(x_BTC.transpose(1, 2).to(weight_CW.dtype), weight_CW.unsqueeze(1), bias_C,
                           groups=weight_CW.shape[0]).transpose(1, 2)
    else:
        S = x_BTC.shape[1] - (W - 1)
        x_BTC, ids_BS = x_BTC.to(weight_CW.dtype), ids_BT[:, W - 1:]
        out_BSC = 0 if bias_C is None else bias_C
        for i in range(W):  # tap i reads the input W-1-i tokens back
            same_BS1 = (ids_BT[:, i:i + S] == ids_BS)[..., None]
            out_BSC = out_BSC + weight_CW[:, i] * x_BTC[:, i:i + S] * same_BS1
    if activation == "silu":
        out_BSC = F.silu(out_BSC)
    return out_BSC.to(x_BTC.dtype)


def _check_doc_ids(doc_ids_BK, B: int, K: int):
    if doc_ids_BK is not None and tuple(doc_ids_BK.shape) != (B, K):
        raise ValueError(f"linear attention: doc_ids_BK {tuple(doc_ids_BK.shape)} must be [B, S * cp] = {(B, K)}, "
                         "the document ids of the whole sequence before the cp split")


def causal_conv1d(x_BSC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None = None,
                  activation: str | None = None, cp_group=None, doc_ids_BK=None) -> torch.Tensor:
    """Causal depthwise conv1d: out_t = act(bias + sum_i w_i x_{t-W+1+i}), inputs before the start 0. weight [Ch, W]
    (nn.Conv1d's weight.squeeze(1)), activation None or "silu". doc_ids_BK: int [B, S * cp], the whole sequence's
    document ids; inputs of an earlier document count as 0."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not supported; use None or 'silu'")
    W = weight_CW.shape[-1]
    cp, r = (1, 0) if cp_group is None else (dist.get_world_size(cp_group), dist.get_rank(cp_group))
    B, S = x_BSC.shape[:2]
    _check_doc_ids(doc_ids_BK, B, S * cp)
    if doc_ids_BK is not None:  # ids of each padded position; -1 (no document) before the sequence start
        ids_BR = F.pad(doc_ids_BK, (W - 1, 0), value=-1)
    if cp_group is None or W == 1:
        ids_BT = None if doc_ids_BK is None or W == 1 else ids_BR  # W == 1: the only tap is the token itself
        return _conv(F.pad(x_BSC, (0, 0, W - 1, 0)), weight_CW, bias_C, activation, ids_BT)
    x_2BhC = _two_chunks(x_BSC)
    h = x_2BhC.shape[1]
    if W - 1 > h:
        raise ValueError(f"causal_conv1d: a cp chunk of {h} tokens is shorter than the conv's {W - 1}-token "
                         f"history; use a longer sequence or a smaller cp")
    tails_BRtC = gather_sequence(_one_sequence(x_2BhC[:, h - (W - 1):]), cp_group, dim=1)  # [B, 2cp (W-1), Ch]
    tails = [torch.zeros_like(tails_BRtC[:, :W - 1])] + list(tails_BRtC.split(W - 1, 1))  # tails[j]: before chunk j
    left_2BtC = torch.cat([tails[r], tails[2 * cp - 1 - r]], 0)
    ids_2BT = None
    if doc_ids_BK is not None:  # chunk j's padded positions are global j*h - (W-1) .. (j+1)*h - 1
        ids_2BT = torch.cat([ids_BR[:, j * h:(j + 1) * h + W - 1] for j in (r, 2 * cp - 1 - r)], 0)
    return _one_sequence(_conv(torch.cat([left_2BtC, x_2BhC], 1), weight_CW, bias_C, activation, ids_2BT))


def gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale: float | None = None, initial_state_BHKV=None,
                     output_final_state: bool = False, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False,
                     cp_group=None, doc_ids_BK=None):
    """core/kernels/gated_delta.py:chunk_gated_delta_rule over a sequence split across cp_group (None: the kernel);
    the final state is the whole sequence's, on every rank. doc_ids_BK: int [B, S * cp], the whole sequence's."""
    cp, r = (1, 0) if cp_group is None else (dist.get_world_size(cp_group), dist.get_rank(cp_group))
    B, S, _, K = q_BSHK.shape
    _check_doc_ids(doc_ids_BK, B, S * cp)
    reset_BS = None if doc_ids_BK is None else document_starts(doc_ids_BK)
    if cp_group is None:
        return chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale, initial_state_BHKV,
                                      output_final_state, chunk_size, use_qk_l2norm_in_kernel, reset_BS)
    if reset_BS is not None:  # the resets at the rank's global positions, as its two chunks
        reset_BS = _two_chunks(split_for_cp(reset_BS, r, cp))
    Hv, V = v_BSHV.shape[2:]
    st = torch.promote_types(v_BSHV.dtype, torch.float32)  # the state's dtype (fp32; fp64 in fp64 tests)
    # columns V.. of the values are 0 and of the initial state the identity: they carry M and P (see the top)
    v_BSHX = torch.cat([v_BSHV, v_BSHV.new_zeros(*v_BSHV.shape[:3], K)], -1)
    eye_BHKK = torch.eye(K, dtype=st, device=v_BSHV.device).expand(2 * B, Hv, K, K)
    init_2BHKX = torch.cat([eye_BHKK.new_zeros(2 * B, Hv, K, V), eye_BHKK], -1)
    o_2BhHX, final_2BHKX = chunk_gated_delta_rule(
        *(_two_chunks(x) for x in (q_BSHK, k_BSHK, v_BSHX, g_BSH, beta_BSH)), scale, init_2BHKX, True, chunk_size,
        use_qk_l2norm_in_kernel, reset_BS)
    summaries_RBHKX = gather_sequence(final_2BHKX.to(st).reshape(2, B, Hv, K, V + K), cp_group, dim=0)
    S_BHKV = (v_BSHV.new_zeros(B, Hv, K, V, dtype=st) if initial_state_BHKV is None
              else initial_state_BHKV.to(st))
    entering = []
    for j in range(2 * cp):  # S_{j+1} = M_j S_j + C_j, chunks in global order
        entering.append(S_BHKV)
        if j < 2 * cp - 1 or output_final_state:
            S_BHKV = summaries_RBHKX[j, ..., V:] @ S_BHKV + summaries_RBHKX[j, ..., :V]
    S_in_2BHKV = torch.cat([entering[r], entering[2 * cp - 1 - r]], 0)
    o0_2BhHV, P_2BhHK = o_2BhHX[..., :V], o_2BhHX[..., V:]
    o_2BhHV = o0_2BhHV.to(st) + torch.einsum("bshk,bhkv->bshv", P_2BhHK.to(st), S_in_2BHKV)
    return _one_sequence(o_2BhHV.to(v_BSHV.dtype)), (S_BHKV if output_final_state else None)
