"""core/kernels/gated_delta.py and core/linear_attention.py: the chunked gated delta rule against a token-by-token
float64 loop (values and every gradient), the causal conv against a direct sum, context parallelism (cp 2 and 4 on
gloo) against one process, and on CUDA fla's kernels against the reference.

Legend: B batch, S sequence, Hk key heads, Hv value heads, K key dim, V value dim, Ch conv channels, W conv width.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.context import document_starts, merge_from_cp, split_for_cp
from core.kernels.gated_delta import chunk_gated_delta_flops_per_token as flops_per_token
from core.kernels.gated_delta import chunk_gated_delta_rule, chunk_gated_delta_rule_reference
from core.linear_attention import causal_conv1d, gated_delta_rule
from tests.multiproc import run_ranks
from tools.cp_traffic import cp_linear_attention_bytes_received_per_layer


def loop_gated_delta(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, scale, S0_BHKV):
    """The recurrence one token at a time, per head (float64): S <- exp(g) S; u = v - S^T k; S <- S + beta k u^T;
    o = S^T q * scale. Key heads are shared by consecutive value heads."""
    n = v_BSHV.shape[2] // q_BSHK.shape[2]
    q, k = (x.double().repeat_interleave(n, 2) for x in (q_BSHK, k_BSHK))
    v, g, beta = v_BSHV.double(), g_BSH.double(), beta_BSH.double()
    S = S0_BHKV.double()
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        u = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t][..., None, None] * k[:, t][..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale)
    return torch.stack(outs, 1), S


def make_inputs(B=2, S=37, Hk=2, Hv=4, K=8, V=6, dtype=torch.float64, seed=0):
    """Unit-norm q, k (as the models pass them), g = logsigmoid (log decays in (-inf, 0)), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, S, Hk, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, S, Hk, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, S, Hv, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, S, Hv, generator=gen, dtype=torch.float64) + 2)
    beta = torch.rand(B, S, Hv, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, Hv, K, V, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, S0)]


def values_and_grads(fn, inputs, seed=1):
    """(o, final state, grads of every input) under a random cotangent on both outputs."""
    o, S = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    do, dS = (torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x) for x in (o, S))
    grads = torch.autograd.grad([o, S], inputs, [do, dS])
    return [o.detach(), S.detach(), *grads]


NAMES = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunked_rule_equals_token_loop_fp64(chunk_size):
    """S = 37 is a multiple of none of the chunk sizes but 1 (64 > S: one padded chunk); Hv = 2 Hk."""
    inputs = make_inputs()
    scale = 0.7
    got = values_and_grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule_reference(
        q, k, v, g, b, scale, S0, True, chunk_size), inputs)
    want = values_and_grads(lambda q, k, v, g, b, S0: loop_gated_delta(q, k, v, g, b, scale, S0), inputs)
    # fp64 (unit roundoff 1.1e-16): the two orders of summation differ by a few hundred roundings of O(1) terms
    # at most (S = 37 steps, K = 8-term dot products, a 64-row triangular solve), far below 1e-11.
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


def test_fp32_within_derived_bound_and_l2norm_flag():
    """fp32 inputs, the kernel's own q/k normalisation (inputs scaled by 3 first), default scale K^-0.5."""
    inputs64 = make_inputs(S=100, K=16, V=16)
    want = values_and_grads(lambda q, k, v, g, b, S0: loop_gated_delta(
        F.normalize(3 * q, dim=-1), F.normalize(3 * k, dim=-1), v, g, b, 16 ** -0.5, S0), inputs64)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    got = values_and_grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule_reference(
        3 * q, 3 * k, v, g, b, None, S0, True, 32, True), inputs32)
    # With |k| = 1 and beta in (0, 1) each transition exp(g)(I - beta k k^T) has norm <= 1, so states, outputs and
    # gradients stay O(1) (|S0|, |v| ~ 1): errors do not grow along the sequence. Each value is a chain of a few
    # matmuls of length <= 32 plus a 32-row triangular solve; fp32 unit roundoff 6e-8 times ~100 accumulated
    # roundings is ~6e-6 of the largest magnitude at worst (3e-7 measured); 1e-5 of it holds for any summation order.
    for name, a, b in zip(NAMES, got, want):
        scale = b.abs().max().item()
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5 * max(1.0, scale), msg=name)


