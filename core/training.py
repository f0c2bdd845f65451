"""What every train.py needs around the model: flags from a dataclass and the lr schedule (the optimizer,
with gradient reduction and clipping, is core/optimizer.py)."""

import argparse
import dataclasses
import math
import typing


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on rank 0 (core.reliability.run_main), not usage text from every rank
        raise ValueError(f"{message} (see --help)")


def parse_args(cls, argv=None):
    """argparse flags mapped 1:1 onto the fields of a dataclass (`max_steps` -> `--max-steps`)."""
    parser = _Parser(description=cls.__doc__)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, bool | None):  # --flag / --no-flag (None: not given, the script decides)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif typing.get_origin(f.type) is typing.Literal:  # one of a few names
            parser.add_argument(flag, choices=typing.get_args(f.type), default=f.default, help=f"default: {f.default}")
        else:
            parser.add_argument(flag, type=f.type, default=f.default, help=f"default: {f.default}")
    args = vars(parser.parse_args(argv))
    for name, value in args.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} {value} is not a finite number")
    return cls(**args)


def check_args(rules: dict[str, bool]) -> None:
    """Raise the first rule (message -> condition) that does not hold, as a ValueError."""
    for message, ok in rules.items():
        if not ok:
            raise ValueError(message)


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_ratio: float, decay_fraction: float) -> float:
    """Multiplier of the peak lr at a 0-based optimizer step: linear warmup, then
    cosine: half a cosine down to min_ratio at `total`;
    wsd:    warmup-stable-decay, flat until the last `decay_fraction` of the steps, then linear to min_ratio."""
    if schedule not in ("cosine", "wsd"):
        raise ValueError(f"unknown --lr-schedule {schedule!r}; use cosine or wsd")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total - int(decay_fraction * total)  # wsd
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - min_ratio) * min(1.0, (step - decay_start + 1) / max(1, total - decay_start))
