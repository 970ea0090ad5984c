"""The claims rows and claims (experiments/claims.toml), where each row's run and evaluations live, and
what has been measured of it.

A row is a configuration, configs/claims/<row>.toml, trained into results/runs/<row>/ and evaluated into
results/runs/<row>/eval/; an untrained row (the original model, the window-only baselines) names the
model argument its evaluations take instead. A row `<base>-seed<N>` is seed N of row <base> (seed 1).
"""

from __future__ import annotations

import json
import math
import os
import statistics

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results")
CONFIGS = os.path.join(ROOT, "configs", "claims")
DATA = os.environ.get("LINJAX_DATA_DIR", os.path.join(os.path.dirname(ROOT), "shared", "data"))
WIKITEXT = os.path.join(DATA, "wikitext", "wikitext-2-raw-v1.test.nonblank.raw")
SEQ_LEN = 1024  # every WikiText-2 evaluation of the claims rows
WHOLE_FILE_WINDOWS = 295  # WikiText-2's test file in SmolLM2's tokens: 294 windows of 1,024 and a shorter last one
LAMBADA_LIMIT = 1000  # the table's LAMBADA columns: the first 1,000 examples; `lambada-full`: all 5,153
NIAH_TASKS, NIAH_LENGTHS, NIAH_SAMPLES = ("niah_single_1", "niah_single_2"), (1024, 2048), 10
TRAINING_DATA = os.path.join(RESULTS, "runs", "training-data.json")
CLAIMS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "claims.toml")