def test_zero_initial_state_no_final_state_and_bad_input():
    q, k, v, g, beta, _ = make_inputs(S=9)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta)
    assert final is None and o.shape == v.shape and o.dtype == v.dtype
    want, _ = loop_gated_delta(q, k, v, g, beta, 8 ** -0.5, torch.zeros(2, 4, 8, 6, dtype=torch.float64))
    torch.testing.assert_close(o, want, rtol=0, atol=1e-11)  # fp64, as above
    with pytest.raises(ValueError, match="not a multiple"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match=r"\[B, S, Hv\]"):
        chunk_gated_delta_rule(q, k, v, g[:, :, :2], beta)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state_BHKV=torch.zeros(2, 4, 6, 8))


def doc_ids_of(lengths_per_row):
    """int [B, S] document ids from each row's document lengths (ids increase along the row)."""
    return torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths_per_row])


# S = 37, kernel chunk 4 or 16: documents of length 1, several per chunk, one ending exactly at a chunk end (row 0:
# 4 + 12 = 16), one spanning three chunks
DOC_LENGTHS = [[4, 12, 1, 3, 17], [9, 1, 1, 26]]


def loop_per_document(doc_ids_BS, q, k, v, g, beta, scale, S0_BHKV):
    """The token loop run on each document alone: the row's initial state enters its first document, 0 the others;
    the final state is the last document's."""
    outs, finals = [], []
    for b in range(doc_ids_BS.shape[0]):
        row, S_1HKV = [], S0_BHKV[b:b + 1]
        for d in doc_ids_BS[b].unique_consecutive():
            t = (doc_ids_BS[b] == d).nonzero().flatten()
            part = [x[b:b + 1, t[0]:t[-1] + 1] for x in (q, k, v, g, beta)]
            o, S_1HKV = loop_gated_delta(*part, scale, S_1HKV if not row else torch.zeros_like(S_1HKV))
            row.append(o)
        outs.append(torch.cat(row, 1))
        finals.append(S_1HKV)
    return torch.cat(outs, 0), torch.cat(finals, 0)


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_document_resets_equal_each_document_alone_fp64(chunk_size):
    inputs = make_inputs()
    doc_ids_BS = doc_ids_of(DOC_LENGTHS)
    reset_BS = document_starts(doc_ids_BS)
    got = values_and_grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule(
        q, k, v, g, b, 0.7, S0, True, chunk_size, reset_BS=reset_BS), inputs)
    want = values_and_grads(lambda *x: loop_per_document(doc_ids_BS, *x[:5], 0.7, x[5]), inputs)
    for name, a, b in zip(NAMES, got, want):  # fp64, bound as in test_chunked_rule_equals_token_loop_fp64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)
    with pytest.raises(ValueError, match="reset_BS"):
        chunk_gated_delta_rule(*inputs[:5], reset_BS=doc_ids_BS)


def test_document_resets_fp32_strong_decays():
    """fp32, decays as a freshly initialised Gated DeltaNet has them (g down to -16 per token: within a 16-token
    chunk log decays reach -250, past fp32's exp range, so nothing may exponentiate a sum across a reset)."""
    inputs64 = make_inputs(S=100, K=16, V=16)
    with torch.no_grad():
        inputs64[3].copy_(-16 * torch.rand(inputs64[3].shape, generator=torch.Generator().manual_seed(2),
                                            dtype=torch.float64))
    doc_ids_BS = doc_ids_of([[30, 50, 20], [7, 1, 59, 33]])
    want = values_and_grads(lambda *x: loop_per_document(doc_ids_BS, *x[:5], 0.25, x[5]), inputs64)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    got = values_and_grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule(
        q, k, v, g, b, 0.25, S0, True, 16, reset_BS=document_starts(doc_ids_BS)), inputs32)
    for name, a, b in zip(NAMES, got, want):  # bound as in test_fp32_within_derived_bound_and_l2norm_flag
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5 * max(1.0, b.abs().max().item()), msg=name)


