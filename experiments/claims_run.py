"""Running the claims rows: training each stage (resuming), then the evaluations, as subprocesses of the
installed `linjax` command; the whole-file WikiText-2 of several rows window by window in turn."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import subprocess
import sys

from experiments import claims_data as data

RUN_EVALUATIONS = "perplexity,perplexity-full,lambada-full,niah,approx"  # what `run` evaluates unless told
RUN_LOGS = os.path.join(data.ROOT, "runs", "claims-logs")  # /runs/ is the checkout's ignored output folder


def linjax_command():
    return os.path.join(os.path.dirname(sys.executable), "linjax")  # the installed command beside this Python


def evaluations(row, model):
    """name -> (output path whose existence means done, command)."""
    out = data.eval_dir(row)
    linjax = [linjax_command(), "eval"]
    wikitext = data.WIKITEXT
    return {
        "perplexity": (os.path.join(out, "wikitext2.json"), linjax + [
            "perplexity", model, "--data", wikitext, "--seq-len", "1024", "--max-windows", "64",
            "--out", os.path.join(out, "wikitext2.json")]),
        # the same text as the 64 windows of 1,024, in 128 windows of 512: the training length
        "perplexity-512": (os.path.join(out, "wikitext2-512.json"), linjax + [
            "perplexity", model, "--data", wikitext, "--seq-len", "512", "--max-windows", "128",
            "--out", os.path.join(out, "wikitext2-512.json")]),
        "perplexity-full": (os.path.join(out, "wikitext2-full.json"), linjax + [
            "perplexity", model, "--data", wikitext, "--seq-len", "1024", "--whole-file",
            "--out", os.path.join(out, "wikitext2-full.json")]),
        "lambada": (os.path.join(out, "lambada", "lm_eval_results.json"), linjax + [
            "lm-eval", model, "--tasks", "lambada_openai", "--limit", str(data.LAMBADA_LIMIT), "--data-dir",
            data.DATA, "--out", os.path.join(out, "lambada"), "--resume"]),
        # all 5,153, scored in JAX (eval/lambada.py: lm-eval's figures, example by example, without the export)
        "lambada-full": (os.path.join(out, "lambada-full.json"), linjax + [
            "lambada", model, "--data-dir", data.DATA, "--out", os.path.join(out, "lambada-full.json"), "--resume"]),
        "niah": (os.path.join(out, "niah.json"), linjax + [
            "ruler", model, "--tasks", ",".join(data.NIAH_TASKS), "--lengths", ",".join(map(str, data.NIAH_LENGTHS)),
            "--samples", str(data.NIAH_SAMPLES), "--out", os.path.join(out, "niah.json"), "--resume"]),
        "approx": (os.path.join(out, "approx", "approx.json"), linjax + [
            "approx", "smollm2-135m", model, "--data",
            os.path.join(data.DATA, "alpaca", "alpaca_data_cleaned_first5k.json"),
            "--num-seqs", "8", "--seq-len", "512", "--out", os.path.join(out, "approx")]),
    }


def is_done(name, path):
    """An evaluation counts as done once its output exists; lm-eval's file is written at the start of a
    resumable run too, so LAMBADA is done only when the file lists the task as finished."""
    if name == "lambada":
        return "lambada_openai" in ((data.load_json(path) or {}).get("finished_tasks") or [])
    if name == "lambada-full":  # written after every batch: done once complete
        return bool((data.load_json(path) or {}).get("complete"))
    if name == "niah":  # written after every sample; a file from before that marking is complete
        return os.path.exists(path) and (data.load_json(path) or {}).get("complete", True)
    return os.path.exists(path)


def check_rows(rows):
    unknown = [row for row in rows if row not in data.ROWS]
    if unknown:
        sys.exit(f"unknown row {unknown[0]!r}; choose from {', '.join(data.ROWS)}")


def evaluate(rows, only):
    """Each row's evaluations (those in `only`, or all), skipping any already written."""
    known = evaluations("any", "any")
    if only - set(known):
        sys.exit(f"unknown evaluation {', '.join(sorted(only - set(known)))}; choose from {', '.join(known)}")
    check_rows(rows)
    for row in rows:
        model = data.model_argument(row)
        for name, (done, command) in evaluations(row, model).items():
            if only and name not in only or (name == "approx" and row == "original"):
                continue
            if is_done(name, done):
                print(f"{row}: {name} already in {os.path.relpath(done, data.ROOT)}")
                continue
            os.makedirs(data.eval_dir(row), exist_ok=True)
            print(f"{row}: {name}: linjax {' '.join(command[1:])}", flush=True)
            subprocess.run(command, cwd=data.ROOT, check=True)


