"""The (MoE layer, expert) load heatmap: cells coloured in load order, written to TensorBoard by MetricsLogger
every N steps and by a tiny training run of every recipe (read back with TensorBoard's EventAccumulator)."""

import importlib
import io

import pytest
import torch
from PIL import Image  # a dependency of tensorboard (its image summaries are PNGs written with it)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from core.metrics import HEATMAP_ANCHORS, MetricsLogger, load_heatmap
from recipes import recipe_names

TAG = "expert_load/layer_x_expert"


def cells(img: torch.Tensor, layers: int, experts: int) -> torch.Tensor:
    """(layers, experts, 3) colours of an image of square cells, checking that each cell is one colour."""
    cell = img.shape[1] // experts
    assert img.shape == (layers * cell, experts * cell, 3) and img.dtype == torch.uint8
    blocks = img.reshape(layers, cell, experts, cell, 3)
    assert (blocks == blocks[:, :1, :, :1]).all(), "a cell has more than one colour"
    return blocks[:, 0, :, 0]


def images(log_dir) -> list:
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return acc.Images(TAG) if TAG in acc.Tags()["images"] else []


def decode(event) -> torch.Tensor:
    rgb = Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB").tobytes()
    return torch.frombuffer(bytearray(rgb), dtype=torch.uint8).reshape(event.height, event.width, 3)


def test_heatmap_cells_follow_the_load(tmp_path):
    load_LE = torch.randperm(6 * 20, generator=torch.Generator().manual_seed(0)).reshape(6, 20).float() * 7
    rgb_LE3 = cells(load_heatmap(load_LE), 6, 20)
    brightness_LE = rgb_LE3.int().sum(-1)  # the anchors' R+G+B grows from cold to hot, so it orders the cells
    assert torch.equal(brightness_LE.flatten().argsort(), load_LE.flatten().argsort())
    assert rgb_LE3.flatten(0, 1)[load_LE.argmax()].tolist() == list(HEATMAP_ANCHORS[-1])  # hottest = the max
    assert rgb_LE3.flatten(0, 1)[load_LE.argmin()].tolist() == list(HEATMAP_ANCHORS[0])  # zero load = coldest
    assert load_heatmap(torch.ones(48, 128)).shape == (48 * 8, 128 * 8, 3)  # 128 experts: 8-pixel cells, 1024 wide

    logger = MetricsLogger(tmp_path / "tb", True, 6, 1.0, 1.0)
    for step in range(1, 7):
        logger.log_load_heatmap(step, load_LE * step, every=3)
    logger.close()
    events = images(tmp_path / "tb")
    assert [e.step for e in events] == [3, 6]
    assert torch.equal(decode(events[0]), load_heatmap(load_LE))  # the image TensorBoard shows is the array
    off = MetricsLogger(tmp_path / "off", True, 2, 1.0, 1.0)
    off.log_load_heatmap(2, load_LE, every=0)
    off.close()
    assert images(tmp_path / "off") == []


@pytest.mark.parametrize("recipe", recipe_names())
def test_training_writes_the_heatmap(recipe, tiny_train_setup, tmp_path):
    train = importlib.import_module(f"recipes.{recipe}.train")
    _, data = tiny_train_setup
    history, model = train.main(["--data", str(data), "--out", str(tmp_path / "run"), "--steps", "2", "--seq-len", "32",
                                 "--global-batch", "2", "--micro-batch", "2", "--ckpt-every", "0",
                                 "--load-heatmap-every", "1"])
    moe_layers, experts = model.take_expert_load().shape  # (MoE layers, routed experts), as train.py logs it
    events = images(tmp_path / "run" / "tensorboard")
    assert [e.step for e in events] == [1, 2]
    for event in events:
        rgb_LE3 = cells(decode(event), moe_layers, experts)
        assert list(HEATMAP_ANCHORS[-1]) in rgb_LE3.flatten(0, 1).tolist()  # the busiest expert, in the hot colour
