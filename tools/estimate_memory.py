"""Per-rank peak training memory of a recipe config under a layout, by component, and whether it fits a GPU.

The command line of core/memory.py (what each component counts and how exact it is: that module's docstring):

    python -m tools.estimate_memory --recipe qwen3_30b_a3b --config recipes/qwen3_30b_a3b/config.json \
        --pp 2 --ep 4 --micro-batch 1 --seq-len 4096 --gpu-gib 141

Prints the components of the most loaded pipeline rank in GiB and FITS / DOES NOT FIT in --gpu-gib minus
--reserve-gib (CUDA context and allocator fragmentation); when it does not fit, up to three layouts on the same
number of GPUs that would.
"""

import argparse
import importlib

from core.memory import GIB, Layout, estimate, fits, suggest
from recipes import recipe_names


def recipe_module(recipe: str):
    """recipes/<recipe>/model.py (any recipe folder, copies included)."""
    try:
        return importlib.import_module(f"recipes.{recipe}.model")
    except ModuleNotFoundError:
        raise ValueError(f"no recipe folder recipes/{recipe}; use a folder name such as {', '.join(recipe_names())}") from None


def table(est: dict) -> str:
    rows = [f"{k:<14}{est[k] / GIB:>10.2f}" for k in
            ("weights", "gradients", "optimizer", "weight_cache", "activations", "comm_buffers", "total")]
    return "\n".join([f"{'component':<14}{'GiB':>10}", *rows])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", required=True, help=f"recipe folder name: {', '.join(recipe_names())} or a copy")
    p.add_argument("--config", default="", help="HF config.json (default: the recipe's config_tiny.json)")
    for name, default in (("pp", 1), ("dp", 1), ("cp", 1), ("ep", 1), ("micro-batch", 1), ("seq-len", 4096)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--fp8-recipe", choices=("rowwise", "blockwise"), default="rowwise", help="train.py's")
    p.add_argument("--recompute", choices=("none", "attention", "layer"), default="none")
    p.add_argument("--expert-placement", default="", help="train.py's: ep rank of each routed expert, comma-separated")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw", help="train.py's")
    p.add_argument("--fsdp-gather", choices=("auto", "micro-batch", "step"), default="auto", help="train.py's")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory, e.g. 80 (H100) or 141 (H200)")
    p.add_argument("--reserve-gib", type=float, default=4.0, help="CUDA context and allocator fragmentation")
    a = p.parse_args(argv)
    mod = recipe_module(a.recipe)
    cfg = mod.ModelConfig.from_hf(a.config or mod.tiny_config_path())
    layout = Layout(a.pp, a.dp, a.cp, a.ep, a.micro_batch, a.seq_len, a.dtype == "bf16", a.fp8, a.recompute,
                    a.expert_placement, a.optimizer, a.fsdp_gather, a.fp8_recipe)
    est = estimate(mod, cfg, layout)
    print(f"{a.recipe} {a.config or 'config_tiny.json'}: {layout} --seq-len {a.seq_len} --dtype {a.dtype}"
          f"{f' --fp8 --fp8-recipe {a.fp8_recipe}' if a.fp8 else ''} | pp rank {est['pp_rank']} (the most loaded)")
    print(table(est))
    ok = fits(est, a.gpu_gib, a.reserve_gib)
    print(f"{'FITS' if ok else 'DOES NOT FIT'} in {a.gpu_gib:g} GiB ({a.reserve_gib:g} GiB reserved)")
    if not ok:
        others = suggest(mod, cfg, layout, a.gpu_gib, a.reserve_gib)
        for other in others:
            print(f"  fits: {other}  ({estimate(mod, cfg, other)['total'] / GIB:.1f} GiB)")
        if not others:
            print(f"  no layout of {layout.pp * layout.dp * layout.cp * layout.ep} GPUs fits: use more GPUs, a bigger "
                  f"GPU or a shorter --seq-len")
    return est, ok


if __name__ == "__main__":
    main()
