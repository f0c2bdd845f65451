"""The 4-D device mesh (pp, dp, cp, ep), built from torchrun's environment (rank order, world size 1: AGENTS.md's
design); nccl on GPU, gloo on CPU. A group of None means "nothing to reduce".
"""

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "cp", "ep")


def resolve_layout(world: int, pp: int = 1, dp: int = -1, cp: int = 1, ep: int = 1) -> tuple[int, int, int, int]:
    """Check a (pp, dp, cp, ep) layout against the world size; dp=-1 means 'whatever is left'."""
    for name, size in (("pp", pp), ("cp", cp), ("ep", ep)):
        if size < 1:
            raise ValueError(f"--{name} must be >= 1, got {size}")
    if dp == -1:
        if world % (pp * cp * ep):
            raise ValueError(
                f"world size {world} is not divisible by pp*cp*ep = {pp}*{cp}*{ep} = {pp * cp * ep}; "
                f"launch a multiple of {pp * cp * ep} ranks or change --pp/--cp/--ep"
            )
        dp = world // (pp * cp * ep)
    if dp < 1:
        raise ValueError(f"--dp must be >= 1 or -1 (auto), got {dp}")
    if pp * dp * cp * ep != world:
        raise ValueError(
            f"mesh pp*dp*cp*ep = {pp}*{dp}*{cp}*{ep} = {pp * dp * cp * ep} ranks, but the world size is {world}; "
            f"make the product equal the number of launched processes (or pass --dp -1 to infer dp)"
        )
    return pp, dp, cp, ep


@dataclass
class Mesh:
    pp: int
    dp: int
    cp: int
    ep: int
    rank: int
    world: int
    device: torch.device
    device_mesh: DeviceMesh | None  # None when world == 1

    def coord(self, dim: str) -> int:
        """This rank's index along one mesh dimension."""
        return 0 if self.device_mesh is None else self.device_mesh.get_local_rank(dim)

    def group(self, *dims: str):
        """Process group spanning the given dims (None when they hold one rank: nothing to communicate)."""
        if math.prod(getattr(self, d) for d in dims) == 1:
            return None
        if len(dims) == 1:
            return self.device_mesh.get_group(dims[0])
        return self.device_mesh[dims]._flatten("_".join(dims)).get_group()

    def replica_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of (dp, cp, ep) that replicates this stage's dense parameters, for DTensor checkpoints (None
        at world size 1); routed experts are checkpointed per expert (core/fsdp.py:expert_checkpoint_entries)."""
        if self.device_mesh is None:
            return None
        return self.device_mesh["dp", "cp", "ep"]._flatten("dp_cp_ep")

    def first_replica(self, experts: bool) -> bool:
        """Whether this rank is the first of those replicating its dense (over dp, cp, ep) or expert (over dp, cp)
        parameters: the one that writes them in an export."""
        return self.coord("dp") == self.coord("cp") == 0 and (experts or self.coord("ep") == 0)

    @property
    def data_rank(self) -> int:
        """Index of this rank's slice of the global batch: every (dp, ep) coordinate reads its own."""
        return self.coord("dp") * self.ep + self.coord("ep")

    @property
    def data_world(self) -> int:
        return self.dp * self.ep

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def build_mesh(pp: int = 1, dp: int = -1, cp: int = 1, ep: int = 1, device: str = "auto",
               timeout_s: float | None = None) -> Mesh:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).
    timeout_s: how long a collective may wait before it fails (None: torch's default)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    pp, dp, cp, ep = resolve_layout(world, pp, dp, cp, ep)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no GPU is visible; use --device cpu")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    device_mesh = None
    if world > 1:
        if not dist.is_initialized():
            # torchrun keeps one store across restarts: a per-attempt prefix keeps a restarted rank from reading the
            # dead ranks' addresses
            store, _, _ = next(dist.rendezvous("env://"))
            store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None,
                                    timeout=None if timeout_s is None else timedelta(seconds=timeout_s), store=store,
                                    rank=rank, world_size=world)
        device_mesh = init_device_mesh(dev.type, (pp, dp, cp, ep), mesh_dim_names=DIMS)
    return Mesh(pp=pp, dp=dp, cp=cp, ep=ep, rank=rank, world=world, device=dev, device_mesh=device_mesh)


def destroy_mesh() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
