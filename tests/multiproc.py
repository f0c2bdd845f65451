"""Run a function on N CPU ranks with the gloo backend, the way torchrun would set them up.

A deadlock fails fast: every call has a timeout (TIMEOUT_S, or MULTIPROC_TIMEOUT_S in the environment). At
the deadline each rank writes the Python stacks of all its threads (faulthandler, which also fires while the
rank is blocked inside a gloo collective), the parent kills the ranks and raises TimeoutError with the stacks.

No port races: the parent hosts the rendezvous store itself on a port the OS picks while binding it (port 0), and
the ranks join it as clients (TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent). Picking a free port first
and letting rank 0 bind it later failed with EADDRINUSE when test processes ran side by side."""

import faulthandler
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


def _worker(rank: int, world: int, port: int, out_dir: str, deadline: float, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    with open(os.path.join(out_dir, f"rank{rank}.stacks"), "w") as stacks:
        faulthandler.dump_traceback_later(max(0.1, deadline - time.time()), file=stacks)
        result = fn(*args)
        faulthandler.cancel_dump_traceback_later()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(world: int, fn, *args, timeout: float | None = None) -> list:
    """fn(*args) on every rank (a module-level function); returns the ranks' return values in rank order.
    Raises TimeoutError with every rank's stacks if the ranks have not all finished after `timeout` seconds."""
    timeout = TIMEOUT_S if timeout is None else timeout
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory() as out_dir:
        deadline = time.time() + timeout  # the ranks dump their stacks then (wall clock: shared by the processes)
        context = mp.start_processes(_worker, args=(world, store.port, out_dir, deadline, fn, args), nprocs=world,
                                     join=False, start_method="spawn")
        while not context.join(timeout=max(0.0, deadline + _STACKS_GRACE_S - time.time())):  # raises if a rank failed
            if time.time() < deadline + _STACKS_GRACE_S:
                continue
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            stacks = []
            for r in range(world):
                path = os.path.join(out_dir, f"rank{r}.stacks")
                text = open(path).read() if os.path.exists(path) else "(none: the rank had not started fn)\n"
                stacks.append(f"---- rank {r} (exit code {context.processes[r].exitcode}):\n{text}")
            raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s (a deadlock?); "
                               f"the ranks' stacks at the deadline:\n" + "".join(stacks))
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]
