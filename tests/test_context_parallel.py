"""Context parallelism in a recipe's training script: a sequence length not divisible by 2*cp is a clear error.
(Every recipe's model-level loss, aux loss, expert load, logits and gradients at cp2 and cp2 x ep2, and its
training at cp2 and cp2 x ep2, against one process: tests/test_recipes.py via
tests/recipe_checks.py:model_grads_worker; the attention op: tests/test_context.py; pp2 x cp2:
tests/test_train_pp.py.)"""

import pytest

from recipes.qwen3_30b_a3b import train
from tests.test_train import train_args


def test_seq_len_not_divisible_by_2cp_is_a_clear_error(tiny_train_setup, tmp_path):
    config, data = tiny_train_setup
    with pytest.raises(ValueError, match=r"--seq-len 30 is not divisible by 2\*cp = 4"):
        train.main(train_args(config, data, tmp_path, seq_len=30, cp=2))
