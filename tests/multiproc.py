"""Run a function on N CPU ranks with the gloo backend, the way torchrun would set them up.

A deadlock fails fast: every call has a timeout (TIMEOUT_S, or MULTIPROC_TIMEOUT_S in the environment). At
the deadline each rank writes the Python stacks of all its threads (faulthandler, which also fires while the
rank is blocked inside a gloo collective), the parent kills the ranks and raises TimeoutError with the stacks.

No port races: the parent hosts the rendezvous store itself on a port the OS picks while binding it (port 0), and
the ranks join it as clients (TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent). Picking a free port first
and letting rank 0 bind it later failed with EADDRINUSE when test processes ran side by side.

No fresh import per rank: the ranks are forked from a forkserver that imported torch and the function's module
once (multiprocessing's "forkserver"; it has run no torch op, so no thread pool is forked), instead of spawned
processes that each import torch again (~5 s of CPU per rank on a small machine). Each rank still starts as a
spawned one would: in the caller's environment, working directory and sys.path of the moment, writing to the
caller's file descriptors 1 and 2 of the moment (a log they are redirected to, pytest's capture). `start_ranks` returns at once, so the caller can work
(or start another group) while the ranks run; `run_ranks` waits."""

import faulthandler
import multiprocessing
import multiprocessing.reduction
import os
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = float(os.environ.get("MULTIPROC_TIMEOUT_S", 300))
_STACKS_GRACE_S = 5  # the parent waits this long after the ranks' deadline for their stack dumps
# what a training rank imports on first use, imported once by the forkserver instead of by every rank (~0.6-1 s of
# CPU per rank: torch._dynamo with sympy, which FSDP2 and DTensor reach; DCP; TensorBoard's writer); none starts a
# thread or runs a torch op
PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.utils.tensorboard")


@contextmanager
def one_thread():
    """The block runs with one intra-op thread, as every spawned rank does (_worker). A one-process reference that a
    layout must equal bit for bit runs under it: ATen splits some reductions by thread count, so the same ops on
    another thread count can round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _Fd:
    """A file descriptor of the caller that the rank receives as its own (passed by the forkserver)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while the rank starts: the fd is sent along
        return _inherited, (multiprocessing.reduction.DupFd(self.fd),)


def _inherited(dup) -> int:
    return dup.detach()


def _worker(rank: int, world: int, port: int, out_dir: str, deadline: float, env: dict, stdio, fn, args):
    for fd, theirs in zip((1, 2), stdio):
        os.dup2(theirs, fd)
        os.close(theirs)
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    with open(os.path.join(out_dir, f"rank{rank}.stacks"), "w") as stacks:
        faulthandler.dump_traceback_later(max(0.1, deadline - time.time()), file=stacks)
        result = fn(*args)
        faulthandler.cancel_dump_traceback_later()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


class Ranks:
    """A running group of ranks (start_ranks); join() waits for them and returns their results."""

    def __init__(self, world: int, fn, args, timeout: float):
        self.world, self.fn, self.timeout = world, fn, timeout
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout))
        self.out_dir = tempfile.TemporaryDirectory()
        self.deadline = time.time() + timeout  # the ranks dump their stacks then (wall clock: shared by the processes)
        multiprocessing.set_forkserver_preload(["tests.multiproc", *PRELOAD, fn.__module__])  # (read as it starts)
        self.context = mp.start_processes(_worker, nprocs=world, join=False, start_method="forkserver", args=(
            world, self.store.port, self.out_dir.name, self.deadline, dict(os.environ), (_Fd(1), _Fd(2)), fn, args))

    def join(self) -> list:
        """The ranks' return values in rank order. Raises TimeoutError with every rank's stacks if they have not all
        finished by the deadline."""
        with self.out_dir as out_dir:
            context, world = self.context, self.world
            while not context.join(timeout=max(0.0, self.deadline + _STACKS_GRACE_S - time.time())):  # raises if a rank failed
                if time.time() < self.deadline + _STACKS_GRACE_S:
                    continue
                self.kill()
                stacks = []
                for r in range(world):
                    path = os.path.join(out_dir, f"rank{r}.stacks")
                    text = open(path).read() if os.path.exists(path) else "(none: the rank had not started fn)\n"
                    stacks.append(f"---- rank {r} (exit code {context.processes[r].exitcode}):\n{text}")
                raise TimeoutError(f"{self.fn.__name__} on {world} ranks did not finish in {self.timeout:.0f} s (a "
                                   f"deadlock?); the ranks' stacks at the deadline:\n" + "".join(stacks))
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]


    def kill(self) -> None:
        """Stops every rank still running (the caller gave up on the group)."""
        for p in self.context.processes:
            if p.is_alive():
                p.kill()
            p.join()


def start_ranks(world: int, fn, *args, timeout: float | None = None) -> Ranks:
    """fn(*args) on every rank (a module-level function), started now; `.join()` returns the ranks' return values
    in rank order. Raises TimeoutError with every rank's stacks if the ranks have not all finished `timeout`
    seconds after the start."""
    return Ranks(world, fn, args, TIMEOUT_S if timeout is None else timeout)


def run_ranks(world: int, fn, *args, timeout: float | None = None) -> list:
    """start_ranks(...).join(): fn(*args) on every rank; the ranks' return values in rank order."""
    return start_ranks(world, fn, *args, timeout=timeout).join()
