"""`linjax run CONFIG.toml`: convert → linearize → train → evaluate → report.md, in one run directory.

Each stage writes `RUN_DIR/stages/<stage>.json` when it finishes, atomically,
with the settings its result depends on (`STAGE_SETTINGS`); a restarted run
skips every stage whose file exists, and the training stage itself resumes from
its last orbax checkpoint. So a run killed at any point and started again redoes
at most the unfinished part of one stage. A restart whose config changes the
settings of a finished stage is refused, naming them: a finished stage is never
redone or deleted behind the user's back (new settings need a new run_dir).
Only the report, which merely summarises the other stages, is rewritten when the
stages it summarises change (e.g. an evaluation added to `eval.run`).

    convert     load the source (cached conversion), record its architecture and size
    train       `linjax.train.run` (linearizes, trains the new parameters, saves)
    perplexity  held-out perplexity of the original, the untrained and the trained model
    approx      per-layer and per-token approximation error of the trained model
    lm_eval     a limited lm-eval run of the exported trained model (local task files)
    ruler       S-NIAH of the trained model at the lengths asked for
    report      report.md with tables and plots from all of the above
"""

from __future__ import annotations

import json
import os
import time

import linjax
from linjax import fingerprint, train
from linjax.app import watchdog
from linjax.eval import approx, lm_eval_bridge, ruler
from linjax.eval.data import data_dir, data_file
from linjax.eval.perplexity import perplexity, token_windows
from linjax.eval.report import write_report
from linjax.experiment import OPERATIONAL, describe_changes, flat_settings, matches, setting_changes
from linjax.files import read_json, write_json, writer_lock
from linjax.train.loop import refuse_overlap_with_inputs, run_history

STAGES = ("convert", "train", "perplexity", "approx", "lm_eval", "ruler", "report")


# The config settings each stage's result depends on (sections, keys or key prefixes, as
# `experiment.matches` reads them). Operational settings (how often training saves, the kernel that
# computes the same function, ...) do not count, except train.steps: a finished training has its length.
_TRAINED = ("model", "linearize", "data", "train")
STAGE_SETTINGS = {"convert": ("model",), "train": _TRAINED,
                  "perplexity": _TRAINED + ("eval.perplexity_",), "approx": _TRAINED + ("eval.approx_",),
                  "lm_eval": _TRAINED + ("eval.lm_eval_", "eval.compare"),
                  "ruler": _TRAINED + ("eval.ruler_", "eval.compare")}


def stage_settings(config, stage: str, wanted=STAGES) -> dict:
    """The flat settings {"train.lr": ...} that `stage`'s result depends on; the report's are those of
    every stage it summarises (`wanted`), and which stages those are."""
    flat = flat_settings(config.to_dict())
    if stage == "report":
        names = tuple(p for s in wanted if s != "report" for p in STAGE_SETTINGS[s])
        return {"stages": [s for s in wanted if s != "report"],
                **{k: v for k, v in flat.items() if matches(k, names) and not _operational(k, OPERATIONAL)}}
    return {k: v for k, v in flat.items() if matches(k, STAGE_SETTINGS[stage]) and not _operational(k, OPERATIONAL)}


def _operational(key: str, operational) -> bool:
    # eval settings are operational for training, not for the stage that evaluates; steps never here
    return key != "train.steps" and not key.startswith("eval.") and matches(key, operational)


def _stage_path(run_dir: str, stage: str) -> str:
    return os.path.join(run_dir, "stages", f"{stage}.json")


def finished_stages(run_dir: str) -> list[str]:
    return [s for s in STAGES if os.path.exists(_stage_path(run_dir, s))]


def _record(run_dir: str, stage: str, result: dict) -> None:
    write_json(_stage_path(run_dir, stage), result)


def _skipped(reason: str) -> dict:
    return {"skipped": reason}


# ----------------------------------------------------------------------------- stages


def _convert(config, run_dir):
    model, tokenizer = linjax.load(config.model.source, dtype=config.model.dtype)
    if tokenizer is None:
        raise ValueError(f"{config.model.source} has no tokenizer; `linjax run` needs one to read text")
    return {"source": config.model.source, "architecture": model.config.architecture,
            "parameters": linjax.parameter_count(model), "layers": model.config.num_hidden_layers,
            "hidden_size": model.config.hidden_size}


