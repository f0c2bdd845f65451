"""Run a function on N CPU ranks with the gloo backend, the way torchrun would set them up."""

import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = fn(*args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(world: int, fn, *args) -> list:
    """fn(*args) on every rank (a module-level function); returns the ranks' return values in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, _free_port(), out_dir, fn, args), nprocs=world,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]
