"""Training checkpoints with torch.distributed.checkpoint (DCP): step_00000100/ holds model, optimizer, scheduler,
data position, each rank's RNG and step, written as step_00000100.tmp/ (maybe in the background) and renamed once every
rank is done. A damaged one (check_files): README "Running on a cluster". An empty --resume means auto after a torchrun
restart, else it refuses a folder holding checkpoints. Loading unpickles only DCP metadata classes, torch.Size, dtypes.
"""

import io
import math
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from core.reliability import inject_fault

STEP_DIR = re.compile(r"^step_(\d{8})$")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # also for a background save's thread


def _dcp(fn, state, path, **kwargs):
    """dcp.save / dcp.load, in-process at world size 1 as intended (muted here too: a caller may reset the filters)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, checkpoint_id=path, no_dist=not dist.is_initialized(), **kwargs)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: allow only the classes DCP writes into it (no code from a checkpoint)."""

    ALLOWED = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module.startswith("torch.distributed.checkpoint.") or (module, name) in self.ALLOWED
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Non-tensor values with weights_only=True (DCP's default unpickles them in full)."""
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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
    """Blocking collective save (`state`: tensors, `extra`: small picklable shared state); keeps the newest `keep`."""
    checkpointer = Checkpointer(ckpt_dir, rank, keep, asynchronous=False)
    checkpointer.save(step, state, extra)
    return checkpointer.complete()


class Checkpointer:
    """Writes checkpoints one at a time, blocking or in the background (`save` stages the state in host memory via DCP's
    async_save; a thread writes it, gathering results over its own gloo group). The folder is step_N.tmp/ until
    `complete` (collective): after every rank's write, rank 0 renames it to step_N/ and prunes to the newest `keep`.
    train.py calls `complete` once no rank is still writing (StopRequest.agree), before the next save and at the end."""

    def __init__(self, ckpt_dir, rank: int, keep: int = 2, asynchronous: bool = False):
        self.ckpt_dir, self.rank, self.keep, self.asynchronous = Path(ckpt_dir), rank, keep, asynchronous
        self.group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        self.pending = None  # (step, the background write's future or None when written)

    def save(self, step: int, state: dict, extra: dict) -> None:
        if self.pending is not None:
            self.complete()
        tmp = self.ckpt_dir / f"step_{step:08d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        _barrier()
        state = {**state, "step": step, **extra, f"rng_rank{self.rank}": _rng_state()}
        if self.asynchronous:
            future = _dcp(dcp.async_save, state, tmp, process_group=self.group)
            self.pending = (step, getattr(future, "upload_completion", future))
        else:
            _dcp(dcp.save, state, tmp)
            self.pending = (step, None)

    def writing(self) -> bool:
        """This rank's background write still runs."""
        return self.pending is not None and self.pending[1] is not None and not self.pending[1].done()

    def complete(self) -> Path | None:
        """Collective: wait for this rank's write, then make the checkpoint final (None: nothing pending)."""
        if self.pending is None:
            return None
        step, future = self.pending
        self.pending = None
        if future is not None:
            future.result()  # raises what failed in the background
        inject_fault("kill-in-save", step)
        _barrier()
        final = self.ckpt_dir / f"step_{step:08d}"
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(self.ckpt_dir / f"step_{step:08d}.tmp", final)
            for old in complete_checkpoints(self.ckpt_dir)[:-self.keep] if self.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final


def resume_candidates(resume: str, ckpt_dir) -> list[Path]:
    """Checkpoints to try, in order (empty: fresh start). '' -> none, or after a torchrun restart the same as
    'auto'; 'auto' -> the complete ones in ckpt_dir, newest first; else that one folder."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    found = complete_checkpoints(ckpt_dir)[::-1]
    if resume == "auto" or (not resume and restarted):
        return found
    if not resume:
        if found:
            raise ValueError(f"{ckpt_dir} already holds checkpoints of an earlier run (newest {found[0].name}); "
                             f"pass --resume auto to continue it, or another --out (or delete the folder) to start over")
        return []
    path = Path(resume)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"--resume {path}: no DCP checkpoint there (missing {path / '.metadata'}); "
                                f"pass a step_* folder or 'auto'")
    return [path]


def resolve_resume(resume: str, ckpt_dir) -> Path | None:
    """The checkpoint a run starts from (None: fresh start); see resume_candidates."""
    found = resume_candidates(resume, ckpt_dir)
    return found[0] if found else None


def load_checkpoint(path, state: dict, extra: dict, rank: int) -> dict:
    """Collective: fills `state`'s tensors in place, returns it with `extra` (keys as saved), 'step'; restores RNG."""
    path = Path(path)
    state = {**state, "step": 0, **extra}
    try:
        metadata = _SafeReader(path).read_metadata()
        keys = metadata.state_dict_metadata
    except Exception as e:  # a truncated or foreign .metadata file
        raise ValueError(f"checkpoint {path} is corrupt: its .metadata cannot be read ({type(e).__name__}); "
                         f"resume from another step_* folder") from e
    check_files(path, metadata)
    reshaped = _reshape_targets(state, keys)
    rng_key = f"rng_rank{rank}"
    has_rng = any(k.startswith(rng_key + ".") for k in keys)
    if has_rng:
        state[rng_key] = _rng_state()
    try:
        _dcp(dcp.load, state, path, storage_reader=_SafeReader(path), planner=_SafePlanner())
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps per-rank errors
        raise ValueError(f"checkpoint {path} could not be loaded into this model/optimizer ({_first_error(e)}); "
                         f"was it written with the same config and --optimizer, and is it complete?") from e
    for target, saved_shaped in reshaped:  # (a collective per tensor when sharded: same order on every rank)
        whole = saved_shaped.full_tensor() if isinstance(saved_shaped, DTensor) else saved_shaped
        whole = whole.reshape(target.shape)
        if isinstance(target, DTensor):
            shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
            whole = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            target = target.to_local()
        target.copy_(whole)
    if has_rng:
        torch.set_rng_state(state[rng_key]["cpu"])
        if "cuda" in state[rng_key] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state[rng_key]["cuda"])
    return state


