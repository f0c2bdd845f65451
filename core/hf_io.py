"""Hugging Face safetensors folders: read only the tensors a (partial) model needs, write a loadable folder.

One `model.safetensors` or shards listed by `model.safetensors.index.json`, read tensor by tensor through
`safe_open` (a pipeline stage or an expert shard never materialises the rest); nothing here knows about a model.
MXFP4 matrices (OCP microscaling FP4: GPT-OSS experts) decode by `dequantize_mxfp4`; FP8 e4m3 ones with a
`*_scale_inv` per block (DeepSeek-V3, Kimi K2) are dequantised by the reader itself (`dequantize_fp8_blocks`).
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_hf_config(path: str | os.PathLike) -> dict:
    """config.json of a checkpoint folder, or the file itself."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {file}; pass a checkpoint folder or its config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); re-download or re-export the config") from None


def variant_config(config: dict, recipe: str) -> dict:
    """The config.json of an export whose model departs from its transformers class (TRANSFORMERS_CLASS None):
    model_type the recipe folder (transformers' Auto classes refuse it, rather than load the base and drop the new
    tensors), base_model_type the base's, no architectures, how_to_load a one-line note; ModelConfig.from_hf reads it."""
    return {**config, "model_type": recipe, "base_model_type": config.get("model_type"), "architectures": [],
            "how_to_load": f"a variant trained by recipes/{recipe} that transformers cannot load: python -m "
                           f"tools.evaluate --hf FOLDER --recipe {recipe}, or train.py --hf-checkpoint FOLDER of "
                           f"that recipe (its model.py:load_hf_checkpoint)"}


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint folder; remembers which names were read."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._handles: dict = {}
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint folder {self.path} does not exist")
        index_file, single_file = self.path / INDEX_NAME, self.path / SINGLE_NAME
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index_file} is not a safetensors index ({e!r}); re-export the checkpoint") from None
        elif single_file.is_file():
            weight_map = {name: SINGLE_NAME for name in self._open(SINGLE_NAME).keys()}
        else:
            raise FileNotFoundError(f"checkpoint folder {self.path} has neither {INDEX_NAME} nor {SINGLE_NAME}")
        for file in sorted(set(weight_map.values())):
            if not (self.path / file).is_file():
                raise FileNotFoundError(f"{index_file} lists {file}, which is missing from {self.path}")
        self.weight_map: dict[str, str] = weight_map
        self.names_read: list[str] = []
        config = read_hf_config(self.path) if (self.path / "config.json").is_file() else {}
        self.fp8_block = tuple((config.get("quantization_config") or {}).get("weight_block_size") or (128, 128))

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(self.path / file, framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{self.path / file} is not a readable safetensors file ({e}); re-download it") from None
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None, rows: slice | None = None) -> torch.Tensor:
        """One tensor, or only `rows` of its first dimension (read from disk alone, e.g. a shard of stacked
        experts); a missing name or a shape that disagrees with the config is a one-line ValueError."""
        if name not in self.weight_map:
            raise ValueError(f"checkpoint {self.path} has no tensor {name}; does its config.json match the model config?")
        if expected_shape is not None and self.shape(name) != tuple(expected_shape):
            raise ValueError(
                f"checkpoint tensor {name} has shape {list(self.shape(name))} but the model config expects "
                f"{list(expected_shape)}; the config does not match these weights"
            )
        self.names_read.append(name)
        handle = self._open(self.weight_map[name])
        if name + "_scale_inv" in self.weight_map and handle.get_slice(name).get_dtype() == "F8_E4M3":
            t = dequantize_fp8_blocks(handle.get_tensor(name), self.get(name + "_scale_inv"), self.fp8_block)
            return t if rows is None else t[rows]
        return handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]

    def get_rows(self, name: str, expected_shape: tuple[int, ...], ids) -> torch.Tensor:
        """Rows `ids` of the first dimension, in that order (e.g. one rank's experts of any placement): each run
        of consecutive ids is read from disk alone. The name is recorded once."""
        runs = []
        for e in ids:
            if runs and e == runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([e, e + 1])
        parts = [self.get(name, expected_shape, slice(lo, hi)) for lo, hi in runs]
        del self.names_read[len(self.names_read) - len(runs) + 1:]
        if not parts:  # no rows: the tensor's other dimensions
            return torch.empty(0, *expected_shape[1:])
        return torch.cat(parts)


# FP4 E2M1 codes 0..15: sign bit 3, then 0, .5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks_XG16: torch.Tensor, scales_XG: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """MXFP4 -> [..., G, 32]: each byte of blocks holds two FP4 E2M1 values (low nibble first), each group of
    32 values shares one E8M0 scale byte s (a factor 2^(s - 127)). Exact in fp32 and bf16 (powers of two)."""
    if blocks_XG16.dtype != torch.uint8 or scales_XG.dtype != torch.uint8 or blocks_XG16.shape[:-1] != scales_XG.shape:
        raise ValueError(f"MXFP4 expects uint8 blocks [..., G, 16] and uint8 scales [..., G], got blocks "
                         f"{list(blocks_XG16.shape)} {blocks_XG16.dtype} and scales {list(scales_XG.shape)} {scales_XG.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks_XG16.device)
    codes = torch.stack([blocks_XG16 & 0x0F, blocks_XG16 >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    return torch.ldexp(lut[codes], scales_XG.int()[..., None] - 127)


def dequantize_fp8_blocks(q_NK: torch.Tensor, scale_inv_nk: torch.Tensor, block=(128, 128), dtype=torch.float32):
    """FP8 e4m3 [N, K] with one scale per block of block[0] x block[1] ([ceil(N / b0), ceil(K / b1)]; the last
    row and column of blocks may be partial) -> q * its block's scale, in dtype (the checkpoints' weight_scale_inv
    multiplies: DeepSeek-V3's weight_dequant)."""
    (N, K), (b0, b1) = q_NK.shape, block
    if q_NK.dtype != torch.float8_e4m3fn or scale_inv_nk.shape != (-(-N // b0), -(-K // b1)):
        raise ValueError(f"FP8 blocks expect float8_e4m3fn [N, K] and scales [ceil(N/{b0}), ceil(K/{b1})], got "
                         f"{list(q_NK.shape)} {q_NK.dtype} and scales {list(scale_inv_nk.shape)}")
    scale_NK = scale_inv_nk.to(dtype).repeat_interleave(b0, 0)[:N].repeat_interleave(b1, 1)[:, :K]
    return q_NK.to(dtype) * scale_NK


def write_hf_folder(path: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict,
                    max_shard_bytes: int = 4 << 30) -> None:
    """Config.json, the tensors as size-capped shards and an index: the layout transformers loads. Collective when
    torch.distributed is initialised: each rank passes the tensors it owns (a sharded model writes each tensor from
    one rank) to its own files, rank 0 writes the index joining them: no rank ever holds the whole model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        shard_bytes += size
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    weight_map, total = {}, sum(t.numel() * t.element_size() for t in tensors.values())
    for i, shard in enumerate(shards):
        if not shard:
            continue
        if distributed:
            file = f"model-rank{rank:05d}-{i + 1:05d}.safetensors"
        else:
            file = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    if distributed:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (weight_map, total))
        weight_map = {name: file for part, _ in gathered for name, file in part.items()}
        total = sum(size for _, size in gathered)
    if rank == 0:
        if len(set(weight_map.values())) > 1 or distributed:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (path / INDEX_NAME).write_text(json.dumps(index, indent=2))
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if distributed:
        dist.barrier()
