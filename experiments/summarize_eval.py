"""Builds results/lm-eval-smollm2.md and results/ruler-smollm2.md from the evaluation JSONs in results/.

    python experiments/summarize_eval.py

Inputs (each written by a `linjax eval` command, see the tables' captions):
    lm-eval-smollm2-full/, -full-lambada/, -full-arc-easy/, -full-hellaswag/  the original model, every example
    lm-eval-smollm2-full-mmlu/, -mmlu-2/  the same, MMLU as its 57 subjects (two processes, one per core),
                                          aggregated as lm-eval aggregates its group (weighted mean, pooled stderr)
    lm-eval-smollm2-limit200/, lm-eval-smollm2-mmlu-limit5/                    original, subsets
    lm-eval-smollm2-gdn-w56-s8-shortconv-limit200/, ...-mmlu-limit5/          linearized + trained, same subsets
    ruler-smollm2/{full-attention,window-only,gdn-w56-s8-shortconv}*.json
A missing input leaves its cells as "not run".
"""

import json
import os

from linjax.files import write_text

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")  # what it reads and writes

# SmolLM2-135M-Instruct's model card (lighteval, zero-shot; its own prompts, and MMLU as a cloze
# task, so not the same protocol as lm-eval's 5-shot multiple choice).
MODEL_CARD = {"hellaswag": "40.9", "piqa": "66.3", "arc_easy": "37.3 (ARC average of Easy and Challenge)",
              "mmlu": "29.3 (MMLU cloze)", "lambada_openai": "—"}
# An lm-eval 0-shot run of SmolLM2-135M-Instruct published by a third party
# (https://huggingface.co/lldois/SmolLM2-135M-Reasoning-SLERP-Champion, "Baseline" column).
THIRD_PARTY_LM_EVAL = {("arc_easy", "acc"): "54.12", ("hellaswag", "acc_norm"): "42.99",
                       ("piqa", "acc_norm"): "66.92"}
TASKS = ("piqa", "arc_easy", "hellaswag", "lambada_openai", "mmlu")
METRICS = {"piqa": ("acc", "acc_norm"), "arc_easy": ("acc", "acc_norm"), "hellaswag": ("acc", "acc_norm"),
           "lambada_openai": ("acc", "perplexity"), "mmlu": ("acc",)}


def _load(*parts):
    path = os.path.join(HERE, *parts)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _value(summary, task, metric, percent=True):
    if not summary or task not in (summary.get("results") or {}):
        return None
    value = summary["results"][task].get(f"{metric},none")
    if value is None:
        return None
    return 100 * value if percent and metric != "perplexity" else value


def _fmt(value, stderr=None):
    if value is None:
        return "not run"
    return f"{value:.2f}" + (f" ± {stderr:.2f}" if stderr is not None else "")


def _merged(*summaries):
    """One summary with the results of several lm-eval output folders (e.g. four tasks + MMLU)."""
    merged = {"results": {}, "n-samples": {}, "seconds_per_task": {}}
    for s in summaries:
        if s:
            for key in merged:
                merged[key].update(s.get(key) or {})
    return merged if merged["results"] else None


def _mmlu_categories() -> dict:
    """{subject task: category} from the shipped task files' tags (linjax_mmlu_<category>_tasks)."""
    folder = os.path.join(HERE, "..", "eval", "lm_eval_tasks")
    categories = {}
    for name in os.listdir(folder):
        if name.startswith("linjax_mmlu_") and name.endswith(".yaml"):
            with open(os.path.join(folder, name)) as f:
                tag = next((line.split(":", 1)[1].strip() for line in f if line.startswith("tag:")), None)
            if tag:
                categories[name[len("linjax_"):-len(".yaml")]] = tag[len("linjax_mmlu_"):-len("_tasks")]
    return categories


def with_mmlu_aggregate(summary):
    """Adds mmlu (and mmlu_<category>) to a summary whose MMLU was run subject by subject, the way lm-eval
    aggregates its mmlu group: acc is the mean over questions, its stderr the pooled subject stderrs.
    While subjects are missing, the figure covers those that finished and is marked partial."""
    from lm_eval.api.metrics import aggregate_subtask_metrics, pooled_sample_stderr

    if not summary or "mmlu" in summary["results"]:
        return summary
    categories = _mmlu_categories()
    subjects = [t for t in categories if t in summary["results"]]
    if not subjects:
        return summary
    if len(subjects) != len(categories):
        summary["partial"] = {"mmlu": f"partial: {len(subjects)} of {len(categories)} subjects"}
    for group, members in [("mmlu", subjects)] + [
            (f"mmlu_{c}", [t for t in subjects if categories[t] == c]) for c in sorted(set(categories.values()))]:
        sizes = [summary["n-samples"][t]["effective"] for t in members]
        accs = [summary["results"][t]["acc,none"] for t in members]
        summary["results"][group] = {
            "acc,none": aggregate_subtask_metrics(accs, sizes),
            "acc_stderr,none": pooled_sample_stderr([summary["results"][t]["acc_stderr,none"] for t in members], sizes)}
        summary["n-samples"][group] = {"effective": sum(sizes)}
    timed = [summary["seconds_per_task"].pop(t) for t in subjects if t in summary["seconds_per_task"]]
    if len(timed) == len(subjects):  # (a resumed run with another task list kept no time for the earlier ones)
        summary["seconds_per_task"]["mmlu"] = sum(timed)
    return summary


