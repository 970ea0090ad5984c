"""Issue 37's retention grid: S-NIAH with retained tokens against the same cache budget without them.

    python experiments/retention.py run [--only PATTERN] [--dry-run]   # the missing cells, one `linjax eval ruler` each
    python experiments/retention.py run --fresh | --prose               # the fresh-prompt or natural-text cells
    python experiments/retention.py perplexity [--windows N]           # WikiText-2 with retention on and off
    python experiments/retention.py lambada [--limit N]                # LAMBADA with retention on and off
    python experiments/retention.py report                             # results/retention.md from the cells written

The grid: S-NIAH 1, 2 and 3 (RULER's niah_single_1/2/3) at 1,024, 2,048 and 4,096 tokens, 20 samples
per cell, seed 0, at total cache budgets of 128 and 256 tokens per layer and kv head, for

    final-recall   the final recipe (results/runs/gdn-w56-s8-shortconv, no further training) read as
                   sinks 8 + window 56 + 64 (or 192) tokens retained by LoLA's self-recall error (the default)
    final-keynorm  the same, retained by key norm
    final-recall-block8  the same as final-recall, chosen 8 tokens at a time (`retain_block` 8: a block-aligned
                   window, the form that trains and prefills by blocks)
    trained-recall-block8  results/runs/gdn-w56-s8-shortconv-retain64, the final recipe trained with 64 retained
                   tokens in blocks of 8 (configs/claims/), read the same way; its cells wait for the run
    final          the same run without retention at the same total budget: sinks 8 + window 120 (or 248)
    window-only    SmolLM2-135M as sinks 8 + window 120 (or 248) softmax, no linear state
    original       SmolLM2-135M with full attention (one cell per task and length: it has no budget)

`--fresh`: the headline S-NIAH-1 cells again on prompts never used in development (seed 1, 100 each).
`--prose`: S-NIAH-2 with WikiText-2's test articles as the haystack, text no trained model here saw (the
essays are training text), for the original model, window-only and each score in blocks of 8
(final-keynorm-block8: as final-keynorm, 8 at a time; final-attention-block8: retained by the softmax mass a
token received while in the window, H2O-style, 8 at a time), 50 prompts of seed 1 at 1,024 and 2,048 tokens.

Each cell is results/retention/<variant>-<budget>-<task>-<length>[-seed<S>][-<haystack>].json (budget "full"
for the original, task niah1/niah2/niah3), as `linjax eval ruler --out` writes it (after every sample); `run`
skips a cell whose file is complete and goes on with a partial one (`--resume`), so it can be stopped and started again.
`report` reads whatever cells exist; a file whose settings are not the cell's is shown as such and counts as
not run.

`perplexity` scores the first 64 WikiText-2 test windows of 1,024 tokens (the claims rows' 64 windows)
with the final recipe read three ways: 8 + 56 + 64 retained by recall, 8 + 120 without retention (the
same 128-token budget) and 8 + 56 as trained. The readings take turns window by window, each saved
after every window (results/retention/wikitext2-<reading>.json), so a stopped run goes on from where it
was and the readings always share their first windows; `report` compares them on those windows with the
claims' paired bootstrap over articles, against the final recipe's seed spread on the same windows.

`lambada` scores LAMBADA (OpenAI), the first 1,000 examples as the claims table's columns, the same three
readings one after another, as `linjax eval lambada` does (results/retention/lambada-<reading>.json, saved
after every batch, so a stopped run goes on); `report` compares their accuracy example by example (a paired
bootstrap over examples) against the final recipe's seed spread on the same examples.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script: the repository root holds the `experiments` package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import stats  # noqa: E402
from experiments.stats import Z95, paired_accuracy_difference, wilson_interval  # noqa: E402,F401
from linjax.files import write_text  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "results")
CELLS = os.path.join(RESULTS, "retention")
REPORT = os.path.join(RESULTS, "retention.md")

TRAINED_RUN = "results/runs/gdn-w56-s8-shortconv"  # the final recipe, seed 1 (results/claims.md)
RETAIN_TRAINED_RUN = "results/runs/gdn-w56-s8-shortconv-retain64"  # trained with retain 64, retain_block 8
ORIGINAL = "smollm2-135m"
TASKS = {"niah1": "niah_single_1", "niah2": "niah_single_2", "niah3": "niah_single_3"}
LENGTHS = (1024, 2048, 4096)
SINKS, WINDOW = 8, 56  # the final recipe's, kept when tokens are retained
RETAINED = {128: 64, 256: 192}  # total budget -> retained tokens: 8 + 56 + 64 and 8 + 56 + 192
SAMPLES, SEED = 20, 0
# The headline cells again on prompts never used while developing retention (seed FRESH_SEED), more samples each.
FRESH_SEED, FRESH_SAMPLES = 1, 100
FRESH_LENGTHS = (2048, 4096)
FRESH_VARIANTS = ("final-recall-block8", "trained-recall-block8", "window-only")
# S-NIAH-2 in a haystack that is not linjax's training text: the claims rows (and so the trained models here)
# train on web text and on the Paul Graham essays that are S-NIAH-2's default haystack; WikiText-2's test file
# is in no training set of the project. Prompts of FRESH_SEED; one budget, each score in blocks of 8.
PROSE_HAYSTACK = "wikitext"
PROSE_LENGTHS = (1024, 2048)
PROSE_BUDGET, PROSE_SAMPLES = 128, 50
PROSE_VARIANTS = ("original", "window-only", "final-recall-block8", "final-keynorm-block8", "final-attention-block8",
                  "trained-recall-block8")

# name -> (what it is, the model argument, retained-token score or None for no retention, window only?)
VARIANTS = {
    "final-recall": ("final recipe + retained by recall (the default score)", TRAINED_RUN, "recall", False),
    "final-keynorm": ("final recipe + retained by key norm", TRAINED_RUN, "key_norm", False),
    "final-recall-block8": ("final recipe + retained by recall, 8 at a time (block-aligned window)", TRAINED_RUN,
                            "recall", False),
    "final-keynorm-block8": ("final recipe + retained by key norm, 8 at a time", TRAINED_RUN, "key_norm", False),
    "final-attention-block8": ("final recipe + retained by the attention mass received in the window, 8 at a time",
                               TRAINED_RUN, "attention", False),
    "trained-recall-block8": ("final recipe trained with 64 retained in blocks of 8, read so", RETAIN_TRAINED_RUN,
                              "recall", False),
    "final": ("final recipe, no retention (window = budget − 8)", TRAINED_RUN, None, False),
    "window-only": ("window-only (sinks + window softmax, no state)", ORIGINAL, None, True),
    "original": ("original model (full attention)", ORIGINAL, None, False),
}

# the grid's variants (the others are read only in the natural-text cells)
GRID_VARIANTS = tuple(v for v in VARIANTS if v not in ("final-keynorm-block8", "final-attention-block8"))

# variant -> retain_block (`linjax eval ruler --retain-block`); every other variant selects token by token
BLOCKS = {"final-recall-block8": 8, "final-keynorm-block8": 8, "final-attention-block8": 8,
          "trained-recall-block8": 8}

# WikiText-2 with retention on and off (the issue: "must not get worse by more than the seed spread").
PPL_WINDOWS = 64  # the claims rows' 64 windows of experiments/claims.py's SEQ_LEN tokens
READINGS = {  # name -> (what it is, window, retained), all with SINKS sinks
    "retained": ("final recipe + 64 retained by recall (8 + 56 + 64)", WINDOW, 64),
    "window-120": ("final recipe, no retention, same budget (8 + 120)", 128 - SINKS, 0),
    "as-trained": ("final recipe as trained (8 + 56)", WINDOW, 0),
}
SEED_ROWS = ("gdn-w56-s8-shortconv", "gdn-w56-s8-shortconv-seed2")  # the final recipe's two seeds
SEED_ROWS_LAMBADA = ("gdn-w56-s8-shortconv", "gdn-w56-s8-shortconv-seed3")  # the two with all of LAMBADA scored
LAMBADA_EXAMPLES = 1000  # the claims table's LAMBADA columns

# The claim: S-NIAH-1 at 2,048 tokens with a 128-token total cache.
CLAIM_TASK, CLAIM_LENGTH, CLAIM_BUDGET, CLAIM_ACCURACY = "niah1", 2048, 128, 0.8


@dataclass(frozen=True)
class Cell:
    variant: str
    budget: int | None  # None: the original model's full cache
    task: str  # a key of TASKS
    length: int
    seed: int = SEED  # the prompts' seed; another than SEED names the cell with it
    samples: int = SAMPLES
    haystack: str | None = None  # a key of haystack_files(); None: the task's default (the essays); names the cell

    @property
    def name(self) -> str:
        fresh = "" if self.seed == SEED else f"-seed{self.seed}"
        haystack = f"-{self.haystack}" if self.haystack else ""
        return f"{self.variant}-{self.budget or 'full'}-{self.task}-{self.length}{fresh}{haystack}"

    @property
    def path(self) -> str:
        return os.path.join(CELLS, f"{self.name}.json")

    @property
    def retain(self) -> int:
        return RETAINED[self.budget] if VARIANTS[self.variant][2] else 0

    def expected_settings(self) -> dict:
        """What `linjax eval ruler` records in the cell's JSON when run with `arguments()`."""
        _, _, score, window_only = VARIANTS[self.variant]
        expected = {"tasks": [TASKS[self.task]], "lengths": [self.length], "samples": self.samples, "seed": self.seed,
                    "budgets": [self.budget] if self.budget else [], "window_only": window_only, "retain": self.retain}
        if self.budget:
            expected["sinks"] = SINKS
        if score:
            expected["retain_score"] = score
        if self.variant in BLOCKS:
            expected["retain_block"] = BLOCKS[self.variant]
        return expected

    def arguments(self) -> list[str]:
        """`linjax eval ruler` arguments that write this cell."""
        _, model, score, window_only = VARIANTS[self.variant]
        args = ["ruler", model, "--tasks", TASKS[self.task], "--lengths", str(self.length),
                "--samples", str(self.samples), "--seed", str(self.seed)]
        if self.budget:
            args += ["--budgets", str(self.budget), "--sinks", str(SINKS)]
        if window_only:
            args.append("--window-only")
        if score:
            args += ["--retain", str(self.retain), "--retain-score", score]
        if self.variant in BLOCKS:
            args += ["--retain-block", str(BLOCKS[self.variant])]
        if self.haystack:
            args += ["--haystack", os.path.relpath(haystack_files()[self.haystack], ROOT)]
        return args + ["--out", os.path.relpath(self.path, ROOT), "--resume"]


