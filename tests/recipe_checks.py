"""The correctness checks every recipe shares, written once: tests/test_recipes.py runs them for every folder under
recipes/ and skills/validate-correctness/scripts/validate.py prints them as one table. What a recipe must
declare for them is the block at the end of its model.py (TRANSFORMERS_CLASS, BASE_RECIPE, check_setup()).

Each check returns Result rows (check, worst error, tolerance, where the worst was). Groups:
  parity   logits, gradients and export against transformers' TRANSFORMERS_CLASS (tools/hf_parity.py:check_recipe),
           in fp32 and with both models in float64 (the whole model runs in float64 on CPU)
  base     a variant equals BASE_RECIPE when both train on check_setup()["base_config"] (its feature switched off);
           and, both in float64, the same logits and gradients (float64_base_results); a variant whose feature
           cannot be switched off declares no base_config and has no base rows
  export   a Hugging Face folder through train.py --lr 0 comes back bit for bit
  buffers  every buffer of a meta-device build + init_weights + load_hf_checkpoint equals a fresh build's
  documents a packed micro-batch under the document mask gives each document's loss and every gradient as
           each document run alone (fp32)
  layouts  ep2, pp2, cp2, pp2xep2, cp2xep2, and ep2 / ep4 under uneven expert placements (PLACED) equal one
           process (losses, grad norms, every weight after 2 steps); the model-level loss, aux loss, expert load,
           logits and gradients at cp2 and cp2xep2; resume at ep2; --recompute (layer at pp2xep2 and in the ep4
           placement); pp2 in bf16 against dp2 at step 1; an export at pp2xep2 and at ep4 under an uneven
           placement; the same five layouts on conversations (whole documents, loss masks, --document-mask) and pp2
           --recompute layer on them. One process group per world size runs all of its jobs, both side by side
           with the one-process references.
Every bound comes from the model under test (see the bounds below); a row over or near its bound makes its
comparison again in float64, and passes as rounding if float64 agrees; a row that cannot be computed says why.

Also the helpers other per-recipe tests share: a partial model reads only its tensors, transformers' aux loss and
router gradients, and the counting dataset the tests train on."""

import contextlib
import copy
import importlib
import json
import math
import random
import tempfile
import traceback
import typing
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

import recipes
from core.context import cp_positions, split_for_cp
from core.data import TokenLoader, positions_in_documents
from core.hf_io import CheckpointReader
from core.mesh import build_mesh
from core.pipeline import split_layers
from core.training import declared, objective, parameter_rules, parse_args
from tests.multiproc import TIMEOUT_S, one_thread, start_ranks
from tests.test_train import (
    LAYOUT_TOLERANCE,
    bitwise_error,
    held_experts,
    layout_errors,
    noise_bound,
    rel_err,
    run_train,
    train_args,
    worst_bounded,
    worst_error,
)
from tools.hf_parity import FLOAT64_TOLERANCE, check_recipe, folder_tensors, make_tiny_hf_model
from tools.shards import write_shards

