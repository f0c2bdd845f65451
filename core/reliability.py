"""Keeping a long run alive and honest: one-line user errors, a per-step watchdog, no bad step applied, fault injection.

- `run_main(main)`: a USER_ERRORS exception (bad input, StopRun) prints `error: <message>` once (rank 0) and exits 2, as
  torchrun's restarts do at once (`_stop_marker`); others keep their traceback: torchrun restarts, train.py resumes.
- `Watchdog`: a step, save or evaluation past its limit prints the rank, phase and collective, all stacks, and exits 3.
- `step_is_finite`: one all-reduce that tells every rank whether any rank saw a non-finite loss or gradient.
- `StopRequest`: SIGTERM / SIGUSR1 or --time-limit stop every rank at the same step boundary, to save once.
- MOE_TRAIN_FAULT (tests only): comma-separated `kind@step[:rank[:attempt]]` (rank, restart attempt default 0): `kill` /
  `kill-in-save` (SIGKILL before the optimizer step / after writing its checkpoint part), `nan` (in its first gradient),
  `hang` (sleep at step start), `sigterm` / `sigusr1` (to itself at step end), `sigterm-launcher` (SIGTERM to torchrun).
"""

import faulthandler
import linecache
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core.metrics import load_max_over_mean


class StopRun(Exception):
    """The run cannot go on (e.g. --max-bad-steps non-finite steps in a row); the message says what to do."""


USER_ERRORS = (ValueError, FileNotFoundError, StopRun)
SLOW_LIMIT_S = 900.0  # auto watchdog: the first steps (compilation, first connections), checkpoints, evaluation
WARMUP_STEPS = 3  # auto watchdog: steps measured before the limit follows the step time
PG_TIMEOUT_S = SLOW_LIMIT_S + 60  # collectives time out only after the watchdog, whose message says more
ROOT = Path(__file__).resolve().parents[1]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _stop_marker() -> Path | None:
    """Where the stopping error goes: $MOE_TRAIN_STOP_FILE (launch.sh reprints it last), else a temp file per run id."""
    if os.environ.get("MOE_TRAIN_STOP_FILE"):
        return Path(os.environ["MOE_TRAIN_STOP_FILE"])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return Path(tempfile.gettempdir()) / f"moe-train-stop-{run_id}" if run_id else None


_OWNS_PROCESS = False  # set by run_main: only then may the watchdog end the process


def run_main(main) -> None:
    """The `__main__` entry of a train.py or tool (see the module docstring)."""
    global _OWNS_PROCESS
    _OWNS_PROCESS = True
    marker = _stop_marker()
    if marker is not None and _attempt() > 0 and marker.exists():
        os._exit(2)  # stopped by bad input: restarting cannot help (rank 0 printed why)
    try:
        main()
    except USER_ERRORS as e:
        if marker is not None:  # every rank: whichever fails first, the restarts see it
            tmp = marker.with_name(f"{marker.name}.{_rank()}")
            tmp.write_text(str(e))
            os.replace(tmp, marker)
        if _rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(1.0)  # rank 0, failing the same way, prints before torchrun stops the job
        sys.stdout.flush()
        os._exit(2)  # a clean exit would wait for peers blocked in collectives


# ------------------------------------------------------------------------------------------------ faults


def _faults() -> list[tuple[str, int, int, int]]:
    out = []
    for item in filter(None, os.environ.get("MOE_TRAIN_FAULT", "").split(",")):
        kind, _, rest = item.partition("@")
        step, rank, attempt = ([int(x) for x in rest.split(":")] + [0, 0])[:3]
        out.append((kind, step, rank, attempt))
    return out