@pytest.mark.parametrize("W", [3, 4])
def test_causal_conv1d_equals_direct_sum(W):
    gen = torch.Generator().manual_seed(0)
    x_BSC, w_CW, b_C = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 11, 5), (5, W), (5,)))
    padded = torch.cat([torch.zeros(2, W - 1, 5, dtype=torch.float64), x_BSC], 1)
    want = torch.stack([b_C + sum(w_CW[:, i] * padded[:, t + i] for i in range(W)) for t in range(11)], 1)
    torch.testing.assert_close(causal_conv1d(x_BSC, w_CW, b_C), want, rtol=0, atol=1e-13)  # fp64, W-term sums
    torch.testing.assert_close(causal_conv1d(x_BSC, w_CW, None, "silu"), F.silu(want - b_C), rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x_BSC, w_CW, activation="gelu")
    # documents [0 0 0 1 2 2 2 2 2 3 3] in row 0, [0 1 1 1 1 1 1 1 1 1 1] in row 1: taps into an earlier document
    # read 0
    doc_ids_BS = doc_ids_of([[3, 1, 5, 2], [1, 10]])
    want = torch.stack([b_C + sum(w_CW[:, i] * padded[:, t + i] * (doc_ids_BS[:, t] == doc_ids_BS[:, t + i - W + 1])
                                  [:, None] for i in range(W) if t + i - W + 1 >= 0) for t in range(11)], 1)
    torch.testing.assert_close(causal_conv1d(x_BSC, w_CW, b_C, doc_ids_BK=doc_ids_BS), want, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="doc_ids_BK"):
        causal_conv1d(x_BSC, w_CW, b_C, doc_ids_BK=doc_ids_BS[:, :5])


def test_fla_wrapper_ops_autograd_and_fullgraph_compile(monkeypatch):
    """The custom ops around fla (forward, recomputing backward, fake shapes, autograd registration) on CPU, with a
    stand-in for fla that has fla's signature and runs the reference; also under torch.compile(fullgraph=True)
    (aot_eager: graph capture, fake tensors and the autograd split, without code generation)."""
    from core.kernels import gated_delta

    def fla_standin(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    use_qk_l2norm_in_kernel):
        assert q.shape[2] == v.shape[2] and initial_state is not None and output_final_state  # what the ops pass
        if cu_seqlens is None:
            return chunk_gated_delta_rule_reference(q, k, v, g, beta, scale, initial_state, True, 16,
                                                    use_qk_l2norm_in_kernel)
        assert q.shape[0] == 1 and len(initial_state) == len(cu_seqlens) - 1  # fla's varlen: one row, N states
        runs = [chunk_gated_delta_rule_reference(*(x[:, a:e] for x in (q, k, v, g, beta)), scale,
                                                 initial_state[n:n + 1], True, 16, use_qk_l2norm_in_kernel)
                for n, (a, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))]
        return torch.cat([o for o, _ in runs], 1), torch.cat([f for _, f in runs], 0)

    monkeypatch.setattr(gated_delta, "_fla_chunk_gated_delta_rule", fla_standin)
    inputs = make_inputs(S=21, dtype=torch.float32)

    def wrapped(q, k, v, g, b, S0):
        return gated_delta._fla_gated_delta_rule(q, k, v, g, b, 0.5, S0, True, True)

    want = values_and_grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule_reference(
        q, k, v, g, b, 0.5, S0, True, 16, True), inputs)
    for fn in (wrapped, torch.compile(wrapped, fullgraph=True, backend="aot_eager")):
        got = values_and_grads(fn, inputs)
        for name, a, b in zip(NAMES, got, want):  # the same fp32 ops in the same order: equal to rounding
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    # documents through fla's varlen form: rows flattened, one sequence per document, states per sequence
    reset_BS = document_starts(doc_ids_of([[5, 1, 15], [21]]))
    got = values_and_grads(lambda q, k, v, g, b, S0: gated_delta._fla_gated_delta_rule(
        q, k, v, g, b, 0.5, S0, True, True, reset_BS), inputs)
    want = values_and_grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule_reference(
        q, k, v, g, b, 0.5, S0, True, 16, True, reset_BS), inputs)
    for name, a, b in zip(NAMES, got, want):  # fp32, per-document chunks against masked chunks: 1e-5 (see above)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------ context parallelism