def haystack_files() -> dict:
    """Haystack name -> its file, for cells that do not use the task's default haystack."""
    return {PROSE_HAYSTACK: claims_module().WIKITEXT}


def grid() -> list[Cell]:
    """Every cell, the claim's first (so a partial run decides it soonest), then budget by budget."""
    cells = [Cell("original", None, task, length) for task in TASKS for length in LENGTHS]
    cells += [Cell(variant, budget, task, length) for budget in RETAINED for task in TASKS for length in LENGTHS
              for variant in GRID_VARIANTS if variant != "original"]
    claim = {claim_cells()["retention"], claim_cells()["window-only"]}
    return sorted(cells, key=lambda c: c not in claim)  # a stable sort: the rest keep their order


def claim_cells() -> dict:
    return {"retention": Cell("final-recall", CLAIM_BUDGET, CLAIM_TASK, CLAIM_LENGTH),
            "blocks": Cell("final-recall-block8", CLAIM_BUDGET, CLAIM_TASK, CLAIM_LENGTH),
            "trained": Cell("trained-recall-block8", CLAIM_BUDGET, CLAIM_TASK, CLAIM_LENGTH),
            "key_norm": Cell("final-keynorm", CLAIM_BUDGET, CLAIM_TASK, CLAIM_LENGTH),
            "window-only": Cell("window-only", CLAIM_BUDGET, CLAIM_TASK, CLAIM_LENGTH)}


