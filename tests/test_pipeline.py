"""DualPipeV engine (core/pipeline.py) on a small MoE stand-in that follows the layer contract: pp=2 and pp=4 against
one process running the same micro-batches (losses: one per micro-batch on pp rank 0; every gradient), with and
without overlap and weight-gradient delay; forward-only; the activation bound; the errors. pp=2 x ep=2, with what
the engine runs recorded, is in test_schedule.py; the Qwen3 recipe's --pp runs are in test_train_pp.py."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.mesh import build_mesh, destroy_mesh
from core.moe import expert_matmul, moe_forward
from core.pipeline import DualPipeV, running, split_layers
from recipes.qwen3_30b_a3b import model as qwen3
from tests.multiproc import run_ranks
from tests.test_train import held_experts, rel_err
from tools.hf_parity import FLOAT64_TOLERANCE

H, E, K, S, MB = 16, 4, 2, 8, 2  # hidden, experts, top-k, sequence, sequences per micro-batch
VOCAB, LAYERS = 32, 8


class ToyLayer(nn.Module):
    """A decoder layer reduced to the contract: (1) mixing + router, (3) experts, (5) residual."""

    moe = True
    drop = None  # a float: slots whose routing weight is below it are masked (id -1), so 0..K experts per token

    def __init__(self, ep_group, lo, hi):
        super().__init__()
        self.mix = nn.Linear(H, H)
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, 2 * H)[lo:hi].clone() * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, 2 * H, H)[lo:hi].clone() * 0.1)
        self.num_experts, self.ep_group, self.placement = E, ep_group, None

    def attention(self, state):
        h = state[0] + torch.tanh(self.mix(state[0]))
        x_TH = h.flatten(0, 1)
        weights, ids = self.router(x_TH).softmax(-1).topk(K, dim=-1)
        if self.drop is not None:
            ids = ids.masked_fill(weights < self.drop, -1)
        return [h], x_TH, ids, weights

    def routed_experts(self, x_QH, row_R, counts, weights_R):
        rows_RH = x_QH[row_R]
        return expert_matmul(F.silu(expert_matmul(rows_RH, self.w1, counts)), self.w2, counts) * weights_R[:, None]

    def finish(self, state, x_TH, out_TH):
        return [state[0] + out_TH.view_as(state[0])]


class ToyModel(nn.Module):
    def __init__(self, ep_group=None, ep_rank=0, ep=1):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList([ToyLayer(ep_group, ep_rank * E // ep, (ep_rank + 1) * E // ep) for _ in range(LAYERS)])
        self.head = nn.Linear(H, VOCAB)


class ToyStage:
    def __init__(self, model, layer_ids, first, last, ids, num_labels):
        self.model, self.layers, self.first, self.last = model, [model.layers[i] for i in layer_ids], first, last
        self.ids, self.num_labels = ids, num_labels

    def pre(self, inputs, mb):
        return [self.model.embed(self.ids[mb])] if self.first else inputs

    def post(self, state, mb):
        if not self.last:
            return state
        logits = self.model.head(state[0])
        return [F.cross_entropy(logits.flatten(0, 1), self.ids[mb].roll(-1, 1).flatten(), reduction="sum") / self.num_labels]


def batches(num_micro):
    return torch.randint(0, VOCAB, (num_micro, MB, S), generator=torch.Generator().manual_seed(1))


def reference(num_micro):
    """One process: every micro-batch through all layers in order, backward per micro-batch."""
    model, ids = ToyModel(), batches(num_micro)
    stage = ToyStage(model, range(LAYERS), True, True, ids, ids.numel())
    losses = []
    for mb in range(num_micro):
        state = stage.pre([], mb)
        for layer in stage.layers:
            state, x_TH, top_ids, weights = layer.attention(state)
            out, _ = moe_forward(x_TH, top_ids, weights, E, None, layer.routed_experts)
            state = layer.finish(state, x_TH, out)
        loss = stage.post(state, mb)[0]
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters()}
    return torch.stack(losses), grads


def pipeline_worker(pp, ep, num_micro, overlap, delay, forward_only=False):
    mesh = build_mesh(pp=pp, ep=ep, dp=1)
    result = run_pipeline(mesh, num_micro, overlap, delay, forward_only)
    destroy_mesh()
    return result


def run_pipeline(mesh, num_micro, overlap, delay, forward_only=False, drops=(None,), layer_class=ToyLayer):
    """One DualPipeV run on `mesh`; layer i's router drops slots below drops[i % len(drops)] (ToyLayer.drop); the
    layers are of `layer_class` (a ToyLayer with the same parameters)."""
    pp, ep, r, ep_rank = mesh.pp, mesh.ep, mesh.coord("pp"), mesh.coord("ep")
    model, ids = ToyModel(mesh.group("ep"), ep_rank, ep), batches(num_micro)
    for i, layer in enumerate(model.layers):
        layer.drop, layer.__class__ = drops[i % len(drops)], layer_class
    stages_layers = split_layers(LAYERS, pp)
    stages = [ToyStage(model, stages_layers[s], s == 0, s == 2 * pp - 1, ids, ids.numel()) for s in (r, 2 * pp - 1 - r)]
    step = mesh.world // pp  # global rank distance between pp neighbours
    engine = DualPipeV(stages, r, pp, mesh.rank - step if r > 0 else None, mesh.rank + step if r < pp - 1 else None,
                       mesh.group("pp"), [((MB, S, H), torch.float32)], torch.device("cpu"), overlap, delay)
    if forward_only:
        with torch.no_grad():
            losses = engine.run(num_micro, forward_only=True)
    else:
        losses = engine.run(num_micro)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, engine.peak_live_chunks, [name for name, *_ in engine.timeline], ep_rank, r


def check_losses(results, ref_losses, rtol):
    """pp rank 0 returns one loss per micro-batch, equal to one process's; the other pp ranks return none."""
    for losses, *_, pp_rank in results:
        if pp_rank == 0:
            assert len(losses) == len(ref_losses) and torch.allclose(torch.stack(losses), ref_losses, rtol=rtol, atol=0)
        else:
            assert losses == []