# A Gated-DeltaNet-like block: conv (SiLU) over q, k, v channels, then the rule with the kernel's q/k norm.
# chunk 10 tokens per cp chunk, kernel chunk 4: three kernel chunks per cp chunk, the last one padded.
CP_HK, CP_HV, CP_K, CP_V, CP_W, CP_CHUNK, CP_KERNEL_CHUNK = 1, 2, 4, 3, 4, 10, 4


def cp_block(x_BSC, w_CW, b_C, g_BSH, beta_BSH, S0_BHKV, cp_group, doc_ids_BK=None):
    y = causal_conv1d(x_BSC, w_CW, b_C, "silu", cp_group, doc_ids_BK)
    B, S = y.shape[:2]
    q, k, v = y.split([CP_HK * CP_K, CP_HK * CP_K, CP_HV * CP_V], -1)
    return gated_delta_rule(q.reshape(B, S, CP_HK, CP_K), k.reshape(B, S, CP_HK, CP_K), v.reshape(B, S, CP_HV, CP_V),
                            g_BSH, beta_BSH, None, S0_BHKV, True, CP_KERNEL_CHUNK, True, cp_group, doc_ids_BK)


# Documents over the whole sequence (cp chunks of 10 tokens): cp 2 (40 tokens) row 0 has a document starting at a
# cp chunk start (10), one of 1 token right after a cp chunk start (conv taps must not read the tail), documents
# crossing cp chunks; cp 4 (80 tokens) has a document spanning three cp chunks.
CP_DOCS = {2: [[10, 1, 2, 14, 13], [3, 25, 12]], 4: [[7, 30, 1, 1, 21, 20], [40, 2, 38]]}


def cp_block_per_document(doc_ids_BK, x, w, b, g, beta, S0):
    """cp_block (one process) on each document alone: the row's S0 enters its first document, 0 the others."""
    outs, finals = [], []
    for r in range(doc_ids_BK.shape[0]):
        row, S_1HKV = [], S0[r:r + 1]
        for d in doc_ids_BK[r].unique_consecutive():
            t = (doc_ids_BK[r] == d).nonzero().flatten()
            part = [z[r:r + 1, t[0]:t[-1] + 1] for z in (x, g, beta)]
            o, S_1HKV = cp_block(part[0], w, b, part[1], part[2], S_1HKV if not row else torch.zeros_like(S_1HKV),
                                 None)
            row.append(o)
        outs.append(torch.cat(row, 1))
        finals.append(S_1HKV)
    return torch.cat(outs, 0), torch.cat(finals, 0)


def cp_case(cp: int, seed: int = 0, dtype=torch.float64):
    """Whole-sequence inputs [x, w, b, g, beta, S0] and cotangents [do, dS] (drawn in fp64, then cast)."""
    gen = torch.Generator().manual_seed(seed)
    B, S, Ch = 2, 2 * cp * CP_CHUNK, 2 * CP_HK * CP_K + CP_HV * CP_V
    shapes = [(B, S, Ch), (Ch, CP_W), (Ch,), (B, S, CP_HV), (B, S, CP_HV), (B, CP_HV, CP_K, CP_V)]
    x, w, b, a, bb, S0 = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes)
    inputs = [x, w, b, F.logsigmoid(a + 1), torch.sigmoid(bb), S0]
    cotangents = [torch.randn(B, S, CP_HV, CP_V, generator=gen, dtype=torch.float64),
                  torch.randn(B, CP_HV, CP_K, CP_V, generator=gen, dtype=torch.float64)]
    return [t.to(dtype) for t in inputs], [t.to(dtype) for t in cotangents]


