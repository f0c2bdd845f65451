"""Distributed training checkpoints with torch.distributed.checkpoint (DCP).

Layout: <dir>/step_00000100/ holds one DCP checkpoint (model, optimizer, scheduler, data position, RNG of
every rank, step). It is written as step_00000100.tmp/ and renamed only after every rank has finished, so
a crash during a save leaves the previous step_* folder as the newest complete one; a leftover .tmp folder
is ignored and overwritten. The model and optimizer state comes from `ShardedAdamW.checkpoint_state`:
tensors named by parameter, sharded ones as DTensors with their global shapes, so DCP reshards a checkpoint
onto another (dp, ep) layout at load.
"""

import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

STEP_DIR = re.compile(r"^step_(\d{8})$")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _dcp(fn, state, path):
    """dcp.save / dcp.load; without a process group (world size 1) DCP runs in-process, which is intended
    here, so its warning about that is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def complete_checkpoints(ckpt_dir) -> list[Path]:
    """Finished checkpoints (renamed, with DCP's .metadata), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


def save_checkpoint(ckpt_dir, step: int, state: dict, extra: dict, rank: int, keep: int = 2) -> Path:
    """Collective: every rank calls it. `state` holds model and optimizer tensors; `extra` small picklable
    state shared by all ranks (scheduler, data position); each rank's RNG goes under its own key. Keeps the
    newest `keep` checkpoints."""
    ckpt_dir = Path(ckpt_dir)
    final, tmp = ckpt_dir / f"step_{step:08d}", ckpt_dir / f"step_{step:08d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    _barrier()
    _dcp(dcp.save, {**state, "step": step, **extra, f"rng_rank{rank}": _rng_state()}, tmp)
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def resolve_resume(resume: str, ckpt_dir) -> Path | None:
    """'' -> None (fresh start); 'auto' -> newest complete checkpoint in ckpt_dir or None; else a path."""
    if not resume:
        return None
    if resume == "auto":
        found = complete_checkpoints(ckpt_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"--resume {path}: no DCP checkpoint there (missing {path / '.metadata'}); "
                                f"pass a step_* folder or 'auto'")
    return path


def load_checkpoint(path, state: dict, extra: dict, rank: int) -> dict:
    """Collective. Fills the tensors of `state` in place and returns it updated with `extra` (same keys as at
    save) and 'step' from the checkpoint. Restores this rank's RNG when the checkpoint has it."""
    path = Path(path)
    state = {**state, "step": 0, **extra}
    reader = dcp.FileSystemReader(path)
    rng_key = f"rng_rank{rank}"
    has_rng = any(k.startswith(rng_key + ".") for k in reader.read_metadata().state_dict_metadata)
    if has_rng:
        state[rng_key] = _rng_state()
    try:
        _dcp(dcp.load, state, path)
    except Exception as e:  # DCP raises CheckpointException wrapping per-rank errors
        raise ValueError(f"checkpoint {path} could not be loaded into this model/optimizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); was it written with the same config?") from e
    if has_rng:
        torch.set_rng_state(state[rng_key]["cpu"])
        if "cuda" in state[rng_key] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state[rng_key]["cuda"])
    return state
