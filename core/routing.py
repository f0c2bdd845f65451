"""Routing statistics and traces from what a router hands core (AGENTS.md's router contract): core/pipeline.py's step
(1) and core/moe.py:moe_forward (the layer whose bound `routed_experts` it runs) call `routing.record`, so any recipe
is counted and traced with no model edit; a router may pass its probabilities to `routing.note_entropy` in step (1)
(they count for the layer recorded next). Only train.py's steps count (begin .. take), only model.layers' MoE layers
(no MTP layer). A layer runs its micro-batches in order (train.py's loop, DualPipeV's chunks): its n-th record is
micro-batch n. The trace file's arrays: README's "Routing" section. Legend: L MoE layers of the model, T tokens of a
micro-batch on this rank, k slots, N tokens of the global batch, E router choices, C = 4 + k integers per token."""

import os
from collections import deque
from pathlib import Path

import numpy as np
import torch

from core.context import cp_positions

DEAD_WINDOW = 25  # steps: an expert with no token in all of them is dead (train.py's collapse check's window)


class RoutingStats:
    rows, counts_L4, records, entropy = {}, None, None, None  # (none counted before `watch` and `begin`)

    def watch(self, model, cfg, mesh, args) -> None:
        """Count model's MoE layers from now on (train.py, once before its loop); traces go to <out>/routing_trace."""
        self.moe_ids = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.rows = {model.layers[str(i)]: row for row, i in enumerate(self.moe_ids) if str(i) in model.layers}
        self.num_experts, self.mesh, self.args = cfg.num_experts, mesh, args
        self.had_empty, self.seen = False, deque(maxlen=DEAD_WINDOW)  # seen: [L, E] per step, experts with a token
        self.counts_L4 = self.records = None  # (a step an exception left running counts no more)

    def begin(self, step: int, input_ids: torch.Tensor, positions: list) -> None:
        """Count step `step` (traced: keep its records); this rank's input_ids [local batch, S] and rope positions
        [micro_batch, S] per micro-batch (train.py's rank_batch)."""
        every = self.args.routing_trace  # counts_L4: slots, empty slots, entropy sum, tokens with an entropy
        self.counts_L4 = torch.zeros(len(self.moe_ids), 4, device=input_ids.device)
        self.records = [] if every and step % every == 0 else None
        self.step, self.input_ids, self.positions = step, input_ids, positions

    def note_entropy(self, probs_TE: torch.Tensor) -> None:
        if self.counts_L4 is not None:
            p_TE = probs_TE.detach().float()
            self.entropy = (-(p_TE * p_TE.clamp(min=1e-30).log()).sum(), p_TE.shape[0])

    def record(self, layer, ids_Tk: torch.Tensor, weights_Tk: torch.Tensor) -> None:
        row = self.rows.get(layer) if self.counts_L4 is not None else None
        (entropy, measured), self.entropy = self.entropy or (0, 0), None
        if row is None:
            return
        self.counts_L4[row, 0] += ids_Tk.numel()  # (scalar adds: no host sync on a GPU)
        self.counts_L4[row, 1] += (ids_Tk < 0).sum()
        self.counts_L4[row, 2] += entropy
        self.counts_L4[row, 3] += measured
        if self.records is not None:
            self.records.append((row, ids_Tk.detach().clamp(min=-1).short(), weights_Tk.detach().float()))

    def take(self) -> dict:
        """The step's statistics for reduce_stats (name -> (tensor, how)); ends the step. Traced: each token's C int32
        (layer row, index in the global batch, rope position, token id, expert ids) and k weights, gathered."""
        out = {"routing_counts": (self.counts_L4, "sum")}
        if self.records is not None:
            mesh, mb_rows, rows, seq = self.mesh, self.args.micro_batch, self.input_ids.shape[0], self.args.seq_len
            dev = self.input_ids.device  # (kept there: the gather is a collective of the run's backend)
            n_BS = (mesh.data_rank * rows + torch.arange(rows, device=dev)).unsqueeze(1) * seq + cp_positions(
                seq, mesh.coord("cp"), mesh.cp, dev)  # the token's index in the global batch: row x seq_len + position
            where_BS3 = torch.stack([n_BS, torch.cat(self.positions), self.input_ids], -1).int()
            k = torch.tensor(max([ids.shape[1] for _, ids, _ in self.records], default=0), device=dev)
            if mesh.world > 1:  # (k: fixed by AGENTS.md's router contract; a rank without MoE layers learns it)
                torch.distributed.all_reduce(k, op=torch.distributed.ReduceOp.MAX)
            ints, weights, done = [torch.zeros(0, 4 + int(k), dtype=torch.int32, device=dev)], \
                [torch.zeros(0, int(k), device=dev)], {}
            for row, ids_Tk, weights_Tk in self.records:
                mb = done[row] = done.get(row, -1) + 1
                where_T3 = where_BS3[mb * mb_rows:(mb + 1) * mb_rows].flatten(0, 1)
                ints.append(torch.cat([torch.full_like(where_T3[:, :1], row), where_T3, ids_Tk.int()], 1))
                weights.append(weights_Tk)
            out["trace_ints"], out["trace_weights"] = (torch.cat(ints), "gather"), (torch.cat(weights), "gather")
        self.counts_L4 = self.records = self.input_ids = self.positions = None
        return out

    def step_done(self, stats: dict) -> dict:
        """The step's reduced statistics (routing's own popped) -> per-MoE-layer lists for the log: dead_experts (share
        of the live choices with no token in the last DEAD_WINDOW steps), empty_slots (share of slots; once a router
        left one empty), router_entropy (mean over tokens, nats; where reported); the main rank writes a traced step."""
        slots_L, empty_L, entropy_L, measured_L = stats.pop("routing_counts").unbind(-1)
        load_LE, live_LE = stats["expert_load"], stats.get("expert_live")
        live_LE = torch.ones_like(load_LE, dtype=torch.bool) if live_LE is None else live_LE.bool()
        self.seen.append(load_LE > 0)
        dead_LE = live_LE & ~torch.stack(list(self.seen)).any(0)
        out = {"dead_experts": (dead_LE.sum(-1) / live_LE.sum(-1).clamp(min=1)).tolist()}
        self.had_empty = self.had_empty or bool(empty_L.any())
        if self.had_empty:
            out["empty_slots"] = (empty_L / slots_L.clamp(min=1)).tolist()
        if measured_L.any():
            out["router_entropy"] = (entropy_L / measured_L.clamp(min=1)).tolist()
        ints_NC, weights_Nk = stats.pop("trace_ints", None), stats.pop("trace_weights", None)
        if ints_NC is not None and self.mesh.is_main:
            self.write(ints_NC, weights_Nk)
        return out

    def write(self, ints_NC: torch.Tensor, weights_Nk: torch.Tensor) -> None:
        """The gathered rows in (layer, token) order, [L, N, ...]: every (layer, token of the global batch) once."""
        L, S, k = len(self.moe_ids), self.args.seq_len, ints_NC.shape[1] - 4
        ints_NC, weights_Nk = ints_NC.cpu(), weights_Nk.cpu()
        N = self.args.global_batch * S
        key = ints_NC[:, 0].long() * N + ints_NC[:, 1]
        order = key.argsort()
        assert torch.equal(key[order], torch.arange(L * N)), "the trace holds each (MoE layer, token) once"
        ints_NC, weights_Nk = ints_NC[order], weights_Nk[order]
        n_N, doc_position_N, token_N = ints_NC[:N, 1:4].T.numpy()
        path = Path(self.args.out) / "routing_trace" / f"step_{self.step:08d}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".tmp"), "wb") as f:
            np.savez(f, expert_ids=ints_NC[:, 4:].short().view(L, N, k).numpy(), weights=weights_Nk.view(L, N, k)
                     .numpy(), row=n_N // S, position=n_N % S, doc_position=doc_position_N, token_ids=token_N,
                     layer=np.array(self.moe_ids, dtype=np.int32), step=self.step, num_experts=self.num_experts)
        os.replace(path.with_suffix(".tmp"), path)


routing = RoutingStats()
