"""RULER's synthetic suite, greedy, scored by string match: S-NIAH and the extended tasks the paper reports.

    niah_single_1/2/3                 one needle: noise or essay haystack; a number or a UUID
    multikey, multikey_2, multikey_3  one of several needles asked (RULER's niah_multikey_1/2/3)
    multivalue, multiquery            4 values of one key / 4 keys asked at once
    vt, cwe, fwe                      variable tracking, common and frequent words extraction

The samples are generated here (eval/ruler_tasks.py, which describes each task) so that the whole prompt has
the requested number of tokens by the model's tokenizer (±2%); each task generates RULER's number of new
tokens (24 or 48 for niah_single_*), and a sample scores the fraction of its answers found in the answer,
case-insensitively (RULER's string_match_all).

    linjax eval ruler MODEL --tasks niah_single_1,multikey,vt,cwe --lengths 1024,2048,4096 \\
        --samples N [--budgets 128,256,512 [--window-only | --retain 64 [--retain-score key_norm]]] \\
        [--haystack FILE] --out results.json

MODEL is full attention (one variant), linearized (`--budgets`: re-read at each cache
budget, sinks + window = budget), or full attention with `--window-only --budgets`: the
same budgets with sinks + window softmax alone, the baseline without a linear state.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import linjax
from linjax.eval.models import load_model
from linjax.eval.ruler_tasks import (
    ANSWER_PREFIX,
    DEPTHS,
    NEW_TOKENS,
    NOISE,
    TASKS,
    TEMPLATE,
    Generator,
    Sample,
    default_haystack,
    read_haystack,
    score,
)
from linjax.files import write_json, write_text
from linjax.generate import generate
from linjax.linearize import with_budget

# The generators' names, importable from here too (callers import them from this module).
__all__ = ["ANSWER_PREFIX", "DEPTHS", "NEW_TOKENS", "NOISE", "TASKS", "TEMPLATE", "Generator", "Sample",
           "budget_variants", "default_haystack", "evaluate", "read_haystack", "run", "score"]

PREFILL_CHUNK = 256  # fixed prefill shapes: one compilation serves every prompt of a length (generate.py)


def evaluate(model, tokenizer, samples: list[Sample], progress: bool = True, on_row=None) -> list[dict]:
    """Greedy answers and scores of `samples` (one at a time: prompts differ in length); `on_row(rows)`
    after each, with the rows so far."""
    rows = []
    # One cache size for all samples (prompts are within 2% of each other), so one compilation.
    capacity = max(len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"]) + s.max_new_tokens
                   for s in samples) if samples else 0
    for s in tqdm(samples, desc="RULER", disable=not progress):
        ids = tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
        out = generate(model, jnp.asarray([ids], jnp.int32), s.max_new_tokens, prefill_chunk=PREFILL_CHUNK,
                       cache_length=capacity, eos_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(np.asarray(out[0, len(ids):]).tolist(), skip_special_tokens=True)
        rows.append({"task": s.task, "tokens": len(ids), "depth": s.depth, "answers": list(s.answers),
                     "prediction": answer, "score": score(answer, s.answers)})
        if on_row:
            on_row(rows)
    return rows


def budget_variants(model, budgets, sinks: int, window_only: bool = False, retain: int = 0,
                    retain_score: str = "recall", retain_block: int = 1) -> dict:
    """{label: model} to evaluate: the model itself (no budgets), or one variant per cache budget b
    (sinks + window + retain = b): a linearized model re-read at that budget (`with_budget`; `retain`
    tokens kept for their content, scored by `retain_score`: docs/retention.md), or, with
    `window_only`, the full-attention model restricted to sinks + window softmax with no linear
    term (mechanism "window", the training-free baseline)."""
    linearized = getattr(model, "linearize_config", None) is not None
    if window_only and (linearized or not budgets):
        raise ValueError("--window-only turns a full-attention model into sinks + window attention at each "
                         "--budgets value: give a plain (not linearized) model and --budgets, e.g. 128,512")
    if budgets and not linearized and not window_only:
        raise ValueError("cache budgets apply to a linearized model; for the window-only baseline of a "
                         "full-attention model add --window-only")
    if retain and (window_only or not linearized or not budgets):
        raise ValueError("--retain keeps tokens beside the window of a linearized model's budget: give a "
                         "linearized model and --budgets (each budget = sinks + window + retain)")
    bad = [b for b in budgets or () if b <= sinks + retain]
    if bad:
        raise ValueError(f"budgets {bad} leave no window after {sinks} sinks and {retain} retained tokens; "
                         "each budget must exceed --sinks + --retain")
    if not budgets:
        if not linearized:
            return {"full attention": model}
        lin = model.linearize_config
        return {f"as trained (sinks {lin.sinks}, window {lin.window})" if lin.window else "as trained (no window)":
                model}
    if window_only:
        return {f"window only, budget {b} (sinks {sinks}, window {b - sinks})":
                linjax.linearize(model, linjax.LinearizeConfig(mechanism="window", sinks=sinks, window=b - sinks))
                for b in budgets}
    if retain_block > 1 and not retain:
        raise ValueError("--retain-block chooses retained tokens a block at a time: it needs --retain")
    if retain:
        blocks = f", in blocks of {retain_block}" if retain_block > 1 else ""
        return {f"budget {b} (sinks {sinks}, window {b - sinks - retain}, retained {retain} by {retain_score}{blocks})":
                with_budget(model, sinks=sinks, window=b - sinks - retain, retain=retain, retain_score=retain_score,
                            retain_block=retain_block)
                for b in budgets}
    return {f"budget {b} (sinks {sinks}, window {b - sinks})":
            with_budget(model, sinks=sinks, window=b - sinks, retain=0) for b in budgets}


def run(model_spec: str, *, tasks, lengths, samples: int, out: str, budgets=None, sinks: int = 8,
        window_only: bool = False, haystack: str | None = None, seed: int = 0, progress: bool = True,
        retain: int = 0, retain_score: str = "recall", retain_block: int = 1, resume: bool = False) -> dict:
    """RULER accuracy per task × length (× cache budget); writes `out` (+ .md) after every sample, marked
    `complete` once every cell is. `resume`: go on from the samples `out` holds (the samples are drawn
    from the seed, so the first n of a cell are the ones already scored)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    model, tokenizer, name = load_model(model_spec)
    if tokenizer is None:
        raise ValueError(f"{model_spec} has no tokenizer; RULER needs one")
    generator = Generator(tokenizer, haystack)
    variants = budget_variants(model, budgets, sinks, window_only, retain, retain_score, retain_block)
    settings = {"tasks": list(tasks), "lengths": list(lengths), "samples": samples, "budgets": list(budgets or []),
                "sinks": sinks, "window_only": window_only, "seed": seed, "retain": retain,
                "retain_score": retain_score, **({"retain_block": retain_block} if retain_block > 1 else {}),
                "haystack": os.path.abspath(generator.haystack_path) if generator.haystack_path else None}
    earlier = _earlier_samples(out, name, settings) if resume else []
    results, details = [], []
    for task in tasks:
        for length in lengths:
            rng = np.random.default_rng([seed, TASKS.index(task), length])
            batch = [generator.sample(task, length, rng) for _ in range(samples)]
            for variant, m in variants.items():
                done = [r for r in earlier if (r["task"], r["length"], r["variant"]) == (task, length, variant)]
                done = [{k: v for k, v in r.items() if k not in ("variant", "length")} for r in done]
                # Both are called in this iteration only (by `evaluate` as it goes), so they read its cell.
                cell = lambda rows: [dict(r, variant=variant, length=length) for r in rows]  # noqa: B023
                save = lambda rows: _write(out, name, settings, results, details + cell(done + rows), False)  # noqa: B023
                rows = done + evaluate(m, tokenizer, batch[len(done):], progress, on_row=save)
                accuracy = float(np.mean([r["score"] for r in rows]))
                results.append({"task": task, "length": length, "variant": variant, "accuracy": accuracy,
                                "samples": len(rows)})
                details += cell(rows)
                if progress:
                    print(f"{task} @ {length} [{variant}]: {accuracy:.2f}", flush=True)
                _write(out, name, settings, results, details, False)  # the finished cell in `results`
    return _write(out, name, settings, results, details, True)