GROUPS = ("parity", "base", "export", "buffers", "documents", "layouts")
# Bounds, as relative norms ||a - b|| / ||b|| per tensor unless a row says otherwise, each from the model under test:
# an fp32 comparison within noise_bound (tests/test_train.py) of the quantity's own rounding noise, its fp32 run's
# distance from a float64 run from the same weights (parity: transformers', tools/hf_parity.py); float64 rows within
# FLOAT64_TOLERANCE; bf16 rows a share of what bf16 does to this model (BF16_SHARE); 0 is bitwise: the same
# operations in the same order. Each with its reason where it is made.
STEPS = 2  # of every trained check (check_args): the second step's update is the first that depends on the
# gradients' size (Adam's first step is ~lr x sign(g)), and it runs on weights the optimizer step wrote into the
# shards and FSDP2 gathered again, routed by expert biases the first step updated. A third step repeats that
CLIP = 0.05  # tests/test_train.py:train_args' --grad-clip: the one-process run must exceed it to test the global norm
LAYOUTS = {"ep2": {"ep": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "pp2xep2": {"pp": 2, "ep": 2},
           "cp2xep2": {"cp": 2, "ep": 2}}
# expert placements (train.py --expert-placement, the ep rank of each routed expert) for E experts: at ep=2 uneven
# and not contiguous (expert 1 alone on rank 0), at ep=4 with rank 2 holding none
PLACED = {"ep2 placed": lambda E: [0 if e == 1 else 1 for e in range(E)],
          "ep4 placed": lambda E: [(3, 0, 0, 1)[e] if e < 4 else (0, 1, 3)[e % 3] for e in range(E)]}
AUX_COEF = 0.1  # model-level cp check: large enough that the aux loss's gradient is visible in the router's
# The layout rows' ids, in the table's order (validate.py --rows; what each reads and compares: layout_rows)
LAYOUT_ROWS = ("clips", *[name.replace(" ", "-") for name in [*LAYOUTS, *PLACED]], "docs-mask-acts",
               *["docs-" + name for name in LAYOUTS], "docs-pp2-recompute", "cp2-model", "cp2xep2-model", "resume",
               "pp2xep2-recompute", "cp2-recompute", "pp2-bf16-loss", "pp2-bf16-grad-norm", "bf16-differs",
               "pp2xep2-export", "ep4-placed-export")
ROWS = {"parity": ("parity-logits", "parity-grads", "parity-grad-worst", "parity-export", "parity64-logits",
                   "parity64-grads", "parity64-grad-worst"),
        "base": ("base-losses", "base-grad-norms", "base-weights", "base64-logits", "base64-grads"),
        "export": ("export", "export-model-type"), "buffers": ("buffers",),
        "documents": ("documents-losses", "documents-grads", "documents-grad-tensors"), "layouts": LAYOUT_ROWS}
ROW_IDS = tuple(row for ids in ROWS.values() for row in ids)
NEAR_BOUND = 0.1  # a row whose error is within 10% of its bound (either side) may be rounding at the edge of its
# bound or a small bug: the table then says what the same comparison gives in float64 (Result.float64), as for a
# row over its bound, where rounding shrinks by 2^29 (float64's eps over fp32's) and a bug does not: rounding then
# agrees within FLOAT64_TOLERANCE (1e-10: an fp32 error of ~1e-6 becomes ~1e-15 x the same amplification), a bug
# keeps its fp32 size, >= 1e-8 even for one float32 cast in a float64 path (tools/hf_parity.py)
BF16_SHARE = 1.0  # the bf16 grad-norm row's bound: this share of one bf16 process's own distance from fp32
# (bf16_step1): no further apart than bf16 itself moves the grad norm. The 5 recipes' pp2 and dp2 differ by 0 to 0.39
# of it (DeepSeek-V2-Lite, 1.1e-5 of 2.8e-5); a dropped gradient term moves it by the term's share of the norm


@dataclass
class Result:
    id: str  # short, for the command line (ROWS)
    check: str
    error: float  # the worst found (a relative norm unless the check names another quantity)
    tolerance: float
    where: str = ""
    above: bool = False  # True: the quantity must exceed `tolerance` (a sanity check of the setup), not stay below
    float64: float | None = None  # the same comparison with every run in float64, where there is one
    failed: str = ""  # the row could not be computed: why (it fails, and the table says so)
    float64_missing: str = ""  # its float64 comparison could not be made: why

    @property
    def rounding(self) -> bool:
        """Over its bound in fp32 while the same comparison in float64 agrees: rounding, not a bug."""
        return (not self.above and self.error > self.tolerance and self.float64 is not None
                and self.float64 <= FLOAT64_TOLERANCE)

    @property
    def ok(self) -> bool:
        if self.failed:
            return False
        return self.error > self.tolerance if self.above else self.error <= self.tolerance or self.rounding

    def near_bound(self, near: float = NEAR_BOUND) -> bool:
        return not self.above and self.tolerance > 0 and abs(self.error / self.tolerance - 1) <= near

    def wants_float64(self, near: float = NEAR_BOUND) -> bool:
        """Over its bound (NaN included) or near it: its float64 comparison tells rounding from a bug."""
        return not self.above and not self.failed and (not self.error <= self.tolerance or self.near_bound(near))


def failure(e: BaseException) -> str:
    """An exception as the one line a row that could not be computed shows (a rank's: its traceback's last line)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    return f"{type(e).__name__}: {lines[-1][:200]}"


def float64_verdict(r: Result, near: float = NEAR_BOUND) -> str:
    """What a row over or near its bound is: rounding (its float64 comparison agrees: it passes) or a bug."""
    head = f"{r.error:.1e} over its bound {r.tolerance:.1e}" if not r.error <= r.tolerance else \
        f"within {near:.0%} of its bound"
    if r.float64 is None:
        return f"{head}; no float64 run of this comparison" + (f" ({r.float64_missing})" if r.float64_missing else "")
    if r.float64 <= FLOAT64_TOLERANCE:
        return f"{head}; in float64 {r.float64:.1e} (<= {FLOAT64_TOLERANCE:.0e}): rounding, not a bug"
    return f"{head}; in float64 still {r.float64:.1e} (> {FLOAT64_TOLERANCE:.0e}): not rounding, a bug"


def format_table(results: list[Result], near: float = NEAR_BOUND) -> str:
    """One line per row: id, check, error, bound, error / bound, PASS / FAIL / ERROR (could not be computed: why),
    where the worst error was; under a row over or within `near` of its bound, what its float64 comparison says
    (float64_verdict: rounding passes)."""
    idw, width = max(len(r.id) for r in results), max(len(r.check) for r in results)
    header = f"{'row':<{idw}}  {'check':<{width}}  {'error':>8}  {'bound':>11}  error/bound  result  where"
    lines = [header, "-" * len(header)]
    for r in results:
        bound = f"{'>' if r.above else '<='} {r.tolerance:.1e}" if r.tolerance or r.above else "0 (bitwise)"
        ratio = f"{r.error / r.tolerance:.2f}" if r.tolerance else "-"
        verdict = "ERROR" if r.failed else "PASS" if r.ok else "FAIL"
        lines.append(f"{r.id:<{idw}}  {r.check:<{width}}  {r.error:>8.2e}  {bound:>11}  {ratio:>11}  "
                     f"{verdict:<6}  {r.failed or r.where}".rstrip())
        if r.wants_float64(near):
            lines.append(f"{'':<{idw}}  ^ {float64_verdict(r, near)}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ recipes, data


@dataclass
class Recipe:
    name: str
    model: ModuleType  # recipes/<name>/model.py
    train: ModuleType  # recipes/<name>/train.py
    transformers_class: str | None
    base: str | None
    config: dict  # the check config (HF config.json fields)
    seq_len: int
    base_config: dict | None


def load_recipe(name: str, vocab_size: int = 0) -> Recipe:
    """A recipe and its check setup (the block at the end of its model.py); vocab_size widens the check config's
    vocabulary to a dataset's. Raises ValueError in one line for an unknown folder or an incomplete block."""
    recipes.check_recipe_name(name)
    model = importlib.import_module(f"recipes.{name}.model")
    declared = [n for n in ("TRANSFORMERS_CLASS", "BASE_RECIPE", "check_setup") if not hasattr(model, n)]
    if declared:
        raise ValueError(f"recipes/{name}/model.py lacks {', '.join(declared)}: copy the recipe-checks block from the "
                         f"end of recipes/qwen3_30b_a3b/model.py and fill it in")
    setup = model.check_setup()
    if not model.TRANSFORMERS_CLASS and not model.BASE_RECIPE:
        raise ValueError(f"recipes/{name}/model.py: TRANSFORMERS_CLASS and BASE_RECIPE are both None, so nothing "
                         f"checks its numerics; name the recipe it was copied from in BASE_RECIPE")
    if not all(split_layers(setup["config"]["num_hidden_layers"], 2)):
        raise ValueError(f"recipes/{name}/model.py: with the {setup['config']['num_hidden_layers']} layers of "
                         f"check_setup()['config'] pp=2 leaves a pipeline stage without layers, so the pp2 checks would "
                         f"not test a split model; give it at least 6 (each of the 4 stages then holds some)")
    if setup["seq_len"] % 4:
        raise ValueError(f"recipes/{name}/model.py: check_setup()['seq_len'] {setup['seq_len']} must be a multiple "
                         f"of 4 (cp2 cuts each sequence into 4 chunks)")
    widen = lambda config: config and {**config, "vocab_size": max(config["vocab_size"], vocab_size)}
    return Recipe(name, model, importlib.import_module(f"recipes.{name}.train"), model.TRANSFORMERS_CLASS,
                  model.BASE_RECIPE, widen(setup["config"]), setup["seq_len"], widen(setup.get("base_config")))


def model_features(recipe: Recipe) -> frozenset[str]:
    """Model.features (the optional features the shared checks exercise; a model may decline some) of the check
    config's model, asked of one holding no layer on the meta device as train.py's check_run does: they may
    depend on the config."""
    path = write_config(Path(tempfile.mkdtemp()) / "config.json", recipe.config)
    return declared(recipe.model.Model, recipe.model.load_config(path)).features


def write_counting_data(out) -> Path:
    """~12k tokens of vocabulary 256 in 120 documents, each counting upwards from its own start with its own
    stride (learnable in a few steps), as token shards (core/data.py)."""
    rng = random.Random(0)
    docs = []
    for _ in range(120):
        start, stride = rng.randrange(3, 256), rng.randrange(1, 5)
        docs.append([3 + (start + i * stride) % 253 for i in range(rng.randrange(20, 200))])
    write_shards(docs, out, vocab_size=256, eos_id=2, tokenizer={"kind": "none"})
    return Path(out)


def write_counting_chats(out, seq_len: int) -> Path:
    """A dataset of whole documents with loss masks (core/data.py format 2, as tools/prepare_data.py --chat writes
    it), vocabulary 256: 60 "conversations" of 4 to seq_len tokens counting upwards, each a "prompt" (not trained)
    then an "answer" (trained) of random lengths, so windows pack 1 to several documents plus padding."""
    rng = random.Random(1)
    docs = []
    for _ in range(60):
        n, start, stride = rng.randrange(4, seq_len + 1), rng.randrange(3, 256), rng.randrange(1, 5)
        prompt = rng.randrange(1, n - 1)
        docs.append(([3 + (start + i * stride) % 253 for i in range(n)], [0] * prompt + [1] * (n - prompt)))
    write_shards(docs, out, vocab_size=256, eos_id=2, tokenizer={"kind": "none"}, loss_masks=True)
    return Path(out)


def data_vocab(data) -> int:
    return TokenLoader(data, 2, 1, 0, 1, 0).meta["vocab_size"]


def write_config(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config))
    return path


