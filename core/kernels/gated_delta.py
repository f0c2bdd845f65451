"""Chunked gated delta rule (Gated DeltaNet, any decayed delta rule): PyTorch reference; fla-core's Triton on CUDA.

The recurrence, per (batch, value head), state S [K, V] in fp32, token t:
    S  <- exp(g_t) * S                          (decay; g_t <= 0 is a log decay)
    u_t = v_t - S^T k_t                         (what the state mis-predicts for key k_t)
    S  <- S + beta_t * k_t u_t^T                (delta update, beta_t in (0, 1) its learning rate)
    o_t = S^T q_t * scale                       (scale defaults to K^-0.5)

Chunked form (the reference's; exact, C only changes rounding): in a chunk of C tokens entering with state S0, gam_t =
g_1 + ... + g_t (log decay from the chunk start to t), Gam_t = exp(gam_t). Unrolled, row t of each [C, *] matrix:
    u_t = v_t - Gam_t S0^T k_t - sum_{j<t} exp(gam_t - gam_j) beta_j (k_t . k_j) u_j
i.e. (I + L) U = V - diag(Gam) K S0, L strictly lower: a unit-triangular solve of [V | Gam*K] gives U = U_v - W S0. Then
    O    = diag(Gam) Q S0 + (Q K^T * D * beta_j) U              D_tj = exp(gam_t - gam_j) for j <= t, else 0
    S_C  = Gam_C S0 + (K * beta * exp(gam_C - gam))^T U
and only S crosses chunks. Decays are differences in log space before exp (every exponent <= 0, none grows). The
sequence is padded to whole chunks with g = beta = k = v = 0 tokens, which leave the state unchanged.

Documents (reset_BS, bool [B, S]: core.context.document_starts): the state entering a document's first token is 0. A
reset at t is g_t = -inf, so any decay product across a reset is 0: with seg_t the resets in the chunk up to t, D_tj = 0
unless seg_t = seg_j, Gam_t = 0 unless seg_t = 0, likewise towards the chunk end: a mask on the same matrices (no split,
no host sync). initial_state reaches only tokens before a row's first reset. fla: varlen (cu_seqlens, a host sync).

Grouped value heads (Qwen3.5: 16 key, 32 value heads): key head h serves value heads h*n .. h*n+n-1 (n = Hv / Hk,
transformers' repeat_interleave); g and beta are per value head. use_qk_l2norm_in_kernel: q and k through `l2norm`.

Backends: fla's chunk_gated_delta_rule (chunk 64, its public [B, T, H, *] API) where `fla_usable` (CUDA, bf16/fp16),
in two torch.library custom ops with fake implementations (backward recomputes fla's forward; fullgraph=True cannot
trace fla 0.6's entry), else the reference below (autograd through it).

Legend: B batch, S sequence, Hk q/k heads, Hv value heads (H once grouped), K/V key/value dims, N chunks, C chunk size.
"""

import torch
import torch.nn.functional as F

try:  # optional GPU dependency: pip install fla-core
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
except ImportError:  # CPU installs, or fla not installed: the reference runs
    _fla_chunk_gated_delta_rule = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (or fp64): fla's and transformers' qk normalisation."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check_inputs(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state_BHKV, reset_BS=None):
    B, S, Hk, K = q_BSHK.shape
    Hv, V = v_BSHV.shape[2:]
    if k_BSHK.shape != q_BSHK.shape or v_BSHV.shape[:2] != (B, S):
        raise ValueError(f"gated delta rule: q {tuple(q_BSHK.shape)}, k {tuple(k_BSHK.shape)}, v {tuple(v_BSHV.shape)} "
                         "must be [B, S, Hk, K], [B, S, Hk, K], [B, S, Hv, V] with the same B and S")
    if Hv % Hk:
        raise ValueError(f"gated delta rule: {Hv} value heads are not a multiple of {Hk} key heads")
    if g_BSH.shape != (B, S, Hv) or beta_BSH.shape != (B, S, Hv):
        raise ValueError(f"gated delta rule: g {tuple(g_BSH.shape)} and beta {tuple(beta_BSH.shape)} must be "
                         f"[B, S, Hv] = {(B, S, Hv)} (one decay and one learning rate per value head and token)")
    if initial_state_BHKV is not None and initial_state_BHKV.shape != (B, Hv, K, V):
        raise ValueError(f"gated delta rule: initial_state {tuple(initial_state_BHKV.shape)} must be "
                         f"[B, Hv, K, V] = {(B, Hv, K, V)}")
    if reset_BS is not None and (reset_BS.shape != (B, S) or reset_BS.dtype != torch.bool):
        raise ValueError(f"gated delta rule: reset_BS {tuple(reset_BS.shape)} {reset_BS.dtype} must be bool [B, S] = "
                         f"{(B, S)} (True where a document starts; core.context.document_starts)")


