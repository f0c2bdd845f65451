import json
import random

import pytest
import torch

from core.data import write_shards

TINY_TRAIN_CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "intermediate_size": 64,
    "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
}


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped on a machine without CUDA."""
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def tiny_train_setup(tmp_path):
    """(config.json path, data dir) for a 2-layer, 4-expert model on ~12k tokens of counting sequences of vocab 256."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_TRAIN_CONFIG))
    rng = random.Random(0)
    docs = []  # learnable: each document counts upwards with its own stride
    for _ in range(120):
        start, stride = rng.randrange(3, 256), rng.randrange(1, 5)
        docs.append([3 + (start + i * stride) % 253 for i in range(rng.randrange(20, 200))])
    write_shards(docs, tmp_path / "data", vocab_size=256, eos_id=2, tokenizer={"kind": "none"})
    return config, tmp_path / "data"