# ----------------------------------------------------------------------------- run


def fresh_grid() -> list[Cell]:
    """The headline cells on fresh prompts: S-NIAH-1 at FRESH_LENGTHS and both budgets, training-free and
    trained retention (both in blocks of 8) and window-only, FRESH_SAMPLES prompts of seed FRESH_SEED each;
    the 2,048-token cells first."""
    return [Cell(variant, budget, "niah1", length, FRESH_SEED, FRESH_SAMPLES) for length in FRESH_LENGTHS
            for budget in RETAINED for variant in FRESH_VARIANTS]


def prose_grid() -> list[Cell]:
    """S-NIAH-2 with the needle in WikiText-2's articles (PROSE_HAYSTACK): the original model, window-only and
    each retention score at PROSE_BUDGET, PROSE_SAMPLES prompts of seed FRESH_SEED per cell, shorter first."""
    return [Cell(variant, None if variant == "original" else PROSE_BUDGET, "niah2", length, FRESH_SEED,
                 PROSE_SAMPLES, PROSE_HAYSTACK) for length in PROSE_LENGTHS for variant in PROSE_VARIANTS]


def run(only: str | None = None, dry_run: bool = False, fresh: bool = False, prose: bool = False) -> list[Cell]:
    """Runs every missing cell whose name matches `only` (a shell pattern, e.g. 'final-recall-128-*') of the
    grid, with `fresh` of the fresh-prompt cells, with `prose` of the natural-text haystack's; returns the
    cells run (or, with `dry_run`, that would be)."""
    cells = fresh_grid() if fresh else prose_grid() if prose else grid()
    todo = [c for c in cells if read_cell(c) is None and (not only or fnmatch.fnmatchcase(c.name, only))]
    if only and not any(fnmatch.fnmatchcase(c.name, only) for c in cells):
        sys.exit(f"--only {only!r} matches no cell; cell names look like final-recall-128-niah1-2048 "
                 "or original-full-niah3-4096")
    untrained = [c for c in todo if not model_ready(VARIANTS[c.variant][1])]
    if untrained:
        print(f"skipping {len(untrained)} cells whose run is not trained yet: "
              + ", ".join(sorted({VARIANTS[c.variant][1] for c in untrained})))
        todo = [c for c in todo if c not in untrained]
    linjax = os.path.join(os.path.dirname(sys.executable), "linjax")  # the installed command
    for i, cell in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {cell.name}: linjax eval {' '.join(cell.arguments())}", flush=True)
        if not dry_run:
            os.makedirs(CELLS, exist_ok=True)
            subprocess.run([linjax, "eval", *cell.arguments()], cwd=ROOT, check=True)
    if not todo:
        print("every matching cell is already written")
    return todo


def model_ready(model: str) -> bool:
    """A run directory is ready once training has finished (its linjax.json exists); a named model always is."""
    return not model.startswith("results/runs/") or os.path.exists(os.path.join(ROOT, model, "linjax.json"))


def claims_module():
    """experiments/claims_data.py (the claims rows' WikiText-2 settings and per-window files)."""
    from experiments import claims_data

    return claims_data


