"""train.py --help explains each flag (core/training.py:build_parser): the field's `# comment` in the Args dataclass,
continued by comment-only lines below it, plus its default. The reference for the recipes is a plain reading of
train.py's lines; a test dataclass covers the corner cases (a '#' inside a string, a section heading, a '%')."""

import dataclasses
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from core.training import build_parser, field_comments, parse_args
from recipes import recipe_names

ROOT = Path(__file__).resolve().parents[1]
RECIPES = recipe_names()
FIELD_WITH_COMMENT = re.compile(r"^    (\w+): [^=]+=.*?  # (.*)$")


def normalised(text: str) -> str:
    return " ".join(text.split())


def written_comments(train_py: Path) -> dict[str, str]:
    """{field: trailing comment} of the Args block as written (no '  # ' inside its defaults)."""
    source = train_py.read_text()
    block = source[source.index("class Args"):source.index("\ndef ", source.index("class Args"))]
    return {m.group(1): m.group(2) for m in map(FIELD_WITH_COMMENT.match, block.splitlines()) if m}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_help_shows_each_comment_and_default(recipe, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping: argparse breaks lines at hyphens inside words
    train = importlib.import_module(f"recipes.{recipe}.train")
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])  # through parse_args, as a user runs it
    shown = normalised(capsys.readouterr().out)
    assert e.value.code == 0
    written = written_comments(ROOT / "recipes" / recipe / "train.py")
    comments = field_comments(train.Args)
    assert len(written) > 30 and set(comments) == set(written)  # every commented field, no other
    for f in dataclasses.fields(train.Args):
        if f.name in written:
            assert comments[f.name].startswith(written[f.name]), f.name
            assert f"{normalised(comments[f.name])} (default: " in shown, f.name
        padded = isinstance(f.default, str) and (not f.default or f.default != f.default.strip())
        assert f"default: {repr(f.default) if padded else f.default}" in shown, f.name  # '' and 'def ' quoted
    # the comment-only line below `compile` continues its help; the section heading below `resume` is no one's
    assert comments["compile"].endswith("gains nothing at its sizes)")
    assert comments["resume"] == written["resume"]
    assert "reliability and evaluation" not in shown
    assert f"default: runs/{recipe}" in shown


@dataclass
class Flags:
    """Corner cases of reading comments from the source."""

    colour: str = "#fff"  # a '#' inside a string is no comment
    tag: str = "x # y"
    width: int = 3  # how wide; 50% of the
    # screen at most
    # ---- layout
    height: int = 4
    # below a field without a comment of its own: no one's help
    depth: float = 1.0  # how deep

    # after a blank line: no one's help
    verbose: bool = False  # say more
    mode: Literal["fast", "slow"] = "fast"  # which path


def test_comments_from_the_source_not_from_strings():
    assert field_comments(Flags) == {
        "colour": "a '#' inside a string is no comment",
        "width": "how wide; 50% of the screen at most",
        "depth": "how deep",
        "verbose": "say more",
        "mode": "which path",
    }


def test_help_of_every_kind_of_flag(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")
    shown = normalised(build_parser(Flags).format_help())
    for text in ("a '#' inside a string is no comment (default: #fff)", "--tag TAG default: x # y",
                 "how wide; 50% of the screen at most (default: 3)", "--height HEIGHT default: 4",
                 "how deep (default: 1.0)", "--verbose, --no-verbose say more (default: False)",
                 "--mode {fast,slow} which path (default: fast)"):
        assert text in shown, text
    assert "layout" not in shown and "no one's help" not in shown
    args = parse_args(Flags, ["--colour", "#000", "--verbose", "--mode", "slow", "--width", "5"])
    assert args == Flags(colour="#000", width=5, verbose=True, mode="slow")


def test_a_class_without_source_shows_defaults_only():
    made = dataclasses.make_dataclass("Made", [("steps", int, dataclasses.field(default=7))])
    assert field_comments(made) == {}
    assert "default: 7" in build_parser(made).format_help()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_removed_flag_says_what_replaced_it(recipe):
    """train.py's --shard (zero1 | fsdp) is gone: with or without a value, in either spelling, one line says that
    FSDP2 shards every multi-rank run and to drop the flag; an unknown flag still gets argparse's message; the
    removed name is no flag of --help."""
    train = importlib.import_module(f"recipes.{recipe}.train")
    for argv in (["--shard", "zero1"], ["--steps", "3", "--shard=fsdp"], ["--shard"]):
        with pytest.raises(ValueError) as e:
            parse_args(train.Args, argv)
        assert str(e.value) == ("--shard no longer exists: every run of more than one rank shards weights, gradients "
                                "and optimizer state with FSDP2 (core/fsdp.py) and one process runs unsharded; drop "
                                "the flag"), argv
    with pytest.raises(ValueError, match=r"^unrecognized arguments: --shards 2 \(see --help\)$"):
        parse_args(train.Args, ["--shards", "2"])
    assert "--shard" not in build_parser(train.Args).format_help() and "removed_flags" not in field_comments(train.Args)
