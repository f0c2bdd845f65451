"""What every train.py needs around the model: flags from a dataclass (--help shows each field's comment), the lr
schedule, the check of the flags a model may not support (check_features), the objective's loss terms (LossTerm),
what the model is told after each step (StepDone) and what it declares of each parameter (ParamRule)."""

import argparse
import ast
import dataclasses
import functools
import importlib.util
import inspect
import io
import math
import pathlib
import textwrap
import tokenize
import typing
import zlib

import torch
import torch.distributed as dist


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on rank 0 (core.reliability.run_main), not usage text from every rank
        raise ValueError(f"{message} (see --help)")


def _own_field_comments(cls) -> dict[str, str]:
    """field_comments of the fields written in this class's own body (rules: field_comments)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a class made at run time): the flags show their defaults only
        return {}
    fields = {}  # first line -> (name, last line) of each annotated name in the class body (dataclass fields)
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields[node.lineno] = (node.target.id, node.end_lineno)
    # tokenize, not a text search: a '#' inside a string (a default such as "#fff") is no comment
    comment_at = {}  # line -> comment text without its '#'
    code_lines = set()  # lines holding anything but a comment (a string spanning lines: each of them)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    comments = {}
    for first, (name, last) in fields.items():
        parts = [comment_at[line] for line in range(first, last + 1) if line in comment_at]
        line = last + 1
        while parts and line in comment_at and line not in code_lines and not comment_at[line].startswith("---"):
            parts.append(comment_at[line])
            line += 1
        if parts:
            comments[name] = " ".join(parts)
    return comments


@functools.cache  # (read from the source once per class: train.py parses its flags on every call of main)
def field_comments(cls) -> dict[str, str]:
    """{field name: its meaning} from the dataclass's source: the `# comment` on the field's line(s), continued by
    comment-only lines directly below it. A comment-only line above a field, below one without a comment, or
    starting `# ---` (a section heading) belongs to no field. Base classes' fields keep their own comments."""
    comments = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):  # base first: a subclass's comment wins
            comments.update(_own_field_comments(klass))
    return comments


def _shown(value) -> str:
    """A default as --help shows it: strings bare (runs/my_arch), quoted only when empty or padded ('', 'def ')."""
    return repr(value) if isinstance(value, str) and (not value or value != value.strip()) else str(value)


def build_parser(cls) -> argparse.ArgumentParser:
    """argparse flags 1:1 onto a dataclass's fields (`max_steps` -> `--max-steps`), --help from field_comments."""
    parser = _Parser(description=cls.__doc__)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f"default: {_shown(f.default)}"
        text = f"{comments[f.name]} ({default})" if f.name in comments else default
        help = text.replace("%", "%%")  # argparse %-formats help text: a literal % must be doubled
        if f.type in (bool, bool | None):  # --flag / --no-flag (None: not given, the script decides)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        elif typing.get_origin(f.type) is typing.Literal:  # one of a few names
            parser.add_argument(flag, choices=typing.get_args(f.type), default=f.default, help=help)
        else:
            parser.add_argument(flag, type=f.type, default=f.default, help=help)
    return parser