def _read(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def ppl_path(reading: str) -> str:
    return os.path.join(CELLS, f"wikitext2-{reading}.json")


def read_ppl(reading: str):
    """The reading's per-window results ({'article', 'nll', 'tokens', ...}), or None."""
    return _read(ppl_path(reading))


def perplexity(windows: int = PPL_WINDOWS) -> None:
    """Scores the first `windows` WikiText-2 windows with every reading in turn, saving after each window."""
    from linjax.eval.models import load_model
    from linjax.eval.perplexity import continues, score_in_turn, text_windows, token_nll_function
    from linjax.files import write_json
    from linjax.linearize import with_budget

    claims = claims_module()
    model, tokenizer, _ = load_model(os.path.join(ROOT, TRAINED_RUN))
    with open(claims.WIKITEXT, encoding="utf-8") as f:
        texts, articles = text_windows(tokenizer, f.read(), claims.SEQ_LEN, max_windows=windows)
    readings = {}
    for reading, (_, window, retain) in READINGS.items():
        earlier = read_ppl(reading) or {"article": [], "nll": [], "tokens": []}
        if not continues(earlier, texts, articles):
            sys.exit(f"{os.path.relpath(ppl_path(reading), ROOT)} holds other windows; move it away to score again")
        reader = with_budget(model, sinks=SINKS, window=window, retain=retain)
        scores = {key: earlier.get(key, []) for key in ("nll", "tokens", "position_nll", "position_tokens")}
        readings[reading] = (token_nll_function(reader), texts, scores)

    def save(reading, scores, index, seconds):
        label, window, retain = READINGS[reading]
        write_json(ppl_path(reading), {
            "model": TRAINED_RUN, "reading": label, "sinks": SINKS, "window": window, "retain": retain,
            "retain_score": "recall" if retain else None, "seq_len": claims.SEQ_LEN, "windows_asked": len(texts),
            "complete": index + 1 == len(texts), **scores, "article": articles[:index + 1]})

    score_in_turn(readings, save, progress=True)


def lambada_path(reading: str) -> str:
    return os.path.join(CELLS, f"lambada-{reading}.json")


def lambada(limit: int = LAMBADA_EXAMPLES) -> None:
    """Scores the first `limit` LAMBADA examples with every reading in turn, saving after each batch."""
    from linjax.eval import lambada as scorer
    from linjax.eval.models import load_model
    from linjax.files import write_json
    from linjax.linearize import with_budget

    claims = claims_module()
    model, tokenizer, _ = load_model(os.path.join(ROOT, TRAINED_RUN))
    texts = scorer.read_texts(claims.DATA, limit)
    # the readings without retention first: they take minutes, the retained one (token by token) far longer,
    # and the report compares them on the examples all have
    for reading, (label, window, retain) in sorted(READINGS.items(), key=lambda item: item[1][2]):
        earlier = _read(lambada_path(reading)) or {"examples": []}
        if earlier.get("limit", limit) != limit:
            sys.exit(f"{os.path.relpath(lambada_path(reading), ROOT)} scored the first {earlier['limit']} examples; "
                     f"score with --limit {earlier['limit']}, or move it away")
        done = earlier["examples"]
        if len(done) >= len(texts):
            continue

        def save(results, reading=reading, label=label, window=window, retain=retain, done=done):
            examples = done + results
            write_json(lambada_path(reading), {
                "model": TRAINED_RUN, "reading": label, "sinks": SINKS, "window": window, "retain": retain,
                "retain_score": "recall" if retain else None, "limit": limit,
                "complete": len(examples) == len(texts), **scorer.summary(examples), "examples": examples})

        print(f"{reading}: LAMBADA examples {len(done) + 1}-{len(texts)}")
        reader = with_budget(model, sinks=SINKS, window=window, retain=retain)
        scorer.score(reader, tokenizer, texts, progress=True, on_batch=save, done=len(done))


def lambada_lines() -> list[str]:
    """The report's LAMBADA section: each reading's accuracy on the examples all have, and retention's
    paired difference from the others, beside the seed spread on the same examples."""
    from linjax.eval.lambada import summary

    scored = {reading: _read(lambada_path(reading)) for reading in READINGS}
    lines = ["## LAMBADA with retention on", ""]
    if any(v is None or not v["examples"] for v in scored.values()):
        return lines + ["Not run yet: `python experiments/retention.py lambada`.", ""]
    n = min(len(v["examples"]) for v in scored.values())
    correct = {r: [e["greedy"] for e in v["examples"][:n]] for r, v in scored.items()}
    lines += [f"LAMBADA (OpenAI), the first {n:,} examples, the final recipe read three ways, scored as `linjax eval "
              "lambada` scores them (lm-eval's lambada_openai); Δ: accuracy with retention minus the other's, in "
              "points, 95% paired bootstrap interval over examples.", "",
              "| reading | acc | ppl | retained minus this: Δ acc [95%] |", "|---|---|---|---|"]
    for reading, (label, _, _) in READINGS.items():
        examples = scored[reading]["examples"][:n]
        figures = summary(examples)
        delta = "—" if reading == "retained" else "{:+.1f} [{:+.1f}, {:+.1f}]".format(
            *paired_accuracy_difference(correct["retained"], correct[reading]))
        lines.append(f"| {label} | {100 * figures['acc']:.1f} | {figures['perplexity']:.2f} | {delta} |")
    claims = claims_module()
    seeds = [_read(os.path.join(claims.eval_dir(row), "lambada-full.json")) for row in SEED_ROWS_LAMBADA]
    if all(s is not None and len(s["examples"]) >= n for s in seeds):
        spread = abs(paired_accuracy_difference(*([e["greedy"] for e in s["examples"][:n]] for s in seeds))[0])
        worst = 0.0 - min(paired_accuracy_difference(correct["retained"], correct[r])[0] for r in READINGS
                          if r != "retained")  # 0.0 −: no "-0.0" where retention loses nothing
        verdict = "within" if worst <= spread else "beyond"
        lines += ["", f"Seed spread on the same examples: |seed 1 − seed 3| = {spread:.1f} points. Retention's "
                  f"largest loss against the others is {worst:.1f} points: **{verdict} the seed spread** (the issue "
                  "asks that it not get worse by more)."]
    return lines + [""]


def perplexity_lines() -> list[str]:
    """The report's WikiText-2 section: each reading's perplexity on the windows all have, and retention's
    difference from the others with paired 95% intervals, beside the seed spread on the same windows."""
    scored = {reading: read_ppl(reading) for reading in READINGS}
    lines = ["## WikiText-2 with retention on", ""]
    if any(v is None for v in scored.values()):
        return lines + ["Not run yet: `python experiments/retention.py perplexity`.", ""]
    claims = claims_module()
    n = min(len(v["nll"]) for v in scored.values())
    cut = {r: {key: v[key][:n] for key in ("article", "nll", "tokens")} for r, v in scored.items()}
    lines += [f"The first {n} of the claims rows' {PPL_WINDOWS} windows ({len(set(cut['retained']['article']))} "
              f"articles), the final recipe read three ways; Δ: log-perplexity of the reading with retention minus "
              "the other's, 95% paired bootstrap interval over articles (`experiments/claims.py`'s).", "",
              "| reading | ppl | retained minus this: Δ log-ppl [95%] |", "|---|---|---|"]
    for reading, (label, _, _) in READINGS.items():
        ppl = math.exp(sum(cut[reading]["nll"]) / sum(cut[reading]["tokens"]))
        delta = "—" if reading == "retained" else "{:+.4f} [{:+.4f}, {:+.4f}]".format(
            *stats.paired_bootstrap(cut["retained"], cut[reading]))
        lines.append(f"| {label} | {ppl:.2f} | {delta} |")
    seeds = [claims.per_window(row) for row in SEED_ROWS]
    if all(s is not None and len(s["nll"]) >= n for s in seeds):
        a, b = ({key: s[key][:n] for key in ("article", "nll", "tokens")} for s in seeds)
        spread = abs(stats.paired_bootstrap(a, b)[0])
        worst = max(stats.paired_bootstrap(cut["retained"], cut[r])[0] for r in READINGS if r != "retained")
        verdict = "within" if worst <= spread else "beyond"
        lines += ["", f"Seed spread on the same windows: |seed 1 − seed 2| = {spread:.4f} in log-perplexity. "
                  f"Retention's largest loss against the others is {worst:+.4f}: **{verdict} the seed spread** "
                  "(the issue asks that it not get worse by more)."]
    return lines + [""]


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Measured:
    accuracy: float
    samples: int

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.accuracy, self.samples)

    def text(self) -> str:
        low, high = self.interval
        hits = self.accuracy * self.samples
        count = f"{round(hits)}/{self.samples}" if abs(hits - round(hits)) < 1e-9 else f"n = {self.samples}"
        return f"{self.accuracy:.2f} ({count}) [{low:.2f}, {high:.2f}]"