def chunk_gated_delta_rule_reference(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale: float | None = None,
                                     initial_state_BHKV=None, output_final_state: bool = False,
                                     chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False, reset_BS=None):
    """The chunked recurrence (see the top) in plain PyTorch, differentiable, in fp32 (fp64 if an input is): (o
    [B, S, Hv, V] in v's dtype, final state [B, Hv, K, V] or None). reset_BS: bool [B, S], True: state 0 entering."""
    _check_inputs(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state_BHKV, reset_BS)
    if chunk_size < 1:
        raise ValueError(f"gated delta rule: chunk_size {chunk_size} must be >= 1")
    B, S, Hk, K = q_BSHK.shape
    Hv, V = v_BSHV.shape[2:]
    inputs = (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    dt = torch.float64 if any(x.dtype == torch.float64 for x in inputs) else torch.float32
    scale = K ** -0.5 if scale is None else scale
    q, k = (x.to(dt) for x in (q_BSHK, k_BSHK))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if Hv != Hk:
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    C = chunk_size
    N = -(-S // C)

    def chunked(x_BSH_):  # [B, S, H, *] -> [B, H, N, C, *], zero-padded to N*C tokens
        x = x_BSH_.to(dt).transpose(1, 2)
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, N * C - S))
        return x.reshape(B, Hv, N, C, *x.shape[3:])

    q_BHNCK, k_BHNCK, v_BHNCV = chunked(q) * scale, chunked(k), chunked(v_BSHV)
    g_BHNC, beta_BHNC = chunked(g_BSH), chunked(beta_BSH)

    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    gone_BHNCC = ~causal_CC
    if reset_BS is None:
        gam_BHNC = g_BHNC.cumsum(-1)
    else:  # documents: a decay product spanning a reset is 0 (see the top)
        seg_B1NC = F.pad(reset_BS, (0, N * C - S)).reshape(B, 1, N, C).cumsum(-1)
        gone_BHNCC = gone_BHNCC | (seg_B1NC[..., :, None] != seg_B1NC[..., None, :])
        # gam restarts at each reset: a cumsum over the whole chunk would make gam_t - gam_j cancel large sums of
        # earlier documents' decays (fp32: 1e-4 relative errors at g ~ -10 per token)
        gam_BHNC = (~gone_BHNCC).to(dt) @ g_BHNC[..., None]
        gam_BHNC = gam_BHNC.squeeze(-1)
        from_start_B1NC = seg_B1NC == 0  # no reset since the chunk start: the entering state reaches t
        to_end_B1NC = seg_B1NC == seg_B1NC[..., -1:]  # no reset after t in the chunk: t reaches the chunk end
    decay_BHNCC = (gam_BHNC[..., :, None] - gam_BHNC[..., None, :]).masked_fill(gone_BHNCC, float("-inf")).exp()
    decay_beta_BHNCC = decay_BHNCC * beta_BHNC[..., None, :]  # exp(gam_t - gam_j) beta_j, j <= t

    Gam_BHNC, to_end_BHNC = gam_BHNC, gam_BHNC[..., -1:] - gam_BHNC  # log decay from the start / to the end
    if reset_BS is not None:  # masked before exp: across a reset gam_C - gam_t may be > 0 (gam restarts)
        Gam_BHNC = Gam_BHNC.masked_fill(~from_start_B1NC, float("-inf"))
        to_end_BHNC = to_end_BHNC.masked_fill(~to_end_B1NC, float("-inf"))
    Gam_BHNC, to_end_BHNC = Gam_BHNC.exp(), to_end_BHNC.exp()

    L_BHNCC = (k_BHNCK @ k_BHNCK.transpose(-1, -2) * decay_beta_BHNCC).tril(-1)
    eye_CC = torch.eye(C, dtype=dt, device=q.device)
    rhs_BHNCX = torch.cat([v_BHNCV, Gam_BHNC[..., None] * k_BHNCK], -1)
    sol_BHNCX = torch.linalg.solve_triangular(eye_CC + L_BHNCC, rhs_BHNCX, upper=False, unitriangular=True)
    u_v_BHNCV, w_BHNCK = sol_BHNCX[..., :V], sol_BHNCX[..., V:]  # U = u_v - w S0

    attn_BHNCC = q_BHNCK @ k_BHNCK.transpose(-1, -2) * decay_beta_BHNCC
    q_decayed_BHNCK = q_BHNCK * Gam_BHNC[..., None]
    k_to_end_BHNCK = k_BHNCK * (beta_BHNC * to_end_BHNC)[..., None]
    chunk_decay_BHN11 = Gam_BHNC[..., -1, None, None]

    S_BHKV = (torch.zeros(B, Hv, K, V, dtype=dt, device=q.device) if initial_state_BHKV is None
              else initial_state_BHKV.to(dt))
    outs = []
    for n in range(N):  # only the state crosses chunks
        u_BHCV = u_v_BHNCV[:, :, n] - w_BHNCK[:, :, n] @ S_BHKV
        outs.append(q_decayed_BHNCK[:, :, n] @ S_BHKV + attn_BHNCC[:, :, n] @ u_BHCV)
        S_BHKV = chunk_decay_BHN11[:, :, n] * S_BHKV + k_to_end_BHNCK[:, :, n].transpose(-1, -2) @ u_BHCV
    o_BHSV = torch.stack(outs, 2).reshape(B, Hv, N * C, V)[:, :, :S]
    return o_BHSV.transpose(1, 2).to(v_BSHV.dtype), (S_BHKV if output_final_state else None)