def check(results, num_micro, ep, ref=None):
    """Against `ref` = (losses, grads) of one process, by default `reference(num_micro)`."""
    ref_losses, ref_grads = ref or reference(num_micro)
    check_losses(results, ref_losses, rtol=1e-5)
    seen, worst = set(), 0.0
    for _, grads, _peak, _ops, ep_rank, _ in results:
        for name, g in grads.items():
            ref = ref_grads[name]
            if name.endswith((".w1", ".w2")):  # both ep ranks feed the same micro-batches: their experts see them twice
                ref = ep * ref.chunk(ep)[ep_rank]
            seen.add(name)
            worst = max(worst, ((g - ref).norm() / ref.norm().clamp(min=1e-30)).item())
            assert worst <= 1e-5, name
    assert seen == set(ref_grads), set(ref_grads) - seen  # every parameter's gradient checked on some rank
    return worst


@pytest.mark.parametrize("pp,ep,num_micro,overlap,delay", [(2, 1, 5, True, True), (2, 1, 4, False, False),
                                                           (4, 1, 9, True, True)])  # pp2 x ep2: test_schedule.py
def test_dualpipev_equals_one_process(pp, ep, num_micro, overlap, delay):
    results = run_ranks(pp * ep, pipeline_worker, pp, ep, num_micro, overlap, delay)
    check(results, num_micro, ep)
    for _, _, peak, ops, *_ in results:
        assert peak / 2 <= pp + 1  # live micro-batch activations per rank, in units of a rank's two stages
        assert ("W" in ops) == delay and any("&" in op for op in ops) == overlap


def test_forward_only_equals_plain_forward():
    check_losses(run_ranks(2, pipeline_worker, 2, 1, 4, True, True, True), reference(4)[0], rtol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="cannot fill 2\\*pp = 8 pipeline stages"):
        split_layers(4, 4)
    assert split_layers(48, 2) == [list(range(0, 11)), list(range(11, 24)), list(range(24, 37)), list(range(37, 48))]
    engine = DualPipeV([None, None], 0, 2, None, 1, None, [], torch.device("cpu"))
    with pytest.raises(ValueError, match="at least 2\\*pp = 4 micro-batches"):
        engine.run(3)



RECORDS = []  # (fingerprint of a mixing input, running.micro_batch, running.stage, running.backward), this process


def fingerprint(x):
    return x.detach().flatten()[:8].tolist()


class RecordingLayer(ToyLayer):
    """ToyLayer whose mixing is recomputed in backward (torch.utils.checkpoint); each run of it, the first and the
    recomputed one, records what core.pipeline.running says while it runs, next to its input's fingerprint."""

    def attention(self, state):
        def mix(x):
            RECORDS.append((fingerprint(x), running.micro_batch, running.stage, running.backward))
            return x + torch.tanh(self.mix(x))

        h = checkpoint(mix, state[0], use_reentrant=False)
        x_TH = h.flatten(0, 1)
        weights, ids = self.router(x_TH).softmax(-1).topk(K, dim=-1)
        return [h], x_TH, ids, weights


def running_worker(pp, num_micro, overlap):
    mesh = build_mesh(pp=pp, ep=1, dp=1)
    run_pipeline(mesh, num_micro, overlap, delay=True, layer_class=RecordingLayer)
    destroy_mesh()
    return RECORDS, running.micro_batch