def read_cell(cell: Cell):
    """The cell's Measured, None if its file does not exist or is partial (`run` goes on with it), or a
    string saying why its file is not the cell's (other settings or another model)."""
    if not os.path.exists(cell.path):
        return None
    with open(cell.path) as f:
        data = json.load(f)
    if data.get("complete") is False:  # written after every sample; a file from before that marking is whole
        return None
    settings = data.get("settings", {})
    wrong = [f"{key} {settings.get(key)!r} (the grid: {value!r})" for key, value in cell.expected_settings().items()
             if settings.get(key) != value]
    model = VARIANTS[cell.variant][1]
    if os.path.normpath(str(data.get("model", ""))).split(os.sep)[-1] != model.split("/")[-1]:
        wrong.append(f"model {data.get('model')!r} (the grid: {model!r})")
    results = data.get("results", [])
    if len(results) != 1:
        wrong.append(f"{len(results)} results (one expected)")
    elif results[0].get("samples") != cell.samples:
        wrong.append(f"{results[0].get('samples')} samples scored (the grid: {cell.samples})")
    if cell.haystack and os.path.basename(str(settings.get("haystack"))) != \
            os.path.basename(haystack_files()[cell.haystack]):
        wrong.append(f"haystack {settings.get('haystack')!r} (the grid: {haystack_files()[cell.haystack]!r})")
    if wrong:
        return "not the grid's settings: " + "; ".join(wrong)
    return Measured(float(results[0]["accuracy"]), int(results[0]["samples"]))


def sample_scores(cell: Cell) -> list[bool] | None:
    """Whether each of the cell's samples was answered, in prompt order; None unless the cell is measured."""
    if not isinstance(read_cell(cell), Measured):
        return None
    with open(cell.path) as f:
        return [s.get("score", 0) > 0 for s in json.load(f).get("samples", [])]