def fla_usable(x: torch.Tensor) -> bool:
    """fla's kernels apply: CUDA tensor, bf16/fp16 (fla refuses fp32 inputs), fla-core installed."""
    return _fla_chunk_gated_delta_rule is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _fla(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm_in_kernel):
    # cu_seqlens (documents): [1, T] rows of several sequences with h0 / the final state [N, H, K, V], fla's varlen
    return _fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


# fla as two opaque custom ops (see the top): the backward op recomputes fla's forward under autograd (one extra
# kernel forward, ~1/3 of fla's forward + backward; fla's internal backward entry points change between releases).
@torch.library.custom_op("moe_delta::fla_gated_delta_rule", mutates_args=())
def _fla_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            h0: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float,
            use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        o, ht = _fla(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm_in_kernel)
    return o.to(v.dtype), ht.float()  # the dtypes the fake implementation promises


@torch.library.custom_op("moe_delta::fla_gated_delta_rule_backward", mutates_args=())
def _fla_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     h0: torch.Tensor, cu_seqlens: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor,
                     scale: float, use_qk_l2norm_in_kernel: bool) -> list[torch.Tensor]:
    # a custom op runs with autograd and autocast excluded: the recompute needs autograd back (autocast stays off)
    autocast_only = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU).add(torch._C.DispatchKey.AutocastCUDA)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), autocast_only), \
            torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = _fla(*inputs, cu_seqlens, scale, use_qk_l2norm_in_kernel)
        grads = torch.autograd.grad([o, ht], inputs, [do, dht], allow_unused=True)
    return [torch.zeros_like(x) if d is None else d.to(x.dtype) for d, x in zip(grads, inputs)]


@_fla_op.register_fake
def _(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm_in_kernel):
    return torch.empty_like(v), torch.empty_like(h0)


@_fla_backward_op.register_fake
def _(q, k, v, g, beta, h0, cu_seqlens, do, dht, scale, use_qk_l2norm_in_kernel):
    return [torch.empty_like(x) for x in (q, k, v, g, beta, h0)]


def _fla_setup(ctx, inputs, output):
    *tensors, ctx.cu_seqlens, ctx.scale, ctx.use_qk_l2norm_in_kernel = inputs
    ctx.save_for_backward(*tensors)


def _fla_backward(ctx, do, dht):
    grads = _fla_backward_op(*ctx.saved_tensors, ctx.cu_seqlens, do, dht, ctx.scale, ctx.use_qk_l2norm_in_kernel)
    return (*grads, None, None, None)


