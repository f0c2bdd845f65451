"""What DualPipeV (core/pipeline.py) really runs, recorded on the MoE stand-in of tests/test_pipeline.py at pp=2 x ep=2
(one gloo run, 4 ranks):
  - pp rank 0 returns exactly one loss per micro-batch, equal to one process's (training and forward-only), and
    the gradients equal one process's;
  - the actions each rank executes (forwards, full backwards, input-only backwards, overlapped pairs, and which
    chunk's queued weight gradients each W step runs, seen at the expert GEMM's weight-gradient queue) are, action
    for action, torch.distributed.pipelining's ScheduleDualPipeV order, I/W split included;
  - inside every overlapped F&B step, the forward and backward compute steps alternate and each all-to-all one
    chunk starts is waited on only after a compute step of the other chunk (the transfer is hidden).
Recording is done here by wrapping the engine's and core/moe.py's functions, not by hooks in core."""

import torch

from core import moe
from core.mesh import build_mesh, destroy_mesh
from core.pipeline import DualPipeV, split_layers
from tests.multiproc import run_ranks
from tests.test_pipeline import LAYERS, MB, H, S, ToyModel, ToyStage, batches, check, check_losses, reference
from tools.pipeline_timeline import torch_schedule_order

PP, EP, NUM_MICRO = 2, 2, 6


class RecordingDualPipeV(DualPipeV):
    """DualPipeV that logs its actions (`actions`, torch's notation) and, in `events`, every compute step of a chunk
    and every all-to-all start and wait with the chunk it belongs to ("F0.3", "B1.1")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.actions, self.events, self.current = [], [], None

    def _recorded(self, name, steps):
        """The chunk's generator, naming the chunk for the events its next step logs."""
        while True:
            self.current = name
            self.events.append(("compute", name))
            if next(steps, StopIteration) is StopIteration:
                return
            yield

    def _start_forward(self, phase):
        chunk, steps = super()._start_forward(phase)
        self.actions[-1].append(f"F{phase}.{chunk}")
        return chunk, self._recorded(f"F{phase}.{chunk}", steps)

    def _start_backward(self, phase):
        chunk, steps = super()._start_backward(phase)
        self.actions[-1].append(f"B{phase}.{chunk}")
        return chunk, self._recorded(f"B{phase}.{chunk}", steps)

    def _action(self, method, *args):
        self.actions.append([])
        self.events.append(("begin", len(self.actions) - 1))
        method(*args)
        self.events.append(("end", len(self.actions) - 1))

    def _forward_compute(self, *args):
        self._action(super()._forward_compute, *args)

    def _backward_compute(self, *args):
        self._action(super()._backward_compute, *args)

    def _forward_backward_compute(self, *args):
        self._action(super()._forward_backward_compute, *args)

    def _weight_compute(self):
        self._action(super()._weight_compute)


def record_communication(engine):
    """Log all-to-all starts and waits (forward: dispatch/combine; backward: their reverse) as engine events, and
    tag each queued weight gradient with the backward chunk that queued it; a W step logs the tags it runs."""
    log = lambda kind: engine.events.append((kind, engine.current))
    for cls, fwd_kind, bwd_kind in ((moe._StartAllToAll, "start", "wait"), (moe._WaitAllToAll, "wait", "start")):
        def wrap(fn, kind):
            return staticmethod(lambda ctx, *a: (log(kind), fn(ctx, *a))[1])
        cls.forward, cls.backward = wrap(cls.forward, fwd_kind), wrap(cls.backward, bwd_kind)
    queue, put, pop = moe.weight_grads, moe.weight_grads.put, moe.weight_grads.pop

    def tagged_put(fn):
        fn.chunk = engine.current
        engine.events.append(("queued", engine.current))
        put(fn)

    def tagged_pop():
        engine.actions[-1] += sorted({"W" + fn.chunk[1:] for fn in (queue.chunks[0] if queue.chunks else [])})
        pop()

    queue.put, queue.pop = tagged_put, tagged_pop