def _train(config, run_dir):
    resume = bool(run_history(run_dir))  # a training this run started before (finished: nothing to do)
    train.run(config, resume=resume, load_finished=False)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    speeds = sorted(r["tokens_per_s"] for r in records[1:]) or [records[0]["tokens_per_s"]]
    return {"steps": len(records), "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
            "mean_loss_last_10": sum(r["loss"] for r in records[-10:]) / len(records[-10:]),
            "median_tokens_per_s": speeds[len(speeds) // 2], "resumed": resume}


def _perplexity(config, run_dir):
    ec = config.eval
    path = ec.perplexity_data or data_file("wikitext", "wikitext-2-raw-v1.test.nonblank.raw")
    if path is None or not os.path.exists(path):
        return _skipped("no perplexity data (set eval.perplexity_data, or LINJAX_DATA_DIR)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    base, tokenizer = linjax.load(config.model.source, dtype=config.model.dtype)
    windows = token_windows(tokenizer, text, ec.perplexity_seq_len, ec.perplexity_windows)
    models = {"original": base,
              "linearized, before training": linjax.linearize(base, config.linearize, seed=config.train.seed),
              "linearized, trained": linjax.load(run_dir, dtype=config.model.dtype)[0]}
    rows = {name: perplexity(model, windows, progress=True) for name, model in models.items()}
    return {"data": os.path.abspath(path), "seq_len": ec.perplexity_seq_len, "rows": rows}


def _approx(config, run_dir):
    ec = config.eval
    path = ec.approx_data or data_file("alpaca", "alpaca_data_cleaned_first5k.json")
    if path is None or not os.path.exists(path):
        return _skipped("no approximation-error data (set eval.approx_data, or LINJAX_DATA_DIR)")
    out = os.path.join(run_dir, "approx")
    return approx.run(config.model.source, run_dir, data=path, num_seqs=ec.approx_num_seqs,
                      seq_len=ec.approx_seq_len, out_dir=out)


def _lm_eval(config, run_dir):
    ec = config.eval
    local = ec.lm_eval_data_dir or data_dir()
    if local is None:
        return _skipped("no local benchmark files (set eval.lm_eval_data_dir, or LINJAX_DATA_DIR)")
    models = {"linearized, trained": (run_dir, "lm_eval")}
    if ec.compare:
        models = {"original": (config.model.source, "lm_eval_original"), **models}
    results = {name: lm_eval_bridge.run(spec, tasks=list(ec.lm_eval_tasks), data_dir=local, limit=ec.lm_eval_limit,
                                        out_dir=os.path.join(run_dir, folder))
               for name, (spec, folder) in models.items()}
    return {"limit": ec.lm_eval_limit, "tasks": list(ec.lm_eval_tasks), "models": results}


def _ruler(config, run_dir):
    ec, lin = config.eval, config.linearize
    common = dict(tasks=list(ec.ruler_tasks), lengths=list(ec.ruler_lengths), samples=ec.ruler_samples)
    budgets = list(ec.ruler_budgets) or None
    runs = {"linearized, trained": dict(model_spec=run_dir, budgets=budgets, sinks=lin.sinks, out="ruler.json")}
    if ec.compare:
        runs["original"] = dict(model_spec=config.model.source, out="ruler_original.json")
        if lin.window:  # the same cache budgets, softmax over sinks + window only
            runs["window only"] = dict(model_spec=config.model.source, window_only=True, sinks=lin.sinks,
                                       budgets=budgets or [lin.sinks + lin.window], out="ruler_window_only.json")
    results = {}
    for name, kwargs in runs.items():
        kwargs["out"] = os.path.join(run_dir, kwargs["out"])
        results[name] = ruler.run(**kwargs, **common)
    return {"models": {name: {"results": r["results"], "out": runs[name]["out"]} for name, r in results.items()}}


def _report(config, run_dir):
    path = write_report(config, run_dir, {s: _load_stage(run_dir, s) for s in STAGES[:-1]})
    return {"report": path}


def _load_stage(run_dir, stage):
    path = _stage_path(run_dir, stage)
    if not os.path.exists(path):
        return None
    return read_json(path)


def _check_finished_stages(run_dir: str, wanted: list[str], settings: dict) -> set[str]:
    """The finished stages to skip; a ValueError naming every finished stage whose settings differ
    from the config's now (the report excepted: it is rewritten instead)."""
    done, refused = set(), []
    for stage in wanted:
        finished = _load_stage(run_dir, stage)
        if finished is None:
            continue
        if "settings" not in finished:  # a marker written before stages recorded their settings
            done.add(stage)
            continue
        changes = setting_changes(finished["settings"], settings[stage])
        if not changes:
            done.add(stage)
        elif stage != "report":
            refused.append(f"{stage} ({describe_changes(changes)})")
    if refused:
        raise ValueError(f"{run_dir} has finished stages done with other settings: {'; '.join(refused)}. "
                         "linjax run never redoes or deletes a finished stage: run the new settings in a new "
                         "run_dir (--set run_dir=...), or restore the old ones")
    return done


_RUNNERS = {"convert": _convert, "train": _train, "perplexity": _perplexity, "approx": _approx,
            "lm_eval": _lm_eval, "ruler": _ruler, "report": _report}


def run(config, *, log=print, watchdog_seconds: float | None = watchdog.DEFAULT_SECONDS,
        allow_changed_inputs: bool = False) -> str:
    """Runs (or finishes) every stage of `config` (an ExperimentConfig); returns report.md's path.
    A stage that makes no progress for `watchdog_seconds` ends the process with an error naming
    it (None or 0: never); started again, the run resumes from the last finished stage. One
    process at a time runs the stages of a run directory (`writer_lock`); one whose base model,
    tokenizer or training data changed since the run recorded them is refused unless
    `allow_changed_inputs` (`linjax.fingerprint`)."""
    run_dir = os.path.abspath(config.run_dir)
    refuse_overlap_with_inputs(run_dir, config)  # before anything is written
    with fingerprint.changes_allowed(allow_changed_inputs):
        if _all_done(config, run_dir):  # nothing to write, so no lock: it answers on a read-only file system too
            for stage in _wanted(config):
                log(f"[linjax run] {stage}: already done, skipped")
            return os.path.join(run_dir, "report.md")
        with writer_lock(run_dir, f"the run {run_dir}"):
            return _run_stages(config, run_dir, log, watchdog_seconds)


def _wanted(config) -> list[str]:
    return [s for s in STAGES if s in ("convert", "train", "report") or s in config.eval.run]


def _all_done(config, run_dir: str) -> bool:
    """Whether every stage `config` asks for finished with its settings (read only; a finished stage of
    other settings is refused as `_run_stages` refuses it)."""
    wanted = _wanted(config)
    if not all(os.path.exists(_stage_path(run_dir, s)) for s in wanted):
        return False
    settings = {stage: stage_settings(config, stage, wanted) for stage in wanted}
    if _check_finished_stages(run_dir, wanted, settings) != set(wanted):
        return False
    _check_inputs(config, run_dir, trained=True)
    return True


def _check_inputs(config, run_dir: str, trained: bool) -> None:
    """Finished stages depend on the inputs the run recorded: the same base model and tokenizer must be
    there now, and while training is unfinished, the same data."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return
    recorded = read_json(path).get("inputs")
    if recorded:
        current = {"model": fingerprint.model_fingerprint(config.model.source)}
        if not trained:
            current["data"] = fingerprint.data_manifest(config.data)
        fingerprint.check(recorded, current, run_dir, "going on with its stages")


def _run_stages(config, run_dir: str, log, watchdog_seconds) -> str:
    wanted = _wanted(config)
    settings = {stage: stage_settings(config, stage, wanted) for stage in wanted}
    done = _check_finished_stages(run_dir, wanted, settings)
    _check_inputs(config, run_dir, trained="train" in done)
    os.makedirs(os.path.join(run_dir, "stages"), exist_ok=True)
    for stage in wanted:
        if stage in done:
            log(f"[linjax run] {stage}: already done, skipped")
            continue
        if stage == "report" and os.path.exists(_stage_path(run_dir, stage)):
            log("[linjax run] report: the stages it summarises changed, so it is written again")
        log(f"[linjax run] {stage} ...")
        start = time.perf_counter()
        with watchdog.watch(f"stage '{stage}' of linjax run", watchdog_seconds,
                            hint="Run the same command again to resume from the last finished stage; "
                                 "--watchdog SECONDS sets the limit (0: off)."):
            result = _RUNNERS[stage](config, run_dir)
        result["seconds"] = time.perf_counter() - start
        result["settings"] = settings[stage]
        _record(run_dir, stage, result)
        log(f"[linjax run] {stage}: done in {result['seconds']:.0f}s")
    return os.path.join(run_dir, "report.md")
