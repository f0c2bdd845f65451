"""tests/multiproc.py: a deadlocked group fails within the timeout, with every rank's stack in the error."""

import time

import pytest
import torch.distributed as dist

from core.mesh import build_mesh, destroy_mesh
from tests.multiproc import run_ranks


def rank1_sleeps_while_rank0_waits_in_a_barrier():
    mesh = build_mesh(dp=2)
    if mesh.rank == 0:
        dist.barrier()  # rank 1 never arrives: gloo would wait 30 minutes
    else:
        time.sleep(600)
    destroy_mesh()


def ready():
    return True


def test_deadlock_times_out_with_the_ranks_stacks():
    run_ranks(2, ready)  # the forkserver started and warm: the deadline below counts the ranks' work, not imports
    start = time.time()
    with pytest.raises(TimeoutError) as err:
        run_ranks(2, rank1_sleeps_while_rank0_waits_in_a_barrier, timeout=12)
    assert time.time() - start < 300  # 12 s + the stack grace + a fork (a busy machine adds), not gloo's 30 minutes
    message = str(err.value)
    rank0, rank1 = message.split("---- rank 1")
    assert "did not finish in 12 s" in message
    assert "in barrier" in rank0 and "rank1_sleeps_while_rank0_waits_in_a_barrier" in rank0
    assert "in barrier" not in rank1 and "rank1_sleeps_while_rank0_waits_in_a_barrier" in rank1  # in its sleep