def paired_samples_text(name: str, a: Cell, other: str, b: Cell) -> str | None:
    """"A against B on the same prompts: n right in A only, m in B only, McNemar's exact p" (None unless both ran)."""
    first, second = sample_scores(a), sample_scores(b)
    if first is None or second is None or len(first) != len(second):
        return None
    only_a = sum(x and not y for x, y in zip(first, second))
    only_b = sum(y and not x for x, y in zip(first, second))
    p = stats.mcnemar_exact(only_a, only_b)
    p_text = "p < 0.001" if p < 0.001 else f"p = {p:.3f}" if p < 0.01 else f"p = {p:.2f}"
    return (f"{name} against {other} on the same {len(first)} prompts: {only_a} answered by the first only, "
            f"{only_b} by the second only; McNemar's exact {p_text}"
            + (" (not shown to differ)" if p >= 0.05 else ""))


def correct_depths(cell: Cell) -> list[float]:
    """Needle depths (0: start of the haystack, 1: its end) of the cell's samples that scored above 0."""
    if not isinstance(read_cell(cell), Measured):
        return []
    with open(cell.path) as f:
        return sorted(s["depth"] for s in json.load(f).get("samples", []) if s.get("score", 0) > 0)


def cell_text(measured) -> str:
    if measured is None:
        return "not run"
    return measured.text() if isinstance(measured, Measured) else measured


def better_score(recall, key_norm) -> str:
    """Which score retained better, decided only when the two 95% intervals do not overlap."""
    if not (isinstance(recall, Measured) and isinstance(key_norm, Measured)):
        return "not both run"
    (r_low, r_high), (k_low, k_high) = recall.interval, key_norm.interval
    if r_low > k_high:
        return "recall"
    if k_low > r_high:
        return "key_norm"
    return "undecided (intervals overlap)"


def claim_verdict(retention, window_only) -> tuple[str, list[str]]:
    """(verdict, reasons) of the issue's claim: retention by recall ≥ 0.8 where window-only scores 0."""
    missing = [name for name, m in (("retention", retention), ("window-only", window_only))
               if not isinstance(m, Measured)]
    if missing:
        return "undecided (not run)", [f"{name} cell not run" for name in missing]
    reasons = []
    if retention.accuracy < CLAIM_ACCURACY:
        reasons.append(f"retention scores {retention.accuracy:.2f} < {CLAIM_ACCURACY}")
    if window_only.accuracy > 0:
        reasons.append(f"window-only scores {window_only.accuracy:.2f} > 0")
    return ("does not hold" if reasons else "holds"), reasons