def evaluate_paired(rows):
    """The whole-file WikiText-2 evaluation (`perplexity-full`) of several rows in one process, window by
    window in turn, so that stopped at any point they hold scores on the same windows (the paired bootstrap
    compares rows on the windows both have). After every window each row's per-window results are
    written (marked incomplete); a rerun goes on from them; the summary is written once a row is complete."""
    from linjax.eval.models import load_model
    from linjax.eval.perplexity import continues, score_in_turn, summary, text_windows, token_nll_function
    from linjax.files import write_json

    with open(data.WIKITEXT, encoding="utf-8") as f:
        text = f.read()
    settings = {"data": os.path.abspath(data.WIKITEXT), "seq_len": data.SEQ_LEN, "max_windows": None,
                "whole_file": True}
    readings, about = {}, {}
    check_rows(rows)
    for row in rows:
        summary_path = os.path.join(data.eval_dir(row), "wikitext2-full.json")
        if os.path.exists(summary_path):
            print(f"{row}: perplexity-full already in {os.path.relpath(summary_path, data.ROOT)}")
            continue
        model, tokenizer, description = load_model(data.model_argument(row))
        windows, articles = text_windows(tokenizer, text, data.SEQ_LEN, whole_file=True)
        earlier = data.per_window(row) or {"nll": [], "tokens": [], "article": [], "position_nll": [],
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
        write_json(os.path.join(data.eval_dir(row), "wikitext2-full.windows.json"),
                   {**settings, "complete": complete, "results": [results]})
        if complete:
            write_json(os.path.join(data.eval_dir(row), "wikitext2-full.json"),
                       {**settings, "results": [{**summary(scores), "model": about[row]["description"],
                                                 "seconds": about[row]["seconds"]}]})

    if readings:
        score_in_turn(readings, save, progress=True)


def call(command, log):
    """One step of `run`: the command's exit status, its output appended to the open file `log`."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    return subprocess.run(command, cwd=data.ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def run_chain(rows, only, settings, log_dir):
    """The rows of one chain in order (they share their first stage): each unfinished stage trained with
    `linjax train --resume`, then the row evaluated. {row: None (done) or what failed}; a failure ends the
    chain, since its later rows start from its stages."""
    outcome = {}
    for position, row in enumerate(rows):
        with open(os.path.join(log_dir, f"{row}.log"), "a", encoding="utf-8") as log:
            steps = [] if row in data.UNTRAINED else [stage for stage, *_ in data.stages(row)]
            for stage in steps:
                if data.training_state(stage)[1]:
                    continue
                command = [linjax_command(), "train", os.path.relpath(data.config_path(stage), data.ROOT),
                           "--resume", "--no-progress"] + [part for item in settings for part in ("--set", item)]
                status = call(command, log)
                if status:
                    outcome[row] = f"training {stage} exited with {status}"
                    break
            else:  # `--only ""`: train only (a lent GPU trains; this machine evaluates, as every other row)
                command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "claims.py"),
                           "evaluate", row, "--only", only]
                status = only and call(command, log)
                outcome[row] = f"evaluation exited with {status}" if status else None
        if outcome[row]:
            outcome.update({later: f"not run: {row} failed" for later in rows[position + 1:]})
            break
    return outcome


def run_rows(rows, only, jobs, settings, log_dir=RUN_LOGS):
    """`run`: train and evaluate `rows`, `jobs` chains at a time. Rows that share a first stage (a
    two-stage row and its first stage, say) form one chain, run in the order given. Returns the number
    of rows that failed; each row's output goes to LOG_DIR/ROW.log, appended."""
    check_rows(rows)
    known = evaluations("any", "any")
    if set(filter(None, only.split(","))) - set(known):
        sys.exit(f"unknown evaluation in --only {only!r}; choose from {', '.join(known)}")
    if jobs < 1:
        sys.exit(f"--jobs must be 1 or more; got {jobs}")
    chains = {}
    for row in dict.fromkeys(rows):
        chains.setdefault(row if row in data.UNTRAINED else data.stages(row)[0][0], []).append(row)
    os.makedirs(log_dir, exist_ok=True)
    if jobs > 1:  # several JAX processes on one GPU each take memory as they need it, not 75% at the start
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        running = [pool.submit(run_chain, chain, only, settings, log_dir) for chain in chains.values()]
        for done in concurrent.futures.as_completed(running):
            for row, problem in done.result().items():
                failed += problem is not None
                print(f"{row}: {problem or ('trained and evaluated' if only else 'trained')} "
                      f"(log: {os.path.relpath(os.path.join(log_dir, row + '.log'), data.ROOT)})", flush=True)
    return failed


def count_training_data():
    """results/runs/training-data.json: each training text the claims rows read (their distinct
    data.paths) as the data loader reads it: documents, distinct documents, tokens per epoch (each
    document and its EOS) and the tokens of the distinct documents."""
    import linjax
    from linjax.files import write_text
    from linjax.train.data import read_documents

    _, tokenizer = linjax.load("smollm2-135m")
    texts = []
    for paths in dict.fromkeys(tuple(data.config_of(row)["data"]["paths"]) for row in data.ROWS
                               if row not in data.UNTRAINED):
        documents = read_documents([os.path.join(data.ROOT, p) for p in paths])
        copies = collections.Counter(documents)
        tokens = {d: len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in copies}
        texts.append({"paths": list(paths), "documents": len(documents), "distinct_documents": len(copies),
                      "tokens_per_epoch": sum(tokens[d] for d in documents), "unique_tokens": sum(tokens.values())})
    path = write_text(data.TRAINING_DATA, json.dumps(texts, indent=2) + "\n")
    print(f"wrote {os.path.relpath(path, data.ROOT)}: {texts}")


def status():
    for row in data.ROWS:
        steps, finished = data.training_state(row)
        done = [name for name, (path, _) in evaluations(row, "MODEL").items() if is_done(name, path)]
        state = ("untrained" if steps is None else f"finished ({steps} steps)" if finished
                 else f"step {steps} of {data.planned_steps(row)}")
        print(f"{row:30s} {state:22s} evaluated: {', '.join(done) or 'nothing'}")