def inject_fault(kind: str, step: int, model: torch.nn.Module | None = None) -> None:
    """Raise the fault MOE_TRAIN_FAULT asks for at this point, if any (tests only)."""
    for k, s, r, a in _faults():
        if (k, s, r, a) != (kind, step, _rank(), _attempt()):
            continue
        print(f"fault injection: {kind} on rank {r} at step {s}", file=sys.stderr, flush=True)
        if kind in ("kill", "kill-in-save"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            time.sleep(3600)
        elif kind == "nan":
            g = next(p.grad for p in model.parameters() if p.grad is not None)
            (g.to_local() if isinstance(g, DTensor) else g).view(-1)[0] = float("nan")  # (FSDP2: this rank's shard)
        elif kind in ("sigterm", "sigusr1"):
            os.kill(os.getpid(), signal.SIGTERM if kind == "sigterm" else signal.SIGUSR1)
        elif kind == "sigterm-launcher":
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(2.0)  # torchrun forwards it to every rank meanwhile


# ------------------------------------------------------------------------------- preemption, time limit


class StopRequest:
    """SIGTERM or SIGUSR1 (torchrun forwards SIGTERM; Slurm's `--signal=USR1@SECONDS`, preemption, scancel) sets a flag;
    --time-limit stops once elapsed time + longest step + longest save (no save yet: limit / 10) would pass it. `agree`,
    after every step, all-reduces (max) [signal, time up, background write running]: all ranks stop together."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, time_limit_s: float = 0.0):
        self.started, self.time_limit_s = time.monotonic(), time_limit_s
        self.received, self.longest_step, self.longest_save = 0, 0.0, None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # (signal handlers live in the main thread)
            self.previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum, frame):
        self.received = signum  # acted on at the end of the step, by every rank

    def agree(self, step_time: float, writing: bool, world: int, device) -> tuple[str, bool]:
        """(why to stop now, '' to go on; whether no rank is still writing a checkpoint in the background)."""
        self.longest_step = max(self.longest_step, step_time)
        reserve = self.longest_step + (self.time_limit_s / 10 if self.longest_save is None else self.longest_save)
        time_up = self.time_limit_s > 0 and time.monotonic() - self.started + reserve >= self.time_limit_s
        flags = torch.tensor([float(self.received), float(time_up), float(writing)], device=device)
        if world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        received, time_up, writing = (int(x) for x in flags.tolist())
        why = f"{signal.Signals(received).name} received" if received else \
            f"--time-limit {self.time_limit_s / 60:g} min would pass within the next step and save" if time_up else ""
        return why, not writing

    def saved(self, seconds: float) -> None:
        """A checkpoint save blocked training this long (the time-limit reserve)."""
        self.longest_save = max(self.longest_save or 0.0, seconds)

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


# --------------------------------------------------------------------------------------------- watchdog


def _where(thread_id: int) -> str:
    """'waiting in <torch.distributed call> from <file:line function>' (or 'at <file:line function>' when the
    innermost wait is in C++, as a p2p request's) and '(pipeline phase N)' inside DualPipeV, for a thread."""
    frame, collective, ours, phase = sys._current_frames().get(thread_id), None, None, None
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if "torch/distributed" in path.replace(os.sep, "/") and name not in ("wrapper", "inner"):
            collective = name  # the outermost torch.distributed function wins (all_reduce, not its helpers)
        elif ours is None and path.startswith(str(ROOT)):  # innermost frame of this repository's code
            ours = f"{Path(path).relative_to(ROOT)}:{frame.f_lineno} {name}"
        if phase is None and name == "run" and path.endswith("pipeline.py"):
            for line in range(frame.f_lineno, 0, -1):  # the schedule's '# phase N: ...' comment above this line
                if m := re.search(r"# (phase \d+)", linecache.getline(path, line)):
                    phase = m.group(1)
                    break
        frame = frame.f_back
    where = f"waiting in {collective}" + (f" from {ours}" if ours else "") if collective else f"at {ours}"
    return where + (f" (pipeline {phase})" if phase else "")


class Watchdog:
    """Step deadline. timeout_s > 0: a fixed limit; 0: SLOW_LIMIT_S (checkpoints, evaluation, first WARMUP_STEPS steps),
    then min(SLOW_LIMIT_S, max(60 s, 10x median step time)). Only under run_main (never ends a test calling main())."""

    def __init__(self, timeout_s: float, rank: int, world: int):
        self.fixed, self.rank, self.world = timeout_s > 0, rank, world
        self.step_limit = timeout_s if self.fixed else SLOW_LIMIT_S
        self.step, self.phase, self.started, self.deadline = 0, "start-up", 0.0, math.inf
        self.step_times: list[float] = []
        self.main_thread = threading.main_thread().ident
        if _OWNS_PROCESS:
            threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def arm(self, step: int, phase: str, slow: bool = False) -> None:
        """Start the clock for `phase` of `step` (slow: a checkpoint or evaluation)."""
        limit = self.step_limit if self.fixed or not slow else SLOW_LIMIT_S
        self.step, self.phase, self.started = step, phase, time.monotonic()
        self.limit, self.deadline = limit, self.started + limit

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def step_done(self, seconds: float) -> None:
        self.deadline = math.inf
        self.step_times.append(seconds)
        if not self.fixed and len(self.step_times) >= WARMUP_STEPS:
            median = statistics.median(self.step_times[WARMUP_STEPS - 1:][-50:])
            self.step_limit = min(SLOW_LIMIT_S, max(60.0, 10 * median))

    def disarm(self) -> None:
        self.deadline = math.inf

    def _watch(self):
        while True:
            time.sleep(0.2)
            if time.monotonic() > self.deadline:
                waited = time.monotonic() - self.started
                print(f"watchdog: rank {self.rank} of {self.world} stuck {waited:.1f} s (limit {self.limit:.1f} s, "
                      f"--step-timeout) in step {self.step}, phase {self.phase}, {_where(self.main_thread)}; "
                      f"its Python stacks follow, then it exits so that torchrun restarts the job",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                time.sleep(min(5.0, self.limit / 2))  # peers waiting on this rank report too before the links drop
                os._exit(3)


# ------------------------------------------------------------------------------------ finiteness check


def grads_finite(model: torch.nn.Module) -> tuple[torch.Tensor, list[str]]:
    """(bool tensor: each local gradient finite, by fused norms; parameter names in order); FSDP2: the local shard."""
    named = [(n, p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()
             if p.grad is not None]
    if not named:
        return torch.ones((), dtype=torch.bool), []
    norms = torch.stack(torch._foreach_norm([g for _, g in named]))
    return norms.isfinite(), [n for n, _ in named]


def step_is_finite(stats: torch.Tensor, finite_P: torch.Tensor, names: list[str], grad_norm: torch.Tensor,
                   rank: int, world: int) -> tuple[torch.Tensor, list[int], list[str]]:
    """One all-reduce of (loss statistics, 'non-finite here' flag) -> (summed stats, ranks that saw a non-finite loss
    or gradient, names of parameters with non-finite gradients on any rank, gathered only then; both empty: good)."""
    flags_W = torch.zeros(world, device=stats.device)
    flags_W[rank] = float(not (bool(stats.isfinite().all()) and bool(finite_P.all())))
    both = torch.cat([stats.float(), flags_W])
    if world > 1:
        dist.all_reduce(both)
    stats, bad_ranks = both[: len(stats)], both[len(stats):].nonzero().flatten().tolist()
    if not bad_ranks and bool(torch.isfinite(grad_norm)):
        return stats, [], []
    bad_names = [n for n, ok in zip(names, finite_P.view(-1).tolist()) if not ok]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, bad_names)
        bad_names = sorted(set().union(*gathered))
    return stats, bad_ranks or list(range(world)), bad_names


def collapse_warning(step: int, load_LE, moe_layer_ids: list[int], live_LE=None, threshold: float = 2.0) -> str:
    """A log line naming layers whose expert load max/mean (load_LE [MoE layers, E], summed over recent steps) exceeds
    threshold ('' if none), among experts routable throughout (live_LE nonzero; None: all; top-k of E: worst E/k)."""
    per_layer = load_max_over_mean(load_LE, live_LE)
    bad = [f"layer {i} {x:.2f}x" for i, x in zip(moe_layer_ids, per_layer) if x > threshold]
    if not bad:
        return ""
    return (f"warning: step {step}: expert load max/mean over the last steps {', '.join(bad)} (balanced: 1.0): routing "
            f"is collapsing onto a few experts; raise --expert-bias-rate (aux-loss-free balancing) or --aux-loss-coef")