def read_claims_file(path: str = CLAIMS_FILE) -> dict:
    """claims.toml as {"rows", "variants", "untrained", "trained_on", "claims", "levers", "scaling",
    "seed_spread", ...}; a ValueError naming the problem if a claim, lever, variant or list names a row the
    file does not define."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    rows = {row: spec["what"] for row, spec in raw["rows"].items()}
    claims = [(c["claim"], c.get("paper", "—"), c["better"], c["worse"]) for c in raw.get("claims", [])]
    levers = [(lever["lever"], lever["with"], lever["without"]) for lever in raw.get("levers", [])]
    variants = {row: (spec["base"], dict(spec.get("changes", {}))) for row, spec in raw["rows"].items()
                if "base" in spec}
    named = [row for *_, better, worse in claims + levers for row in (better, worse)]
    named += [base for base, _ in variants.values()]
    named += raw.get("scaling", []) + raw.get("seed_spread", []) + raw.get("readme", [])
    unknown = sorted(set(named) - set(rows))
    if unknown:
        raise ValueError(f"{path}: {', '.join(unknown)} named but not defined under [rows]")
    return {"rows": rows, "variants": variants, "claims": claims, "levers": levers,
            "untrained": {row: spec["model"] for row, spec in raw["rows"].items() if "model" in spec},
            "trained_on": {row: spec["trained_on"] for row, spec in raw["rows"].items() if "trained_on" in spec},
            "short": {row: spec.get("short", spec["what"]) for row, spec in raw["rows"].items()},
            "scaling": tuple(raw.get("scaling", ())), "seed_spread": tuple(raw.get("seed_spread", ())),
            "readme": tuple(raw.get("readme", ()))}


_FILE = read_claims_file()
ROWS = _FILE["rows"]  # row -> what it is
VARIANTS = _FILE["variants"]  # row -> (its base row, {"section.key": value}): it changes these settings only
CLAIMS = _FILE["claims"]  # (claim, the paper's figure, better row, worse row)
LEVERS = _FILE["levers"]  # (lever, the row with it, the row without it): the levers toward half the gap
UNTRAINED = _FILE["untrained"]  # row -> the model argument of its evaluations
# Rows trained on a lent GPU before a run's history named its devices (train/loop.py now records them).
TRAINED_ON_GPU_UNRECORDED = _FILE["trained_on"]
SCALING = _FILE["scaling"]  # the scaling curve's rows, fewest tokens first
SEED_SPREAD = _FILE["seed_spread"]  # the configurations whose seeds measure the recipe's seed noise
README_ROWS = _FILE["readme"]  # the configurations of the README's results table
SHORT = _FILE["short"]  # row -> a short description (the README's)


def run_dir(row):
    return os.path.join(RESULTS, "runs", row)


def eval_dir(row):
    return os.path.join(run_dir(row), "eval")


def config_path(row):
    return os.path.join(CONFIGS, f"{row}.toml")


def config_of(row):
    with open(config_path(row), "rb") as f:
        return tomllib.load(f)


def stages(row):
    """The row's training stages, first to last: (row, steps, tokens per step, seed) each; a row whose
    config starts from another row's parameters (train.init_from) has that row's stages first."""
    train = config_of(row)["train"]
    earlier = []
    if train.get("init_from"):
        earlier = stages(os.path.basename(os.path.normpath(train["init_from"])))
    return earlier + [(row, train["steps"], train["seq_len"] * train.get("batch_size", 1), train.get("seed", 1))]


def training_state(row):
    """(steps done, finished?) of a trained row; (None, True) for an untrained one."""
    if row in UNTRAINED:
        return None, True
    metrics = os.path.join(run_dir(row), "metrics.jsonl")
    steps = 0
    if os.path.exists(metrics):
        with open(metrics) as f:
            steps = max((json.loads(line)["step"] for line in f if line.strip()), default=0)
    return steps, os.path.exists(os.path.join(run_dir(row), "linjax.json"))


def planned_steps(row):
    return config_of(row)["train"]["steps"]


def model_argument(row):
    """What `linjax eval` takes for the row: its model name or config (untrained), or its finished run."""
    if row in UNTRAINED:
        return UNTRAINED[row]
    steps, finished = training_state(row)
    if not finished:
        raise SystemExit(f"{row}: training is at step {steps} of {planned_steps(row)}; finish it first with "
                         f"`linjax train configs/claims/{row}.toml --resume`")
    return os.path.relpath(run_dir(row), ROOT)


def training_texts():
    """{data.paths as a tuple: its counts} from results/runs/training-data.json (`claims.py data`); {} before."""
    counted = load_json(TRAINING_DATA) or []
    return {tuple(counts["paths"]): counts for counts in (counted if isinstance(counted, list) else [counted])}


def text_of(row, texts):
    """The counts of the text `row` trains on (None where it is not counted)."""
    return texts.get(tuple(config_of(row)["data"]["paths"])) if texts else None


def load_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def metrics_of(row):
    """The numbers a row's table line and the claims need (None where not evaluated)."""
    from linjax.eval.lambada import summary as lambada_summary

    out = eval_dir(row)
    m = {}
    ppl = load_json(os.path.join(out, "wikitext2.json"))
    m["ppl"] = ppl["results"][0]["perplexity"] if ppl else None
    whole = load_json(os.path.join(out, "wikitext2-full.json"))
    m["ppl_whole_file"] = whole["results"][0]["perplexity"] if whole else None
    short = load_json(os.path.join(out, "wikitext2-512.json"))
    m["ppl_512"] = short["results"][0]["perplexity"] if short else None
    lam = load_json(os.path.join(out, "lambada", "lm_eval_results.json"))
    lam = lam and lam["results"].get("lambada_openai")
    m["lambada_acc"] = 100 * lam["acc,none"] if lam else None
    m["lambada_ppl"] = lam["perplexity,none"] if lam else None
    m["lambada_acc_stderr"] = 100 * lam["acc_stderr,none"] if lam else None
    full = load_json(os.path.join(out, "lambada-full.json"))
    full = full if full and full.get("complete") else None
    m["lambada_full_acc"] = 100 * full["acc"] if full else None
    m["lambada_full_ppl"] = full["perplexity"] if full else None
    m["lambada_examples"] = full["examples"] if full else None
    if lam is None and full:  # the first 1,000 of the JAX scorer's examples: the same figures as lm-eval's
        first = lambada_summary(full["examples"][:LAMBADA_LIMIT])
        m["lambada_acc"], m["lambada_ppl"] = 100 * first["acc"], first["perplexity"]
        m["lambada_acc_stderr"] = 100 * first["acc_stderr"]
    niah = load_json(os.path.join(out, "niah.json"))
    for r in (niah or {}).get("results", []):
        m[f"{r['task']}@{r['length']}"] = 100 * r["accuracy"]
    approx = load_json(os.path.join(out, "approx", "approx.json"))
    if approx:
        per_token = [statistics.fmean(layer[t] for layer in approx["per_layer_token_nmse"])
                     for t in range(approx["seq_len"])]
        m["nmse"] = statistics.fmean(r["nmse"] for r in approx["per_layer"])
        m["nmse_first8"] = statistics.fmean(per_token[1:9])  # token 0 is exact for every mechanism
        m["nmse_after64"] = statistics.fmean(per_token[64:])
    metrics = os.path.join(run_dir(row), "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            losses = [json.loads(line)["loss"] for line in f if line.strip()]
        m["loss_last100"] = statistics.fmean(losses[-100:]) if losses else None
    validation = load_json(os.path.join(run_dir(row), "validation.json"))
    m["kept_step"] = validation["best"]["step"] if validation and validation.get("best") else None
    return m


def per_window(row, evaluation="wikitext2-full"):
    """The row's per-window WikiText-2 results ({'article', 'nll', 'tokens', ...}), or None: the whole
    file's by default, or another evaluation's (`wikitext2-512`)."""
    loaded = load_json(os.path.join(eval_dir(row), f"{evaluation}.windows.json"))
    return loaded and loaded["results"][0]


def common_windows(*rows):
    """The rows' per-window results cut to the windows all have scored (evaluate-paired scores rows
    window by window in turn, so a run stopped early leaves them the same first windows)."""
    n = min(len(r["nll"]) for r in rows)
    return tuple({key: r[key][:n] for key in ("article", "nll", "tokens")} for r in rows)


def seed_groups():
    """base row -> [the base row (seed 1), its -seedN rows], for every row that has seeds in ROWS."""
    groups = {}
    for row in ROWS:
        base, _, seed = row.rpartition("-seed")
        if base in ROWS and seed.isdigit():
            groups.setdefault(base, [base]).append(row)
    return groups


def seed_label(row):
    base, _, seed = row.rpartition("-seed")
    return seed if base in ROWS and seed.isdigit() else "1"


def whole_file_log_ppl(row):
    """The row's log-perplexity on the whole WikiText-2 test file, or None if not scored."""
    whole = load_json(os.path.join(eval_dir(row), "wikitext2-full.json"))
    return math.log(whole["results"][0]["perplexity"]) if whole else None