def _earlier_samples(out: str, name: str, settings: dict) -> list[dict]:
    """The scored samples a resumed run goes on from: none if `out` does not exist; a ValueError if it
    holds another model's or other settings' results."""
    if not os.path.exists(out):
        return []
    with open(out, encoding="utf-8") as f:
        saved = json.load(f)
    if (saved.get("model"), saved.get("settings")) != (name, settings):
        raise ValueError(f"{out} holds RULER results of another model or other settings "
                         f"({saved.get('model')}, {saved.get('settings')}); --overwrite replaces them")
    return saved.get("samples", [])


def _write(out: str, name: str, settings: dict, results: list, details: list, complete: bool) -> dict:
    """The results JSON and a Markdown table beside it (same name, .md), atomically; `results` holds the
    finished cells, `details` every scored sample."""
    table = ["| task | length | cache | accuracy | samples |", "|---|---|---|---|---|"]
    table += [f"| {r['task']} | {r['length']} | {r['variant']} | {r['accuracy']:.2f} | {r['samples']} |"
              for r in results]
    result = {"model": name, "settings": settings, "complete": complete, "results": results,
              "table_markdown": "\n".join(table), "samples": details}
    write_json(out, result)
    write_text(os.path.splitext(out)[0] + ".md", f"# RULER: {name}\n\n" + result["table_markdown"] + "\n")
    return result
