"""How the files in this folder were made: ZeRO-1 checkpoints written by the engine this repository ran before
FSDP2 became the only data-parallel one (`core/optimizer.py:ShardedAdamW` and the ZeRO-1 `core/muon.py`, commit
d4ffa8e), kept so that tests/test_fsdp.py can show that such a checkpoint still resumes. It ran once, with that
commit checked out; it does not run against the current code (ZeRO-1 and `--shard` are gone):

    OMP_NUM_THREADS=1 python -m tests.data.zero1_checkpoints.make

Each run: tests/conftest.py's TINY_TRAIN_CONFIG narrowed to hidden 32 (Qwen3-MoE, 2 layers, 4 experts; CONFIG
below, ~0.6 MB per checkpoint), the counting data
(tests/recipe_checks.py:write_counting_data), tests/test_train.py:train_args with 6 steps of 16 sequences, Adam eps
1e-6, at ep2 on 2 gloo ranks, a checkpoint after step 2 (step_00000002/, kept) and at the end (deleted: only the
losses and grad norms of the uninterrupted run are kept, in reference.json)."""

import json
import shutil
from pathlib import Path

from tests.conftest import TINY_TRAIN_CONFIG
from tests.multiproc import run_ranks
from tests.recipe_checks import write_counting_data
from tests.test_train import run_train, train_args

HERE = Path(__file__).parent
CONFIG = {**TINY_TRAIN_CONFIG, "hidden_size": 32, "head_dim": 8, "moe_intermediate_size": 16, "intermediate_size": 32}
RUNS = {"adamw_ep2": {"ep": 2}, "muon_ep2": {"ep": 2, "optimizer": "muon"}}


def flags(config, data, out, **extra):
    return train_args(config, data, out, steps=6, global_batch=16, adam_eps=1e-6, **extra)


def main():
    (HERE / "config.json").write_text(json.dumps(CONFIG, indent=1))
    data = write_counting_data(HERE / "tmp_data")
    reference = {}
    for name, extra in RUNS.items():
        ranks = run_ranks(2, run_train, flags(HERE / "config.json", data, HERE / "tmp_run", ckpt_every=2,
                                              keep_checkpoints=0, **extra))
        reference[name] = {"flags": extra, "losses": ranks[0][0], "grad_norms": ranks[0][1]}
        assert all(r[0] == ranks[0][0] and r[1] == ranks[0][1] for r in ranks)
        shutil.rmtree(HERE / name, ignore_errors=True)
        shutil.move(HERE / "tmp_run/checkpoints/step_00000002", HERE / name)
        shutil.rmtree(HERE / "tmp_run")
    shutil.rmtree(data)
    (HERE / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
