"""One folder per architecture (model.py, train.py, launch.sh, configs), each importing only `core`. Tools and tests
find them with `recipe_names`, never from a list, so a copied folder is picked up with nothing else edited."""

import sys
from pathlib import Path


def recipe_names(folder=None) -> list[str]:
    """Every recipe folder (model.py and train.py) where `import recipes.<name>` looks, copies included, sorted;
    or those in `folder`."""
    return sorted({d.name for root in ([folder] if folder else __path__) for d in Path(root).iterdir()
                   if (d / "model.py").is_file() and (d / "train.py").is_file()})


def check_recipe_name(name: str) -> None:
    """ValueError in one line unless `name` is a recipe folder (recipe_names)."""
    if name not in recipe_names():
        raise ValueError(f"unknown recipe {name!r}: the recipes are the folders under recipes/ with model.py and "
                         f"train.py: {', '.join(recipe_names())}")


def import_from(folders: list[str]) -> list[str]:
    """From now on `import recipes.<name>` reads the recipe folders under `folders` (validate.py's snapshot, in its
    process and its ranks); recipe modules imported from elsewhere are dropped from sys.modules, so the next import
    reads the files there. Returns the folders of before."""
    before = list(__path__)
    if before != list(folders):
        __path__[:] = folders
        for name in [m for m in sys.modules if m.startswith(__name__ + ".")]:
            del sys.modules[name]
    return before