def lm_eval_table():
    full = with_mmlu_aggregate(_merged(*(_load(f"lm-eval-smollm2-full{part}", "lm_eval_results.json")
                                         for part in ("", "-lambada", "-arc-easy", "-hellaswag", "-mmlu", "-mmlu-2"))))
    lines = ["# lm-eval on SmolLM2-135M-Instruct, from the local data files", "",
             "`linjax eval lm-eval runs/smollm2-hf --tasks TASKS --data-dir ../shared/data --out DIR` (lm-eval "
             "0.4.13, float32, CPU). PIQA, ARC-Easy and LAMBADA were scored by lm-eval's HFLM (batch 16 or 32), "
             "HellaSwag and MMLU by linjax's SharedPrefixHFLM (the same log-likelihoods, each shared context "
             "prefix computed once; MMLU run as its 57 subjects and aggregated as lm-eval aggregates its group). "
             "The model is the embedded GGUF (Q4_1 weights, dequantized), exported to a transformers directory; "
             "MMLU 5-shot, the rest 0-shot. HellaSwag's local file differs slightly from lm-eval's preprocessing "
             "(see the data README), so its acc_norm is close to, not identical with, lm-eval's hub task.", "",
             "## The original model, every example", "",
             "| task | examples | metric | this run (%, ± stderr) | lm-eval 0-shot, third party | model card "
             "(lighteval) |", "|---|---|---|---|---|---|"]
    for task in TASKS:
        n = ((full or {}).get("n-samples") or {}).get(task, {}).get("effective", "—") if full else "—"
        if full and task in full.get("partial", {}):
            n = f"{n} ({full['partial'][task]})"
        for metric in METRICS[task]:
            value = _value(full, task, metric)
            stderr = _value(full, task, metric + "_stderr") if metric != "perplexity" else None
            card = MODEL_CARD.get(task, "—") if metric == METRICS[task][-1] or task == "mmlu" else ""
            lines.append(f"| {task} | {n} | {metric} | {_fmt(value, stderr)} | "
                         f"{THIRD_PARTY_LM_EVAL.get((task, metric), '—')} | {card} |")
    for category in ("stem", "humanities", "social_sciences", "other"):  # lm-eval's MMLU groups
        group = f"mmlu_{category}"
        if full and group in full["results"] and "partial" not in full:
            lines.append(f"| mmlu: {category.replace('_', ' ')} | {full['n-samples'][group]['effective']} | acc | "
                         f"{_fmt(_value(full, group, 'acc'), _value(full, group, 'acc_stderr'))} | — | |")
    if full:
        seconds = full.get("seconds_per_task", {})
        lines += ["", "Time, one process per task on a 2-core CPU (PIQA and LAMBADA shared it with other jobs): " +
                  ", ".join(f"{t} {s / 60:.0f} min" for t, s in seconds.items()) + ". "
                  "HellaSwag was stopped after 15,350 of its 40,168 requests (about 50 min) and finished with "
                  "`--resume`, which reused them from its request cache: its time above is the second part only. "
                  "MMLU took about 2.2 hours of one core (two processes of 57 subjects between them)."]

    original = _merged(_load("lm-eval-smollm2-limit200", "lm_eval_results.json"),
                       _load("lm-eval-smollm2-mmlu-limit5", "lm_eval_results.json"))
    trained = _merged(_load("lm-eval-smollm2-gdn-w56-s8-shortconv-limit200", "lm_eval_results.json"),
                      _load("lm-eval-smollm2-gdn-w56-s8-shortconv-mmlu-limit5", "lm_eval_results.json"))
    lines += ["", "## Original against linearized + trained, same subsets", "",
              "The first 200 examples of each task; for MMLU (5-shot) the first 5 questions of each of the 57 "
              "subjects. "
              "Linearized: GDN + window 56 + sinks 8 + short conv, trained 200 steps × 1,024 tokens "
              "(`configs/smollm2/gdn-w56-s8-shortconv.toml`), exported with `linjax export` and loaded by "
              "transformers with `trust_remote_code` (no JAX).", "",
              "| task | metric | original | linearized, trained |", "|---|---|---|---|"]
    for task in TASKS:
        for metric in METRICS[task]:
            lines.append(f"| {task} | {metric} | {_fmt(_value(original, task, metric))} | "
                         f"{_fmt(_value(trained, task, metric))} |")
    return lines