def report_text() -> str:
    measured = {cell: read_cell(cell) for cell in grid()}
    by_name = {cell.name: m for cell, m in measured.items()}
    written = sum(isinstance(m, Measured) for m in measured.values())
    lines = ["# Retained tokens on S-NIAH at a fixed cache budget", "",
             "Made by `python experiments/retention.py report` from the cells in `results/retention/` (the grid and "
             "the commands are in its docstring; `python experiments/retention.py run` runs the missing ones). "
             f"Each cell: `linjax eval ruler`, {SAMPLES} samples, seed {SEED}, greedy, scored by string match. "
             f"The trained model is `{TRAINED_RUN}` (the final recipe, no further training), read at each budget "
             f"(the trained-with-retention column: `{RETAIN_TRAINED_RUN}`); "
             f"the baselines are `{ORIGINAL}`. {written} of {len(measured)} cells written. Every cell reads the "
             f"prompts of seed {SEED}, the prompts the scores were tried and inspected on (results/retention-log.md): "
             "the cells are not out of sample. S-NIAH-2 and -3 build their haystacks from the Paul Graham essays "
             "(`ruler/gkamradt_PaulGrahamEssays`), which every claims row, the trained models here included, "
             "trains on.", "",
             "A cell: accuracy (correct / samples) [95% Wilson interval].", ""]
    variants = list(GRID_VARIANTS)
    for budget, retained in RETAINED.items():
        lines += [f"## Total cache budget {budget} tokens per layer and kv head", "",
                  f"With retention: sinks {SINKS} + window {WINDOW} + {retained} retained. Without: sinks {SINKS} + "
                  f"window {budget - SINKS}. The original model keeps every token.", "",
                  "| task | length | " + " | ".join(VARIANTS[v][0] for v in variants) + " |",
                  "|---|---|" + "---|" * len(variants)]
        for task, ruler_task in TASKS.items():
            for length in LENGTHS:
                row = [cell_text(by_name[Cell(v, None if v == "original" else budget, task, length).name])
                       for v in variants]
                lines.append(f"| {ruler_task} | {length:,} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## Which score retains better", "",
              "Recall (LoLA's self-recall error) against key norm, where both cells ran: decided only when "
              "their 95% intervals do not overlap.", "",
              "| budget | task | length | recall | key_norm | better |", "|---|---|---|---|---|---|"]
    compared = [(budget, ruler_task, length, by_name[Cell("final-recall", budget, task, length).name],
                 by_name[Cell("final-keynorm", budget, task, length).name])
                for budget in RETAINED for task, ruler_task in TASKS.items() for length in LENGTHS]
    compared = [row for row in compared if isinstance(row[3], Measured) and isinstance(row[4], Measured)]
    lines += [f"| {budget} | {ruler_task} | {length:,} | {recall.text()} | {key_norm.text()} | "
              f"{better_score(recall, key_norm)} |" for budget, ruler_task, length, recall, key_norm in compared]
    if not compared:
        lines.append("| — | — | — | — | — | no cell ran with both scores yet |")
    cells = claim_cells()
    retention, key_norm, window_only, blocks, trained = (
        read_cell(cells[k]) for k in ("retention", "key_norm", "window-only", "blocks", "trained"))
    verdict, reasons = claim_verdict(retention, window_only)
    trained_verdict, trained_reasons = claim_verdict(trained, window_only)
    lines += ["", "## The claim", "",
              f"Issue 37: \"S-NIAH-1 at {CLAIM_LENGTH:,} tokens with a {CLAIM_BUDGET}-token total cache ≥ "
              f"{CLAIM_ACCURACY} for the final recipe with retention, where window-only at the same budget scores 0\". "
              "Judged on the default score (recall), by the measured accuracies as the issue states them.", "",
              f"- retention by recall (sinks {SINKS} + window {WINDOW} + {RETAINED[CLAIM_BUDGET]}): "
              f"{cell_text(retention)}",
              f"- retention by key norm (not the default; for comparison): {cell_text(key_norm)}",
              f"- retention by recall chosen {BLOCKS['final-recall-block8']} at a time (`retain_block`; the form "
              f"that trains and prefills by blocks): {cell_text(blocks)}",
              f"- the final recipe trained with retention on (`{RETAIN_TRAINED_RUN}`, 64 retained chosen "
              f"{BLOCKS['trained-recall-block8']} at a time), read as trained: {cell_text(trained)}",
              f"- window-only (sinks {SINKS} + window {CLAIM_BUDGET - SINKS}): {cell_text(window_only)}",
              f"- training-free: **{verdict}**" + (f": {'; '.join(reasons)}" if reasons else ""),
              f"- trained with retention: **{trained_verdict}**"
              + (f": {'; '.join(trained_reasons)}" if trained_reasons else "")]
    threshold = [(name, m) for name, m in (("training-free", retention), ("trained", trained))
                 if isinstance(m, Measured)]
    if threshold:
        lines.append(f"- the accuracy half alone (≥ {CLAIM_ACCURACY} with retention): " + "; ".join(
            f"{name} {m.accuracy:.2f}, {'reached' if m.accuracy >= CLAIM_ACCURACY else 'not reached'}"
            for name, m in threshold))
    for other, other_name in (("blocks", "training-free in blocks of 8"),
                              ("retention", "training-free token by token")):
        paired = paired_samples_text("trained (blocks of 8)", cells["trained"], other_name, cells[other])
        if paired:
            lines.append(f"- {paired}")
    depths = correct_depths(cells["window-only"])
    if depths:
        lines.append("- window-only's correct samples have their needle at depth "
                     + ", ".join(f"{d:.2f}" for d in depths)
                     + " (depth 1.00: the end of the haystack, just before the question)")
    if isinstance(retention, Measured) and isinstance(window_only, Measured):
        beats = retention.interval[0] > window_only.interval[1]
        lines.append(f"- weaker, not the issue's claim: retention by recall beats window-only with non-overlapping "
                     f"95% intervals: **{'holds' if beats else 'undecided (intervals overlap)'}**")
    lines += [""] + fresh_lines() + prose_lines() + perplexity_lines() + lambada_lines()
    return "\n".join(lines).rstrip("\n") + "\n"


def fresh_lines() -> list[str]:
    """The report's fresh-prompt section: the headline cells on prompts never used in development, each with
    its Wilson interval, whether it reaches the claim's 0.8 with its whole interval, trained against
    training-free and each against window-only, prompt by prompt."""
    lines = ["## The headline cells on fresh prompts", "",
             f"S-NIAH-1, {FRESH_SAMPLES} prompts of seed {FRESH_SEED} per cell (the grid's are seed {SEED}'s, "
             "those the scores were tried on), retention in blocks of 8 (`python experiments/retention.py run "
             "--fresh`). A cell: accuracy (correct / samples) [95% Wilson interval].", "",
             "| budget | length | " + " | ".join(VARIANTS[v][0] for v in FRESH_VARIANTS)
             + " | trained against training-free, same prompts |", "|---|---|" + "---|" * len(FRESH_VARIANTS) + "---|"]
    ran = 0
    for length in FRESH_LENGTHS:
        for budget in RETAINED:
            cells = {v: Cell(v, budget, "niah1", length, FRESH_SEED, FRESH_SAMPLES) for v in FRESH_VARIANTS}
            measured = {v: read_cell(c) for v, c in cells.items()}
            ran += sum(isinstance(m, Measured) for m in measured.values())
            paired = paired_samples_text("trained", cells["trained-recall-block8"], "training-free",
                                         cells["final-recall-block8"]) or "—"
            lines.append(f"| {budget} | {length:,} | " + " | ".join(cell_text(measured[v]) for v in FRESH_VARIANTS)
                         + f" | {paired.split(': ', 1)[-1]} |")
    if not ran:
        return lines + ["", "Not run yet: `python experiments/retention.py run --fresh`.", ""]
    claim = {v: read_cell(Cell(v, CLAIM_BUDGET, CLAIM_TASK, CLAIM_LENGTH, FRESH_SEED, FRESH_SAMPLES))
             for v in FRESH_VARIANTS}
    lines.append("")
    for variant, label in (("final-recall-block8", "training-free"), ("trained-recall-block8", "trained")):
        m = claim[variant]
        if isinstance(m, Measured):
            low, high = m.interval
            verdict = ("holds (the whole interval at or above it)" if low >= CLAIM_ACCURACY else
                       "does not hold (the whole interval below it)" if high < CLAIM_ACCURACY else
                       "undecided (the interval spans it)")
            lines.append(f"- {label}, S-NIAH-1 at {CLAIM_LENGTH:,} tokens with a {CLAIM_BUDGET}-token cache, "
                         f"{m.text()}, against {CLAIM_ACCURACY}: **{verdict}**")
    for length in FRESH_LENGTHS:  # retention against no retention at the same total budget
        for budget in RETAINED:
            window = Cell("window-only", budget, "niah1", length, FRESH_SEED, FRESH_SAMPLES)
            for variant in ("final-recall-block8", "trained-recall-block8"):
                paired = paired_samples_text(VARIANTS[variant][0],
                                             Cell(variant, budget, "niah1", length, FRESH_SEED, FRESH_SAMPLES),
                                             "window-only", window)
                if paired:
                    lines.append(f"- {budget} tokens, {length:,}: {paired}")
    return lines + [""]


