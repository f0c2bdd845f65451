"""Validation loss and perplexity of a trained model on any dataset made by tools/prepare_data.py: the numbers
train.py logs with --eval-every, for a DCP checkpoint or an exported Hugging Face folder.

  python -m tools.evaluate --checkpoint runs/qwen3_30b_a3b/checkpoints/step_00000300 --data data/stdlib/val \
      --seq-len 256 --global-batch 8 --micro-batch 1
  python -m tools.evaluate --hf runs/export --data data/other
  torchrun --nproc-per-node 4 -m tools.evaluate --checkpoint ... --data ... --pp 2 --ep 2   (any layout)

It runs the recipe's train.py in --eval-only mode: flags it does not know (--config, --seq-len, --global-batch,
--micro-batch, --eval-batches, --pp/--ep/--cp, --dtype) go there. A DCP checkpoint needs the config it was
trained with (--config; default the recipe's tiny one); an exported folder carries its own. The same
--seq-len, --global-batch and --eval-batches as in training evaluate the same windows, hence the same number.
An export of a variant recipe (its config.json's model_type names the recipe, core/hf_io.py:variant_config) is
evaluated by that recipe unless --recipe says otherwise.
"""

import argparse
import importlib
import json
from pathlib import Path

from core.reliability import run_main


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m tools.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a step_* folder written by train.py (DCP)")
    p.add_argument("--hf", help="a Hugging Face folder (train.py --export-hf, or released weights)")
    p.add_argument("--data", required=True, help="dataset folder from tools/prepare_data.py (e.g. <data>/val)")
    p.add_argument("--recipe", help="recipes/<name>/train.py builds the model (default: the variant recipe an --hf "
                                    "export names, else qwen3_30b_a3b)")
    args, rest = p.parse_known_args(argv)
    if bool(args.checkpoint) == bool(args.hf):
        raise ValueError("give exactly one of --checkpoint STEP_DIR (DCP) or --hf FOLDER")
    if args.checkpoint and not (Path(args.checkpoint) / ".metadata").is_file():
        raise FileNotFoundError(f"--checkpoint {args.checkpoint}: no DCP checkpoint there (no .metadata); pass a "
                                f"<out>/checkpoints/step_* folder, or --hf for an exported folder")
    if args.recipe is None:
        args.recipe = variant_recipe(args.hf) if args.hf else None
        if args.recipe:
            print(f"{args.hf} is an export of the variant recipe {args.recipe}: evaluating with recipes/{args.recipe}")
        args.recipe = args.recipe or "qwen3_30b_a3b"
    try:
        train = importlib.import_module(f"recipes.{args.recipe}.train")
    except ModuleNotFoundError:
        raise ValueError(f"no recipe {args.recipe!r}: recipes/{args.recipe}/train.py does not exist") from None
    weights = ["--resume", args.checkpoint] if args.checkpoint else ["--hf-checkpoint", args.hf]
    history, _ = train.main([*weights, "--data", args.data, "--eval-data", args.data, "--eval-only", *rest])
    return history[0]


def variant_recipe(folder) -> str | None:
    """The recipe a variant's export names (config.json: model_type = the recipe folder, with base_model_type and
    how_to_load beside it), or None for any other folder."""
    config = Path(folder) / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    return hf["model_type"] if "base_model_type" in hf and "how_to_load" in hf else None


if __name__ == "__main__":
    run_main(main)