def parse_args(cls, argv=None):
    """An instance of the dataclass `cls` from command-line flags (build_parser); a non-finite float is refused, and
    so is a flag of `cls.removed_flags` (name -> what replaced it), in one line."""
    parser = build_parser(cls)
    args, unknown = parser.parse_known_args(argv)
    for flag in unknown:
        name = flag.split("=")[0].removeprefix("--").replace("-", "_")
        if flag.startswith("--") and name in getattr(cls, "removed_flags", {}):
            raise ValueError(f"--{name.replace('_', '-')} no longer exists: {cls.removed_flags[name]}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args = vars(args)
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
    """Multiplier of the peak lr at a 0-based optimizer step: linear warmup, then (cosine) half a cosine down to
    min_ratio at `total`, or (wsd) flat until the last `decay_fraction` of the steps, then linear to min_ratio."""
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


def declared(model_class, cfg):
    """A model of config cfg that holds no layer, embedding or head, built on the meta device (no memory): what a
    model declares for a config before any is built, its features and loss terms (train.py's check_run)."""
    with torch.device("meta"):
        return model_class(cfg, layers=[], embed=False, head=False)


def check_wandb(project: str) -> None:
    """--wandb's optional package (core/metrics.py:WandbWriter), in one line before any rank starts."""
    if project and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb {project} needs the wandb package: pip install -e .[wandb] (or pip install wandb)")


def check_features(supported, requested: dict[str, tuple[str, bool]], where: str) -> None:
    """requested: optional model feature -> (the flag that asks for it, whether it is on). Raise, in one line, for
    the first feature asked for that the model's `supported` (its Model.features) lacks."""
    for feature, (flag, on) in requested.items():
        if on and feature not in supported:
            raise ValueError(f"{flag} needs the model feature {feature!r}, which {where} does not support (it "
                             f"supports: {', '.join(sorted(supported)) or 'none'}); drop the flag")


@dataclasses.dataclass
class StepDone:
    """What train.py hands `Model.after_step` once per step, on every rank, after the optimizer step and the
    reduction of the statistics (the post-step seam: expert bias, a router's expert changes, per-step files)."""

    step: int  # the step just finished (1-based)
    stats: dict  # Model.take_stats() combined over all ranks (core/metrics.py:reduce_stats), expert_load included
    optimizer: object  # FSDPAdamW / MuonAdamW: reinit_(param, index, value) resets rows and their optimizer state
    out: pathlib.Path  # the run's folder (--out): per-step artifacts go under it
    args: object  # train.py's Args (every flag: expert_bias_rate, ...)
    skipped: bool  # the step was skipped (non-finite loss or gradient): weights and optimizer state unchanged
    mesh: object  # core/mesh.py:Mesh (is_main: write a shared file once; group(...): a collective of the model's own)


@dataclasses.dataclass
class LossTerm:
    """One named term of the training objective (Model.loss_terms): the step's objective sums weight x (its global
    sum) / (its global denominator, counted before the first backward), so every layout trains one process's."""

    weight: float  # its coefficient; train.py --loss-weight NAME=W overrides it
    per: str | None  # the denominator: "tokens" (labels != -100), "micro_batches" (n_micro x dp x ep), the name
    # of an extra from Model.prepare_batch (the global sum of that per-token tensor), or None: a parameter-only term
    # counted once per step (n_micro x dp x cp x ep); each rank's sum is then the term over its layers' parameters,
    # a part over routed experts counted ep times (its own experts' part x ep) so the ep ranks' parts add up. FSDP2
    # gathering per micro-batch (pp = 1's default) holds a parameter whole only inside its unit's forward (a layer's
    # steps; the routed experts' own module): a term reading other ones (the experts' weights in the attention step)
    # needs train.py --fsdp-gather step


def loss_weights(terms: dict[str, LossTerm], flag: str) -> dict[str, LossTerm]:
    """terms with the weights of --loss-weight NAME=W[,NAME=W...] ('' keeps them); one-line error for a bad item."""
    terms = dict(terms)
    for item in filter(None, flag.split(",")):
        name, _, weight = item.partition("=")
        try:
            terms[name] = dataclasses.replace(terms[name], weight=float(weight))
        except (KeyError, ValueError):
            raise ValueError(f"--loss-weight {item}: give NAME=WEIGHT with NAME one of the model's loss terms "
                             f"({', '.join(terms)}) and WEIGHT a number") from None
    return terms


def loss_denominators(terms: dict[str, LossTerm], labels_BS, extras: list[dict], n_micro: int, mesh) -> dict:
    """Each term's denominator over the step's global batch (LossTerm.per) from this rank's labels and extras (one
    dict per micro-batch, Model.prepare_batch's): summed over (dp, cp, ep) in one all-reduce, each at least 1."""
    counted = sorted({t.per for t in terms.values()} - {"micro_batches", None})
    counts = [(labels_BS != -100).sum() if per == "tokens" else sum(e[per].sum() for e in extras)
              for per in counted]
    counts = torch.stack(counts).float() if counts else torch.zeros(0, device=labels_BS.device)
    group = mesh.group("dp", "cp", "ep")
    if group is not None:
        dist.all_reduce(counts, group=group)
    found = {per: count.clamp(min=1) for per, count in zip(counted, counts)}
    found.update({"micro_batches": n_micro * mesh.data_world, None: n_micro * mesh.data_world * mesh.cp})
    return {name: found[t.per] for name, t in terms.items()}


def objective(sums: dict, terms: dict[str, LossTerm], denominators: dict):
    """One micro-batch's share of the step's objective: sum of weight x sum / denominator over the terms."""
    return sum(t.weight * sums[name] / denominators[name] for name, t in terms.items())


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """What a model declares of one parameter (Model.parameter_rules); core reads it, never the parameter's name."""

    expert_ids: list[int] | None  # routed experts: the global id of each dim-0 row (sharded and reduced over dp x cp,
    # checkpointed per id, counted as experts by core/memory.py; their module holds nothing else); None: dense
    muon: dict  # the matrices --optimizer muon orthogonalises: {kind: ([S, A, B] view of the tensor, ids of the S
    # matrices or None)}, whole dim-0 rows each (core/muon.py); {}: AdamW trains it
    init: typing.Callable  # init(tensor, generator) fills it in place (a routed expert's row at a time): normal(std),
    # constant(value) or a function of your own
    decay: bool | None = None  # AdamW's weight decay; None: by rank, matrices only (as Megatron; parameter_rules)


def normal(std: float):
    return lambda t, gen: t.normal_(0.0, std, generator=gen)


def constant(value: float):
    return lambda t, gen: t.fill_(value)


def default_rule(model, name: str, t: torch.Tensor, std: float) -> ParamRule:
    """The rules the recipes' names imply: routed experts under `.mlp.experts.` (ids: their module's expert_ids), a
    3-D one a matrix per expert; Muon for other 2-D weights but the embedding, LM head and router (`mlp.gate`); norm
    weights ones, biases zeros, the rest Normal(0, std)."""
    ids = model.get_submodule(name.rsplit(".", 1)[0]).expert_ids if ".mlp.experts." in name else None
    adamw = name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))
    muon = ({"": (t, ids)} if t.ndim == 3 else {}) if ids is not None else \
        {"": (t.unsqueeze(0), None)} if t.ndim == 2 and not adamw else {}
    init = constant(1.0) if name.endswith("norm.weight") else constant(0.0) if name.endswith(".bias") else normal(std)
    return ParamRule(ids, muon, init)


def parameter_rules(model) -> dict[str, ParamRule]:
    """Every parameter's rule, declared on a meta tensor of its shape (a sharded one's too: views stay whole)."""
    rules = {n: model.parameter_rules(n, torch.empty(p.shape, device="meta")) for n, p in model.named_parameters()}
    return {n: rule if rule.decay is not None else dataclasses.replace(rule, decay=p.dim() >= 2)
            for (n, rule), p in zip(rules.items(), model.parameters())}


@torch.no_grad()
def init_parameters(model, seed: int) -> None:
    """Each parameter by its rule's init, from a generator seeded by `seed` and its name (a routed expert's row: with
    its global id), so a partial model (pipeline stage, any expert placement) gets its part of the full model's."""
    for name, p in model.named_parameters():
        rule = None if p.is_meta else model.parameter_rules(name, p)
        for j, block in enumerate([] if rule is None else p if rule.expert_ids is not None else [p]):
            key = name if rule.expert_ids is None else f"{name}.{rule.expert_ids[j]}"
            rule.init(block, torch.Generator(p.device).manual_seed(seed ^ zlib.crc32(key.encode())))