def _cp_run(cp: int, seed: int, group, rank: int, dtype=torch.float64, docs: bool = False) -> list:
    """This rank's outputs and input gradients for case (cp, seed) on group (rank: its rank in the group); docs:
    with CP_DOCS[cp]'s document ids (of the whole sequence)."""
    inputs, (do, dS) = cp_case(cp, seed, dtype)
    local = [split_for_cp(t, rank, cp) if i in (0, 3, 4) else t for i, t in enumerate(inputs)]  # per-token ones
    local = [t.clone().requires_grad_() for t in local]
    o, S = cp_block(*local, group, doc_ids_of(CP_DOCS[cp]) if docs else None)
    # the final state is replicated: rank 0 alone carries its cotangent (a replica's loss counts once)
    torch.autograd.backward([o, S], [split_for_cp(do, rank, cp), dS if rank == 0 else torch.zeros_like(dS)])
    return [o.detach(), S.detach()] + [t.grad for t in local]


def _cp_worker():
    """4 ranks (one spawn for both layouts): cp 2 on ranks {0, 1} (seed 0) and {2, 3} (seed 1), then cp 4 (seed 2),
    then cp 4 in fp32 (seed 3); then with documents: cp 2 (seeds 4, 5) and cp 4 (seed 6)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp2 = _cp_run(2, rank // 2, pairs[rank // 2], rank % 2)
    cp4 = _cp_run(4, 2, dist.group.WORLD, rank)
    cp4_fp32 = _cp_run(4, 3, dist.group.WORLD, rank, torch.float32)
    cp2_docs = _cp_run(2, 4 + rank // 2, pairs[rank // 2], rank % 2, docs=True)
    cp4_docs = _cp_run(4, 6, dist.group.WORLD, rank, docs=True)
    dist.destroy_process_group()
    return {"cp2": cp2, "cp4": cp4, "cp4_fp32": cp4_fp32, "cp2_docs": cp2_docs, "cp4_docs": cp4_docs}


def one_process(cp, seed, dtype, docs, per_document=False):
    """The whole-sequence block's outputs and every input gradient for case (cp, seed) in one process (per_document:
    each document of CP_DOCS[cp] run alone)."""
    inputs, (do, dS) = cp_case(cp, seed, dtype)
    inputs = [t.clone().requires_grad_() for t in inputs]
    doc_ids_BK = doc_ids_of(CP_DOCS[cp]) if docs else None
    o, S = cp_block_per_document(doc_ids_BK, *inputs) if per_document else cp_block(*inputs, None, doc_ids_BK)
    torch.autograd.backward([o, S], [do, dS])
    return [o.detach(), S.detach()] + [t.grad for t in inputs]


def test_cp2_and_cp4_equal_one_process():
    """Each cp chunk is 10 tokens, 3 kernel chunks of 4 (the last padded), conv width 4; every input's gradient;
    with and without documents (one process with documents also equals each document run alone)."""
    ranks = run_ranks(4, _cp_worker)
    cases = [(2, 0, torch.float64, False, [r["cp2"] for r in ranks[:2]]),
             (2, 1, torch.float64, False, [r["cp2"] for r in ranks[2:]]),
             (4, 2, torch.float64, False, [r["cp4"] for r in ranks]),
             (4, 3, torch.float32, False, [r["cp4_fp32"] for r in ranks]),
             (2, 4, torch.float64, True, [r["cp2_docs"] for r in ranks[:2]]),
             (2, 5, torch.float64, True, [r["cp2_docs"] for r in ranks[2:]]),
             (4, 6, torch.float64, True, [r["cp4_docs"] for r in ranks])]
    names = ["o", "final state", "dx", "dw", "db", "dg", "dbeta", "dS0"]
    for cp, seed, dtype, docs, per_rank in cases:
        want = one_process(cp, seed, dtype, docs)
        if docs:  # fp64, the same sums regrouped: bound as below
            for name, a, b in zip(names, want, one_process(cp, seed, dtype, docs, per_document=True)):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"cp{cp} seed {seed} alone: {name}")
        per_token = (0, 2, 5, 6)  # o, dx, dg, dbeta: split over the ranks; weights, S0: gradients summed
        got = [merge_from_cp([r[i] for r in per_rank]) if i in per_token else
               per_rank[0][i] if i == 1 else sum(r[i] for r in per_rank) for i in range(len(names))]
        assert all(torch.equal(r[1], per_rank[0][1]) for r in per_rank)  # every rank has the same final state
        # The composition S_{j+1} = M_j S_j + C_j and o0 + S_in^T P regroup the same sums: differences are a few
        # hundred roundings of O(1) values (states are bounded, see the fp32 kernel test). fp64: far below 1e-10.
        # fp32: ~100 x 6e-8 = 6e-6 of a tensor's largest magnitude at worst (3e-7 measured); the repo's layout
        # tolerance, 1e-5 of it, holds with that margin.
        for name, a, b in zip(names, got, want):
            atol = 1e-10 if dtype == torch.float64 else 1e-5 * b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=f"cp{cp} seed {seed} {dtype} docs {docs}: {name}")


def test_cp_bytes_and_flops_formulas():
    # Qwen3.5-35B-A3B: 32 value heads, K = V = 128, conv width 4 over 8192 channels; cp 2: 2 summaries of
    # 32 x 128 x 256 fp32 (4 MiB each) + 2 tails of 3 x 8192 bf16
    assert cp_linear_attention_bytes_received_per_layer(2, 32, 128, 128, 8192, 4) == 2 * 2**22 + 2 * 3 * 8192 * 2
    assert cp_linear_attention_bytes_received_per_layer(1, 32, 128, 128, 8192, 4) == 0
    assert flops_per_token(128, 128, 1, 64) == 64 * 8 * 128 + 6 * 128 * 128


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_fla_kernel_matches_reference_on_cuda():
    """fla's Triton kernels (bf16, through chunk_gated_delta_rule) against the fp32 reference on the same bf16
    inputs, values and every gradient, also under torch.compile(fullgraph=True) of a function around the call."""
    from core.kernels import gated_delta
    if gated_delta._fla_chunk_gated_delta_rule is None:
        pytest.skip("fla-core is not installed (pip install fla-core)")
    inputs = [x.detach().cuda().requires_grad_() for x in make_inputs(B=2, S=300, Hk=2, Hv=4, K=128, V=128,
                                                                        dtype=torch.float32)]
    q, k, v, g, beta, S0 = inputs
    bf16 = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), S0]

    def fla(q, k, v, g, b, S0):
        return chunk_gated_delta_rule(q, k, v, g, b, None, S0, True, 64, True)

    def ref(q, k, v, g, b, S0):
        return chunk_gated_delta_rule_reference(q.float(), k.float(), v.float(), g, b.float(), None, S0, True, 64,
                                                True)

    assert gated_delta.fla_usable(bf16[2])
    want = values_and_grads(ref, bf16)
    for fn in (fla, torch.compile(fla, fullgraph=True)):
        got = values_and_grads(fn, bf16)
        # bf16 outputs and bf16-stored intermediate states in fla (8 mantissa bits: 4e-3 relative per rounding,
        # a few chained): 3e-2 of each tensor's largest magnitude
        for name, a, b in zip(NAMES, got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=3e-2 * b.abs().max().item(), msg=name)


@pytest.mark.gpu
def test_fla_cp_path_matches_reference_on_cuda(tmp_path):
    """gated_delta_rule on a one-rank NCCL group (the rank holds chunks 0 and 1): fla runs with value width V + K
    from the state [0 | I], the summaries are gathered and composed; against the reference without cp."""
    from core.kernels import gated_delta
    if gated_delta._fla_chunk_gated_delta_rule is None:
        pytest.skip("fla-core is not installed (pip install fla-core)")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        inputs = [x.detach().cuda().requires_grad_() for x in make_inputs(B=2, S=256, Hk=2, Hv=4, K=128, V=128,
                                                                            dtype=torch.float32)]
        q, k, v, g, beta, S0 = inputs
        bf16 = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), S0]
        got = values_and_grads(lambda q, k, v, g, b, S0: gated_delta_rule(
            q, k, v, g, b, None, S0, True, 64, True, dist.group.WORLD), bf16)
        want = values_and_grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule_reference(
            q.float(), k.float(), v.float(), g, b.float(), None, S0, True, 64, True), bf16)
        for name, a, b in zip(NAMES, got, want):  # bf16 bound as in the test above
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=3e-2 * b.abs().max().item(), msg=name)
    finally:
        dist.destroy_process_group()