def check_args(recipe: Recipe, config, data, out, **extra) -> list[str]:
    """train.py flags of the layout checks: 2 steps of 8 micro-batches of 1 sequence, clipping at 0.05 active, the
    aux-loss-free expert bias on (its updates, from the global expert load, must be bit-identical in every
    layout). Adam eps 1e-6, not 1e-8: a stage boundary sums gradients in another order and cp runs the matmuls on
    other shapes, so gradients differ from one process by ~3e-7 (float rounding); with eps 1e-8 the few elements
    whose clipped gradient is ~eps turn that into lr-sized steps, ~1e-5 weight differences after 5 steps at cp2
    (measured: grad norm 1.8e-5, weights 9.5e-6). dp splits whole sequences, keeps the shapes and is not affected;
    losses and grad norms match at either eps. A model without the expert_bias feature (Model.features) trains
    without the bias."""
    bias = {"expert_bias_rate": 1e-2} if "expert_bias" in model_features(recipe) else {}
    return train_args(config, data, out, **{"steps": STEPS, "micro_batch": 1, "adam_eps": 1e-6, **bias,
                                            "seq_len": recipe.seq_len, **extra})


def run_checks(name: str, data, workdir, groups=GROUPS, progress=lambda group: None, rows=None,
               near: float = NEAR_BOUND) -> list[Result]:
    """The named groups of checks (GROUPS), or the rows named in `rows` (ids of ROWS; only the work they need runs),
    on recipe `name`, training on `data`; scratch files under workdir. progress(group) is called as each group
    starts. With "layouts", its process groups start first and run while this process checks the other groups
    (layout_results' `meanwhile`). A row within `near` of its bound gets its float64 comparison (Result.float64)."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown check group(s) {', '.join(sorted(unknown))}: choose from {', '.join(GROUPS)}")
    if rows is not None:
        unknown = set(rows) - set(ROW_IDS)
        if unknown or not rows:
            raise ValueError(f"unknown row(s) {', '.join(sorted(unknown)) or '(none given)'}: name rows of the table's "
                             f"first column, comma-separated: {', '.join(ROW_IDS)}")
        groups = [g for g in GROUPS if set(ROWS[g]) & set(rows)]
    recipe, workdir = load_recipe(name, data_vocab(data)), Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    made = {}  # the reference folder, made once (parity, export and buffers read it)

    def hf_in() -> Path:
        made.setdefault("hf_in", reference_folder(recipe, workdir / "hf_in") if "hf_in" not in made else None)
        return made["hf_in"]

    checks = {"parity": lambda: parity_results(recipe, hf_in()) if recipe.transformers_class else [],
              "base": lambda: base_equality_results(recipe, data, workdir) + float64_base_results(recipe)
              if recipe.base and recipe.base_config else [],
              "export": lambda: export_results(recipe, data, workdir, hf_in()),
              "buffers": lambda: buffer_results(recipe, hf_in()),
              # (Model.features: a model may decline document masks)
              "documents": lambda: document_results(recipe) if "document_mask" in model_features(recipe) else []}

    def in_this_process() -> list[Result]:
        results = []
        for group in [g for g in GROUPS if g in groups and g != "layouts"]:
            progress(group)
            try:
                results += checks[group]()
            except (ValueError, FileNotFoundError):  # bad input (a check block, a config): one line, at once
                raise
            except Exception as e:  # a group that cannot run fails its rows, says why, and the rest still runs
                traceback.print_exc()  # (validate.py: into runs.log)
                results += [Result(row, f"{group} checks", math.nan, 0.0, failed=failure(e)) for row in ROWS[group]]
        return [r for r in results if rows is None or r.id in rows]

    results = layout_results(recipe, data, workdir, meanwhile=in_this_process, progress=progress, rows=rows, near=near) \
        if "layouts" in groups else in_this_process()
    unlisted = {r.id for r in results} - set(ROW_IDS)
    assert not unlisted, f"rows {unlisted} are missing from ROWS (--rows could not name them)"
    return results


# ------------------------------------------------------------------------ parity, base, export, buffers


def reference_folder(recipe: Recipe, out: Path) -> Path:
    """A Hugging Face folder of the check config with random weights: written by transformers' save_pretrained
    where the recipe has a counterpart (so loading is checked against the released layout), else by the recipe's
    own save_hf_checkpoint of a fresh Model."""
    if not recipe.transformers_class:
        torch.manual_seed(0)
        model = recipe.model.Model(recipe.model.ModelConfig.from_hf(write_config(out.with_suffix(".json"), recipe.config)))
        recipe.model.save_hf_checkpoint(model, out)
        return out
    import transformers

    cls = getattr(transformers, recipe.transformers_class, None)
    if cls is None or getattr(cls.config_class, "model_type", None) != recipe.config["model_type"]:
        raise ValueError(f"recipes/{recipe.name}/model.py: TRANSFORMERS_CLASS {recipe.transformers_class!r} is not a "
                         f"transformers class for model_type {recipe.config['model_type']!r}")
    make_tiny_hf_model(recipe.config, out)
    # tensors the recipe keeps beyond the class, which transformers drops on load (a training-only module such as
    # DeepSeek-V3's multi-token prediction layer): added at the recipe's start values, so that the folder holds
    # everything the recipe reads and writes
    model = recipe.model.Model(recipe.model.ModelConfig.from_hf(out))
    recipe.model.load_hf_checkpoint(model, out)
    weight_map = CheckpointReader(out).weight_map
    extra = {n: t.contiguous() for n, t in recipe.model.hf_state_dict(model).items() if n not in weight_map}
    if extra:
        save_file(extra, out / "model-extra.safetensors", metadata={"format": "pt"})
        weight_map |= dict.fromkeys(extra, "model-extra.safetensors")
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def parity_results(recipe: Recipe, hf_dir: Path) -> list[Result]:
    """tools/hf_parity.py:check_recipe's rows: logits and the export's logits as max abs errors, the gradients of
    every checkpoint tensor (together, and the worst one) as relative norms; 1e-4 each, since transformers sums in
    another order (fused experts, sdpa): measured ~1e-7 to 1e-6. Then logits and gradients with both models in
    float64, relative, within tools/hf_parity.py:FLOAT64_TOLERANCE (1e-10; measured ~1e-15), each the float64
    comparison of its fp32 row."""
    results = {}
    ids = {"logits": "logits", "grad (all tensors)": "grads", "grad worst": "grad-worst",
           "export -> transformers logits": "export"}
    for dtype in (torch.float32, torch.float64):
        for row in check_recipe(recipe.name, hf_dir, seq_len=recipe.seq_len, dtype=dtype):
            check, _, tensor = row.check.partition(": ")  # "grad worst: NAME"
            error = row.max_abs if row.metric == "max_abs" else row.rel
            what = f"{check}, {'max abs' if row.metric == 'max_abs' else 'relative'}"
            kind = ("float64 ", " float64", "64") if dtype == torch.float64 else ("", "", "")
            row_id = f"parity{kind[2]}-{ids[check]}"
            results[row_id] = Result(row_id, f"{kind[0]}= {recipe.transformers_class}{kind[1]}: {what}", error,
                                     row.tol, tensor)
    for row_id, r in results.items():  # an fp32 row's float64 comparison: its float64 row (the export's: none)
        twin = results.get(row_id.replace("parity-", "parity64-"))
        r.float64 = twin.error if twin not in (None, r) else None
    return list(results.values())


def float64_base_results(recipe: Recipe, seed: int = 0) -> list[Result]:
    """The variant and BASE_RECIPE built on base_config (the feature off) with the base's weights, both in float64
    on CPU: logits and the gradient of every base tensor within FLOAT64_TOLERANCE (relative: float64 rounds at
    1.1e-16 per op; a switched-off feature's leftover multiply by 1 or add of 0 changes nothing above ~1e-15,
    a real difference, e.g. another norm epsilon, >= 1e-8)."""
    base = load_recipe(recipe.base)
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp) / "base_config.json", recipe.base_config)
        torch.manual_seed(seed)
        ref = base.model.Model(base.model.ModelConfig.from_hf(config)).double()
        model = recipe.model.Model(recipe.model.ModelConfig.from_hf(config)).double()
    missing = set(ref.state_dict()) - set(model.state_dict())
    if missing:
        raise ValueError(f"recipes/{recipe.name}/model.py: the variant lacks {recipe.base}'s tensors "
                         f"{sorted(missing)[:3]}; a variant keeps every tensor of its base under the same name")
    model.load_state_dict(ref.state_dict(), strict=False)
    ids = torch.randint(0, recipe.base_config["vocab_size"], (2, recipe.seq_len),
                        generator=torch.Generator().manual_seed(seed))
    logits = [m(ids) for m in (model, ref)]
    for out in logits:
        F.cross_entropy(out.flatten(0, 1), torch.roll(ids, -1, 1).flatten()).backward()
    params = dict(model.named_parameters())
    error, where = worst_error((rel_err(params[n].grad, p.grad), n) for n, p in ref.named_parameters())
    return [Result("base64-logits", f"float64 = {recipe.base} float64 with the feature off: logits", rel_err(*logits),
                   FLOAT64_TOLERANCE),
            Result("base64-grads", f"float64 = {recipe.base} float64 with the feature off: gradients", error,
                   FLOAT64_TOLERANCE, where)]


def base_equality_results(recipe: Recipe, data, workdir: Path) -> list[Result]:
    """One process each, the layout checks' flags, on base_config: every weight and buffer of the base equals the
    variant's (those only the variant has belong to its feature, which is switched off), each within noise_bound of
    its own rounding noise (the base's fp32 run against a float64 run from the same weights: a switched-off feature
    may leave an operation that rounds otherwise, a multiply by 1, an add of 0 in another place); their float64:
    both again in float64 from those weights. A real difference (another norm epsilon) is >= 1e-4."""
    base = load_recipe(recipe.base)
    config = write_config(workdir / "base_config.json", recipe.base_config)
    args = lambda out, **extra: check_args(recipe, config, data, workdir / out, **extra)
    ref, got = (run_train(args(out), main) for out, main in (("base_ref", base.train.main),
                                                              ("base_variant", recipe.train.main)))
    base.train.main(args("base_init", steps=1, lr=0.0, expert_bias_rate=0.0, export_hf=workdir / "base_init_hf"))
    with float64_default():  # (the float64 twins start from the fp32 runs' weights: float64 draws other numbers)
        ref64, got64 = (run_train(args(out, hf_checkpoint=workdir / "base_init_hf"), main) for out, main in
                        (("base_ref64", base.train.main), ("base_variant64", recipe.train.main)))
    base_part = lambda run, of: (run[0], run[1], {k: v for k, v in run[2].items() if k in of[2]})
    errors = layout_errors(ref, [base_part(got, ref)], reference64=ref64)
    errors64 = layout_errors(ref64, [base_part(got64, ref64)])
    return [Result("base-" + what.replace(" ", "-"), f"= {recipe.base} with the feature off: {what}", error, bound,
                   where, float64=errors64[what][0]) for what, (error, where, bound) in errors.items()]


def export_results(recipe: Recipe, data, workdir: Path, hf_in: Path) -> list[Result]:
    """train.py --hf-checkpoint hf_in --lr 0 --export-hf: every tensor comes back bit for bit."""
    hf_out = workdir / "hf_out"
    recipe.train.main(train_args("unused", data, workdir / "export_run", steps=1, lr=0.0, hf_checkpoint=hf_in,
                                 export_hf=hf_out, seq_len=recipe.seq_len))
    before, after = folder_tensors(hf_in), folder_tensors(hf_out)
    error, where = worst_error([(bitwise_error(after[n], t) if n in after else math.inf, n) for n, t in before.items()]
                               + [(math.inf, f"exported, not in the input: {n}") for n in after.keys() - before.keys()])
    # a variant (TRANSFORMERS_CLASS None) names itself, so transformers cannot take it for its base model
    model_type = json.loads((hf_out / "config.json").read_text()).get("model_type")
    expected = recipe.config["model_type"] if recipe.transformers_class else recipe.name
    return [Result("export", "export round trip: HF folder -> train.py --lr 0 -> export", error, 0.0, where),
            Result("export-model-type", f"export's model_type is {expected!r}",
                   0.0 if model_type == expected else math.inf, 0.0, "" if model_type == expected else f"got {model_type!r}")]


def buffer_results(recipe: Recipe, hf_dir: Path) -> list[Result]:
    """train.py's --hf-checkpoint path builds on the meta device, allocates with to_empty (uninitialised memory:
    NaN here, so a buffer init_weights forgets cannot be right by luck), calls init_weights and loads the folder,
    which holds no buffers: every named buffer must equal a fresh build's."""
    cfg = recipe.model.ModelConfig.from_hf(hf_dir)
    torch.manual_seed(0)
    fresh = dict(recipe.model.Model(cfg).named_buffers())
    with torch.device("meta"):
        model = recipe.model.Model(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(math.nan if t.is_floating_point() else 7)
    model.init_weights()
    recipe.model.load_hf_checkpoint(model, hf_dir)
    built = dict(model.named_buffers())
    errors = [(bitwise_error(built[n], t) if n in built else math.inf, n) for n, t in fresh.items()]
    errors += [(math.inf, f"{n} (not in a fresh build)") for n in built.keys() - fresh.keys()]
    error, where = worst_error(errors) if errors else (0.0, "no buffers")
    return [Result("buffers", f"buffers ({len(fresh)}): meta build + init_weights + load = fresh build", error, 0.0, where)]


# ---------------------------------------------------------------------------------------------- documents

def document_results(recipe: Recipe) -> list[Result]:
    """Two packed rows of documents (lengths chosen to span GPT-OSS's window and leave padding in one row) through
    forward_train's trunk under the document mask, with rope positions restarting per document: each document's
    cross-entropy and the gradients of their sum equal each document run alone (a batch of one short sequence,
    default positions, plain causal attention), fp32, each quantity within noise_bound of its own rounding (the
    documents run alone in fp32 against the same in float64): packed and alone run the same operations on other
    shapes (sums in another order; masked keys add exact zeros). Measured: losses <= 3e-8, all gradients <= 4e-7,
    one tensor <= 1.6e-6 (a norm weight's gradient, a sum over tokens that cancels), the floor 2e-6; a key leaking
    across a document boundary or a position not restarting moves the losses by >= 1e-3."""
    cfg = recipe.model.ModelConfig.from_hf(write_config(Path(tempfile.mkdtemp()) / "c.json", recipe.config))
    S = recipe.seq_len
    lengths = [[S // 2 - 3, 5, S - S // 2 - 2], [S // 4, S - S // 4 - 3, 3]]  # the last of row 1: padding
    torch.manual_seed(0)
    model = recipe.model.Model(cfg)
    ids_BS = torch.randint(3, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(5))
    labels_BS = torch.roll(ids_BS, -1, 1)
    docs_BS = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    spans = [(b, sum(row[:d]), sum(row[:d + 1])) for b, row in enumerate(lengths) for d in range(len(row))]
    for b, _, hi in spans:
        labels_BS[b, hi - 1] = -100  # a document's last token predicts nothing (core/data.py)
    labels_BS[1, S - 3:] = -100  # padding, never trained
    labels_BS[0, 2] = -100  # and an untrained prompt token

    def losses_and_grads(model, packed: bool):
        model.zero_grad()
        losses = []
        if packed:
            h_BSH = model.trunk(ids_BS, positions_in_documents(docs_BS), doc_ids_BK=docs_BS)[0]
        for b, lo, hi in spans[:-1]:  # (the padding has no labels)
            h_1LH = h_BSH[b:b + 1, lo:hi] if packed else model.trunk(ids_BS[b:b + 1, lo:hi])[0]
            losses.append(model.cross_entropy_sum(h_1LH, labels_BS[b:b + 1, lo:hi]))
        sum(losses).backward()
        return torch.stack(losses).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (alone, alone_grads), (packed, packed_grads) = losses_and_grads(model, False), losses_and_grads(model, True)
    model64 = copy.deepcopy(model).double()  # float64, the same weights: each row's float64 comparison
    (alone64, alone64_grads), (packed64, packed64_grads) = losses_and_grads(model64, False), losses_and_grads(model64, True)
    flat = lambda grads: torch.cat([grads[n].flatten() for n in sorted(alone_grads)])
    # per tensor, its own noise: an ill-conditioned gradient (Gated DeltaNet's dt_bias and A_log, a sum over tokens
    # that cancels) moves by ~5e-4 under any regrouping of the same sums (the delta rule's chunk 8 instead of 64, no
    # documents) and by ~1e-11 in float64 packed vs alone; its fp32 noise is as large
    tensors = worst_bounded([(rel_err(packed_grads[n], g) if n in packed_grads else math.inf, n,
                              noise_bound(rel_err(g, alone64_grads[n]))) for n, g in alone_grads.items()]
                            + [(math.inf, f"only packed: {n}", 0.0) for n in packed_grads.keys() - alone_grads.keys()])
    all_grads = lambda packed, alone: rel_err(flat(packed), flat(alone)) if packed.keys() == alone.keys() else math.inf
    tensor64 = rel_err(packed64_grads[tensors[1]], alone64_grads[tensors[1]]) if tensors[1] in alone64_grads else None
    return [Result("documents-losses", "documents: packed + document mask = each alone: losses", rel_err(packed, alone),
                   noise_bound(rel_err(alone, alone64)), float64=rel_err(packed64, alone64)),
            Result("documents-grads", "documents: ... all gradients together", all_grads(packed_grads, alone_grads),
                   noise_bound(all_grads(alone_grads, alone64_grads)), float64=all_grads(packed64_grads, alone64_grads)),
            Result("documents-grad-tensors", "documents: ... each gradient tensor", tensors[0], tensors[2], tensors[1],
                   float64=tensor64)]


# ------------------------------------------------------------------------------------------------ layouts


def model_grads_worker(config_path, cp: int, ep: int, seq_len: int, recipe: str, float64: bool = False):
    """Model level at cp (x ep): each (ep) data rank has its own 2 sequences (one micro-batch) and each cp rank its
    2 of their 2*cp chunks; one process runs the same micro-batches whole over the full model, in fp32 and in
    float64 from the same weights. Both go train.py's way: Model.prepare_batch on the whole sequences (split for
    cp like the ids), forward_train, the objective of Model.loss_terms over the global batch's denominators.
    {quantity: (error against the fp32 process, noise: the fp32 process's error against the float64 one)} of
    every loss term, the expert load, whole-sequence logits and every parameter's gradient. float64: both models in
    float64 (the comparison of a row near its bound). Runs inside a process group the caller owns (layouts_worker)."""
    mod = importlib.import_module(f"recipes.{recipe}.model")
    args = parse_args(importlib.import_module(f"recipes.{recipe}.train").Args, ["--aux-loss-coef", str(AUX_COEF)])
    mesh = build_mesh(dp=1, cp=cp, ep=ep)
    cp_group, cp_rank, r = mesh.group("cp"), mesh.coord("cp"), mesh.data_rank
    cfg = mod.ModelConfig.from_hf(config_path)
    torch.manual_seed(0)
    model = mod.Model(cfg, ep_group=mesh.group("ep"), cp_group=cp_group)
    torch.manual_seed(0)
    full = mod.Model(cfg)
    if float64:
        model, full = model.double(), full.double()
    ids = torch.randint(0, cfg.vocab_size, (2 * ep, seq_len), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    labels[0, 5:9] = -100  # ignored labels inside a chunk
    terms = full.loss_terms(args)
    whole_positions = torch.arange(seq_len).expand(2, -1)
    extras = [full.prepare_batch(ids[2 * d:2 * d + 2], labels[2 * d:2 * d + 2], None, whole_positions) for d in range(ep)]
    counts = {"tokens": (labels != -100).sum(), "micro_batches": ep, **{n: sum(e[n].sum() for e in extras) for n in extras[0]}}
    per_rank = lambda ranks: {n: counts[t.per] if t.per is not None else ep * ranks for n, t in terms.items()}
    label = lambda name: {"lm": "loss", "aux": "aux loss"}.get(name, f"{name} loss")

    def one_process(m) -> dict:
        """Rank r's loss terms, expert load and logits and every gradient, computed by m alone."""
        outs, loads = [], []  # per micro-batch: TrainOutput, expert load [MoE layers, E]
        for d in range(ep):
            outs.append(m.forward_train(ids[2 * d:2 * d + 2], labels[2 * d:2 * d + 2], extras=extras[d]))
            loads.append(m.take_expert_load())
        sum(objective(o.terms, terms, per_rank(1)) for o in outs).backward()
        with torch.no_grad():
            found = {**{label(n): outs[r].terms[n].detach() for n in terms}, "expert load": loads[r],
                     "logits (whole sequences)": m(ids[2 * r:2 * r + 2])}
        for name, p in m.named_parameters():  # a routed expert's (Model.parameter_rules): this ep rank's rows
            experts = routed[name]
            found["grad " + name] = p.grad[held_experts(cfg.num_experts, ep, mesh.coord("ep"))] if experts else p.grad
        return found

    routed = {n: rule.expert_ids is not None for n, rule in parameter_rules(full).items()}
    ref64 = one_process(copy.deepcopy(full).double())
    ref = one_process(full)
    positions_BS = cp_positions(seq_len, cp_rank, cp)[None].expand(2, -1)
    mine = [split_for_cp(t[2 * r:2 * r + 2], cp_rank, cp) for t in (ids, labels)]
    my_extras = {n: split_for_cp(t, cp_rank, cp) for n, t in
                 model.prepare_batch(ids[2 * r:2 * r + 2], labels[2 * r:2 * r + 2], None, whole_positions).items()}
    out = model.forward_train(*mine, positions_BS, extras=my_extras)
    objective(out.terms, terms, per_rank(cp)).backward()

    load = model.take_expert_load()
    dist.all_reduce(load, group=cp_group)
    got = {"expert load": load}
    for n, t in out.terms.items():  # each cp rank's part of a per-token sum; a parameter-only term is whole on
        # every rank but counts its routed experts' part ep times (core/training.py:LossTerm): the mean over (cp, ep)
        t = t.detach().clone()
        dist.all_reduce(t, group=cp_group if terms[n].per is not None else mesh.group("cp", "ep"))
        got[label(n)] = t if terms[n].per is not None else t / (cp * ep)
    with torch.no_grad():  # whole sequences on every cp rank (sampling, evaluation)
        got["logits (whole sequences)"] = model(ids[2 * r:2 * r + 2])
    for name, p in model.named_parameters():
        grad = p.grad.clone()  # summed over the ranks replicating it: (cp) for experts, (cp, ep) for the rest
        dist.all_reduce(grad, group=mesh.group("dp", "cp") if routed[name] else mesh.group("dp", "cp", "ep"))
        got["grad " + name] = grad
    return {k: (rel_err(got[k], ref[k]), rel_err(ref[k], ref64[k])) for k in got}


def layouts_worker(recipe: str, jobs: dict, recipes_path: list[str] | None = None) -> dict:
    """Every job in turn on this rank, all in one process group: ("train", argv) -> run_train's result, ("train64",
    argv) -> the same in float64, ("grads" or "grads64", (config, cp, ep, seq_len)) -> model_grads_worker's errors
    (float64: in float64). recipes_path: the caller's recipes.__path__ (validate.py's snapshot), from which this
    rank imports recipes whatever its forkserver imported. train.py's closing destroy_mesh is skipped: a new
    rendezvous per run races with slower ranks still leaving the previous one."""
    if recipes_path is not None:
        recipes.import_from(recipes_path)
    dist.init_process_group("gloo")
    train = importlib.import_module(f"recipes.{recipe}.train")
    train.destroy_mesh = lambda: None
    results = {}
    for name, (kind, arg) in jobs.items():
        with float64_default() if kind == "train64" else contextlib.nullcontext():
            results[name] = run_train(arg, train.main) if kind.startswith("train") else \
                model_grads_worker(*arg, recipe=recipe, float64=kind == "grads64")
    dist.barrier()
    dist.destroy_process_group()
    return results


def in_float64(argv: list[str], hf_init: Path) -> list[str]:
    """A train.py run's argv again from hf_init's weights (where the float64 references start), its --out and
    --export-hf beside the fp32 run's, and a --resume from the float64 twin of the run it names (argparse keeps a
    repeated flag's last value); layouts_worker's "train64"."""
    extra = ["--hf-checkpoint", str(hf_init)]
    for flag in ("--out", "--export-hf"):
        if flag in argv:
            extra += [flag, argv[argv.index(flag) + 1] + "_64"]
    if "--resume" in argv:  # <run>/checkpoints/step_N -> <run>_64/checkpoints/step_N
        step = Path(argv[argv.index("--resume") + 1])
        extra += ["--resume", str(step.parents[1].with_name(step.parents[1].name + "_64") / "checkpoints" / step.name)]
    return argv + extra


@dataclass
class LayoutRow:
    """One row of the layout checks: the runs it reads (jobs of the rank groups, runs of this process) and
    compare(get, float64) -> (error, where, bound), get(name) giving a run's result. float64: the same comparison
    with every run it reads in float64 (its jobs again from the float64 reference's weights, a reference's float64
    run for the reference: FLOAT64_OF); its bound is then unused. A row without a float64 form says why
    (no_float64: a bf16 row; a check that the setup is what it should be, above its bound, needs none)."""
    id: str
    check: str
    reads: frozenset
    compare: typing.Callable
    above: bool = False
    no_float64: str = ""  # why it has no float64 form ("": it has one)


FLOAT64_OF = {"single": "single64", "docs single": "docs single64"}  # a one-process run's float64 twin


def against_one_process(job: str, reference: str):
    """A layout's compare: every rank's losses, grad norms and state against one process's (layout_errors), each
    tensor within noise_bound of its own rounding noise (the fp32 reference against its float64 twin)."""
    def compare(get, float64):
        worst = layout_errors(get(reference), get(job), reference64=None if float64 else get(FLOAT64_OF[reference]))
        return worst_bounded((e, f"{what} {w}", b) for what, (e, w, b) in worst.items())
    return compare


def same_as(job: str, other: str, first_step: int = 0):
    """compare of two runs of one layout that must agree bit for bit, rank by rank (from `first_step` of `other`):
    the same operations in the same order. In float64 their relative error (rounding: ~1e-16)."""
    def compare(get, float64):
        error, where = worst_error((e, f"rank {rank} {what} {w}") for rank, ((losses, norms, state), result) in
                                   enumerate(zip(get(other), get(job))) for what, (e, w, _) in layout_errors(
                                       (losses[first_step:], norms[first_step:], state), [result],
                                       error=rel_err if float64 else bitwise_error).items())
        return error, where, 0.0
    return compare


def model_level(job: str):
    """compare of model_grads_worker's errors: each quantity within noise_bound of its own noise."""
    def compare(get, float64):
        errors = [(e, f"rank {rank} {k}", noise_bound(noise)) for rank, found in enumerate(get(job))
                  for k, (e, noise) in found.items()]
        return max(errors)[:2] + (0.0,) if float64 else worst_bounded(errors)
    return compare


def export_of(job: str, folder: Path, single: Path):
    """compare of the Hugging Face folder a layout's run exported against one process's export, each tensor within
    noise_bound of its noise (float64: both runs' float64 twins' folders, `_64`)."""
    twin = lambda path: path.with_name(path.name + "_64")

    def compare(get, float64):
        get(job)  # (the run that wrote it)
        exported, reference = (folder_tensors(twin(path) if float64 else path) for path in (folder, single))
        reference64 = None if float64 else folder_tensors(twin(single))
        return worst_bounded(
            [(rel_err(exported[n], t) if n in exported else math.inf, n,
              0.0 if float64 else noise_bound(rel_err(t, reference64[n]))) for n, t in reference.items()]
            + [(math.inf, f"exported, not in 1 process's: {n}", 0.0) for n in exported.keys() - reference.keys()])
    return compare


def bf16_step1(quantity: int):
    """compare of the bf16 rows: pp2 in bf16 against dp2 in bf16 at step 1 (`quantity` 0: the loss, 1: the grad
    norm). Both compute each micro-batch's forward with the same bf16 operations on the same bf16 weights (FSDP2
    gathers them), so the loss differs only in the order of fp32 sums: its bound is noise_bound of the step-1 loss's
    own fp32 rounding (the one-process fp32 run against its float64 twin), as the fp32 layout rows'. The grad norm
    may differ more: where a parameter serves twice in one backward, dp2 adds the two gradients in bf16 and pp2 in
    fp32 (two backward segments): its bound is that, or BF16_SHARE of the distance bf16 itself puts between one bf16
    process's step-1 grad norm and one fp32 process's, if larger. A hidden state carried on in fp32 after a stage
    hand-off moves the loss by 1.6x its bound, a dropped term the grad norm by the term's share of it
    (tests/test_skill_validate.py: PLANTS)."""
    def compare(get, float64):
        step1 = lambda run: run[quantity][0]
        pp2, dp2 = step1(get("pp2 bf16")[0]), step1(get("dp2 bf16")[0])
        fp32 = noise_bound(abs(step1(get("single")) / step1(get("single64")) - 1))
        bf16 = abs(step1(get("single bf16")) / step1(get("single")) - 1)
        bound = fp32 if quantity == 0 else max(fp32, BF16_SHARE * bf16)
        return abs(pp2 / dp2 - 1), f"one bf16 process is {bf16:.1e} from fp32, its fp32 noise x16 {fp32:.1e}", bound
    return compare


def layout_rows(recipe: Recipe, workdir: Path, features, placements: dict) -> list[LayoutRow]:
    """Every layout row the recipe's features allow, in the table's order (LAYOUT_ROWS' ids)."""
    documents, recompute = "document_mask" in features, "recompute" in features
    row = lambda id, check, reads, compare, **kw: LayoutRow(id, check, frozenset(reads), compare, **kw)
    rows = [row("clips", "1 process clips (global norm exercised): max grad norm", {"single"},
                lambda get, _: (max(get("single")[1]), "", CLIP), above=True)]
    for name in [*LAYOUTS, *PLACED]:
        label = f"{name} {','.join(map(str, placements[name]))}" if name in placements else name
        rows.append(row(name.replace(" ", "-"), f"{label} = 1 process: losses, grad norms, weights, buffers",
                        {"single", "single64", name}, against_one_process(name, "single")))
    if documents:
        rows.append(row("docs-mask-acts", "documents: the document mask changes the 1-process losses",
                        {"docs single", "docs unmasked"}, lambda get, _: (rel_err(torch.tensor(get("docs single")[0]),
                        torch.tensor(get("docs unmasked")[0])), "", LAYOUT_TOLERANCE), above=True))
        rows += [row("docs-" + name, f"documents + loss masks {name} = 1 process: losses, grad norms, weights, buffers",
                     {"docs single", "docs single64", "docs " + name}, against_one_process("docs " + name, "docs single"))
                 for name in LAYOUTS]
        if recompute:
            rows.append(row("docs-pp2-recompute", "documents pp2 --recompute layer = pp2", {"docs pp2", "docs pp2 recompute"},
                            same_as("docs pp2 recompute", "docs pp2")))
    rows += [row(f"{name}-model", f"{name} model: loss, aux, load, logits, grads", {f"grads {name}"},
                 model_level(f"grads {name}")) for name in ("cp2", "cp2xep2")]
    rows.append(row("resume", "resume at ep2 from step 2 = uninterrupted run", {"full", "resumed"},
                    same_as("resumed", "full", first_step=2)))
    if recompute:
        rows += [row("pp2xep2-recompute", "pp2xep2 --recompute layer = pp2xep2", {"pp2xep2", "pp2xep2 recompute"},
                     same_as("pp2xep2 recompute", "pp2xep2")),
                 row("cp2-recompute", "cp2 --recompute attention = cp2", {"cp2", "cp2 recompute"},
                     same_as("cp2 recompute", "cp2"))]
    bf16 = {"pp2 bf16", "dp2 bf16", "single bf16", "single", "single64"}
    rows += [row("pp2-bf16-loss", "pp2 bf16 = dp2 bf16 at step 1: loss", bf16, bf16_step1(0), no_float64="bf16"),
             row("pp2-bf16-grad-norm", "pp2 bf16 = dp2 bf16 at step 1: grad norm", bf16, bf16_step1(1),
                 no_float64="bf16"),
             row("bf16-differs", "bf16 runs in bf16: pp2's step-1 loss vs fp32", {"pp2 bf16", "single"},
                 lambda get, _: (abs(get("pp2 bf16")[0][0][0] / get("single")[0][0] - 1), "", 0.0), above=True)]
    rows += [row(f"{name.replace(' ', '-')}-export", f"{name} export = 1-process export", {"single", "single64", name},
                 export_of(name, workdir / f"hf_{name.replace(' ', '_')}", workdir / "hf_single"))
             for name in ("pp2xep2", "ep4 placed")]
    return rows


def layout_results(recipe: Recipe, data, workdir: Path, meanwhile=lambda: [], progress=lambda group: None, rows=None,
                   near: float = NEAR_BOUND) -> list[Result]:
    """One group of 2 ranks and one of 4, started together, each running all of its jobs in one process group, and
    meanwhile the references in this process (fp32; float64 from the same weights, whose distance from the fp32 run
    is each tensor's rounding noise; bf16), after `meanwhile()`'s rows (other checks this process runs while the
    ranks start and run; they come first in the result). The rows (layout_rows): the five layouts and the two
    placements (PLACED) against fp32 (pp2xep2 and ep4 placed also exporting), the same on conversations, the
    model-level cp checks, resume at ep2, recompute at pp2xep2 and cp2 against the same layout without, pp2 in bf16
    against dp2 in bf16. With `rows` (ids of LAYOUT_ROWS) only the jobs and references those rows read run. A row
    over its bound or within `near` of it runs its jobs again in float64, from the float64 reference's weights, and
    makes its comparison again on them (Result.float64). A row that cannot be computed, or whose ranks failed, says
    so (Result.failed); the others are still made."""
    wanted = lambda row: rows is None or row in rows
    features = model_features(recipe)
    num_experts = recipe.model.ModelConfig.from_hf(write_config(workdir / "check_config.json", recipe.config)).num_experts
    placements = {name: table(num_experts) for name, table in PLACED.items()}
    chosen = [r for r in layout_rows(recipe, workdir, features, placements) if wanted(r.id)]
    need = set().union(*(r.reads for r in chosen))
    config = workdir / "check_config.json"
    args = lambda out, **extra: check_args(recipe, config, data, workdir / out, **extra)
    # conversations: whole documents with loss masks, --document-mask on by default for them (core/data.py)
    chats = write_counting_chats(workdir / "chats", recipe.seq_len)
    chat_args = lambda out, **extra: check_args(recipe, config, chats, workdir / out, **extra)
    jobs = {2: {"cp2 recompute": ("train", args("cp2r", cp=2, recompute="attention")),
                "pp2 bf16": ("train", args("pp2bf16", pp=2, dtype="bf16", steps=1)),
                "dp2 bf16": ("train", args("dp2bf16", dp=2, dtype="bf16", steps=1)),
                # resume at ep=2: 3 steps with a checkpoint at 2, then again from that checkpoint
                "full": ("train", args("full", ep=2, steps=3, ckpt_every=2)),
                "resumed": ("train", args("resumed", ep=2, steps=3, resume=workdir / "full/checkpoints/step_00000002")),
                "grads cp2": ("grads", (config, 2, 1, recipe.seq_len)),
                "docs pp2 recompute": ("train", chat_args("docs_pp2r", pp=2, recompute="layer"))},
            4: {"grads cp2xep2": ("grads", (config, 2, 2, recipe.seq_len)),
                # DualPipeV with the experts' rows dispatched again in backward (core/moe.py recompute_dispatch)
                "pp2xep2 recompute": ("train", args("pp2xep2r", pp=2, ep=2, recompute="layer"))}}
    for name, layout in LAYOUTS.items():
        export = {"export_hf": workdir / "hf_pp2xep2"} if name == "pp2xep2" else {}
        jobs[math.prod(layout.values())][name] = ("train", args(name, **layout, **export))
        jobs[math.prod(layout.values())]["docs " + name] = ("train", chat_args("docs_" + name, **layout))
    for name, table in placements.items():
        ep = int(name[2])
        # ep4: a rank without experts, whose backward dispatches again under --recompute layer like the others'
        export = {"export_hf": workdir / "hf_ep4_placed",
                  **({"recompute": "layer"} if "recompute" in features else {})} if ep == 4 else {}
        jobs[ep][name] = ("train", args(name.replace(" ", "_"), ep=ep, expert_placement=",".join(map(str, table)),
                                        **export))
    jobs = {world: {name: job for name, job in world_jobs.items() if name in need} for world, world_jobs in jobs.items()}
    # both process groups start now and run side by side with the references below: a rank waiting in a collective
    # (pipeline bubbles, all-to-alls) leaves its core to another process, so the 6 ranks and this process keep 2
    # cores busy. Their deadline doubles multiproc's (they share the cores)
    start = lambda jobs: {world: start_ranks(world, layouts_worker, recipe.name, world_jobs, list(recipes.__path__),
                                             timeout=2 * TIMEOUT_S) for world, world_jobs in jobs.items() if world_jobs}
    hf_init = workdir / "hf_init"  # where every float64 run starts: the fp32 runs' initial weights, exported after
    # one step at lr 0 (float64 draws other random numbers), then loaded into a model built in float64 (torch's default
    # dtype, which train.py's model, optimizer and loss follow)
    init = lambda: hf_init.exists() or recipe.train.main(args("init", steps=1, lr=0.0, expert_bias_rate=0.0,
                                                              export_hf=hf_init))
    groups, refs = start(jobs), {}
    # this process computes beside the ranks (one thread each, tests/multiproc.py) on the same cores: with one thread
    # too, its idle workers do not spin
    try:
        with one_thread():
            results = meanwhile()
            progress("layouts")
            references = {"single": args("single", export_hf=workdir / "hf_single"),
                          "single bf16": args("single_bf16", dtype="bf16", steps=1),
                          "docs single": chat_args("docs_single"),
                          "docs unmasked": chat_args("docs_unmasked", no_document_mask=True)}
            references64 = {"single64": args("single64", export_hf=workdir / "hf_single_64"),
                            "docs single64": chat_args("docs_single64")}
            for name, argv in references.items():
                if name in need:
                    refs[name] = run_train(argv, recipe.train.main)
            for name, argv in references64.items():
                if name in need:
                    init()
                    with float64_default():
                        refs[name] = run_train(argv + ["--hf-checkpoint", str(hf_init)], recipe.train.main)
    except BaseException:
        for group in groups.values():
            group.kill()
        raise
    runs, failed = {}, {}
    for world, group in groups.items():  # per job: every rank's result
        try:
            per_rank = group.join()
            runs.update({name: [rank[name] for rank in per_rank] for name in jobs[world]})
        except Exception as e:  # (its ranks' output is the caller's: runs.log under validate.py)
            failed.update(dict.fromkeys(jobs[world], f"its {world} ranks failed ({failure(e)}); their output: runs.log"))
    get = lambda name: refs[name] if name in refs else runs[name]

    def compared(row: LayoutRow, get, float64: bool, failed: dict) -> tuple:
        broken = [failed[name] for name in sorted(row.reads) if name in failed]
        if broken:
            raise RuntimeError(broken[0])
        return row.compare(get, float64)

    made = []
    for row in chosen:
        try:
            error, where, bound = compared(row, get, False, failed)
            made.append(Result(row.id, row.check, error, bound, where, row.above))
        except Exception as e:
            made.append(Result(row.id, row.check, math.nan, 0.0, failed=failure(e)))
    # rows over their bound or near it: their jobs again in float64 from the float64 references' weights, each row's
    # comparison made again on them
    again = [(row, r) for row, r in zip(chosen, made) if r.wants_float64(near)]
    for row, r in again:
        r.float64_missing = row.no_float64 and f"{row.no_float64} by design"
    again = [(row, r) for row, r in again if not row.no_float64]
    jobs64 = {}
    for row, _ in again:
        for name in row.reads:
            world = next((world for world, world_jobs in jobs.items() if name in world_jobs), None)
            if world is not None:
                kind, arg = jobs[world][name]
                jobs64.setdefault(world, {})[name] = ("train64", in_float64(arg, hf_init)) if kind == "train" \
                    else ("grads64", arg)
    if jobs64:
        progress(f"float64 runs of the rows over or near their bound ({', '.join(r.id for _, r in again)})")
        init()
    runs64, failed64 = {}, {}
    for world, group in start(jobs64).items():
        try:
            per_rank = group.join()
            runs64.update({name: [rank[name] for rank in per_rank] for name in jobs64[world]})
        except Exception as e:
            failed64.update(dict.fromkeys(jobs64[world], f"its {world} ranks failed in float64 ({failure(e)})"))
    get64 = lambda name: refs[FLOAT64_OF[name]] if name in FLOAT64_OF else runs64[name]
    for row, r in again:  # (a row whose float64 comparison cannot be made says why in the table)
        try:
            r.float64 = compared(row, get64, True, failed64)[0]
        except Exception as e:
            r.float64_missing = failure(e)
    return results + made


@contextlib.contextmanager
def float64_default():
    """torch's default dtype float64 inside (train.py builds its model, and so its optimizer state, in it)."""
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------- helpers of per-recipe tests


def assert_partial_model_reads_only_its_tensors(recipe, path, num_tensors: int) -> None:
    """Layer 1 with experts 2 and 3 only, no embedding or head: `num_tensors` HF tensors read, all of layer 1,
    and the partial model's weights are exactly the full model's slice."""
    cfg = recipe.ModelConfig.from_hf(path)
    full = recipe.Model(cfg)
    recipe.load_hf_checkpoint(full, path)
    part = recipe.Model(cfg, layers=[1], expert_ids=[2, 3], embed=False, head=False)
    names = recipe.load_hf_checkpoint(part, path)
    assert all(n.startswith("model.layers.1.") for n in names)
    experts_read = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n and n.split(".")[5].isdigit()}
    assert experts_read in (set(), {2, 3})  # per-expert keys: 2 and 3 only (fused keys: sliced rows, not named)
    assert len(names) == len(set(names)) == num_tensors, sorted(names)
    full_sd = full.state_dict()
    for key, value in part.state_dict().items():
        ref = full_sd[key][2:4] if ".mlp.experts." in key else full_sd[key]
        assert torch.equal(value, ref), key


def assert_aux_loss_matches(hf_class, recipe_model: ModuleType, path, vocab_size: int, grad_pairs) -> None:
    """The HF folder `path` loaded by transformers' hf_class and by the recipe's model.py: transformers' aux_loss
    (output_router_logits) equals forward_train's, and the gradients of each (ours, transformers') parameter pair
    in grad_pairs(model, ref) agree to 1e-5 relative."""
    ref = hf_class.from_pretrained(path, dtype=torch.float32)
    model = recipe_model.Model(recipe_model.ModelConfig.from_hf(path))
    recipe_model.load_hf_checkpoint(model, path)
    ids = torch.randint(0, vocab_size, (2, 20))
    ref_aux = ref(input_ids=ids, output_router_logits=True).aux_loss
    aux = model.forward_train(ids, ids).aux_loss
    torch.testing.assert_close(aux, ref_aux, rtol=1e-6, atol=0)
    ref_aux.backward()
    aux.backward()
    for ours, theirs in grad_pairs(model, ref):
        assert ((ours.grad - theirs.grad).norm() / theirs.grad.norm()).item() <= 1e-5