def check_files(path: Path, metadata) -> None:
    """Raise (naming the file) if a shard the .metadata names is missing or truncated, before any tensor is read."""
    needed = {}  # file -> bytes the metadata's entries reach
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint {path} is incomplete: its shard {file} is missing; "
                             f"resume from another step_* folder")
        if file.stat().st_size < size:
            raise ValueError(f"checkpoint {path} is damaged: its shard {file} has {file.stat().st_size} bytes, "
                             f"{size} expected (truncated); resume from another step_* folder")


def _reshape_targets(state: dict, keys: dict, prefix: str = "") -> list:
    """Where the checkpoint has a tensor of another shape but as many elements (the flat Adam moments of the ZeRO-1
    engine this repository ran before FSDP2, tests/data/zero1_checkpoints), swap in one of the saved shape (Shard(0)
    over the target's mesh) -> [(target, swapped)]."""
    found = []
    for k, v in state.items():
        meta = keys.get(prefix + k)
        if isinstance(v, dict):
            found += _reshape_targets(v, keys, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor) and meta is not None and hasattr(meta, "size") and \
                tuple(meta.size) != tuple(v.shape) and math.prod(meta.size) == v.numel():
            if isinstance(v, DTensor):
                placements = [Shard(0)] + [Replicate()] * (v.device_mesh.ndim - 1)
                local, _ = compute_local_shape_and_global_offset(meta.size, v.device_mesh, placements)
                state[k] = DTensor.from_local(torch.empty(local, dtype=v.dtype, device=v.device), v.device_mesh,
                                              placements, run_check=False, shape=meta.size,
                                              stride=torch.empty(meta.size, device="meta").stride())
            else:
                state[k] = v.new_empty(meta.size)
            found.append((v, state[k]))
    return found


def _first_error(e: Exception) -> str:
    """The root cause inside DCP's CheckpointException (a dict of per-rank failures) in one line."""
    failures = getattr(e, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    lines = [line for line in str(e).splitlines() if line.strip()]
    return type(e).__name__ + (f": {lines[-1][:300]}" if lines else " (the file is truncated or empty)")