torch.library.register_autograd("moe_delta::fla_gated_delta_rule", _fla_backward, setup_context=_fla_setup)


def _fla_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale, initial_state_BHKV, output_final_state,
                          use_qk_l2norm_in_kernel, reset_BS=None):
    B, S, Hk, K = q_BSHK.shape
    Hv, V = v_BSHV.shape[2:]
    if Hv != Hk:  # older fla releases have no grouped value heads (0.6 has): one key head per value head
        q_BSHK, k_BSHK = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q_BSHK, k_BSHK))
    dtype = v_BSHV.dtype
    h0_BHKV = (v_BSHV.new_zeros(B, Hv, K, V, dtype=torch.float32) if initial_state_BHKV is None
               else initial_state_BHKV.float())  # always a tensor: custom ops take no optional outputs
    inputs = [q_BSHK.to(dtype), k_BSHK.to(dtype), v_BSHV, g_BSH.float(), beta_BSH.to(dtype)]
    if reset_BS is None:
        o, final = _fla_op(*inputs, h0_BHKV, None, float(scale), use_qk_l2norm_in_kernel)
        return o, (final if output_final_state else None)
    # documents: the rows flattened into one, a sequence at each row start and reset (cu_seqlens [N + 1], one host
    # sync); a row's first sequence enters with its initial state, others with 0; its final state is its last's.
    starts_BS = reset_BS.clone()
    starts_BS[:, 0] = True
    starts_T = starts_BS.flatten().nonzero().flatten()
    cu_seqlens = F.pad(starts_T, (0, 1), value=B * S)
    first_B = starts_BS.flatten().cumsum(0).reshape(B, S)[:, 0] - 1  # sequence index of each row's start
    h0_NHKV = h0_BHKV.new_zeros(len(starts_T), Hv, K, V).index_copy(0, first_B, h0_BHKV)
    flat = [x.reshape(1, B * S, *x.shape[2:]) for x in inputs]
    o, final_NHKV = _fla_op(*flat, h0_NHKV, cu_seqlens, float(scale), use_qk_l2norm_in_kernel)
    last_B = torch.cat([first_B[1:], first_B.new_tensor([len(starts_T)])]) - 1
    return o.reshape(B, S, Hv, V), (final_NHKV[last_B] if output_final_state else None)


def chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale: float | None = None,
                           initial_state_BHKV=None, output_final_state: bool = False, chunk_size: int = 64,
                           use_qk_l2norm_in_kernel: bool = False, reset_BS=None):
    """The gated delta rule over sequences of any S: (o [B, S, Hv, V], final state [B, Hv, K, V] fp32 or None). fla
    where `fla_usable` (fla's chunk 64), else the reference. reset_BS: bool [B, S], True where a document starts."""
    _check_inputs(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state_BHKV, reset_BS)
    scale = q_BSHK.shape[-1] ** -0.5 if scale is None else scale
    if fla_usable(v_BSHV):
        return _fla_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale, initial_state_BHKV,
                                     output_final_state, use_qk_l2norm_in_kernel, reset_BS)
    return chunk_gated_delta_rule_reference(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale, initial_state_BHKV,
                                            output_final_state, chunk_size, use_qk_l2norm_in_kernel, reset_BS)


def chunk_gated_delta_flops_per_token(key_dim: int, value_dim: int, value_heads: int, chunk_size: int = 64,
                                      cp: int = 1) -> int:
    """Forward FLOPs per token of the chunked rule (matmuls only; backward ~2x). Per chunk and head: K K^T, Q K^T
    (2 C^2 K), the solve with [V | K] (C^2 (V + K) / 2), A U (C^2 V), W S0, Q S0, K^T U (3 C K V); per token and head
    2 * (2 C K + C (V + K) / 2 + C V + 3 K V) = C (5 K + 3 V) + 6 K V. With cp > 1 (core/linear_attention.py) at
    value width V + K, each output adding S_in^T P (2 K V)."""
    K, C = key_dim, chunk_size
    V = value_dim + (key_dim if cp > 1 else 0)
    per_head = C * (5 * K + 3 * V) + 6 * K * V + (2 * K * value_dim if cp > 1 else 0)
    return value_heads * per_head
