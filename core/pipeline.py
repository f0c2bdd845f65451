"""DualPipeV (after DeepSeek's schedule): 2*pp pipeline stages in a V, one micro-batch's forward overlapped with
another's backward, delayed weight gradients (zero bubble). Layout and layer protocol: AGENTS.md (phase 0: stage r,
down; phase 1: 2*pp-1-r, back; the last rank hands stage pp-1's output on locally); a chunk: a micro-batch on a stage.

Overlap: a chunk's forward is a generator that yields right after starting an all-to-all; its backward runs autograd
segment by segment (cut at the all-to-alls), yielding after starting a reverse one; the steady phase alternates the
two, so each waits on a transfer only when it needs it. W steps run core.moe.weight_grads' queue, oldest chunk first;
a checkpoint region in a compute step lies in one segment. Memory: a tape keeps its tensors (an MoE layer's state at
the dispatch, received rows) until the chunk's backward, not the sent payloads and combined rows (freed after their
all-to-all); rank r holds <= 2pp - r chunks of stage r and r + 1 of stage 2pp-1-r (a steady forward may end before
its pair frees). `running`: the chunk whose code runs now, set whenever the engine advances a generator.
"""

import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.moe import AllToAll, DispatchPlan, release, weight_grads
from core.routing import routing


def split_layers(num_layers: int, pp: int, costs: list | None = None) -> list[list[int]]:
    """Layer ids of the 2*pp stages, the embedding and the head each counted as one layer. costs: one number per
    layer, or a recipe's flops_by_layer (a dict of FLOPs per token per layer, then one for the first stage's own
    modules and one for the last's): the contiguous split whose largest stage cost is smallest (plain numbers: the
    embedding and head each cost one average layer; equal costs: the split by count)."""
    stages = 2 * pp
    total = lambda c: sum(c.values()) if isinstance(c, dict) else c
    per_layer = None if costs is None else [total(c) for c in costs[:num_layers]]
    ends = [total(c) for c in costs[num_layers:]] if costs is not None and len(costs) == num_layers + 2 else None
    if per_layer and (ends or len(set(per_layer)) > 1) and num_layers >= stages - 2:
        return _split_by_cost(per_layer, stages, *(ends or [sum(per_layer) / num_layers] * 2))
    units = num_layers + 2
    sizes = [units // stages + (1 if 0 < s < stages - 1 and s - 1 < units % stages else 0) for s in range(stages)]
    sizes[0] -= 1
    sizes[-1] -= 1
    extra = num_layers - sum(sizes)  # remainder beyond the middle stages
    sizes[0] += extra // 2
    sizes[-1] += extra - extra // 2
    if min(sizes[1:-1], default=1) < 1 or min(sizes) < 0:
        raise ValueError(f"{num_layers} layers cannot fill 2*pp = {stages} pipeline stages (each middle stage needs "
                         f"a layer); use a smaller --pp or a model with at least {stages - 2} layers")
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [list(range(starts[s], starts[s] + sizes[s])) for s in range(stages)]


@dataclass
class Running:
    """micro_batch: index within the step (None outside any loop and in W slots, which serve several chunks);
    stage: 0..2*pp-1 (None without a pipeline); backward: its backward runs (recompute included)."""

    micro_batch: int | None = None
    stage: int | None = None
    backward: bool = False

    def set(self, micro_batch: int | None, stage: int | None = None, backward: bool = False) -> None:
        self.micro_batch, self.stage, self.backward = micro_batch, stage, backward


running = Running()


def _running_as(steps, micro_batch: int, stage: int, backward: bool):
    """The generator `steps`, with `running` set to this chunk before each step (the other one sets its own)."""
    while True:
        running.set(micro_batch, stage, backward)
        if next(steps, StopIteration) is StopIteration:
            return
        yield


def _split_by_cost(costs: list, stages: int, first: float, last: float) -> list[list[int]]:
    """The contiguous split into `stages` (middle ones hold a layer) whose largest stage cost, the end stages' own
    modules costing `first` and `last`, is smallest: dynamic programming over (stage, layers so far), ties earliest."""
    n, prefix = len(costs), list(itertools.accumulate(costs, initial=0.0))  # prefix[i]: cost of layers 0..i-1
    best = [[first + prefix[i] for i in range(n + 1)]]  # best[s][i]: layers 0..i-1 on stages 0..s
    cut = [[0] * (n + 1)]
    for s in range(1, stages):
        final = s == stages - 1
        row, row_cut = [float("inf")] * (n + 1), [0] * (n + 1)
        for i in range(n + 1):
            for j in range(i + 1 if final else i):  # a middle stage holds layers j..i-1, at least one
                load = max(best[-1][j], prefix[i] - prefix[j] + (last if final else 0.0))
                if load < row[i]:
                    row[i], row_cut[i] = load, j
        best.append(row)
        cut.append(row_cut)
    bounds, i = [n], n
    for s in range(stages - 1, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds = [0] + bounds[::-1]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]


class _Tape:
    """The forward of one chunk, cut into autograd segments so that its backward can be run piece by piece."""

    def __init__(self, record: bool):
        self.record = record
        self.segments = []  # (outputs, leaves made from them, whether the backward starts a reverse all-to-all)
        self.has_wait = False

    def cut(self, tensors: list) -> list:
        """End the current segment: later code reads leaves detached from `tensors`."""
        if not self.record:
            return list(tensors)
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        self.segments.append((list(tensors), leaves, self.has_wait))
        self.has_wait = False
        return leaves


def _forward_steps(stage, inputs: list, mb: int, tape: _Tape, out: list):
    """Generator: the chunk's forward, yielding after each all-to-all start; the stage outputs land in `out`."""
    state = stage.pre(inputs, mb)
    for layer in stage.layers:
        if not layer.moe:
            state = layer.dense(state)
            continue
        state, x_TH, ids_Tk, weights_Tk = layer.attention(state)  # (1)
        routing.record(layer, ids_Tk, weights_Tk)  # (counted in a training step, kept when traced)
        plan = DispatchPlan(ids_Tk, layer.num_experts, layer.ep_group, layer.placement,
                            getattr(layer, "recompute_dispatch", False))
        *state, x_TH, payload = tape.cut([*state, x_TH, plan.dispatch_payload(x_TH, weights_Tk)])
        dispatch = AllToAll(payload, plan.send_splits, plan.recv_splits, layer.ep_group)  # (2)
        [buffer] = tape.cut([dispatch.out])
        yield
        tape.has_wait |= dispatch.transfer is not None
        x_QX = dispatch.wait(buffer)
        if dispatch.transfer is not None:  # sent (in one process it is x_QX): no backward reads the payload
            release(payload)
        y_QH = plan.run_experts(x_QX, layer.routed_experts)  # (3)
        combine = AllToAll(y_QH, plan.recv_splits, plan.send_splits, layer.ep_group)  # (4)
        [buffer] = tape.cut([combine.out])
        yield
        tape.has_wait |= combine.transfer is not None
        state = layer.finish(state, x_TH, plan.unpermute(combine.wait(buffer)))  # (5)
        release(buffer)  # the combined rows [P, H]: unpermute keeps only its index
    out.extend(stage.post(state, mb))


def _backward_steps(tape: _Tape, outputs: list, grads: list):
    """Generator: a recorded chunk's backward, last segment first, yielding after each reverse all-to-all start."""
    segments = [(outputs, None, tape.has_wait)] + list(reversed(tape.segments))
    for i, (outs, leaves, has_wait) in enumerate(segments):
        outs_grads = zip(outs, grads if i == 0 else [leaf.grad for leaf in leaves])  # read after later segments ran
        pairs = [(o, g) for o, g in outs_grads if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if has_wait:
            yield


class DualPipeV:
    def __init__(self, stages, pp_rank: int, pp: int, prev_rank: int | None, next_rank: int | None, group,
                 p2p_specs: list[tuple[tuple[int, ...], torch.dtype]] | None, device, overlap: bool = True,
                 delay_weight_grads: bool = True):
        """stages: (stage r, stage 2*pp-1-r); prev/next_rank: the pp neighbours' global ranks; p2p_specs: None or
        (shape, dtype) of each state tensor crossing ranks (None: what stage 0 creates, _stage0_specs)."""
        self.stages, self.rank, self.pp, self.group = stages, pp_rank, pp, group
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.p2p_specs, self.device = p2p_specs, device
        self.overlap, self.delay_weight_grads = overlap, delay_weight_grads
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        self.timeline: list[tuple[str, float, float]] = []  # (op, start, end) of the last run, seconds
        self.peak_live_chunks = 0

    # -------------------------------------------------------------------------------- compute of one chunk

    def _timed(self, name: str, fn):
        start = time.perf_counter()
        fn()
        self.timeline.append((name, start - self.t0, time.perf_counter() - self.t0))

    def _start_forward(self, phase: int):
        chunk = self.f_chunk[phase]
        self.f_chunk[phase] += 1
        tape = _Tape(record=not self.forward_only)
        out = []
        self.tapes[phase].append(tape)
        self.outputs[phase].append(out)
        steps = _forward_steps(self.stages[phase], self.inputs[phase][chunk], chunk, tape, out)
        return chunk, _running_as(steps, chunk, self._stage_id(phase), backward=False)

    def _stage_id(self, phase: int) -> int:
        return self.rank if phase == 0 else 2 * self.pp - 1 - self.rank

    def _end_forward(self, phase: int, chunk: int):
        out = self.outputs[phase][chunk]
        if self.first and phase == 1:
            self.losses.append(out[0].detach())
        if self.last and phase == 0:  # the bottom of the V: stage pp-1 feeds stage pp on this rank
            self.inputs[1].append([t.detach().requires_grad_(t.requires_grad) for t in out])
        self.live += 1
        self.peak_live_chunks = max(self.peak_live_chunks, self.live)

    def _start_backward(self, phase: int):
        chunk = self.b_chunk[phase]
        self.b_chunk[phase] += 1
        outputs = self.outputs[phase][chunk]
        grads = [torch.ones_like(outputs[0])] if self.first and phase == 1 else self.output_grads[phase][chunk]
        steps = _backward_steps(self.tapes[phase][chunk], outputs, grads)
        return chunk, _running_as(steps, chunk, self._stage_id(phase), backward=True)

    def _end_backward(self, phase: int, chunk: int):
        inputs = self.inputs[phase][chunk]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        self.inputs[phase][chunk] = self.outputs[phase][chunk] = self.tapes[phase][chunk] = None  # free the chunk
        if not (self.first and phase == 1):  # the loss stage receives no gradients
            self.output_grads[phase][chunk] = None
        if self.last and phase == 1:
            self.output_grads[0].append(grads)
        else:
            self.input_grads[phase].append(grads)
        self.live -= 1

    def _forward_compute(self, phase: int):
        chunk, steps = self._start_forward(phase)
        with torch.set_grad_enabled(not self.forward_only):
            self._timed(f"F{phase}", lambda: [None for _ in steps])
        self._end_forward(phase, chunk)

    def _backward_compute(self, phase: int, zero_bubble: bool = False):
        if self.forward_only:
            return
        chunk, steps = self._start_backward(phase)
        weight_grads.enabled = zero_bubble and self.delay_weight_grads
        self._timed(f"B{phase}", lambda: [None for _ in steps])
        weight_grads.enabled = False
        if zero_bubble and self.delay_weight_grads:
            weight_grads.flush()
        self._end_backward(phase, chunk)

    def _forward_backward_compute(self, phase_f: int, phase_b: int):
        if self.forward_only or not self.overlap:
            self._forward_compute(phase_f)
            self._backward_compute(phase_b)
            return
        chunk_f, forward = self._start_forward(phase_f)
        chunk_b, backward = self._start_backward(phase_b)

        def interleave():  # one forward step, then one backward step, each up to its next all-to-all start
            running = [forward, backward]
            while running:
                for gen in list(running):
                    with torch.enable_grad():
                        if next(gen, StopIteration) is StopIteration:
                            running.remove(gen)

        self._timed(f"F{phase_f}&B{phase_b}", interleave)
        self._end_forward(phase_f, chunk_f)
        self._end_backward(phase_b, chunk_b)

    def _weight_compute(self):
        if self.forward_only or not self.delay_weight_grads:
            return
        self._commit()
        running.set(None, backward=True)  # queued weight gradients of earlier chunks: no one micro-batch
        with torch.no_grad():
            self._timed("W", weight_grads.pop)

    # ---------------------------------------------------------------------- point-to-point communication

    def _stage0_specs(self):
        """(shape, dtype) of each tensor stage 0's pre makes of micro-batch 0 (once, without gradients, on pp rank 0,
        in the caller's autocast), broadcast to the pp group: a model declares its state in one place."""
        specs = [None]
        if self.first:
            with torch.no_grad():
                specs = [[(tuple(t.shape), t.dtype) for t in self.stages[0].pre([], 0)]]
        dist.broadcast_object_list(specs, src=dist.get_global_rank(self.group, 0), group=self.group, device=self.device)
        return specs[0]

    def _buffers(self, requires_grad: bool):
        return [torch.empty(shape, dtype=dtype, device=self.device).requires_grad_(requires_grad and dtype.is_floating_point)
                for shape, dtype in self.p2p_specs]

    def _recv_forward(self, phase: int):
        if (self.first and phase == 0) or (self.last and phase == 1):
            return
        bufs = self._buffers(requires_grad=not self.forward_only)
        peer = self.prev_rank if phase == 0 else self.next_rank
        self.ops += [dist.P2POp(dist.irecv, b, peer, self.group) for b in bufs]
        self.inputs[phase].append(bufs)

    def _send_forward(self, phase: int):
        if (self.first and phase == 1) or (self.last and phase == 0):
            return
        tensors = self.outputs[phase][self.sent_f[phase]]
        self.sent_f[phase] += 1
        assert [t.dtype for t in tensors] == [d for _, d in self.p2p_specs], ("p2p_specs", [t.dtype for t in tensors])
        peer = self.next_rank if phase == 0 else self.prev_rank
        self.ops += [dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group) for t in tensors]

    def _recv_backward(self, phase: int):
        if self.forward_only or (self.first and phase == 1) or (self.last and phase == 0):
            return
        bufs = self._buffers(requires_grad=False)
        peer = self.next_rank if phase == 0 else self.prev_rank
        self.ops += [dist.P2POp(dist.irecv, b, peer, self.group) for b in bufs]
        self.output_grads[phase].append(bufs)

    def _send_backward(self, phase: int):
        if self.forward_only or (self.first and phase == 0) or (self.last and phase == 1):
            return
        grads = self.input_grads[phase][self.sent_b[phase]]
        self.input_grads[phase][self.sent_b[phase]] = None
        assert [g.dtype for g in grads] == [d for _, d in self.p2p_specs], ("p2p_specs", [g.dtype for g in grads])
        self.sent_b[phase] += 1
        peer = self.prev_rank if phase == 0 else self.next_rank
        self.ops += [dist.P2POp(dist.isend, g.contiguous(), peer, self.group) for g in grads]

    def _commit(self):
        if self.ops:
            for req in dist.batch_isend_irecv(self.ops):
                req.wait()
            self.ops = []

    # ------------------------------------------------------------------ a chunk with its communication

    def _forward(self, phase: int, recv: bool = True, send: bool = True):
        if recv:
            self._recv_forward(phase)
        self._commit()
        self._forward_compute(phase)
        if send:
            self._send_forward(phase)

    def _backward(self, phase: int, zero_bubble: bool = False, recv: bool = True, send: bool = True):
        if recv:
            self._recv_backward(phase)
        self._commit()
        self._backward_compute(phase, zero_bubble)
        if send:
            self._send_backward(phase)

    def _forward_backward(self, phase_f: int, phase_b: int, recv_f: bool = True):
        if recv_f:
            self._recv_forward(phase_f)
        self._recv_backward(phase_b)
        self._commit()
        self._forward_backward_compute(phase_f, phase_b)
        self._send_forward(phase_f)
        self._send_backward(phase_b)

    # --------------------------------------------------------------------------------------- the schedule

    def run(self, num_chunks: int, forward_only: bool = False) -> list[torch.Tensor]:
        """One pass over `num_chunks` micro-batches (collective over the pp group), gradients accumulating into .grad;
        returns the per-micro-batch losses on pp rank 0 ([] on the others)."""
        n, r = self.pp, self.rank
        if num_chunks < 2 * n:
            raise ValueError(f"DualPipeV needs at least 2*pp = {2 * n} micro-batches per step, got {num_chunks}; "
                             f"raise --global-batch or lower --micro-batch")
        self.forward_only = forward_only
        if self.p2p_specs is None:
            self.p2p_specs = self._stage0_specs()
        self.inputs = ([[] for _ in range(num_chunks)] if self.first else [], [])
        self.outputs, self.tapes, self.output_grads, self.input_grads = ([], []), ([], []), ([], []), ([], [])
        self.f_chunk, self.b_chunk, self.sent_f, self.sent_b = [0, 0], [0, 0], [0, 0], [0, 0]
        self.ops, self.losses, self.timeline, self.live, self.peak_live_chunks = [], [], [], 0, 0
        self.t0 = time.perf_counter()

        # phase 1: warm-up on the way down, forwards of stage r only
        for _ in range((n - r - 1) * 2):
            self._forward(0)

        # phase 2: forwards of both stages
        self._recv_forward(0)
        for i in range(r + 1):
            self._forward(0, recv=False, send=False)
            self._recv_forward(0)
            self._forward(1, send=not self.last or i < r)
            self._send_forward(0)

        # phase 3: backward of stage B (weight gradients delayed), its W, next forward of stage B
        for _ in range(n - r - 1):
            self._backward(1, zero_bubble=True)
            self._recv_forward(1)
            self._weight_compute()
            self._forward(1, recv=False)

        # phase 4: steady state, forward of one chunk overlapped with the backward of another
        for i in range(num_chunks - 2 * n + r + 1):
            if i == 0 and self.last:  # the bottom of the V: not overlapped, to start the way back sooner
                self._forward(0, recv=False, send=False)
                self._send_forward(1)
                self._backward(1, send=False)
                self._send_forward(0)
                self._send_backward(1)
            else:
                self._forward_backward(0, 1, recv_f=i > 0)
            self._forward_backward(1, 0)

        # phase 5: backward of stage B, then forward of stage B overlapped with backward of stage A
        for _ in range(n - r - 1):
            self._backward(1)
            self._forward_backward(1, 0)

        # phase 6: backwards of both stages; the second half delays weight gradients
        zero_bubble = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                zero_bubble = True
            self._backward(1, zero_bubble)
            if i == (r + 1) // 2 and r % 2 == 0:
                zero_bubble = True
            self._backward(0, zero_bubble)

        # phase 7: delayed weight gradients interleaved with the last backwards of stage A
        for _ in range(n - r - 1):
            self._weight_compute()
            self._backward(0, zero_bubble=True)

        # phase 8: the remaining weight gradients
        for _ in range(r + 1):
            self._weight_compute()
        self._commit()
        assert forward_only or not self.delay_weight_grads or weight_grads.empty(), "weight gradients left queued"
        running.set(None)
        return self.losses
