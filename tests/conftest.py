import getpass
import json
import os
import tempfile

import pytest
import torch

from core import fp8
from recipes.qwen3_30b_a3b.model import check_setup as qwen3_check_setup
from tests.recipe_checks import write_counting_data

# Inductor's on-disk cache does not tell kernels built under one ATen CPU capability from another's: read under
# ATEN_CPU_CAPABILITY=avx2, kernels an earlier run built natively (AVX-512) gave wrong logits, and the other way round
# crashed the process; with a cache of its own each passes. So one cache folder per capability, for the tests and
# the processes they start (a folder the caller names is kept).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{torch.backends.cpu.get_cpu_capability().lower()}"))

# the Qwen3 recipe's check config with 2 of its 6 layers (4 experts, vocab 256), which most single-feature tests train
TINY_TRAIN_CONFIG = {**qwen3_check_setup()["config"], "num_hidden_layers": 2}


def config_with(config_dir, **fields):
    """config_dir's config.json with `fields` replaced, written beside it as bad.json (for from_hf's errors)."""
    hf = json.loads((config_dir / "config.json").read_text())
    (config_dir.parent / "bad.json").write_text(json.dumps({**hf, **fields}))
    return config_dir.parent / "bad.json"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped on a machine without CUDA; tests marked `slow` unless -m selects them."""
    slow_selected = "slow" in (config.option.markexpr or "")
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("slow") and not slow_selected:
            item.add_marker(pytest.mark.skip(reason="slow: run with -m slow"))


@pytest.fixture(autouse=True)
def process_wide_defaults():
    """Every test starts from the process-wide settings a train.py run may change and leave: row-wise FP8 scaling
    (core/fp8.py:SCALING, --fp8-recipe; a blockwise run made tests/test_fp8.py's emulations fail after
    tests/test_fsdp.py in one process) and torch's nondeterministic algorithms (--deterministic)."""
    fp8.set_scaling("rowwise", "cpu")
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def tiny_train_setup(tmp_path):
    """(config.json path, data dir) for a 2-layer, 4-expert model on ~12k tokens of counting sequences of vocab 256."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_TRAIN_CONFIG))
    return config, write_counting_data(tmp_path / "data")