def prose_lines() -> list[str]:
    """The report's natural-text section: S-NIAH-2 with WikiText-2 as the haystack, each cell with its Wilson
    interval, and each retention score against window-only on the same prompts."""
    lines = ["## S-NIAH-2 in a haystack that is not training text", "",
             f"The needle in WikiText-2's test articles instead of the Paul Graham essays the trained rows train on; "
             f"{PROSE_SAMPLES} prompts of seed {FRESH_SEED} per cell, total cache {PROSE_BUDGET} tokens per layer and "
             "kv head (with retention: sinks 8 + window 56 + 64 retained, chosen 8 at a time; window-only: sinks 8 + "
             "window 120); the original model keeps every token (`python experiments/retention.py run --prose`). "
             "A cell: accuracy (correct / samples) [95% Wilson interval].", "",
             "| length | " + " | ".join(VARIANTS[v][0] for v in PROSE_VARIANTS) + " |",
             "|---|" + "---|" * len(PROSE_VARIANTS)]
    cells = {(c.variant, c.length): c for c in prose_grid()}
    measured = {key: read_cell(c) for key, c in cells.items()}
    for length in PROSE_LENGTHS:
        lines.append(f"| {length:,} | " + " | ".join(cell_text(measured[v, length]) for v in PROSE_VARIANTS) + " |")
    if not any(isinstance(m, Measured) for m in measured.values()):
        return lines + ["", "Not run yet: `python experiments/retention.py run --prose`.", ""]
    lines.append("")
    for length in PROSE_LENGTHS:
        for variant in PROSE_VARIANTS:
            if variant in ("original", "window-only"):
                continue
            paired = paired_samples_text(VARIANTS[variant][0], cells[variant, length], "window-only",
                                         cells["window-only", length])
            if paired:
                lines.append(f"- {length:,} tokens: {paired}")
    return lines + [""]


def report() -> str:
    path = write_text(REPORT, report_text())
    print(f"wrote {os.path.relpath(path, ROOT)}")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", help="run the missing cells, one `linjax eval ruler` call each")
    runner.add_argument("--only", help="a shell pattern on cell names, e.g. 'final-recall-128-*' or '*-niah1-2048'")
    runner.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    which = runner.add_mutually_exclusive_group()
    which.add_argument("--fresh", action="store_true", help=f"the headline cells on fresh prompts (seed "
                       f"{FRESH_SEED}, {FRESH_SAMPLES} each) instead of the grid")
    which.add_argument("--prose", action="store_true", help="S-NIAH-2 with WikiText-2's test articles as the "
                       "haystack (not training text) instead of the grid")
    scorer = sub.add_parser("perplexity", help="WikiText-2 with retention on and off, resumable")
    scorer.add_argument("--windows", type=int, default=PPL_WINDOWS, help=f"windows to score (default {PPL_WINDOWS})")
    lambada_parser = sub.add_parser("lambada", help="LAMBADA with retention on and off, resumable")
    lambada_parser.add_argument("--limit", type=int, default=LAMBADA_EXAMPLES,
                                help=f"the first N examples (default {LAMBADA_EXAMPLES})")
    sub.add_parser("report", help="write results/retention.md from the cells written")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.only, args.dry_run, args.fresh, args.prose)
    elif args.command == "perplexity":
        if args.windows < 1:
            parser.error(f"--windows must be at least 1, got {args.windows}")
        perplexity(args.windows)
    elif args.command == "lambada":
        if args.limit < 1:
            parser.error(f"--limit must be at least 1, got {args.limit}")
        lambada(args.limit)
    else:
        report()


if __name__ == "__main__":
    main()
