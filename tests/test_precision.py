"""The bf16 path (--dtype bf16: autocast, fp32 master weights) against one process and against fp32: pp, ep, cp and
their combinations; activations that cross ranks are bf16; weights are cast once per step; activation recompute
changes no number and holds fewer saved tensors."""

import json

import torch
import torch.distributed as dist

from recipes.qwen3_30b_a3b import train
from recipes.qwen3_30b_a3b.model import Model, ModelConfig
from tests.conftest import TINY_TRAIN_CONFIG
from tests.multiproc import one_thread, run_ranks
from tests.test_train import rel_err, run_train
from tests.test_train_pp import pp_args


class CommRecorder:
    """Records every floating-point tensor this rank sends through all_to_all_single, batch_isend_irecv (isend ops)
    or all_gather: (call, dtype, shape, bytes sent to other ranks)."""

    NAMES = ("all_to_all_single", "batch_isend_irecv", "all_gather")

    def __init__(self):
        self.records = []

    def _add(self, call, t, rows_to_others):
        if t.is_floating_point():
            self.records.append((call, t.dtype, tuple(t.shape), rows_to_others * t[:1].numel() * t.element_size()))

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        a2a, p2p, gather = (self.saved[n] for n in self.NAMES)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            n, me = dist.get_world_size(group), dist.get_rank(group)
            splits = input_split_sizes or [input.shape[0] // n] * n
            self._add("all_to_all", input, sum(splits) - splits[me])
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        def batch_isend_irecv(ops):
            for op in ops:
                if op.op.__name__ == "isend":
                    self._add("p2p", op.tensor, op.tensor.shape[0] if op.tensor.dim() else 1)
            return p2p(ops)

        def all_gather(tensor_list, tensor, group=None, **kw):
            self._add("all_gather", tensor, (dist.get_world_size(group) - 1) * tensor.shape[0])
            return gather(tensor_list, tensor, group=group, **kw)

        for name, fn in zip(self.NAMES, (all_to_all_single, batch_isend_irecv, all_gather)):
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def recorded_runs(runs: list[list[str]]):
    """Training runs one after the other in each spawned rank, all in one process group (train.py's closing
    destroy_mesh waits for the last run: a new rendezvous per run races with slower ranks still leaving the
    previous one); returns [(run_train result, records)]."""
    dist.init_process_group("gloo")
    train.destroy_mesh = lambda: None
    out = []
    for argv in runs:
        with CommRecorder() as recorder:
            out.append((run_train(argv), recorder.records))
    dist.barrier()
    dist.destroy_process_group()
    return out


def weight_errors(ranks, ref) -> dict[tuple[int, str], float]:
    """{(rank, name): relative error of the tensor against a one-process run}; routed experts by global id, as every
    run holds them (tests/test_train.py:run_train's `name[e]`)."""
    return {(rank, name): rel_err(w, ref[2][name]) for rank, (_, _, weights) in enumerate(ranks)
            for name, w in weights.items()}


def errors(ranks, ref) -> tuple[float, float, float]:
    """(losses, grad norms, worst weight) relative errors of a run's ranks against a one-process run."""
    (ref_losses, ref_norms, _), (losses, norms, _) = ref, ranks[0]
    return rel_err(torch.tensor(losses), torch.tensor(ref_losses)), \
        rel_err(torch.tensor(norms), torch.tensor(ref_norms)), max(weight_errors(ranks, ref).values())


def test_bf16_layouts_match_one_process_and_differ_from_fp32(tmp_path, tiny_train_setup):
    """pp2, ep2, cp2 (one spawn of 2 ranks), pp2 x ep2, cp2 x ep2 (one spawn of 4) under --dtype bf16, 6 layers (with
    --pp 2 the first rank then holds MoE layers whose first gradient is a delayed one). Every layout runs FSDP2,
    which gathers every weight in bf16 where one process keeps the norms' and routers' in fp32, and rounds in other
    places (ep: other expert sums, cp: another attention kernel): they are other bf16 computations of the same
    steps, held to bf16's own error, measured in the same run as the distance between one bf16 process and one fp32
    process (the bounds below say why each is that size); pp2 against dp2 on the same bf16 weights: the gradients
    of tests/test_fsdp.py. Activations crossing ranks (dispatch, combine, stage hand-offs, cp K/V) are bf16.
    --recompute layer at pp2 and attention at cp2 change no bit."""
    _, data = tiny_train_setup
    config = tmp_path / "six_layers.json"
    config.write_text(json.dumps({**TINY_TRAIN_CONFIG, "num_hidden_layers": 6}))

    def args(name, **extra):
        return pp_args(config, data, tmp_path / name, dtype="bf16", **extra)

    with one_thread():  # the ranks' thread count: pp2 must equal this run bit for bit
        bf16 = run_train(args("bf16"))
    fp32 = run_train(pp_args(config, data, tmp_path / "fp32"))
    # bf16's own rounding error, the scale of every bound below: one bf16 process against one fp32 process
    noise_loss, noise_norm, _ = errors([bf16], fp32)
    noise_weight = {name: err for (_, name), err in weight_errors([fp32], bf16).items()}
    layouts = {2: {"pp2": dict(pp=2), "ep2": dict(ep=2), "cp2": dict(cp=2),
                   "pp2 recompute": dict(pp=2, recompute="layer"), "cp2 recompute": dict(cp=2, recompute="attention")},
               4: {"pp2xep2": dict(pp=2, ep=2), "cp2xep2": dict(cp=2, ep=2)}}
    results = {"single": ([bf16], [])}
    for world, runs in layouts.items():
        per_rank = run_ranks(world, recorded_runs, [args(name, **extra) for name, extra in runs.items()])
        results.update({name: ([rank[i][0] for rank in per_rank], [r for rank in per_rank for r in rank[i][1]])
                        for i, name in enumerate(runs)})
    for name, (ranks, records) in results.items():
        (loss, norm, weight), (loss32, norm32, _) = errors(ranks, bf16), errors(ranks, fp32)
        print(f"{name}: vs one-process bf16: losses {loss:.1e} grad norms {norm:.1e} worst weight {weight:.1e}; "
              f"vs fp32: losses {loss32:.1e} grad norms {norm32:.1e}")
        if name != "single":
            # Losses and grad norms, two-sided against fp32. Above 1/30 of bf16's error: fp32 layouts match fp32 to
            # ~2e-7, several times below that floor on any kernel set (bf16's loss error is 4e-5 with ATen's AVX2
            # kernels, 3e-4 with its default ones), so an error above it means the run computed in bf16. Below 8x
            # bf16's error: a bf16 computation that rounds in other places deviates from fp32 by the same kind of
            # error (measured: at most 4.1x, cp2 x ep2 on AVX2, whose attention kernel rounds other intermediates
            # in bf16; at least 0.14x, cp2's grad norm on the default kernels), and 8x leaves a factor 2 for other
            # CPUs; a dropped or doubled term (a missing reduction, a wrong scale) moves them by that term's size.
            assert noise_loss / 30 < loss32 < 8 * noise_loss, (name, loss32, noise_loss)
            assert noise_norm / 30 < norm32 < 8 * noise_norm, (name, norm32, noise_norm)
            # Each weight tensor within twice the distance that bf16 itself puts between one bf16 and one fp32
            # process on that tensor: Adam turns near-zero gradients whose sign rounding decides into lr-sized steps,
            # so the router, whose gradients are smallest, moves 15% in 3 steps under bf16 alone; both distances come
            # from the same rounding (measured: at most 0.92x, the layer-0 router at cp2 on AVX2), and a tensor whose
            # gradient is wrong moves by whole Adam steps in every element.
            for (rank, tensor), err in weight_errors(ranks, bf16).items():
                assert err <= 2 * noise_weight[tensor], (name, rank, tensor, err, noise_weight[tensor])
        # not the aux statistics: Qwen3's state entry [2, E] (Model.initial_state), fp32 by design
        activations = [r for r in records if r[2] != (2, TINY_TRAIN_CONFIG["num_experts"])]
        assert all(dtype == torch.bfloat16 for _, dtype, _, _ in activations), (name, set(records))
        moved = {}  # bytes per trained token (3 steps of 8 x 32): per MoE layer, per stage crossing, per layer
        for call, _, _, nbytes in activations:
            kind = {"p2p": "pipeline", "all_gather": "cp K/V gather", "all_to_all": "dispatch + combine"}[call]
            moved[kind] = moved.get(kind, 0) + nbytes / (3 * 8 * 32) / (2 if call == "p2p" else 6)
        print(f"{name}: bytes sent per token", {kind: round(b, 1) for kind, b in sorted(moved.items())})
        assert {call for call, *_ in activations} == {"single": set(), "pp2": {"p2p"}, "ep2": {"all_to_all"},
                                                     "cp2": {"all_gather"}, "pp2xep2": {"p2p", "all_to_all"},
                                                     "cp2xep2": {"all_gather", "all_to_all"}}[name.split(" ")[0]]
    for name in ("pp2", "cp2"):  # recompute (with DualPipeV and delayed weight gradients; cp: K/V gathered again)
        for (losses, norms, weights), recomputed in zip(results[name][0], results[name + " recompute"][0]):
            assert (losses, norms) == recomputed[:2], name
            assert all(torch.equal(w, recomputed[2][n]) for n, w in weights.items()), name


def saved_tensor_bytes(model, fn, *args) -> tuple:
    """(fn(*args), bytes of the distinct tensors (by storage) that autograd keeps for backward while fn runs, the
    model's parameters excluded). torch.utils.checkpoint's inner hooks hide what it will recompute; the inputs it keeps
    pass through this hook."""
    storages = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(storages.values())


def test_recompute_changes_no_number_and_keeps_fewer_tensors():
    """One process, 2 MoE layers and 1 dense layer: loss and every gradient bitwise equal with --recompute attention
    and layer; the saved-tensor bytes fall from none to attention to layer."""

    fields = {k: v for k, v in TINY_TRAIN_CONFIG.items() if k != "model_type"}
    cfg = ModelConfig(**{**fields, "num_hidden_layers": 3, "mlp_only_layers": [1]})
    ids_BS = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("none", "attention", "layer"):
        torch.manual_seed(0)
        model = Model(cfg, recompute=mode)
        out, saved = saved_tensor_bytes(model, model.forward_train, ids_BS, ids_BS.roll(-1, 1))
        (out.loss_sum + out.aux_loss).backward()
        results[mode] = (out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters()}, saved)
    print({mode: r[2] for mode, r in results.items()})
    loss, grads, saved = results["none"]
    for mode in ("attention", "layer"):
        assert torch.equal(results[mode][0], loss), mode
        for name, g in grads.items():
            assert torch.equal(results[mode][1][name], g), (mode, name)
    assert saved > results["attention"][2] > results["layer"][2]


def test_bf16_weights_cast_once_per_step(tiny_train_setup, tmp_path):
    """--dtype bf16, 2 steps of 4 micro-batches: every matrix parameter (attention, router, experts, LM head; the
    embedding is looked up in fp32 and its rows cast) is cast to bf16 exactly once per step, counted at the ATen
    level (the norms' weights, [H] each, are cast where they are used)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.test_train import train_args

    class CountCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts = {}  # storage address of the source -> count

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 and \
                    kwargs.get("dtype") == torch.bfloat16:
                ptr = args[0].untyped_storage().data_ptr()
                self.casts[ptr] = self.casts.get(ptr, 0) + 1
            return func(*args, **kwargs)

    config, data = tiny_train_setup
    with CountCasts() as counter:
        _, model = train.main(train_args(config, data, tmp_path, steps=2, dtype="bf16"))
    # (the Qwen3 recipe's matrices: its weights of 2+ dims but the embedding; a test of this recipe, not a shared one)
    matrices = {n: p for n, p in model.named_parameters() if p.dim() >= 2 and n != "embed_tokens.weight"}
    assert {n: counter.casts.get(p.untyped_storage().data_ptr()) for n, p in matrices.items()} == \
        {n: 2 for n in matrices}