@pytest.mark.parametrize("overlap", [True, False])
def test_running_names_the_chunk(overlap):
    """Every run of a layer's code, in forward and recomputed in backward, under overlap (one chunk's forward
    interleaved with another's backward) or not, sees the micro-batch and stage whose data it computes: told
    apart by its input, matched to the one-process run's inputs of each (layer, micro-batch)."""
    pp, num_micro = 2, 5
    model, ids = ToyModel(), batches(num_micro)
    stage_of = {i: s for s, layer_ids in enumerate(split_layers(LAYERS, pp)) for i in layer_ids}
    ref = []  # (fingerprint, micro-batch, stage) of every layer's input
    with torch.no_grad():
        for mb in range(num_micro):
            state = [model.embed(ids[mb])]
            for i, layer in enumerate(model.layers):
                ref.append((torch.tensor(fingerprint(state[0])), mb, stage_of[i]))
                state, x_TH, top_ids, weights = layer.attention(state)
                state = layer.finish(state, x_TH, moe_forward(x_TH, top_ids, weights, E, None, layer.routed_experts)[0])
    seen = set()
    for records, after in run_ranks(pp, running_worker, pp, num_micro, overlap):
        assert after is None  # reset when the step is done
        for fp, mb, stage, backward in records:
            _, ref_mb, ref_stage = min(ref, key=lambda r: (r[0] - torch.tensor(fp)).norm().item())
            assert (mb, stage) == (ref_mb, ref_stage), (fp, mb, stage, backward)
            seen.add((ref_mb, ref_stage, backward))
    # every (micro-batch, stage) ran forward once and was recomputed in its backward
    assert seen == {(mb, s, b) for mb in range(num_micro) for s in range(2 * pp) for b in (False, True)}


def test_split_layers_by_cost():
    """Layers of unequal cost: the split whose largest stage (plain numbers: embedding and head one mean layer
    each; flops_by_layer's dicts: the first and last stage's own modules at their own cost) is smallest, found
    against every contiguous split written out here; equal costs split by count."""
    import itertools

    def largest(costs, stages, ends=None):
        first, last = ends or [sum(costs) / len(costs)] * 2
        return max(sum(costs[i] for i in s) + (first if k == 0 else last if k == len(stages) - 1 else 0)
                   for k, s in enumerate(stages))

    # a hybrid (every 4th layer costs 4), costs where leaving out the embedding's or the head's share misplaces
    # a cut, and a head as costly as 5 layers with a free embedding (flops_by_layer's form: it moves layers off the
    # last stage onto the first)
    for costs, ends, want in (([1, 1, 1, 4, 1, 1, 1, 4, 1, 1], None, 6), ([1, 4, 1, 2, 1, 2, 2, 2], None, 5.875),
                              ([1] * 12, [0, 5], 5)):
        n = len(costs)
        best = min(largest(costs, [list(range(a, b)) for a, b in zip((0, *cuts), (*cuts, n))], ends)
                   for cuts in itertools.combinations_with_replacement(range(n + 1), 3)
                   if all(b > a for a, b in zip(cuts, cuts[1:])))  # middle stages non-empty
        given = costs if ends is None else [{"dense": c} for c in costs] + [{"embedding": ends[0]}, {"head": ends[1]}]
        split = split_layers(n, 2, given)
        assert sum(split, []) == list(range(n)) and all(split[1:-1]) and largest(costs, split, ends) == best == want
    assert split[-1] == [] and len(split[0]) == 4  # the heavy head's stage holds no layer (by count: 2 of 12)
    assert split_layers(10, 2, [{"attention": 2, "dense": 3}] * 10 + [{"embedding": 5}, {"head": 5}]) == split_layers(10, 2)


# ---------------------------------------------------------------- finish gets the layer input (a recipe variant)


class IdentityExpertLayer(qwen3.DecoderLayer):
    """A Qwen3 layer with a zero-computation expert, as a copied recipe adds one: an identity expert whose output
    x_TH * w (x_TH: the routed tokens, w [H] its weight) joins the routed experts' in step (5), `finish`."""

    def finish(self, state, x_TH, out_TH):
        return super().finish(state, x_TH, out_TH + x_TH * self.identity_H)


class IdentityInStepOne(qwen3.DecoderLayer):
    """The same computation in one place, the reference: the identity expert added where x_TH is made, step (1)."""

    def attention(self, state):
        (h_BSH, *more), x_TH, ids_Tk, weights_Tk = super().attention(state)
        return [h_BSH + (x_TH * self.identity_H).view_as(h_BSH), *more], x_TH, ids_Tk, weights_Tk


