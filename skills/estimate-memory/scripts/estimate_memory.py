"""Estimate a recipe's per-GPU training memory: python skills/estimate-memory/scripts/estimate_memory.py RECIPE [options]

RECIPE is a folder under recipes/ (any one with model.py and train.py, a copy too); the options are those of
tools/estimate_memory.py, the command line of core/memory.py (--config, --pp, --dp, --cp, --ep, --micro-batch,
--seq-len, --dtype, --fp8, --fp8-recipe, --recompute, --optimizer, --gpu-gib, --reserve-gib). Exit status 1 when the layout does not fit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

from tools.estimate_memory import main  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    _, ok = main(["--recipe", sys.argv[1], *sys.argv[2:]])
    sys.exit(0 if ok else 1)