def ruler_table():
    # Each model's cells may come from several runs (e.g. full-attention.json + full-attention-niah3-4k.json).
    prefixes = {"full attention": "full-attention", "window only": "window-only",
                "GDN + w56 + s8 + SC, trained": "gdn-w56-s8-shortconv"}
    folder = os.path.join(HERE, "ruler-smollm2")
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    runs = [(name, _load("ruler-smollm2", f)) for name, prefix in prefixes.items() for f in files
            if f.startswith(prefix) and f.endswith(".json")]
    rows = [(name, r) for name, run in runs for r in run["results"]]
    # The cache-budget runs may use fewer samples than the full-attention one; every run draws the same
    # samples in the same order, so full attention is also scored on the budget runs' first n samples.
    budget_samples = min((r["samples"] for name, r in rows if name != "full attention"), default=None)
    cell, first_n = {}, {}
    for name, r in rows:
        budget = next((b for b in ("128", "512") if f"budget {b} " in r["variant"]), None)
        cell[(r["task"], r["length"], name, budget)] = (r["accuracy"], r["samples"])
    for name, run in runs:
        if name == "full attention" and budget_samples:
            for task, length in {(d["task"], d["length"]) for d in run["samples"]}:
                scores = [d["score"] for d in run["samples"] if (d["task"], d["length"]) == (task, length)]
                first_n[(task, length)] = (sum(scores[:budget_samples]) / budget_samples, budget_samples)
    full_n = sorted({r["samples"] for name, r in rows if name == "full attention"}) or ["—"]
    lines = ["# S-NIAH on SmolLM2-135M-Instruct: full attention, window only, linearized", "",
             "`linjax eval ruler MODEL --lengths 1024,2048,4096 --samples N [--budgets B [--window-only]]`: "
             "RULER's single-needle tasks, the needle at one of 40 evenly spaced depths, greedy decoding, "
             f"string match. Full attention: {'/'.join(map(str, full_n))} samples per cell; cache budgets: "
             f"{budget_samples or '—'} samples, the first {budget_samples or '—'} of the same sequence (full "
             "attention on those is given too). A cache budget b is 8 sinks + a window of b − 8 tokens. "
             "\"Window only\" is the "
             "original model attending to the sinks and the window alone (no linear state); the linearized model "
             "(GDN + w56 + s8 + short conv, trained 200 steps) was trained at 8 + 56 and is read at each budget with "
             "the same parameters.", "",
             f"| task | length | full attention | full attention, first {budget_samples or '—'} | window only, 128 | "
             "linearized, 128 | window only, 512 | linearized, 512 |", "|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["task"], r["length"]) for _, r in rows})
    for task, length in keys:
        values = [cell.get((task, length, "full attention", None)), first_n.get((task, length))]
        values += [cell.get((task, length, name, budget)) for budget in ("128", "512")
                   for name in ("window only", "GDN + w56 + s8 + SC, trained")]
        lines.append(f"| {task} | {length} | " + " | ".join("not run" if v is None else f"{v[0]:.2f}" for v in values)
                     + " |")
    # Where the hits come from: the needle within the last (budget − sinks) tokens, i.e. still in the window
    # when the question is read, or out of it (only a linear state could then retrieve it). The position is
    # estimated as (1 − depth) × prompt tokens, ignoring the few tokens of the question after the haystack.
    lines += ["", "Hits by the needle's place, all tasks and lengths (position estimated from its depth):", "",
              "| model | budget | needle inside the window | needle outside it |", "|---|---|---|---|"]
    for name, run in runs:
        budgets = run["settings"].get("budgets") or []
        if name == "full attention" or len(budgets) != 1:
            continue
        window = budgets[0] - run["settings"]["sinks"]
        inside = [d["score"] for d in run["samples"] if (1 - d["depth"]) * d["tokens"] < window]
        outside = [d["score"] for d in run["samples"] if (1 - d["depth"]) * d["tokens"] >= window]
        lines.append(f"| {name} | {budgets[0]} | {sum(inside):.0f} / {len(inside)} correct | "
                     f"{sum(outside):.0f} / {len(outside)} correct |")
    return lines


def _write(name, lines):
    write_text(os.path.join(HERE, name), "\n".join(lines) + "\n")
    print("\n".join(lines) + "\n")


def main():
    _write("lm-eval-smollm2.md", lm_eval_table())
    _write("ruler-smollm2.md", ruler_table())


if __name__ == "__main__":
    main()