def identity_model(layer_class, layers=None, **kw):
    """The tiny Qwen3 model in float64, every layer of `layer_class` with the identity weight w = 0.5 + N(0, 0.1):
    large enough that a lost or misplaced x_TH * w moves every gradient upstream of it by O(10%)."""
    cfg = qwen3.ModelConfig.from_hf(qwen3.tiny_config_path())
    torch.manual_seed(0)
    model = qwen3.Model(cfg, layers=layers, **kw).double()
    for i, layer in model.layers.items():
        layer.__class__ = layer_class
        w_H = 0.5 + 0.1 * torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(int(i)))
        layer.identity_H = nn.Parameter(w_H.double())
    return model, cfg


def identity_expert_worker(num_micro, batch, seq):
    """pp2 x ep2, each ep rank its own micro-batches: {recompute: (losses of pp rank 0, gradients: dense ones summed
    over ep, routed experts this rank's rows)}, and the same from one process (both layer classes, every ep rank's
    micro-batches in order) in the same form."""
    mesh = build_mesh(pp=2, ep=2, dp=1)
    r, ep_rank = mesh.coord("pp"), mesh.coord("ep")
    torch.set_default_dtype(torch.float64)  # the state's statistics too (Model.initial_state)
    ids = torch.randint(0, 4096, (2, num_micro * batch, seq), generator=torch.Generator().manual_seed(5))
    positions_BS = torch.arange(seq).expand(batch, seq)

    def mine(model, cfg):  # a whole model's routed experts: this ep rank's rows
        rows = held_experts(cfg.num_experts, 2, ep_rank)
        return {n: p.grad[rows] if ".mlp.experts." in n else p.grad for n, p in model.named_parameters()}

    out = {}
    for layer_class in (IdentityInStepOne, IdentityExpertLayer):  # one process
        model, cfg = identity_model(layer_class)
        model.set_positions(positions_BS)
        losses = []
        for e in range(2):
            for ids_BS in ids[e].split(batch):
                losses.append(model.forward_train(ids_BS, ids_BS).terms["lm"])
                losses[-1].backward()
        out[layer_class.__name__] = torch.stack(losses).detach().view(2, num_micro)[ep_rank], mine(model, cfg)
    for recompute in ("none", "layer"):
        layers = split_layers(cfg.num_hidden_layers, 2)
        model, cfg = identity_model(IdentityExpertLayer, layers[r] + layers[3 - r], embed=r == 0, head=r == 0,
                                    ep_group=mesh.group("ep"), recompute=recompute)
        stages = [qwen3.PipelineStage(model, layers[s], s == 0, s == 3) for s in (r, 3 - r)]
        engine = DualPipeV(stages, r, 2, mesh.rank - 2 if r else None, mesh.rank + 2 if r == 0 else None,
                           mesh.group("pp"), None, torch.device("cpu"))
        for stage in stages:
            stage.input_ids = stage.labels = ids[ep_rank].split(batch)
            stage.extras = [{}] * num_micro
            stage.loss_fn = lambda terms: terms["lm"]
        model.set_positions(positions_BS)
        losses = engine.run(num_micro)
        grads = {n: p.grad for n, p in model.named_parameters()}
        for n, g in grads.items():
            if ".mlp.experts." not in n:
                dist.all_reduce(g, group=mesh.group("ep"))
        out[recompute] = torch.stack(losses).detach() if losses else None, grads
    torch.set_default_dtype(torch.float32)
    destroy_mesh()
    return out


def test_finish_gets_the_layer_input():
    """A recipe variant whose finish adds an identity expert's x_TH * w equals the same computation done in step (1)
    (IdentityInStepOne, one process), in one process and at pp2 x ep2 (DualPipeV with overlap and delayed weight
    gradients; --recompute none and layer): losses and every gradient, the identity weights' included. In float64:
    the runs differ only in summation order (the identity term added before or after the residual, partial sums
    per ep rank), a few roundings of 1.1e-16 each (measured: <= 1.6e-15), so FLOAT64_TOLERANCE (1e-10) leaves no
    room for a lost or detached term (x_TH detached before finish: 0.99 on the embedding's gradient)."""
    runs = run_ranks(4, identity_expert_worker, 4, 2, 16)
    for rank, run in enumerate(runs):
        ref_losses, ref = run["IdentityInStepOne"]
        for name in ("IdentityExpertLayer", "none", "layer"):
            losses, grads = run[name]
            if losses is not None:  # pp rank 0: its ep rank's micro-batches
                assert rel_err(losses, ref_losses) < FLOAT64_TOLERANCE, (rank, name)
            assert any(n.endswith("identity_H") for n in grads), (rank, name)
            for n, g in grads.items():
                assert rel_err(g, ref[n]) < FLOAT64_TOLERANCE, (rank, name, n, rel_err(g, ref[n]))