def schedule_worker():
    mesh = build_mesh(pp=PP, ep=EP, dp=1)
    r, ep_rank = mesh.coord("pp"), mesh.coord("ep")
    model, ids = ToyModel(mesh.group("ep"), ep_rank, EP), batches(NUM_MICRO)
    layers = split_layers(LAYERS, PP)
    stages = [ToyStage(model, layers[s], s == 0, s == 2 * PP - 1, ids, ids.numel()) for s in (r, 2 * PP - 1 - r)]
    step = mesh.world // PP
    engine = RecordingDualPipeV(stages, r, PP, mesh.rank - step if r > 0 else None,
                                mesh.rank + step if r < PP - 1 else None, mesh.group("pp"),
                                [((MB, S, H), torch.float32)], torch.device("cpu"))
    record_communication(engine)
    losses = engine.run(NUM_MICRO)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    actions, events = engine.actions, engine.events
    engine.actions, engine.events = [], []
    with torch.no_grad():
        forward_only = engine.run(NUM_MICRO, forward_only=True)
    destroy_mesh()
    return r, ep_rank, losses, forward_only, grads, actions, events


def action_names(actions, events):
    """torch's notation for each recorded action: a backward that queued weight gradients is input-only (I), a W
    step is named by the chunk whose gradients it ran."""
    queued = {name for kind, name in events if kind == "queued"}
    names = []
    for parts in actions:
        if not parts:  # a W step with nothing queued, or an action that did no compute
            continue
        if len(parts) == 1 and parts[0].startswith("B") and parts[0] in queued:
            names.append("I" + parts[0][1:])
        else:
            names.append("&".join(parts))
    return names


def overlapped_steps(actions, events):
    """The events of every F&B action."""
    steps, current = [], None
    for kind, value in events:
        if kind == "begin":
            current = [] if len(actions[value]) == 2 and actions[value][0][0] == "F" else None
        elif kind == "end":
            if current is not None:
                steps.append(current)
            current = None
        elif current is not None:
            current.append((kind, value))
    return steps


def assert_alternates(step):
    """Compute steps alternate F, B, F, B... until one chunk is done, and while both run, every transfer a chunk
    starts is waited on after at least one compute step of the other chunk."""
    computes = [name for kind, name in step if kind == "compute"]
    f_name, b_name = computes[0], computes[1]
    assert f_name[0] == "F" and b_name[0] == "B", computes
    n = min(computes.count(f_name), computes.count(b_name))
    assert computes[:2 * n] == [f_name, b_name] * n, computes
    assert n >= 3, computes  # each chunk has several all-to-alls to hide
    last_compute = {name: i for i, (kind, name) in enumerate(step) if kind == "compute"}
    in_flight = {f_name: [], b_name: []}  # per chunk: for each open transfer, whether the other chunk computed since
    hidden = 0
    for i, (kind, name) in enumerate(step):
        other = b_name if name == f_name else f_name
        if kind == "start":
            in_flight[name].append(False)
        elif kind == "wait":
            computed_meanwhile = in_flight[name].pop(0)
            assert computed_meanwhile or i > last_compute[other], (name, step)  # the other chunk was still running
            hidden += computed_meanwhile
        elif kind == "compute":
            in_flight[other] = [True] * len(in_flight[other])
    assert hidden >= 4 and not any(in_flight.values()), step


def test_dualpipev_runs_what_the_schedule_defines():
    results = run_ranks(PP * EP, schedule_worker)
    check_losses([(forward_only, r) for r, _, _, forward_only, *_ in results], reference(NUM_MICRO)[0], rtol=1e-5)
    check([(losses, grads, 0, [], ep_rank, r) for r, ep_rank, losses, _, grads, _, _ in results], NUM_MICRO, EP)
    torch_order = torch_schedule_order(PP, NUM_MICRO)
    for r, _, _, _, _, actions, events in results:
        assert action_names(actions, events) == torch_order[r], (r, action_names(actions, events), torch_order[r])
        steps = overlapped_steps(actions, events)
        assert len(steps) == sum("&" in a for a in torch_order[r]) > 0
        for step in steps:
            assert_alternates(step)
